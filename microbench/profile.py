"""What one call costs the host, and how many GPU activities it launches (CUDA only).

Used once per variant after its gate passes, for cases that ask (``Case.profile_calls``):
the kernel count comes from the torch profiler (every CUDA activity the call puts on the
device: kernels, memsets, copies), the host time is the wall time for the call to return
without waiting for the GPU (the enqueue cost), averaged over a few calls.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

# Kineto tears CUPTI down after each profiler session when TEARDOWN_CUPTI is 1, and the
# teardown runs asynchronously: a session started right after the last one can record no
# GPU activity at all (a launch count of 0). One session per variant, back to back, is
# exactly that pattern, so CUPTI stays up for the process unless the user says otherwise.
os.environ.setdefault("TEARDOWN_CUPTI", "0")

#: Calls averaged for the host time: few enough that the launch queue never fills.
HOST_REPS = 5

#: Profiler sessions tried for the launch count: a CUDA-only trace now and then comes back
#: with no device events at all, whatever the call launched; a second session is cheap.
PROFILE_TRIES = 2


def profile_call(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"launches": int, "host_s": float}`` of ``fn`` (which launches GPU work) on the
    current CUDA device, ``profile_error`` in place of ``launches`` when the profiler is
    unavailable or records nothing (never raises)."""
    import torch

    out: dict[str, Any] = {}
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        launches = 0
        for _ in range(PROFILE_TRIES):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            launches = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
            if launches:
                break
        if launches:
            out["launches"] = launches
        else:  # the profiled calls all launch kernels: an empty trace is CUPTI's failure
            out["profile_error"] = (f"the profiler recorded no GPU activity in {PROFILE_TRIES} sessions "
                                    "(CUPTI did not attach): launches unknown")
    except Exception as e:  # noqa: BLE001 - a missing profiler costs the column, not the run
        out["profile_error"] = f"{type(e).__name__}: {e}"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(HOST_REPS):
        fn()
    out["host_s"] = (time.perf_counter() - t0) / HOST_REPS
    torch.cuda.synchronize()
    return out
