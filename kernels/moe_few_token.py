"""A fused-experts kernel for few tokens (verify: T <= 64): each touched expert's weights
are streamed once, split over N and K for parallelism, with no row padding.

At T = 4 verify tokens and top-8 routing, Kimi-K2.5 TP8 touches up to 32 of 384 experts
(31 on average with uniform choices; the benchmark's router draw, whose shared correction
bias concentrates them, averages 28), mostly one token each: the layer is a weight stream
(~96 MB of INT4 + scales at 31), not a GEMM.  The
server kernel (``moe_fused``) pads each touched expert to a 16-row block and sizes its
grid for many tokens.  Here the unit of work is an expert **segment** — all of one
expert's pairs — so every program holds all of its expert's tokens in one tile (up to 64
rows), and the grid is (segment, N tile, K split):

1. ``moe_routing.expert_segments``: the pairs sorted by expert, one segment per touched
   expert (one launch, no padding, no host synchronisation).
2. ``_few_w13_kernel``: for its segment, N tile of the intermediate and K range of H, the
   gate and the up columns together (so SiLU(gate) * up needs no second pass); K-split
   partial sums go to an fp32 workspace ``[split, pairs, 2I]`` — it also zeroes the fp32
   output accumulator for step 3, so no memset launch.
3. ``_few_w2_kernel``: for its segment, N tile of H and K range of I: sums the step-2
   partials, applies SiLU(gate) * up in registers, multiplies by w2's tile, scales by the
   router weight, and adds into the token's output row with fp32 atomics — the top-k
   reduction is fused (no per-pair [pairs, H] buffer, no sum pass).
4. One cast of the fp32 accumulator to the output dtype.

Each weight tile is read by exactly one program when no expert holds more than the tile's
rows (always so for T <= 64 with distinct ids per token); a segment longer than that is
walked in row chunks, re-reading its weights (correct, not fast: that is prefill's regime).
The order in which fp32 atomics land is not fixed, so the last bits of the output may
differ between runs.

Layout: constants → ``@triton.jit`` kernels → the public launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from microbench.kernels.checks import require_runnable, small_shared
from microbench.kernels.moe_common import ExpertWeights, _int4_tile_once, _mma, _weight_tile, check_moe_args
from microbench.kernels.moe_tuning import MAX_TILE_ROWS, GemmConfig, default_config, tile_rows
from microbench.kernels.moe_routing import expert_segments

__all__ = ["MAX_TILE_ROWS", "few_token_moe"]

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

# Elements zeroed per step of the accumulator clear in the w13 kernel (T*H fp32, at most
# 64 x 7168 = 1.8 MB, spread over every program of the grid).
_ZERO_BLOCK = 1024


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _few_w13_kernel(x_ptr, w_ptr, s_ptr, part_ptr, acc_ptr, sorted_ptr, seg_e_ptr, seg_start_ptr, seg_cnt_ptr,
                    nseg_ptr, I, K, num_pairs, acc_numel, k_per_split,
                    stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
                    TOP_K: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, M_TILE: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ZERO_BLOCK: tl.constexpr,
                    UNPACK: tl.constexpr = 0):
    """Gate and up partial sums of one (segment, N tile, K split) into ``part``."""
    seg = tl.program_id(0)
    pn = tl.program_id(1)
    ps = tl.program_id(2)
    # every program clears its share of the w2 kernel's fp32 accumulator first
    nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    lin = (seg * tl.num_programs(1) + pn) * tl.num_programs(2) + ps
    share = tl.cdiv(acc_numel, nprog)
    z_end = tl.minimum((lin + 1) * share, acc_numel)
    for z0 in range(lin * share, z_end, ZERO_BLOCK):
        z = z0 + tl.arange(0, ZERO_BLOCK)
        tl.store(acc_ptr + z, tl.zeros([ZERO_BLOCK], dtype=tl.float32), mask=z < z_end)
    if seg >= tl.load(nseg_ptr):
        return
    expert = tl.load(seg_e_ptr + seg).to(tl.int64)
    start = tl.load(seg_start_ptr + seg)
    count = tl.load(seg_cnt_ptr + seg)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    k_lo = ps * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    offs_k = tl.arange(0, BLOCK_K)
    for r0 in range(0, count, M_TILE):  # one pass when the expert's tokens fit one tile
        rows = r0 + tl.arange(0, M_TILE)
        row_ok = rows < count
        pairs = tl.load(sorted_ptr + start + rows, mask=row_ok, other=0)
        x_rows = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * K
        acc_g = tl.zeros([M_TILE, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([M_TILE, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < k_hi
            a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if INT4 and UNPACK:
                wg = _int4_tile_once(w_base, s_base, k0, k_hi, offs_n, n_ok, stride_wk, stride_wn, stride_sk,
                                     stride_sn, GROUP, BLOCK_K, BLOCK_N)
                wu = _int4_tile_once(w_base, s_base, k0, k_hi, offs_n + I, n_ok, stride_wk, stride_wn, stride_sk,
                                     stride_sn, GROUP, BLOCK_K, BLOCK_N)
            else:
                wmask = k_ok[:, None] & n_ok[None, :]
                wg = _weight_tile(w_base, s_base, k, offs_n, wmask, stride_wk, stride_wn, stride_sk, stride_sn,
                                  INT4, GROUP)
                wu = _weight_tile(w_base, s_base, k, offs_n + I, wmask, stride_wk, stride_wn, stride_sk, stride_sn,
                                  INT4, GROUP)
            acc_g += _mma(a, wg)
            acc_u += _mma(a, wu)
        out = part_ptr + ps.to(tl.int64) * num_pairs * 2 * I + (start + rows).to(tl.int64)[:, None] * 2 * I
        omask = row_ok[:, None] & n_ok[None, :]
        tl.store(out + offs_n[None, :], acc_g, mask=omask)
        tl.store(out + I + offs_n[None, :], acc_u, mask=omask)


@triton.jit
def _few_w2_kernel(x_ptr, w_ptr, s_ptr, part_ptr, acc_ptr, topk_w_ptr, sorted_ptr, seg_e_ptr, seg_start_ptr,
                   seg_cnt_ptr, nseg_ptr, H, I, split_stride, k_per_split,
                   stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
                   TOP_K: tl.constexpr, SPLIT_IN: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr,
                   M_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNPACK: tl.constexpr = 0):
    """``acc[token] += w * (w2[e] @ (silu(g) * u))`` for one (segment, N tile, K split)."""
    seg = tl.program_id(0)
    if seg >= tl.load(nseg_ptr):
        return
    pn = tl.program_id(1)
    ps = tl.program_id(2)
    expert = tl.load(seg_e_ptr + seg).to(tl.int64)
    start = tl.load(seg_start_ptr + seg)
    count = tl.load(seg_cnt_ptr + seg)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    k_lo = ps * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, I)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    offs_k = tl.arange(0, BLOCK_K)
    for r0 in range(0, count, M_TILE):
        rows = r0 + tl.arange(0, M_TILE)
        row_ok = rows < count
        pairs = tl.load(sorted_ptr + start + rows, mask=row_ok, other=0)
        part_rows = part_ptr + (start + rows).to(tl.int64)[:, None] * 2 * I
        acc = tl.zeros([M_TILE, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < k_hi
            amask = row_ok[:, None] & k_ok[None, :]
            g = tl.zeros([M_TILE, BLOCK_K], dtype=tl.float32)
            u = tl.zeros([M_TILE, BLOCK_K], dtype=tl.float32)
            for j in range(SPLIT_IN):  # the w13 kernel's K-split partials
                g += tl.load(part_rows + j * split_stride + k[None, :], mask=amask, other=0.0)
                u += tl.load(part_rows + j * split_stride + I + k[None, :], mask=amask, other=0.0)
            act = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)
            if INT4 and UNPACK:
                w = _int4_tile_once(w_base, s_base, k0, k_hi, offs_n, n_ok, stride_wk, stride_wn, stride_sk,
                                    stride_sn, GROUP, BLOCK_K, BLOCK_N)
            else:
                w = _weight_tile(w_base, s_base, k, offs_n, k_ok[:, None] & n_ok[None, :], stride_wk, stride_wn,
                                 stride_sk, stride_sn, INT4, GROUP)
            acc += _mma(act, w)
        acc *= tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0)[:, None]
        tokens = (pairs // TOP_K).to(tl.int64)
        # relaxed: the workspace was zeroed by the w13 launch, nothing here orders against
        # another add, and the default (acq_rel) makes each add wait for its old value
        tl.atomic_add(acc_ptr + tokens[:, None] * H + offs_n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :],
                      sem="relaxed")


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


def _k_per_split(k: int, cfg: GemmConfig) -> tuple[int, int]:
    """(K elements per split, a whole number of BLOCK_K steps; the splits that hold any)."""
    per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return per, triton.cdiv(k, per)


def few_token_moe(hidden: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor, *,
                  out: Tensor | None = None, config_w13: GemmConfig | None = None,
                  config_w2: GemmConfig | None = None, check_ids: bool = False) -> Tensor:
    """The routed experts of one layer for few tokens (semantics: ``fused_moe_ref``).

    Args:
        hidden: ``[T, H]`` contiguous bf16 (fp16/fp32 for CPU tests); built for T <= 64.
        weights: from ``moe_common.prepare_weights`` (bf16 of hidden's dtype, or INT4).
        topk_weights: ``[T, top_k]`` float32; ``topk_ids``: ``[T, top_k]`` int32.
        out: ``[T, H]`` like hidden, written; allocated when ``None``.
        config_w13, config_w2: tile configurations of the two GEMMs (``block_n``,
            ``block_k``, ``split_k``, warps, stages; ``block_m`` unused);
            ``default_config("few_token", ...)`` when None.
        check_ids: read the ids on the host and raise for one out of range (a
            synchronisation).  Without it such a pair is dropped (contributes nothing),
            which is also how ``-1`` (an expert on another rank, expert parallelism)
            is handled.

    Returns:
        ``out``.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, top_k < 1 (naming the argument),
            before any launch.
    """
    t, top_k = check_moe_args(hidden, weights, topk_weights, topk_ids, out, check_ids)
    require_runnable(_few_w13_kernel, hidden, "hidden")
    h, inter = weights.hidden, weights.inter
    small = small_shared(hidden.device)
    group = max(weights.group_size, 1)
    # reading each INT4 word once (unpack=1) needs a power-of-two group; other groups (a
    # multiple of 8 dividing K) take the default with one load per input row instead
    whole_words = not weights.int4 or (group >= 8 and not group & (group - 1))
    c13 = config_w13 or default_config("few_token", "w13", weights.kind, 2 * inter, h, t, small, whole_words)
    c2 = config_w2 or default_config("few_token", "w2", weights.kind, h, inter, t, small, whole_words)
    for name, c in (("config_w13", c13), ("config_w2", c2)):
        if c.unpack and not whole_words:
            raise ValueError(f"{name}: unpack=1 needs a power-of-two INT4 group of at least 8, got {group}")
    out = torch.empty_like(hidden) if out is None else out
    if t == 0:
        return out
    pairs = t * top_k
    sorted_ids, seg_e, seg_start, seg_cnt, nseg = expert_segments(topk_ids, weights.num_experts)
    segs = seg_e.numel()
    m_tile = tile_rows("few_token", t)
    per13, split13 = _k_per_split(h, c13)
    per2, split2 = _k_per_split(inter, c2)
    dev = hidden.device
    part = torch.empty(split13, pairs, 2 * inter, dtype=torch.float32, device=dev)
    acc = torch.empty(t, h, dtype=torch.float32, device=dev)  # zeroed by the w13 kernel
    w, s, st = weights.gemm("w13")
    _few_w13_kernel[(segs, triton.cdiv(inter, c13.block_n), split13)](
        hidden, w, s, part, acc, sorted_ids, seg_e, seg_start, seg_cnt, nseg, inter, h, pairs, t * h, per13, *st,
        TOP_K=top_k, INT4=weights.int4, GROUP=group, M_TILE=m_tile, BLOCK_N=c13.block_n, BLOCK_K=c13.block_k,
        ZERO_BLOCK=_ZERO_BLOCK, UNPACK=c13.unpack, num_warps=c13.num_warps, num_stages=c13.num_stages,
    )
    w, s, st = weights.gemm("w2")
    _few_w2_kernel[(segs, triton.cdiv(h, c2.block_n), split2)](
        hidden, w, s, part, acc, topk_weights, sorted_ids, seg_e, seg_start, seg_cnt, nseg, h, inter, part.stride(0),
        per2, *st, TOP_K=top_k, SPLIT_IN=split13, INT4=weights.int4, GROUP=group, M_TILE=m_tile, BLOCK_N=c2.block_n,
        BLOCK_K=c2.block_k, UNPACK=c2.unpack, num_warps=c2.num_warps, num_stages=c2.num_stages,
    )
    out.copy_(acc)
    return out
