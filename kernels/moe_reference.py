"""Torch references for the MoE block of DeepSeek-V3-family models, one function per op.

Each reference is the single source of truth for its op's semantics: the CPU tests and
the benchmark cases both import it, and no other copy exists.  Scores are formed and
returned in fp32 (the correctness gate compares in fp32), and ties are broken by the
lower index, so every reference is deterministic.

The MoE block of one layer runs, in order: the **router** (gate GEMM + grouped top-k,
DeepSeek-V3's ``noaux_tc``), the **alignment** of the (token, expert) pairs into
expert-contiguous, block-padded runs (what servers call ``moe_align_block_size``), and
the grouped expert GEMMs that consume those runs.

Contents
--------
- :func:`check_routing_args` — the argument rules shared by the router reference and
  its kernel (``ValueError`` naming the argument).
- :func:`router_ref`, :func:`router_cost` — sigmoid gate, bias-corrected grouped top-k,
  renormalised and scaled weights.
- :func:`align_ref`, :func:`align_cost`, :func:`align_capacity` — pairs sorted by
  expert, each expert's run padded to a multiple of the block size.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "align_capacity",
    "align_cost",
    "align_ref",
    "check_routing_args",
    "router_cost",
    "router_ref",
]

# Added to the renormalisation denominator as Hugging Face's DeepSeek-V3 / Kimi-K2 gate
# does; sigmoid scores are positive, so it only matters if every chosen score underflows.
RENORM_EPS = 1e-20


# --------------------------------------------------------------------------------------
# Router (sigmoid gate + grouped top-k, "noaux_tc")
# --------------------------------------------------------------------------------------


def check_routing_args(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Raise ``ValueError`` (naming the argument) unless the routing configuration is valid.

    Rules: ``num_experts >= 1``; ``1 <= top_k <= num_experts``; ``n_group >= 1`` divides
    ``num_experts``; ``1 <= topk_group <= n_group``; and the kept groups hold enough
    experts, ``top_k <= topk_group * (num_experts / n_group)``.
    """
    for name, v in (("num_experts", num_experts), ("top_k", top_k), ("n_group", n_group),
                    ("topk_group", topk_group)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}: expected an int, got {type(v).__name__}")
    if num_experts < 1:
        raise ValueError(f"num_experts: must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: must be in 1..{num_experts} (the number of experts), got {top_k}")
    if n_group < 1 or num_experts % n_group != 0:
        raise ValueError(f"n_group: must be >= 1 and divide the {num_experts} experts, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: must be in 1..{n_group} (n_group), got {topk_group}")
    kept = topk_group * (num_experts // n_group)
    if top_k > kept:
        raise ValueError(
            f"top_k: {top_k} exceeds the {kept} experts in the {topk_group} kept groups "
            f"(topk_group * num_experts / n_group)"
        )


def router_ref(
    hidden: Tensor,
    gate_weight: Tensor,
    correction_bias: Tensor | None,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    renormalize: bool = True,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's ``noaux_tc`` router in fp32: which ``top_k`` experts each token uses.

    Semantics (all in fp32 on fp32 copies of the inputs)::

        scores = sigmoid(hidden @ gate_weight.T)                  # [T, E]
        biased = scores + correction_bias                         # chooses, never weighs
        group  = sum of the 2 largest biased scores in each of the n_group groups
                 (the one score when a group holds a single expert)
        keep the topk_group best groups; experts of the others are masked to -inf
        ids    = the top_k experts by biased score among the kept, best first
        w      = scores[ids] (unbiased), / (sum(w) + 1e-20) if renormalize,
                 * routed_scaling_factor

    Ties (equal group scores, equal biased scores) go to the lower group / expert id.
    ``renormalize`` is the model's ``norm_topk_prob``; with ``top_k == 1`` it makes the
    weight exactly 1 before scaling (servers renormalise for every top_k).

    Model settings: Kimi-K2.5 E=384, n_group=1, topk_group=1, top_k=8, factor 2.827;
    DeepSeek-V3 E=256, n_group=8, topk_group=4, top_k=8, factor 2.5.

    Args:
        hidden: ``[T, H]`` hidden states, any float dtype.
        gate_weight: ``[E, H]`` router weight, any float dtype.
        correction_bias: ``[E]`` the ``e_score_correction_bias``, or ``None`` for none.
        top_k, n_group, topk_group: see :func:`check_routing_args`.
        routed_scaling_factor: multiplies every weight.
        renormalize: divide the chosen weights by their sum first.

    Returns:
        ``(topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32)``, ids in descending
        order of biased score.

    Cost per call (see :func:`router_cost`; ``e`` = element size of hidden / gate):
        bytes = T·H·e (hidden) + E·H·e (gate weight) + 4·E (bias) + 8·T·top_k (outputs)
        FLOPs = 2·T·H·E (gate GEMM) + T·E (bias add); the T·E sigmoids and the
        selection's compares are not counted.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected a 2-D [T, H] tensor, got shape {tuple(hidden.shape)}")
    if gate_weight.dim() != 2 or gate_weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"gate_weight: expected [E, {hidden.shape[1]}] to match hidden, got {tuple(gate_weight.shape)}"
        )
    E = gate_weight.shape[0]
    if correction_bias is not None and tuple(correction_bias.shape) != (E,):
        raise ValueError(f"correction_bias: expected shape ({E},), got {tuple(correction_bias.shape)}")
    check_routing_args(E, top_k, n_group, topk_group)
    T = hidden.shape[0]

    scores = torch.sigmoid(hidden.float() @ gate_weight.float().T)  # [T, E]
    biased = scores if correction_bias is None else scores + correction_bias.float()

    gs = E // n_group
    grouped = biased.view(T, n_group, gs)
    top2 = grouped.topk(min(2, gs), dim=-1).values.sum(dim=-1)  # [T, n_group]
    # A stable descending sort puts equal scores in index order: ties go to the lower id.
    group_order = torch.sort(top2, dim=-1, descending=True, stable=True).indices
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=hidden.device)
    keep.scatter_(1, group_order[:, :topk_group], True)
    masked = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)

    ids = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def router_cost(T: int, H: int, E: int, top_k: int, elem_bytes: int) -> tuple[int, int]:
    """Bytes moved and FLOPs done by one router call (formula in :func:`router_ref`).

    The fp32 ``[T, E]`` logits between the gate GEMM and the top-k kernel are an
    implementation's intermediate, not part of the floor.

    Returns:
        ``(bytes, flops)``.
    """
    if T < 0 or H < 1 or E < 1 or top_k < 1 or elem_bytes < 1:
        raise ValueError(
            f"router_cost: need T >= 0 and H, E, top_k, elem_bytes >= 1; got {T}, {H}, {E}, {top_k}, {elem_bytes}"
        )
    nbytes = (T * H + E * H) * elem_bytes + 4 * E + 8 * T * top_k
    return nbytes, 2 * T * H * E + T * E


# --------------------------------------------------------------------------------------
# Alignment ("moe_align_block_size")
# --------------------------------------------------------------------------------------


def align_capacity(num_pairs: int, num_experts: int, block_size: int) -> int:
    """The largest padded length ``P`` any routing of ``num_pairs`` pairs can need.

    Each expert that receives pairs pads by at most ``block_size - 1``, and at most
    ``min(num_experts, num_pairs)`` experts receive any, so
    ``P <= num_pairs + min(num_experts, num_pairs) * (block_size - 1)``; the bound is
    rounded up to a multiple of ``block_size`` so it is a whole number of blocks.
    """
    if num_pairs < 0 or num_experts < 1 or block_size < 1:
        raise ValueError(
            f"align_capacity: need num_pairs >= 0, num_experts >= 1, block_size >= 1; "
            f"got {num_pairs}, {num_experts}, {block_size}"
        )
    bound = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return -(-bound // block_size) * block_size


def align_ref(topk_ids: Tensor, num_experts: int, block_size: int) -> tuple[Tensor, Tensor, int]:
    """Pairs sorted by expert, each expert's run padded to a multiple of ``block_size``.

    Pair ``p = t * top_k + j`` is token t's j-th choice, ``topk_ids[t, j]``.  The pairs
    are sorted by expert, stably (in pair order within an expert); each expert's run is
    padded to a multiple of ``block_size`` with the sentinel ``T * top_k``; an expert
    with no pairs takes no blocks.  ``P`` is the padded total, and block ``i`` (entries
    ``i*block_size .. (i+1)*block_size - 1``) belongs to expert ``expert_of_block[i]``.

    Args:
        topk_ids: ``[T, top_k]`` int32 expert ids, each in ``0 .. num_experts - 1``.
        num_experts: E.
        block_size: rows per block of the expert GEMM that consumes the runs.

    Returns:
        ``(sorted_ids [P] int32, expert_of_block [P / block_size] int32, P)``.

    Raises:
        ValueError: a bad shape, dtype, size, or an expert id out of range.

    Cost per call (see :func:`align_cost`): bytes = 4·T·top_k (read ids)
    + 4·P (write sorted ids) + 4·P / block_size (write block experts); no FLOPs.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32:
        raise ValueError(
            f"topk_ids: expected a 2-D int32 tensor, got {topk_ids.dtype} of shape {tuple(topk_ids.shape)}"
        )
    align_capacity(0, num_experts, block_size)  # validates num_experts and block_size
    flat = topk_ids.reshape(-1).to(torch.long)
    n = flat.numel()
    if n and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(
            f"topk_ids: expert ids must lie in 0..{num_experts - 1}, "
            f"got range {int(flat.min())}..{int(flat.max())}"
        )
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    sorted_parts: list[Tensor] = []
    block_parts: list[Tensor] = []
    pos = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        padded = -(-c // block_size) * block_size
        run = torch.full((padded,), n, dtype=torch.int32)
        run[:c] = order[pos:pos + c].to(torch.int32).cpu()
        sorted_parts.append(run)
        block_parts.append(torch.full((padded // block_size,), e, dtype=torch.int32))
        pos += c
    empty = torch.empty(0, dtype=torch.int32)
    sorted_ids = torch.cat(sorted_parts) if sorted_parts else empty
    expert_of_block = torch.cat(block_parts) if block_parts else empty
    dev = topk_ids.device
    return sorted_ids.to(dev), expert_of_block.to(dev), int(sorted_ids.numel())


def align_cost(num_pairs: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """Bytes moved by one alignment call whose outputs are sized to the worst case.

    A launcher that never synchronises cannot know ``P`` and writes every entry of its
    :func:`align_capacity`-sized outputs, so that is the floor counted here
    (:func:`align_ref`'s docstring gives the data-dependent minimum), plus the 4-byte
    padded total.

    Returns:
        ``(bytes, 0)`` — the op does no floating-point work.
    """
    cap = align_capacity(num_pairs, num_experts, block_size)
    return 4 * num_pairs + 4 * cap + 4 * (cap // block_size) + 4, 0
