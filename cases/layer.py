"""A whole decoder layer on one rank, eager vs CUDA-graph replay, decode vs verify.

``layer.decoder`` runs ``layers`` independent copies of one rank's DeepSeek-V3 /
Kimi-K2.5 layer back to back (each with its own weights, so each streams its own from
memory), as one call: the per-layer time is the call's over ``layers`` (column
``per layer``). Variants: ``server`` (what servers run: the extend kernel for verify's
attention, the fused MoE) and ``microbench`` (the verify kernel and the few-token MoE);
decode uses the decode kernel in both. Axis ``capture``: ``eager`` launches every kernel
from Python back to back (the harness's hot mode); ``graph`` replays the captured
layers; ``compile`` (opt-in, ``--axis capture=compile``) runs ``torch.compile`` of the
layer function, launched eagerly. The allreduce is a stand-in on one rank (same bytes; facts say so).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from microbench.case import Case, Cost, Point, Variant, Workload
from microbench.cases.common import DTYPES, default_float, on_cuda

#: capture -> timing mode; "compile" (torch.compile of the layer function, launched eagerly)
#: is opt-in (--axis capture=compile): its first call compiles for tens of seconds
CAPTURE = {"eager": "hot", "graph": "graph", "compile": "hot"}
_compiled: dict[str, object] = {}


def _layer_fn(capture: str):
    from microbench.kernels.decoder_layer import decoder_layer

    if capture != "compile":
        return decoder_layer
    if "fn" not in _compiled:
        import torch

        _compiled["fn"] = torch.compile(decoder_layer, dynamic=False)
    return _compiled["fn"]
#: (attention in verify, MoE kernel) per variant; decode always uses the decode kernel
KERNELS = {"server": ("extend", "fused"), "microbench": ("verify", "few_token")}
#: the most layers a call stacks, and the share of free GPU memory they may take
MAX_LAYERS, MEMORY_SHARE = 4, 0.3


def _stack(variant: str):
    def call(xs, residuals, weights, batches, phase, capture="eager", moe_config=None):
        layer = _layer_fn(capture)
        attention, moe = KERNELS[variant]
        outs = [layer(x, r, w, b, attention="decode" if phase == "decode" else attention, moe=moe,
                      moe_config=moe_config)[0]
                for x, r, w, b in zip(xs, residuals, weights, batches)]
        return torch.stack(outs)

    return call


class DecoderLayerCase(Case):
    """Variant signature: fn(xs, residuals, weights, batches, phase, capture, moe_config) -> out
    [layers, T, H]; xs, residuals: per layer [T, H] (residuals updated in place); weights: per
    layer LayerWeights; batches: per layer LayerBatch; phase "decode" | "verify"; moe_config
    the MoE kernels' tiles for this device ({"fused", "w13", "w2"}: GemmConfig)."""

    id = "layer.decoder"
    title = "a whole decoder layer per rank: eager vs graph replay, decode vs verify"
    baseline = "server"
    order = 140
    profile_calls = True  # kernel launches and host time per call, on CUDA
    #: a layer accumulates bf16 roundings through ~25 ops; outputs are O(1)
    tolerances = {"fp32": (1e-3, 1e-3), "fp16": (3e-2, 3e-2), "bf16": (8e-2, 8e-2)}

    def variants(self) -> Sequence[Variant]:
        return [Variant(name, _stack(name), doc=f"verify attention {a}, MoE {m}") for name, (a, m) in KERNELS.items()]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        # fp16 stays off the GPU: every timed call adds x to the residual in place, and over
        # thousands of calls bf16 stops growing near 2^14 (the add rounds away) while fp16
        # reaches inf near call 1,200 (kimi-tp8), after which the router picks no expert and
        # the calls time no MoE; the CPU's fp16 points make ~10 calls
        capture = ["eager", "graph"] if on_cuda(device) else ["eager"]
        if suite == "verify":
            return {"layer": ["kimi-tp8"], "weights": ["int4"], "phase": ["decode", "verify"], "batch": [1],
                    "draft_tokens": [3], "context": [4096], "capture": capture, "dtype": ["bf16"]}
        if suite == "smoke":
            big = on_cuda(device)
            return {"layer": ["kimi-tp8" if big else "mini"], "weights": ["int4"], "phase": ["decode", "verify"],
                    "batch": [1], "draft_tokens": [3], "context": [1024 if big else 33], "capture": capture,
                    "dtype": [default_float(device)]}
        return {}

    def point_timing_mode(self, point: Point) -> str | None:
        return CAPTURE[point["capture"]]

    def parse_axis_value(self, axis: str, text: str) -> Any:
        if axis == "capture" and text == "compile":
            return text
        # any batch, context or draft length: --axis batch=8 --axis context=16384
        if axis in ("batch", "context", "draft_tokens"):
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"{text!r} is not a positive integer")
            if axis == "draft_tokens" and int(text) + 1 > 16:
                raise ValueError("the verify kernels take at most 16 tokens per request (draft tokens + 1)")
            return int(text)
        return super().parse_axis_value(axis, text)

    def skip(self, point: Point, device: str) -> str | None:
        if point["capture"] == "compile" and not on_cuda(device):
            return "torch.compile of the layer is measured on the GPU"
        if point["dtype"] == "bf16" and not on_cuda(device):
            return "bf16 is checked on the GPU (the Triton interpreter mishandles bf16 tl.dot)"
        return None

    def _layers(self, point: Point, held_bytes: int, device: str) -> int:
        """How many layers a call at ``point`` stacks: as many as ``MEMORY_SHARE`` of the free
        GPU memory holds at ``held_bytes`` each (at most ``MAX_LAYERS``), decided once per
        point, at its first variant's set-up: the next variant's, made while the first one's
        layers are still held, would see less free memory, and a verdict between calls of
        different layer counts would compare different work (so would passes pooled by
        ``--repeat``). The capture modes of one point share it: the table's "eager - graph"
        column subtracts their times per layer, which must be of the same stack."""
        if not on_cuda(device):
            return 1
        key = (device, tuple(sorted((k, str(v)) for k, v in point.items() if k != "capture")))
        counts: dict[tuple, int] = self.__dict__.setdefault("_layer_counts", {})
        if key not in counts:
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            counts[key] = max(1, min(MAX_LAYERS, int(MEMORY_SHARE * free // max(1, held_bytes))))
        return counts[key]

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        from microbench.cases.layer_inputs import layer_batch, layer_inputs, layer_shape, layer_weights
        from microbench.cases.moe import device_slug, tuned_configs, tuning_path
        from microbench.kernels.checks import small_shared
        from microbench.kernels.mla_common import HEAD_DIM
        from microbench.kernels.moe_tuning import TuningTable

        s, dt = layer_shape(point["layer"]), DTYPES[point["dtype"]]
        q_len = 1 if point["phase"] == "decode" else point["draft_tokens"] + 1
        t = point["batch"] * q_len
        first = layer_weights(s, point["weights"], dt, device, seed)
        # what a layer holds: its weights as the kernels read them, the checkpoint copy of its
        # experts the reference reads, and its latent cache (page size 1), which the reference
        # reads again widened to fp32
        pages = point["batch"] * (point["context"] + q_len)
        held = (first.nbytes() + sum(t.numel() * t.element_size() for t in first.experts_ckpt.values())
                + pages * HEAD_DIM * (dt.itemsize + 4))
        n = self._layers(point, held, device)
        weights = [first] + [layer_weights(s, point["weights"], dt, device, seed + 1000 * i) for i in range(1, n)]
        batches = [layer_batch(s, point["batch"], q_len, point["context"], dt, device, seed + 1000 * i + 1)
                   for i in range(n)]
        ins = [layer_inputs(w, t, dt, device, seed + 1000 * i + 2) for i, w in enumerate(weights)]
        cache_bytes = sum(b.kv_cache.numel() * b.kv_cache.element_size() for b in batches)
        # a step reads the experts its tokens chose, not all of them (as moe.experts counts)
        touched = [int(torch.unique(chosen).numel()) for _, _, chosen in ins]
        reads = sum(w.nbytes(k) for w, k in zip(weights, touched)) + cache_bytes
        # the MoE kernels' tiles as moe.experts times them: this device's tuned table, else defaults
        tab = TuningTable.load(tuning_path(device), device_slug(device))
        moe_config, tiles = tuned_configs(tab, s.hidden, s.moe_inter, t, point["weights"], small_shared(device))
        facts = {"layers": n, "tokens": t, "allreduce": "stand-in (one rank: the same bytes moved, no sum)",
                 "layer_bytes": first.nbytes(), "experts_touched": touched[0], "moe_tiles": tiles}
        return Workload({"xs": [x for x, _, _ in ins], "residuals": [r for _, r, _ in ins], "weights": weights,
                         "batches": batches, "phase": point["phase"], "capture": point["capture"],
                         "moe_config": moe_config}, {},
                        Cost(bytes=reads),
                        meta={"layers": n}, facts=facts)

    def reference(self, w: Workload) -> Mapping[str, Any]:
        from microbench.kernels.decoder_layer import decoder_layer_ref

        refs = [decoder_layer_ref(x, r, lw, b) for x, r, lw, b in zip(w.inputs["xs"], w.inputs["residuals"],
                                                                      w.inputs["weights"], w.inputs["batches"])]
        return {"out": torch.stack([o for o, _ in refs])}

    def derive(self, records: Sequence[dict[str, Any]]) -> None:
        from microbench.report import fmt_time

        def point(r):  # the same point and variant, whatever the capture
            return tuple(sorted((k, v) for k, v in r["axes"].items() if k != "capture")) + (r["variant"],)

        by_point: dict[tuple, dict[str, float]] = {}
        for r in records:
            if r["status"] == "OK":
                n = (r.get("facts") or {}).get("layers") or 1
                d = r.setdefault("derived", {})
                d["per layer"] = fmt_time(r["timing"]["summary"]["median"] / n)
                prof = r.get("profile") or {}
                if "launches" in prof:
                    d["launches/layer"] = f"{prof['launches'] / n:.0f}"
                if "host_s" in prof and r["axes"]["capture"] != "graph":  # profiled eagerly: not a replay's cost
                    d["host/layer"] = fmt_time(prof["host_s"] / n)
                by_point.setdefault(point(r), {})[r["axes"]["capture"]] = r["timing"]["summary"]["median"] / n
        for r in records:
            if r["status"] == "OK" and r["axes"]["capture"] == "eager":
                times = by_point.get(point(r), {})
                if "graph" in times:
                    gap = times["eager"] - times["graph"]
                    r["derived"]["eager - graph per layer"] = fmt_time(gap) if gap >= 0 else "-" + fmt_time(-gap)
