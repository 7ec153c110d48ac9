"""User-style kernels for the ``microbench compile`` tests, with norm.rmsnorm's variant
signature: one that the compiler rejects although the interpreter runs it (a tl.dot with
K = 4), one whose tiles cannot fit an H200 block's shared memory, one that fits, and one
whose process dies."""

import triton
import triton.language as tl


@triton.jit
def _tiny_dot(x_ptr, o_ptr):
    r = tl.arange(0, 4)
    a = tl.load(x_ptr + r[:, None] * 4 + r[None, :])
    tl.store(o_ptr + r[:, None] * 4 + r[None, :], tl.dot(a, a))


@triton.jit
def _big_tiles(x_ptr, o_ptr, n, T: tl.constexpr):
    r = tl.arange(0, T)
    acc = tl.zeros((T, T), dtype=tl.float32)
    for k in range(0, n, T):
        a = tl.load(x_ptr + r[:, None] * n + k + r[None, :])
        b = tl.load(x_ptr + (k + r[:, None]) * n + r[None, :])
        acc += tl.dot(a, b)
    tl.store(o_ptr + r[:, None] * T + r[None, :], acc.to(o_ptr.dtype.element_ty))


def tiny_dot(x, weight, eps, out, residual=None):
    _tiny_dot[(1,)](x, out)


def big_tiles(x, weight, eps, out, residual=None):
    _big_tiles[(1,)](x, out, x.shape[1], T=256, num_warps=8, num_stages=4)


@triton.jit
def _fits(x_ptr, o_ptr, H, BLOCK: tl.constexpr):
    c = tl.arange(0, BLOCK)
    row = tl.program_id(0)
    v = tl.load(x_ptr + row * H + c, mask=c < H, other=0.0)
    tl.store(o_ptr + row * H + c, v * 2, mask=c < H)


def fits(x, weight, eps, out, residual=None):
    _fits[(x.shape[0],)](x, out, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4)


def dies(x, weight, eps, out, residual=None):
    """A variant whose process ends mid-call (as one killed for memory would)."""
    import os

    os._exit(3)
