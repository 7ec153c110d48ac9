"""``microbench`` command line: list, run (the other commands live in cli_*.py).

Bad input (an unknown suite, case, variant or axis value, a malformed or foreign result
file, a config missing keys) prints one line and exits 2, never a traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Sequence

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell tool killed by it returns

#: When this command began (``main``): --deadline-s counts from here, so the imports, the
#: device and process-group set-up and the fingerprint before the first point count too.
_started: float | None = None
#: Set for the ranks a ``run --nproc N --deadline-s S`` starts: the wall-clock time (epoch
#: seconds) its deadline falls at, so the ranks' launch and set-up count against it.
DEADLINE_EPOCH = "MICROBENCH_DEADLINE_EPOCH"


class UsageError(Exception):
    """Bad input from the user: one line, exit 2."""


def _err(msg: str) -> int:
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one line from rank 0, not one per rank
        print(f"microbench: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


# --------------------------------------------------------------------------- device


def resolve_device(spec: str, present: bool = True) -> str:
    """``auto`` -> cuda if present else cpu. On CPU the Triton interpreter is switched on
    here, before any kernel module is imported (Triton decides at decoration time). With
    ``present`` False (``run --plan``) a CUDA device is only named, not required."""
    import torch

    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if re.fullmatch(r"cuda(:\d+)?", spec):
        if not present:
            return spec
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: no CUDA device (torch {torch.__version__}, "
                             f"torch.cuda.is_available() is False)")
        idx = torch.device(spec).index
        if idx is not None and idx >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s)")
        if idx is not None:  # Triton launches on the current device, wherever its tensors are
            torch.cuda.set_device(idx)
    elif spec == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        raise UsageError(f"--device {spec!r}: use auto, cpu, cuda or cuda:N")
    return spec


# --------------------------------------------------------------------------- list


def check_suite(suite: str | None) -> None:
    """A suite name the user gave (None: the command's default) must be one of SUITES."""
    from microbench.cases import SUITES

    if suite is not None and suite not in SUITES:
        raise UsageError(f"unknown suite {suite!r} (suites: {', '.join(SUITES)})")


def _select_cases(case_ids: Sequence[str], suite: str | None, device: str):
    from microbench.cases import all_cases, get_case

    check_suite(suite)
    if case_ids:
        try:
            cases = [get_case(c) for c in case_ids]
        except KeyError as e:
            raise UsageError(e.args[0]) from None
        absent = [c for c in cases if suite is not None and not c.axes(suite, device)]
        if absent:
            from microbench.cases import SUITES

            theirs = [s for s in SUITES if absent[0].axes(s, device)]
            raise UsageError(f"case {absent[0].id} has no points in suite {suite} "
                             f"(its suites: {', '.join(theirs) or 'none'})")
        return cases
    return [c for c in all_cases() if suite is None or c.axes(suite, device)]


# --------------------------------------------------------------------------- run


def min_effect_arg(text: str) -> float:
    """``--min-effect``: a finite fraction >= 0 (0.02 = 2%)."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction >= 0, e.g. 0.02 for 2%")
    return v


def _split(values: Sequence[str] | None) -> list[str]:
    """Comma lists from repeatable options, flattened; a name given twice counts once."""
    return list(dict.fromkeys(x for v in values or [] for x in v.split(",") if x))


def _axis_picks(items: Sequence[str] | None) -> dict[str, list[str]]:
    picks: dict[str, list[str]] = {}
    for item in items or []:
        name, sep, vals = item.partition("=")
        if not sep or not name or not vals:
            raise UsageError(f"--axis {item!r}: expected name=v1,v2")
        picks.setdefault(name, []).extend(v for v in vals.split(",") if v)
    return picks


def _profile_ceilings(device: str) -> dict[str, dict]:
    if not device.startswith("cuda"):
        return {}
    import torch

    from microbench.hardware import profile_for_device_name

    prof = profile_for_device_name(torch.cuda.get_device_name(torch.device(device)))
    if prof is None:
        return {}
    return {
        "memory_bandwidth": {"value": prof.memory_bandwidth.value,
                             "source": f"profile {prof.name}: {prof.memory_bandwidth.source}"},
        "matmul_flops": {"value": prof.bf16_dense_flops.value,
                         "source": f"profile {prof.name}: {prof.bf16_dense_flops.source}"},
    }


def _set_threads(device: str, threads: int) -> None:
    if threads < 1:
        raise UsageError(f"--threads {threads}: need at least 1")
    if device == "cpu":
        # One intra-op thread: on a small shared machine a busy neighbour core stalls
        # OpenMP barriers (a 48x48 matmul took 15 ms with 2 threads under load, 25 µs with 1).
        import torch

        torch.set_num_threads(threads)


def run_selection(a: argparse.Namespace, device: str) -> tuple[str, list, list[str]]:
    """The suite, the cases and the variant filter of ``run`` (UsageError on bad names)."""
    suite = a.suite or ("verify" if device.startswith("cuda") else "smoke")
    cases = _select_cases(_split(a.case), suite, device)
    if not cases:
        raise UsageError(f"suite {suite} has no case on {device}")
    variants = _split(a.variant)
    known = {v.name for c in cases for v in c.variants()}
    unknown = [v for v in variants if v not in known]
    if unknown:
        raise UsageError(f"unknown variant {', '.join(unknown)} (variants: {', '.join(sorted(known))})")
    if variants:  # a case with none of the variants named has nothing to run: said, not counted
        none = [c.id for c in cases if not any(v.name in variants for v in c.variants())]
        if none:
            print(f"microbench: --variant {','.join(variants)}: not in {', '.join(none)}, whose points are not run",
                  file=sys.stderr)
        cases = [c for c in cases if c.id not in none]
    return suite, cases, variants


def run_timing(a: argparse.Namespace, device: str):
    """``run``'s TimingOptions (--mode, --budget-s, --max-noise) and its passes over the plan
    (--repeat; default 1 on CUDA, 3 on CPU), refused in one line where the device cannot
    take them (graph mode without CUDA)."""
    from microbench.timing import TimingOptions

    if a.repeat is not None and a.repeat < 1:
        raise UsageError(f"--repeat {a.repeat}: need at least 1 pass")
    try:
        timing = TimingOptions(mode=a.mode, budget_s=a.budget_s, max_noise=a.max_noise)
        timing.resolved_mode(device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return timing, a.repeat if a.repeat is not None else (1 if device.startswith("cuda") else 3)


def check_dist_timeout(a: argparse.Namespace) -> None:
    """``--dist-timeout`` a run and its plan both refuse: not a positive, finite time."""
    if not 0 < a.dist_timeout < float("inf"):
        raise UsageError(f"--dist-timeout {a.dist_timeout:g}: must be a positive number of seconds")


def default_nproc(a: argparse.Namespace, device: str) -> int:
    """Ranks of multi-rank cases: --nproc, else every GPU on CUDA, 2 gloo processes on CPU."""
    return a.nproc if a.nproc is not None else (_cuda_count() if device.startswith("cuda") else 2)


def run_options(a: argparse.Namespace, suite: str, device: str, variants: list[str], world: Any = None):
    from microbench import env
    from microbench.planning import RunOptions

    timing, repeat = run_timing(a, device)
    deadline = deadline_s(a)
    deadline_at = None if deadline is None else (_started or time.monotonic()) + deadline
    epoch = os.environ.get(DEADLINE_EPOCH)
    if deadline_at is not None and epoch:  # a rank of a run: the run's own deadline, its launch counted
        deadline_at = time.monotonic() + float(epoch) - time.time()
    return RunOptions(suite=suite, device=device, variants=variants, axis_picks=_axis_picks(a.axis), timing=timing,
                      interleave=a.interleave, seed=a.seed, min_effect=a.min_effect, probe=not a.no_probe,
                      cache_bytes=env.l2_cache_bytes(device), profile_ceilings=_profile_ceilings(device),
                      repeat=repeat, world=world, deadline_at=deadline_at)


def deadline_s(a: argparse.Namespace) -> float | None:
    """``--deadline-s`` (None where the command has none); a non-positive one is refused."""
    d = getattr(a, "deadline_s", None)
    if d is not None and not (d > 0 and math.isfinite(d)):
        raise UsageError(f"--deadline-s {d:g}: need a positive number of seconds")
    return d


def make_plan(cases, opts, all_cases):
    from microbench.planning import plan

    try:
        p = plan(cases, opts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    all_axes = {k for c in all_cases for k in c.axes(opts.suite, opts.device)}
    stray = [k for k in opts.axis_picks if k not in all_axes]
    if stray:
        raise UsageError(f"no selected case has axis {', '.join(stray)}")
    return p


def run_meta(a: argparse.Namespace, opts, cases) -> dict[str, Any]:
    from microbench.results import utc_now
    from microbench.targets import stored

    return {"id": None, "started_utc": utc_now(), "argv": sys.argv[1:], "suite": opts.suite,
            "cases": [c.id for c in cases], "device": opts.device, "seed": a.seed, "interleave": a.interleave,
            "timing": opts.timing.__dict__, "min_effect": a.min_effect,
            "cpu_threads": a.threads if opts.device == "cpu" else None, "repeat": opts.repeat,
            "deadline_s": getattr(a, "deadline_s", None), "targets": stored(cases)}


def open_writer(out: str, meta: dict[str, Any], fingerprint: dict[str, Any]):
    from microbench.results import ResultWriter

    writer = ResultWriter(out, meta, fingerprint)
    writer.doc["run"]["id"] = os.path.basename(writer.path)[: -len(".json")]
    return writer


def cmd_run(a: argparse.Namespace) -> int:
    from microbench import cli_out, distributed

    if distributed.launched():  # one rank of a torchrun launch (ours or the user's)
        from microbench.ranks import run_ranks

        return run_ranks(a)
    if a.plan:
        from microbench.cli_plan import show_plan

        return show_plan(a)
    device = resolve_device(a.device)
    _set_threads(device, a.threads)
    from microbench.cli_paths import check_output_dir

    check_output_dir(a.out, "--out")
    suite, cases, variants = run_selection(a, device)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    multi = [c for c in cases if c.distributed and (not variants or any(v.name in variants for v in c.variants()))]
    nproc = default_nproc(a, device)
    check_dist_timeout(a)
    if multi:
        try:
            distributed.check_backend(a.backend, kind)
            distributed.check_nproc(nproc, kind)
            if nproc > 1 and ":" in device:
                raise distributed.WorldError(f"--device {device} names one GPU; with --nproc {nproc} rank i "
                                             f"takes cuda:i (use --device cuda)")
        except distributed.WorldError as e:
            raise UsageError(str(e)) from None
    # --nproc 1: the multi-rank cases run here, last, on a world of one that the runner starts
    # just before their first point, with the result file open and every other case timed:
    # a hang or a fault in its device work (the communicator, a symmetric-memory probe) then
    # costs only their points. Until then the plan counts their variants at that world's size.
    solo = bool(multi) and nproc == 1
    here = [c for c in cases if not c.distributed or (solo and c in multi)]

    from microbench import env, report
    from microbench.runner import Runner

    opts = run_options(a, suite, device, variants)
    from microbench.cli_plan import duration_text
    from microbench.planning import planned_runs

    p = make_plan(here, opts, cases)
    ranks_runs = 0  # the ranks' variant runs after this process's, within the same --deadline-s
    if multi and nproc > 1:
        pm = make_plan(multi, opts, cases)  # bad axis values fail here, in one line, not on every rank
        with distributed.expecting(nproc):
            ranks_runs = planned_runs(pm, variants, device)[0] * opts.repeat

    with distributed.expecting(1 if solo else None):
        n_var, _ = planned_runs(p, variants, device)
    if p.n_points or not multi or nproc == 1:
        bound = n_var * opts.repeat * opts.timing.budget_s
        print(f"microbench run: suite {suite} on {device}: {len(p.items)} points ({n_var} variant runs)"
              + (f" x {opts.repeat} passes" if opts.repeat > 1 else "")
              + (f", {len(p.skipped)} skipped" if p.skipped else "") + f" from {len(here)} case(s)"
              + f", timing budget {duration_text(bound)} (a variant's slowest calls may pass it: 3 samples at least)"
              + (f" (budgets cut as needed to end by --deadline-s {a.deadline_s:g})" if a.deadline_s else "")
              + (f", then {len(multi)} multi-rank case(s) on {nproc} ranks" if multi and nproc > 1 else ""),
              file=sys.stderr)
    writer = open_writer(a.out, run_meta(a, opts, cases), env.fingerprint(device))
    world = None

    def start_world():  # the runner's, just before the first multi-rank point
        nonlocal world
        world = distributed.init_world(device, a.backend, a.dist_timeout)
        writer.doc["run"]["world"] = world.describe()
        return world

    runner = Runner(opts, writer, start_world=start_world if solo else None)
    rc = 0
    try:
        with distributed.expecting(1 if solo else None):
            runner.run(p, after_runs=ranks_runs)
        if multi and nproc > 1:
            from microbench.ranks import run_on_ranks

            rc = run_on_ranks(a, suite, kind, multi, nproc, opts, writer)
    except KeyboardInterrupt:
        return cli_out.close_interrupted(writer, a.format)
    except BaseException as e:  # a crash outside any case: the points finished so far stay on disk
        writer.close(complete=False, error=f"{type(e).__name__}: {e}")
        raise
    else:
        if rc:
            path = writer.close(complete=False, error=f"the {nproc}-rank run exited with status {rc}")
            print(report.render(writer.doc, a.format), end="")
            cli_out.results_line(path, "results (incomplete)")
            return 1
        path = writer.close(complete=True)
        print(report.render(writer.doc, a.format), end="")
        cli_out.print_targets("run", writer.doc, a.format, path or "RESULT")
        cli_out.results_line(path)
        return 0 if path else 1
    finally:  # the file closed first, whatever happened: leaving the world cannot cost it
        _leave(world)


def _leave(world: Any) -> None:
    """Leave the one-rank world, after the result file is closed; a process group that fails
    to close (an NCCL teardown fault) is a warning, the results being already kept."""
    if world is None:
        return
    try:
        world.close()
    except Exception as e:  # noqa: BLE001
        print(f"microbench run: warning: closing the process group failed ({type(e).__name__}: {e}); "
              f"the result file was closed before it, as it stands", file=sys.stderr)


def _cuda_count() -> int:
    import torch

    return max(1, torch.cuda.device_count())


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="microbench", description=(
        "Kernel-level microbenchmarks of the speculative-decoding verify step: correctness-gated, "
        "timed with their spread and environment, compared with verdicts."))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from microbench import cli_compile, cli_info, cli_model, cli_results, cli_try, cli_tune

    ls = sub.add_parser("list", help="suites, cases, variants and axes")
    ls.add_argument("--suite", help="only cases of this suite")
    ls.add_argument("--case", action="append", help="details of a case: variants, signature (repeatable)")
    ls.add_argument("--device", default="auto", help="whose shapes to show: cpu or cuda (default: cuda)")
    ls.set_defaults(func=cli_info.cmd_list)

    r = sub.add_parser("run", help="gate and time cases, print the table, write a result file")
    r.add_argument("--suite", help="smoke, verify or selftest (default: verify on a GPU, smoke on CPU)")
    r.add_argument("--case", action="append", help="case id(s), comma-separated or repeated (default: the suite's)")
    r.add_argument("--variant", action="append", help="only these variants")
    r.add_argument("--axis", action="append", metavar="NAME=V1,V2", help="narrow an axis of the sweep")
    r.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    r.add_argument("--out", default="results", help="directory for the result file (default: results/)")
    r.add_argument("--mode", choices=["cold", "hot", "graph"], help="timing mode (default: cold on CUDA, hot on CPU)")
    r.add_argument("--budget-s", type=float, default=1.0, help="time budget per variant and point (s)")
    r.add_argument("--deadline-s", type=float, metavar="S",
                   help="end the run's points within S seconds of the command's start (imports, device set-up "
                        "and the fingerprint count): before each point, what is left is "
                        "spread over the variant runs to come (less the median set-up a run has cost so far), cutting "
                        "their budgets below --budget-s as needed, so every point is still gated and timed (down "
                        "to 3 samples) rather than the last ones lost to a time limit; a cut record says so")
    r.add_argument("--max-noise", type=float, default=0.005, help="stop when the median's relative noise is under this")
    r.add_argument("--min-effect", type=min_effect_arg, default=0.02, help="smallest ratio change a verdict calls real")
    r.add_argument("--interleave", action="store_true", help="time variants alternately, in rounds whose order rotates (A B, B A, ...), for in-run A/B")
    r.add_argument("--repeat", type=int, help="passes over the whole plan, samples pooled per point, so each "
                   "spans the run and its wander is measured (default: 3 on CPU, 1 on CUDA)")
    r.add_argument("--seed", type=int, default=0, help="input seed (recorded)")
    r.add_argument("--no-probe", action="store_true", help="skip the environment probe beside each point")
    r.add_argument("--threads", type=int, default=1, help="torch CPU threads when --device cpu (default 1)")
    r.add_argument("--format", choices=["text", "markdown", "csv"], default="text", help="table format")
    r.add_argument("--plan", action="store_true", help="print what the run would do (points, variant runs, "
                   "skips with reasons, the timing budget per case) and exit; nothing is set up or timed, and "
                   "--device cuda plans without a GPU")
    r.add_argument("--nproc", type=int, help="ranks for multi-rank cases (comm.*): started with torchrun when "
                   "more than 1 (default: every GPU on CUDA, 2 gloo processes on CPU)")
    r.add_argument("--backend", help="torch.distributed backend of multi-rank cases: nccl or gloo "
                   "(default: nccl on CUDA, gloo on CPU)")
    r.add_argument("--dist-timeout", type=float, default=120.0, metavar="S",
                   help="seconds a rank waits for the others before every rank stops (default 120)")
    r.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)  # set for ranks we launch
    r.set_defaults(func=cmd_run)

    cli_tune.add_parser(sub)
    cli_info.add_parsers(sub)
    cli_results.add_parsers(sub)
    cli_model.add_parser(sub)
    cli_try.add_parser(sub)
    cli_compile.add_parser(sub)

    return p


def _terminated(signum: int, frame: Any) -> None:  # noqa: ARG001 - a signal handler's signature
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    global _started
    _started = time.monotonic()
    if not faulthandler.is_enabled():  # a kernel that crashes the process still names the Python frame it was in
        faulthandler.enable()
    args = build_parser().parse_args(argv)
    # SIGTERM (timeout, a job scheduler, torchrun stopping its ranks) ends a command as
    # Ctrl-C does: a run keeps its finished points in a file marked incomplete and prints them
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return rc
    except UsageError as e:
        return _err(str(e))
    except KeyboardInterrupt:  # outside a command's own handling (starting up, printing its table)
        print("microbench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader left (`| head`): it had what it wanted; no traceback,
        # and none at exit either, when Python flushes stdout into the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as e:  # config errors from model / hardware files are the user's input too
        from microbench.models import ConfigError

        if isinstance(e, ConfigError):
            return _err(str(e))
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
