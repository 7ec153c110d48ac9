"""``microbench compile``: build every Triton kernel a suite launches for a target GPU, on
any host (see microbench.aot), and print what each build takes on one SM of it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from microbench.children import end_with_parent
from microbench.cli import EXIT_INTERRUPTED, UsageError, _axis_picks, _split
from microbench.report import render_table

EXIT_PROBLEMS = 1


def _configs(builds: list[Any]) -> dict[str, str]:
    """Per build, what tells it from the other builds of its kernel: the constexprs whose
    values differ among them (the rest is the kernel's fixed shape and would only repeat),
    then the integer arguments specialised as multiples of 16 that not all of them share."""
    by_kernel: dict[str, list[Any]] = {}
    for b in builds:
        by_kernel.setdefault(b.kernel, []).append(b)
    out = {}
    for group in by_kernel.values():
        keys = sorted({k for b in group for k in b.config if k != "%16"})
        varying = [k for k in keys if len({repr(b.config.get(k)) for b in group}) > 1]
        div = [set(str(b.config.get("%16", "")).split(",")) - {""} for b in group]
        common = set.intersection(*div) if div else set()
        for b, d in zip(group, div):
            parts = [f"{k}={b.config[k]}" for k in varying if b.config.get(k) is not None]
            extra = sorted(d - common)
            if extra:
                parts.append("%16:" + ",".join(extra))
            out[b.hash] = " ".join(parts) or "-"
    return out


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def table(builds: list[Any], sm: Any, fmt: str) -> str:
    from microbench.aot import occupancy, problems

    configs = _configs(builds)
    rows = []
    for b in sorted(builds, key=lambda b: (b.kernel, configs[b.hash], b.num_warps, b.num_stages)):
        spill = "?" if b.spill_stores is None else ("0" if not b.spill_stores and not b.spill_loads
                                                    else f"{b.spill_stores}/{b.spill_loads}")
        bad = problems(b, sm)
        rows.append([b.kernel, configs[b.hash], b.num_warps, b.num_stages, b.registers if b.registers else "?",
                     spill, _kib(b.shared), occupancy(b, sm), "NO: " + "; ".join(bad) if bad else "yes",
                     ", ".join(f"{u} ({n})" for u, n in sorted(b.uses.items()))])
    head = ["kernel", "config", "warps", "stages", "regs", "spill st/ld B", "smem KiB", "blocks/SM", "fits",
            "used by (points)"]
    return render_table(rows, head, fmt)


def _load_baseline(path: str, arch: int) -> dict[str, Any]:
    """A previous ``--json`` report, for the same target (UsageError otherwise)."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as e:
        raise UsageError(f"--baseline {path}: cannot read it ({e})") from None
    if (not isinstance(doc, dict) or doc.get("schema") != "microbench.compile"
            or not isinstance(doc.get("builds"), list)):
        raise UsageError(f"--baseline {path}: not a microbench compile report (write one with --json)")
    if doc.get("version") != 1:
        raise UsageError(f"--baseline {path}: report version {doc.get('version')!r}, this microbench reads 1")
    if doc.get("arch") != arch:
        raise UsageError(f"--baseline {path}: built for sm_{doc.get('arch')}, not sm_{arch}")
    return doc


def _key(b: dict[str, Any]) -> tuple:
    return (b["kernel"], b["signature"], b["num_warps"], b["num_stages"], json.dumps(b["config"], sort_keys=True))


_COMPARED = (("registers", "regs"), ("spill_stores", "spill st B"), ("shared_bytes", "smem B"),
             ("blocks_per_sm", "blocks/SM"))


def diff(old: list[dict[str, Any]], new: list[dict[str, Any]], fmt: str) -> tuple[str, dict[str, int]]:
    """What changed between two reports' builds, matched by kernel, signature, warps,
    stages and full config: changed resources (old -> new), builds only in the new report
    (``+``) and only in the old one (``-``); and the counts."""
    before, after = {_key(b): b for b in old}, {_key(b): b for b in new}
    rows = []
    counts = {"changed": 0, "added": 0, "removed": 0, "same": 0}
    configs = _configs([_Shim(b) for b in [*old, *new]])
    for k in sorted(set(before) | set(after)):
        o, n = before.get(k), after.get(k)
        if o and n:
            moved = [(f, o.get(f), n.get(f)) for f, _ in _COMPARED if o.get(f) != n.get(f)]
            if not moved:
                counts["same"] += 1
                continue
            counts["changed"] += 1
            rows.append(["~", n["kernel"], configs[id(n)],
                         *[f"{o.get(f)} -> {n.get(f)}" if o.get(f) != n.get(f) else n.get(f) for f, _ in _COMPARED]])
        else:
            b = n or o
            counts["added" if n else "removed"] += 1
            rows.append(["+" if n else "-", b["kernel"], configs[id(b)], *[b.get(f) for f, _ in _COMPARED]])
    head = ["", "kernel", "config", *[h for _, h in _COMPARED]]
    return (render_table(rows, head, fmt) if rows else ""), counts


class _Shim:
    """A report's build as :func:`_configs` reads it (kernel, config, hash)."""

    def __init__(self, b: dict[str, Any]):
        self.kernel, self.config, self.hash = b["kernel"], b["config"], id(b)


def _selection(a: argparse.Namespace) -> tuple[list[Any], dict[str, list[str]], list[str], Any]:
    """The cases, axis picks, variants and target profile the arguments name (UsageError
    for anything they name that does not exist); the same in every worker process."""
    from microbench.aot import case_points
    from microbench.cases import SUITES
    from microbench.cli import _select_cases

    if a.suite not in SUITES:
        raise UsageError(f"unknown suite {a.suite!r} (suites: {', '.join(SUITES)})")
    profile = _target(a.target)
    if profile.sm is None:
        raise UsageError(f"--target {a.target}: profile {profile.name} has no 'sm' block (one SM's limits), "
                         "so a build cannot be checked against it")
    cases = _select_cases(_split(a.case), None if a.case else a.suite, "cuda")
    cases = [c for c in cases if not c.distributed and c.launches_triton]
    if not cases:
        raise UsageError("no selected case launches Triton kernels")
    outside = [c.id for c in cases if not c.axes(a.suite, "cuda")]
    if outside:
        raise UsageError(f"case {', '.join(outside)} has no shapes in suite {a.suite}")
    picks = _axis_picks(a.axis)
    known_axes = {k for c in cases for k in c.axes(a.suite, "cuda")}
    stray = [k for k in picks if k not in known_axes]
    if stray:
        raise UsageError(f"no selected case has axis {', '.join(stray)} in suite {a.suite}")
    try:  # a value an axis lacks is refused here, before any build
        for c in cases:
            case_points(c, a.suite, picks)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if a.file:
        cases = _with_user_variant(a, cases)
    variants = _split(a.variant)
    if variants:
        known = {v.name for c in cases for v in c.variants()}
        unknown = [v for v in variants if v not in known]
        if unknown:
            raise UsageError(f"unknown variant {', '.join(unknown)} (variants: {', '.join(sorted(known))})")
    return cases, picks, variants, profile


def _target(name: str) -> Any:
    """``--target``: a profile by name or path; ``auto``, the shipped profile of the GPU
    torch sees (a GPU host warming its own cache)."""
    from microbench import hardware

    if name != "auto":
        return hardware.load_profile(name)
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--target auto: no CUDA device is visible here; name a profile (e.g. h200)")
    gpu = torch.cuda.get_device_name()
    profile = hardware.profile_for_device_name(gpu)
    if profile is None:
        raise UsageError(f"--target auto: no shipped profile matches {gpu}; name one, or a profile JSON")
    return profile


def _cache_dir() -> str:
    """Triton's own cache directory (TRITON_CACHE_DIR, else ~/.triton/cache)."""
    from triton import knobs

    return knobs.cache.dir


def build_share(a: argparse.Namespace, started: float, tag: str = "") -> tuple[list[Any], list[Any], int]:
    """Build the selection's points: the builds, the failures and the number of calls. In
    the command's own process, every point; in one of ``--jobs`` worker processes (spawned:
    the parent's Triton state stays its own), each next point no worker has taken yet."""
    from microbench import case as case_mod
    from microbench.aot import AotError, check_not_interpreted, compile_cases, compile_only

    os.environ.pop("TRITON_INTERPRET", None)
    cases, picks, variants, profile = _selection(a)

    def progress(text: str) -> None:
        print(f"[{time.time() - started:6.1f}s{tag}] {text}", file=sys.stderr, flush=True)

    case_mod.COMPILE_TARGET = profile
    try:
        from microbench.kernels import launch

        check_not_interpreted(launch._empty_kernel)
        with compile_only(profile.sm, cache_dir=_cache_dir() if a.into_cache else _SHARED_DIR,
                          sm_count=int(profile.sm_count.value)) as session:
            calls = compile_cases(cases, a.suite, picks, session, seed=a.seed, variants=variants,
                                  progress=progress, take=_Claims() if _NEXT is not None else None)
    except AotError as e:
        raise UsageError(str(e)) from None
    finally:
        case_mod.COMPILE_TARGET = None
    return list(session.builds.values()), session.failures, calls


#: In a ``--jobs`` worker: the index of the next point no worker has taken, and the cache
#: directory the workers share (a build one made is not made again by another; without
#: --into-cache, a private one), both shared by all of them.
_NEXT: Any = None
_SHARED_DIR: str | None = None


def _init_worker(counter: Any, cache_dir: str, threads: int, parent: int) -> None:
    global _NEXT, _SHARED_DIR
    _NEXT, _SHARED_DIR = counter, cache_dir
    end_with_parent(parent)  # no worker outlives the command
    import torch

    torch.set_num_threads(threads)  # the workers share the cores


def _stop_workers(pool: Any) -> None:
    """End ``pool``'s worker processes now (shutdown alone waits for their running tasks)."""
    stop = getattr(pool, "terminate_workers", None)  # Python 3.14
    if stop is not None:
        stop()
        return
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        proc.terminate()
    for proc in procs:  # gone before their cache directory is
        proc.join(timeout=5)
    pool.shutdown(wait=False, cancel_futures=True)


class _Claims:
    """``compile_cases``' ``take`` in a worker: it claims the next untaken point's index,
    builds that point when the walk over all points reaches it, then claims again."""

    def __init__(self) -> None:
        self.mine = self._claim()

    @staticmethod
    def _claim() -> int:
        with _NEXT.get_lock():
            n = _NEXT.value
            _NEXT.value += 1
        return n

    def __call__(self, index: int) -> bool:
        if index != self.mine:
            return False
        self.mine = self._claim()
        return True


def _cores() -> int:
    from microbench.env import usable_cpus

    return usable_cpus() or 1


def _jobs(a: argparse.Namespace, points: int) -> int:
    return max(1, min(a.jobs if a.jobs > 0 else _cores(), points))


def _build_all(a: argparse.Namespace, jobs: int, session: Any, started: float) -> int:
    """Every point's builds into ``session``, over ``jobs`` processes; the number of calls.
    A worker that dies (killed, out of memory) leaves a failure naming it."""
    if jobs == 1:
        builds, failures, calls = build_share(a, started)
        session.absorb(builds, failures)
        return calls
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from microbench.aot import Failure

    ctx = multiprocessing.get_context("spawn")
    threads = max(1, _cores() // jobs)
    # the workers' common cache (unused with --into-cache, where Triton's own is)
    shared = tempfile.TemporaryDirectory(prefix="microbench-aot-", ignore_cleanup_errors=True)
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init_worker,
                               initargs=(ctx.Value("i", 0), shared.name, threads, os.getpid()))
    calls = 0
    try:
        futures = [pool.submit(build_share, a, started, f" {i + 1}/{jobs}") for i in range(jobs)]
        for i, f in enumerate(futures):
            try:
                builds, failures, n = f.result()
            except BrokenProcessPool as e:  # one died: the pool has ended the others too
                session.failures.append(Failure(f"worker {i + 1}/{jobs}", f"a worker process died ({e})"))
                continue
            session.absorb(builds, failures)
            calls += n
    except BaseException:  # Ctrl-C, SIGTERM: the workers stop too, not after their share
        _stop_workers(pool)
        raise
    else:
        pool.shutdown()
    finally:
        shared.cleanup()
    return calls


def cmd_compile(a: argparse.Namespace) -> int:
    # Triton decides interpreter or compiler when a kernel module is imported: this command
    # needs the compiler, whatever the shell says
    os.environ.pop("TRITON_INTERPRET", None)
    from microbench.aot import AotError, Session, case_points, problems, toolchain

    if a.jobs < 0:
        raise UsageError(f"--jobs {a.jobs}: give a number of processes, or 0 for one per core")
    cases, picks, _, profile = _selection(a)
    if a.json:  # before the builds: a path that cannot be written would lose them
        from microbench.cli_paths import check_output_file

        check_output_file(a.json, "--json")
    a.target = profile.name if a.target == "auto" else a.target  # the workers touch no GPU to find it again
    sm = profile.sm
    baseline = _load_baseline(a.baseline, sm.arch) if a.baseline else None
    jobs = _jobs(a, sum(len(case_points(c, a.suite, picks)) for c in cases))
    t0, started = time.perf_counter(), time.time()
    try:
        tools = toolchain(sm.arch)
    except ImportError as e:
        raise UsageError(f"Triton is not importable here ({e}); microbench compile needs it") from None
    where = f" into Triton's cache ({_cache_dir()})" if a.into_cache else ""
    print(f"microbench compile: suite {a.suite} for {profile.name} (sm_{sm.arch}) with Triton {tools['triton']}, "
          f"ptxas {tools['ptxas']}, {jobs} process{'es' if jobs > 1 else ''}{where}: launches compile and run "
          "nothing", file=sys.stderr)
    session = Session(sm)
    try:
        calls = _build_all(a, jobs, session, started)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (main turns it into this)
        kept = "; the builds made so far are in Triton's cache" if a.into_cache else ""
        print(f"microbench compile: interrupted{f' ({e})' if str(e) else ''} after "
              f"{time.perf_counter() - t0:.0f} s: no table{kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    builds = list(session.builds.values())
    head = (f"Builds for {profile.name} (sm_{sm.arch}), suite {a.suite}, Triton {tools['triton']}, "
            f"ptxas {tools['ptxas']}")
    if a.format == "markdown":
        print(f"**{head}**\n")
    elif a.format == "text":
        print(head)
    if builds:
        print(table(builds, sm, a.format), end="")
    bad = [b for b in builds if problems(b, sm)]
    spilled = [b for b in builds if b.spill_stores]
    unknown = [b for b in builds if b.spill_stores is None]  # taken from a cache: ptxas said nothing
    for f in session.failures:
        print(f"FAILED {f.where}" + (f" [{f.kernel}]" if f.kernel else "") + f": {f.error}")
    kernels = len({b.kernel for b in builds})
    summary = (f"{len(builds)} builds of {kernels} kernels from {calls} calls: {len(bad)} do not fit, "
               f"{len(spilled)} spill" + (f", {len(unknown)} unknown ('?')" if unknown else "")
               + f", {len(session.failures)} failed")
    if a.format != "csv":
        print(("\n" if a.format == "markdown" else "") + summary)
    print(f"microbench compile: {summary} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if baseline is not None:
        text, n = diff(baseline["builds"], [b.to_json(sm) for b in builds], a.format)
        print(f"\nvs {a.baseline} (Triton {baseline.get('triton')}, ptxas {baseline.get('ptxas')}): {n['changed']} "
              f"changed, {n['added']} added (+), {n['removed']} removed (-), {n['same']} the same")
        if text:
            print(("\n" if a.format == "markdown" else "") + text, end="")
    if a.json:
        doc = {"schema": "microbench.compile", "version": 1, "target": profile.name, "arch": sm.arch,
               "suite": a.suite, **tools, "limits": {k: v for k, v in vars(sm).items()},
               "builds": [b.to_json(sm) for b in builds], "failures": [f.to_json() for f in session.failures]}
        from microbench.results import write_atomic

        try:
            write_atomic(a.json, doc, indent=1)
            print(f"details: {a.json}", file=sys.stderr)
        except OSError as e:  # the table above stands; its details could not be kept
            print(f"microbench compile: could not write {a.json} ({e.strerror or e})", file=sys.stderr)
            return EXIT_PROBLEMS
    if not calls:
        print("microbench compile: no variant was called (every point skipped?)", file=sys.stderr)
        return EXIT_PROBLEMS
    if a.fail_on_spill and unknown:
        print(f"microbench compile: --fail-on-spill: {len(unknown)} builds came from a cache, where ptxas reports "
              "no spills: not known to be free of them (build without --into-cache, or clear the cache)",
              file=sys.stderr)
    return EXIT_PROBLEMS if bad or session.failures or (a.fail_on_spill and (spilled or unknown)) else 0


def _with_user_variant(a: argparse.Namespace, cases: list[Any]) -> list[Any]:
    """The one selected case, with FILE::FUNCTION added as a variant (as ``try`` does)."""
    from microbench.case import expand
    from microbench.usercode import UserCodeError, WithVariant, load_variant, parse_target

    if len(cases) != 1:
        raise UsageError("--file needs exactly one --case (the case whose variant it is)")
    case = cases[0]
    small = [p for p in expand(case.check_axes("cpu")) if not case.skip(p, "cpu")]
    if not small:
        raise UsageError(f"case {case.id} has no small shapes to bind {a.file} against")
    try:
        parse_target(a.file)
        variant = load_variant(a.file, case, small[0], "cpu", a.name)
        return [WithVariant(case, variant)]
    except UserCodeError as e:
        raise UsageError(str(e)) from None


def add_parser(sub) -> None:
    from microbench.hardware import shipped_listing

    c = sub.add_parser(
        "compile", help="build every Triton kernel of a suite for a target GPU (no GPU needed): registers, "
        "spills, shared memory, occupancy, fit",
        description="Call each case's variants at the suite's GPU shapes with every Triton launch compiled for "
        "the target and nothing run; print one row per distinct build: its varying constexprs, warps, stages, "
        "registers, spill bytes, shared memory, blocks per SM, whether it fits the target, and which cases use it. "
        "Exit 1 when a kernel fails to compile or a build does not fit (or spills, with --fail-on-spill), 2 on bad "
        "input. Nothing is timed or checked for correctness: run the suite on the GPU for that.")
    c.add_argument("--target", default="h200", help="hardware profile to build for (default h200; shipped: "
                   f"{shipped_listing()}; a unique prefix is enough; or a profile JSON with an 'sm' block; auto: "
                   "the profile of the GPU torch sees)")
    c.add_argument("--suite", default="verify", help="whose shapes (default verify: the model's)")
    c.add_argument("--case", action="append", help="case id(s), comma-separated or repeated (default: the suite's)")
    c.add_argument("--variant", action="append", help="only these variants")
    c.add_argument("--axis", action="append", metavar="NAME=V1,V2", help="narrow an axis of the sweep")
    c.add_argument("--file", metavar="FILE::FUNCTION", help="also build your own function as a variant of --case")
    c.add_argument("--name", help="its variant name (default: the function's)")
    c.add_argument("--seed", type=int, default=0, help="input seed (inputs only shape the launches)")
    c.add_argument("--format", choices=["text", "markdown", "csv"], default="text", help="table format")
    c.add_argument("--json", metavar="PATH", help="also write every build's details (full config, uses) as JSON")
    c.add_argument("--fail-on-spill", action="store_true", help="exit 1 when any build spills registers")
    c.add_argument("--jobs", type=int, default=1, metavar="N", help="build in N processes, each taking the next "
                   "point none has taken (0: one per core; default 1); the table is the one a single process prints. "
                   "Each process imports torch and Triton and makes its own inputs: the verify suite takes about "
                   "5 GB of host memory in one process")
    c.add_argument("--into-cache", action="store_true", help="put the builds in Triton's own cache "
                   "(TRITON_CACHE_DIR, else ~/.triton/cache) instead of a private one, so that a run on this host's "
                   "GPU of the target's architecture loads them instead of compiling each at its first launch "
                   "(scripts/gpu-check builds the verify suite so while it tunes). A build already there is not "
                   "built again, so ptxas does not report its spills ('?')")
    c.add_argument("--baseline", metavar="JSON", help="a previous --json report for the same target: also print "
                   "what changed (registers, spills, shared memory, blocks/SM; builds added and removed)")
    c.set_defaults(func=cmd_compile)
