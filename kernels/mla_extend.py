"""The baseline: MLA attention for verify as servers run it, with the prefill-style extend kernel.

SGLang's Triton attention backend runs EAGLE target-verify through ``extend_attention_fwd``
(``triton_ops/extend_attention.py``, ``_fwd_kernel``) with the draft tree as a custom mask.
This module reproduces that design at the project's layout (``mla_common``) so the verify
kernel (``mla_verify``) is measured against what servers actually do:

* **Grid** ``(batch, heads, cdiv(max_q_len, BLOCK_M))``: one program per (request, query
  head, block of BLOCK_M of the request's new tokens). Blocks past a request's q_len (a
  shorter request in a mixed batch) get empty loops and store nothing.
* **Stage 1** (the prefix): the program loads its ``[BLOCK_M, 512]`` latent and
  ``[BLOCK_M, 64]`` rope query rows of one head once, then walks the request's whole prefix
  in BLOCK_N tokens, gathering each token's page through ``kv_indices`` (token t is row
  ``t % PAGE_SIZE`` of page ``kv_indices[kv_indptr[b] + t // PAGE_SIZE]``). q.k is two dots,
  ``[M, 512] @ [512, N]`` plus ``[M, 64] @ [64, N]`` (576 is not a power of two), then an
  online softmax (running max and sum, exp2 of log2(e)-scaled logits, as the server's
  ``USE_EXP2`` path) and ``acc += p @ v``, v being the same rows' first 512 channels
  loaded again as ``[N, 512]``.
* **Stage 2** (the new tokens): the same loop over the request's own ``kv_new`` rows with
  the mask: causal (``j <= i``, and only up to the block's last row, as the server's
  ``IS_CAUSAL`` path bounds it) or the tree (``tree_mask[mask_indptr[b] + i*q_len + j]``,
  all q_len keys, as the server's ``USE_CUSTOM_MASK`` path with the prefix part of the mask
  skipped: every new token sees the whole prefix).
* **Store** ``out[qo_indptr[b] + i, head, :512]`` in q.dtype, rows past q_len masked.

What each program reads, and why verify is slow with it: every program reads its
request's **whole prefix** (576 channels a token), and there is one program per head, so at
Kimi-K2.5 TP8 the 8 query heads of a rank stream the one shared latent cache **8 times per
request** (:func:`extend_kv_reads`; at best from L2 when the head programs run in step,
from HBM once they drift apart), and each pass feeds the tensor cores only q_len useful rows
of the 32-row tile (4 at 3 draft tokens). Decode kernels avoid both by packing the heads
that share the latent into one tile; the extend kernel is a prefill kernel, where q_len is
in the thousands and a head-per-program grid has ample rows and programs. In the server it
serves verify because the one kernel already covers extend, draft-extend and verify (with
a custom mask) at any q_len.

Differences from the server kernel, none of which changes what is read or computed: the
tree mask here is q_len x q_len per request (the server's custom mask holds
``prefix + q_len`` columns per row and skips the prefix columns), the prefix is found
through the plan's page table (page id per token, PAGE_SIZE a constexpr), and the whole-tile skip on an
all-masked mask tile is omitted (a verify tile is never all masked: every token sees itself).

The semantics are ``reference.mla_attention_ref``; the launcher is :func:`mla_extend`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from microbench.kernels.checks import require_runnable, small_shared
from microbench.kernels.mla_common import HEAD_DIM, KV_LORA_RANK, ROPE_DIM, MLAPlan, check_mla_tensors

__all__ = ["BLOCK_M", "BLOCK_N", "ExtendTile", "extend_kv_reads", "extend_tile", "mla_extend"]

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

#: Query rows per tile and keys per block: SGLang's ``_get_block_sizes_for_extend_attention``
#: on Hopper (compute capability 9.x) for a head dimension above 256 (Lq = 576) picks
#: ``BLOCK_M, BLOCK_N = (32, 64)`` (the same in its older and newer versions). The small M
#: keeps the [32, 512] fp32 accumulator at 64 KB (64 registers a thread over 8 warps); N = 64
#: makes the K tile [512, 64] and the V tile [64, 512] 64 KB each in bf16. Built for sm_90
#: (``microbench compile``, Triton 3.9, ptxas 12.9, bf16, causal) the kernel takes 104 KiB of
#: shared memory and all 255 registers a thread, and spills 36 bytes a thread, as the
#: server's kernel does at this tile. BLOCK_M >= 16 is also tl.dot's minimum M.
BLOCK_M = 32
BLOCK_N = 64
#: Keys per block on a GPU whose block may take less than 128 KiB of shared memory (sm_86,
#: sm_89, sm_120 at 99 KiB), where the 104 KiB tile above cannot launch: the servers' choice
#: there for a head above 256 channels, ``(32, 32)``; 70 KiB on sm_120.
_BLOCK_N_SMALL_SHARED = 32
#: fp32 (a precision check here, never a model dtype) doubles every tile's bytes; a quarter
#: of the keys per block keeps q (72 KB) + K + V (32 KB each) well inside shared memory.
_BLOCK_N_FP32 = 16
#: The server's launch: ``num_warps = 4 if Lq <= 64 else 8`` -> 8 for 576 channels, and
#: ``num_stages = 1`` (no software pipelining: two buffers of 128 KB K+V would not fit).
_NUM_WARPS = 8
_NUM_STAGES = 1
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (log2 e = 1.4426950408889634 appears as a literal in the kernel: Triton reads module
# globals inside @triton.jit only when they are constexpr; a literal works in every version)


class ExtendTile(NamedTuple):
    """Launch shape of the extend kernel for one dtype."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def extend_tile(dtype: torch.dtype, small_smem: bool = False) -> ExtendTile:
    """The tile and launch parameters used for ``dtype`` (the server's for 16-bit types), on
    a GPU with less than 128 KiB of shared memory per block when ``small_smem``."""
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} not supported; use one of {_SUPPORTED_DTYPES}")
    block_n = _BLOCK_N_FP32 if dtype == torch.float32 else (_BLOCK_N_SMALL_SHARED if small_smem else BLOCK_N)
    return ExtendTile(BLOCK_M, block_n, _NUM_WARPS, _NUM_STAGES)


def extend_kv_reads(plan: MLAPlan, heads: int, elem_bytes: int) -> int:
    """Bytes of key rows the extend kernel's programs request for one call (host ints only).

    Each program with at least one query row reads its request's whole prefix (576
    channels a token) and the new-token rows its stage 2 covers; values are the same rows'
    first 512 channels, loaded again right after (cache hits), so they are not counted.
    Compare ``mla_cost``'s floor, which counts the prefix once: at one query block per
    request the ratio tends to ``heads`` as the prefix grows.
    """
    if heads < 1 or elem_bytes < 1:
        raise ValueError(f"heads and elem_bytes must be >= 1, got {heads}, {elem_bytes}")
    rows = 0
    for q_len, prefix in zip(plan.q_lens, plan.prefix_lens_host):
        for blk in range(triton.cdiv(q_len, BLOCK_M)):
            new_keys = q_len if plan.tree_mask is not None else min(q_len, (blk + 1) * BLOCK_M)
            rows += prefix + new_keys
    return heads * rows * HEAD_DIM * elem_bytes


# --------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------


@triton.jit
def _online_softmax_step(acc, e_max, deno, qk, visible, v, sm_scale, logit_cap,
                         HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one block of keys into (acc [M, 512], e_max [M], deno [M]), e_max in log2 units.

    qk [M, N] raw q.k in fp32, visible [M, N], v [N, 512] in the cache dtype.
    """
    s = qk * sm_scale
    if HAS_CAP:
        # cap * tanh(s / cap), tanh as 2 sigmoid(2x) - 1 exactly as the server writes it
        s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)
    s = tl.where(visible, s * 1.4426950408889634, float("-inf"))
    row_max = tl.max(s, 1)
    # a row with nothing visible yet (a padded row) would give -inf - -inf = NaN; the
    # server substitutes -1e20 so its weights come out exactly 0
    row_max = tl.where(row_max == float("-inf"), -1e20, row_max)
    n_e_max = tl.maximum(row_max, e_max)
    re_scale = tl.exp2(e_max - n_e_max)
    p = tl.exp2(s - n_e_max[:, None])
    deno = deno * re_scale + tl.sum(p, 1)
    acc = acc * re_scale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    return acc, n_e_max, deno


@triton.jit
def _mla_extend_kernel(
    q_ptr, kv_new_ptr, cache_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, prefix_lens_ptr,
    tree_mask_ptr, mask_indptr_ptr, out_ptr,
    num_heads, sm_scale, logit_cap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DMODEL: tl.constexpr, BLOCK_DPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, USE_TREE_MASK: tl.constexpr, HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (request b, head h, query block mb): out rows of those queries for that head.

    q [T, H, 576], kv_new [T, 576], cache [pages, PAGE_SIZE, 576], out [T, H, 512], all
    contiguous; tree_mask uint8 [sum q_len^2] (read only when USE_TREE_MASK).
    """
    HEAD: tl.constexpr = BLOCK_DMODEL + BLOCK_DPE
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)

    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    prefix = tl.load(prefix_lens_ptr + b)
    page_base = tl.load(kv_indptr_ptr + b)
    # a block past this request's q_len (a shorter request of a mixed batch) walks no keys;
    # the server's newer kernel returns early here, a zero loop bound does the same
    has_rows = mb * BLOCK_M < q_len
    prefix_end = tl.where(has_rows, prefix, 0)

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index i within the request
    mask_m = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dpe = BLOCK_DMODEL + tl.arange(0, BLOCK_DPE)
    q_row = ((q_start + offs_m).to(tl.int64) * num_heads + h) * HEAD
    q = tl.load(q_ptr + q_row[:, None] + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    qpe = tl.load(q_ptr + q_row[:, None] + offs_dpe[None, :], mask=mask_m[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_DMODEL], dtype=tl.float32)
    deno = tl.zeros([BLOCK_M], dtype=tl.float32)
    e_max = tl.full([BLOCK_M], float("-inf"), tl.float32)

    # stage 1: the whole prefix, through the page table; every valid row sees every key
    for start_n in range(0, prefix_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_end
        page = tl.load(kv_indices_ptr + page_base + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        kv_row = (page * PAGE_SIZE + offs_n % PAGE_SIZE) * HEAD
        # K loaded transposed [512, N] (as the server does), then the rope part [64, N]
        k = tl.load(cache_ptr + kv_row[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        kpe = tl.load(cache_ptr + kv_row[None, :] + offs_dpe[:, None], mask=mask_n[None, :], other=0.0)
        qk = tl.dot(qpe, kpe, acc=qk, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        v = tl.load(cache_ptr + kv_row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        visible = mask_m[:, None] & mask_n[None, :]
        acc, e_max, deno = _online_softmax_step(acc, e_max, deno, qk, visible, v, sm_scale, logit_cap,
                                                HAS_CAP, DOT_PRECISION)

    # stage 2: the request's own new tokens (kv_new rows), masked
    if USE_TREE_MASK:
        new_end = q_len  # a tree row may see any earlier token: all q_len keys
        mask_start = tl.load(mask_indptr_ptr + b)
    else:
        new_end = tl.minimum(q_len, (mb + 1) * BLOCK_M)  # causal: no key past the block's last row
    new_end = tl.where(has_rows, new_end, 0)
    for start_n in range(0, new_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # new-token index j
        mask_n = offs_n < new_end
        kv_row = (q_start + offs_n).to(tl.int64) * HEAD
        k = tl.load(kv_new_ptr + kv_row[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        kpe = tl.load(kv_new_ptr + kv_row[None, :] + offs_dpe[:, None], mask=mask_n[None, :], other=0.0)
        qk = tl.dot(qpe, kpe, acc=qk, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        v = tl.load(kv_new_ptr + kv_row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        both = mask_m[:, None] & mask_n[None, :]
        if USE_TREE_MASK:
            m_off = mask_start + offs_m[:, None] * q_len + offs_n[None, :]
            visible = both & (tl.load(tree_mask_ptr + m_off, mask=both, other=0) != 0)
        else:
            visible = both & (offs_m[:, None] >= offs_n[None, :])
        acc, e_max, deno = _online_softmax_step(acc, e_max, deno, qk, visible, v, sm_scale, logit_cap,
                                                HAS_CAP, DOT_PRECISION)

    # every stored row saw at least itself, so deno > 0; padded rows are not stored
    o = acc / tl.where(mask_m, deno, 1.0)[:, None]
    o_row = ((q_start + offs_m).to(tl.int64) * num_heads + h) * BLOCK_DMODEL
    tl.store(out_ptr + o_row[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


def mla_extend(q: Tensor, kv_new: Tensor, kv_cache: Tensor, plan: MLAPlan, *, out: Tensor | None = None) -> Tensor:
    """MLA attention of every request's new tokens over its paged prefix and themselves,
    with the server's extend kernel (one program per request x head x query block).

    Args:
        q: ``[T, H, 576]`` the new tokens' queries (512 latent + 64 rope), fp16 / bf16 / fp32;
            T = plan.total_q, any H >= 1.
        kv_new: ``[T, 576]`` the new tokens' latent rows, same dtype.
        kv_cache: ``[num_pages, page_size, 576]`` the paged prefix latents, same dtype.
        plan: from ``mla_common.plan_mla`` (causal, or a tree mask); no q_len limit of the
            kernel's own: longer requests take more query blocks.
        out: optional ``[T, H, 512]`` contiguous tensor in q.dtype, overwritten.

    Returns:
        ``out`` ``[T, H, 512]`` in q.dtype (dots accumulate and the softmax runs in fp32).

    Raises:
        ValueError: a bad tensor (via ``check_mla_tensors``, naming it), no heads, or an
            unsupported dtype. TypeError: an argument that is not a tensor.

    One launch, no synchronisation: the grid comes from the plan's host fields.
    """
    out = check_mla_tensors(q, kv_new, kv_cache, plan, out)
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} not supported; use one of {_SUPPORTED_DTYPES}")
    heads = q.shape[1]
    if heads < 1:
        raise ValueError(f"q: needs at least one head, got shape {tuple(q.shape)}")
    require_runnable(_mla_extend_kernel, q, "q")

    tile = extend_tile(q.dtype, small_shared(q.device))
    use_tree = plan.tree_mask is not None
    # bool pointers are not portable across Triton versions: pass the mask's bytes; without
    # a tree any int32 tensor stands in (never read: USE_TREE_MASK is a constexpr)
    tree = plan.tree_mask.view(torch.uint8) if use_tree else plan.qo_indptr
    mask_indptr = plan.mask_indptr if use_tree else plan.qo_indptr
    fp32 = q.dtype == torch.float32
    grid = (plan.batch, heads, triton.cdiv(plan.max_q_len, tile.block_m))
    _mla_extend_kernel[grid](
        q, kv_new, kv_cache, plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.prefix_lens,
        tree, mask_indptr, out,
        heads, plan.sm_scale, plan.logit_cap if plan.logit_cap > 0 else 1.0,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_DMODEL=KV_LORA_RANK, BLOCK_DPE=ROPE_DIM,
        PAGE_SIZE=plan.page_size, USE_TREE_MASK=use_tree, HAS_CAP=plan.logit_cap > 0,
        # fp32 is the precision check: full-precision products, not TF32's 10-bit mantissa
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
