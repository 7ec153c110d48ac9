"""``microbench try`` / ``microbench scaffold``: a kernel developer's own file, gated and
timed against a case's variants, and a starting file for it.

The loop: ``scaffold --case C my.py`` writes a correct, simple kernel with the case's
signature; ``try my.py::fn --case C`` checks it at the case's small odd shapes, then gates
and times it interleaved with the case's variants at the selected shapes, prints the table
with verdicts against the baseline and the best of the case's own variants, and writes a
result file; ``--watch`` repeats a short version whenever the file changes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

#: --watch: how often the file's mtime is polled, and the timing budget of each rerun
WATCH_POLL_S, WATCH_BUDGET_S = 0.5, 0.2


def _user_error(e: Exception) -> int:
    print(f"microbench try: {e}", file=sys.stderr)
    return 1


def _suite(case: Any, device: str) -> str:
    """The device's default suite, else the first suite the case is in (the self-test's)."""
    from microbench.cases import SUITES

    default = "verify" if device.startswith("cuda") else "smoke"
    return default if case.axes(default, device) else next((x for x in SUITES if case.axes(x, device)), default)


def _check_small(case: Any, variant: Any, device: str, seed: int) -> list[tuple[Any, str, bool]]:
    """The gate at the case's small odd shapes: (point, summary, passed) per point."""
    from microbench.case import expand, point_label
    from microbench.gate import check_variant
    from microbench.usercode import UserCodeError

    out = []
    for point in expand(case.check_axes(device)):
        if case.skip(point, device):
            continue
        s = case.input_seed(seed, point)
        w = case.setup(point, device, s)
        try:
            gate = check_variant(variant.fn, w.inputs, w.outputs, case.reference_for(w, variant), **case.gate_tolerances(point),
                                 seed=s)
            out.append((point, f"{point_label(point)} seed {s}: {gate.summary()}", gate.passed))
        except UserCodeError as e:
            out.append((point, f"{point_label(point)} seed {s}: {e}", False))
    return out


def _vs_best(case: Any, name: str, records: list[dict[str, Any]], min_effect: float) -> None:
    """Add 'vs best' (the user's variant against the fastest of the case's own, paired)."""
    from microbench import verdicts
    from microbench.results import record_key

    by_point: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        by_point.setdefault(record_key({**r, "variant": ""}), []).append(r)
    for recs in by_point.values():
        mine = next((r for r in recs if r["variant"] == name and r["status"] == "OK"), None)
        own = [r for r in recs if r["variant"] != name and r["status"] == "OK" and r.get("timing")]
        if mine is None or not own:
            continue
        best = min(own, key=lambda r: r["timing"]["summary"]["median"])
        v = verdicts.within_run(best["timing"], mine["timing"], interleaved=True, min_effect=min_effect)
        mine.setdefault("derived", {})["vs best"] = f"×{v.ratio:.3f} {v.label} vs {best['variant']}"


def cmd_try(a: argparse.Namespace) -> int:
    from microbench import cli, cli_out, env, report
    from microbench.cli_paths import check_output_dir
    from microbench.cases import get_case
    from microbench.case import expand
    from microbench.usercode import NameTaken, UserCodeError, WithVariant, load_variant, parse_target

    device = cli.resolve_device(a.device)
    cli._set_threads(device, a.threads)
    cli.check_suite(a.suite)
    watch_budget_s = WATCH_BUDGET_S if a.budget_s is None else a.budget_s
    a.budget_s = 1.0 if a.budget_s is None else a.budget_s
    cli.run_timing(a, device)  # --mode, --budget-s, --repeat refused before anything runs
    check_output_dir(a.out, "--out")
    try:
        case = get_case(a.case)
    except KeyError as e:
        raise cli.UsageError(e.args[0]) from None
    if a.suite and not case.axes(a.suite, device):
        raise cli.UsageError(f"case {case.id} has no points in suite {a.suite}")
    try:
        parse_target(a.target)  # the command line's own mistakes: exit 2, as for any bad argument
    except UserCodeError as e:
        raise cli.UsageError(str(e)) from None
    small = [p for p in expand(case.check_axes(device)) if not case.skip(p, device)]
    if not small:
        raise cli.UsageError(f"case {case.id} has no small shapes on {device} to check a variant at")
    world = None
    if case.distributed:  # one rank, in process: the path's fixed cost
        from microbench.distributed import solo_world

        world = solo_world(device)
    try:
        variant = load_variant(a.target, case, small[0], device, a.name)
        tried = WithVariant(case, variant)
    except NameTaken as e:
        raise cli.UsageError(str(e)) from None
    except UserCodeError as e:
        return _user_error(e)
    if a.watch:
        return _watch(a, case, device, world, watch_budget_s)
    checks = _check_small(case, variant, device, a.seed)
    for _, text, ok in checks:
        print(f"check {'ok ' if ok else 'BAD'} {text}", file=sys.stderr)
    if not all(ok for _, _, ok in checks):
        print(f"microbench try: {variant.name} is incorrect at the small shapes above: not timed", file=sys.stderr)
        return 1
    a.interleave = True  # always: the verdicts against the case's variants are paired
    suite = a.suite or _suite(case, device)
    opts = cli.run_options(a, suite, device, [], world)
    p = cli.make_plan([tried], opts, [tried])
    from microbench.runner import Runner

    writer = cli.open_writer(a.out, {**cli.run_meta(a, opts, [tried]), "tried": f"{a.target} as {variant.name}"},
                             env.fingerprint(device))
    print(f"microbench try: {variant.name} on {case.id}, suite {suite} on {device}: {len(p.items)} points, "
          "interleaved with the case's variants", file=sys.stderr)
    try:
        records = Runner(opts, writer).run(p)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the points finished so far, as `run` keeps them
        return cli_out.close_interrupted(writer, a.format)
    except BaseException as e:  # a crash outside any point: what was finished stays on disk
        writer.close(complete=False, error=f"{type(e).__name__}: {e}")
        raise
    _vs_best(case, variant.name, records, a.min_effect)
    path = writer.close(complete=True)
    print(report.render(writer.doc, a.format), end="")
    cli_out.print_targets("try", writer.doc, a.format, path or "RESULT", also=variant.name)
    cli_out.results_line(path)
    mine = [r for r in records if r["variant"] == variant.name]
    return 0 if path and mine and all(r["status"] in ("OK", "SKIPPED") for r in mine) else 1


def _watch(a: argparse.Namespace, case: Any, device: str, world: Any, budget_s: float) -> int:
    """Rerun the small-shape gate and a short interleaved timing (``budget_s`` per variant,
    at the first point --axis leaves) on every save."""
    from microbench import cli
    from microbench.case import expand, point_label
    from microbench.planning import RunOptions
    from microbench.runner import Runner
    from microbench.timing import TimingOptions
    from microbench.usercode import UserCodeError, load_variant, parse_target, WithVariant

    path, _ = parse_target(a.target)
    suite = a.suite or _suite(case, device)
    picks = cli._axis_picks(a.axis)
    cli.make_plan([case], RunOptions(suite=suite, device=device, axis_picks=picks), [case])  # a bad --axis: now
    seen = None
    print(f"microbench try --watch: {path} (Ctrl-C to stop)", file=sys.stderr)
    try:
        while True:
            try:
                mtime = os.stat(path).st_mtime_ns
            except FileNotFoundError:  # an editor that saves by replacing the file: back in a moment
                mtime = seen
            if mtime == seen:
                time.sleep(WATCH_POLL_S)
                continue
            seen = mtime
            stamp = time.strftime("%H:%M:%S")
            try:
                small = [p for p in expand(case.check_axes(device)) if not case.skip(p, device)]
                variant = load_variant(a.target, case, small[0], device, a.name)
            except UserCodeError as e:
                print(f"{stamp} ERROR {e}", flush=True)
                continue
            bad = [t for _, t, ok in _check_small(case, variant, device, a.seed) if not ok]
            if bad:
                print(f"{stamp} INCORRECT {bad[0]}", flush=True)
                continue
            tried = WithVariant(case, variant)
            opts = RunOptions(suite=suite, device=device, variants=[case.baseline, variant.name], interleave=True,
                              timing=TimingOptions(budget_s=budget_s), probe=False, world=world,
                              axis_picks=picks)
            points = [pt for _, pt in cli.make_plan([tried], opts, [tried]).items]
            if not points:
                print(f"{stamp} correct (suite {suite} has no point to time)", flush=True)
                continue
            recs = Runner(opts, None, progress=lambda line: None).run_point(tried, points[0])
            mine = next(r for r in recs if r["variant"] == variant.name)
            if mine["status"] != "OK":
                print(f"{stamp} {mine['status']} at {point_label(points[0])}: {mine['reason']}", flush=True)
                continue
            from microbench.report import fmt_time

            vb = mine.get("vs_baseline") or {}
            ratio = f" ×{vb['ratio']:.3f} vs {case.baseline} {vb.get('label', '')}" if vb else ""
            print(f"{stamp} correct {fmt_time(mine['timing']['summary']['median'])} at {point_label(points[0])}"
                  f"{ratio}", flush=True)
    except KeyboardInterrupt:
        return 0


def cmd_scaffold(a: argparse.Namespace) -> int:
    from microbench import cli
    from microbench.cli_paths import check_output_file
    from microbench.cases import get_case

    try:
        case = get_case(a.case)
    except KeyError as e:
        raise cli.UsageError(e.args[0]) from None
    text = case.scaffold()
    if text is None:
        raise cli.UsageError(f"case {case.id} has no scaffold yet (cases with one: "
                             + ", ".join(c.id for c in _scaffolded()) + ")")
    path = a.path or f"my_{case.id.replace('.', '_')}.py"
    check_output_file(path, "scaffold")
    if os.path.exists(path) and not a.force:
        raise cli.UsageError(f"{path} exists: pass --force to overwrite it")
    with open(path, "w") as f:
        f.write(text)
    fn = scaffold_function(text)
    print(f"wrote {path}: try it with\n  microbench try {path}::{fn} --case {case.id}")
    return 0


def scaffold_function(text: str) -> str:
    """The public function of a scaffold: its one top-level ``def`` without a leading ``_``."""
    names = [line[4:].split("(")[0] for line in text.splitlines() if line.startswith("def ")]
    return next(n for n in names if not n.startswith("_"))


def _scaffolded() -> list:
    from microbench.cases import all_cases

    return [c for c in all_cases() if c.scaffold() is not None]


def add_parser(sub) -> None:
    from microbench.cli import min_effect_arg

    t = sub.add_parser("try", help="gate and time your own function as a variant of a case",
                       description="Load FUNCTION from FILE (any path) as a variant of CASE; check its signature "
                       "and its results at the case's small odd shapes, then gate and time it interleaved with "
                       "the case's variants; print the table with verdicts against the baseline and the case's "
                       "best variant; write a result file.")
    t.add_argument("target", metavar="FILE::FUNCTION")
    t.add_argument("--case", required=True, help="the case whose variant it is (microbench list --case shows "
                   "the signature)")
    t.add_argument("--name", help="the variant's name in tables (default: the function's)")
    t.add_argument("--suite", help="whose shapes to time (default: verify on a GPU, smoke on CPU)")
    t.add_argument("--axis", action="append", metavar="NAME=V1,V2", help="narrow an axis of the sweep")
    t.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    t.add_argument("--out", default="results", help="directory for the result file (default: results/)")
    t.add_argument("--budget-s", type=float, help="time budget per variant and point (s; default 1, with "
                   f"--watch {WATCH_BUDGET_S:g})")
    t.add_argument("--max-noise", type=float, default=0.005, help="stop when the median's relative noise is under this")
    t.add_argument("--min-effect", type=min_effect_arg, default=0.02, help="smallest ratio change a verdict calls real")
    t.add_argument("--mode", choices=["cold", "hot", "graph"], help="timing mode (default: cold on CUDA, hot on CPU)")
    t.add_argument("--repeat", type=int, default=1, help="passes over the sweep (default 1)")
    t.add_argument("--seed", type=int, default=0, help="input seed")
    t.add_argument("--no-probe", action="store_true", help="skip the environment probe beside each point")
    t.add_argument("--threads", type=int, default=1, help="torch CPU threads when --device cpu (default 1)")
    t.add_argument("--format", choices=["text", "markdown", "csv"], default="text", help="table format")
    t.add_argument("--watch", action="store_true", help="rerun the check and a short timing on every save")
    t.set_defaults(func=cmd_try)

    sc = sub.add_parser("scaffold", help="write a starting file for `microbench try`: a simple, correct kernel")
    sc.add_argument("--case", required=True)
    sc.add_argument("path", nargs="?", help="where to write it (default: my_<case>.py)")
    sc.add_argument("--force", action="store_true", help="overwrite an existing file")
    sc.set_defaults(func=cmd_scaffold)
