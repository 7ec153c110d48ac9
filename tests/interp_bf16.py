"""bf16 ``tl.dot`` in Triton's interpreter, made to compute what the GPU computes.

The interpreter keeps bfloat16 tensors as their raw 16-bit patterns (numpy has no bf16)
and its ``tl.dot`` multiplies those patterns as integers (Triton 3.6 to 3.9), so every
bf16 GEMM in a kernel returns garbage on CPU. A tensor core reads the two operands as
bf16 numbers and accumulates in fp32; :func:`install` replaces the interpreter's dot
with exactly that: each bf16 operand widened to fp32 (a bf16 value is the top half of
an fp32 one, so the widening is exact), the product accumulated in the accumulator's
dtype. Everything else the interpreter does is left alone: loads, stores and the
conversions to and from fp32 already handle bf16, and a kernel that did arithmetic on
bf16 values themselves would still get raw-pattern results, which fail any comparison
with a reference rather than pass one.

Installed by ``tests/conftest.py`` when the kernels are interpreted, so the CPU tests
check the kernels' bf16 paths (the model's dtype) as well as fp16 and fp32.
"""

from __future__ import annotations

import numpy as np

_MARK = "_microbench_bf16_dot"


def widen(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> the fp32 values they encode, exactly."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def install() -> bool:
    """Patch the interpreter's dot (once); False where this Triton has no interpreter
    builder to patch (nothing is changed then)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    def operand(h):
        return widen(h.data) if h.dtype.scalar == tl.bfloat16 else h.data.astype(np.float32)

    def create_dot(self, a, b, d, *rest):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return original(self, a, b, d, *rest)
        acc = np.matmul(operand(a), operand(b), dtype=d.data.dtype) + d.data
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    setattr(create_dot, _MARK, True)
    builder.create_dot = create_dot
    return True
