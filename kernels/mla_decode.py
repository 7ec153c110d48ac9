"""Split-KV (flash-decoding) MLA attention for one new token per request, as servers decode.

Absorbed MLA at one rank: every query head attends over the same latent row of each key
(576 = 512 latent + 64 rope channels; the value is the first 512), so all the heads of a
rank form one "KV group". This is the design of SGLang's Triton MLA decode
(``decode_attention_fwd_grouped``: ``_fwd_grouped_kernel_stage1`` + ``_fwd_kernel_stage2``):

* **Stage 1**, grid ``(batch, cdiv(heads, BLOCK_H), num_splits)``. Request ``b`` has
  ``L = prefix_len + 1`` keys: its prefix tokens, read through its pages, then the new
  token's own ``kv_new`` row as the last key (the token sees itself). The keys are cut into
  ``num_splits`` contiguous ranges of ``cdiv(cdiv(L, num_splits), BLOCK_N) * BLOCK_N`` keys
  (a whole number of tiles, so only a split's last tile is partial). A program reads its
  range once, ``BLOCK_N`` rows at a time (page id per key from ``kv_indices``), with
  ``BLOCK_H`` heads as the M dimension of the tile: ``q [BLOCK_H, 512] @ k [512, BLOCK_N]``
  plus the rope part ``[BLOCK_H, 64] @ [64, BLOCK_N]`` (two dots, as 576 is not a power of
  two), an online softmax in the log2 domain, and ``p @ v [BLOCK_N, 512]``. The split that
  owns key ``L - 1`` folds the new token's row in after its loop (a vector dot, no tile).
  It writes its normalised partial output ``[batch, heads, num_splits, 512]`` fp32 and its
  log-sum-exp ``[batch, heads, num_splits]`` fp32 (natural log); a split that got no keys
  (short requests under a large split count) writes LSE = -inf and no partial.
* **Stage 2**, grid ``(batch, heads)``: merges the splits, weighting each partial by
  ``exp(lse_s - max lse)``, and writes ``out`` in q.dtype.

Why this design: one-token decode has one query row per head, far too little work per key
for a program per head (that would read the 1152-byte latent row once per head). Packing
the heads that share the latent into one tile reads each key once per request and gives
``tl.dot`` its M dimension; splitting the keys gives the GPU enough programs when the
batch is small. The tile needs ``BLOCK_H >= 16`` (tl.dot's minimum M): with Kimi-K2.5's
8 heads per rank at TP8 half of every tile is padding rows (their q is zero, their
results are not stored), which costs MMA throughput but no memory traffic, and decode is
memory-bound. Head counts above 16 take several head tiles, each re-reading the keys.

The semantics are ``reference.mla_attention_ref`` restricted to q_len 1; the launcher
:func:`mla_decode` rejects plans with a longer q_len (that is the verify kernel's job).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from torch import Tensor

from microbench.kernels.checks import require_runnable
from microbench.kernels.mla_common import KV_LORA_RANK, ROPE_DIM, MLAPlan, check_mla_tensors, sm_count

__all__ = ["BLOCK_H", "MAX_SPLITS", "MIN_SPLIT_KEYS", "decode_num_splits", "mla_decode"]

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

#: Heads per tile: tl.dot needs M >= 16, and 16 rows of a 512-wide fp32 accumulator are
#: 32 KB per program (64 registers a thread at 4 warps); SGLang uses the same value.
BLOCK_H = 16
#: Keys per tile for 16-bit caches: a [512, 32] bf16 K tile is 32 KB and its V view as
#: much, so two pipeline stages need ~136 KB of shared memory (H200: 227 KB a block).
#: SGLang uses 32 for the 576-wide MLA key on NVIDIA GPUs.
_BLOCK_N_16BIT = 32
#: fp32 caches (a precision check, not a model dtype) halve the tile to keep the same bytes.
_BLOCK_N_FP32 = 16
#: Programs per SM the split count aims for: with ~one 136 KB program resident per SM, two
#: waves keep the tail of the last wave (uneven splits, short requests) to about half a wave.
_WAVES = 2
#: Fewest keys worth a split of their own: each split also writes and the merge re-reads its
#: partial (8 valid heads x 512 x 4 B = 16 KB each way); at 128 keys x 1152 B that extra
#: traffic is ~22% of the split's key bytes, and shorter splits would be dominated by it.
#: A multiple of every BLOCK_N, so this is also "no split shorter than a tile".
MIN_SPLIT_KEYS = 128
#: Most splits: the verify kernel's cap, so that at batch 1 both kernels fill the GPU
#: alike (128 at 16K keys: 128 programs of ~128 keys; a cap of 64 left half of an H200's
#: 132 SMs idle). The cap binds only below 2 x SMs / 128 requests (batch <= 2 on an H200),
#: so the scratch stays small (2 x 8 heads x 128 splits x 2 KB = 4 MB); the merge reads all
#: of a head's LSEs at once (128 floats) and its partials in chunks.
MAX_SPLITS = 128
#: Splits the merge weights per step: an [8, 512] fp32 chunk is 32 registers a thread at 4 warps.
_MERGE_CHUNK = 8
#: Stand-in SM count off the GPU (an H200's), so the interpreter path runs the same rule.
#: 4 warps for both stages: stage 1's tile is [16, 512] (one 16-row MMA slab per warp column),
#: stage 2 a 512-wide vector; 2 stages double-buffer stage 1's K/V loads (as SGLang does).
_NUM_WARPS = 4
_NUM_STAGES_16BIT = 2
_NUM_STAGES_FP32 = 1  # fp32 tiles are twice the bytes: no second buffer
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (log2 e = 1.4426950408889634 and ln 2 = 0.6931471805599453 appear as literals in the kernels:
# Triton reads module globals only when they are constexpr, literals work in every version)

# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _log2_logits(qk, sm_scale, logit_cap, HAS_CAP: tl.constexpr):
    """q.k -> the softmax logit in the log2 domain (times log2 e), soft-capped if asked."""
    s = qk * sm_scale
    if HAS_CAP:
        # tanh(x) = 2 sigmoid(2x) - 1: every Triton version has sigmoid, not all have tanh
        s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)
    return s * 1.4426950408889634


@triton.jit
def _mla_decode_stage1_kernel(
    q_ptr, kv_new_ptr, cache_ptr, kv_indptr_ptr, kv_indices_ptr, prefix_lens_ptr, part_ptr, lse_ptr,
    num_heads, num_splits, sm_scale, logit_cap,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DMODEL: tl.constexpr, BLOCK_DPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (request, head tile, split): the split's keys -> partial [BLOCK_H, 512] and LSE.

    q [B, H, 576] (token b is request b: q_len is 1), kv_new [B, 576], cache [pages, PAGE_SIZE,
    576]; part [B, H, S, 512] fp32, lse [B, H, S] fp32, all contiguous.
    """
    HEAD_DIM: tl.constexpr = BLOCK_DMODEL + BLOCK_DPE
    b = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_pe = BLOCK_DMODEL + tl.arange(0, BLOCK_DPE)

    # padding heads load q = 0: their logits stay finite (0) and their rows are never stored
    q_row = (b.to(tl.int64) * num_heads + heads) * HEAD_DIM
    q = tl.load(q_ptr + q_row[:, None] + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    qpe = tl.load(q_ptr + q_row[:, None] + offs_pe[None, :], mask=mask_h[:, None], other=0.0)

    prefix = tl.load(prefix_lens_ptr + b)
    page_base = tl.load(kv_indptr_ptr + b)
    n_keys = prefix + 1  # the new token's own row is key number `prefix`
    # whole tiles per split, so only the last tile of a split is partial
    split_len = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, n_keys)
    cache_end = tl.minimum(end, prefix)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DMODEL], tl.float32)
    # every tile of this loop holds >= 1 valid key, so the running max is finite after it
    for n0 in range(start, cache_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < cache_end
        page = tl.load(kv_indices_ptr + page_base + offs_n // PAGE_SIZE, mask=valid, other=0)
        row = (page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE) * HEAD_DIM
        k = tl.load(cache_ptr + row[None, :] + offs_d[:, None], mask=valid[None, :], other=0.0)
        kpe = tl.load(cache_ptr + row[None, :] + offs_pe[:, None], mask=valid[None, :], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        qk = tl.dot(qpe, kpe, acc=qk, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        s = tl.where(valid[None, :], _log2_logits(qk, sm_scale, logit_cap, HAS_CAP), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        # the value is the key's first 512 channels: a [BLOCK_N, 512] view of the same rows
        v = tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION,
                     out_dtype=tl.float32)
        m = m_new

    # the new token's row, owned by the split whose range holds key `prefix`; the others
    # load nothing (masked) and add a zero weight
    has_new = (start <= prefix) & (prefix < end)
    new_row = kv_new_ptr + b.to(tl.int64) * HEAD_DIM
    # the mask is built from vector comparisons: the interpreter mishandles vector & scalar
    pos = prefix + tl.zeros([BLOCK_DMODEL], tl.int32)
    pos_pe = prefix + tl.zeros([BLOCK_DPE], tl.int32)
    kn = tl.load(new_row + offs_d, mask=(pos >= start) & (pos < end), other=0.0).to(tl.float32)
    knpe = tl.load(new_row + offs_pe, mask=(pos_pe >= start) & (pos_pe < end), other=0.0).to(tl.float32)
    qk_n = tl.sum(q.to(tl.float32) * kn[None, :], 1) + tl.sum(qpe.to(tl.float32) * knpe[None, :], 1)
    s_n = tl.where(has_new, _log2_logits(qk_n, sm_scale, logit_cap, HAS_CAP), float("-inf"))
    m_new = tl.maximum(m, s_n)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split with no keys: avoid -inf - -inf
    alpha = tl.exp2(m - m_safe)
    p_n = tl.exp2(s_n - m_safe)
    l = l * alpha + p_n
    acc = acc * alpha[:, None] + p_n[:, None] * kn[None, :]

    has_keys = l > 0.0
    lse = tl.where(has_keys, (m_new + tl.log2(tl.where(has_keys, l, 1.0))) * 0.6931471805599453, float("-inf"))
    out_row = (b.to(tl.int64) * num_heads + heads) * num_splits + split
    part = acc / tl.where(has_keys, l, 1.0)[:, None]
    tl.store(part_ptr + out_row[:, None] * BLOCK_DMODEL + offs_d[None, :], part,
             mask=(mask_h & has_keys)[:, None])
    tl.store(lse_ptr + out_row, lse, mask=mask_h)


@triton.jit
def _mla_decode_stage2_kernel(
    part_ptr, lse_ptr, out_ptr, num_heads, num_splits,
    BLOCK_DV: tl.constexpr, LSE_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    """One (request, head): out = sum_s exp(lse_s - M) part_s / sum_s exp(lse_s - M).

    part [B, H, S, 512] fp32, lse [B, H, S] fp32 (-inf: an empty split), out [B, H, 512].
    At least one split of every request holds a key (the new token), so M is finite.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b.to(tl.int64) * num_heads + h) * num_splits
    offs_all = tl.arange(0, LSE_BLOCK)
    lse_all = tl.load(lse_ptr + base + offs_all, mask=offs_all < num_splits, other=float("-inf"))
    m = tl.max(lse_all, 0)
    denom = tl.sum(tl.exp2((lse_all - m) * 1.4426950408889634), 0)
    offs_d = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for c in range(0, num_splits, CHUNK):
        offs_s = c + tl.arange(0, CHUNK)
        ok = offs_s < num_splits
        lse = tl.load(lse_ptr + base + offs_s, mask=ok, other=float("-inf"))
        w = tl.exp2((lse - m) * 1.4426950408889634)  # 0 for empty splits
        # empty splits wrote no partial: never read it (it may be garbage, even NaN)
        part = tl.load(part_ptr + (base + offs_s)[:, None] * BLOCK_DV + offs_d[None, :],
                       mask=(ok & (lse > float("-inf")))[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    out = acc / denom
    tl.store(out_ptr + (b.to(tl.int64) * num_heads + h) * BLOCK_DV + offs_d, out.to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


def decode_num_splits(plan: MLAPlan, heads: int, sm_count: int) -> int:
    """The split count the launcher uses when none is forced (host ints only, no sync).

    ``min(cdiv(2 x sm_count, batch x cdiv(heads, BLOCK_H)), cdiv(max_prefix + 1,
    MIN_SPLIT_KEYS), MAX_SPLITS)``, at least 1. Reasons: enough stage-1 programs for about
    two waves of SMs (decode is memory-bound, so idle SMs are lost bandwidth; two waves
    hide the uneven tail); no split of the longest request shorter than MIN_SPLIT_KEYS
    keys (a split's partial write + merge read must stay small next to its key reads);
    at most MAX_SPLITS (the merge and the scratch grow with it). Shorter requests of a
    mixed batch get fewer non-empty splits (splits are whole tiles); their empty
    programs exit after a few loads.

    Example at Kimi-K2.5 TP8 (8 heads -> one head tile) on an H200 (132 SMs): batch 16 at
    context 16K -> 17 splits (272 programs); batch 1 at 16K -> 128 (the cap: 128 programs,
    one per SM; the length rule alone would give 129).
    """
    if heads < 1 or sm_count < 1:
        raise ValueError(f"heads and sm_count must be >= 1, got {heads}, {sm_count}")
    programs = plan.batch * triton.cdiv(heads, BLOCK_H)
    by_occupancy = triton.cdiv(_WAVES * sm_count, programs)
    by_length = triton.cdiv(plan.max_prefix + 1, MIN_SPLIT_KEYS)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def mla_decode(q: Tensor, kv_new: Tensor, kv_cache: Tensor, plan: MLAPlan, *, out: Tensor | None = None,
               num_splits: int | None = None) -> Tensor:
    """MLA attention of one new token per request over its paged prefix and itself.

    Args:
        q: ``[B, H, 576]`` the new tokens' queries (512 latent + 64 rope), fp16 / bf16 / fp32;
            B = plan.batch (one token per request).
        kv_new: ``[B, 576]`` the new tokens' latent rows, same dtype (each token's last key).
        kv_cache: ``[num_pages, page_size, 576]`` the paged prefix latents, same dtype.
        plan: from ``mla_common.plan_mla``; every q_len must be 1.
        out: optional ``[B, H, 512]`` contiguous tensor in q.dtype, overwritten.
        num_splits: split count of the keys (1..MAX_SPLITS); None = :func:`decode_num_splits`.

    Returns:
        ``out`` ``[B, H, 512]`` in q.dtype (softmax and sums in fp32).

    Raises:
        ValueError: a bad tensor (via ``check_mla_tensors``, naming it), a plan with a q_len
            above 1 (naming qo_indptr), an unsupported dtype or a bad num_splits.

    Launches two kernels without synchronising: all sizes come from the plan's host fields.
    Scratch (the partials, ``B x H x splits x 2 KB``) is allocated per call.
    """
    out = check_mla_tensors(q, kv_new, kv_cache, plan, out)
    if plan.max_q_len > 1:
        raise ValueError(f"qo_indptr: the decode kernel takes one new token per request, but the plan has "
                         f"q_len up to {plan.max_q_len} (plan.max_q_len); use the verify or extend kernel")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} not supported; use one of {_SUPPORTED_DTYPES}")
    heads = q.shape[1]
    if heads < 1:
        raise ValueError(f"q: needs at least one head, got shape {tuple(q.shape)}")
    if num_splits is None:
        num_splits = decode_num_splits(plan, heads, sm_count(q.device))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int in 1..{MAX_SPLITS}, got {num_splits!r}")
    require_runnable(_mla_decode_stage1_kernel, q, "q")

    batch = plan.batch
    part = torch.empty(batch, heads, num_splits, KV_LORA_RANK, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    fp32 = q.dtype == torch.float32
    _mla_decode_stage1_kernel[(batch, triton.cdiv(heads, BLOCK_H), num_splits)](
        q, kv_new, kv_cache, plan.kv_indptr, plan.kv_indices, plan.prefix_lens, part, lse,
        heads, num_splits, plan.sm_scale, plan.logit_cap if plan.logit_cap > 0 else 1.0,
        BLOCK_H=BLOCK_H, BLOCK_N=_BLOCK_N_FP32 if fp32 else _BLOCK_N_16BIT, BLOCK_DMODEL=KV_LORA_RANK,
        BLOCK_DPE=ROPE_DIM, PAGE_SIZE=plan.page_size, HAS_CAP=plan.logit_cap > 0,
        # fp32 is the precision check: full-precision products, not TF32's 10-bit mantissa
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES_FP32 if fp32 else _NUM_STAGES_16BIT,
    )
    lse_block = triton.next_power_of_2(num_splits)
    _mla_decode_stage2_kernel[(batch, heads)](
        part, lse, out, heads, num_splits,
        BLOCK_DV=KV_LORA_RANK, LSE_BLOCK=lse_block, CHUNK=min(lse_block, _MERGE_CHUNK), num_warps=_NUM_WARPS,
    )
    return out

