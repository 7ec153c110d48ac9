"""The timer's tick: read from the samples (the smallest gap, the timer's resolution where
all are equal), it holds a median's interval to median ± tick/2 where the order statistics
collapsed, keeps a µs call from stopping on a false noise rule, and holds verdicts open
that two tick values would otherwise decide; dithered and ns-resolution samples are left
as they were, and files from before ticks were kept still load."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from microbench import stats
from microbench.stats import Summary, median_ci, median_rel_noise, summarize
from microbench.timing import TimingOptions, run_interleaved, run_until_stable
from microbench.verdicts import Verdict, compare_paired, compare_samples

from .helpers import FakeClock, lognormal

TICK = 1.024e-6  # the step CUDA events are seen counting in on recent GPUs


def _ticked(counts: dict[int, int], seed: int = 0) -> np.ndarray:
    """Samples on whole ticks, ``counts[k]`` of them at k ticks, in a seeded order."""
    x = np.concatenate([np.full(c, k * TICK) for k, c in counts.items()])
    np.random.default_rng(seed).shuffle(x)
    return x


def test_samples_on_two_tick_values_have_half_a_tick_of_noise_not_zero() -> None:
    """A ~4.3 µs kernel timed by CUDA events: 200 samples at 4 or 5 ticks. Every rank of
    the median's order-statistic interval lands on 4 ticks (width 0, "±0.00%"), yet the
    time it stands for is known only to within half a tick."""
    x = _ticked({4: 160, 5: 40})
    s = summarize(x)
    assert s.tick == pytest.approx(TICK)
    assert s.rel_noise == pytest.approx(0.5 / 4) and median_rel_noise(x) == s.rel_noise
    assert median_ci(x) == pytest.approx((3.5 * TICK, 4.5 * TICK))
    # all samples equal: no gap shows the tick, the timer's resolution stands in; unknown, none
    same = [4 * TICK] * 50
    assert summarize(same, resolution=0.5e-6).tick == 0.5e-6
    assert median_rel_noise(same, resolution=0.5e-6) == pytest.approx(0.25e-6 / (4 * TICK))
    assert median_rel_noise(same) == 0.0


def test_the_tick_of_per_call_samples_is_the_timers_over_the_calls() -> None:
    # a hot sample of 8 calls: its time on whole ticks / 8, so its step is a tick / 8
    x = _ticked({60: 30, 61: 50, 62: 20}) / 8
    assert stats.sample_tick(x) == pytest.approx(TICK / 8)
    # float rounding between values that are one time is not a tick
    assert stats.sample_tick([1e-6, 1e-6 * (1 + 1e-14), 2e-6]) == pytest.approx(1e-6)
    assert stats.half_tick([2.0, 4.0, 4.0], 1.0) == 0.125


def test_samples_spread_over_ticks_and_cpu_timings_keep_their_interval() -> None:
    """The tick widens only an interval that collapsed onto one value: samples dithered
    over many ticks, and ns-resolution CPU timings, keep the order-statistic interval
    exactly (ranks 86 and 115 of 200), and their verdicts are what they were."""
    rng = np.random.default_rng(30)
    spread = np.round(lognormal(rng, 200, 0.2, scale=50e-6) / TICK) * TICK
    cpu = np.round(lognormal(rng, 200, 0.02, scale=2e-6) * 1e9) * 1e-9
    for x in (spread, cpu, lognormal(rng, 200, 0.02)):
        s = np.sort(x)
        assert summarize(x).rel_noise == (s[114] - s[85]) / (2 * np.median(x))
        assert median_ci(x) == (s[85], s[114])
    slower = np.round(lognormal(rng, 200, 0.2, scale=55e-6) / TICK) * TICK
    cpu_same = np.round(lognormal(rng, 200, 0.02, scale=2e-6) * 1e9) * 1e-9
    for a, b in ((spread, slower), (cpu, cpu_same)):
        v = compare_samples(a, b)
        assert v == compare_samples(a, b, half_ticks=(0.0, 0.0)) and v.tick == 0.0, v.explain()
        assert compare_paired(a, b) == compare_paired(a, b, half_ticks=(0.0, 0.0))


@pytest.mark.parametrize("compare", [compare_samples, compare_paired])
def test_medians_less_than_a_tick_apart_are_not_a_verdict(compare) -> None:
    """Base mostly at 4 ticks, new mostly at 5: the medians read 4 and 5 ticks, and the
    bootstrap gives ×1.25 [1.25, 1.25] (SLOWER), but times of 4.45 and 4.55 ticks could
    give these samples. Each median is held to ±half a tick: the ratio's interval is at
    least (5 - 1/2) / (4 + 1/2) .. (5 + 1/2) / (4 - 1/2), and the verdict UNSURE."""
    base, new = _ticked({4: 160, 5: 40}, seed=1), _ticked({4: 40, 5: 160}, seed=2)
    assert compare(base, new, half_ticks=(0.0, 0.0)).label == "SLOWER"  # as it read before
    v = compare(base, new)
    assert v.ratio == pytest.approx(1.25) and v.label == "UNSURE", v.explain()
    assert (v.lo, v.hi) == pytest.approx((4.5 / 4.5, 5.5 / 3.5))
    assert v.tick == pytest.approx(0.5 / 4 + 0.5 / 5) and "timer's tick" in v.explain()
    # nearly the same split on both sides: no longer a certain SAME at [1, 1] either
    w = compare(base, _ticked({4: 150, 5: 50}, seed=3))
    assert w.label in ("UNSURE", "SAME") and w.lo <= 4 / 4.5 and w.hi >= 4.5 / 3.5, w.explain()


def test_old_summaries_and_verdicts_without_a_tick_still_load() -> None:
    x = lognormal(np.random.default_rng(31), 50, 0.02)
    old = {k: v for k, v in summarize(x).to_dict().items() if k != "tick"}
    assert Summary.from_dict(old).tick == 0.0 and Summary.from_dict(old).median == np.median(x)
    v = compare_samples(x, x * 1.1)
    d = {k: val for k, val in v.to_dict().items() if k != "tick"}
    assert Verdict.from_dict(d) == v  # tick 0: nothing widened it


def _ticked_take(clock, tick, counts, rng):
    """Samples on whole ticks (``counts``: ticks -> weight), as CUDA events give a µs call."""
    ks, w = list(counts), np.array(list(counts.values()), dtype=float)

    def take() -> float:
        s = int(rng.choice(ks, p=w / w.sum())) * tick
        clock.t += s + 100e-6  # the flush and spin around a cold sample
        return s
    return take


def test_samples_on_a_few_tick_values_do_not_stop_on_noise():
    """A ~4.3 µs kernel timed by 1.024 µs ticks: its samples fall on 4 and 5 ticks, the
    order-statistic interval of the median collapses to width 0 at once, and the noise
    rule used to stop it at 10 samples with "±0.00%". Half a tick is 12% of it: it runs to
    its budget instead, and a 50-tick call, whose half-tick is 1%, stops on a 2% target."""
    tick = 1.024e-6
    opts = TimingOptions(min_samples=10, min_time_s=0.0, max_noise=0.005, budget_s=0.05)
    clock = FakeClock()
    samples, reason, _ = run_until_stable(_ticked_take(clock, tick, {4: 0.8, 5: 0.2}, np.random.default_rng(7)),
                                          opts, clock)
    assert reason == "budget" and len(samples) > 100
    assert median_rel_noise(samples) == pytest.approx(0.5 / 4)
    # all samples equal: the timer's resolution stands in for the tick they cannot show
    clock = FakeClock()
    samples, reason, _ = run_until_stable(_ticked_take(clock, tick, {4: 1.0}, np.random.default_rng(8)),
                                          opts, clock, resolution=0.5e-6)
    assert reason == "budget"
    clock = FakeClock()
    (a, b), reason, _ = run_interleaved([_ticked_take(clock, tick, {4: 0.8, 5: 0.2}, np.random.default_rng(9)),
                                         _ticked_take(clock, tick, {4: 1.0}, np.random.default_rng(10))],
                                        opts, clock, resolutions=[0.5e-6, 0.5e-6])
    assert reason == "budget"
    clock = FakeClock()
    samples, reason, _ = run_until_stable(_ticked_take(clock, tick, {50: 0.8, 51: 0.2}, np.random.default_rng(11)),
                                          replace(opts, max_noise=0.02), clock)
    assert reason == "noise" and len(samples) == 10


def test_a_half_tick_widens_only_the_side_of_the_interval_it_passes() -> None:
    """ratio · (1 ± u) for the new side's half-tick u: where it reaches past one end of the
    bootstrap interval only (here the upper, the interval being lopsided), that end moves
    and the other stays; a half-tick of more than the whole statistic floors the lower end at 0."""
    rng = np.random.default_rng(62)
    a, b = lognormal(rng, 30, 0.05), lognormal(rng, 30, 0.05)
    plain = compare_samples(a, b, half_ticks=(0.0, 0.0))
    assert plain.ratio * 0.975 > plain.lo and plain.ratio * 1.025 > plain.hi  # lopsided: short above
    v = compare_samples(a, b, half_ticks=(0.0, 0.025))
    assert v.lo == plain.lo and v.hi == pytest.approx(plain.ratio * 1.025) and v.tick == 0.025, v.explain()
    w = compare_samples(a, b, half_ticks=(0.0, 1.5))
    assert w.lo == 0.0 and w.label == "UNSURE", w.explain()


def test_the_probes_ticks_hold_a_corrected_verdict_open_too() -> None:
    """Both probes at 4 ticks, the case timed at ns resolution: the probe's ratio is ×1
    [1, 1] by bootstrap, yet each probe median is known to half a tick, and the corrected
    ratio's interval holds (1 - 1/8) / (1 + 1/8) .. (1 + 1/8) / (1 - 1/8) of it."""
    rng = np.random.default_rng(32)
    base, new = lognormal(rng, 200, 0.02), lognormal(rng, 200, 0.02)
    v = compare_samples(base, new, base_probe=_ticked({4: 160, 5: 40}, seed=4),
                        new_probe=_ticked({4: 160, 5: 40}, seed=5))
    assert v.env_ratio == 1.0 and v.label == "UNSURE", v.explain()
    assert (v.lo, v.hi) == pytest.approx((v.ratio * 0.875 / 1.125, v.ratio * 1.125 / 0.875), rel=1e-4)
    assert v.tick == pytest.approx(0.25, rel=1e-4)


def test_a_quantile_is_held_to_half_a_tick_of_itself() -> None:
    """Compared at p20, the half-tick is over the p20 (4 ticks: 1/8), not the median (4.5)."""
    base, new = _ticked({4: 100, 5: 100}, seed=6), _ticked({4: 100, 5: 100}, seed=7)
    v = compare_samples(base, new, quantile=0.2)
    assert v.ratio == 1.0 and v.tick == pytest.approx(0.125 + 0.125), v.explain()
    assert (v.lo, v.hi) == pytest.approx((3.5 / 4.5, 4.5 / 3.5))
