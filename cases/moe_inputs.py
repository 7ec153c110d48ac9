"""Seeded inputs for the MoE cases: per-rank layouts from the model files, expert weights
(bf16, or INT4 drawn directly in the packed checkpoint layout), and routings.

Shared by the MoE cases and the tuner, so tuning and timing see the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from microbench.cases.common import model, randn, undrawn

#: Layout name -> (model file, tp, ep); per-rank shapes come from microbench.models.
LAYOUTS: dict[str, tuple[str, int, int]] = {
    "kimi-tp8": ("kimi-k2.5", 8, 1),
    "kimi-ep8": ("kimi-k2.5", 8, 8),
    "dsv3-tp8": ("deepseek-v3", 8, 1),
}
#: A scaled-down layout for the CPU interpreter (same structure: top-8 of many experts).
MINI = {"experts": 16, "global_experts": 16, "hidden": 128, "inter": 32, "top_k": 8, "n_group": 1,
        "topk_group": 1, "scaling": 2.5, "renorm": True, "rank_offset": 0}


@dataclass(frozen=True)
class MoEShape:
    """One rank's routed-expert shape and its model's routing configuration."""

    name: str
    experts: int  # on this rank
    global_experts: int  # the router chooses among these
    hidden: int
    inter: int  # per-rank intermediate I (w13 has 2I rows)
    top_k: int
    n_group: int
    topk_group: int
    scaling: float
    renorm: bool
    rank_offset: int  # first global expert id held by this rank (EP); 0 otherwise


def moe_shape(layout: str) -> MoEShape:
    """The per-rank shape of a layout name (``mini`` is the CPU interpreter's)."""
    if layout == "mini":
        return MoEShape("mini", **MINI)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: unknown {layout!r} (known: mini, {', '.join(LAYOUTS)})")
    from microbench.layout import ParallelLayout, rank_shapes

    name, tp, ep = LAYOUTS[layout]
    m = model(name)
    r = rank_shapes(m, ParallelLayout(tp=tp, ep=ep))
    return MoEShape(layout, r.experts_per_rank, m.n_routed_experts, r.hidden, r.moe_intermediate_per_rank,
                    r.top_k, m.n_group, m.topk_group, m.routed_scaling_factor, m.norm_topk_prob, 0)


def expert_weights(shape: MoEShape, kind: str, dtype: torch.dtype, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint-layout weights, unit-variance outputs per GEMM.

    ``bf16``: ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` ~ N(0, 1/K).  ``int4``: random words
    (every nibble uniform in 0..15, so q uniform in -8..7, std ~4.6) and scales around
    ``1 / (4.6 sqrt(K))`` with ±25% spread — drawn packed, since a 384-expert layer in
    fp32 would be 5.6 GB just to be quantised.
    """
    e, h, i = shape.experts, shape.hidden, shape.inter
    if kind == "bf16":
        return {"w13": randn((e, 2 * i, h), dtype, device, seed, 1 / math.sqrt(h)),
                "w2": randn((e, h, i), dtype, device, seed + 1, 1 / math.sqrt(i))}
    if kind != "int4":
        raise ValueError(f"weights: expected 'bf16' or 'int4', got {kind!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, n, k in (("w13", 2 * i, h), ("w2", h, i)):
        skipped = undrawn((e, n, k // 8), torch.int32, device)
        if skipped is not None:
            out[name], out[f"{name}_scales"] = skipped, torch.empty((e, n, k // 32), dtype=dtype, device=device)
            continue
        out[name] = torch.randint(-2**31, 2**31, (e, n, k // 8), generator=g, dtype=torch.int64,
                                  device=device).to(torch.int32)
        jitter = 0.75 + 0.5 * torch.rand((e, n, k // 32), generator=g, device=device)
        out[f"{name}_scales"] = (jitter / (4.6 * math.sqrt(k))).to(dtype)
    return out


def routing(shape: MoEShape, tokens: int, how: str, dtype: torch.dtype, device: str,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [T, H], topk_weights [T, k] fp32, topk_ids [T, k] int32)`` for this rank.

    ``router``: the model's router on seeded hidden states (N(0, 1)) with a random gate
    (N(0, 1/H)) and correction bias (0.1 N(0, 1)), over all the model's experts; under
    EP, ids of experts on other ranks become -1.  ``distinct``: the worst case — the
    T x top_k choices walk a random permutation of this rank's experts, so they are all
    distinct while T x top_k <= E (each token's own choices always are).
    """
    from microbench.kernels.moe_reference import router_ref

    hidden = randn((tokens, shape.hidden), dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 7)
    if how == "router":
        gate = randn((shape.global_experts, shape.hidden), dtype, device, seed + 1, 1 / math.sqrt(shape.hidden))
        bias = randn((shape.global_experts,), torch.float32, device, seed + 2, 0.1)
        w, ids = router_ref(hidden, gate, bias, top_k=shape.top_k, n_group=shape.n_group,
                            topk_group=shape.topk_group, routed_scaling_factor=shape.scaling,
                            renormalize=shape.renorm)
        local = ids - shape.rank_offset
        ids = torch.where((local >= 0) & (local < shape.experts), local, torch.full_like(local, -1))
        return hidden, w, ids.to(torch.int32)
    if how != "distinct":
        raise ValueError(f"routing: expected 'router' or 'distinct', got {how!r}")
    perm = torch.randperm(shape.experts, generator=g)
    flat = perm.repeat(math.ceil(tokens * shape.top_k / shape.experts) + 1)
    # a token's choices must be distinct even where the walk wraps round: shift such rows
    ids = torch.empty(tokens, shape.top_k, dtype=torch.int64)
    pos = 0
    for t in range(tokens):
        row = flat[pos:pos + shape.top_k]
        if row.unique().numel() < shape.top_k:
            row = torch.roll(perm, -(pos % shape.experts))[: shape.top_k]
        ids[t] = row
        pos += shape.top_k
    w = torch.rand(tokens, shape.top_k, generator=g) + 0.1
    w = w / w.sum(dim=1, keepdim=True) * shape.scaling
    return hidden, w.to(device), ids.to(torch.int32).to(device)
