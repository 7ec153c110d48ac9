"""The statistics behind measurements and A/B verdicts, on seeded synthetic timings.

Timings are modelled as lognormal around a true time (multiplicative noise, right skew,
as real per-call times are); every generator is seeded, so each assertion is exact for
its data and fails if the estimator or the verdict rule changes behaviour.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from microbench.stats import MIN_SAMPLES, Summary, geomean, median_ci, median_rel_noise, summarize
from microbench.verdicts import Verdict, classify, compare_paired, compare_samples
from microbench.wander import block_sigma, block_wander, combined_wander, t_quantile

from .helpers import lognormal

T0 = 1e-3  # a 1 ms case (lognormal's default scale)


# --------------------------------------------------------------------------- one sample set


def test_summarize_matches_numpy() -> None:
    x = lognormal(np.random.default_rng(1), 257, 0.1)
    s = summarize(list(x))
    p20, p25, p75, p80 = np.percentile(x, [20, 25, 75, 80])
    assert s.count == 257
    assert s.median == pytest.approx(np.median(x), rel=1e-12)
    assert s.p20 == pytest.approx(p20, rel=1e-12)
    assert s.p80 == pytest.approx(p80, rel=1e-12)
    assert s.iqr == pytest.approx(p75 - p25, rel=1e-12)
    assert s.mean == pytest.approx(x.mean(), rel=1e-12)
    assert s.stddev == pytest.approx(x.std(ddof=1), rel=1e-12)
    assert (s.min, s.max) == (x.min(), x.max())
    assert s.rel_noise == median_rel_noise(x)


def test_summarize_small_known_values() -> None:
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.count, s.median, s.min, s.max, s.mean) == (5, 3.0, 1.0, 5.0, 3.0)
    assert s.iqr == pytest.approx(2.0)
    assert math.isinf(s.rel_noise)  # 5 < MIN_SAMPLES: no interval
    assert summarize([2.5]).stddev == 0.0


def test_median_rel_noise_shrinks_like_inverse_sqrt_n() -> None:
    rng = np.random.default_rng(2)
    sigma = 0.05
    small, large = median_rel_noise(lognormal(rng, 100, sigma)), median_rel_noise(lognormal(rng, 10_000, sigma))
    assert 7.0 < small / large < 14.0, (small, large)  # sqrt(10000 / 100) = 10
    # Half-width of a median interval: z * sqrt(pi / 2) * sigma / sqrt(n) for a near-normal shape.
    expected = 1.96 * math.sqrt(math.pi / 2) * sigma / math.sqrt(10_000)
    assert large == pytest.approx(expected, rel=0.15)


def test_median_rel_noise_inf_for_tiny_n() -> None:
    for n in range(1, MIN_SAMPLES):
        assert math.isinf(median_rel_noise([1.0 + 0.01 * i for i in range(n)]))
    assert math.isfinite(median_rel_noise([1.0 + 0.01 * i for i in range(MIN_SAMPLES)]))
    assert median_ci([1.0, 2.0]) == (-math.inf, math.inf)
    # at MIN_SAMPLES there is an interval: ranks 1 and n, the whole sample
    assert median_ci([1.0 + 0.01 * i for i in range(MIN_SAMPLES)]) == pytest.approx((1.0, 1.0 + 0.01 * (MIN_SAMPLES - 1)))


def test_small_sets_and_zero_times_have_defined_statistics() -> None:
    # two samples have a sample standard deviation (ddof = 1); only one has none
    assert summarize([1.0, 3.0]).stddev == pytest.approx(math.sqrt(2.0))
    # a median of 0 (a timer too coarse for the call) has no relative noise, not a crash
    assert math.isinf(median_rel_noise([0.0] * 4 + [1e-6] * 3))
    assert math.isinf(summarize([0.0] * 4 + [1e-6] * 3).rel_noise)


def test_median_ci_textbook_ranks_and_coverage() -> None:
    # n = 100 at 95%: the interval is the 40th and 61st order statistics (1-based).
    x = np.arange(1.0, 101.0)
    assert median_ci(x) == (40.0, 61.0)
    # Coverage of the true median over many seeded draws is near the nominal 95%
    # (the order-statistic interval is slightly conservative).
    rng = np.random.default_rng(3)
    hits = 0
    trials = 400
    for _ in range(trials):
        lo, hi = median_ci(lognormal(rng, 41, 0.2))
        hits += lo <= T0 <= hi
    assert 0.92 <= hits / trials <= 0.995, hits / trials


def test_invalid_samples_raise() -> None:
    for bad in ([], [1.0, float("nan")], [1.0, float("inf")]):
        with pytest.raises(ValueError):
            summarize(bad)
        with pytest.raises(ValueError):
            median_rel_noise(bad)
    with pytest.raises(ValueError, match="new: 1 non-finite"):
        compare_samples([1.0] * 10, [1.0] * 9 + [float("nan")])
    with pytest.raises(ValueError, match="base: empty"):
        compare_paired([], [1.0])
    with pytest.raises(ValueError, match="positive"):
        compare_samples([1.0, 0.0] * 5, [1.0] * 10)
    with pytest.raises(ValueError, match="both"):
        compare_samples([1.0] * 10, [1.0] * 10, base_probe=[1.0] * 10)
    with pytest.raises(ValueError, match="confidence"):
        compare_samples([1.0] * 10, [1.0] * 10, confidence=1.5)
    with pytest.raises(ValueError):
        geomean([1.0, -2.0])
    with pytest.raises(ValueError, match="positive"):
        geomean([0.0, 4.0])  # not a geomean of 0
    with pytest.raises(ValueError, match="n_boot"):
        compare_samples([1.0] * 10, [1.1] * 10, n_boot=5)


def test_geomean() -> None:
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([1.1] * 7) == pytest.approx(1.1)


# --------------------------------------------------------------------------- verdict rule


def test_classify_rule_and_edges() -> None:
    e = 0.02
    assert classify(1.10, 1.08, 1.12, e) == "SLOWER"
    assert classify(0.90, 0.88, 0.92, e) == "FASTER"
    assert classify(1.00, 0.99, 1.01, e) == "SAME"
    # A big ratio whose interval still reaches 1 is not a verdict.
    assert classify(1.30, 0.95, 1.70, e) == "UNSURE"
    assert classify(0.70, 0.40, 1.01, e) == "UNSURE"
    # A narrow interval excluding 1 but a 1% change: real, too small to matter.
    assert classify(1.01, 1.005, 1.015, e) == "SAME"
    assert classify(0.99, 0.985, 0.995, e) == "SAME"
    # Excludes 1, ratio under the minimum effect, interval reaching past it: cannot tell.
    assert classify(1.015, 1.001, 1.04, e) == "UNSURE"
    # A wide interval around 1 proves nothing either way.
    assert classify(1.0, 0.95, 1.05, e) == "UNSURE"
    # Probably slower, but the interval reaches back inside the minimum effect: UNSURE.
    assert classify(1.05, 1.01, 1.09, e) == "UNSURE"
    assert classify(0.95, 0.91, 0.99, e) == "UNSURE"
    # Boundaries: a verdict needs the whole interval past the effect; SAME includes its edges.
    assert classify(1.03, 1.021, 1.04, e) == "SLOWER"
    assert classify(1.03, 1.02, 1.04, e) == "UNSURE"
    # the band is symmetric in log space: [1 / 1.02, 1.02], so A vs B mirrors B vs A
    assert classify(1.0, 1 / 1.02, 1.02, e) == "SAME"
    assert classify(1.0, 0.98, 1.02, e) == "UNSURE"  # 0.98 is 2.04% faster: past the band
    assert classify(1.0, 0.0, math.inf, e) == "UNSURE"
    assert classify(0.97, 0.96, 0.98, e) == "FASTER"
    assert classify(0.97, 0.96, 1 / 1.02, e) == "UNSURE"  # FASTER's edge belongs to the effect, as SLOWER's does
    for lo, hi in ((1.0201, 1.05), (1.01, 1.03), (0.99, 1.019)):  # mirrored intervals, mirrored verdicts
        mirrored = {"SLOWER": "FASTER", "FASTER": "SLOWER"}
        one = classify(math.sqrt(lo * hi), lo, hi, e)
        assert classify(1 / math.sqrt(lo * hi), 1 / hi, 1 / lo, e) == mirrored.get(one, one)
    with pytest.raises(ValueError, match="min_effect"):
        classify(1.0, 0.99, 1.01, -0.01)
    with pytest.raises(ValueError):
        classify(float("nan"), 0.9, 1.1, e)
    with pytest.raises(ValueError):
        classify(1.0, 1.1, 0.9, e)


# --------------------------------------------------------------------------- two runs


def test_identical_distributions_are_same() -> None:
    rng = np.random.default_rng(10)
    v = compare_samples(lognormal(rng, 200, 0.02), lognormal(rng, 200, 0.02))
    assert v.label == "SAME", v.explain()
    assert v.lo < v.ratio < v.hi
    assert v.method == "bootstrap-median" and v.env_ratio is None and v.raw_ratio == v.ratio


@pytest.mark.parametrize(("factor", "label"), [(1.10, "SLOWER"), (1 / 1.10, "FASTER")])
def test_ten_percent_change_is_detected(factor: float, label: str) -> None:
    rng = np.random.default_rng(11)
    v = compare_samples(lognormal(rng, 200, 0.02), lognormal(rng, 200, 0.02, scale=T0 * factor))
    assert v.label == label, v.explain()
    assert v.ratio == pytest.approx(factor, rel=0.01)
    assert v.lo <= factor <= v.hi


def test_env_shift_stretches_the_interval_by_the_move_on_both_sides() -> None:
    rng = np.random.default_rng(12)
    a, b = lognormal(rng, 200, 0.02), lognormal(rng, 200, 0.02, scale=T0 * 1.10)
    plain = compare_samples(a, b, seed=3)
    moved = compare_samples(a, b, seed=3, env_shift=math.log(1.15))
    assert plain.label == "SLOWER" and moved.label == "UNSURE", moved.explain()
    assert moved.lo == pytest.approx(plain.lo / 1.15) and moved.hi == pytest.approx(plain.hi * 1.15)
    assert moved.ratio == plain.ratio and moved.env_shift == pytest.approx(math.log(1.15))


def test_interval_is_the_two_sided_confidence_interval() -> None:
    # Half-width of the median ratio's interval, log-space, for two near-normal sets of n:
    # z * sqrt(pi / 2) * sigma * sqrt(2 / n), z = 1.96 at 95% (1.64, a 90% interval, is not it).
    rng = np.random.default_rng(40)
    sigma, n = 0.05, 2000
    half = [math.log(v.hi / v.lo) / 2 for v in (compare_samples(lognormal(rng, n, sigma), lognormal(rng, n, sigma), seed=i)
                                                for i in range(8))]
    expected = 1.96 * math.sqrt(math.pi / 2) * sigma * math.sqrt(2 / n)
    assert float(np.mean(half)) == pytest.approx(expected, rel=0.08), (np.mean(half), expected)


def test_one_percent_under_five_percent_noise_large_n_is_same() -> None:
    # n = 2000: the interval is about ±0.4% wide, so a 1% shift is ruled out as >= 2%.
    rng = np.random.default_rng(12)
    for seed in range(4):
        v = compare_samples(lognormal(rng, 2000, 0.05), lognormal(rng, 2000, 0.05, scale=T0 * 1.01), seed=seed)
        assert v.label == "SAME", v.explain()


def test_one_percent_under_five_percent_noise_small_n_is_rarely_a_verdict() -> None:
    # n = 50: the median ratio's standard error is ~1.25% here. An interval that merely
    # excluded 1 would read SLOWER in ~7% of draws; the rule needs the whole interval past
    # 2%, which a true 1% shift reaches only by a ~2.7-sigma overshoot. Never a verdict
    # over these 150 draws; otherwise UNSURE rather than SAME (2% is not ruled out).
    rng = np.random.default_rng(13)
    labels = [
        compare_samples(lognormal(rng, 50, 0.05), lognormal(rng, 50, 0.05, scale=T0 * 1.01), n_boot=1000, seed=i).label
        for i in range(150)
    ]
    assert labels.count("FASTER") == 0, labels.count("FASTER")
    assert labels.count("SLOWER") == 0, f"{labels.count('SLOWER')} of {len(labels)} SLOWER"
    assert labels.count("UNSURE") >= 0.8 * len(labels), f"{labels.count('UNSURE')} of {len(labels)} UNSURE"


def test_probes_separate_environment_from_code() -> None:
    rng = np.random.default_rng(113)
    env = 1.18  # the whole machine 18% slower in the new run
    base, base_probe = lognormal(rng, 200, 0.02), lognormal(rng, 200, 0.02, scale=0.5 * T0)
    new, new_probe = lognormal(rng, 200, 0.02, scale=T0 * env), lognormal(rng, 200, 0.02, scale=0.5 * T0 * env)

    naive = compare_samples(base, new)
    assert naive.label == "SLOWER", naive.explain()

    v = compare_samples(base, new, base_probe=base_probe, new_probe=new_probe)
    assert v.label == "SAME", v.explain()
    assert v.env_ratio == pytest.approx(env, rel=0.01)
    assert v.raw_ratio == pytest.approx(naive.ratio)
    assert v.ratio == pytest.approx(v.raw_ratio / v.env_ratio)
    text = v.explain()
    assert re.search(r"environment moved \+1[78]\.\d%", text) and "moved with it" in text, text
    # The corrected interval carries the probe's noise too: wider than the raw one.
    assert v.hi - v.lo > naive.hi - naive.lo

    slower = lognormal(rng, 200, 0.02, scale=T0 * env * 1.10)
    w = compare_samples(base, slower, base_probe=base_probe, new_probe=new_probe)
    assert w.label == "SLOWER", w.explain()
    assert w.ratio == pytest.approx(1.10, rel=0.015)
    assert w.raw_ratio == pytest.approx(env * 1.10, rel=0.015)
    assert re.search(r"environment moved \+1[78]\.\d%", w.explain()), w.explain()


def test_steady_environment_is_reported_as_steady() -> None:
    rng = np.random.default_rng(14)
    a, b, pa, pb = (lognormal(rng, 100, 0.02) for _ in range(4))
    v = compare_samples(a, b, base_probe=pa, new_probe=pb)
    assert v.label == "SAME" and "environment steady" in v.explain(), v.explain()


def test_probes_that_differ_make_a_case_compared_with_itself_a_comparison() -> None:
    """The same case samples on both sides but a probe that moved 20%: not the
    identical-samples shortcut, the case reads faster against the environment."""
    rng = np.random.default_rng(16)
    case, probe = lognormal(rng, 200, 0.02), lognormal(rng, 200, 0.02, scale=0.5 * T0)
    v = compare_samples(case, case, base_probe=probe, new_probe=probe * 1.2)
    assert v.method == "bootstrap-median" and v.env_ratio == pytest.approx(1.2)
    assert v.ratio == pytest.approx(1 / 1.2) and v.label == "FASTER", v.explain()
    same = compare_samples(case, case, base_probe=probe, new_probe=probe)
    assert same.method == "identical-samples" and (same.lo, same.hi, same.env_ratio) == (1.0, 1.0, 1.0)


def test_probes_with_too_few_samples_give_no_interval() -> None:
    rng = np.random.default_rng(17)
    base, new = lognormal(rng, 200, 0.02), lognormal(rng, 200, 0.02, scale=T0 * 1.10)
    v = compare_samples(base, new, base_probe=lognormal(rng, 3, 0.02), new_probe=lognormal(rng, 3, 0.02))
    assert (v.lo, v.hi) == (0.0, math.inf) and v.label == "UNSURE", v.explain()
    assert "too few samples of the environment probe for an interval" in v.explain()


def test_explain_names_how_far_the_environment_moved() -> None:
    def verdict(label, ratio, env):
        return Verdict(label=label, ratio=ratio, lo=ratio * 0.99, hi=ratio * 1.01, raw_ratio=ratio * env, env_ratio=env,
                       min_effect=0.02, confidence=0.95, method="bootstrap-median", n_base=100, n_new=100)

    assert "environment steady (+1.0%)" in verdict("SAME", 1.0, 1.01).explain()
    assert "environment moved +3.0%" in verdict("SAME", 1.0, 1.03).explain()  # past the 2% effect: moved
    # "moved with it" only where the correction turned a raw move into SAME
    assert "this case moved with it" in verdict("SAME", 1.0, 1.10).explain()
    slower = verdict("SLOWER", 1.10, 1.10).explain()
    assert "environment moved +10.0%, raw ×1.210 (corrected)" in slower and "moved with it" not in slower, slower


def test_false_positive_rate_of_a_a_pairs() -> None:
    rng = np.random.default_rng(15)
    labels = [compare_samples(lognormal(rng, 60, 0.03), lognormal(rng, 60, 0.03), seed=i).label for i in range(200)]
    wrong = labels.count("FASTER") + labels.count("SLOWER")
    assert wrong <= 2, f"{wrong} of 200 A/A pairs called FASTER/SLOWER"
    assert labels.count("SAME") > 100  # and the rule is not just refusing to decide


# --------------------------------------------------------------------------- one interleaved run


def _drifting_rounds(rng: np.random.Generator, rounds: int, slowdown: float) -> tuple[np.ndarray, np.ndarray]:
    """A and B interleaved under the same +10% linear drift across the run; B x ``slowdown``."""
    drift = 1.0 + 0.10 * np.arange(rounds) / (rounds - 1)
    return drift * lognormal(rng, rounds, 0.02), drift * lognormal(rng, rounds, 0.02, scale=T0 * slowdown)


def test_paired_cancels_drift() -> None:
    a, b = _drifting_rounds(np.random.default_rng(16), 300, 1.0)
    v = compare_paired(a, b)
    assert v.label == "SAME", v.explain()
    assert v.method == "paired-median" and (v.n_base, v.n_new) == (300, 300)
    # Unpaired, the drift widens the interval; paired, it cancels in each round's ratio.
    u = compare_samples(a, b)
    assert v.hi - v.lo < 0.7 * (u.hi - u.lo), (v.explain(), u.explain())


def test_paired_detects_slowdown_under_drift() -> None:
    a, b = _drifting_rounds(np.random.default_rng(17), 300, 1.10)
    v = compare_paired(a, b)
    assert v.label == "SLOWER", v.explain()
    assert v.ratio == pytest.approx(1.10, rel=0.01)


def test_paired_truncates_to_common_length() -> None:
    a, b = _drifting_rounds(np.random.default_rng(18), 120, 1.0)
    v = compare_paired(a, b[:100])
    assert (v.n_base, v.n_new) == (120, 100)
    assert v.ratio == pytest.approx(float(np.median(b[:100] / a[:100])))


def test_rotated_rounds_merge_per_whole_rotation_within_each_pass() -> None:
    from microbench.verdicts import paired_ratios

    base = [1.0] * 11
    new = [2.0, 0.5, 4.0, 1.0, 9.0, 3.0, 1.0, 8.0, 2.0, 2.0, 7.0]
    r, passes = paired_ratios(base, new, rotation=2, passes=[5, 6])
    # pass 1: rounds (2, 0.5), (4, 1), its fifth left out; pass 2: (3, 1), (8, 2), (2, 7)
    assert list(r) == pytest.approx([1.0, 2.0, 3 ** 0.5, 4.0, 14 ** 0.5]) and passes == [2, 3]
    r, passes = paired_ratios(base, new)
    assert list(r) == new and passes is None
    # not one whole rotation: the rounds' own ratios, and no interval
    v = compare_paired([1.0] * 3, [1.5] * 3, rotation=4)
    assert v.ratio == 1.5 and v.label == "UNSURE" and math.isinf(v.hi)
    v = compare_paired([1.0] * 12, [1.5] * 12, rotation=4)  # 12 rounds: 3 whole rotations
    assert v.label == "UNSURE" and "too few whole rotations" in v.explain()
    # three passes cut at 3 rounds each by a deadline, 4 variants: 9 rounds, no rotation
    v = compare_paired([1.0] * 9, [1.5] * 9, rotation=4, passes=[3, 3, 3])
    assert v.ratio == 1.5 and v.label == "UNSURE" and math.isinf(v.hi)
    # one rotation per pass (a variant failed in the second: it rotated over fewer)
    r, passes = paired_ratios([1.0] * 7, [2.0, 0.5, 4.0, 1.0, 3.0, 3.0, 3.0], rotation=[2, 3], passes=[4, 3])
    assert list(r) == pytest.approx([1.0, 2.0, 3.0]) and passes == [2, 1]
    with pytest.raises(ValueError, match="do not describe 7 rounds"):
        paired_ratios([1.0] * 7, [1.0] * 7, rotation=2, passes=[4, 4])


def test_too_few_samples_is_unsure() -> None:
    for v in (compare_samples([1.0, 1.1, 1.2], [2.0, 2.1, 2.2]), compare_paired([1.0] * 4, [2.0] * 4)):
        assert v.label == "UNSURE" and (v.lo, v.hi) == (0.0, math.inf)
        assert "too few samples" in v.explain()


# --------------------------------------------------------------------------- mechanics


def test_bootstrap_is_deterministic_per_seed() -> None:
    rng = np.random.default_rng(19)
    a, b = lognormal(rng, 80, 0.05), lognormal(rng, 80, 0.05)
    assert compare_samples(a, b, seed=7) == compare_samples(a, b, seed=7)
    assert compare_paired(a, b, seed=7) == compare_paired(a, b, seed=7)
    assert compare_samples(a, b, seed=7).lo != compare_samples(a, b, seed=8).lo


def test_large_sample_sets_are_chunked() -> None:
    rng = np.random.default_rng(20)
    a, b = lognormal(rng, 10_000, 0.03), lognormal(rng, 10_000, 0.03, scale=T0 * 1.05)
    v = compare_samples(a, b, n_boot=600)
    assert v.label == "SLOWER" and v.hi - v.lo < 0.005, v.explain()


def test_round_trips_through_json() -> None:
    rng = np.random.default_rng(21)
    a, b, pa, pb = (lognormal(rng, 50, 0.02) for _ in range(4))
    for v in (compare_samples(a, b, base_probe=pa, new_probe=pb), compare_paired(a, b), compare_samples(a[:3], b)):
        d = json.loads(json.dumps(v.to_dict()))
        assert Verdict.from_dict(d) == v
        assert all(type(x) in (str, int, float, type(None)) for x in d.values())
    for s in (summarize(a), summarize(a[:2])):
        assert Summary.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_block_sigma_sees_wander_over_time_that_the_bootstrap_cannot() -> None:
    rng = np.random.default_rng(77)
    steady = lognormal(rng, 500, 0.02)
    assert block_sigma(steady) < 0.01
    wandering = np.array(lognormal(rng, 500, 0.02))
    wandering[250:] *= 1.2  # the machine changed state half-way
    assert block_sigma(wandering) > 0.05
    assert block_sigma(lognormal(rng, 20, 0.02)) == 0.0  # too few for five blocks of six


def test_env_sigma_widens_the_interval_and_can_turn_a_verdict_unsure() -> None:
    rng = np.random.default_rng(78)
    base, new = lognormal(rng, 300, 0.02), lognormal(rng, 300, 0.02, scale=T0 * 1.06)
    tight = compare_samples(base, new)
    wide = compare_samples(base, new, env_sigma=0.05)
    assert tight.label == "SLOWER" and wide.label == "UNSURE"
    assert wide.lo < tight.lo and wide.hi > tight.hi and wide.ratio == tight.ratio


def test_env_sigma_adds_in_quadrature_at_the_two_sided_t_quantile() -> None:
    """Log-space, each side of the interval grows from d to hypot(d, t * sigma), t the
    two-sided quantile at the confidence (1.96 at 95%), Student's with env_df degrees of
    freedom where sigma was estimated from a few blocks; the Verdict keeps sigma."""
    rng = np.random.default_rng(78)
    base, new = lognormal(rng, 300, 0.02), lognormal(rng, 300, 0.02, scale=T0 * 1.06)
    tight = compare_samples(base, new)
    assert t_quantile(0.975, 0) == pytest.approx(1.959964, rel=1e-6)
    assert t_quantile(0.975, 4) == pytest.approx(2.776, rel=0.03)  # Student's t, 4 degrees of freedom
    widths = []
    for df in (0, 4):
        v = compare_samples(base, new, env_sigma=0.05, env_df=df)
        w = t_quantile(0.975, df) * 0.05
        assert math.log(v.hi / v.ratio) == pytest.approx(math.hypot(math.log(tight.hi / tight.ratio), w), rel=1e-9)
        assert math.log(v.ratio / v.lo) == pytest.approx(math.hypot(math.log(tight.ratio / tight.lo), w), rel=1e-9)
        assert v.env_sigma == 0.05 and Verdict.from_dict(v.to_dict()).env_sigma == 0.05
        widths.append(v.hi - v.lo)
    assert widths[1] > widths[0]  # a sigma from five blocks is less sure than a known one


def test_block_wander_degrees_of_freedom_and_passes() -> None:
    rng = np.random.default_rng(79)
    x = np.array(lognormal(rng, 500, 0.02))
    x[250:] *= 1.2
    sigma, df = block_wander(x)
    assert df == 4 and sigma == block_sigma(x)  # five blocks: four degrees of freedom
    # three passes or more: the passes' medians, however the blocks would fall
    passes = [200, 200, 100]
    meds = [np.median(x[:200]), np.median(x[200:400]), np.median(x[400:])]
    assert block_wander(x, passes) == (pytest.approx(float(np.std(np.log(meds), ddof=1))), 2)
    # two passes are too few for a spread: the blocks again
    assert block_wander(x, [250, 250]) == (sigma, 4)
    # two records together: root sum of squares, degrees of freedom added
    y = np.array(lognormal(rng, 500, 0.02))
    assert combined_wander(x, None, y, None) == (pytest.approx(math.hypot(sigma, block_sigma(y))), 8)


def test_two_short_records_timed_one_after_the_other_under_drift_are_not_a_verdict() -> None:
    # a quiet kernel stops at ~20 samples; the machine drifts 5% across base then new: the
    # ratio is 1.05 with no change of code, and each record is too short for five blocks
    from microbench.verdicts import within_run

    rng = np.random.default_rng(3)
    t = 1 + 0.05 * np.linspace(0, 1, 40)
    x = t * np.exp(rng.normal(0, 0.003, 40)) * 1e-3
    v = within_run({"samples_s": list(x[:20])}, {"samples_s": list(x[20:])}, interleaved=False)
    assert v.label == "UNSURE", v.explain()
    # the same samples on both sides by chance: judged, not taken as one measurement
    same = within_run({"samples_s": [2e-6] * 12}, {"samples_s": [2e-6] * 12}, interleaved=False)
    assert same.method != "identical-samples"


def test_noise_that_persists_on_one_variant_widens_the_paired_interval() -> None:
    # per-variant AR(1) noise (phi 0.98, 2%): rounds are not independent, and the bootstrap
    # alone called such A/A pairs FASTER or SLOWER about one time in four
    rng = np.random.default_rng(5)

    def ar(n):
        e, z = np.zeros(n), rng.normal(0, 0.02 * np.sqrt(1 - 0.98 ** 2), n)
        for i in range(1, n):
            e[i] = 0.98 * e[i - 1] + z[i]
        return np.exp(e) * 1e-3

    labels = [compare_paired(list(ar(60)), list(ar(60))).label for _ in range(40)]
    assert not {"FASTER", "SLOWER"} & set(labels), labels
