"""The one timing entry point: :func:`measure` (and :func:`measure_interleaved` for A/B).

Modes are options, not separate loops:

``cold`` (CUDA default)
    Before each sample a buffer of at least 2x the device's L2 is written and then read
    back, then the call is bracketed by CUDA events. The write evicts everything (the last
    call's dirty outputs are written back during the flush); the read that follows leaves
    the L2 full of clean lines, so the timed call pays no write-back of the flush's own
    dirty lines as it misses (up to one L2 of extra DRAM writes after a write-only flush).
    Between the flush and the start event a spin kernel runs for twice the call's host
    side (timed on warm calls: its launches and the Python between them), at least
    ~100 µs: the call is wholly enqueued before the events count, so they see its GPU
    time, the host's launch latency left out (the flush alone, tens of µs, can be shorter
    than a multi-launch call's Python). Eager launch cost is what ``hot`` and the layer's
    eager-vs-graph rows measure.
``hot``
    Back-to-back calls with no flush; each sample is a batch of calls between two events
    (or two host clock reads on CPU), sized so a sample lasts at least
    ``TimingOptions.min_sample_s`` (1 ms on CUDA, 20 µs on CPU): the per-call time is the
    batch time / batch size. On CUDA the start event fires as soon as it is enqueued, on
    an idle GPU, while the batch's first call is still being launched; a 1 ms sample keeps
    that one launch latency (5-20 µs) to a percent or two of it, and a steady stream of
    calls is what the mode means to time.
``graph`` (CUDA only)
    N calls are captured once into a CUDA graph and the graph is replayed; a sample is
    one replay / N: the launch-free time. The caller passes rotating input copies that
    together cover >= 4x L2 (see :func:`copies_for_cold_cache`) so the cache is cold here too.
    A short spin kernel (``torch.cuda._sleep``) runs before each start event, so the
    replay is already launched when the events start counting: one replay of 16 short
    kernels lasts tens of µs, and the graph launch's host latency would be a large part
    of it.

On CPU samples come from ``time.perf_counter_ns``; ``cold`` there writes and reads a
buffer of 2x the last-level cache before each sample.

The stopping rule is shared by every mode (:func:`stop_reason`): take at least
``min_samples`` samples and ``min_time_s`` of measured time, then stop as soon as the
relative noise of the median (half-width of its 95% CI / median) is at most
``max_noise``; stop anyway at ``budget_s`` of wall time or ``max_samples``. Which rule
ended the measurement is recorded, so a number that hit the budget says so. The noise is
never under half the timer's tick over the median (:mod:`microbench.stats`): a µs-scale
call whose samples fall on a few tick values has an order-statistic interval of width 0,
and must not stop on it; it runs to its budget unless half a tick is within ``max_noise``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Sequence

from microbench.samplers import _cpu_sampler, _cuda_sampler, _is_cuda, _Sampler, _same
from microbench.stats import MIN_SAMPLES, Summary, median_rel_noise, summarize

MODES = ("cold", "hot", "graph")

#: Why these defaults: 0.5% noise on the median separates a 2% effect with margin; a
#: 1 s budget per variant keeps a 48-point sweep with 3 variants under 3 minutes.
DEFAULT_MAX_NOISE = 0.005
DEFAULT_BUDGET_S = 1.0

#: A hot sample's least length. CPU: perf_counter_ns reads in tens of ns, so 20 µs samples
#: resolve well. CUDA: each sample carries one launch latency (see the module docstring).
CPU_MIN_SAMPLE_S = 20e-6
CUDA_MIN_SAMPLE_S = 1e-3

#: A hard floor under every stopping rule: fewer samples than this give no spread at all.
_MIN_SAMPLES_FLOOR = 3


@dataclass(frozen=True)
class TimingOptions:
    """How to time. ``mode=None`` picks ``cold`` on CUDA and ``hot`` on CPU."""

    mode: str | None = None
    min_samples: int = 10
    max_samples: int = 10_000
    min_time_s: float = 0.01
    budget_s: float = DEFAULT_BUDGET_S
    max_noise: float = DEFAULT_MAX_NOISE
    warmup_s: float = 0.02
    min_sample_s: float | None = None  # a hot sample's least length; None = 1 ms on CUDA, 20 µs on CPU
    graph_calls: int = 0  # calls captured per graph; 0 = at least 16; whole rotations of the copies (samplers.graph_calls)

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"timing mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.min_samples < 1 or self.max_samples < self.min_samples:
            raise ValueError("need 1 <= min_samples <= max_samples")
        if not (self.budget_s > 0 and self.max_noise > 0):  # NaN fails as well
            raise ValueError("budget_s and max_noise must be positive")

    def resolved_min_sample_s(self, device: str) -> float:
        if self.min_sample_s is not None:
            return self.min_sample_s
        return CUDA_MIN_SAMPLE_S if device.startswith("cuda") else CPU_MIN_SAMPLE_S

    def resolved_mode(self, device: str) -> str:
        mode = self.mode or ("cold" if device.startswith("cuda") else "hot")
        if mode == "graph" and not device.startswith("cuda"):
            raise ValueError("graph mode needs a CUDA device")
        return mode


@dataclass
class Measurement:
    """One variant's timing: raw per-call samples in seconds, their summary, and how."""

    mode: str
    timer: str  # "cuda-events" | "perf_counter_ns"
    device: str
    samples_s: list[float]
    summary: Summary
    stop_reason: str  # "noise" | "budget" | "max_samples"
    batch: int  # calls per sample (graph: calls per replay)
    copies: int  # input copies rotated through
    warmup_calls: int
    elapsed_s: float  # wall time of the sampling loop
    flush_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    # wall time before the first sample: warm-up calls, batch sizing, host-side timing,
    # graph capture (0 in result files written before it was recorded)
    warmup_s: float = 0.0
    # interleaved: the number of variants whose order rotated round by round (round i
    # starts with variant i mod rotation); 1: not interleaved, or a file from before rotation
    rotation: int = 1
    # the timer's documented step per call (its step per sample / batch): the tick where
    # the samples show none (microbench.stats.sample_tick; 0 in files from before it was kept)
    resolution_s: float = 0.0

    @property
    def median_s(self) -> float:
        return self.summary.median

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measurement":
        """Inverse of :meth:`to_dict`, from a record's ``timing`` too: the keys the runner adds
        there (``interleaved``, ``budget_s``) and any this version does not know are ignored."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["summary"] = Summary.from_dict(d["summary"])
        return cls(**kw)


def stop_reason(n: int, measured_s: float, elapsed_s: float, noise: float, opts: TimingOptions) -> str | None:
    """The stopping rule, shared by every mode. ``noise`` is the median's relative noise."""
    if n >= opts.max_samples:
        return "max_samples"
    if n >= _MIN_SAMPLES_FLOOR and elapsed_s >= opts.budget_s:
        return "budget"
    if n >= opts.min_samples and measured_s >= opts.min_time_s and noise <= opts.max_noise:
        return "noise"
    return None


def _noise_due(n: int) -> bool:
    # Checking the noise costs a sort; check every ~5% of the samples taken so far.
    return n < 20 or n % max(1, n // 20) == 0


def run_until_stable(
    take: Callable[[], float], opts: TimingOptions, clock: Callable[[], float] = time.perf_counter, batch: int = 1,
    resolution: float = 0.0,
) -> tuple[list[float], str, float]:
    """Take samples from ``take`` (seconds per call each, ``batch`` calls a sample) until
    the stopping rule says stop; the measured time it counts is the samples' whole length.
    ``resolution``: the timer's step per call, the tick while the samples show none.

    Returns (samples, stop reason, elapsed wall seconds). ``clock`` is injectable so the
    rule can be tested against synthetic timers.
    """
    samples: list[float] = []
    measured = 0.0
    noise = math.inf
    t0 = clock()
    while True:
        s = take()
        samples.append(s)
        measured += s * batch
        n = len(samples)
        if n >= opts.min_samples and _noise_due(n):
            noise = median_rel_noise(samples, resolution=resolution)
        reason = stop_reason(n, measured, clock() - t0, noise, opts)
        if reason:
            return samples, reason, clock() - t0


#: An interleaved measurement ends on its noise rule only after this many whole rotations
#: (each variant once in each place of a round): the paired verdict's least count of
#: rotation-balanced ratios (:data:`microbench.stats.MIN_SAMPLES`).
MIN_ROTATIONS = MIN_SAMPLES


def run_interleaved(
    takes: Sequence[Callable[[], float]], opts: TimingOptions, clock: Callable[[], float] = time.perf_counter,
    batches: Sequence[int] | None = None, resolutions: Sequence[float] | None = None,
) -> tuple[list[list[float]], str, float]:
    """Rounds of every variant, A B C, B C A, C A B, ... until every variant meets the
    rule (or the shared budget).

    The budget scales with the number of variants, so interleaving costs what sequential
    timing would. Sample i of every variant is taken in round i (the pairing the paired
    verdict relies on). Round i starts with variant i mod k: a call's place in its round
    changes its time (on a 2-core CPU the second of two identical calls ran 1.4% faster,
    19 times in 20), and over each whole rotation every variant holds every place once, so
    :func:`microbench.verdicts.paired_ratios` cancels it. The noise rule ends the loop
    only on a whole rotation, after at least :data:`MIN_ROTATIONS` of them; the budget
    ends it anywhere. ``batches`` gives each variant's calls per sample (default 1),
    ``resolutions`` its timer's step per call (as for :func:`run_until_stable`).
    """
    k = len(takes)
    batches = list(batches) if batches is not None else [1] * k
    resolutions = list(resolutions) if resolutions is not None else [0.0] * k
    shared = replace(opts, budget_s=opts.budget_s * k)  # max_samples stays per variant
    least = opts.min_samples if k == 1 else max(opts.min_samples, MIN_ROTATIONS * k)
    all_samples: list[list[float]] = [[] for _ in takes]
    measured = [0.0] * k
    noise = [math.inf] * k
    t0 = clock()
    n = 0
    while True:
        for j in range(k):
            i = (n + j) % k
            s = takes[i]()
            all_samples[i].append(s)
            measured[i] += s * batches[i]
        n += 1
        if n >= opts.min_samples and _noise_due(n):
            noise = [median_rel_noise(s, resolution=r) for s, r in zip(all_samples, resolutions)]
        elapsed = clock() - t0
        reasons = [stop_reason(n, measured[i], elapsed, noise[i], shared) for i in range(k)]
        if any(r in ("budget", "max_samples") for r in reasons):
            return all_samples, next(r for r in reasons if r in ("budget", "max_samples")), elapsed
        if all(r == "noise" for r in reasons) and n >= least and n % k == 0:
            return all_samples, "noise", elapsed


def _prepare(calls: Sequence[Callable[[], Any]], device: str, opts: TimingOptions, cache_bytes: int | None,
             lockstep: Any = None) -> _Sampler:
    if not calls:
        raise ValueError("measure() needs at least one callable")
    t0 = time.perf_counter()
    mode = opts.resolved_mode(device)
    agreed = (lambda x: lockstep.max(x)[0]) if lockstep is not None else _same
    if _is_cuda(device):
        meet = getattr(lockstep, "device_meet", None)
        s = _cuda_sampler(list(calls), device, mode, opts, cache_bytes, agreed, meet)
    else:
        s = _cpu_sampler(list(calls), mode, opts, cache_bytes, agreed)
    if lockstep is not None:
        s.take = lockstep.track(s.take)
    s.warmup_s = time.perf_counter() - t0
    return s


def _measurement(s: _Sampler, device: str, samples: list[float], reason: str, elapsed: float,
                 rotation: int = 1) -> Measurement:
    return Measurement(
        mode=s.mode, timer=s.timer, device=device, samples_s=samples,
        summary=summarize(samples, s.resolution_s), stop_reason=reason, batch=s.batch, copies=s.copies,
        warmup_calls=s.warmup_calls, elapsed_s=elapsed, flush_bytes=s.flush_bytes, notes=list(s.notes),
        warmup_s=s.warmup_s, rotation=rotation, resolution_s=s.resolution_s,
    )


def measure(
    calls: Sequence[Callable[[], Any]] | Callable[[], Any],
    *,
    device: str = "cpu",
    options: TimingOptions | None = None,
    cache_bytes: int | None = None,
    lockstep: Any = None,
) -> Measurement:
    """Time a zero-argument callable (or several bound to rotating input copies).

    ``device`` is ``"cpu"`` or ``"cuda[:N]"``; ``cache_bytes`` is the L2 (CUDA) or
    last-level cache (CPU) size used for flushing, ``None`` = unknown (a large fallback
    is flushed and a note recorded). ``lockstep`` (a :class:`microbench.distributed.Lockstep`,
    on every rank of a multi-rank case) makes the ranks sample together: the samples are
    the slowest rank's, and warm-up, batch size and the stopping decision are agreed.
    Exceptions from the callable propagate.
    """
    opts = options or TimingOptions()
    calls = [calls] if callable(calls) else list(calls)
    s = _prepare(calls, device, opts, cache_bytes, lockstep)
    if lockstep is not None:
        lockstep.begin()
    clock = lockstep.clock if lockstep is not None else time.perf_counter
    samples, reason, elapsed = run_until_stable(s.take, opts, clock, s.batch, s.resolution_s)
    return _measurement(s, device, samples, reason, elapsed)


def measure_interleaved(
    call_sets: Sequence[Sequence[Callable[[], Any]]],
    *,
    device: str = "cpu",
    options: TimingOptions | None = None,
    cache_bytes: int | None = None,
    lockstep: Any = None,
) -> list[Measurement]:
    """Time several variants alternately (A B, B A, ...: see :func:`run_interleaved`) so
    drift hits all of them alike (``lockstep`` as for :func:`measure`)."""
    opts = options or TimingOptions()
    if not call_sets or not all(call_sets):
        raise ValueError("measure_interleaved needs at least one variant, each with at least one call")
    samplers = [_prepare(list(c), device, opts, cache_bytes, lockstep) for c in call_sets]
    if lockstep is not None:
        lockstep.begin()
    clock = lockstep.clock if lockstep is not None else time.perf_counter
    all_samples, reason, elapsed = run_interleaved([s.take for s in samplers], opts, clock,
                                                   [s.batch for s in samplers], [s.resolution_s for s in samplers])
    return [_measurement(s, device, xs, reason, elapsed, rotation=len(samplers))
            for s, xs in zip(samplers, all_samples)]
