"""Seeded MoE inputs shared by the expert-kernel and reference tests."""

from __future__ import annotations

import math

import torch

from microbench.kernels.moe_common import prepare_weights
from microbench.kernels.moe_reference import pack_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def dense_weights(E: int, H: int, I: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 w13 [E, 2I, H] ~ N(0, 1/H) and w2 [E, H, I] ~ N(0, 1/I): outputs of order 1."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H), torch.randn(E, H, I, generator=g) / math.sqrt(I)


def routing(pattern: str, T: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32 in 0.1..1.1, topk_ids [T, k] int32) for a named pattern."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "distinct":  # k distinct experts per token
        rows = [torch.randperm(E, generator=g)[:k] for _ in range(T)]
    elif pattern == "sparse":  # only experts 1, 4, E-1 ever chosen: the rest get no tokens
        pool = torch.tensor([1, 4, E - 1])
        rows = [pool[torch.randperm(3, generator=g)[:k]] for _ in range(T)]
    elif pattern == "expert2-everyone":  # expert 2 among every token's choices, in a random slot
        rows = []
        for _ in range(T):
            others = [e for e in torch.randperm(E, generator=g).tolist() if e != 2][: k - 1]
            others.insert(int(torch.randint(0, k, (1,), generator=g)), 2)
            rows.append(torch.tensor(others))
    elif pattern == "all-same":  # every choice of every token is expert E-1: T*k pairs on it
        rows = [torch.full((k,), E - 1) for _ in range(T)]
    else:
        raise AssertionError(pattern)
    ids = torch.stack(rows).to(torch.int32)
    tw = torch.rand(T, k, generator=g) + 0.1
    return tw.to(DEVICE), ids.to(DEVICE)


def moe_checkpoint(kind: str, E: int, H: int, I: int, seed: int, dtype=torch.float16, group_size: int = 32):
    """(reference kwargs, ExpertWeights) holding the same numbers: dense weights of
    ``dtype``, or INT4 words with their scales cast to ``dtype`` (the reference is fed
    those cast scales, so both dequantise identically)."""
    w13, w2 = dense_weights(E, H, I, seed)
    if kind == "dense":
        ck = {"w13": w13.to(DEVICE, dtype), "w2": w2.to(DEVICE, dtype)}
    else:
        (q13, s13), (q2, s2) = pack_int4(w13, group_size), pack_int4(w2, group_size)
        ck = {"w13": q13.to(DEVICE), "w2": q2.to(DEVICE), "w13_scales": s13.to(DEVICE, dtype),
              "w2_scales": s2.to(DEVICE, dtype)}
    W = prepare_weights(ck["w13"], ck["w2"], w13_scales=ck.get("w13_scales"), w2_scales=ck.get("w2_scales"))
    return ck, W


def hidden_states(T: int, H: int, seed: int, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def router_inputs(T: int, H: int, E: int, dtype: torch.dtype, seed: int, with_bias: bool):
    """hidden ~ N(0, 1); gate rows ~ N(0, 1/H) so logits ~ N(0, 1); bias ~ 0.1·N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    gate = (torch.randn(E, H, generator=g) / math.sqrt(H)).to(DEVICE, dtype)
    bias = (0.1 * torch.randn(E, generator=g)).to(DEVICE) if with_bias else None
    return hidden, gate, bias
