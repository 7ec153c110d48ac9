"""What one call costs the host, and how many GPU activities it launches (CUDA only).

Used once per variant, after its point is timed, for cases that ask
(``Case.profile_calls``): the host time is the wall time for the call to return without
waiting for the GPU (the enqueue cost), averaged over a few calls; the kernel count comes
from the torch profiler (every CUDA activity the call puts on the device: kernels,
memsets, copies).

A profiler session attaches CUPTI, which then intercepts every CUDA API call of the
process until it is finalised. Kineto finalises it after a session only when
TEARDOWN_CUPTI is 1 (newer Kineto builds make that the default from CUDA 12.6; older ones
leave CUPTI attached for good, which slows launch-bound code by up to 10-20% for the rest
of the process). So: the profile comes after the point's timing, never before it; the
teardown is asked for where the CUDA build is one Kineto tears down reliably (12.6 on),
unless the user set TEARDOWN_CUPTI; the teardown, which runs on Kineto's own thread at
the next CUDA call, is given time to finish before the next session or timing starts;
records timed while CUPTI may still be attached say so (``attached_note``); and a session
that waits seconds for a CUPTI that does not come back ends the profiling for the process
(``SLOW_EMPTY_SESSION_S``), so a broken profiler costs the launch column, not the run's time.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

#: Calls averaged for the host time: few enough that the launch queue never fills.
HOST_REPS = 5

#: Profiler sessions tried for the launch count: a CUDA-only trace now and then comes back
#: with no device events at all, whatever the call launched; a second session is cheap.
PROFILE_TRIES = 2

#: Seconds given to Kineto's CUPTI teardown after a session (it starts at the first CUDA
#: call after the session and runs on a thread of its own; a session started while it is
#: still running can record nothing, and a timing started then would time it).
SETTLE_S = 0.1

#: CUDA builds from which Kineto tears CUPTI down reliably (with CUDA graphs in the process
#: too): where newer Kineto turns teardown on by default.
TEARDOWN_FROM_CUDA = (12, 6)

#: A session that records nothing and takes longer than this is waiting on a CUPTI that
#: will not come back (Kineto waits up to 10 s for a teardown before it traces without the
#: GPU): no more sessions are tried in this process, so the run's time goes to timing.
SLOW_EMPTY_SESSION_S = 2.0

#: The number of profiler sessions this process has run.
_sessions = 0

#: Why this process tries no more sessions (a slow empty one), else None.
_given_up: str | None = None


def _cuda_build() -> tuple[int, ...] | None:
    import torch

    try:
        return tuple(int(x) for x in str(torch.version.cuda).split(".")[:2])
    except (TypeError, ValueError):
        return None


def ask_for_teardown() -> str:
    """Set TEARDOWN_CUPTI=1 unless the user set it or the CUDA build predates reliable
    teardown; returns the value in force ("" for unset)."""
    if "TEARDOWN_CUPTI" not in os.environ:
        cuda = _cuda_build()
        if cuda is not None and cuda >= TEARDOWN_FROM_CUDA:
            os.environ["TEARDOWN_CUPTI"] = "1"
    return os.environ.get("TEARDOWN_CUPTI", "")


def attached_note() -> str | None:
    """A note for a record timed now, when a profiler session ran earlier in this process
    and CUPTI was not asked to detach after it; None otherwise."""
    if not _sessions or os.environ.get("TEARDOWN_CUPTI") == "1":
        return None
    return (f"timed after {_sessions} profiler session(s) in this process with CUPTI left attached "
            f"(TEARDOWN_CUPTI={os.environ.get('TEARDOWN_CUPTI', 'unset')}): launch-bound times may read high")


def _settle(torch: Any) -> None:
    torch.cuda.synchronize()  # a CUDA call: Kineto's teardown, if pending, starts here
    time.sleep(SETTLE_S)


def profile_call(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"launches": int, "host_s": float}`` of ``fn`` (which launches GPU work) on the
    current CUDA device, ``profile_error`` in place of ``launches`` when the profiler is
    unavailable or records nothing (never raises). The host time is taken first, with no
    profiler session in between."""
    global _sessions, _given_up
    import torch

    out: dict[str, Any] = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(HOST_REPS):
        fn()
    out["host_s"] = (time.perf_counter() - t0) / HOST_REPS
    torch.cuda.synchronize()
    if _given_up:
        out["profile_error"] = _given_up
        return out
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        ask_for_teardown()
        launches = 0
        for _ in range(PROFILE_TRIES):
            _settle(torch)
            _sessions += 1
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            launches = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
            took = time.perf_counter() - t0
            if launches:
                break
            if took > SLOW_EMPTY_SESSION_S:
                _given_up = (f"no profiler sessions after one took {took:.1f} s and recorded no GPU activity "
                             "(CUPTI not coming back): launches unknown")
                break
        if launches:
            out["launches"] = launches
        else:  # the profiled calls all launch kernels: an empty trace is CUPTI's failure
            out["profile_error"] = _given_up or (f"the profiler recorded no GPU activity in {PROFILE_TRIES} "
                                                 "sessions (CUPTI did not attach): launches unknown")
    except Exception as e:  # noqa: BLE001 - a missing profiler costs the column, not the run
        out["profile_error"] = f"{type(e).__name__}: {e}"
    _settle(torch)
    return out
