"""Statistics of one set of timing samples (numpy only).

:func:`summarize` / :func:`median_rel_noise` describe one set of timing samples
(seconds). The timer's stopping rule calls :func:`median_rel_noise` repeatedly, so it
sorts once and does no resampling: the distribution-free confidence interval of the
median comes from binomial order statistics (ranks ``n/2 ± z·sqrt(n)/2``), valid for any
continuous distribution, skewed timing tails included. The A/B verdicts built on these
samples are in :mod:`microbench.verdicts`.

Timers count in ticks (CUDA events: "around 0.5 µs" documented, multiples of ~1.024 µs
seen on recent GPUs), and a µs-scale call's samples then fall on two or three values. The
median of such samples is itself a whole number of ticks, up to half a tick from the time
it stands for however many samples agree on it, while the order-statistic interval can
land all its ranks on one value and claim a width of 0. So the tick is read from the
samples (:func:`sample_tick`) and an interval narrower than one tick is widened to hold
``median ± tick/2`` (:func:`median_ci`, :func:`median_rel_noise`). Of samples that show
their tick, an interval spanning two distinct values is at least one tick wide, so the
rule changes only an interval that collapsed onto one value: dithered samples, and CPU
timings at ns resolution, keep theirs unchanged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from typing import Any, Literal, Mapping, Sequence

import numpy as np

Label = Literal["FASTER", "SLOWER", "SAME", "UNSURE"]
LABELS: tuple[str, ...] = ("FASTER", "SLOWER", "SAME", "UNSURE")

#: Below this many samples the order-statistic interval of the median at 95% spans the
#: whole sample (n = 6 gives ranks 1 and 6), and a bootstrap of the median has almost no
#: distinct values: no interval is reported (noise = inf, verdict interval = [0, inf]).
MIN_SAMPLES = 6

#: Gaps between sample values below this fraction of the largest value are float rounding,
#: not a timer's tick.
_TICK_RTOL = 1e-9

#: Resampled elements per bootstrap chunk: 2M int64 indices + their gathered float64
#: values is ~32 MB, whatever the sample count (up to ~10,000) and n_boot.
_MAX_DRAWS_PER_CHUNK = 2_000_000


# --------------------------------------------------------------------------- validation


def _as_samples(samples: Sequence[float], name: str, positive: bool = False) -> np.ndarray:
    """1-D float64 copy of ``samples``; ValueError on empty, non-finite or (if asked) <= 0."""
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of samples, got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{name}: empty sample set")
    bad = ~np.isfinite(x)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}: {int(bad.sum())} non-finite value(s) of {x.size}, first at index {i} ({x[i]})")
    if positive and (x <= 0).any():
        i = int(np.flatnonzero(x <= 0)[0])
        raise ValueError(f"{name}: times must be positive for a ratio, got {x[i]} at index {i}")
    return x


def _check_confidence(confidence: float) -> None:
    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")


@lru_cache(maxsize=32)
def _z(confidence: float) -> float:
    """Two-sided standard-normal quantile: P(|Z| <= z) = confidence (1.95996 at 0.95)."""
    _check_confidence(confidence)
    target = 1.0 - (1.0 - confidence) / 2.0
    lo, hi = 0.0, 40.0
    for _ in range(100):  # bisection on the CDF; erf is exact enough and this is cached
        mid = 0.5 * (lo + hi)
        if 0.5 * (1.0 + math.erf(mid / math.sqrt(2.0))) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# --------------------------------------------------------------------------- one sample set


@dataclass(frozen=True)
class Summary:
    """Summary of one sample set, in the samples' unit (seconds for timings).

    ``iqr`` is p75 - p25; ``stddev`` is the sample standard deviation (ddof = 1, 0 for one
    sample); ``rel_noise`` is the half-width of the distribution-free 95% interval of the
    median divided by the median (inf below :data:`MIN_SAMPLES` samples), never under half
    a ``tick`` (:func:`median_ci`); ``tick`` is the timer's step per call as the samples
    show it (:func:`sample_tick`; 0: unknown, as in result files from before it was kept).
    """

    count: int
    median: float
    mean: float
    min: float
    max: float
    p20: float
    p80: float
    iqr: float
    stddev: float
    rel_noise: float
    tick: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (``rel_noise`` may be ``inf``: results are written with allow_nan)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Summary":
        """Inverse of :meth:`to_dict`; keys this version does not know are ignored, and one
        it added since (``tick``) takes its default where an older file lacks it."""
        kw: dict[str, Any] = {f.name: float(d[f.name]) for f in fields(cls) if f.name != "count" and f.name in d}
        return cls(count=int(d["count"]), **kw)


def _median_ranks(n: int, confidence: float) -> tuple[int, int]:
    """0-based ranks (lo, hi) of the order-statistic interval of the median of n samples.

    Normal approximation of the Binomial(n, 1/2) count below the median (Conover): 1-based
    ranks floor(n/2 - z·sqrt(n)/2) and ceil(1 + n/2 + z·sqrt(n)/2), clamped to [1, n];
    n = 100 at 95% gives the textbook ranks 40 and 61.
    """
    half = _z(confidence) * math.sqrt(n) / 2.0
    lo = max(1, math.floor(n / 2.0 - half))
    hi = min(n, math.ceil(1.0 + n / 2.0 + half))
    return lo - 1, hi - 1


def sample_tick(samples: Sequence[float], resolution: float = 0.0) -> float:
    """The timer's step per call as ``samples`` show it: the smallest positive gap between
    two of their distinct values; ``resolution`` (the timer's documented step per call)
    where they show none, all being equal; 0 where neither is known.

    Per-call samples of a batch (hot mode, a graph replay) are its time / calls, so their
    step is the timer's / calls, and this finds it. Samples pooled from batches of
    different sizes can show a smaller gap than either step: the tick is then understated,
    and intervals are widened less, never more, than they should be.
    """
    return _tick(np.sort(_as_samples(samples, "samples")), resolution)


def _tick(x: np.ndarray, resolution: float) -> float:
    """:func:`sample_tick` of sorted samples."""
    gaps = np.diff(x)
    gaps = gaps[gaps > _TICK_RTOL * max(abs(x[0]), abs(x[-1]))]
    return float(gaps.min()) if gaps.size else float(resolution)


def half_tick(samples: Sequence[float], tick: float, quantile: float = 0.5) -> float:
    """Half a ``tick`` over the samples' ``quantile`` (the median by default): how far,
    relative, that statistic of tick-counted samples may lie from the time it stands for,
    however many samples agree on it. inf where the quantile is not positive."""
    q = float(np.quantile(_as_samples(samples, "samples"), quantile))
    return 0.5 * tick / q if q > 0 else math.inf


def timing_half_tick(timing: Mapping[str, Any], quantile: float = 0.5) -> float:
    """A record's half-tick over its ``quantile`` of time, relative: its tick is what its
    samples show, else the timer's resolution it recorded (``resolution_s``; absent from
    files from before it was kept, whose all-equal samples then have none)."""
    x = timing["samples_s"]
    return half_tick(x, sample_tick(x, float(timing.get("resolution_s") or 0.0)), quantile)


def _median(x: np.ndarray) -> float:
    n = x.size
    return float(0.5 * (x[(n - 1) // 2] + x[n // 2]))


def _ci(x: np.ndarray, confidence: float, tick: float) -> tuple[float, float]:
    """The median's interval from sorted samples: the order statistics of
    :func:`_median_ranks`, held to ``median ± tick/2`` where they lie less than a tick
    apart (the module docstring says why)."""
    lo_i, hi_i = _median_ranks(x.size, confidence)
    lo, hi = float(x[lo_i]), float(x[hi_i])
    if hi - lo < tick:
        m = _median(x)
        lo, hi = min(lo, m - 0.5 * tick), max(hi, m + 0.5 * tick)
    return lo, hi


def median_ci(samples: Sequence[float], confidence: float = 0.95, resolution: float = 0.0) -> tuple[float, float]:
    """Distribution-free interval (lo, hi) of the median of ``samples``, same unit, at
    least one tick wide (:func:`sample_tick`, ``resolution`` its fallback).

    Returns (-inf, inf) below :data:`MIN_SAMPLES` samples.
    """
    x = np.sort(_as_samples(samples, "samples"))
    if x.size < MIN_SAMPLES:
        return -math.inf, math.inf
    return _ci(x, confidence, _tick(x, resolution))


def median_rel_noise(samples: Sequence[float], confidence: float = 0.95, resolution: float = 0.0) -> float:
    """Relative noise of the median: the width of :func:`median_ci` / (2 · median).

    Shrinks like 1/sqrt(n), down to half a tick over the median (``resolution``: the
    timer's step per call, for samples that show none). ``math.inf`` when n <
    :data:`MIN_SAMPLES` or the median is not positive (a relative width means nothing
    there). One sort, no resampling: the timer's stopping rule calls this after every few
    samples.
    """
    x = np.sort(_as_samples(samples, "samples"))
    return _rel_noise(x, confidence, _tick(x, resolution))


def _rel_noise(x: np.ndarray, confidence: float, tick: float) -> float:
    """:func:`median_rel_noise` of sorted samples whose tick is known."""
    if x.size < MIN_SAMPLES:
        return math.inf
    med = _median(x)
    if med <= 0:
        return math.inf
    lo, hi = _ci(x, confidence, tick)
    return (hi - lo) / (2.0 * med)


def summarize(samples: Sequence[float], resolution: float = 0.0) -> Summary:
    """Summary of ``samples`` (any unit); ValueError on empty input or non-finite values.
    ``resolution``: the timer's step per call, the tick where the samples show none."""
    x = _as_samples(samples, "samples")
    xs = np.sort(x)
    tick = _tick(xs, resolution)
    p20, p25, p50, p75, p80 = np.percentile(x, [20, 25, 50, 75, 80])
    return Summary(
        count=int(x.size),
        median=float(p50),
        mean=float(x.mean()),
        min=float(x.min()),
        max=float(x.max()),
        p20=float(p20),
        p80=float(p80),
        iqr=float(p75 - p25),
        stddev=float(x.std(ddof=1)) if x.size > 1 else 0.0,
        rel_noise=_rel_noise(xs, 0.95, tick),
        tick=tick,
    )


def geomean(xs: Sequence[float]) -> float:
    """Geometric mean of positive finite values (the mean of ratios across cases)."""
    x = _as_samples(xs, "geomean input")
    if (x <= 0).any():
        raise ValueError("geomean input: values must be positive")
    return float(np.exp(np.mean(np.log(x))))
