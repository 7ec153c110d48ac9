"""Verify-step MLA attention at Kimi-K2.5 TP8 shapes: extend (what servers run for verify)
vs the split-KV verify kernel, with the decode kernel as the one-token reference point.

Per rank, 8 query heads attend over one shared latent cache of 576 channels per token.
Verify scores ``draft_tokens`` new tokens per request against the request's context:

* ``extend`` (baseline): the server's prefill-style kernel, one program per (request,
  head, query block): the latent cache is streamed once per head, 8 times.
* ``verify``: split-KV with every (token x head) row of a request in one tile: the cache
  is read once per request.
* ``decode``: the one-token split-KV kernel; it runs at draft_tokens = 1 only, and the
  ``decode x q_len`` column shows what running it once per draft token would cost.

Bytes (the floor) = the latent cache read once + q + kv_new + out (``mla_cost``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from microbench.case import Case, Cost, Point, Variant, Workload
from microbench.report import fmt_time
from microbench.cases.common import DTYPES, default_float, model, on_cuda


def _extend(q, kv_new, kv_cache, plan, out) -> None:
    from microbench.kernels.mla_extend import mla_extend

    mla_extend(q, kv_new, kv_cache, plan, out=out)


def _decode(q, kv_new, kv_cache, plan, out) -> None:
    from microbench.kernels.mla_decode import mla_decode

    mla_decode(q, kv_new, kv_cache, plan, out=out)


def _verify(q, kv_new, kv_cache, plan, out) -> None:
    from microbench.kernels.mla_verify import mla_verify

    mla_verify(q, kv_new, kv_cache, plan, out=out)


def _verify_dv2(q, kv_new, kv_cache, plan, out) -> None:
    from microbench.kernels.mla_verify import mla_verify

    mla_verify(q, kv_new, kv_cache, plan, out=out, dv_split=2)


def _heads() -> int:
    from microbench.layout import ParallelLayout, rank_shapes

    return rank_shapes(model(), ParallelLayout(tp=8)).heads_per_rank


class MLAVerifyCase(Case):
    """Variant signature: fn(q, kv_new, kv_cache, plan, out)
    q [T, heads, 576] dtype (T = batch x draft_tokens); kv_new [T, 576] dtype (the new tokens'
    latents); kv_cache [num_pages, page_size, 576] dtype (the shuffled paged prefix);
    plan: microbench.kernels.mla_common.MLAPlan (built once per batch, host-validated);
    out [T, heads, 512] dtype, written. Causal among a request's new tokens."""

    id = "attention.mla_verify"
    title = "MLA attention for verify: extend vs split-KV verify (decode for reference)"
    baseline = "extend"
    # bf16 logits over 64K keys and a 512-wide value sum: a few bf16 ulps of the output
    tolerances = {"fp32": (1e-4, 1e-4), "fp16": (2e-2, 2e-2), "bf16": (2e-2, 2e-2)}
    # and over the whole output, where a few wrong keys out of 64K can hide under the
    # elementwise bound: a correct kernel's relative L2 error is its output's rounding,
    # ~3.5e-3 (bf16), 2e-4 (fp16), 3e-6 (fp32) from 65 to 16K keys; 1% of 64K keys read
    # from wrong pages puts it at 2.4e-2 to 6.8e-2 (at 655 wrong single-key pages, 14
    # elements past the elementwise bound, the norm 2.4x past its own)
    norm_tolerances = {"fp32": 5e-5, "fp16": 2e-3, "bf16": 1e-2}

    def variants(self) -> Sequence[Variant]:
        return [Variant("extend", _extend, doc="server-style extend kernel (one program per request x head x block)"),
                Variant("verify", _verify, doc="split-KV, (draft tokens x heads) packed in the tile"),
                Variant("verify_dv2", _verify_dv2, doc="verify with each tile's 512 value channels over two "
                        "programs (half the accumulator, twice the logits)"),
                Variant("decode", _decode, doc="split-KV decode kernel (q_len 1 only)")]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        if suite == "verify":
            return {"batch": [1, 4, 16], "draft_tokens": [1, 2, 4, 8], "context": [1024, 4096, 16384, 65536],
                    "page": [1], "dtype": ["bf16"]}
        if suite == "smoke":
            big = on_cuda(device)  # the interpreter costs ~ms per tile op: tiny contexts on CPU
            return {"batch": [1, 2] if big else [1], "draft_tokens": [1, 4], "context": [1024 if big else 65],
                    "page": [1] if big else [64], "dtype": [default_float(device)]}
        return {}

    def skip(self, point: Point, device: str) -> str | None:
        if point["dtype"] == "bf16" and not on_cuda(device):
            return "bf16 is checked on the GPU (the Triton interpreter mishandles bf16 tl.dot)"
        return None

    def skip_variant(self, variant: str, point: Point, device: str) -> str | None:
        if variant == "decode" and point["draft_tokens"] != 1:
            return "decode handles one token per request: see the decode x q_len column"
        return None

    def targets(self) -> Sequence[Any]:
        """The verify kernel's bars at Kimi-K2.5 TP8 shapes on an H200 (q_len 4, batch 1
        unless a bar says otherwise), for both of its tile layouts."""
        from microbench.targets import Target

        mine = ("verify", "verify_dv2")
        long = tuple(c for c in self.axes("verify")["context"] if c >= 16384)
        return [Target("8x the extend kernel at q_len 4, batch 1, 16K keys", mine, "speedup", 8.0, ref="extend",
                       where={"draft_tokens": (4,), "batch": (1,), "context": (16384,)}, stated_for="h200-sxm"),
                Target("80% of the copy floor at q_len 4, batch 16, 16K keys and more", mine, "floor", 0.80,
                       where={"draft_tokens": (4,), "batch": (16,), "context": long}, stated_for="h200-sxm"),
                Target("within 10% of the decode kernel at q_len 1, batch 1", mine, "time_ratio", 1.10, ref="decode",
                       where={"draft_tokens": (1,), "batch": (1,)}, stated_for="h200-sxm")]

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        from microbench.cases.mla_inputs import make_mla_inputs
        from microbench.kernels.mla_common import mla_cost

        b, n, ctx = point["batch"], point["draft_tokens"], point["context"]
        dt = DTYPES[point["dtype"]]
        heads = _heads()
        x = make_mla_inputs([n] * b, [ctx] * b, heads=heads, page_size=point["page"], dtype=dt, device=device,
                            seed=seed)
        nbytes, flops = mla_cost(x.plan, heads, torch.finfo(dt).bits // 8)
        out = torch.empty(b * n, heads, 512, dtype=dt, device=device)
        # the heads per rank, for the step model: a time at 8 heads is not another layout's
        return Workload({"q": x.q, "kv_new": x.kv_new, "kv_cache": x.kv_cache, "plan": x.plan}, {"out": out},
                        Cost(nbytes, flops), facts={"heads": heads})

    def reference(self, w: Workload) -> Mapping[str, Any]:
        from microbench.kernels.reference import mla_attention_ref

        i = w.inputs
        return {"out": mla_attention_ref(i["q"], i["kv_new"], i["kv_cache"], i["plan"])}

    def derive(self, records: Sequence[dict[str, Any]]) -> None:
        """speed-up over extend per point; decode x q_len from the draft_tokens=1 point."""
        def key(r, **over):
            a = {**r["axes"], **over}
            return tuple(sorted(a.items()))

        med = {(key(r), r["variant"]): r["timing"]["summary"]["median"] for r in records
               if r["status"] == "OK" and r.get("timing")}
        for r in records:
            if r["status"] != "OK" or not r.get("timing"):
                continue
            t = r["timing"]["summary"]["median"]
            d = r.setdefault("derived", {})
            base = med.get((key(r), "extend"))
            if base and r["variant"] != "extend":
                d["speed-up vs extend"] = f"{base / t:.2f}x"
            dec = med.get((key(r, draft_tokens=1), "decode"))
            if dec and r["variant"] in ("verify", "verify_dv2"):
                n = r["axes"]["draft_tokens"]
                d["decode x q_len"] = f"{fmt_time(dec * n)} ({dec * n / t:.2f}x {r['variant']})"
