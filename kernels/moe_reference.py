"""Torch references for the MoE block of DeepSeek-V3-family models, one function per op.

Each reference is the single source of truth for its op's semantics: the CPU tests and
the benchmark cases both import it, and no other copy exists.  Scores are formed and
returned in fp32 (the correctness gate compares in fp32), and ties are broken by the
lower index, so every reference is deterministic.

The MoE block of one layer runs, in order: the **router** (gate GEMM + grouped top-k,
DeepSeek-V3's ``noaux_tc``), the **alignment** of the (token, expert) pairs into
expert-contiguous, block-padded runs (what servers call ``moe_align_block_size``), and
the grouped expert GEMMs that consume those runs: per (token, expert) pair,
``w2 @ (SiLU(gate) * up)`` with ``[gate; up] = w13 @ x``, scaled by the router weight and
summed over the token's ``top_k`` experts.

Contents
--------
- :func:`check_routing_args` — the argument rules shared by the router reference and
  its kernel (``ValueError`` naming the argument).
- :func:`router_ref`, :func:`router_cost` — sigmoid gate, bias-corrected grouped top-k,
  renormalised and scaled weights.
- :func:`align_ref`, :func:`align_cost`, :func:`align_capacity` — pairs sorted by
  expert, each expert's run padded to a multiple of the block size.
- :func:`pack_int4`, :func:`unpack_int4`, :func:`check_int4_weight` — the checkpoint's
  W4A16 layout (below).
- :func:`fused_moe_ref`, :func:`moe_cost` — the expert GEMMs with the top-k reduction.

INT4 layout (Kimi-K2.5's routed experts, compressed-tensors ``pack-quantized``)
------------------------------------------------------------------------------
A weight ``[E, N, K]`` (N output channels, K inputs) is stored as

- ``qweight`` int32 ``[E, N, K / 8]``: element ``k`` of row ``n`` is the 4-bit nibble at
  bits ``4 * (k % 8)`` of word ``k // 8``, holding ``q + 8`` for a symmetric ``q`` in
  ``-8 .. 7``;
- ``scales`` ``[E, N, K / group_size]`` (bf16, ``group_size`` 32): one scale per 32
  consecutive inputs of an output channel;

and ``w[e, n, k] = (nibble - 8) * scales[e, n, k // group_size]``.  Activations stay
bf16 (W4A16).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "INT4_PER_WORD",
    "align_capacity",
    "align_cost",
    "align_ref",
    "check_int4_weight",
    "check_routing_args",
    "fused_moe_ref",
    "moe_cost",
    "pack_int4",
    "router_cost",
    "router_ref",
    "unpack_int4",
]

#: 4-bit values per int32 word, packed along the input (K) dimension.
INT4_PER_WORD = 8

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
                 (the one score when a group holds a single expert); with no
                 correction_bias, the group's largest score (DeepSeek-V3's Gate)
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
    # a group's score: with the correction bias the sum of its two best biased scores, without
    # it its best score (DeepSeek-V3's Gate, vLLM's and SGLang's grouped top-k)
    if correction_bias is None:
        group_score = grouped.amax(dim=-1)  # [T, n_group]
    else:
        group_score = grouped.topk(min(2, gs), dim=-1).values.sum(dim=-1)
    # A stable descending sort puts equal scores in index order: ties go to the lower id.
    group_order = torch.sort(group_score, dim=-1, descending=True, stable=True).indices
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


# --------------------------------------------------------------------------------------
# INT4 weights (W4A16, symmetric, group-wise scales)
# --------------------------------------------------------------------------------------


def check_int4_weight(name: str, qweight: Tensor, scales: Tensor, k: int | None = None) -> int:
    """Check a packed weight against the checkpoint layout; return its group size.

    ``qweight`` must be int32 ``[E, N, K / 8]`` and ``scales`` a float tensor
    ``[E, N, K / group_size]`` with ``group_size`` a multiple of 8 dividing ``K``; with
    ``k`` given, ``K`` must equal it.  ``ValueError`` names ``name`` (or its scales).
    """
    for what, t in ((name, qweight), (f"{name}_scales", scales)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if qweight.dtype != torch.int32 or qweight.dim() != 3:
        raise ValueError(f"{name}: packed INT4 expects a 3-D int32 [E, N, K/8] tensor, "
                         f"got {qweight.dtype} of shape {tuple(qweight.shape)}")
    e, n, kw = qweight.shape
    kk = kw * INT4_PER_WORD
    if k is not None and kk != k:
        raise ValueError(f"{name}: packed shape {tuple(qweight.shape)} holds K = {kk} inputs, expected {k} "
                         f"(K/8 = {k / INT4_PER_WORD:g} words per row)")
    sname = f"{name}_scales"
    if not scales.is_floating_point() or scales.dim() != 3 or tuple(scales.shape[:2]) != (e, n):
        raise ValueError(f"{sname}: expected a float [{e}, {n}, K/group_size] tensor, "
                         f"got {scales.dtype} of shape {tuple(scales.shape)}")
    groups = scales.shape[2]
    if groups < 1 or kk % groups or (kk // groups) % INT4_PER_WORD:
        raise ValueError(f"{sname}: {groups} groups do not split K = {kk} into whole groups of a multiple "
                         f"of {INT4_PER_WORD} inputs")
    return kk // groups


def pack_int4(w: Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """Quantise ``w [E, N, K]`` to the INT4 checkpoint layout (module docstring).

    Symmetric, round to nearest, as compressed-tensors quantises: ``scale = max|w| / 7.5``
    (half the range -8..7) over each group of ``group_size`` inputs (rounded to
    ``scale_dtype`` first, so unpacking with the stored scale is what a kernel sees),
    ``q = clamp(round(w / scale), -8, 7)``: a group's most negative weight may be -8, the
    nibble 0, as in real checkpoints.

    Returns:
        ``(qweight int32 [E, N, K / 8], scales scale_dtype [E, N, K / group_size])``.

    Raises:
        ValueError: ``w`` not 3-D float, or ``group_size`` not a multiple of 8 dividing K.
    """
    if w.dim() != 3 or not w.is_floating_point():
        raise ValueError(f"w: expected a 3-D float [E, N, K] tensor, got {w.dtype} of shape {tuple(w.shape)}")
    e, n, k = w.shape
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < INT4_PER_WORD \
            or group_size % INT4_PER_WORD or k % group_size:
        raise ValueError(f"group_size: must be a multiple of {INT4_PER_WORD} dividing K = {k}, got {group_size!r}")
    g = w.float().view(e, n, k // group_size, group_size)
    scale = (g.abs().amax(dim=-1) / 7.5).clamp_min(1e-8).to(scale_dtype)
    q = torch.round(g / scale.float()[..., None]).clamp_(-8, 7).to(torch.int32) + 8  # 0..15
    q = q.view(e, n, k // INT4_PER_WORD, INT4_PER_WORD)
    shifts = torch.arange(0, 4 * INT4_PER_WORD, 4, dtype=torch.int32, device=w.device)
    # the top nibble's bit 3 lands on the sign bit: summing in int64 and narrowing keeps it
    words = (q.to(torch.int64) << shifts.to(torch.int64)).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.contiguous(), scale.contiguous()


def unpack_int4(qweight: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The dequantised weight ``[E, N, K]`` of a packed one (layout: module docstring)."""
    gs = check_int4_weight("qweight", qweight, scales)
    e, n, kw = qweight.shape
    shifts = torch.arange(0, 4 * INT4_PER_WORD, 4, dtype=torch.int32, device=qweight.device)
    nib = (qweight[..., None] >> shifts) & 0xF  # arithmetic shift, then the low 4 bits
    q = (nib - 8).view(e, n, kw * INT4_PER_WORD).float()
    s = scales.float().repeat_interleave(gs, dim=-1)
    return (q * s).to(dtype)


# --------------------------------------------------------------------------------------
# Fused experts (w13 -> SiLU-and-mul -> w2, weighted sum over the top-k)
# --------------------------------------------------------------------------------------


def fused_moe_ref(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    w13_scales: Tensor | None = None,
    w2_scales: Tensor | None = None,
) -> Tensor:
    """The routed experts of one MoE layer in fp32: ``[T, H]``.

    Semantics, per token t and choice j with expert ``e = topk_ids[t, j]``::

        [g; u] = w13[e] @ x[t]                    # w13[e]: [2I, H], gate rows first
        y      = w2[e] @ (silu(g) * u)            # w2[e]:  [H, I]
        out[t] = sum_j topk_weights[t, j] * y

    Weights are dense ``[E, 2I, H]`` / ``[E, H, I]`` floats, or, with ``w13_scales`` and
    ``w2_scales``, INT4 in the checkpoint layout (:func:`pack_int4`), dequantised exactly
    (one touched expert at a time, so a 384-expert layer never exists in fp32).

    Args:
        hidden: ``[T, H]`` float.
        w13, w2: the expert weights (dense or packed, see above).
        topk_weights: ``[T, top_k]`` float router weights.
        topk_ids: ``[T, top_k]`` int expert ids in ``0 .. E - 1``, or ``-1`` for an expert
            held by another rank (expert parallelism): that pair contributes nothing.

    Cost per call (see :func:`moe_cost`; ``D`` = distinct experts in ``topk_ids``, ``b``
    = bytes per weight element, 2 for bf16, 1/2 for INT4 plus 2 / group per scale):
        bytes = D · (2I·H + H·I) · b (touched weights, each read once) + 2 · T·H · e
        (hidden in, output out) + 8 · T·top_k (router weights and ids)
        FLOPs = 2 · T·top_k · (2I·H + H·I)
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected a 2-D [T, H] tensor, got shape {tuple(hidden.shape)}")
    t, h = hidden.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids / topk_weights: expected matching [{t}, top_k] tensors, got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    packed = w13_scales is not None
    if packed != (w2_scales is not None):
        raise ValueError("w13_scales / w2_scales: give both (INT4 weights) or neither (dense weights)")
    e = w13.shape[0]
    if packed:
        check_int4_weight("w13", w13, w13_scales, k=h)
        i2 = w13.shape[1]
        check_int4_weight("w2", w2, w2_scales, k=i2 // 2)
    else:
        i2 = w13.shape[1]
        if w13.dim() != 3 or w13.shape[2] != h:
            raise ValueError(f"w13: expected [E, 2I, {h}], got {tuple(w13.shape)}")
    if i2 % 2 or w2.shape[0] != e or w2.shape[1] != h or (not packed and tuple(w2.shape) != (e, h, i2 // 2)):
        raise ValueError(f"w2: expected [{e}, {h}, {i2 // 2}] to match w13 {tuple(w13.shape)}, got {tuple(w2.shape)}")
    ids = topk_ids.long()
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= e):
        raise ValueError(f"topk_ids: expert ids must lie in 0..{e - 1} (or -1: another rank's), "
                         f"got range {int(ids.min())}..{int(ids.max())}")

    x = hidden.float()
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    for ex in [v for v in torch.unique(ids).tolist() if v >= 0]:
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        if packed:
            a = unpack_int4(w13[ex:ex + 1], w13_scales[ex:ex + 1])[0]
            b = unpack_int4(w2[ex:ex + 1], w2_scales[ex:ex + 1])[0]
        else:
            a, b = w13[ex].float(), w2[ex].float()
        gu = x[tok] @ a.T
        g, u = gu[:, : i2 // 2], gu[:, i2 // 2:]
        y = (torch.nn.functional.silu(g) * u) @ b.T
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out


def moe_cost(T: int, H: int, I: int, top_k: int, distinct: int, weights: str, elem_bytes: int = 2,
             group_size: int = 32, scale_bytes: int = 2) -> tuple[int, int]:
    """Bytes and FLOPs of one fused-experts call (formula in :func:`fused_moe_ref`).

    ``I`` is the per-rank intermediate size (w13 has 2I rows), ``distinct`` the experts
    the routing touches, ``weights`` ``"bf16"`` (dense, in the activations' dtype of
    ``elem_bytes``: bf16 on a GPU, fp16 or fp32 on CPU) or ``"int4"`` (with scales of
    ``scale_bytes`` per ``group_size`` inputs).

    Returns:
        ``(bytes, flops)``.
    """
    if weights not in ("bf16", "int4"):
        raise ValueError(f"weights: expected 'bf16' or 'int4', got {weights!r}")
    if min(H, I, top_k, elem_bytes) < 1 or T < 0 or distinct < 0:
        raise ValueError(f"moe_cost: need T, distinct >= 0 and H, I, top_k >= 1; "
                         f"got {T}, {distinct}, {H}, {I}, {top_k}")
    per_expert = 3 * I * H  # 2I·H (w13) + H·I (w2) elements
    if weights == "bf16":
        wbytes = per_expert * elem_bytes
    else:
        wbytes = per_expert // 2 + per_expert // group_size * scale_bytes
    nbytes = distinct * wbytes + 2 * T * H * elem_bytes + 8 * T * top_k
    return nbytes, 2 * T * top_k * per_expert
