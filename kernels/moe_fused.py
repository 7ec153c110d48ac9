"""The fused-MoE kernel servers run (the baseline): block-aligned expert GEMMs.

The design of vLLM's and SGLang's Triton ``fused_moe``, rewritten here: the (token,
expert) pairs are sorted by expert and each expert's run padded to ``BLOCK_M`` rows
(``moe_routing.align``); one GEMM kernel runs a program per (row block, N tile), looks
up the block's expert, gathers the block's activation rows and streams that expert's
weight tile.  A layer is five launches::

    align (BLOCK_M)  ->  GEMM w13: [pairs, 2I]  ->  SiLU(gate) * up: [pairs, I]
                     ->  GEMM w2 x router weight: [pairs, H]  ->  sum over top-k: [T, H]

Each weight tile of an expert is read once per row block of that expert, so an expert
with at most ``BLOCK_M`` tokens is read once — but every touched expert costs at least
one full ``BLOCK_M``-row block of MMA work and gathers, and with T of 1..64 tokens most
rows of most blocks are padding.  INT4 weights (``moe_common``'s kernel layout) are
dequantised per tile in registers before the MMA (W4A16).

Layout: constants → ``@triton.jit`` kernels → the public launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from microbench.kernels.checks import require_runnable
from microbench.kernels.moe_common import ExpertWeights, _mma, _weight_tile, check_moe_args
from microbench.kernels.moe_tuning import GemmConfig, default_config
from microbench.kernels.moe_routing import align

__all__ = ["fused_moe"]

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

# The SiLU-and-mul kernel: one program per (pair, 1024 channels); I is 256..2048 per rank.
_ACT_BLOCK = 1024


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _fused_moe_kernel(a_ptr, w_ptr, s_ptr, c_ptr, topk_w_ptr, sorted_ptr, blocks_ptr, npad_ptr,
                      N, K, num_pairs, num_row_blocks,
                      stride_am, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn, stride_cm,
                      A_ROWS_PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr, INT4: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    """``C[pair] = A[row(pair)] @ W[expert(block)]^T`` for one (row block, N tile).

    ``A_ROWS_PER_PAIR``: the top-k when A is the hidden states (pair p reads token
    p // top_k), 0 when A holds one row per pair (then row = pair).  Blocks past the
    padded total, and padding rows (sentinel = num_pairs), do nothing.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M row blocks walk the N tiles together (L2 reuse of A)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_row_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    expert = tl.load(blocks_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)
    row_ok = pairs < num_pairs
    if A_ROWS_PER_PAIR > 0:
        a_rows = pairs // A_ROWS_PER_PAIR
    else:
        a_rows = pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(a_base + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_base, s_base, k, offs_n, k_ok[:, None] & n_ok[None, :], stride_wk, stride_wn,
                         stride_sk, stride_sn, INT4, GROUP)
        acc += _mma(a, w)
    if MUL_WEIGHT:
        acc *= tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, inter, BLOCK: tl.constexpr):
    """``y[p] = silu(x[p, :I]) * x[p, I:]`` in fp32, stored in y's dtype."""
    p = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inter
    g = tl.load(x_ptr + p * 2 * inter + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + p * 2 * inter + inter + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + p * inter + c, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


def _gemm(a: Tensor, weights: ExpertWeights, which: str, c: Tensor, topk_weights: Tensor, sorted_ids: Tensor,
          blocks: Tensor, npad: Tensor, num_pairs: int, rows_per_pair: int, mul_weight: bool,
          cfg: GemmConfig) -> None:
    w, s, st = weights.gemm(which)
    n, k = c.shape[1], a.shape[1]
    num_row_blocks = blocks.numel()
    grid = (num_row_blocks * triton.cdiv(n, cfg.block_n),)
    _fused_moe_kernel[grid](
        a, w, s, c, topk_weights, sorted_ids, blocks, npad, n, k, num_pairs, num_row_blocks,
        a.stride(0), *st, c.stride(0), A_ROWS_PER_PAIR=rows_per_pair, MUL_WEIGHT=mul_weight,
        INT4=weights.int4, GROUP=max(weights.group_size, 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def fused_moe(hidden: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor, *,
              out: Tensor | None = None, config: GemmConfig | None = None, check_ids: bool = False,
              remote_ids: bool = False) -> Tensor:
    """The routed experts of one layer, server style (semantics: ``fused_moe_ref``).

    Args:
        hidden: ``[T, H]`` contiguous bf16 (fp16/fp32 for CPU tests).
        weights: from ``moe_common.prepare_weights`` (bf16 of hidden's dtype, or INT4).
        topk_weights: ``[T, top_k]`` float32 router weights; ``topk_ids``: ``[T, top_k]``
            int32 expert ids (``moe_routing.route``).
        out: ``[T, H]`` like hidden, written; allocated when ``None``.
        config: the tile configuration (one for both GEMMs, as servers use; its
            ``block_m`` is the alignment block); ``default_config("fused", ...)`` if None.
        check_ids: read the ids on the host and raise for one out of range, or for a
            ``-1`` without ``remote_ids`` (a synchronisation).  Without it such a pair is
            dropped by the alignment and its token's output row is undefined.
        remote_ids: ``topk_ids`` may hold ``-1`` for experts on other ranks (expert
            parallelism); their pairs' rows are zeroed first (one memset) so they add
            nothing, as servers' kernels write zeros for them.

    Returns:
        ``out``.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, top_k < 1 (naming the argument),
            before any launch.
    """
    t, top_k = check_moe_args(hidden, weights, topk_weights, topk_ids, out, check_ids, remote=remote_ids)
    require_runnable(_fused_moe_kernel, hidden, "hidden")
    cfg = config or default_config("fused", "w13+w2", weights.kind, 2 * weights.inter, weights.hidden, t)
    out = torch.empty_like(hidden) if out is None else out
    if t == 0:
        return out
    pairs = t * top_k
    sorted_ids, blocks, npad = align(topk_ids, weights.num_experts, cfg.block_m)
    dev, dt = hidden.device, hidden.dtype
    inter = weights.inter
    gate_up = torch.empty(pairs, 2 * inter, dtype=dt, device=dev)
    act = torch.empty(pairs, inter, dtype=dt, device=dev)
    down = (torch.zeros if remote_ids else torch.empty)(pairs, weights.hidden, dtype=dt, device=dev)
    _gemm(hidden, weights, "w13", gate_up, topk_weights, sorted_ids, blocks, npad, pairs, top_k, False, cfg)
    _silu_and_mul_kernel[(pairs, triton.cdiv(inter, _ACT_BLOCK))](gate_up, act, inter, BLOCK=_ACT_BLOCK)
    _gemm(act, weights, "w2", down, topk_weights, sorted_ids, blocks, npad, pairs, 0, True, cfg)
    # servers' moe_sum (a pair dropped for a bad id leaves its row unwritten, so without
    # check_ids that token's output is undefined, as in servers)
    torch.sum(down.view(t, top_k, weights.hidden), dim=1, out=out)
    return out
