"""RMSNorm and fused residual-add + RMSNorm as Triton kernels.

DeepSeek-V3-family decoder layers normalise twice per layer (before attention and before
the MoE block), each time fused with the residual add the way inference servers run it
(``fused_add_rmsnorm``)::

    residual <- x + residual            # in place, rounded to x.dtype
    out      <- rmsnorm(residual) * weight

The op is memory-bound at every shape the project runs (at most 1 FLOP per byte moved for
bf16, see ``reference.rmsnorm_cost``), so the kernel reads each row once, keeps it in
registers, and writes each output once: one program per row, the whole row in one block.

Layout of this module: constants (with the reason for each) → ``@triton.jit`` kernels →
the public launcher :func:`rmsnorm`, which checks arguments, allocates and launches.
The semantics are defined by ``reference.rmsnorm_ref``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from microbench.kernels.checks import check_tensor, require_runnable

__all__ = ["MAX_HIDDEN", "SUPPORTED_DTYPES", "rmsnorm"]

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

# The whole row lives in one block of registers (BLOCK = next_power_of_2(H)), so H is
# bounded by what a program can hold: 16384 fp32 values over 16 warps is 32 per thread,
# twice DeepSeek-V3's hidden size of 7168 (BLOCK 8192).  Beyond this the kernel would
# need a looped two-pass variant, which no model in scope needs.
MAX_HIDDEN = 16384

# Activations arrive as bf16 on the GPU; fp16 and fp32 run through the same path, and fp32
# also serves as a high-precision check.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Target elements per thread when choosing num_warps: 8 bf16 values are 16 bytes, the
# widest load one thread issues, so rows of up to 8·32·num_warps elements are read with
# full-width vector loads while keeping register pressure low (x, weight and the fp32
# result are each 8 registers per thread).
_ELEMS_PER_THREAD = 8

# At least one warp; at most 16 (512 threads): the row's sum of squares crosses warps
# through shared memory and a barrier whose cost grows with the warp count, while 512
# threads already keep a whole 8192-wide row's loads in flight (16 elements each).
# (Liger-Kernel and Triton's fused-softmax tutorial use the same ladder; the benchmark
# is where a different value should prove itself.)
_MIN_WARPS = 1
_MAX_WARPS = 16


def _num_warps(block: int) -> int:
    """Warps for a one-row block of ``block`` elements (a power of two)."""
    warps = block // (32 * _ELEMS_PER_THREAD)
    return max(_MIN_WARPS, min(_MAX_WARPS, warps))


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    """y[row] = x[row] * rsqrt(mean(x[row]**2) + eps) * w, for one row per program.

    x, y: contiguous [T, H]; w: [H].  Accumulates in fp32; rounds once, at the store.
    """
    # int64 row offset: T·H may exceed 2**31 elements for long prefills.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    offs = row * H + cols
    # Masked lanes load 0, so they add nothing to the sum of squares.
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / H
    rstd = tl.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    """res[row] <- x[row] + res[row];  y[row] = rmsnorm(x[row] + res[row]) * w.

    x, res, y: contiguous [T, H]; w: [H].  The sum is formed in fp32, stored to ``res``
    rounded to its dtype, and normalised unrounded (as FlashInfer's fused_add_rmsnorm
    does), so y carries one rounding, not two.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    offs = row * H + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = x + r
    # Each program reads its row of res before writing it back, so the in-place update
    # is race-free: no other program touches this row.
    tl.store(res_ptr + offs, s.to(res_ptr.dtype.element_ty), mask=mask)
    mean_sq = tl.sum(s * s, axis=0) / H
    rstd = tl.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = s * rstd * w
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether the memory spans of two contiguous tensors intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1


def rmsnorm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    *,
    residual: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """RMSNorm of each row of ``x``, optionally fused with the residual add.

    Without ``residual``: ``out = x / sqrt(mean(x**2, -1) + eps) * weight``.

    With ``residual`` (the server's ``fused_add_rmsnorm``): ``residual`` is **updated in
    place** to ``x + residual`` (rounded to x.dtype) and ``out`` receives
    ``rmsnorm(x + residual) * weight``, normalising the unrounded fp32 sum.

    Accumulation is in fp32; ``out`` is in x.dtype.  One program per row, the whole row
    in one block of ``next_power_of_2(H)`` lanes.

    Args:
        x: ``[T, H]`` contiguous, float16 / bfloat16 / float32, ``1 <= H <= MAX_HIDDEN``.
        weight: ``[H]`` contiguous, same dtype and device as x.
        eps: finite, ``>= 0``; added to the mean square (DeepSeek-V3: 1e-6).
        residual: optional ``[T, H]`` contiguous tensor like x, overwritten with the sum.
        out: optional preallocated ``[T, H]`` contiguous tensor like x; it may be x
            itself (each row is read before it is written) but must not overlap residual,
            weight, or x otherwise.

    Returns:
        ``out`` (the preallocated tensor when given, else a new one).

    Raises:
        ValueError: a shape, dtype, device, layout or eps problem; the message names the
            argument.  TypeError: an argument that is not a tensor.

    Tensors must be on a CUDA device, or on the CPU when Triton's interpreter is on
    (``TRITON_INTERPRET=1`` set before this module is first imported).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, H] tensor, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x: dtype {x.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    if not x.is_contiguous():
        raise ValueError(f"x: must be contiguous (strides {x.stride()})")
    T, H = x.shape
    if not 1 <= H <= MAX_HIDDEN:
        raise ValueError(f"x: hidden size H={H} outside 1..{MAX_HIDDEN} (one row per block)")

    check_tensor("weight", weight, shape=(H,), like=x)

    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ValueError(f"eps: expected a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: must be finite and >= 0, got {eps}")

    if residual is not None:
        check_tensor("residual", residual, like=x)
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor("out", out, like=x)
        if residual is not None and _overlap(out, residual):
            raise ValueError("out: overlaps residual, which would destroy the new residual")
        if _overlap(out, weight):
            raise ValueError("out: overlaps weight, which every row reads")
        if _overlap(out, x) and out.data_ptr() != x.data_ptr():
            raise ValueError("out: overlaps x without being x (a row would be written before another reads it)")

    kernel = _rmsnorm_kernel if residual is None else _fused_add_rmsnorm_kernel
    require_runnable(kernel, x)
    if T == 0:  # a zero-size grid is not a launch; nothing to write
        return out

    block = triton.next_power_of_2(H)
    warps = _num_warps(block)
    grid = (T,)
    if residual is None:
        _rmsnorm_kernel[grid](x, weight, out, H, float(eps), BLOCK=block, num_warps=warps)
    else:
        _fused_add_rmsnorm_kernel[grid](
            x, residual, weight, out, H, float(eps), BLOCK=block, num_warps=warps
        )
    return out
