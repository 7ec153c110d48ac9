"""Pacing a run to a deadline (``microbench run --deadline-s``): what is left of it is
spread over the variant runs still to come, cutting their timing budgets where the run
has fallen behind, so every point is still gated and timed instead of the last ones being
lost to an outer time limit."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

#: The note a record carries when --deadline-s cut its timing budget (the budget it got is
#: its timing's ``budget_s``); one text, so a table's footnotes name it once.
DEADLINE_NOTE = "timing budget cut to end the run by its --deadline-s (this record's budget: timing.budget_s)"

#: The least budget a deadline leaves a variant: the stopping rule's 3-sample floor then ends it.
MIN_DEADLINE_BUDGET_S = 1e-3


class Pace:
    """Spreads what is left of a run's deadline over the variant runs still to come.

    Before each point: budget = time left / runs left - the set-up a run costs, at most the
    run's own budget and at least :data:`MIN_DEADLINE_BUDGET_S`. The set-up is everything
    but the sampling loop (inputs, reference, gate, compiles, warm-up, probe), taken as the
    median over the points so far of each point's set-up per run (the least while there are
    fewer than 3), so one point's burst of first-call compiles does not starve the points
    after it. A run that keeps pace keeps its budget; one that falls behind cuts its later
    points' budgets, since each point's share is taken from the time actually left, and
    every point is still reached, gated and timed (with fewer samples) instead of the last
    ones being lost to a time limit. ``budget()`` is None when the run has no deadline.
    """

    def __init__(self, opts: Any, runs: Sequence[int], clock: Callable[[], float] = time.monotonic,
                 after: int = 0):
        """``opts``: the run's RunOptions (its ``deadline_at`` and ``timing.budget_s``);
        ``runs``: the variant runs at each point, in the order they will run (a later pass's
        count may be lowered once the first pass says which variants it runs); ``after``:
        variant runs made after these by another process (a run's ranks), within the same
        deadline, whose share these leave them."""
        self.opts, self.runs, self.clock, self.after = opts, list(runs), clock, after
        self.mark = clock()  # when the current point began
        self.i = 0
        self.setup_per_run: list[float] = []  # per point: its wall time less its sampling, per run
        self.cut_points = 0
        self.least: float | None = None

    def budget(self) -> float | None:
        if self.opts.deadline_at is None:
            return None
        self.mark = now = self.clock()
        left_runs = sum(self.runs[self.i:]) + self.after
        if not left_runs:
            return self.opts.timing.budget_s
        seen = self.setup_per_run  # under 3 points a median is one outlier: the least, until more come
        overhead = statistics.median(seen) if len(seen) >= 3 else min(seen, default=0.0)
        b = (self.opts.deadline_at - now) / left_runs - overhead
        b = min(self.opts.timing.budget_s, max(MIN_DEADLINE_BUDGET_S, b))
        if b < self.opts.timing.budget_s:
            self.cut_points += 1
            self.least = b if self.least is None else min(self.least, b)
        return b

    def done(self, recs: Sequence[dict[str, Any]]) -> None:
        timed = [r["timing"] for r in recs if r.get("timing")]
        loops = [t["elapsed_s"] for t in timed]  # interleaved variants share one loop: counted once
        sampling = (max(loops) if any(t.get("interleaved") for t in timed) else sum(loops)) if loops else 0.0
        runs = self.runs[self.i] if self.i < len(self.runs) else 0
        if runs:
            self.setup_per_run.append(max(0.0, self.clock() - self.mark - sampling) / runs)
        self.i += 1

    def summary(self) -> str:
        over = self.clock() - self.opts.deadline_at if self.opts.deadline_at is not None else 0.0
        return (f"deadline: {self.cut_points} of {len(self.runs)} points timed on a cut budget (least "
                f"{self.least:.3g} s of {self.opts.timing.budget_s:g} s); the points ended "
                + (f"{over:.0f} s past the deadline" if over > 0 else f"{-over:.0f} s before the deadline"))
