"""The run loop: gate before timing, failures recorded, A/B verdicts in a run and across runs."""

from __future__ import annotations

import pytest

from microbench import compare
from microbench.results import ResultWriter, load
from microbench.runner import RunOptions, Runner, plan
from microbench.timing import TimingOptions

from .helpers import Scaled

FAST = TimingOptions(budget_s=0.3, max_noise=0.005)


def _run(case, tmp_path=None, **kw):
    opts = RunOptions(suite="smoke", device="cpu", timing=kw.pop("timing", FAST), **kw)
    writer = ResultWriter(str(tmp_path), {"suite": "smoke", "device": "cpu"}, {"git": {}, "host": {}}) if tmp_path else None
    recs = Runner(opts, writer, progress=lambda _: None).run(plan([case], opts))
    if writer:
        writer.close(complete=True)
    return recs, writer


def _by(recs, variant, n=None):
    return [r for r in recs if r["variant"] == variant and (n is None or r["axes"]["n"] == n)]


def test_wrong_kernel_is_failed_and_not_timed():
    recs, _ = _run(Scaled(wrong=True), variants=["base"])
    assert {r["status"] for r in recs} == {"FAILED"}
    for r in recs:
        assert r["timing"] is None and r["reason"].startswith("incorrect: c")
        assert r["correctness"]["reports"][0]["worst_index"] == [r["axes"]["n"] - 1] * 2


def test_a_raising_variant_is_recorded_and_the_run_goes_on():
    case = Scaled()

    def raising(a, b, c):
        raise RuntimeError("CUDA out of memory (simulated)")

    case.variants = lambda: [Scaled().variants()[0], type(Scaled().variants()[0])("oom", raising, devices=("cpu",))]
    recs, _ = _run(case)
    assert [r["status"] for r in _by(recs, "oom")] == ["FAILED", "FAILED"]
    assert "out of memory" in _by(recs, "oom")[0]["reason"]
    assert [r["status"] for r in _by(recs, "base")] == ["OK", "OK"]


def test_records_carry_seed_stats_floor_and_probe():
    recs, _ = _run(Scaled(), variants=["base"], axis_picks={"n": ["48"]})
    (r,) = recs
    assert r["correctness"]["passed"] and isinstance(r["correctness"]["seed"], int)
    t = r["timing"]
    assert len(t["samples_s"]) == t["summary"]["count"] and t["stop_reason"] in ("noise", "budget")
    assert r["gbps"] > 0 and r["tflops"] > 0
    assert r["probe"]["samples_s"] and r["probe"]["version"] >= 1


def test_axis_narrowing_rejects_unknown_values():
    with pytest.raises(ValueError, match="axis n has no value 7"):
        plan([Scaled()], RunOptions(suite="smoke", axis_picks={"n": ["7"]}))


@pytest.mark.serial
def test_interleaved_ab_within_one_run_sees_ten_percent_and_not_zero():
    recs, _ = _run(Scaled(reps=30, other_reps=33), variants=["base", "other"], interleave=True,
                   axis_picks={"n": ["48"]}, timing=TimingOptions(budget_s=0.6))
    (other,) = _by(recs, "other")
    assert other["vs_baseline"]["method"] == "paired-median"
    assert other["vs_baseline"]["label"] == "SLOWER", other["vs_baseline"]
    assert 1.05 < other["vs_baseline"]["ratio"] < 1.15
    recs, _ = _run(Scaled(reps=30, other_reps=30), variants=["base", "other"], interleave=True,
                   axis_picks={"n": ["48"]}, timing=TimingOptions(budget_s=0.6))
    assert _by(recs, "other")[0]["vs_baseline"]["label"] in ("SAME", "UNSURE")


@pytest.mark.serial
def test_across_two_real_runs_relative_to_an_unchanged_baseline(tmp_path):
    """Real CPU timing, separate runs: `other` is the function under test, `base` an
    unchanged anchor timed alternately with it. Absolute times may wander more than 10%
    between runs on a shared machine; the per-round ratio to the anchor does not."""
    t = TimingOptions(budget_s=0.25)
    runs = []
    for name, other in (("a", 30), ("b", 33), ("c", 30)):
        _, w = _run(Scaled(reps=30, other_reps=other), tmp_path / name, variants=["base", "other"], timing=t,
                    repeat=3, interleave=True, axis_picks={"n": ["48"]})
        runs.append(load(w.path))
    a, b, c = runs
    slower = {r["variant"]: r for r in compare.compare_runs(a, b, relative=True)["rows"]}
    assert slower["other"]["label"] == "SLOWER", compare.render(compare.compare_runs(a, b, relative=True))
    assert 1.05 < slower["other"]["ratio"] < 1.15
    same = {r["variant"]: r for r in compare.compare_runs(a, c, relative=True)["rows"]}
    assert same["other"]["label"] in ("SAME", "UNSURE"), compare.render(compare.compare_runs(a, c, relative=True))


def test_passes_pool_samples_and_keep_their_boundaries():
    recs, _ = _run(Scaled(), variants=["base", "other"], repeat=3, timing=TimingOptions(budget_s=0.05))
    for r in recs:
        t = r["timing"]
        assert len(t["passes"]) == 3 and sum(t["passes"]) == len(t["samples_s"]) == t["summary"]["count"]
        assert len(t["stop_reasons"]) == 3
    assert _by(recs, "other")[0]["vs_baseline"] is not None
