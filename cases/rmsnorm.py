"""RMSNorm at the widths of a DeepSeek-V3-family layer (per rank, identical on every rank).

A layer normalises four times: the input norm and the post-attention norm over the hidden
size, both fused with the residual add; q_a_layernorm over q_lora_rank and kv_a_layernorm
over kv_lora_rank, without. At decode and verify token counts each is a few KB per token:
launch- and latency-bound, which is why the step model counts them as small ops.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from microbench.case import Case, Cost, Point, Variant, Workload
from microbench.cases.common import DTYPES, default_float, model, on_cuda, randn


def _torch(x, weight, eps, out, residual=None) -> None:
    """Eager torch, as a server's fallback path runs it: native dtype, fp32 statistics."""
    if residual is not None:
        residual.add_(x)
        x = residual
    var = x.float().pow(2).mean(-1, keepdim=True)
    out.copy_((x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight)


def _triton(x, weight, eps, out, residual=None) -> None:
    from microbench.kernels.rmsnorm import rmsnorm

    rmsnorm(x, weight, eps, residual=residual, out=out)


def _widths(device: str) -> dict[str, tuple[int, bool]]:
    m = model()
    return {"input": (m.hidden_size, True), "q_a": (m.q_lora_rank or m.hidden_size, False),
            "kv_a": (m.kv_lora_rank, False)}


class RMSNormCase(Case):
    """Variant signature: fn(x, weight, eps, out, residual=None)
    x [tokens, width] dtype; weight [width] dtype; eps float; out [tokens, width] dtype (written);
    residual [tokens, width] dtype, only for norm=input: updated in place to x + residual, and
    out = rmsnorm(x + residual) * weight."""

    id = "norm.rmsnorm"
    title = "RMSNorm (+ fused residual add) at the layer's widths"
    baseline = "torch"

    def variants(self) -> Sequence[Variant]:
        return [Variant("torch", _torch, doc="eager torch ops (server fallback)"),
                Variant("triton", _triton, doc="microbench.kernels.rmsnorm: one program per row")]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        if suite == "smoke":
            return {"tokens": [1, 5], "norm": ["input", "kv_a"], "dtype": [default_float(device)]}
        if suite == "verify":
            return {"tokens": [1, 4, 16, 64], "norm": ["input", "q_a", "kv_a"], "dtype": ["bf16"]}
        return {}

    def skip(self, point: Point, device: str) -> str | None:
        if point["dtype"] == "bf16" and not on_cuda(device):
            return "bf16 is checked on the GPU (the Triton interpreter mishandles bf16)"
        return None

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        width, fused = _widths(device)[point["norm"]]
        dt, t = DTYPES[point["dtype"]], point["tokens"]
        inputs: dict[str, Any] = {
            "x": randn((t, width), dt, device, seed),
            "weight": randn((width,), dt, device, seed + 1, scale=0.5).add_(1.0),
            "eps": model().rms_norm_eps,
        }
        if fused:
            inputs["residual"] = randn((t, width), dt, device, seed + 2)
        from microbench.kernels.reference import rmsnorm_cost

        nbytes, flops = rmsnorm_cost(t, width, torch.finfo(dt).bits // 8, fused)
        # the width, for the step model: a time at Kimi-K2.5's widths is not another model's
        return Workload(inputs, {"out": torch.empty(t, width, dtype=dt, device=device)}, Cost(nbytes, flops),
                        facts={"width": width})

    def reference(self, w: Workload) -> Mapping[str, Any]:
        from microbench.kernels.reference import rmsnorm_ref

        i = w.inputs
        y, s = rmsnorm_ref(i["x"], i["weight"], i["eps"], residual=i.get("residual"))
        return {"out": y, "residual": s} if s is not None else {"out": y}
