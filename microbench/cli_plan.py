"""``microbench run --plan``: what a run would do, case by case, with nothing set up,
gated or timed — on any host: ``--device cuda`` plans a GPU run without a GPU, so a
command meant for a GPU host (a CI job, ``scripts/gpu-check``) is checked, and sized
against its time limit, before it gets one."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from microbench.cli import (UsageError, _axis_picks, check_dist_timeout, deadline_s, default_nproc, make_plan,
                            resolve_device,
                            run_selection, run_timing)


def plan_rows(a: argparse.Namespace) -> tuple[str, str, list[dict[str, Any]], dict[str, Any]]:
    """(suite, device, one row per case, run settings) for ``microbench run ARGS --plan``."""
    from microbench.planning import RunOptions, variant_plan

    device = resolve_device(a.device, present=False)
    suite, cases, variants = run_selection(a, device)
    nproc = default_nproc(a, device)
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: need at least 1")
    if any(c.distributed for c in cases):  # what a real run would refuse, refused here too
        from microbench import distributed

        try:
            distributed.check_backend(a.backend, "cuda" if device.startswith("cuda") else "cpu")
        except distributed.WorldError as e:
            raise UsageError(str(e)) from None
    check_dist_timeout(a)
    timing, repeat = run_timing(a, device)
    opts = RunOptions(suite=suite, device=device, variants=variants, axis_picks=_axis_picks(a.axis), timing=timing,
                      interleave=a.interleave, repeat=repeat)
    p = make_plan(cases, opts, cases)
    rows: dict[str, dict[str, Any]] = {}
    for case in sorted(cases, key=lambda c: (c.order, c.id)):
        rows[case.id] = {"case": case.id, "points": 0, "runs": 0, "not_run": 0, "skipped": 0,
                         "ranks": nproc if case.distributed else 1, "budget_s": 0.0, "reasons": {}}
    for case, _ in p.items:
        rows[case.id]["points"] += 1
    from microbench import distributed

    with distributed.expecting(nproc):  # the multi-rank cases' skips that hang on the world's size
        planned = list(variant_plan(p, variants, device))
    for case, _, _, why in planned:
        row = rows[case.id]
        if why:
            row["not_run"] += 1
            row["reasons"][why] = row["reasons"].get(why, 0) + 1
        else:
            row["runs"] += 1
    for case, _, reason in p.skipped:
        row = rows[case.id]
        row["skipped"] += 1
        row["reasons"][reason] = row["reasons"].get(reason, 0) + 1
    for row in rows.values():
        row["budget_s"] = row["runs"] * timing.budget_s * repeat
    settings = {"budget_s": timing.budget_s, "max_noise": timing.max_noise, "repeat": repeat,
                "deadline_s": deadline_s(a)}
    return suite, device, list(rows.values()), settings


def duration_text(s: float) -> str:
    if s < 10:
        return f"{s:.1f} s"
    return f"{s:.0f} s" if s < 600 else f"{s / 60:.1f} min"


def render_plan(suite: str, device: str, rows: list[dict[str, Any]], settings: dict[str, Any], fmt: str) -> str:
    from microbench.report import render_table

    if fmt == "csv":
        return render_table([[r["case"], r["points"], r["runs"], r["not_run"], r["skipped"], r["ranks"],
                              r["budget_s"]] for r in rows],
                            ["case", "points", "variant_runs", "variants_not_run", "skipped_points", "ranks",
                             "budget_s"], fmt)
    head = ["case", "points", "variant runs", "variants not run", "skipped points", "ranks", "timing budget"]
    body = [[r["case"], r["points"], r["runs"], r["not_run"], r["skipped"], r["ranks"],
             duration_text(r["budget_s"])] for r in rows]
    total = sum(r["budget_s"] for r in rows)
    body.append(["total", sum(r["points"] for r in rows), sum(r["runs"] for r in rows),
                 sum(r["not_run"] for r in rows), sum(r["skipped"] for r in rows), "", duration_text(total)])
    md = fmt == "markdown"
    lines = [("**" if md else "") + f"Plan: suite {suite} on {device}, nothing run" + ("**" if md else ""), "",
             render_table(body, head, fmt).rstrip("\n"), ""]
    passes = f"{settings['repeat']} pass{'es' if settings['repeat'] > 1 else ''}"
    note = (f"The timing budget: {settings['budget_s']:g} s per variant run and pass ({passes}); a variant "
            f"stops sooner once its median's noise is under {settings['max_noise']:.1%}, and later where 3 of its "
            "calls (the fewest a median takes) outlast the budget. "
            "Set-up, the correctness gate, warm-up and first-call compiles come on top. Reasons that "
            "depend on this host (a library it lacks) may not hold where the run is meant to go."
            + (f" With --deadline-s {settings['deadline_s']:g}, budgets are cut as the run goes so that its "
               "points end by then, every one still gated and timed." if settings.get("deadline_s") else ""))
    lines.append(note if md else textwrap.fill(note, 100))
    notes = [(r["case"], why, n) for r in rows for why, n in r["reasons"].items()]
    if notes:
        lines += ["", "Not run:" if not md else "Not run:  "]
        lines += [f"{'- ' if md else '  '}{case}: {n} x {why}" for case, why, n in notes]
    return "\n".join(lines) + "\n"


def show_plan(a: argparse.Namespace) -> int:
    suite, device, rows, settings = plan_rows(a)
    print(render_plan(suite, device, rows, settings, a.format), end="")
    return 0
