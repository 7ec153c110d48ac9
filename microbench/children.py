"""Processes a command starts end with it: a compile worker, the torchrun that runs a
run's ranks. Without this, a parent killed outright (SIGKILL, an OOM kill) leaves them
running on, holding cores or GPUs, their results never collected."""

from __future__ import annotations

import os


def end_with_parent(parent: int) -> None:
    """Linux: this process gets SIGTERM when ``parent``, which started it, ends, however it
    ends (a SIGKILL included). Called in the child: a pool's initializer, or a
    ``subprocess.Popen`` ``preexec_fn`` (the request survives the exec)."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: Ctrl-C reaches the whole process group anyway
        return
    if os.getppid() != parent:  # it ended before the request was made
        os._exit(1)
