"""The interpreter's debug checks (tests/interp_checks.py): off, an int32 overflow wraps
as in a compiled kernel; on, it raises, as a failed device assert does; and Triton's own
default computes the overflow check only to drop it, which is why the tests turn it off."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests.conftest import INTERPRETED
from tests.interp_checks import checks, interpreter_builder, set_checks

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the interpreter's options (kernels are compiled here)")


@triton.jit
def _scale_kernel(x_ptr, out_ptr, k, LIMIT: tl.constexpr):
    x = tl.load(x_ptr)
    tl.device_assert(x < LIMIT, "x under the limit")
    tl.store(out_ptr, x * k)


def _scale(x: int, k: int, limit: int = 1 << 30) -> int:
    src, out = torch.tensor([x], dtype=torch.int32), torch.full((1,), -1, dtype=torch.int32)
    _scale_kernel[(1,)](src, out, k, LIMIT=limit)
    return int(out.item())


@pytest.fixture
def builder():
    b = interpreter_builder()
    assert b is not None, "this Triton's interpreter has no sanitize_overflow / debug options"
    was = b.options
    yield b
    b.options = was


def test_off_an_overflow_wraps_and_asserts_are_skipped(builder):
    assert set_checks(False) and checks() is False
    assert _scale(3, 5) == 15
    assert _scale(1 << 20, 1 << 12) == 0  # 2**32 wraps to 0 in int32
    assert _scale(7, 2, limit=5) == 14


def test_on_an_overflow_and_a_failed_assert_raise(builder):
    assert set_checks(True) and checks() is True
    assert _scale(3, 5) == 15
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _scale(1 << 20, 1 << 12)
    with pytest.raises(Exception, match="x under the limit"):
        _scale(7, 2, limit=5)


def test_tritons_default_computes_the_overflow_check_and_drops_it(builder):
    """The reason the tests turn the overflow check off: left as the interpreter starts
    (sanitize_overflow on, debug off) it is made and never asserted. Should a Triton
    assert it, this fails, and turning it off would then drop a real check."""
    fresh = type(builder.options)()
    assert fresh.sanitize_overflow is True and fresh.debug is False
    builder.options = fresh
    assert _scale(1 << 20, 1 << 12) == 0


def test_the_session_runs_what_its_option_asked(request):
    assert checks() is bool(request.config.getoption("--triton-checks"))
