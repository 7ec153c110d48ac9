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


#: Run as ``python -c _EXEC PARENT CMD...``: end with PARENT, then become CMD (the request
#: survives the exec). A fresh interpreter does it, not a ``preexec_fn``: Python code run in
#: a child forked from a process with threads (CUDA's, NVML's, OpenMP's) can deadlock.
_EXEC = (
    "import os, sys\n"
    "from microbench.children import end_with_parent\n"
    "end_with_parent(int(sys.argv[1]))\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def ending_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` started so that it ends with this process, however this one ends."""
    import sys

    return [sys.executable, "-c", _EXEC, str(os.getpid()), *cmd]
