"""`run --repeat R`: a point's records pooled over passes. A later pass runs only what its
first pass timed, a later skip takes nothing back, a --deadline-s cut in any pass shows
on the record; the ranks' runs keep their share of the deadline."""

from __future__ import annotations

import pytest

from microbench.case import Variant
from microbench.pace import DEADLINE_NOTE, Pace
from microbench.passes import merge_pass
from microbench.planning import RunOptions, plan
from microbench.runner import Runner
from microbench.timing import TimingOptions

from .helpers import Scaled

FAST = TimingOptions(budget_s=0.03, max_noise=0.05)


def _rec(variant, n, **timing):
    return {"status": "OK", "variant": variant, "prep_s": 0.0,
            "timing": {"samples_s": [1e-3] * n, "elapsed_s": 0.1, "warmup_s": 0.0, "stop_reason": "budget",
                       "notes": [], **timing}}


def test_a_later_skip_keeps_what_was_pooled_and_a_later_cut_shows():
    old = [_rec("a", 10), _rec("b", 10)]
    merge_pass(old, [{"status": "SKIPPED", "variant": "a", "reason": "peer access lost"},
                     _rec("b", 3, budget_s=0.001, notes=[DEADLINE_NOTE])], 2)
    a, b = old
    assert a["status"] == "OK" and len(a["timing"]["samples_s"]) == 10
    assert a["timing"]["notes"] == ["pass 3 skipped: peer access lost"]
    assert b["timing"]["passes"] == [10, 3] and b["timing"]["budget_s"] == 0.001
    assert b["timing"]["notes"] == [DEADLINE_NOTE]
    merge_pass(old, [_rec("b", 5, budget_s=0.01, notes=[DEADLINE_NOTE])], 3)  # the least budget, one note
    assert b["timing"]["budget_s"] == 0.001 and b["timing"]["notes"] == [DEADLINE_NOTE]


def test_a_variant_not_ok_in_the_first_pass_is_not_run_again():
    """A variant that failed in pass 1 has no record to pool into: later passes leave it."""
    class Flaky(Scaled):
        def variants(self):
            self.flaky_calls = getattr(self, "flaky_calls", 0)

            def flaky(a, b, c):
                self.flaky_calls += 1
                if self.flaky_calls == 1:
                    raise RuntimeError("CUDA out of memory (first pass only)")
                c.copy_(a @ b)
            return [*super().variants()[:1], Variant("flaky", flaky, devices=("cpu",))]

    case = Flaky()
    opts = RunOptions(suite="smoke", device="cpu", timing=FAST, repeat=3, axis_picks={"n": ["32"]})
    recs = Runner(opts, None, progress=lambda _: None).run(plan([case], opts))
    by = {r["variant"]: r for r in recs}
    assert by["flaky"]["status"] == "FAILED" and case.flaky_calls == 1
    assert by["base"]["timing"]["passes"] and len(by["base"]["timing"]["passes"]) == 3


def test_runs_of_another_process_keep_their_share_of_the_deadline():
    now = [0.0]
    opts = RunOptions(suite="smoke", timing=TimingOptions(budget_s=10.0), deadline_at=12.0)
    alone = Pace(opts, [2, 2], clock=lambda: now[0])
    shared = Pace(opts, [2, 2], clock=lambda: now[0], after=2)
    assert alone.budget() == pytest.approx(3.0) and shared.budget() == pytest.approx(2.0)


def test_ranks_started_by_a_run_keep_its_deadline_their_launch_counted(monkeypatch):
    import time

    from microbench import cli

    a = cli.build_parser().parse_args(["run", "--device", "cpu", "--deadline-s", "100"])
    monkeypatch.setenv(cli.DEADLINE_EPOCH, repr(time.time() + 5.0))  # the run's deadline, 5 s from now
    left = cli.run_options(a, "smoke", "cpu", []).deadline_at - time.monotonic()
    assert 4.0 < left <= 5.0  # not the 100 s its --deadline-s would give from its own start
    monkeypatch.delenv(cli.DEADLINE_EPOCH)
    assert cli.run_options(a, "smoke", "cpu", []).deadline_at - time.monotonic() > 50
