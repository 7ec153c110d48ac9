"""``microbench tune``: search the launch configurations of tunable cases (see microbench.tune)."""

from __future__ import annotations

import argparse
import sys

from microbench.cli import EXIT_INTERRUPTED, UsageError, _axis_picks, _select_cases, _split, make_plan, resolve_device


def cmd_tune(a: argparse.Namespace) -> int:
    device = resolve_device(a.device)
    from microbench.cli import _set_threads
    from microbench.cli_paths import check_output_file

    _set_threads(device, a.threads)
    suite = a.suite or ("verify" if device.startswith("cuda") else "smoke")
    from microbench.case import Case

    cases = [c for c in _select_cases(_split(a.case), suite, device) if type(c).tune is not Case.tune]
    if not cases:
        raise UsageError(f"no tunable case selected in suite {suite} (cases with launch configurations: "
                         "moe.experts)")
    for c in cases:  # before the search: a table it cannot write, or a file it must not replace
        path = a.out or c.tuning_file(device)
        flag = "--out" if a.out else "tuning table"
        if path:
            check_output_file(path, flag, make_parents=True)
        try:
            c.load_tuning(device, a.out)
        except (ValueError, OSError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UsageError(f"{flag} {path}: cannot be updated, so it is not replaced ({why})") from None
    from tabulate import tabulate

    from microbench import env
    from microbench.report import fmt_time
    from microbench.planning import RunOptions
    from microbench.timing import TimingOptions
    from microbench.tune import distinct_items, tune

    if a.max_trials is not None and a.max_trials < 1:
        raise UsageError(f"--max-trials {a.max_trials}: must be >= 1")
    try:
        timing = TimingOptions(budget_s=a.budget_s, max_noise=0.01)
    except ValueError as e:
        raise UsageError(str(e)) from None
    # an axis no tunable case has is refused, as run refuses it: not a tune of the whole sweep
    p = make_plan(cases, RunOptions(suite=suite, device=device, axis_picks=_axis_picks(a.axis)), cases)
    if not p.items:
        raise UsageError(f"nothing to tune: every point of suite {suite} was skipped on {device}")
    items, shared = distinct_items(p.items)
    print(f"microbench tune: suite {suite} on {device}: {len(items)} points"
          + (f" ({shared} more share their table entries with one of them)" if shared else "")
          + (f", at most {a.max_trials} trials per search" if a.max_trials else ""), file=sys.stderr)
    try:
        rows, _, unsaved = tune(items, device, seed=a.seed, timing=timing, cache_bytes=env.l2_cache_bytes(device),
                                max_trials=a.max_trials, out=a.out)
    except KeyboardInterrupt:
        print("interrupted: the tuning tables keep each search's best so far", file=sys.stderr)
        return EXIT_INTERRUPTED
    for r in rows:
        r["median_s"] = fmt_time(r["median_s"]) if r.get("median_s") else "-"
    if rows:
        print(tabulate(rows, headers="keys", tablefmt="github" if a.format == "markdown" else "simple",
                       disable_numparse=True))
    if unsaved:
        print(f"microbench tune: no table holds the winners of {len(unsaved)} point(s) (writing it failed): "
              f"{'; '.join(unsaved)}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    t = sub.add_parser("tune", help="search launch configurations on this device; write its tuning table",
                       description="For each point of the suite (narrowed by --axis), try each tunable kernel's "
                       "configurations, gate each against the reference, time it, and keep the fastest correct "
                       "one in the device's table (cases/tuning/<device>.json), which `run` then uses. "
                       "Points missing from the table fall back to the nearest tuned token count (few-token: "
                       "with the same tile rows), then to the documented default.")
    t.add_argument("--suite", help="whose points (default: verify on a GPU, smoke on CPU)")
    t.add_argument("--case", action="append", help="case id(s) (default: every tunable case of the suite)")
    t.add_argument("--axis", action="append", metavar="NAME=V1,V2", help="narrow an axis of the sweep")
    t.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    t.add_argument("--budget-s", type=float, default=0.2, help="time budget per candidate (s, default 0.2)")
    t.add_argument("--max-trials", type=int, help="try at most this many configurations per search "
                   "(the default configuration first)")
    t.add_argument("--out", help="update the table in this file (read and written there) instead of the "
                   "device's own; a file that is not a tuning table of this device is refused")
    t.add_argument("--seed", type=int, default=0, help="input seed")
    t.add_argument("--threads", type=int, default=1, help="torch CPU threads when --device cpu (default 1)")
    t.add_argument("--format", choices=["text", "markdown"], default="text", help="table format")
    t.set_defaults(func=cmd_tune)
