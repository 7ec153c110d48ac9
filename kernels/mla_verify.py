"""Split-KV MLA attention for the verify step: every (new token x head) row of a request in
one tile, so each block of the shared latent cache is read once per request, not once per head.

Verify scores a request's q_len (1 .. 16) draft tokens against its whole context. The
prefill-style extend kernel servers run for it gives each head its own program, so the
576-wide latent cache is streamed once per head (8 times at Kimi-K2.5 TP8) for 4 useful
query rows per tile. Absorbed MLA shares one latent KV across all heads, so this kernel
does what FlashMLA and the servers' grouped decode kernels do for one token and extends it
to q_len tokens: it packs ``q_len x heads`` query rows into the M dimension of one tile
(q_len 4 x 8 heads = 32 rows) and splits the keys, flash-decoding style, over enough
programs to fill the GPU.

Tile rows (:func:`verify_tile`): row ``r`` of a tile is new token ``r // HPG`` and head
``g * HPG + r % HPG`` (token-major: one token's heads are adjacent rows, which are
adjacent in ``q`` and ``out``, and the mask is a function of ``r // HPG`` alone). ``HPG``
(heads per group) is all the heads unless ``max_q_len x heads`` exceeds ``MAX_BLOCK_M``
rows; then the heads are split into ``groups`` of at most ``MAX_BLOCK_M // max_q_len``
(balanced), one grid axis over them, and each group re-reads the request's keys (from L2:
the groups of one split are adjacent program ids). ``BLOCK_M`` = next power of two of
``max_q_len x HPG``, at least 16 (tl.dot's minimum); padded rows are masked. Keys per
block and warps follow from BLOCK_M (``TILE_CONFIG``).

Stage 1, grid ``(groups, num_splits, batch)`` (groups fastest so that the programs sharing
a key range run together): program (g, s, b) takes request b's keys ``[s*len, (s+1)*len)``
of ``prefix_len + q_len`` (len a multiple of BLOCK_N; the prefix through the page table,
then the request's ``kv_new`` rows), loads its q rows once, and for each BLOCK_N block of
keys loads the 576-wide rows once and computes the 512-latent and 64-rope dots for all
rows, then p @ v with v = the same rows' first 512 channels. Prefix keys are visible to
every row; key ``prefix_len + j`` (new token j) is visible to row token i iff causal
``j <= i`` or ``tree_mask[mask_indptr[b] + i*q_len + j]``. Online softmax in fp32 with
exp2 on log2(e)-scaled logits; it writes the split's normalised partial output
``[T, H, S, 512]`` fp32 and its base-2 LSE ``[T, H, S]`` (-inf where a row sees no key
of the split, e.g. an empty split). With one split, stage 1 writes ``out`` itself.

``DV_SPLIT`` 2 (``mla_verify(..., dv_split=2)``): the 512 output channels of a tile are
split over two programs, adjacent on grid axis 0 (``groups * 2``). Each still loads the
whole 576-wide key rows and computes the full logits (the latent's halves summed in the
same order in both, so their softmax statistics agree to the bit), but accumulates and
writes only its half of ``p @ v``: the accumulator is [M, 256] instead of [M, 512] (at 64
rows, 64 fp32 registers a thread at 8 warps instead of 128), at the price of twice the
logit FLOPs and each key block read twice (the second read from L2). The first half
writes the LSE.

Stage 2, grid ``(T * H, 512 / BLOCK_DV)``: merges a (token, head)'s splits by their LSE
and writes ``out`` in q.dtype. Split count: :func:`verify_num_splits`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from microbench.kernels.checks import require_runnable, small_shared
from microbench.kernels.mla_common import (HEAD_DIM, KV_LORA_RANK, MAX_Q_LEN, ROPE_DIM, MLAPlan, check_mla_tensors,
                                           sm_count)

__all__ = ["DV_SPLITS", "MAX_BLOCK_M", "MAX_SPLITS", "VerifyTile", "mla_verify", "verify_num_splits", "verify_tile"]

# ------------------------------------------------------------------------------ constants

#: Most rows in one tile: at 64 rows the [64, 512] fp32 accumulator is already 128 registers
#: per thread at 8 warps (and the tile spills a little, below); 128 rows would need 256, so
#: q_len x heads above 64 is split into head groups instead.
MAX_BLOCK_M = 64
#: (BLOCK_N, num_warps) per BLOCK_M, read off register/spill counts of the stage-1 kernel
#: compiled for sm_90 (Triton 3.9, bf16, cuobjdump --dump-resource-usage) over the mask,
#: page-size and one-split variants:
#:   16 rows: 32 keys, 8 warps: 106-183 registers, no spill (4 warps, the servers' grouped
#:            decode choice, need 250 and spill in the tree + one-split variant);
#:   32 rows: 32 keys, 8 warps: 179-248 registers, no spill (4 warps spill 264 B);
#:   64 rows: 16 keys, 8 warps: wgmma, 255 registers, 40-230 B spilled (32 keys: 320 B;
#:            16 warps: 360 B at their 128-register cap).
#: Every BLOCK_N is >= MAX_Q_LEN, so a request's new-token keys fit one key block.
TILE_CONFIG = {16: (32, 8), 32: (32, 8), 64: (16, 8)}
#: The same with the value channels split over two programs (``dv_split=2``), read off the
#: same way (Triton 3.9, sm_90, bf16, page 1, 4 splits; registers, spill B, smem, blocks/SM):
#:   16 rows: 32 keys, 4 warps: 146, 0, 71 KiB, 3 (8 warps: 126, 0, 71 KiB, 2;
#:            whole tile: 105, 0, 55 KiB, 2);
#:   32 rows: 32 keys, 4 warps: 180, 0, 90 KiB, 2 (8 warps: 136, 0, 90 KiB, 1;
#:            whole tile: 173, 0, 74 KiB, 1);
#:   64 rows: 16 keys, 8 warps: 218, 0, 124 KiB, 1 (whole tile: 255, 100 B, 128 KiB, 1).
#: Whether more blocks per SM, or no spill, pays for the doubled logits is a GPU question.
#: On GPUs with under 128 KiB of shared memory a block (sm_120: 99 KiB) the 64-row tile's
#: 100 KiB do not fit: there it takes one stage (82 KiB, 48 B spilled).
DV2_TILE_CONFIG = {16: (32, 4), 32: (32, 4), 64: (16, 8)}
#: Output channels per merge program: 4 programs per (token, head) so stage 2 has enough
#: programs in flight to read the partials quickly at batch 1.
BLOCK_DV = 128
#: Stage-1 pipeline depth: the next block's keys (36 KB at 32 keys) load asynchronously
#: while the current block is in the tensor cores, as the servers' grouped MLA decode does.
NUM_STAGES = 2
#: Split-count rule (see verify_num_splits): programs for ~2 waves of the SMs; no split
#: shorter than 128 keys (the pipeline must fill) or than 8 keys per tile row (a split's
#: partials, 4 KB written + read per row, stay under half the bytes of its keys, 1152 B
#: each in bf16, and they are written and read back from L2).
WAVES = 2
MIN_SPLIT_KEYS = 128
MIN_KEYS_PER_ROW = 8
#: Output-channel parts per tile (``dv_split``): 2 halves the [M, 512] accumulator of a
#: program and doubles the programs.
DV_SPLITS = (1, 2)
#: Stage 2 loops over the splits; flash-decoding implementations cap them at 128 too.
MAX_SPLITS = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

assert all(n >= MAX_Q_LEN for n, _ in [*TILE_CONFIG.values(), *DV2_TILE_CONFIG.values()]), \
    "new-token keys must fit one key block"
assert HEAD_DIM == KV_LORA_RANK + ROPE_DIM and KV_LORA_RANK % BLOCK_DV == 0


class VerifyTile(NamedTuple):
    """Tile of a batch: rows (a power of two >= 16), heads per group, groups, keys per block, warps."""

    block_m: int
    heads_per_group: int
    groups: int
    block_n: int
    num_warps: int


def verify_tile(max_q_len: int, heads: int, dv_split: int = 1) -> VerifyTile:
    """Pack max_q_len x heads rows in one tile, or split the heads into balanced groups of
    at most MAX_BLOCK_M // max_q_len heads when the rows do not fit MAX_BLOCK_M; keys per
    block and warps from TILE_CONFIG (DV2_TILE_CONFIG with ``dv_split`` 2)."""
    if not 1 <= max_q_len <= MAX_Q_LEN or heads < 1:
        raise ValueError(f"verify_tile: need 1 <= max_q_len <= {MAX_Q_LEN} and heads >= 1, got {max_q_len}, {heads}")
    hpg = heads
    if max_q_len * heads > MAX_BLOCK_M:
        groups = -(-heads // max(1, MAX_BLOCK_M // max_q_len))
        hpg = -(-heads // groups)  # same group count, fewest padded heads
    block_m = max(16, triton.next_power_of_2(max_q_len * hpg))
    return VerifyTile(block_m, hpg, -(-heads // hpg), *(DV2_TILE_CONFIG if dv_split == 2 else TILE_CONFIG)[block_m])


def verify_num_splits(plan: MLAPlan, heads: int, sm_count: int, dv_split: int = 1) -> int:
    """Splits of each request's keys: enough programs to fill the GPU, none too short.

    ``min(ceil(WAVES * sm_count / (batch * groups * dv_split)), L // min_len, MAX_SPLITS)``, at least 1,
    with L = max_prefix + max_q_len (the longest request's keys) and min_len =
    max(MIN_SPLIT_KEYS, MIN_KEYS_PER_ROW * max_q_len * heads_per_group).
    Fewer programs than ~2 waves leaves SMs idle and HBM bandwidth unused (one program's
    loads cannot saturate it); shorter splits spend more on partial outputs and the merge
    than they save. Host ints only: no device read.
    """
    tile = verify_tile(plan.max_q_len, heads, dv_split)
    fill = -(-WAVES * sm_count // (plan.batch * tile.groups * dv_split))
    min_len = max(MIN_SPLIT_KEYS, MIN_KEYS_PER_ROW * plan.max_q_len * tile.heads_per_group)
    by_len = (plan.max_prefix + plan.max_q_len) // min_len
    return max(1, min(fill, by_len, MAX_SPLITS))


# -------------------------------------------------------------------------------- kernels


@triton.jit
def _load_keys(ptr, k_off, n_ok, d, dpe, q_a, q_b, q_pe, half,
               BLOCK_DMODEL: tl.constexpr, DV_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A block of keys at row offsets ``k_off``: (q . k logits [M, N], this program's values).

    DV_SPLIT 1: q_a = q_nope [M, 512], values = the keys' 512 latent channels. DV_SPLIT 2:
    the latent in two halves, q_a / q_b [M, 256] the first / second half of q_nope; the
    logits are summed in the same order in both programs of a pair (so their LSE agree to
    the bit) and the values are this program's half (``half``) of the latent.
    """
    if DV_SPLIT == 1:
        kv = tl.load(ptr + k_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        kpe = tl.load(ptr + k_off[:, None] + BLOCK_DMODEL + dpe[None, :], mask=n_ok[:, None], other=0.0)
        qk = tl.dot(q_a, tl.trans(kv), input_precision=DOT_PRECISION)
        v = kv
    else:
        kv_a = tl.load(ptr + k_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        kv_b = tl.load(ptr + k_off[:, None] + BLOCK_DMODEL // 2 + d[None, :], mask=n_ok[:, None], other=0.0)
        kpe = tl.load(ptr + k_off[:, None] + BLOCK_DMODEL + dpe[None, :], mask=n_ok[:, None], other=0.0)
        qk = tl.dot(q_a, tl.trans(kv_a), input_precision=DOT_PRECISION)
        qk += tl.dot(q_b, tl.trans(kv_b), input_precision=DOT_PRECISION)
        # this half's values loaded again (an L1 hit) rather than picked with tl.where from
        # kv_a / kv_b: the select kept both halves live (at 64 rows, sm_90: 255 registers and
        # 124 B spilled, against 218 and none)
        v = tl.load(ptr + k_off[:, None] + half * (BLOCK_DMODEL // 2) + d[None, :], mask=n_ok[:, None], other=0.0)
    qk += tl.dot(q_pe, tl.trans(kpe), input_precision=DOT_PRECISION)
    return qk, v


@triton.jit
def _attend_block(acc, m_i, l_i, qk, kv, visible, sm_scale, logit_cap,
                  HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One block of keys for all tile rows: online-softmax update of (acc, m_i, l_i).

    qk [M, N] the unscaled logits, kv [N, DV] this program's value channels, visible [M, N]
    or [1, N]; m_i is in log2 units. Rows that see nothing keep m_i = -inf, l_i = 0.
    """
    qk = qk * sm_scale
    if HAS_CAP:  # cap * tanh(x / cap), tanh written with exp so the interpreter runs it too
        qk = logit_cap * (1.0 - 2.0 / (tl.exp(2.0 * qk / logit_cap) + 1.0))
    qk = tl.where(visible, qk * 1.4426950408889634, float("-inf"))  # log2(e): exp2 below
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # a row with no visible key so far would make -inf - -inf = NaN: subtract 0 instead
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _mla_verify_split_kernel(
    q_ptr, kv_new_ptr, kv_cache_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, prefix_lens_ptr,
    tree_mask_ptr, mask_indptr_ptr, part_ptr, lse_ptr, out_ptr,
    sm_scale, logit_cap, num_heads, num_splits,
    HPG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DMODEL: tl.constexpr,
    BLOCK_DPE: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_TREE: tl.constexpr, HAS_CAP: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, DV_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Stage 1: program (head group g x value half, split s, request b); see the module docstring."""
    g = tl.program_id(0) // DV_SPLIT
    half = tl.program_id(0) % DV_SPLIT
    DV: tl.constexpr = BLOCK_DMODEL // DV_SPLIT
    s = tl.program_id(1)
    b = tl.program_id(2)
    HEAD: tl.constexpr = BLOCK_DMODEL + BLOCK_DPE
    qo_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - qo_start
    prefix = tl.load(prefix_lens_ptr + b)
    page_base = tl.load(kv_indptr_ptr + b)
    total = prefix + q_len
    # block-aligned split ranges: with pages >= BLOCK_N a block never straddles two pages
    split_len = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    k_start = s * split_len
    k_end = tl.minimum(total, k_start + split_len)

    rows = tl.arange(0, BLOCK_M)
    tok = rows // HPG
    head = g * HPG + rows % HPG
    row_ok = (tok < q_len) & (head < num_heads)
    row_off = ((qo_start + tok).to(tl.int64) * num_heads + head) * HEAD  # into q [T, H, 576]
    d = tl.arange(0, DV)  # the latent channels of one part (all 512 unless DV_SPLIT)
    dpe = tl.arange(0, BLOCK_DPE)
    q_a = tl.load(q_ptr + row_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    if DV_SPLIT == 1:
        q_b = q_a  # unused
    else:
        q_b = tl.load(q_ptr + row_off[:, None] + DV + d[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_ptr + row_off[:, None] + BLOCK_DMODEL + dpe[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)

    # the prefix part of the split: every row sees every key, only the range is masked
    pre_end = tl.minimum(k_end, prefix)
    for start in range(k_start, pre_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < pre_end
        page = tl.load(kv_indices_ptr + page_base + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        k_off = (page * PAGE_SIZE + n % PAGE_SIZE) * HEAD
        qk, kv = _load_keys(kv_cache_ptr, k_off, n_ok, d, dpe, q_a, q_b, q_pe, half, BLOCK_DMODEL, DV_SPLIT,
                            DOT_PRECISION)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, qk, kv, n_ok[None, :], sm_scale, logit_cap,
                                      HAS_CAP, DOT_PRECISION)

    # the new-token part (at most q_len <= BLOCK_N keys: zero or one trip), with the mask
    for start in range(tl.maximum(k_start, prefix), k_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        j = n - prefix  # new token j of the request
        n_ok = n < k_end
        k_off = (qo_start + j).to(tl.int64) * HEAD
        qk, kv = _load_keys(kv_new_ptr, k_off, n_ok, d, dpe, q_a, q_b, q_pe, half, BLOCK_DMODEL, DV_SPLIT,
                            DOT_PRECISION)
        both = row_ok[:, None] & n_ok[None, :]
        if HAS_TREE:
            m_off = tl.load(mask_indptr_ptr + b) + tok[:, None] * q_len + j[None, :]
            visible = both & (tl.load(tree_mask_ptr + m_off, mask=both, other=0) != 0)
        else:
            visible = both & (j[None, :] <= tok[:, None])
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, qk, kv, visible, sm_scale, logit_cap,
                                      HAS_CAP, DOT_PRECISION)

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # an empty row's acc is 0: store 0, not NaN
    tok_head = (qo_start + tok).to(tl.int64) * num_heads + head  # (token, head) index
    c = half * DV + d  # this program's output channels
    if SINGLE_SPLIT:
        tl.store(out_ptr + tok_head[:, None] * BLOCK_DMODEL + c[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        slot = tok_head * num_splits + s
        tl.store(part_ptr + slot[:, None] * BLOCK_DMODEL + c[None, :], o, mask=row_ok[:, None])
        # the two halves' LSE are equal to the bit: the first half writes it (the test is on
        # a block, not the scalar: the interpreter cannot mask with a block & a scalar)
        tl.store(lse_ptr + slot, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")),
                 mask=row_ok & ((rows * 0 + half) == 0))


@triton.jit
def _mla_verify_merge_kernel(part_ptr, lse_ptr, out_ptr, num_splits, DV: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Stage 2: out[t, h, c-block] = sum_s 2^(lse_s - max) * part_s / sum_s 2^(lse_s - max)."""
    th = tl.program_id(0).to(tl.int64)  # token * heads + head
    c = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + th * num_splits + s, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m), 0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for i in range(num_splits):
        w = tl.exp2(tl.load(lse_ptr + th * num_splits + i) - m)
        part = tl.load(part_ptr + (th * num_splits + i) * DV + c)
        acc += tl.where(w > 0.0, w * part, 0.0)  # an empty split adds nothing
    o = tl.where(denom > 0.0, acc / denom, 0.0)
    tl.store(out_ptr + th * DV + c, o.to(out_ptr.dtype.element_ty))


# ------------------------------------------------------------------------------- launcher


def mla_verify(q: Tensor, kv_new: Tensor, kv_cache: Tensor, plan: MLAPlan, *, out: Tensor | None = None,
               num_splits: int | None = None, dv_split: int = 1) -> Tensor:
    """Verify-step absorbed-MLA attention: all (token x head) rows of a request in one tile.

    Args:
        q: [T, H, 576] queries (512 latent + 64 rope), T = plan.total_q; fp16/bf16/fp32.
        kv_new: [T, 576] the new tokens' latents, q.dtype.
        kv_cache: [num_pages, page_size, 576] the paged prefix latents, q.dtype.
        plan: the batch layout from ``mla_common.plan_mla`` (on q's device).
        out: optional [T, H, 512] q.dtype contiguous output, written entirely.
        num_splits: splits of each request's keys (1..MAX_SPLITS); None =
            :func:`verify_num_splits` for this GPU's SM count (132 on the CPU). Splits past
            a request's keys are empty.
        dv_split: 1, or 2 to split each tile's 512 output channels over two programs
            (see ``DV_SPLIT`` in the module docstring): half the accumulator per program,
            twice the programs, each key block read by both (the second from L2).

    Returns:
        out [T, H, 512] in q.dtype (semantics of ``reference.mla_attention_ref``).

    Never synchronises: grid and constexprs come from the plan's host fields; scratch
    partials [T, H, S, 512] and LSE [T, H, S] fp32 are allocated per call when S > 1.
    Raises ValueError (naming the argument) for bad shapes, dtypes or num_splits.
    """
    out = check_mla_tensors(q, kv_new, kv_cache, plan, out)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    heads = q.shape[1]
    if heads < 1:
        raise ValueError(f"q: needs at least one head, got shape {tuple(q.shape)}")
    require_runnable(_mla_verify_split_kernel, q, "q")
    if dv_split not in DV_SPLITS or isinstance(dv_split, bool):
        raise ValueError(f"dv_split: expected one of {DV_SPLITS}, got {dv_split!r}")
    tile = verify_tile(plan.max_q_len, heads, dv_split)
    if num_splits is None:
        num_splits = verify_num_splits(plan, heads, sm_count(q.device), dv_split)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int in 1..{MAX_SPLITS}, got {num_splits!r}")

    t = plan.total_q
    single = num_splits == 1
    if single:  # stage 1 writes out; the scratch pointers are never used
        part = lse = out
    else:
        part = torch.empty(t, heads, num_splits, KV_LORA_RANK, dtype=torch.float32, device=q.device)
        lse = torch.empty(t, heads, num_splits, dtype=torch.float32, device=q.device)
    has_tree = plan.tree_mask is not None
    # bool -> uint8 is a free view: byte loads compile the same on every Triton version
    tree = plan.tree_mask.view(torch.uint8) if has_tree else plan.qo_indptr
    mask_indptr = plan.mask_indptr if has_tree else plan.qo_indptr
    grid = (tile.groups * dv_split, num_splits, plan.batch)
    _mla_verify_split_kernel[grid](
        q, kv_new, kv_cache, plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.prefix_lens,
        tree, mask_indptr, part, lse, out,
        plan.sm_scale, plan.logit_cap if plan.logit_cap > 0 else 1.0, heads, num_splits,
        HPG=tile.heads_per_group, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_DMODEL=KV_LORA_RANK,
        BLOCK_DPE=ROPE_DIM, PAGE_SIZE=plan.page_size, HAS_TREE=has_tree, HAS_CAP=plan.logit_cap > 0,
        SINGLE_SPLIT=single, DV_SPLIT=dv_split, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps,
        num_stages=1 if dv_split == 2 and tile.block_m == 64 and small_shared(q.device) else NUM_STAGES,
    )
    if not single:
        # 4 warps x 32 lanes cover BLOCK_DV = 128 channels one per lane: the merge is a
        # stream over S x 512 fp32 partials per (token, head), bandwidth-bound
        _mla_verify_merge_kernel[(t * heads, KV_LORA_RANK // BLOCK_DV)](
            part, lse, out, num_splits, DV=KV_LORA_RANK, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_DV=BLOCK_DV, num_warps=4,
        )
    return out

