"""Argument checks shared by every launcher: one clear ValueError naming the argument.

A launcher checks before it launches, so a wrong shape, dtype, device or layout is
reported as the caller's mistake, not as a Triton error or a silent wrong answer.
"""

from __future__ import annotations

from torch import Tensor


def check_tensor(name: str, t: object, *, shape: tuple[int, ...] | None = None, like: Tensor | None = None,
                 like_name: str = "x") -> Tensor:
    """``t`` must be a contiguous tensor; with ``like``, of its dtype and device (and its
    shape unless ``shape`` is given)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    want = shape if shape is not None else (tuple(like.shape) if like is not None else None)
    if want is not None and tuple(t.shape) != tuple(want):
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not match {like_name} (expected {tuple(want)})")
    if like is not None and t.dtype != like.dtype:
        raise ValueError(f"{name}: dtype {t.dtype} does not match {like_name} ({like.dtype})")
    if like is not None and t.device != like.device:
        raise ValueError(f"{name}: on {t.device}, but {like_name} is on {like.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (strides {t.stride()})")
    return t


def require_runnable(kernel: object, t: Tensor, name: str = "x") -> None:
    """Raise unless ``kernel`` can take ``t``: a CUDA tensor, or any tensor when the kernel
    was built by Triton's interpreter (TRITON_INTERPRET=1 set before its module was imported)."""
    if t.is_cuda:
        return
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without an interpreter cannot run on CPU tensors
        interpreted = False
    else:
        interpreted = isinstance(kernel, InterpretedFunction)
    if not interpreted:
        raise ValueError(f"{name}: on {t.device}; the kernel needs a CUDA tensor, or TRITON_INTERPRET=1 set "
                         "before triton and this module are imported")
