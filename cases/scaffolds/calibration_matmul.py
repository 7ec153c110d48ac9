"""A starting point for calibration.matmul: one Triton program per [BLOCK_M, BLOCK_N] tile of c.

Signature (microbench list --case calibration.matmul): fn(a, b, c)
  a, b [n, n] in, c [n, n] written (c = a @ b); bf16 on CUDA, fp32 on CPU; FLOPs = 2 n^3.

This is the simplest correct kernel: a tiled tl.dot over K with an fp32 accumulator, masked
at the edges so any n works. Make it fast: bigger tiles, num_stages / num_warps, grouped
(swizzled) program order for L2 reuse, autotune, a persistent or TMA-based kernel.

Check and time it:   microbench try THIS_FILE::my_matmul --case calibration.matmul
Iterate on save:     microbench try THIS_FILE::my_matmul --case calibration.matmul --watch
"""

import triton
import triton.language as tl


@triton.jit
def _my_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                      stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def my_matmul(a, b, c):
    M, K = a.shape
    K2, N = b.shape
    assert K == K2 and c.shape == (M, N)
    BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _my_matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                            c.stride(0), c.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
