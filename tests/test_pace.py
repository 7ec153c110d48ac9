"""--deadline-s: the pace of a run, and the timing budget of its points when it falls behind."""

from __future__ import annotations

import pytest

from microbench.planning import RunOptions
from microbench.timing import TimingOptions


def _timed_recs(*elapsed, interleaved=False):
    return [{"timing": {"elapsed_s": e, "interleaved": interleaved}} for e in elapsed]


def test_a_deadline_keeps_the_budget_while_the_run_keeps_pace_and_cuts_it_when_behind():
    from microbench.pace import MIN_DEADLINE_BUDGET_S, Pace

    now = [0.0]

    def point(end, *elapsed, interleaved=False):  # one point: its budget, then it ends at `end`
        b = pace.budget()
        now[0] = end
        pace.done(_timed_recs(*elapsed, interleaved=interleaved))
        return b

    # keeping pace: 100 s for 8 runs, 2 s sampling and 0.25 s of set-up per point
    opts = RunOptions(suite="smoke", timing=TimingOptions(budget_s=1.0), deadline_at=100.0)
    pace = Pace(opts, [2, 2, 2, 2], clock=lambda: now[0])
    assert point(2.5, 1.0, 1.0) == 1.0 and point(5.0, 1.0, 1.0) == 1.0 and pace.cut_points == 0
    # a little behind: 6 s for 6 runs, one 2 s interleaved loop shared by two variants
    # (counted once) and 0.1 s of set-up per run, then 1 s loops with 1.15 s of set-up per run
    opts = RunOptions(suite="smoke", timing=TimingOptions(budget_s=1.0), deadline_at=6.0)
    now[0] = 0.0
    pace = Pace(opts, [2, 2, 2], clock=lambda: now[0])
    assert point(2.2, 2.0, 2.0, interleaved=True) == 1.0
    assert point(5.5, 0.5, 0.5) == pytest.approx((6.0 - 2.2) / 4 - 0.1)  # cut, not to the floor
    # the last point: 0.5 s left for 2 runs, less the least set-up seen (two points: no median yet)
    assert pace.budget() == pytest.approx(0.5 / 2 - 0.1)
    now[0] = 7.0
    assert pace.summary() == ("deadline: 2 of 3 points timed on a cut budget (least 0.15 s of 1 s); "
                              "the points ended 1 s past the deadline")
    # one point's burst of compiles does not starve the points after it: the set-up a run
    # costs is the median over the points (0.1 s here), not the mean (6.7 s)
    opts = RunOptions(suite="smoke", timing=TimingOptions(budget_s=1.0), deadline_at=40.0)
    now[0] = 0.0
    pace = Pace(opts, [1] * 10, clock=lambda: now[0])
    for end in (20.0, 20.3, 20.6):
        point(end, 0.2)
    assert pace.budget() == 1.0  # 19.4 s left for 7 runs
    # ... while set-up that stays high does cut: three points of 5 s set-up each
    now[0] = 0.0
    pace = Pace(opts, [1] * 10, clock=lambda: now[0])
    for end in (5.2, 10.4, 15.6):
        point(end, 0.2)
    assert pace.budget() == MIN_DEADLINE_BUDGET_S  # 24.4 s left for 7 runs of 5 s set-up
    # no deadline: no budget is set
    assert Pace(RunOptions(suite="smoke"), [1]).budget() is None
