"""A starting point for calibration.copy: one Triton program per block of elements.

Signature (microbench list --case calibration.copy): fn(src, dst)
  src [n] fp32, dst [n] fp32 written (dst = src, exactly); bytes = read n*4 + write n*4.

This is the simplest correct kernel: a flat, masked load and store. Make it fast: tune BLOCK
and num_warps, try a persistent grid that strides over the buffer, vectorize the accesses.

Check and time it:   microbench try THIS_FILE::my_copy --case calibration.copy
Iterate on save:     microbench try THIS_FILE::my_copy --case calibration.copy --watch
"""

import triton
import triton.language as tl


@triton.jit
def _my_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def my_copy(src, dst):
    n = src.numel()
    assert src.is_contiguous() and dst.is_contiguous() and dst.numel() == n
    BLOCK = 4096
    _my_copy_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK)
