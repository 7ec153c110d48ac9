"""Statistics of one set of timing samples (numpy only).

:func:`summarize` / :func:`median_rel_noise` describe one set of timing samples
(seconds). The timer's stopping rule calls :func:`median_rel_noise` repeatedly, so it
sorts once and does no resampling: the distribution-free confidence interval of the
median comes from binomial order statistics (ranks ``n/2 ± z·sqrt(n)/2``), valid for any
continuous distribution, skewed timing tails included. The A/B verdicts built on these
samples are in :mod:`microbench.verdicts`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from typing import Any, Literal, Sequence

import numpy as np

Label = Literal["FASTER", "SLOWER", "SAME", "UNSURE"]
LABELS: tuple[str, ...] = ("FASTER", "SLOWER", "SAME", "UNSURE")

#: Below this many samples the order-statistic interval of the median at 95% spans the
#: whole sample (n = 6 gives ranks 1 and 6), and a bootstrap of the median has almost no
#: distinct values: no interval is reported (noise = inf, verdict interval = [0, inf]).
MIN_SAMPLES = 6

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
    median divided by the median (inf below :data:`MIN_SAMPLES` samples).
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

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (``rel_noise`` may be ``inf``: results are written with allow_nan)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Summary":
        """Inverse of :meth:`to_dict`; keys this version does not know are ignored."""
        kw: dict[str, Any] = {f.name: float(d[f.name]) for f in fields(cls) if f.name != "count"}
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


def median_ci(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval (lo, hi) of the median of ``samples``, same unit.

    Returns (-inf, inf) below :data:`MIN_SAMPLES` samples.
    """
    x = np.sort(_as_samples(samples, "samples"))
    if x.size < MIN_SAMPLES:
        return -math.inf, math.inf
    lo, hi = _median_ranks(x.size, confidence)
    return float(x[lo]), float(x[hi])


def median_rel_noise(samples: Sequence[float], confidence: float = 0.95) -> float:
    """Relative noise of the median: (x[hi] - x[lo]) / (2 · median), ranks as :func:`median_ci`.

    Shrinks like 1/sqrt(n). ``math.inf`` when n < :data:`MIN_SAMPLES` or the median is not
    positive (a relative width means nothing there). One sort, no resampling: the timer's
    stopping rule calls this after every few samples.
    """
    x = np.sort(_as_samples(samples, "samples"))
    n = x.size
    if n < MIN_SAMPLES:
        return math.inf
    med = 0.5 * (x[(n - 1) // 2] + x[n // 2])
    if med <= 0:
        return math.inf
    lo, hi = _median_ranks(n, confidence)
    return float((x[hi] - x[lo]) / (2.0 * med))


def summarize(samples: Sequence[float]) -> Summary:
    """Summary of ``samples`` (any unit); ValueError on empty input or non-finite values."""
    x = _as_samples(samples, "samples")
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
        rel_noise=median_rel_noise(x),
    )


def geomean(xs: Sequence[float]) -> float:
    """Geometric mean of positive finite values (the mean of ratios across cases)."""
    x = _as_samples(xs, "geomean input")
    if (x <= 0).any():
        raise ValueError("geomean input: values must be positive")
    return float(np.exp(np.mean(np.log(x))))
