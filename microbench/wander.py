"""How far a measurement wanders over its own duration, and how that widens a verdict's
interval: the spread of its blocks' (or passes') medians (:func:`block_wander`), for
pairs of rounds the spread beyond what independent rounds give (:func:`excess_wander`),
added to an interval in quadrature at a Student-t quantile (:func:`widen`)."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Sequence

import numpy as np


def widen(ratio: float, lo: float, hi: float, sigma: float, confidence: float, df: int = 0) -> tuple[float, float]:
    """Add a log-normal uncertainty of ``sigma`` (estimated with ``df`` degrees of freedom)
    to the interval [lo, hi] in quadrature."""
    if not sigma > 0 or not (lo > 0 and math.isfinite(hi)):
        return lo, hi
    w = t_quantile(0.5 + confidence / 2.0, df) * sigma
    lr = math.log(ratio)
    dl, dh = lr - math.log(lo), math.log(hi) - lr
    return math.exp(lr - math.hypot(dl, w)), math.exp(lr + math.hypot(dh, w))


def block_sigma(samples: Sequence[float], passes: Sequence[int] | None = None, blocks: int = 5,
                min_per_block: int = 6) -> float:
    """How far this measurement wandered over its own duration: the log-space standard
    deviation of the medians of ``blocks`` consecutive blocks of samples (time order) —
    or, when ``passes`` (sample counts of successive passes over a run) names three or
    more, of the passes, which lie seconds apart.

    A separate run meets the machine in another state; no bootstrap of one run's samples
    sees that, but the drift between the blocks of one run does. Used, not divided by
    sqrt(blocks) (the machine's states last longer than a block), as the between-run
    uncertainty of this record: over 14 A/A pairs of separate CPU runs every shift of the
    median lay within 1.3 of these sigmas, while the bootstrap interval alone missed 10.
    0 when there are too few samples for ``blocks`` blocks.
    """
    return block_wander(samples, passes, blocks, min_per_block)[0]


def block_wander(samples: Sequence[float], passes: Sequence[int] | None = None, blocks: int = 5,
                 min_per_block: int = 6, short: bool = False) -> tuple[float, int]:
    """:func:`block_sigma` and its degrees of freedom (blocks - 1; 0 when not estimated).

    ``short``: a record too short for ``blocks`` blocks of ``min_per_block`` (a quiet GPU
    kernel stops at 10-30 samples) is cut into 3 blocks of at least 3: a rough estimate,
    with its 2 degrees of freedom (a wide Student-t quantile), rather than none, which read
    a drift between two variants timed one after the other as code (:func:`microbench.verdicts.within_run`;
    ``compare`` lends such a record its run's typical wander instead). Under 9: none."""
    x = np.asarray(samples, dtype=np.float64)
    if passes is not None and len(passes) >= 3 and sum(passes) == x.size and min(passes) >= min_per_block:
        edges = np.cumsum([0, *passes])
        meds = np.array([np.median(x[a:b]) for a, b in zip(edges, edges[1:])])
        return float(np.std(np.log(meds), ddof=1)), len(passes) - 1
    m = x.size // blocks
    if m < min_per_block:
        if not short or x.size < 9:
            return 0.0, 0
        blocks, m = 3, x.size // 3
    meds = np.median(x[: m * blocks].reshape(blocks, m), axis=1)
    return float(np.std(np.log(meds), ddof=1)), blocks - 1


def combined_wander(a: Sequence[float], a_passes: Sequence[int] | None, b: Sequence[float],
                    b_passes: Sequence[int] | None) -> tuple[float, int]:
    """The wander of two measurements together (root sum of squares) and its degrees of freedom."""
    (sa, da), (sb, db) = block_wander(a, a_passes), block_wander(b, b_passes)
    return math.hypot(sa, sb), da + db


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (Cornish-Fisher expansion around the normal; within 3% of the
    exact value from 2 degrees of freedom up, exact in the limit). ``df`` <= 0 = normal."""
    z = NormalDist().inv_cdf(p)
    if df <= 0:
        return z
    v = float(df)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3))


def excess_wander(r: np.ndarray, blocks: int = 5, min_per_block: int = 6) -> float:
    """How far the medians of ``blocks`` consecutive blocks of per-round ratios spread
    beyond what independent rounds would give them (log-space sigma; 0 when they do not,
    or the series is too short). Noise that persists over rounds on one variant alone
    (its own slow state, not shared with the other) does not cancel in a round's ratio,
    and a bootstrap of the rounds, which takes them as independent, would not see it."""
    m = r.size // blocks
    if m < min_per_block:
        return 0.0
    lr = np.log(r[: m * blocks])
    meds = np.median(lr.reshape(blocks, m), axis=1)
    s = 1.4826 * float(np.median(np.abs(lr - np.median(lr))))  # the rounds' own spread, robustly
    expected = (1.2533 * s) ** 2 / m  # a median's variance over m independent rounds
    seen = float(np.var(meds, ddof=1))
    # only a spread independent rounds would rarely show (chi-square, 4 degrees of freedom,
    # 95%: 9.49 / 4) widens: otherwise the estimate's own noise would widen every interval
    if seen <= 2.37 * expected:
        return 0.0
    return math.sqrt(seen - expected)
