"""A starting point for norm.rmsnorm: one Triton program per row, the row in one block.

Signature (microbench list --case norm.rmsnorm): fn(x, weight, eps, out, residual=None)
  x [tokens, width], weight [width], out [tokens, width] written; with residual [tokens, width]:
  residual <- x + residual, then out = rmsnorm(residual) * weight.

Check and time it:   microbench try THIS_FILE::my_rmsnorm --case norm.rmsnorm
Iterate on save:     microbench try THIS_FILE::my_rmsnorm --case norm.rmsnorm --watch
"""

import triton
import triton.language as tl


@triton.jit
def _my_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, width, eps, HAS_RESIDUAL: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(x_ptr + row * width + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * width + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * width + offs, x.to(res_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def my_rmsnorm(x, weight, eps, out, residual=None):
    tokens, width = x.shape
    assert x.is_contiguous() and out.is_contiguous()
    res = residual if residual is not None else x  # unread without a residual
    _my_rmsnorm_kernel[(tokens,)](x, res, weight, out, width, eps, HAS_RESIDUAL=residual is not None,
                                  BLOCK=triton.next_power_of_2(width))
