"""Several ranks, one measurement: the process group, lock-step sampling, agreement, failure.

Multi-rank cases (``Case.distributed``) run on torch.distributed, one process per rank,
started by torchrun — by ``microbench run --nproc N`` itself, or by the user's own
``torchrun`` / multi-node launch running ``python -m microbench run``. A world of one rank
needs no launcher: it is set up in process (a file store, no port).

Three things make the ranks measure one thing together:

* **Lock-step samples** (:class:`Lockstep`): before every sample the ranks meet (an
  all-reduce on a CPU gloo group, which is a barrier; on NCCL the GPUs meet too, in a
  one-element all-reduce just before each start event), each rank times its own call, and
  the ranks exchange ``[sample, elapsed]`` in one more all-reduce(MAX). The sample kept is
  the slowest rank's, so every rank holds the same series and reaches the same stopping
  decision at the same sample; warm-up length and batch size are agreed the same way.
  Each rank's own samples are kept beside, for the per-rank spread.
* **Agreement** (:meth:`World.agree`): outside the timed loop (skip reasons, gate results,
  errors, fingerprints) ranks post JSON to the torch.distributed store and read everyone's.
  The store is not a collective, so a rank that raised cannot leave the others matched
  against the wrong collective; a rank that never posts is detected by a timeout.
* **Failure** (:meth:`World.fatal`): a rank that is lost, or an error that leaves the ranks
  out of step, ends every rank: a clear line on stderr, the result file closed as
  incomplete, exit :data:`EXIT_RANK_FAILED`. torchrun then stops the remaining workers;
  without it the process-group timeout bounds every wait.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NoReturn, Sequence

#: Exit status of a rank that stops because another rank failed or was lost.
EXIT_RANK_FAILED = 3
BACKENDS = ("gloo", "nccl")
#: Why 120 s: long enough for the slowest first call of a case (a Triton compile, an NCCL
#: communicator's setup across 8 GPUs), short enough that a lost rank is noticed quickly.
DEFAULT_TIMEOUT_S = 120.0


class WorldError(Exception):
    """The ranks cannot be set up as asked (bad backend, too few devices): the user's input."""


#: Callbacks that drop what is kept per process group (a communicator, symmetric buffers, a
#: set-up probe's answer), called by :meth:`World.close` just before it destroys the group:
#: that state is keyed by ``id(group)``, which outlives the group and may become a later one's.
_on_destroy: list[Callable[[], None]] = []


def on_destroy(fn: Callable[[], None]) -> None:
    """Have ``fn()`` drop this process's per-group state before a World destroys its groups."""
    if fn not in _on_destroy:
        _on_destroy.append(fn)


#: The size of the world a run will start only later (:func:`expecting`), else None.
_expected: int | None = None


@contextlib.contextmanager
def expecting(size: int | None) -> Iterator[None]:
    """While a run plans and paces multi-rank cases on a world it starts only later (``run
    --nproc 1``: after the single-rank cases), :func:`world_size` reads ``size``, so their
    skips that hang on it (an NCCL graph that is empty at one rank, a kernel built for 2, 4
    or 8 ranks) count in the plan and its pacing before the world exists."""
    global _expected
    before, _expected = _expected, size
    try:
        yield
    finally:
        _expected = before


def world_size() -> int | None:
    """The multi-rank cases' world size: the process group's, else that of the world a run
    is :func:`expecting`, else None (not known: a plan with no world)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _expected


def launched() -> bool:
    """True in a process started by torchrun (or any launcher that sets its variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_backend(backend: str | None, device_kind: str) -> str:
    """The backend for ``device_kind`` ("cuda" | "cpu"): NCCL on GPUs, gloo on CPU by default."""
    if backend is None:
        return "nccl" if device_kind == "cuda" else "gloo"
    if backend not in BACKENDS:
        raise WorldError(f"unknown backend {backend!r} (backends: {', '.join(BACKENDS)})")
    if backend == "nccl" and device_kind != "cuda":
        raise WorldError("backend nccl needs CUDA devices; use gloo on CPU")
    return backend


def check_nproc(nproc: int, device_kind: str) -> None:
    """Raise WorldError when ``nproc`` ranks cannot be placed on this host's devices."""
    if nproc < 1:
        raise WorldError(f"--nproc {nproc}: need at least one rank")
    if device_kind == "cuda":
        import torch

        have = torch.cuda.device_count()
        if nproc > have:
            raise WorldError(f"--nproc {nproc}: more ranks than CUDA devices ({have} on this host); "
                             f"one rank per GPU")


@dataclass
class World:
    """This process's place among the ranks, and the groups it talks on."""

    rank: int
    size: int
    local_rank: int
    backend: str
    device: str
    group: Any  # the data group (the backend asked for)
    control: Any  # a CPU gloo group for lock-step traffic
    store: Any
    launcher: str  # "torchrun" | "in-process"
    timeout_s: float
    _seq: int = 0
    _on_fatal: list[Callable[[str], None]] = field(default_factory=list)
    _tmp: Any = None
    _owns: bool = True  # this World made the process group (and so destroys it)

    # ------------------------------------------------------------------ agreement

    def agree(self, tag: str, payload: Any, timeout_s: float | None = None) -> list[Any]:
        """Every rank's ``payload`` (JSON-able), in rank order. Every rank must call this the
        same number of times in the same order; a rank that does not post within the
        timeout makes this rank stop (:meth:`fatal`), naming the missing ranks.

        The default wait outlasts the process group's own timeout (x 1.5, + 10 s): a peer
        stuck in a collective this rank never entered times out there first and brings its
        error here, beside this rank's, instead of both giving up at once."""
        self._seq += 1
        if self.size == 1:
            return [json.loads(json.dumps(payload))]
        prefix = f"microbench/{self._seq}/"
        self.store.set(prefix + str(self.rank), json.dumps(payload))
        keys = [prefix + str(r) for r in range(self.size)]
        wait = _dt.timedelta(seconds=timeout_s or 1.5 * self.timeout_s + 10.0)
        try:
            self.store.wait(keys, wait)
        except Exception:  # noqa: BLE001 - a timeout or a store that went away with its host
            try:
                missing = [str(r) for r in range(self.size) if not self.store.check([keys[r]])]
            except Exception:  # noqa: BLE001
                missing = ["?"]
            own = payload.get("error") if isinstance(payload, dict) else None
            self.fatal(f"rank(s) {', '.join(missing)} did not reach '{tag}' within {wait.total_seconds():.0f} s "
                       f"(lost or stuck)" + (f"; this rank's own error: {own}" if own else ""))
        return [json.loads(self.store.get(k)) for k in keys]

    def lockstep(self) -> "Lockstep":
        meet = None
        if self.size > 1 and self.backend == "nccl":
            import torch
            import torch.distributed as dist

            token = torch.zeros(1, dtype=torch.float32, device=self.device)
            group = self.group

            def meet() -> None:  # on the current stream, as the samples' events are
                dist.all_reduce(token, group=group)
        return Lockstep(self.control, self.size, meet)

    # ------------------------------------------------------------------ failure

    def on_fatal(self, fn: Callable[[str], None]) -> None:
        """Run ``fn(message)`` before this rank stops on a fatal error (rank 0 closes its file)."""
        self._on_fatal.append(fn)

    def fatal(self, message: str) -> NoReturn:
        line = f"microbench: rank {self.rank} of {self.size}: {message}; stopping every rank"
        print(line, file=sys.stderr, flush=True)
        for fn in self._on_fatal:
            try:
                fn(line)
            except Exception:  # noqa: BLE001 - stopping must not be stopped
                pass
        sys.stdout.flush()
        # os._exit, not sys.exit: a clean shutdown would wait on collectives that never end.
        os._exit(EXIT_RANK_FAILED)

    def close(self) -> None:
        """Leave the process group (after a final agreement, so no rank leaves early); what
        was kept per group (:func:`on_destroy`) is dropped first, while the group still exists."""
        import torch.distributed as dist

        self.agree("close", None)
        if self._owns and dist.is_initialized():
            for fn in _on_destroy:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - a communicator that fails to go must not keep the group
                    print(f"microbench: rank {self.rank}: releasing per-group state failed "
                          f"({type(e).__name__}: {e})", file=sys.stderr)
            dist.destroy_process_group()
        if self._tmp is not None:
            self._tmp.cleanup()

    def describe(self) -> dict[str, Any]:
        return {"world_size": self.size, "backend": self.backend, "launcher": self.launcher}


def init_world(device: str, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join the ranks torchrun started (``device`` "cuda": local rank i on cuda:i; "cpu"),
    or, outside a launcher, make a world of one rank on ``device`` ("cpu", "cuda[:N]").

    Raises WorldError for a backend the device cannot use or a local rank without a GPU."""
    import torch
    import torch.distributed as dist

    device_kind = "cuda" if device.startswith("cuda") else "cpu"
    backend = check_backend(backend, device_kind)
    timeout = _dt.timedelta(seconds=timeout_s)
    tmp = None
    if launched():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
        launcher = "torchrun"
    else:
        rank, size, local, launcher = 0, 1, 0, "in-process"
    if device_kind == "cuda":
        have = torch.cuda.device_count()
        if launcher == "torchrun":
            if local >= have:
                raise WorldError(f"local rank {local} has no GPU ({have} CUDA device(s) on this host): "
                                 f"more ranks than devices")
            index = local
        else:
            index = torch.device(device).index
            index = torch.cuda.current_device() if index is None else index
        device = f"cuda:{index}"
        torch.cuda.set_device(index)
    else:
        device = "cpu"
    owns = not dist.is_initialized()
    # NCCL: bound to this rank's GPU at init (its communicator made there and then, on the
    # right device), not guessed from the current device at the first collective
    bind = {"device_id": torch.device(device)} if backend == "nccl" else {}
    if owns:
        if launcher == "torchrun":
            dist.init_process_group(backend, timeout=timeout, **bind)
        else:
            tmp = tempfile.TemporaryDirectory(prefix="microbench-world-")
            store = dist.FileStore(os.path.join(tmp.name, "store"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, **bind)
    else:  # joined a group someone made in this process (a test, a notebook)
        rank, size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    group = dist.group.WORLD
    control = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()  # the group's own store: every launcher provides one
    return World(rank, size, local, backend, device, group, control, store, launcher, timeout_s, _tmp=tmp, _owns=owns)


_solo: dict[str, World] = {}


def solo_world(device: str, backend: str | None = None) -> World:
    """A world of one rank on ``device`` for this process, made once (benches, tests):
    multi-rank cases at world size 1 measure each path's fixed cost per call."""
    import torch.distributed as dist

    if dist.is_initialized() and device in _solo:
        return _solo[device]
    if dist.is_initialized():
        raise WorldError("a process group already exists in this process; a world of one cannot be added")
    _solo[device] = init_world(device, backend)
    return _solo[device]


class Lockstep:
    """Lock-step sampling over a CPU group: the ranks meet before each sample and keep the
    slowest rank's time (see the module docstring). One object per measurement.

    ``device_meet`` (NCCL worlds of several ranks) is a collective on the GPUs that the CUDA
    sampler enqueues just before each start event: the ranks leave the host-side meeting
    tens of µs apart, and without it the first rank's sample would hold its wait, inside
    the timed collective, for the last."""

    def __init__(self, control: Any, size: int, device_meet: Callable[[], None] | None = None):
        self.control = control
        self.size = size
        self.device_meet = device_meet
        self.local: list[list[float]] = []  # each tracked sampler's own (this rank's) samples
        self._t0 = time.perf_counter()
        self._elapsed = 0.0

    def max(self, *values: float) -> list[float]:
        """Element-wise maximum over ranks (every rank must call with as many values)."""
        if self.size == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return t.tolist()

    def begin(self) -> None:
        """Meet, then start the shared clock (just before the first sample)."""
        self.max(0.0)
        self._t0 = time.perf_counter()
        self._elapsed = 0.0

    def track(self, take: Callable[[], float]) -> Callable[[], float]:
        """``take`` in lock step: returns the slowest rank's sample; keeps this rank's."""
        mine: list[float] = []
        self.local.append(mine)

        def lock_take() -> float:
            s = take()
            mine.append(s)
            slowest, self._elapsed = self.max(s, time.perf_counter() - self._t0)
            return slowest

        return lock_take

    def clock(self) -> float:
        """The agreed elapsed time (the slowest rank's) as of the last sample."""
        return self._elapsed


def torchrun_command(nproc: int, argv: Sequence[str]) -> list[str]:
    """``python -m torch.distributed.run`` (torchrun, from this interpreter) running
    ``python -m microbench <argv>`` on ``nproc`` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=0", "--monitor-interval=0.5", "-m", "microbench", *argv]
