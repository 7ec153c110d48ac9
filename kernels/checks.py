"""Argument checks shared by every launcher: one clear ValueError naming the argument.

A launcher checks before it launches, so a wrong shape, dtype, device or layout is
reported as the caller's mistake, not as a Triton error or a silent wrong answer.
"""

from __future__ import annotations

import functools

import torch
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


#: True while launches only compile for a target GPU and run nothing (``microbench
#: compile``): any tensor may then stand in for a CUDA one, since no kernel reads it.
COMPILE_ONLY = False
#: While :data:`COMPILE_ONLY`: the target GPU's shared memory per block (bytes, the opt-in
#: maximum), which launchers that size tiles by it read through :func:`shared_memory_per_block`.
COMPILE_SHARED_PER_BLOCK: int | None = None
#: While :data:`COMPILE_ONLY`: the target GPU's SM count, which split rules read through
#: ``mla_common.sm_count`` (a split count sets constexprs and argument specialisations).
COMPILE_SM_COUNT: int | None = None

#: Below this much shared memory per block (sm_86, sm_89, sm_120: 99 KiB), launchers pick
#: their smaller-tile configurations; Hopper and datacenter Blackwell (227 KiB) and sm_80
#: (163 KiB) take the full ones.
SMALL_SHARED_PER_BLOCK = 128 * 1024


@functools.lru_cache(maxsize=None)
def _cuda_shared_per_block(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block", None)


def shared_memory_per_block(device: torch.device | str) -> int | None:
    """Bytes of shared memory one block may take on ``device``'s GPU; the compile target's
    while launches only compile; None on the CPU (the interpreter has no such limit, and
    kernels take the tiles they use on Hopper)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_shared_per_block(device.index if device.index is not None else torch.cuda.current_device())
    return COMPILE_SHARED_PER_BLOCK if COMPILE_ONLY else None


def small_shared(device: torch.device | str) -> bool:
    """Whether ``device``'s blocks get less than :data:`SMALL_SHARED_PER_BLOCK`."""
    limit = shared_memory_per_block(device)
    return limit is not None and limit < SMALL_SHARED_PER_BLOCK


def require_runnable(kernel: object, t: Tensor, name: str = "x") -> None:
    """Raise unless ``kernel`` can take ``t``: a CUDA tensor, or any tensor when the kernel
    was built by Triton's interpreter (TRITON_INTERPRET=1 set before its module was imported)
    or when launches only compile (:data:`COMPILE_ONLY`)."""
    if t.is_cuda or COMPILE_ONLY:
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
