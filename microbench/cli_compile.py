"""``microbench compile``: build every Triton kernel a suite launches for a target GPU, on
any host (see microbench.aot), and print what each build takes on one SM of it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from microbench.cli import UsageError, _axis_picks, _split
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


def cmd_compile(a: argparse.Namespace) -> int:
    # Triton decides interpreter or compiler when a kernel module is imported: this command
    # needs the compiler, whatever the shell says
    os.environ.pop("TRITON_INTERPRET", None)
    from microbench import case as case_mod
    from microbench import hardware
    from microbench.aot import (AotError, case_points, check_not_interpreted, compile_cases, compile_only, problems,
                                toolchain)
    from microbench.cases import SUITES
    from microbench.cli import _select_cases

    if a.suite not in SUITES:
        raise UsageError(f"unknown suite {a.suite!r} (suites: {', '.join(SUITES)})")
    profile = hardware.load_profile(a.target)
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
    sm = profile.sm
    baseline = _load_baseline(a.baseline, sm.arch) if a.baseline else None
    t0 = time.perf_counter()

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    case_mod.COMPILE_TARGET = profile
    try:
        from microbench.kernels import launch

        check_not_interpreted(launch._empty_kernel)
        tools = toolchain(sm.arch)
        print(f"microbench compile: suite {a.suite} for {profile.name} (sm_{sm.arch}) with Triton {tools['triton']}, "
              f"ptxas {tools['ptxas']}: launches compile and run nothing", file=sys.stderr)
        with compile_only(sm) as session:
            calls = compile_cases(cases, a.suite, picks, session, seed=a.seed, variants=variants, progress=progress)
    except AotError as e:
        raise UsageError(str(e)) from None
    finally:
        case_mod.COMPILE_TARGET = None
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
    for f in session.failures:
        print(f"FAILED {f.where}" + (f" [{f.kernel}]" if f.kernel else "") + f": {f.error}")
    kernels = len({b.kernel for b in builds})
    summary = (f"{len(builds)} builds of {kernels} kernels from {calls} calls: {len(bad)} do not fit, "
               f"{len(spilled)} spill, {len(session.failures)} failed")
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
        tmp = a.json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh, indent=1)
        os.replace(tmp, a.json)
        print(f"details: {a.json}", file=sys.stderr)
    if not calls:
        print("microbench compile: no variant was called (every point skipped?)", file=sys.stderr)
        return EXIT_PROBLEMS
    return EXIT_PROBLEMS if bad or session.failures or (a.fail_on_spill and spilled) else 0


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
    except UserCodeError as e:
        raise UsageError(str(e)) from None
    return [WithVariant(case, variant)]


def add_parser(sub) -> None:
    c = sub.add_parser(
        "compile", help="build every Triton kernel of a suite for a target GPU (no GPU needed): registers, "
        "spills, shared memory, occupancy, fit",
        description="Call each case's variants at the suite's GPU shapes with every Triton launch compiled for "
        "the target and nothing run; print one row per distinct build: its varying constexprs, warps, stages, "
        "registers, spill bytes, shared memory, blocks per SM, whether it fits the target, and which cases use it. "
        "Exit 1 when a kernel fails to compile or a build does not fit (or spills, with --fail-on-spill), 2 on bad "
        "input. Nothing is timed or checked for correctness: run the suite on the GPU for that.")
    c.add_argument("--target", default="h200", help="hardware profile to build for (default h200; shipped: "
                   "h100-sxm, h200-sxm, rtx-pro-6000-blackwell; or a profile JSON with an 'sm' block)")
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
    c.add_argument("--baseline", metavar="JSON", help="a previous --json report for the same target: also print "
                   "what changed (registers, spills, shared memory, blocks/SM; builds added and removed)")
    c.set_defaults(func=cmd_compile)
