"""What both fused-expert kernels share: the weight layout they read, argument checks,
and the ``@triton.jit`` weight-tile loader (their tile configurations and tuning table:
``moe_tuning``).

Weights are repacked once, at load time (:func:`prepare_weights`), never in the timed
step:

- **bf16** stays as the checkpoint has it: ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, the
  inputs (K) contiguous — what servers' fused-MoE kernel reads.
- **INT4** (checkpoint: ``qweight [E, N, K/8]`` with 8 nibbles along K per int32, scales
  ``[E, N, K/32]``, see ``moe_reference``) is transposed to ``[E, K/8, N]`` words and
  ``[E, K/32, N]`` scales: a tile's row of words is then contiguous across the N output
  channels, so a warp's loads coalesce along N while the 8 inputs of one word are
  unpacked in registers.  The bits are unchanged.

Layout: constants → the ``@triton.jit`` helper → weights → checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from microbench.kernels.checks import check_tensor
from microbench.kernels.moe_reference import INT4_PER_WORD, check_int4_weight

__all__ = [
    "ACTIVATION_DTYPES",
    "ExpertWeights",
    "check_moe_args",
    "prepare_weights",
]

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

#: Activation dtypes: bf16 is the model's; fp16 and fp32 also serve the CPU interpreter,
#: whose own bf16 tl.dot is broken (the tests patch it: tests/interp_bf16.py).
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------
# The weight-tile loader (both kernels)
# --------------------------------------------------------------------------------------


@triton.jit
def _mma(a, w):
    """``a @ w`` with ``w`` cast to ``a``'s dtype, accumulated in fp32. fp32 operands are
    multiplied at full precision: compiled, ``tl.dot`` would use TF32 (a 10-bit mantissa)
    by default, which the interpreter never does and an fp32 gate over K = 7168 rejects."""
    if a.dtype == tl.float32:
        return tl.dot(a, w.to(a.dtype), input_precision="ieee")
    else:
        return tl.dot(a, w.to(a.dtype))


@triton.jit
def _weight_tile(w_ptr, s_ptr, offs_k, offs_n, mask, stride_k, stride_n, stride_sk, stride_sn,
                 INT4: tl.constexpr, GROUP: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` tile of one expert's weight (``w_ptr``/``s_ptr`` already
    at the expert): bf16/fp16 as stored, or INT4 dequantised to fp32.

    INT4: word ``k // 8`` holds input k at bits ``4 * (k % 8)`` as ``q + 8``; the eight
    inputs of a word are loaded from the same address (one transaction, cached) and
    shifted apart in registers.
    """
    if INT4:
        words = tl.load(w_ptr + (offs_k // 8)[:, None] * stride_k + offs_n[None, :] * stride_n, mask=mask, other=0)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        sc = tl.load(s_ptr + (offs_k // GROUP)[:, None] * stride_sk + offs_n[None, :] * stride_sn, mask=mask,
                     other=0.0)
        return (q - 8).to(tl.float32) * sc.to(tl.float32)
    else:
        return tl.load(w_ptr + offs_k[:, None] * stride_k + offs_n[None, :] * stride_n, mask=mask, other=0.0)


@triton.jit
def _int4_tile_once(w_ptr, s_ptr, k0, k_hi, offs_n, n_ok, stride_k, stride_n, stride_sk, stride_sn,
                    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The INT4 tile of inputs ``[k0, k0 + BLOCK_K)`` (``k0`` a multiple of 8 and of the
    group when ``BLOCK_K >= GROUP``; inputs from ``k_hi`` on read as zero weights), with
    each word and each scale loaded once: ``BLOCK_K / 8`` rows of words are shifted into
    a ``[BLOCK_K / 8, 8, BLOCK_N]`` block and reshaped (row ``k = 8 * word + nibble``),
    the ``BLOCK_K / GROUP`` scale rows broadcast over their groups. A tuning option of
    the few-token kernel (``GemmConfig.unpack = 1``): :func:`_weight_tile` issues eight
    loads per word (one per input row, served from L1), this one none redundant, at the
    cost of the reshape's register shuffles; which is faster is the GPU's to say.
    """
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptr + offs_w[:, None] * stride_k + offs_n[None, :] * stride_n,
                    mask=(offs_w * 8 < k_hi)[:, None] & n_ok[None, :], other=0)
    q = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    q = tl.reshape(q, (BLOCK_K, BLOCK_N))
    if BLOCK_K >= GROUP:
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        sc = tl.load(s_ptr + offs_g[:, None] * stride_sk + offs_n[None, :] * stride_sn,
                     mask=(offs_g * GROUP < k_hi)[:, None] & n_ok[None, :], other=0.0)
        sc = tl.reshape(tl.broadcast_to(sc[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N)), (BLOCK_K, BLOCK_N))
    else:  # the whole tile inside one group
        sc = tl.load(s_ptr + (k0 // GROUP) * stride_sk + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
    k_ok = (k0 + tl.arange(0, BLOCK_K)) < k_hi
    return tl.where(k_ok[:, None], (q - 8).to(tl.float32) * sc.to(tl.float32), 0.0)


# --------------------------------------------------------------------------------------
# Weights in the kernels' layout
# --------------------------------------------------------------------------------------


@dataclass
class ExpertWeights:
    """One layer's routed-expert weights as the kernels read them (see the module doc).

    ``kind`` is ``"bf16"`` (dense, any half or fp32 dtype) or ``"int4"``; ``inter`` is
    the per-rank intermediate I (w13 has 2I output rows).
    """

    kind: str
    num_experts: int
    hidden: int
    inter: int
    group_size: int
    w13: Tensor  # dense [E, 2I, H]; int4 [E, H/8, 2I] int32
    w2: Tensor  # dense [E, H, I]; int4 [E, I/8, H] int32
    s13: Tensor | None = None  # int4 [E, H/G, 2I]
    s2: Tensor | None = None  # int4 [E, I/G, H]

    @property
    def int4(self) -> bool:
        return self.kind == "int4"

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def gemm(self, which: str) -> tuple[Tensor, Tensor, tuple[int, ...]]:
        """``(weight, scales, strides)`` of ``which`` ("w13" or "w2") for a kernel:
        strides are (expert, k, n, scale expert, scale k, scale n); dense weights pass
        themselves as the (unread) scales."""
        w, s = (self.w13, self.s13) if which == "w13" else (self.w2, self.s2)
        if self.int4:
            return w, s, (w.stride(0), w.stride(1), w.stride(2), s.stride(0), s.stride(1), s.stride(2))
        return w, w, (w.stride(0), w.stride(2), w.stride(1), 0, 0, 0)


def prepare_weights(w13: Tensor, w2: Tensor, *, w13_scales: Tensor | None = None,
                    w2_scales: Tensor | None = None) -> ExpertWeights:
    """Check checkpoint-layout weights and repack them for the kernels (load time).

    Args:
        w13: dense ``[E, 2I, H]`` (gate rows, then up rows), or INT4 ``[E, 2I, H/8]`` int32.
        w2: dense ``[E, H, I]``, or INT4 ``[E, H, I/8]`` int32.
        w13_scales, w2_scales: the INT4 scales ``[E, 2I, H/G]`` / ``[E, H, I/G]``; both or
            neither.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, a packed tensor of the wrong
            shape, or a group size that does not divide the input dimension — naming the
            argument.
    """
    for name, t in (("w13", w13), ("w2", w2)):
        check_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D [E, N, K] tensor, got shape {tuple(t.shape)}")
    if (w13_scales is None) != (w2_scales is None):
        raise ValueError("w13_scales / w2_scales: give both (INT4 weights) or neither (dense weights)")
    if w2.device != w13.device:
        raise ValueError(f"w2: on {w2.device}, but w13 is on {w13.device}")
    e, n13 = w13.shape[0], w13.shape[1]
    if n13 % 2:
        raise ValueError(f"w13: {n13} output rows cannot be split into gate and up halves")
    inter = n13 // 2
    if w2.shape[0] != e:
        raise ValueError(f"w2: {w2.shape[0]} experts, but w13 has {e}")
    if w13_scales is None:
        h = w13.shape[2]
        if w13.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"w13: dtype {w13.dtype} is not a dense weight dtype {ACTIVATION_DTYPES}")
        check_tensor("w2", w2, shape=(e, h, inter), like_name="w13's [E, H, I]")
        if w2.dtype != w13.dtype:
            raise ValueError(f"w2: dtype {w2.dtype} does not match w13 ({w13.dtype})")
        return ExpertWeights("bf16", e, h, inter, 0, w13, w2)
    h = w13.shape[2] * INT4_PER_WORD
    g13 = check_int4_weight("w13", w13, w13_scales)
    if tuple(w2.shape[:2]) != (e, h):
        raise ValueError(f"w2: expected [{e}, {h}, I/8] int32 to match w13, got {tuple(w2.shape)}")
    g2 = check_int4_weight("w2", w2, w2_scales, k=inter)
    if g13 != g2:
        raise ValueError(f"w2_scales: group size {g2} differs from w13's {g13}")
    for name, t in (("w13_scales", w13_scales), ("w2_scales", w2_scales)):
        check_tensor(name, t)
        if t.device != w13.device:
            raise ValueError(f"{name}: on {t.device}, but w13 is on {w13.device}")
    t13, t2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    return ExpertWeights("int4", e, h, inter, g13, t13, t2,
                         w13_scales.transpose(1, 2).contiguous(), w2_scales.transpose(1, 2).contiguous())


# --------------------------------------------------------------------------------------
# Argument checks shared by the launchers
# --------------------------------------------------------------------------------------


def check_moe_args(hidden: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor,
                   out: Tensor | None, check_ids: bool, remote: bool = True) -> tuple[int, int]:
    """Raise ``ValueError`` naming the argument unless a fused-experts call is well formed;
    return ``(T, top_k)``.  ``check_ids`` reads the ids on the host (a synchronisation);
    ``remote`` False: a ``-1`` id (another rank's expert) is refused too, for a kernel
    called without what it needs to skip one."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights: expected ExpertWeights (from prepare_weights), got {type(weights).__name__}")
    check_tensor("hidden", hidden)
    if hidden.dim() != 2 or hidden.shape[1] != weights.hidden:
        raise ValueError(f"hidden: expected [T, {weights.hidden}] (the weights' H), got {tuple(hidden.shape)}")
    if hidden.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"hidden: dtype {hidden.dtype} not supported; use one of {ACTIVATION_DTYPES}")
    if not weights.int4 and weights.w13.dtype != hidden.dtype:
        raise ValueError(f"weights: dense dtype {weights.w13.dtype} does not match hidden ({hidden.dtype})")
    if weights.device != hidden.device:
        raise ValueError(f"weights: on {weights.device}, but hidden is on {hidden.device}")
    check_tensor("topk_ids", topk_ids)
    t = hidden.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype != torch.int32:
        raise ValueError(f"topk_ids: expected int32 [{t}, top_k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    # No upper bound from the weights: under expert parallelism a rank may hold fewer
    # experts than a token picks (its other choices are -1).
    if k < 1:
        raise ValueError(f"topk_ids: top_k = {k} must be at least 1")
    check_tensor("topk_weights", topk_weights, shape=(t, k), like_name="topk_ids")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights: dtype {topk_weights.dtype}, expected torch.float32")
    for name, x in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if x.device != hidden.device:
            raise ValueError(f"{name}: on {x.device}, but hidden is on {hidden.device}")
    if out is not None:
        check_tensor("out", out, like=hidden, like_name="hidden")
    if check_ids and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= weights.num_experts:
            raise ValueError(f"topk_ids: expert ids must lie in 0..{weights.num_experts - 1} (or -1: another "
                             f"rank's expert), got range {lo}..{hi}")
        if lo == -1 and not remote:
            raise ValueError("topk_ids: -1 (another rank's expert) needs remote_ids=True, which zeroes those "
                             "pairs' rows; without it their rows are never written and their tokens' sums "
                             "are undefined")
    return t, k
