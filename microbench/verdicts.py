"""A/B verdicts from raw timing samples (numpy only).

:func:`compare_samples` (two separate runs) and :func:`compare_paired` (one run with the
variants interleaved A B, B A, ...) turn two sample sets into a :class:`Verdict`: the time
ratio new / base (> 1 means new is slower), its bootstrap confidence interval and a label.

The verdict rule (:func:`classify`), the same for both comparisons, with ``e`` the
minimum effect (default 2%) and ``[lo, hi]`` the interval of the ratio:

``SLOWER``  ``lo > 1 + e``  (the whole interval beyond the minimum effect)
``FASTER``  ``hi < 1 / (1 + e)``
``SAME``    ``1 / (1 + e) <= lo`` and ``hi <= 1 + e``
``UNSURE``  anything else

Why each part:

* A verdict needs the whole interval past the minimum effect, not just past 1: an
  interval that merely excludes 1 says "different", but a true 1% shift under 5% noise
  then reads SLOWER in ~7% of 50-sample comparisons (its estimate overshoots 2% with an
  interval clear of 1). Requiring ``lo > 1 + e`` makes that a ~0.3% event at 30-60
  samples (about 1% at the fewest a verdict takes, 6-10) while a real 10% change under
  the same noise (interval half-width ~2.5%) is still SLOWER.
* The band is symmetric in log space, ``[1 / (1 + e), 1 + e]``: A against B and B against
  A then get mirrored verdicts (``1 - e`` on the fast side called ×1.0201 [1.0201, 1.05]
  SLOWER one way and UNSURE the other).
* The minimum effect itself: a difference smaller than ``e`` is either too small to
  matter for a kernel change, or cannot be separated from the shifts between runs that
  no within-run interval sees (the same code in separate processes on a shared machine
  moves by several percent). A narrow interval that excludes 1 but sits inside
  ``[1 / (1 + e), 1 + e]`` is therefore ``SAME``: a real but negligible difference.
* A change that is probably real but whose interval reaches back inside ``e`` (say
  ×1.05 [1.01, 1.09]) is ``UNSURE``: more samples decide it, a label would overclaim.
* ``SAME`` needs the *whole* interval inside ``[1 / (1 + e), 1 + e]``: only then do the samples
  rule out an effect that matters. A wide interval around 1 proves nothing either way,
  and neither does a large ratio whose interval still reaches 1: both are ``UNSURE``,
  and the answer is more samples or less noise, not a label.

Timer ticks: a statistic of samples that fall on a few tick values (a µs-scale call timed
by CUDA events) is known to no better than half a tick (:mod:`microbench.stats`), and a
bootstrap of such samples collapses onto a ratio of two tick values, [1.25, 1.25] say,
however close the true times are. So every interval is widened to hold the ratios the
statistics allow within their half-ticks, ``(mB - qB/2) / (mA + qA/2)`` to
``(mB + qB/2) / (mA - qA/2)`` for medians mA, mB read in ticks qA, qB (:func:`_tick_bound`):
the outer bounds of that and the bootstrap interval, before any widening for the
environment. Samples of fine resolution (a CPU's ns, or dithered samples whose bootstrap
spans many ticks) have a bound inside their bootstrap interval, and it changes nothing.

Environment correction: between two runs the whole machine can shift (clocks, co-tenants,
thermal state). When each run also timed a fixed reference workload (the probe) beside
the case, :func:`compare_samples` divides the case's ratio by the probe's ratio and
bootstraps all four sample sets jointly, so the interval carries the probe's noise too.

All bootstraps are percentile bootstraps of the median, vectorised over a bounded number
of resampled elements at a time, and deterministic for a given seed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, Sequence

import numpy as np

from microbench import stats
from microbench.wander import block_wander, excess_wander, widen
from microbench.stats import MIN_SAMPLES, _MAX_DRAWS_PER_CHUNK, _as_samples, _check_confidence


# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Verdict:
    """An A/B verdict: time ratio new / base (> 1: new is slower) and its interval.

    ``ratio`` is environment-corrected when probes were given (``raw_ratio / env_ratio``);
    ``[lo, hi]`` is the ``confidence`` interval of ``ratio`` ([0, inf] when either side has
    fewer than :data:`MIN_SAMPLES` samples); ``method`` is "bootstrap-median" (two runs)
    or "paired-median" (one interleaved run).
    """

    label: str
    ratio: float
    lo: float
    hi: float
    raw_ratio: float
    env_ratio: float | None
    min_effect: float
    confidence: float
    method: str
    n_base: int
    n_new: int
    #: Log-space sigma of between-run environment wander folded into [lo, hi] (0 = none).
    env_sigma: float = 0.0
    #: Log-space environment move between the runs that stretched [lo, hi] (0 = none).
    env_shift: float = 0.0
    #: The compared statistics' half-ticks together (relative, about the ratio's own
    #: half-width from the timers' ticks alone) where they widened [lo, hi] (0 = they did not).
    tick: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (``hi`` may be ``inf`` for too few samples)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Verdict":
        """Inverse of :meth:`to_dict`; keys this version does not know are ignored."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        for k in ("ratio", "lo", "hi", "raw_ratio", "min_effect", "confidence"):
            kw[k] = float(kw[k])
        kw["env_ratio"] = None if kw["env_ratio"] is None else float(kw["env_ratio"])
        kw["n_base"], kw["n_new"] = int(kw["n_base"]), int(kw["n_new"])
        return cls(**kw)

    def explain(self) -> str:
        """One line: label, ratio, interval, why, and what the environment did."""
        e = self.min_effect
        head = f"{self.label}: ×{self.ratio:.3f} [{self.lo:.3f}, {self.hi:.3f}]"
        if self.method == "identical-samples":
            why = "the same samples on both sides"
        elif min(self.n_base, self.n_new) < MIN_SAMPLES:
            why = f"too few samples for an interval (n={self.n_base}/{self.n_new}, need {MIN_SAMPLES})"
        elif self.method == "paired-median" and math.isinf(self.hi):
            why = f"too few whole rotations of the interleaved order for an interval (need {MIN_SAMPLES})"
        elif self.env_ratio is not None and math.isinf(self.hi):
            why = f"too few samples of the environment probe for an interval (need {MIN_SAMPLES} a side)"
        else:
            why = {
                "SLOWER": f"whole interval at least {e:.1%} slower",
                "FASTER": f"whole interval at least {e:.1%} faster",
                "SAME": f"interval within ±{e:.1%}",
                "UNSURE": f"interval does not decide at ±{e:.1%}",
            }.get(self.label, "unknown label")
            if self.tick > 0:
                why += (f", held open by the timer's tick (±{self.tick:.1%}: more samples cannot narrow it; "
                        "more calls per sample, hot or graph mode, can)")
        tail = f"({self.method}, n={self.n_base}/{self.n_new})"
        if self.env_ratio is None:
            return f"{head}, {why} {tail}"
        shift = self.env_ratio - 1.0
        if abs(shift) < e:
            env = f"environment steady ({shift:+.1%}), raw ×{self.raw_ratio:.3f}"
        elif self.label == "SAME" and abs(self.raw_ratio - 1.0) >= e:
            env = (f"environment moved {shift:+.1%} and this case moved with it "
                   f"(raw ×{self.raw_ratio:.3f}, corrected)")
        else:
            env = f"environment moved {shift:+.1%}, raw ×{self.raw_ratio:.3f} (corrected)"
        return f"{head}, {why}; {env} {tail}"


def classify(ratio: float, lo: float, hi: float, min_effect: float) -> str:
    """The verdict rule (module docstring): "SLOWER", "FASTER", "SAME" or "UNSURE"."""
    if any(math.isnan(v) for v in (ratio, lo, hi, min_effect)):
        raise ValueError(f"classify: NaN in ratio={ratio}, lo={lo}, hi={hi}, min_effect={min_effect}")
    if min_effect < 0:
        raise ValueError(f"classify: min_effect must be >= 0, got {min_effect}")
    if lo > hi:
        raise ValueError(f"classify: interval lo={lo} > hi={hi}")
    e = min_effect
    if lo > 1.0 + e:
        return "SLOWER"
    if hi < 1.0 / (1.0 + e):
        return "FASTER"
    if 1.0 / (1.0 + e) <= lo and hi <= 1.0 + e:
        return "SAME"
    return "UNSURE"


def _tick_bound(ratio: float, lo: float, hi: float, up: Sequence[float],
                down: Sequence[float]) -> tuple[float, float, float]:
    """([lo, hi] widened to hold ``ratio`` moved by each statistic within its half-tick,
    the half-ticks together where that widened it, else 0).

    ``up``: the relative half-ticks (:func:`microbench.stats.half_tick`) of the
    statistics in the ratio's numerator, ``down``: of those in its denominator. The bound
    is ratio · Π(1 - u_up) / Π(1 + u_down) .. ratio · Π(1 + u_up) / Π(1 - u_down): for
    medians mA (base) and mB (new) read in ticks qA, qB, (mB - qB/2) / (mA + qA/2) ..
    (mB + qB/2) / (mA - qA/2). A denominator's half-tick of a whole statistic or more
    leaves no upper bound.
    """
    b_lo, b_hi = ratio, ratio
    for u in up:
        b_lo, b_hi = b_lo * max(0.0, 1.0 - u), b_hi * (1.0 + u)
    for u in down:
        b_lo, b_hi = b_lo / (1.0 + u), (b_hi / (1.0 - u) if u < 1.0 else math.inf)
    if b_lo >= lo and b_hi <= hi:
        return lo, hi, 0.0
    return min(lo, b_lo), max(hi, b_hi), float(sum(up) + sum(down))


def _half_ticks(sets: Sequence[np.ndarray], quantile: float = 0.5) -> list[float]:
    """Each sample set's half-tick over its ``quantile``, its tick read from its own samples."""
    return [stats.half_tick(x, stats.sample_tick(x), quantile) for x in sets]


def _check_args(min_effect: float, confidence: float, n_boot: int) -> None:
    _check_confidence(confidence)
    if not (min_effect >= 0 and math.isfinite(min_effect)):
        raise ValueError(f"min_effect must be a finite value >= 0, got {min_effect}")
    if n_boot < 10:
        raise ValueError(f"n_boot must be >= 10 (>= 1000 for a stable interval), got {n_boot}")


def _boot_medians(rng: np.random.Generator, sets: Sequence[np.ndarray], n_boot: int,
                  q: float = 0.5) -> list[np.ndarray]:
    """The ``q`` quantile (median by default) of ``n_boot`` resamples (with replacement) of
    each set, drawn independently.

    Returns one [n_boot] array per set. Resamples are drawn as index matrices of at most
    :data:`_MAX_DRAWS_PER_CHUNK` elements in total per chunk, so memory stays bounded.
    """
    total = sum(s.size for s in sets)
    rows = max(1, _MAX_DRAWS_PER_CHUNK // total)
    out = [np.empty(n_boot) for _ in sets]
    for start in range(0, n_boot, rows):
        r = min(rows, n_boot - start)
        for s, o in zip(sets, out):
            idx = rng.integers(0, s.size, size=(r, s.size))
            o[start:start + r] = np.median(s[idx], axis=1) if q == 0.5 else np.quantile(s[idx], q, axis=1)
    return out


def _interval(boot: np.ndarray, confidence: float) -> tuple[float, float]:
    """Percentile interval of bootstrap replicates."""
    a = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(boot, [a, 1.0 - a])
    return float(lo), float(hi)


def compare_samples(
    base: Sequence[float],
    new: Sequence[float],
    *,
    min_effect: float = 0.02,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    base_probe: Sequence[float] | None = None,
    new_probe: Sequence[float] | None = None,
    env_sigma: float = 0.0,
    quantile: float = 0.5,
    env_df: int = 0,
    env_shift: float = 0.0,
    half_ticks: tuple[float, float] | None = None,
    identical_is_same: bool = True,
) -> Verdict:
    """Verdict for two separate (unpaired) runs: ratio = median(new) / median(base).

    ``quantile``: the statistic compared, the median by default. On a CPU, interference
    from co-tenants only ever adds time, so a low quantile (the lower envelope) is the
    stable one: the same 48x48 matmul loop timed in 8 separate processes on a 2-core
    machine gave medians from 211 to 237 µs but 2nd percentiles from 141 to 144 µs.

    ``env_sigma``: the log-space standard deviation of how far the environment wanders
    between the moments two runs measure a point (estimated by the caller from the probe's
    spread within each run). The bootstrap cannot see it; it widens the interval in
    quadrature, so on a machine whose environment wanders 20% a verdict says UNSURE rather
    than read the wander as code. ``env_df``: the degrees of freedom ``env_sigma`` was
    estimated with (a few blocks or passes: a Student-t quantile, not the normal one, so
    an underestimated sigma from three passes does not make a verdict).

    ``env_shift``: how far (log-space, >= 0) the environment measurably moved between the
    two runs — the probe's ratio when it is not divided out. Not a correction (a case does
    not move exactly with the probe) but a bound: the interval is stretched by it on both
    sides, so a change no larger than the machine's own move is never called code.

    ``half_ticks``: (base, new) each side's timer half-tick over its statistic, relative
    (:func:`microbench.stats.half_tick`; :func:`microbench.stats.timing_half_tick` for a record), which
    widens the interval (module docstring); None: each read from its own samples, as are
    the probes'.

    ``base``/``new``: positive per-call times (any unit, the same for both), any lengths.
    The interval is a percentile bootstrap of the median ratio, each side resampled
    independently. With ``base_probe`` and ``new_probe`` (the reference workload timed
    beside the case in each run) the ratio is divided by median(new_probe) /
    median(base_probe) and all four sets are bootstrapped jointly (ratio of ratios per
    draw). Give both probes or neither.

    ``identical_is_same``: equal sample sets on both sides are one measurement compared
    with itself (a file with itself): SAME, [1, 1]. False where equal sets are a chance
    (two measurements whose quantised samples happen to agree): the interval then comes
    from the ticks and the bootstrap as any other.
    """
    _check_args(min_effect, confidence, n_boot)
    b = _as_samples(base, "base", positive=True)
    n = _as_samples(new, "new", positive=True)
    if (base_probe is None) != (new_probe is None):
        raise ValueError("compare_samples: give both base_probe and new_probe, or neither")
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    stat = (lambda x: float(np.median(x))) if quantile == 0.5 else (lambda x: float(np.quantile(x, quantile)))
    raw = stat(n) / stat(b)
    sets = [b, n]
    env: float | None = None
    if base_probe is not None and new_probe is not None:
        bp = _as_samples(base_probe, "base_probe", positive=True)
        nprobe = _as_samples(new_probe, "new_probe", positive=True)
        env = stat(nprobe) / stat(bp)
        sets += [bp, nprobe]
    ratio = raw if env is None else raw / env
    if identical_is_same and all(np.array_equal(sets[i], sets[i + 1]) for i in range(0, len(sets), 2)):
        # The same measurement on both sides (a run compared with itself): there is no
        # sampling difference between them to be uncertain about.
        return Verdict(label="SAME", ratio=1.0, lo=1.0, hi=1.0, raw_ratio=1.0, env_ratio=None if env is None else 1.0,
                       min_effect=float(min_effect), confidence=float(confidence), method="identical-samples",
                       n_base=int(b.size), n_new=int(n.size))
    tick = 0.0
    if min(s.size for s in sets) < MIN_SAMPLES:
        lo, hi = 0.0, math.inf
    else:
        meds = _boot_medians(np.random.default_rng(seed), sets, n_boot, quantile)
        boot = meds[1] / meds[0]
        if env is not None:
            boot = boot / (meds[3] / meds[2])
        lo, hi = _interval(boot, confidence)
        ub, un = half_ticks if half_ticks is not None else _half_ticks([b, n], quantile)
        up, down = [un], [ub]
        if env is not None:  # ratio / (new_probe / base_probe)
            ubp, unp = _half_ticks(sets[2:], quantile)
            up, down = [un, ubp], [ub, unp]
        lo, hi, tick = _tick_bound(ratio, lo, hi, up, down)
        lo, hi = widen(ratio, lo, hi, env_sigma, confidence, env_df)
        if env_shift > 0:
            lo, hi = lo * math.exp(-env_shift), hi * math.exp(env_shift)
    return Verdict(
        label=classify(ratio, lo, hi, min_effect), ratio=ratio, lo=lo, hi=hi, raw_ratio=raw,
        env_ratio=env, min_effect=float(min_effect), confidence=float(confidence),
        method="bootstrap-median" if quantile == 0.5 else f"bootstrap-p{100 * quantile:g}", n_base=int(b.size),
        n_new=int(n.size), env_sigma=float(env_sigma), env_shift=float(env_shift), tick=tick,
    )


def within_run(base: Mapping[str, Any], new: Mapping[str, Any], *, interleaved: bool,
               min_effect: float = 0.02) -> Verdict:
    """Verdict between two variants of one point of one run, from their records' ``timing``
    (``samples_s``, and ``passes`` where the run made several): paired rounds when the run
    interleaved them (balanced over each rotation of their order, where it rotated); else
    each one's wander over time (between passes, or blocks of one pass) widens the
    interval, since the two were timed at different moments. Either way each one's timer
    tick widens it too (:func:`microbench.stats.timing_half_tick`)."""
    ticks = (stats.timing_half_tick(base), stats.timing_half_tick(new))
    if interleaved:
        return compare_paired(base["samples_s"], new["samples_s"], min_effect=min_effect,
                              rotation=rotations(new), passes=new.get("passes"), half_ticks=ticks)
    sides = _wanders(base, new)
    v = compare_samples(base["samples_s"], new["samples_s"], min_effect=min_effect,
                        env_sigma=math.hypot(sides[0][0], sides[1][0]), env_df=sides[0][1] + sides[1][1],
                        half_ticks=ticks, identical_is_same=False)
    if v.label != "UNSURE" and not all(df for _, df in sides):
        # timed one after the other, and too short to show how far either wandered meanwhile:
        # a difference could be the machine's
        v = replace(v, label="UNSURE")
    return v


def _wanders(base: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[float, int]]:
    return [block_wander(t["samples_s"], t.get("passes"), short=True) for t in (base, new)]


def wander_known(base: Mapping[str, Any], new: Mapping[str, Any], *, interleaved: bool) -> bool:
    """Whether :func:`within_run` can bound the two records' difference at all: paired
    rounds always can; variants timed one after the other only when each record is long
    enough to show its own wander (else its interval is not widened for it, and its label
    is UNSURE whatever the interval)."""
    return interleaved or all(df for _, df in _wanders(base, new))


def paired_ratios(base: Sequence[float], new: Sequence[float], rotation: int | Sequence[int] = 1,
                  passes: Sequence[int] | None = None) -> tuple[np.ndarray, list[int] | None]:
    """The per-round ratios new[i] / base[i] of an interleaved run (both truncated to the
    common length), and their count per pass (``passes``: the rounds of each pass, None
    for one pass).

    ``rotation`` k > 1: the order of the k variants rotated round by round
    (:func:`microbench.timing.run_interleaved`), so each k consecutive rounds of a pass
    give every variant every place in a round once; their ratios are merged into one, the
    geometric mean, in which the place's own effect on a call's time cancels. A pass's
    last rounds that do not fill a rotation are left out; the counts are then per pass of
    these merged ratios. ``rotation`` may also be one k per pass (a pass in which a variant
    failed rotated over fewer). Each pass starts its rotation afresh, so ``passes`` must
    add up to the rounds."""
    b = np.asarray(base, dtype=np.float64)
    n = np.asarray(new, dtype=np.float64)
    m = min(b.size, n.size)
    r = n[:m] / b[:m]
    sizes = list(passes) if passes is not None else [m]
    ks = [int(rotation)] * len(sizes) if isinstance(rotation, (int, np.integer)) else [int(k) for k in rotation]
    if all(k <= 1 for k in ks):
        return r, (list(passes) if passes is not None else None)
    if sum(sizes) != m or len(ks) != len(sizes):
        raise ValueError(f"paired ratios: passes {sizes} and rotations {ks} do not describe {m} rounds")
    out, counts, start = [], [], 0
    for size, k in zip(sizes, ks):
        k = max(1, k)
        whole = size // k
        seg = np.log(r[start:start + whole * k]).reshape(whole, k)
        out.append(np.exp(seg.mean(axis=1)))
        counts.append(whole)
        start += size
    return np.concatenate(out), (counts if passes is not None else None)


def rotations(timing: Mapping[str, Any]) -> int | list[int]:
    """A record's rotation of its interleaved order: one per pass where a run of several
    passes recorded them, else the one it had (1 in files from before rotation)."""
    return list(timing.get("rotations") or []) or int(timing.get("rotation") or 1)


def compare_paired(
    base: Sequence[float],
    new: Sequence[float],
    *,
    min_effect: float = 0.02,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    rotation: int | Sequence[int] = 1,
    passes: Sequence[int] | None = None,
    half_ticks: tuple[float, float] | None = None,
) -> Verdict:
    """Verdict for one interleaved run: base[i] and new[i] were taken in the same round.

    Per-round ratios new[i] / base[i] (both truncated to the common length; with the
    variants' order rotated round by round, one per whole rotation: :func:`paired_ratios`);
    ratio = their median; interval by bootstrap over them. A slow drift (clock,
    temperature) that hits both variants of a round cancels in its ratio, so the interval
    is not widened by it. The timers' ticks do not cancel: ``half_ticks`` (base, new) as
    for :func:`compare_samples`, each side's half-tick over its median, widens it.
    """
    _check_args(min_effect, confidence, n_boot)
    b = _as_samples(base, "base", positive=True)
    n = _as_samples(new, "new", positive=True)
    r, _ = paired_ratios(b, n, rotation, passes)
    whole = r.size
    if not whole:  # not one whole rotation (a run cut short): the rounds' own ratios, judged UNSURE
        r = paired_ratios(b, n)[0]
    ratio = float(np.median(r))
    tick = 0.0
    if whole < MIN_SAMPLES:
        lo, hi = 0.0, math.inf
    else:
        (boot,) = _boot_medians(np.random.default_rng(seed), [r], n_boot)
        lo, hi = _interval(boot, confidence)
        ub, un = half_ticks if half_ticks is not None else _half_ticks([b, n])
        lo, hi, tick = _tick_bound(ratio, lo, hi, [un], [ub])
        lo, hi = widen(ratio, lo, hi, excess_wander(r), confidence, 4)
    return Verdict(
        label=classify(ratio, lo, hi, min_effect), ratio=ratio, lo=lo, hi=hi, raw_ratio=ratio,
        env_ratio=None, min_effect=float(min_effect), confidence=float(confidence),
        method="paired-median", n_base=int(b.size), n_new=int(n.size), tick=tick,
    )
