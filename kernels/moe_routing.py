"""The first two steps of the MoE block as Triton kernels: routing and block alignment.

**Router** (:func:`route`): DeepSeek-V3's ``noaux_tc`` — sigmoid gate scores, a
bias-corrected grouped top-k, and the chosen experts' unbiased scores renormalised and
scaled.  The gate GEMM is a torch matmul (bf16/fp16 operands, fp32 logits); the grouped
top-k is one Triton program per token that holds the token's E scores in registers as an
``[n_group, group_size]`` tile and selects by iterated maxima, top_k times.  At verify
sizes (T of 4..64 tokens) the op is a weight-streaming GEMM (E·H·2 = 5.5 MB of bf16 gate
at Kimi-K2.5 shapes) followed by a launch-bound selection.

**Alignment** (:func:`align`, servers' ``moe_align_block_size``): the T·top_k (token,
expert) pairs sorted by expert into runs padded to the expert GEMM's block size.  It is
one launch of one program, with no host synchronisation: a histogram pass, an exclusive
scan over the E experts, a pass that writes the block→expert map and the padding
sentinels, and a stable scatter pass.  Its outputs are sized to the worst case
(:func:`align_capacity`) and the padded total stays on the device; :func:`trim_alignment`
is the host-side helper (a synchronisation) for tests and reports.  One program walking
the pairs in chunks suits the verify step (at most a few thousand pairs); a prefill-size
batch would want a multi-program variant.

Layout: constants → ``@triton.jit`` kernels → the public launchers.  The semantics are
defined by ``moe_reference.router_ref`` and ``moe_reference.align_ref``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from microbench.kernels.checks import check_tensor, require_runnable
from microbench.kernels.moe_reference import RENORM_EPS, align_capacity, check_routing_args

__all__ = ["MAX_EXPERTS", "SUPPORTED_DTYPES", "align", "align_capacity", "expert_segments", "route", "trim_alignment"]

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

# A token's scores live in one block of next_power_of_2(E) registers-worth of lanes:
# 512 covers Kimi-K2.5's 384 experts and DeepSeek-V3's 256, and the alignment kernel's
# [chunk, E] compare tiles stay at 16K elements.
MAX_EXPERTS = 512

# Activations arrive as bf16 on the GPU; fp16 and fp32 run through the same path.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Pairs per chunk of the alignment kernel: its stable rank is a [chunk, chunk] compare
# and its expert lookup a [chunk, E_BLOCK] one, so 32 keeps both tiles small (16K lanes
# at E_BLOCK = 512) while a verify step's 32..512 pairs take 1..16 chunk iterations.
_ALIGN_CHUNK = 32
# Blocks per iteration of the block-map pass: a [16, E_BLOCK] compare, as above.
_ALIGN_BLOCKS = 16
_ALIGN_WARPS = 4

# torch.mm(..., out_dtype=torch.float32) (CUDA, torch >= 2.8) gives fp32 logits from
# half operands without an fp32 copy of the gate weight; None until first tried.
_MM_OUT_DTYPE: bool | None = None


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _grouped_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, scale,
                         GS: tl.constexpr, N_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                         G_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
                         EPS: tl.constexpr):
    """Grouped top-k of one token's logits row: ids [TOP_K] int32, weights [TOP_K] fp32.

    logits: contiguous [T, E] fp32; expert g*GS + s sits at tile lane (g, s).  The group
    shape and the k's are compile-time: a model has one routing configuration.
    """
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_BLOCK)[:, None]
    s = tl.arange(0, S_BLOCK)[None, :]
    valid = (g < N_GROUP) & (s < GS)
    # Padded lanes (s >= GS) alias the next group's expert numbers, so every lookup by
    # expert number below is also masked by `valid`.
    expert = g * GS + s  # [G_BLOCK, S_BLOCK]
    x = tl.load(logits_ptr + t * E + expert, mask=valid, other=0.0)
    scores = tl.where(valid, tl.sigmoid(x), 0.0)
    biased = scores
    if HAS_BIAS:
        biased = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    neg_inf = float("-inf")
    biased = tl.where(valid, biased, neg_inf)
    big = E + G_BLOCK * S_BLOCK  # larger than any lane index, for "lowest index" mins

    if TOPK_GROUP < N_GROUP:
        # Group score with a correction bias (noaux_tc) = sum of its two best biased
        # scores: take the max, remove its first lane, take the max again (a one-expert
        # group scores its one expert); without one, its best score (DeepSeek-V3's Gate).
        m1 = tl.max(biased, axis=1)
        first = tl.min(tl.where(biased == m1[:, None], s, big), axis=1)
        m2 = tl.max(tl.where(s == first[:, None], neg_inf, biased), axis=1)
        if GS > 1 and HAS_BIAS:
            gscore = m1 + m2
        else:
            gscore = m1
        gidx = tl.arange(0, G_BLOCK)
        gscore = tl.where(gidx < N_GROUP, gscore, neg_inf)
        kept = gidx < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gscore, axis=0)
            pick = tl.min(tl.where(gscore == best, gidx, big), axis=0)
            kept = kept | (gidx == pick)
            gscore = tl.where(gidx == pick, neg_inf, gscore)
        biased = tl.where(kept[:, None], biased, neg_inf)

    # Iterated maxima over the lanes not yet chosen: best first, ties to the lowest expert
    # id, as the reference's stable sort. Chosen lanes are tracked apart from their
    # scores: where fewer than TOP_K lanes are finite (a -inf bias masking experts), the
    # rest are taken among the -inf ones in id order, never one twice; a NaN score (no
    # lane equals the max) takes the lowest open lane. A padded lane is never open.
    kk = tl.arange(0, K_BLOCK)
    out_ids = tl.zeros([K_BLOCK], dtype=tl.int32)
    out_w = tl.zeros([K_BLOCK], dtype=tl.float32)
    chosen = expert < 0  # all False
    for i in tl.static_range(TOP_K):
        open_ = valid & (chosen == 0)
        cand = tl.where(open_, biased, neg_inf)
        best = tl.max(tl.max(cand, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(open_ & (cand == best), expert, big), axis=1), axis=0)
        lowest = tl.min(tl.min(tl.where(open_, expert, big), axis=1), axis=0)
        pick = tl.where(pick == big, lowest, pick)
        hit = (expert == pick) & valid
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        out_ids = tl.where(kk == i, pick, out_ids)
        out_w = tl.where(kk == i, w, out_w)
        chosen = chosen | hit

    if RENORM:
        out_w = out_w / (tl.sum(out_w, axis=0) + EPS)
    kmask = kk < TOP_K
    tl.store(w_ptr + t * TOP_K + kk, out_w * scale, mask=kmask)
    tl.store(ids_ptr + t * TOP_K + kk, out_ids, mask=kmask)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, blocks_ptr, npad_ptr, seg_e_ptr, seg_start_ptr, seg_cnt_ptr, nseg_ptr,
                  N, E, BS, NUM_BLOCKS, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr, BB: tl.constexpr,
                  BS_BLOCK: tl.constexpr, BLOCK_MAP: tl.constexpr, SEGMENTS: tl.constexpr):
    """Sort N pairs by expert into BS-padded runs; one program, four passes.

    Every output entry is written exactly once and no pass reads what another wrote, so
    the passes need no barrier.  Pairs whose id is outside 0..E-1 are dropped.
    ``BLOCK_MAP``: write the block -> expert map and padding sentinels (pass 3).
    ``SEGMENTS``: also write the touched experts in id order as segments — expert,
    start, count, and how many — for kernels that take one expert's pairs whole.
    """
    e = tl.arange(0, E_BLOCK)
    ci = tl.arange(0, CHUNK)

    # 1. Histogram: counts[e] = number of pairs routed to expert e.
    counts = tl.zeros([E_BLOCK], dtype=tl.int32)
    for c0 in range(0, N, CHUNK):
        p = c0 + ci
        ids = tl.load(ids_ptr + p, mask=p < N, other=-1)
        ok = (p < N) & (ids >= 0) & (ids < E)
        hit = (ids[:, None] == e[None, :]) & ok[:, None]
        counts += tl.sum(hit.to(tl.int32), axis=0)

    # 2. Exclusive scan of the padded counts: expert e owns [starts[e], ends[e]).
    padded = (counts + BS - 1) // BS * BS
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(npad_ptr, total)
    if SEGMENTS:
        touched = (counts > 0) & (e < E)
        slot = tl.cumsum(touched.to(tl.int32), axis=0) - 1
        tl.store(seg_e_ptr + slot, e, mask=touched)
        tl.store(seg_start_ptr + slot, starts, mask=touched)
        tl.store(seg_cnt_ptr + slot, counts, mask=touched)
        tl.store(nseg_ptr, tl.sum(touched.to(tl.int32), axis=0))

    # 3. Block map and sentinels: block b starts at b*BS and belongs to the first expert
    #    whose run ends after it (empty experts end where they start, so they are passed
    #    over); an entry of it past that expert's count, or past the total, is padding.
    bi = tl.arange(0, BB)
    col = tl.arange(0, BS_BLOCK)[None, :]
    for b0 in range(0, NUM_BLOCKS if BLOCK_MAP else 0, BB):
        b = b0 + bi
        first = b * BS
        owner = tl.sum(((ends[None, :] <= first[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
        used = first < total
        sel = e[None, :] == owner[:, None]
        own_start = tl.sum(tl.where(sel, starts[None, :], 0), axis=1)
        own_count = tl.sum(tl.where(sel, counts[None, :], 0), axis=1)
        tl.store(blocks_ptr + b, tl.where(used, owner, -1), mask=b < NUM_BLOCKS)
        pos = first[:, None] + col
        pad = (~used[:, None]) | (pos - own_start[:, None] >= own_count[:, None])
        tl.store(sorted_ptr + pos, N, mask=pad & (col < BS) & (b[:, None] < NUM_BLOCKS))

    # 4. Stable scatter: a pair lands at its expert's next free slot (`fill`, carried in
    #    registers across chunks) plus its rank among earlier same-expert pairs of its chunk.
    fill = starts
    cj = tl.arange(0, CHUNK)
    for c0 in range(0, N, CHUNK):
        p = c0 + ci
        ids = tl.load(ids_ptr + p, mask=p < N, other=-1)
        ok = (p < N) & (ids >= 0) & (ids < E)
        same = (ids[:, None] == ids[None, :]) & (cj[None, :] < ci[:, None]) & ok[None, :]
        rank = tl.sum(same.to(tl.int32), axis=1)
        hit = (ids[:, None] == e[None, :]) & ok[:, None]
        base = tl.sum(tl.where(hit, fill[None, :], 0), axis=1)
        tl.store(sorted_ptr + base + rank, p, mask=ok)
        fill += tl.sum(hit.to(tl.int32), axis=0)


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


def _gate_logits(hidden: Tensor, gate_weight: Tensor) -> Tensor:
    """``hidden @ gate_weight.T`` as fp32 ``[T, E]``, accumulated in fp32.

    Half operands on CUDA use ``torch.mm(..., out_dtype=float32)`` where this torch has
    it (no fp32 copy of the 5.5 MB gate per call); elsewhere, and on the CPU, the
    operands are upcast — exact, since every half value is an fp32 value.
    """
    global _MM_OUT_DTYPE
    if hidden.dtype == torch.float32:
        return torch.matmul(hidden, gate_weight.t())
    if hidden.is_cuda and _MM_OUT_DTYPE is not False:
        try:
            out = torch.mm(hidden, gate_weight.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE = False
        else:
            _MM_OUT_DTYPE = True
            return out
    return torch.matmul(hidden.float(), gate_weight.float().t())


def route(
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
    """Route each token to ``top_k`` experts (semantics: ``moe_reference.router_ref``).

    Two launches: the gate GEMM (torch, fp32 logits ``[T, E]``) and one Triton program
    per token for sigmoid, bias, group selection and top-k.  Ties go to the lower id.

    Args:
        hidden: ``[T, H]`` contiguous, float16 / bfloat16 / float32.
        gate_weight: ``[E, H]`` contiguous, hidden's dtype and device, ``E <= MAX_EXPERTS``.
        correction_bias: ``[E]`` contiguous float32 on hidden's device, or ``None``.
        top_k, n_group, topk_group: as ``moe_reference.check_routing_args`` requires.
        routed_scaling_factor: finite; multiplies every weight.
        renormalize: divide the chosen weights by their sum (``norm_topk_prob``).

    Returns:
        ``(weights [T, top_k] float32, ids [T, top_k] int32)``, ids in descending order
        of biased score.

    Raises:
        ValueError: a shape, dtype, device, layout or configuration problem, naming the
            argument, before anything is launched.  TypeError: a non-tensor argument.
    """
    if not isinstance(hidden, Tensor):
        raise TypeError(f"hidden: expected a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected a 2-D [T, H] tensor, got shape {tuple(hidden.shape)}")
    if hidden.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"hidden: dtype {hidden.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    check_tensor("hidden", hidden)
    if not isinstance(gate_weight, Tensor):
        raise TypeError(f"gate_weight: expected a torch.Tensor, got {type(gate_weight).__name__}")
    T, H = hidden.shape
    if gate_weight.dim() != 2 or gate_weight.shape[1] != H:
        raise ValueError(f"gate_weight: expected [E, {H}] to match hidden, got {tuple(gate_weight.shape)}")
    E = gate_weight.shape[0]
    check_tensor("gate_weight", gate_weight, shape=(E, H), like=hidden, like_name="hidden")
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"gate_weight: {E} experts outside 1..{MAX_EXPERTS}")
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, shape=(E,), like_name="the experts of gate_weight")
        if correction_bias.dtype != torch.float32:
            raise ValueError(f"correction_bias: dtype {correction_bias.dtype}, expected torch.float32")
        if correction_bias.device != hidden.device:
            raise ValueError(f"correction_bias: on {correction_bias.device}, but hidden is on {hidden.device}")
    check_routing_args(E, top_k, n_group, topk_group)
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)) \
            or not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor: expected a finite float, got {routed_scaling_factor!r}")
    require_runnable(_grouped_topk_kernel, hidden, "hidden")

    weights = torch.empty(T, top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=hidden.device)
    if T == 0:
        return weights, ids
    logits = _gate_logits(hidden, gate_weight)
    gs = E // n_group
    _grouped_topk_kernel[(T,)](
        logits, correction_bias if correction_bias is not None else logits, weights, ids,
        E, float(routed_scaling_factor), GS=gs, N_GROUP=n_group, TOP_K=top_k,
        TOPK_GROUP=topk_group, HAS_BIAS=correction_bias is not None, RENORM=bool(renormalize),
        G_BLOCK=triton.next_power_of_2(n_group), S_BLOCK=triton.next_power_of_2(gs),
        K_BLOCK=triton.next_power_of_2(top_k), EPS=RENORM_EPS, num_warps=4,
    )
    return weights, ids


def _check_align_args(topk_ids: Tensor, num_experts: int, block_size: int) -> None:
    """The argument rules :func:`align` and :func:`expert_segments` share."""
    check_tensor("topk_ids", topk_ids)
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32:
        raise ValueError(
            f"topk_ids: expected a 2-D int32 tensor, got {topk_ids.dtype} of shape {tuple(topk_ids.shape)}"
        )
    for name, v in (("num_experts", num_experts), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}: expected an int, got {type(v).__name__}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts: {num_experts} outside 1..{MAX_EXPERTS}")
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")


def align(
    topk_ids: Tensor, num_experts: int, block_size: int, *, check: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Sort the routed pairs by expert into block-padded runs (semantics: ``align_ref``).

    One launch, no host synchronisation, so it can sit in a CUDA graph.  The outputs are
    sized to the worst case ``C = align_capacity(T * top_k, num_experts, block_size)``:
    entries from the padded total ``P`` on are the sentinel ``T * top_k`` in
    ``sorted_ids`` and ``-1`` in ``expert_of_block``; ``P`` itself stays on the device.

    An expert id outside ``0 .. num_experts - 1`` is a device-side condition: by default
    (``check=False``) the kernel drops such pairs (they appear nowhere, and nothing is
    written out of bounds); ``check=True`` reads the ids on the host first and raises
    ``ValueError`` (a synchronisation, for tests and debugging).  ``align_ref`` always
    raises.

    Args:
        topk_ids: ``[T, top_k]`` contiguous int32 expert ids (from :func:`route`).
        num_experts: E, ``1 .. MAX_EXPERTS``.
        block_size: rows per block of the expert GEMM, ``>= 1`` (16 and 64 are typical).
        check: validate the id range on the host (synchronises).

    Returns:
        ``(sorted_ids [C] int32, expert_of_block [C / block_size] int32,
        num_padded [] int32)``; :func:`trim_alignment` cuts them to ``P``.

    Raises:
        ValueError: a bad shape, dtype, layout or size (or, with ``check``, an id out of
            range), naming the argument.  TypeError: a non-tensor ``topk_ids``.
    """
    _check_align_args(topk_ids, num_experts, block_size)
    n = topk_ids.numel()
    cap = align_capacity(n, num_experts, block_size)
    if cap + block_size >= 2**31:  # positions and the sentinel are int32
        raise ValueError(f"topk_ids: {n} pairs at block_size {block_size} overflow int32 positions")
    if check and n:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids: expert ids must lie in 0..{num_experts - 1}, got range {lo}..{hi}")
    require_runnable(_align_kernel, topk_ids, "topk_ids")

    dev = topk_ids.device
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_of_block = torch.empty(cap // block_size, dtype=torch.int32, device=dev)
    if n == 0:  # nothing to sort: empty outputs, P = 0
        return sorted_ids, expert_of_block, torch.zeros((), dtype=torch.int32, device=dev)
    num_padded = torch.empty((), dtype=torch.int32, device=dev)  # the kernel writes it
    _align_kernel[(1,)](
        topk_ids, sorted_ids, expert_of_block, num_padded, num_padded, num_padded, num_padded, num_padded,
        n, num_experts, block_size, cap // block_size, CHUNK=_ALIGN_CHUNK,
        E_BLOCK=triton.next_power_of_2(num_experts), BB=_ALIGN_BLOCKS,
        BS_BLOCK=triton.next_power_of_2(block_size), BLOCK_MAP=True, SEGMENTS=False, num_warps=_ALIGN_WARPS,
    )
    return sorted_ids, expert_of_block, num_padded


def expert_segments(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The pairs sorted by expert with no padding, and one segment per touched expert.

    The alignment of :func:`align` at block size 1, plus the list a per-expert kernel
    walks: segment ``s < num_segments`` is expert ``seg_expert[s]`` (increasing ids),
    whose pairs are ``sorted_ids[seg_start[s] : seg_start[s] + seg_count[s]]`` in pair
    order.  One launch, no host synchronisation; ids outside ``0 .. num_experts - 1``
    are dropped.  Entries of the segment arrays from ``num_segments`` on are unwritten.

    Args:
        topk_ids: ``[T, top_k]`` contiguous int32 expert ids.
        num_experts: E, ``1 .. MAX_EXPERTS``.

    Returns:
        ``(sorted_ids [T*top_k] int32, seg_expert [S] int32, seg_start [S] int32,
        seg_count [S] int32, num_segments [] int32)`` with ``S = min(E, T * top_k)``, the
        most experts a routing can touch.

    Raises:
        ValueError: as :func:`align`.
    """
    _check_align_args(topk_ids, num_experts, 1)
    require_runnable(_align_kernel, topk_ids, "topk_ids")
    n = topk_ids.numel()
    dev = topk_ids.device
    s = min(num_experts, n)
    sorted_ids = torch.empty(n, dtype=torch.int32, device=dev)  # segments cover every entry read
    seg = torch.empty(3, max(s, 1), dtype=torch.int32, device=dev)
    counts = torch.zeros(2, dtype=torch.int32, device=dev)  # [padded total, segments]
    if n:
        _align_kernel[(1,)](
            topk_ids, sorted_ids, counts, counts, seg[0], seg[1], seg[2], counts[1:], n, num_experts, 1, 0,
            CHUNK=_ALIGN_CHUNK, E_BLOCK=triton.next_power_of_2(num_experts), BB=_ALIGN_BLOCKS, BS_BLOCK=1,
            BLOCK_MAP=False, SEGMENTS=True, num_warps=_ALIGN_WARPS,
        )
    return sorted_ids, seg[0, :s], seg[1, :s], seg[2, :s], counts[1]


def trim_alignment(
    sorted_ids: Tensor, expert_of_block: Tensor, num_padded: Tensor
) -> tuple[Tensor, Tensor, int]:
    """Cut :func:`align`'s worst-case outputs to the padded total ``P`` (a host sync).

    Returns ``(sorted_ids[:P], expert_of_block[:P / block_size], P)``, the shapes
    ``align_ref`` returns.
    """
    p = int(num_padded)
    if sorted_ids.numel() == 0:
        return sorted_ids, expert_of_block, p
    block_size = sorted_ids.numel() // expert_of_block.numel()
    return sorted_ids[:p], expert_of_block[: p // block_size], p
