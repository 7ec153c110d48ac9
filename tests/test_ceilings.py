"""The run's ceilings (the calibration cases' measurements) and every row's % of floor
against them: measured before a point's own rows are read, settled from the kept records,
and said when they may mislead."""

from __future__ import annotations

import pytest

from microbench.planning import RunOptions, plan
from microbench.runner import Runner
from microbench.stats import summarize
from microbench.timing import TimingOptions

from .helpers import Scaled


class _Bandwidth(Scaled):
    """A copy-like calibration case on one point; incorrect from its ``bad_from``-th set-up."""

    id = "test.bandwidth"
    ceiling = "memory_bandwidth"
    order = 0

    def __init__(self, bad_from=None):
        super().__init__(reps=1)
        self.setups, self.bad_from = 0, bad_from

    def axes(self, suite, device="cuda"):
        return {"n": [48]}

    def setup(self, point, device, seed):
        self.setups += 1
        self.wrong = self.bad_from is not None and self.setups >= self.bad_from
        return super().setup(point, device, seed)

    def variants(self):
        return super().variants()[:1]


class _Other(Scaled):
    id = "test.other"

    def axes(self, suite, device="cuda"):
        return {"n": [32]}

    def variants(self):
        return super().variants()[:1]


def test_a_calibration_point_is_read_against_the_ceiling_it_measured():
    # one pass: the ceiling's own row was floored before it was measured (against nothing)
    opts = RunOptions(suite="smoke", device="cpu", timing=TimingOptions(budget_s=0.1), repeat=1, probe=False)
    runner = Runner(opts, None, progress=lambda _: None)
    cal, other = runner.run(plan([_Bandwidth(), _Other()], opts))
    assert cal["floor_source"] == other["floor_source"] == "measured in this run"
    assert cal["pct_of_floor"] == pytest.approx(100.0)
    assert runner.ceilings["memory_bandwidth"]["value"] == pytest.approx(cal["bytes"] / summarize(cal["timing"]["samples_s"]).median)


def test_a_ceiling_whose_record_fails_in_a_later_pass_is_dropped():
    opts = RunOptions(suite="smoke", device="cpu", timing=TimingOptions(budget_s=0.05), repeat=2, probe=False)
    runner = Runner(opts, None, progress=lambda _: None)
    cal, other = runner.run(plan([_Bandwidth(bad_from=2), _Other()], opts))
    assert cal["status"] == "FAILED" and cal["reason"].startswith("pass 2: incorrect")
    assert cal["gbps"] is None and cal["pct_of_floor"] is None  # no rate of the pass that ran before
    assert runner.ceilings == {} and other["floor_source"] is None and other["pct_of_floor"] is None


def test_the_run_says_when_its_floors_may_mislead():
    from microbench.report import describe_run

    def doc(ceiling, pct):
        return {"run": {"device": "cuda", "suite": "verify", "ceilings": {"memory_bandwidth": {
                    "value": ceiling, "unit": "B/s", "source": "calibration.copy in this run"}}},
                "fingerprint": {"device": {"name": "NVIDIA H200"}},
                "records": [{"case": "c", "axes": {}, "variant": "v", "status": "OK", "pct_of_floor": pct,
                             "floor_source": "measured in this run"}]}

    # 4.3 of the datasheet's 4.8 TB/s, every row under its floor: nothing to say
    assert "note:" not in describe_run(doc(4.3e12, 85.0))
    # a busy GPU's copy at 1.2 TB/s: every row against it reads high, one above 100%
    text = describe_run(doc(1.2e12, 104.0))
    assert "note: measured memory_bandwidth is 25% of h200-sxm's datasheet 4800.0 GB/s" in text
    assert "note: 1 row(s) ran faster than their floor (% floor over 100)" in text
