"""What a run will do, known before anything runs: its options, the expanded sweep of
points (:func:`plan`), and which variants run at each (:func:`variant_plan`); ``run
--plan`` prints it, the runner executes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from microbench.case import Case, Point, Variant, expand, narrow
from microbench.timing import TimingOptions


@dataclass
class RunOptions:
    suite: str
    device: str = "cpu"
    variants: Sequence[str] = ()  # empty = all
    axis_picks: Mapping[str, Sequence[str]] = field(default_factory=dict)
    timing: TimingOptions = field(default_factory=TimingOptions)
    interleave: bool = False
    seed: int = 0
    min_effect: float = 0.02
    probe: bool = True
    cache_bytes: int | None = None  # L2 (CUDA) / LLC (CPU) size for flushing
    repeat: int = 1  # passes over the whole plan; samples pooled per point
    profile_ceilings: Mapping[str, dict] = field(default_factory=dict)  # fallback ceilings
    world: Any = None  # a microbench.distributed.World: multi-rank cases run on it
    deadline_at: float | None = None  # time.monotonic() by which the run should end (--deadline-s)


@dataclass
class Plan:
    """The expanded sweep, known before anything runs (its size is printed first)."""

    items: list[tuple[Case, Point]]
    skipped: list[tuple[Case, Point, str]]

    @property
    def n_points(self) -> int:
        return len(self.items) + len(self.skipped)


def plan(cases: Sequence[Case], opts: RunOptions) -> Plan:
    """Expand every case's axes for the suite; raises ValueError on an unknown axis/value."""
    items, skipped = [], []
    for case in sorted(cases, key=lambda c: (c.order, c.id)):
        axes = case.axes(opts.suite, opts.device)
        picks = {k: v for k, v in opts.axis_picks.items() if k in axes}
        for point in expand(narrow(axes, picks, case.id, case.parse_axis_value)):
            reason = case.skip(point, opts.device)
            (skipped.append((case, point, reason)) if reason else items.append((case, point)))
    return Plan(items, skipped)


def variant_skip(case: Case, v: Variant, point: Point, device: str) -> str | None:
    """Why ``v`` does not run at ``point`` on ``device`` (None: it runs). The case's own
    reason first: it says why (e.g. "NCCL through CuPy needs CUDA devices")."""
    return case.skip_variant(v.name, point, device) or (None if v.runs_on(device) else
                                                        f"variant does not run on {device}")


def variant_plan(p: Plan, variants: Sequence[str], device: str):
    """Each (case, point, variant, why it does not run or None) of the plan's points, the
    variant filter (empty = all) applied."""
    for case, point in p.items:
        for v in case.variants():
            if not variants or v.name in variants:
                yield case, point, v, variant_skip(case, v, point, device)


def planned_runs(p: Plan, variants: Sequence[str], device: str) -> tuple[int, int]:
    """(variant runs the plan makes, variant runs it skips) over its points."""
    whys = [why for *_, why in variant_plan(p, variants, device)]
    return sum(w is None for w in whys), sum(w is not None for w in whys)


def runs_per_point(p: Plan, opts: RunOptions) -> list[int]:
    """Variant runs (gated and, when correct, timed) at each of the plan's points."""
    return [sum(variant_skip(case, v, point, opts.device) is None for v in case.variants()
                if not opts.variants or v.name in opts.variants) for case, point in p.items]
