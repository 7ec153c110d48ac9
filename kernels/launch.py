"""The launch floor: an empty Triton kernel on a one-program grid.

Timing :func:`empty_launch` eagerly measures what every Triton launch pays before any
work starts: Triton's Python launcher (argument binding, specialisation-key lookup in
the kernel cache, building the launch parameters) plus the driver's kernel launch and
the GPU's cost of scheduling one empty block.  It is the per-launch term of the launch
path component: an extend forward outside a CUDA graph pays it ~25 times per layer,
61 layers per step.  Captured in a CUDA graph and replayed, only the GPU-side part
remains, so eager minus graph time of this kernel is the pure host launch overhead.

It deliberately does not measure a torch op's dispatch (ATen dispatcher, caching
allocator); that is a different floor, for a torch-side case to time.

Layout of this module: ``@triton.jit`` kernel → the public launcher.  There are no
constants: the kernel has no block size, and one warp is the smallest launch.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from microbench.kernels.checks import require_runnable

__all__ = ["cupy_empty_launch", "cupy_unavailable", "empty_launch"]


# --------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------


@triton.jit
def _empty_kernel(x_ptr):
    """Do nothing observable.

    The pointer argument is there so the launch binds one tensor argument, as real
    kernels do (a zero-argument launch would understate the launcher's per-argument
    work); reading the program id keeps the body non-empty for every Triton version
    without touching memory.
    """
    pid = tl.program_id(0)  # noqa: F841 - computed and discarded on purpose


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


def empty_launch(x: Tensor) -> None:
    """Launch the empty kernel once, on a grid of one program with one warp.

    Args:
        x: any tensor (its contents are never read or written); it must be on a CUDA
            device, or on the CPU when Triton's interpreter is on.

    The call is asynchronous on CUDA like any launch: time it with CUDA events or a
    synchronise, and call it once before timing so the one-off compilation is excluded.

    Raises:
        TypeError: ``x`` is not a tensor.
        ValueError: ``x`` is on a device the kernel cannot run on.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    require_runnable(_empty_kernel, x)
    _empty_kernel[(1,)](x, num_warps=1)


# --------------------------------------------------------------------------------------
# The same empty launch through CuPy: the driver path without Triton's launcher
# --------------------------------------------------------------------------------------

_CUPY_EMPTY_SOURCE = r'extern "C" __global__ void microbench_empty(const float* x) {}'
_cupy_state: dict = {}


def cupy_unavailable() -> str | None:
    """Why the CuPy RawKernel launch cannot run here, or None."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is a reason
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    return None


def cupy_empty_launch(x: Tensor) -> None:
    """An empty ``cupy.RawKernel`` (one block of one thread, one pointer argument) on
    torch's current stream — inside a CUDA graph capture, the capture stream, so the
    graph records it. Compiled once (NVRTC), on the first call.

    The stream goes to the launch as an argument: entering CuPy's ``Device`` and stream
    contexts on every call would add their Python cost to what this row reports as the
    driver's launch path. The kernel is CuPy's build for the current device, as a Triton
    launch takes the current device's; only when that is not ``x``'s device (a check
    before the first timing sets it) is ``x``'s device entered for the call.
    """
    import cupy
    import torch

    kernel = _cupy_state.get("kernel")
    if kernel is None:
        kernel = _cupy_state["kernel"] = cupy.RawKernel(_CUPY_EMPTY_SOURCE, "microbench_empty")
    ptr = torch.cuda.current_stream(x.device).cuda_stream
    streams = _cupy_state.setdefault("streams", {})
    stream = streams.get(ptr)
    if stream is None:
        stream = streams[ptr] = cupy.cuda.ExternalStream(ptr)
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if cupy.cuda.runtime.getDevice() == index:
        kernel((1,), (1,), (x.data_ptr(),), stream=stream)
        return
    with cupy.cuda.Device(index):
        kernel((1,), (1,), (x.data_ptr(),), stream=stream)
