"""The interpreter's bf16 dot patch (tests/interp_bf16.py) computes what a tensor core does.

The bf16 kernel tests lean on it, so it is checked on its own: the widening is exact, and a
bf16 ``tl.dot`` in a small kernel matches an fp32 matmul of the same bf16 values.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import BF16_DOT, INTERPRETED
from tests.interp_bf16 import widen

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def test_widen_is_exact_for_every_bf16_pattern():
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)  # every pattern
    values = bits.view(torch.bfloat16).float().numpy()
    got = widen(bits.numpy().view("uint16"))
    finite = ~torch.from_numpy(values).isnan().numpy()
    assert (got[finite] == values[finite]).all()
    assert torch.from_numpy(got[~finite]).isnan().all()  # NaN patterns stay NaN


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    acc = tl.full((M, N), 1.0, tl.float32)  # a non-zero accumulator must be added
    acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


@pytest.mark.skipif(not INTERPRETED, reason="the patch serves the interpreter only")
def test_bf16_dot_matches_fp32_matmul_of_the_same_values():
    assert BF16_DOT, "the interpreter's create_dot could not be patched"
    gen = torch.Generator().manual_seed(3)
    M, N, K = 16, 32, 64
    a = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(K, N, generator=gen).to(torch.bfloat16)
    c = torch.full((M, N), float("nan"))
    _dot_kernel[(1,)](a, b, c, M=M, N=N, K=K)
    want = a.float() @ b.float() + 1.0
    torch.testing.assert_close(c, want, rtol=1e-5, atol=1e-5)
