"""``microbench tune``: search a case's launch configurations on this device and keep the
fastest correct one per point.

The split is the same as for ``run``.  The harness owns the sweep (a suite's points,
narrowed by ``--axis``), the :class:`Trial` that judges one candidate — the correctness
gate against the case's reference first (a configuration that computes a wrong answer is
never kept, however fast), then the one timing engine — the progress lines and the
table.  The case owns what is tunable: :meth:`microbench.case.Case.tune` proposes
candidates in its own search order, keeps the winners and says where its table lives.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from microbench.case import Case, Point, Workload, point_label
from microbench.gate import check_variant
from microbench.outcome import error_text
from microbench.report import fmt_time
from microbench.timing import TimingOptions, measure


@dataclass
class Trial:
    """Gate, then time, one candidate call of a case at one point."""

    case: Case
    point: Point
    device: str
    seed: int
    timing: TimingOptions
    cache_bytes: int | None = None
    max_trials: int | None = None  # per search (a case may run several searches per point)
    out: str | None = None  # the table updated (read and written); None: the device's own
    log: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr))
    count: int = 0
    rejected: int = 0

    def __call__(self, fn: Callable[..., Any], w: Workload, expected: Mapping[str, Any],
                 label: str = "") -> float | None:
        """The candidate's median seconds per call, or ``None`` when it is incorrect or fails."""
        self.count += 1
        try:
            gate = check_variant(fn, w.inputs, w.outputs, expected, **self.case.gate_tolerances(self.point),
                                 seed=self.seed)
            if not gate.passed:
                self.rejected += 1
                self.log(f"    {label}: incorrect: {gate.summary()}")
                return None
            m = measure(functools.partial(fn, **w.kwargs()), device=self.device, options=self.timing,
                        cache_bytes=self.cache_bytes)
        except Exception as e:  # noqa: BLE001 - a config that cannot compile, launch or be timed is not a winner
            self.rejected += 1
            self.log(f"    {label}: failed: {error_text(e)}")
            return None
        self.log(f"    {label}: {fmt_time(m.median_s)} ±{100 * m.summary.rel_noise:.2f}% n={m.summary.count}")
        return m.median_s

    def limit(self, candidates: Sequence[Any]) -> list[Any]:
        """The first ``max_trials`` candidates (all when unlimited): cases order their
        spaces from the most to the least promising."""
        return list(candidates if self.max_trials is None else candidates[: self.max_trials])


def distinct_items(items: Sequence[tuple[Case, Point]]) -> tuple[list[tuple[Case, Point]], int]:
    """The points to tune, the first of each case's :meth:`Case.tuning_key` (a later one
    would replace its winners with its own, searched the same way), and how many were
    left out for sharing a key."""
    seen: set[tuple[str, Any]] = set()
    kept = []
    for case, point in items:
        key = case.tuning_key(point)
        if key is not None:
            if (case.id, key) in seen:
                continue
            seen.add((case.id, key))
        kept.append((case, point))
    return kept, len(items) - len(kept)


def tune(items: Sequence[tuple[Case, Point]], device: str, *, seed: int = 0, timing: TimingOptions | None = None,
         cache_bytes: int | None = None, max_trials: int | None = None, out: str | None = None,
         log: Callable[[str], None] | None = None) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Tune every point (once per :meth:`Case.tuning_key`: :func:`distinct_items`); returns
    the winners' rows, the tables written (``out``: the one table updated, read and
    written, instead of each case's own) and the points whose winners could not be written
    (a full disk: the search goes on).

    Each case saves its table after every point (``Case.save_tuning``), and when anything
    stops the search (Ctrl-C, SIGTERM, an error) once more before that goes on: what the
    point being tuned has found is kept too (the case puts each search's best so far in
    its table as it is found). A table with nothing in it is not written.
    """
    log = log or (lambda s: print(s, file=sys.stderr))
    timing = timing or TimingOptions(budget_s=0.2, max_noise=0.01)
    rows: list[dict[str, Any]] = []
    written: list[str] = []
    unsaved: list[str] = []  # the points whose winners no table holds

    def saved(path: str | None) -> None:  # each table once, as "tuning table: PATH" (scripts read it)
        if path and path not in written:
            written.append(path)
            log(f"tuning table: {path}")

    items, shared = distinct_items(items)
    if shared:
        log(f"{shared} point(s) share their table entries with an earlier one (another routing or layout "
            "of the same shapes): each entry is tuned once")
    for i, (case, point) in enumerate(items, 1):
        log(f"[{i}/{len(items)}] {case.id} {point_label(point)}")
        trial = Trial(case, point, device, case.input_seed(seed, point), timing, cache_bytes, max_trials, out=out, log=log)
        t0 = time.perf_counter()
        try:
            found = case.tune(point, device, trial)
        except BaseException as e:
            why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"stopped by {type(e).__name__}"
            try:
                path = case.save_tuning(device, out)
            except Exception as save_error:  # noqa: BLE001 - the error that stopped the search is the one raised
                log(f"    {why} after {trial.count} trials; the table could not be written: {error_text(save_error)}")
                raise e from None
            log(f"    {why} after {trial.count} trials: " + (f"the winners found so far are in {path}" if path
                                                            else "nothing found yet, no table written"))
            saved(path)
            raise
        for r in found:
            rows.append({"case": case.id, **point, **r})
        try:
            saved(case.save_tuning(device, out))
        except OSError as e:  # a full disk: the search goes on, its winners are in the table printed
            unsaved.append(f"{case.id} {point_label(point)}")
            log(f"    the tuning table could not be written ({e.strerror or e}): this point's winners are only "
                "in the table printed at the end")
        log(f"    {trial.count} trials ({trial.rejected} rejected) in {time.perf_counter() - t0:.1f} s")
    return rows, written, unsaved
