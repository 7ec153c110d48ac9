"""Verify-step MoE at Kimi-K2.5 TP8 / EP8 and DeepSeek-V3 TP8 shapes: router, alignment,
and the routed experts — the server's block-aligned fused-MoE kernel vs the few-token kernel.

With T verify tokens and top-8 routing a step touches up to min(E, 8T) experts, and at
these T the layer is a stream of the touched experts' weights:

* ``moe.router``: gate GEMM + grouped top-k (``noaux_tc``), timed alone.
* ``moe.align``: the (token, expert) pairs sorted into 16-row blocks, timed alone.
* ``moe.experts``: ``fused`` (baseline: align + w13 GEMM + SiLU-and-mul + w2 GEMM + top-k
  sum, five launches) vs ``few_token`` (one program per touched expert x N tile x K
  split, top-k sum fused).  Bytes = the touched experts' weights and scales + hidden in
  + output out; the ``experts`` column is how many the routing touched.  Configurations
  come from the device's tuning table (``microbench tune``), else the documented default;
  the ``config`` column says which.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Mapping, Sequence

import torch

from microbench.case import Case, Cost, Point, Variant, Workload
from microbench.cases.common import DTYPES, default_float, on_cuda

TOKENS = [1, 4, 8, 16, 32, 64]
#: One tuning table per device, in this folder, named by the device (``NVIDIA H200`` ->
#: ``nvidia-h200.json``).
TUNING_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning")


def device_slug(device: str) -> str:
    """The tuning-table name of a device: its CUDA name, lower-cased, dashes for spaces."""
    if not on_cuda(device):
        from microbench import case as _case

        target = _case.COMPILE_TARGET  # microbench compile: the target GPU's table
        return _target_slug(target) if target is not None else "cpu"
    return _slug(torch.cuda.get_device_name(torch.device(device)))


def _slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def _target_slug(profile: Any) -> str:
    """The table of the GPU a hardware profile describes: the one shipped table whose name,
    read as a device name, the profile matches as ``run`` matches a GPU (whole words, its
    ``exclude`` words honoured: ``nvidia-h200`` for H200 SXM, not ``nvidia-gh200-480gb`` nor
    ``nvidia-h200-nvl``), else the profile's name (no such file: the documented defaults)."""
    from microbench.hardware import match_length

    tables = sorted(f[:-5] for f in os.listdir(TUNING_DIR) if f.endswith(".json")) if os.path.isdir(TUNING_DIR) else []
    hits = [t for t in tables if match_length(profile, t)]
    return hits[0] if len(hits) == 1 else profile.name


def tuned_configs(table: Any, hidden: int, inter: int, tokens: int, weights: str,
                  small: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """The MoE kernels' tiles for T = ``tokens`` from a :class:`TuningTable` (``{"fused",
    "w13", "w2"}``: GemmConfig), and where each came from (``{"fused", "few_token"}``)."""
    fused, src_f = table.lookup("fused", "w13+w2", weights, 2 * inter, hidden, tokens, small)
    w13, src_1 = table.lookup("few_token", "w13", weights, 2 * inter, hidden, tokens, small)
    w2, src_2 = table.lookup("few_token", "w2", weights, hidden, inter, tokens, small)
    return ({"fused": fused, "w13": w13, "w2": w2},
            {"fused": src_f, "few_token": src_1 if src_1 == src_2 else f"{src_1}/{src_2}"})


def tuning_path(device: str) -> str:
    return os.path.join(TUNING_DIR, f"{device_slug(device)}.json")


def _skip_dtype(point: Point, device: str) -> str | None:
    if point.get("dtype") == "bf16" and not on_cuda(device):
        return "bf16 is checked on the GPU (the Triton interpreter mishandles bf16 tl.dot)"
    return None


# --------------------------------------------------------------------------------------
# Router and alignment rows
# --------------------------------------------------------------------------------------


def _route(hidden, gate, bias, shape, weights, ids):
    from microbench.kernels.moe_routing import route

    return route(hidden, gate, bias, top_k=shape.top_k, n_group=shape.n_group, topk_group=shape.topk_group,
                 routed_scaling_factor=shape.scaling, renormalize=shape.renorm)


class MoERouterCase(Case):
    """Variant signature: fn(hidden, gate, bias, shape, weights, ids) -> (weights, ids)
    hidden [T, H] dtype; gate [E, H] dtype (all the model's experts); bias [E] fp32;
    shape: cases.moe_inputs.MoEShape (routing configuration); returns topk weights
    [T, top_k] fp32 and ids [T, top_k] int32."""

    id = "moe.router"
    title = "MoE router: gate GEMM + grouped top-k (noaux_tc)"
    baseline = "triton"
    tolerances = {"fp32": (1e-5, 1e-5), "fp16": (1e-4, 1e-4), "bf16": (1e-4, 1e-4)}  # fp32 logits both ways

    def variants(self) -> Sequence[Variant]:
        return [Variant("triton", _route, doc="torch gate GEMM (fp32 logits) + one Triton program per token")]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        if suite == "verify":
            return {"layout": ["kimi-tp8", "dsv3-tp8"], "tokens": TOKENS, "dtype": ["bf16"]}
        if suite == "smoke":
            return {"layout": ["kimi-tp8" if on_cuda(device) else "mini"], "tokens": [4],
                    "dtype": [default_float(device)]}
        return {}

    def skip(self, point: Point, device: str) -> str | None:
        return _skip_dtype(point, device)

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        from microbench.cases.common import randn
        from microbench.cases.moe_inputs import moe_shape
        from microbench.kernels.moe_reference import router_cost

        shape, t, dt = moe_shape(point["layout"]), point["tokens"], DTYPES[point["dtype"]]
        e, h = shape.global_experts, shape.hidden
        hidden = randn((t, h), dt, device, seed)
        gate = randn((e, h), dt, device, seed + 1, h ** -0.5)
        bias = randn((e,), torch.float32, device, seed + 2, 0.1)
        nbytes, flops = router_cost(t, h, e, shape.top_k, hidden.element_size())
        outs = {"weights": torch.empty(t, shape.top_k, dtype=torch.float32, device=device),
                "ids": torch.empty(t, shape.top_k, dtype=torch.int32, device=device)}
        return Workload({"hidden": hidden, "gate": gate, "bias": bias, "shape": shape}, outs, Cost(nbytes, flops))

    def reference(self, w: Workload) -> Mapping[str, Any]:
        from microbench.kernels.moe_reference import router_ref

        i, s = w.inputs, w.inputs["shape"]
        weights, ids = router_ref(i["hidden"], i["gate"], i["bias"], top_k=s.top_k, n_group=s.n_group,
                                  topk_group=s.topk_group, routed_scaling_factor=s.scaling, renormalize=s.renorm)
        return {"weights": weights, "ids": ids}


def _align(topk_ids, num_experts, block_size, sorted_ids, expert_of_block, num_padded):
    from microbench.kernels.moe_routing import align

    return align(topk_ids, num_experts, block_size)


class MoEAlignCase(Case):
    """Variant signature: fn(topk_ids, num_experts, block_size, sorted_ids, expert_of_block,
    num_padded) -> (sorted_ids [C] int32, expert_of_block [C / block] int32, num_padded []
    int32), C the worst-case capacity; topk_ids [T, top_k] int32 from the router."""

    id = "moe.align"
    title = "MoE alignment: pairs sorted by expert into 16-row blocks"
    baseline = "triton"
    tolerances = {"int": (0.0, 0.0)}

    def variants(self) -> Sequence[Variant]:
        return [Variant("triton", _align, doc="one program: histogram, scan, block map, stable scatter")]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        if suite == "verify":
            return {"layout": ["kimi-tp8", "dsv3-tp8"], "tokens": TOKENS, "block": [16]}
        if suite == "smoke":
            return {"layout": ["kimi-tp8" if on_cuda(device) else "mini"], "tokens": [4], "block": [16]}
        return {}

    def tolerance(self, point: Point) -> tuple[float, float]:
        return self.tolerances["int"]

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        from microbench.cases.moe_inputs import moe_shape, routing
        from microbench.kernels.moe_reference import align_capacity, align_cost

        shape = moe_shape(point["layout"])
        _, _, ids = routing(shape, point["tokens"], "router", torch.float32, device, seed)
        n, bs = ids.numel(), point["block"]
        cap = align_capacity(n, shape.experts, bs)
        outs = {"sorted_ids": torch.empty(cap, dtype=torch.int32, device=device),
                "expert_of_block": torch.empty(cap // bs, dtype=torch.int32, device=device),
                "num_padded": torch.empty((), dtype=torch.int32, device=device)}
        return Workload({"topk_ids": ids, "num_experts": shape.experts, "block_size": bs}, outs,
                        Cost(align_cost(n, shape.experts, bs)[0]))

    def reference(self, w: Workload) -> Mapping[str, Any]:
        """align_ref's layout padded to the launcher's worst-case capacity."""
        from microbench.kernels.moe_reference import align_ref

        ids, e, bs = w.inputs["topk_ids"], w.inputs["num_experts"], w.inputs["block_size"]
        sorted_ids, blocks, p = align_ref(ids, e, bs)
        cap = w.outputs["sorted_ids"].numel()
        s = torch.full((cap,), ids.numel(), dtype=torch.int32, device=ids.device)
        b = torch.full((cap // bs,), -1, dtype=torch.int32, device=ids.device)
        s[:p], b[: p // bs] = sorted_ids, blocks
        return {"sorted_ids": s, "expert_of_block": b,
                "num_padded": torch.tensor(p, dtype=torch.int32, device=ids.device)}


# --------------------------------------------------------------------------------------
# The routed experts
# --------------------------------------------------------------------------------------


def _fused(hidden, weights, topk_weights, topk_ids, configs, out):
    from microbench.kernels.moe_fused import fused_moe

    fused_moe(hidden, weights, topk_weights, topk_ids, out=out, config=configs["fused"],
              remote_ids=configs["remote"])


def _few_token(hidden, weights, topk_weights, topk_ids, configs, out):
    from microbench.kernels.moe_few_token import few_token_moe

    few_token_moe(hidden, weights, topk_weights, topk_ids, out=out, config_w13=configs["w13"],
                  config_w2=configs["w2"])


class MoEExpertsCase(Case):
    """Variant signature: fn(hidden, weights, topk_weights, topk_ids, configs, out)
    hidden [T, H] dtype; weights: microbench.kernels.moe_common.ExpertWeights (bf16
    [E, 2I, H] / [E, H, I], or INT4 repacked at load time); topk_weights [T, 8] fp32;
    topk_ids [T, 8] int32 (-1: an expert on another rank); configs: {"fused", "w13",
    "w2": GemmConfig, "remote": bool}; out [T, H] dtype, written."""

    id = "moe.experts"
    title = "MoE routed experts: server fused-MoE vs few-token kernel (bf16 / INT4 weights)"
    baseline = "fused"
    # bf16 intermediates (the baseline rounds gate/up and the activation to bf16) over
    # K = 7168 and 8 experts: a few bf16 ulps of outputs of order 1
    tolerances = {"fp32": (1e-4, 1e-4), "fp16": (1e-2, 1e-2), "bf16": (3e-2, 3e-2)}
    # the INT4 and bf16 rows of a layout, and its dtypes, route the same tokens to the same
    # experts: under expert parallelism their local pairs (the work) are then the same too
    unseeded_axes = ("weights", "dtype")

    def __init__(self) -> None:
        self._weights: tuple[tuple, Any] | None = None  # the last layout's weights: points reuse them
        self._ref: tuple[tuple, Any] | None = None  # the last point's reference: variants share it
        self._tables: dict[str, Any] = {}

    def variants(self) -> Sequence[Variant]:
        return [Variant("fused", _fused, doc="server-style: align to 16-row blocks, 2 GEMM launches, SiLU, sum"),
                Variant("few_token", _few_token, doc="per touched expert x N tile x K split, top-k sum fused")]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        if suite == "verify":
            return {"layout": ["kimi-tp8", "kimi-ep8", "dsv3-tp8"], "weights": ["int4", "bf16"], "tokens": TOKENS,
                    "routing": ["router", "distinct"], "dtype": ["bf16"]}
        if suite == "smoke":
            return {"layout": ["kimi-tp8" if on_cuda(device) else "mini"], "weights": ["int4", "bf16"],
                    "tokens": [4], "routing": ["router"], "dtype": [default_float(device)]}
        return {}

    def skip(self, point: Point, device: str) -> str | None:
        return _skip_dtype(point, device)

    def targets(self) -> Sequence[Any]:
        """The few-token kernel's bars at Kimi-K2.5 TP8, T = 4 with the router's choices
        (28 experts on average over seeds, a row's own count in its `experts` column), INT4
        and bf16, on an H200; the rows show the configuration each
        kernel ran (the fused baseline's should be its tuned one) and the experts touched."""
        from microbench.targets import Target

        at = {"layout": ("kimi-tp8",), "tokens": (4,), "routing": ("router",)}
        return [Target("70% of the weight-streaming floor at Kimi-K2.5 TP8, T = 4", ("few_token",), "floor", 0.70,
                       where=at, stated_for="h200-sxm", details=("experts", "config")),
                Target("1.5x the fused kernel at Kimi-K2.5 TP8, T = 4", ("few_token",), "speedup", 1.5, ref=self.baseline,
                       where=at, stated_for="h200-sxm", details=("config",))]

    def table(self, device: str, path: str | None = None):
        """The tuning table at ``path`` (default: the device's own), loaded once."""
        from microbench.kernels.moe_tuning import TuningTable

        path = path or tuning_path(device)
        if path not in self._tables:
            self._tables[path] = TuningTable.load(path, device_slug(device))
        return self._tables[path]

    def configs(self, point: Point, device: str, path: str | None = None) -> tuple[dict[str, Any], str]:
        """The tile configurations for this point from the device's table (or the table at
        ``path``), and where from."""
        from microbench.cases.moe_inputs import moe_shape

        from microbench.kernels.checks import small_shared

        s = moe_shape(point["layout"])
        cfg, src = tuned_configs(self.table(device, path), s.hidden, s.inter, point["tokens"], point["weights"],
                                 small_shared(device))
        return {**cfg, "remote": s.global_experts != s.experts}, src

    def _expert_weights(self, point: Point, device: str, seed_base: int):
        from microbench.cases.moe_inputs import expert_weights, moe_shape
        from microbench.kernels.moe_common import prepare_weights

        key = (point["layout"], point["weights"], point["dtype"], device)
        if self._weights is None or self._weights[0] != key:
            self._weights = None  # free the previous layout's gigabytes before drawing the next
            self._ref = None
            ckpt = expert_weights(moe_shape(point["layout"]), point["weights"], DTYPES[point["dtype"]], device,
                                  seed_base)
            prepared = prepare_weights(ckpt["w13"], ckpt["w2"], w13_scales=ckpt.get("w13_scales"),
                                       w2_scales=ckpt.get("w2_scales"))
            self._weights = (key, (ckpt, prepared))
        return self._weights[1]

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        from microbench.cases.moe_inputs import moe_shape, routing
        from microbench.kernels.moe_reference import moe_cost

        shape, t, dt = moe_shape(point["layout"]), point["tokens"], DTYPES[point["dtype"]]
        # weights depend on the layout only (drawn once per layout, like a model load)
        weight_seed = zlib.crc32(f"{point['layout']}|{point['weights']}".encode())
        ckpt, prepared = self._expert_weights(point, device, weight_seed)
        hidden, tw, ids = routing(shape, t, point["routing"], dt, device, seed)
        local = ids[ids >= 0]
        distinct = int(torch.unique(local).numel())
        scales = ckpt.get("w13_scales")
        nbytes, flops = moe_cost(t, shape.hidden, shape.inter, shape.top_k, distinct, point["weights"],
                                 elem_bytes=hidden.element_size(),
                                 scale_bytes=scales.element_size() if scales is not None else 2)
        flops = 2 * int(local.numel()) * 3 * shape.inter * shape.hidden  # the pairs on this rank
        configs, source = self.configs(point, device)
        return Workload({"hidden": hidden, "weights": prepared, "topk_weights": tw, "topk_ids": ids,
                         "configs": configs},
                        {"out": torch.empty(t, shape.hidden, dtype=dt, device=device)}, Cost(nbytes, flops),
                        meta={"ckpt": ckpt, "key": (tuple(sorted(point.items())), seed)},
                        facts={"experts": distinct, "pairs": int(local.numel()), "config": source})

    def reference(self, w: Workload) -> Mapping[str, Any]:
        from microbench.kernels.moe_reference import fused_moe_ref

        if self._ref is not None and self._ref[0] == w.meta["key"]:
            return self._ref[1]
        i, c = w.inputs, w.meta["ckpt"]
        out = fused_moe_ref(i["hidden"], c["w13"], c["w2"], i["topk_weights"], i["topk_ids"],
                            w13_scales=c.get("w13_scales"), w2_scales=c.get("w2_scales"))
        self._ref = (w.meta["key"], {"out": out})
        return self._ref[1]

    # ------------------------------------------------------------------ tuning

    def tune(self, point: Point, device: str, trial: Any) -> list[dict[str, Any]]:
        """Three searches per point: the fused kernel's one configuration (both GEMMs share
        its alignment block), then the few-token kernel's w13 GEMM (w2 at its current
        configuration), then its w2 GEMM (w13 at the winner).  Each search's best so far
        is in the device's table as soon as it is found (a search cut short keeps it);
        each row says how much faster the winner is than the default.  ``trial.out``: the
        table updated (read and written), None for the device's own."""
        from microbench.cases.moe_inputs import moe_shape
        from microbench.kernels.checks import small_shared
        from microbench.kernels.moe_tuning import TuningEntry, default_config, search_space

        s, t, kind = moe_shape(point["layout"]), point["tokens"], point["weights"]
        out, small = getattr(trial, "out", None), small_shared(device)
        w = self.setup(point, device, trial.seed)
        expected = self.reference(w)
        configs = self.configs(point, device, out)[0]  # the searches start from the table they update
        rows = []
        searches = [("fused", "w13+w2", "fused", _fused, 2 * s.inter, s.hidden),
                    ("few_token", "w13", "w13", _few_token, 2 * s.inter, s.hidden),
                    ("few_token", "w2", "w2", _few_token, s.hidden, s.inter)]
        for kernel, gemm, slot, fn, n, k in searches:
            best, best_t, default_t = None, None, None
            default = default_config(kernel, gemm, kind, n, k, t, small)
            for cfg in trial.limit(search_space(kernel, gemm, kind, n, k, t, small)):
                w.inputs["configs"] = {**configs, slot: cfg}
                label = f"{kernel}/{gemm} " + " ".join(f"{a}={v}" for a, v in cfg.to_dict().items())
                m = trial(fn, w, expected, label)
                if m is None:
                    continue
                if cfg == default:
                    default_t = m
                if best_t is None or m < best_t:
                    best, best_t = cfg, m
                    self.table(device, out).put(TuningEntry(kernel, gemm, kind, n, k, t, best, best_t))
            if best is None:
                rows.append({"kernel": kernel, "gemm": gemm, "config": "none correct", "median_s": None})
                continue
            configs = {**configs, slot: best}
            rows.append({"kernel": kernel, "gemm": gemm, "median_s": best_t,
                         "vs default": f"{default_t / best_t:.2f}x" if default_t else "-",
                         "config": " ".join(f"{a}={v}" for a, v in best.to_dict().items())})
        return rows

    def save_tuning(self, device: str, path: str | None = None) -> str | None:
        table = self.table(device, path)
        return table.save(path or tuning_path(device)) if table.entries else None

    def tuning_file(self, device: str) -> str | None:
        return tuning_path(device)

    def load_tuning(self, device: str, path: str | None = None) -> None:
        self.table(device, path)

    def tuning_key(self, point: Point) -> Any:
        """The table entries a point's searches write: its weights, GEMM shapes and T (not
        its routing, nor which layout gave the shapes)."""
        from microbench.cases.moe_inputs import moe_shape

        s = moe_shape(point["layout"])
        return (point["weights"], s.hidden, s.inter, point["tokens"])

    def summarize(self, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Per layout, weights and routing: each variant's time over fused's by token count,
        and the T at which fused overtakes it (by the table's verdict rule)."""
        from microbench.report import crossovers

        return crossovers(records, "tokens", self.baseline)

    def derive(self, records: Sequence[dict[str, Any]]) -> None:
        """experts touched, config source, speed-up over the fused baseline per point."""
        def key(r):
            return tuple(sorted(r["axes"].items()))

        base = {key(r): r["timing"]["summary"]["median"] for r in records
                if r["variant"] == "fused" and r["status"] == "OK" and r.get("timing")}
        for r in records:
            facts = r.get("facts") or {}
            d = r.setdefault("derived", {})
            if "experts" in facts:
                d["experts"] = str(facts["experts"])
            if r["status"] != "OK" or not r.get("timing"):
                continue
            b = base.get(key(r))
            if b and r["variant"] != "fused":
                d["speed-up vs fused"] = f"{b / r['timing']['summary']['median']:.2f}x"
            if r["variant"] in facts.get("config", {}):
                d["config"] = facts["config"][r["variant"]]
