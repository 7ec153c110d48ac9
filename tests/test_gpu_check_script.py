"""scripts/gpu-check, read and partly run without a GPU: its steps fit its time, select
the GPU tests, prebuild and tune what the verify suite needs, plan its verify-suite run
within its limit, and its last steps work on a GPU result file."""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys

import microbench.cases as cases_pkg
from microbench.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script() -> str:
    """scripts/gpu-check with its continued lines joined (one line per command)."""
    with open(os.path.join(ROOT, "scripts", "gpu-check")) as f:
        return f.read().replace("\\\n", " ")


def _step(name: str) -> list[str]:
    """The words of the check's `step "NAME" SECONDS CMD...` line."""
    (line,) = [ln for ln in _script().splitlines() if ln.startswith(f'step "{name}"')]
    return shlex.split(line)


def test_gpu_check_runs_the_gpu_tests_only():
    """The GPU check's test step selects the tests marked gpu (each a bf16, CUDA-timing or
    capture check), not the CPU suite, whose interpreter smoke run alone would outlast the
    step's limit on a GPU host."""
    script = _script()
    limits = dict(re.findall(r'^\s*step "([^"]+)" (\d+) ', script, re.M))
    limits = {k: int(v) for k, v in limits.items()}
    # the prebuild runs beside env and tune: the check waits for it only past their limits
    (grace, prebuild), = [(int(g), int(n))
                          for g, n in re.findall(r"timeout --kill-after=(\d+) (\d+) .* compile ", script)]
    waited = max(0, prebuild + grace - limits["env"] - limits["tune"])
    # the tests step: at least its floor, else what is left of the check's cap but a reserve
    # that holds every step after it
    (cap,) = [int(c) for c in re.findall(r"^CAP=(\d+)", script, re.M)]
    found = re.search(
        r'^tests_s=\$\(\(CAP - SECONDS - (\d+)\)\)\n\[ "\$tests_s" -ge (\d+) \] \|\| tests_s=(\d+)$', script, re.M)
    (reserve, floor, floor_again), lines = found.groups(), found.group(0)
    assert floor == floor_again and 'step "tests" "$tests_s" ' in script
    for elapsed, want in [(0, cap - int(reserve)), (cap - int(reserve) - 100, 100), (cap, int(floor))]:
        got = subprocess.run(["bash", "-c", f"CAP={cap}; SECONDS={elapsed}; {lines}; echo $tests_s"],
                             capture_output=True, text=True, timeout=30).stdout
        assert int(got) == want, (elapsed, got)
    later = script[script.index('step "tests"'):]
    after = [n for n in limits if f'step "{n}" ' in later]
    assert set(after) >= {"benches", "model", "report"} and sum(limits[n] for n in after) <= int(reserve)
    limits["tests"] = int(floor)
    # the check's steps fit in 8 minutes, with room for what runs between them (the CUDA
    # probe, a gzip of a large result file, a SIGTERM'd step's 5 s grace)
    assert len(limits) >= 7 and sum(limits.values()) + waited <= cap <= 8 * 60 - 15
    args = _step("tests")
    expr = args[args.index("-m", args.index("pytest")) + 1]
    assert re.search(r"\bgpu\b", expr) and "not gpu" not in expr
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests",
                        "--ignore=tests/bench", "-m", expr], capture_output=True, text=True, cwd=ROOT, timeout=300)
    ids = [ln for ln in p.stdout.splitlines() if "::" in ln]
    assert len(ids) >= 10, p.stdout[-2000:]
    assert not [i for i in ids if i.startswith(("tests/test_cli.py", "tests/test_compile.py"))]


def test_gpu_check_prebuilds_the_verify_suite_into_the_cache_before_running_it():
    """The prebuild builds the verify suite's Triton kernels for the GPU present into
    Triton's own cache, in several processes, in the background; the check waits for it
    before the suite runs, and logs how many builds the suite still compiled itself."""
    from microbench.cli import build_parser
    from microbench.cli_compile import _selection

    lines = _script().splitlines()
    (i,) = [i for i, ln in enumerate(lines) if " -m microbench compile " in ln]
    argv = shlex.split(lines[i].split('"$PY" -m microbench ', 1)[1].split(">", 1)[0])
    a = build_parser().parse_args(argv)
    assert (a.suite, a.target, a.into_cache) == ("verify", "auto", True) and 2 <= a.jobs <= 8
    a.target = "h200"  # what auto picks on an H200; the selection is the suite's Triton cases
    cases, _, _, profile = _selection(a)
    assert {"attention.mla_verify", "moe.experts", "layer.decoder"} <= {c.id for c in cases}
    assert profile.sm.arch == 90
    assert lines[i - 1].lstrip().startswith("( ") and lines[i + 1].rstrip().endswith(") &")  # in the background
    order = [j for j, ln in enumerate(lines) if ln.startswith(('wait "$prebuild"', 'step "verify suite"'))]
    assert len(order) == 2 and lines[order[0]].startswith("wait")
    assert any("builds before the verify suite" in ln for ln in lines[order[1]:])


def test_gpu_check_gives_the_verify_suite_a_deadline_inside_its_limit():
    """The suite's run spreads a deadline over its points (the builds' time is not known
    before a GPU runs them), ending them before the step's SIGTERM with room for its table,
    speed targets and file."""
    args = _step("verify suite")
    limit, deadline = int(args[2]), float(args[args.index("--deadline-s") + 1])
    assert 0.8 * limit <= deadline <= limit - 15


def test_plan_sizes_a_gpu_run_without_a_gpu_and_runs_nothing(tmp_path, capsys):
    """`run --plan --device cuda` needs no GPU: the GPU check's own verify-suite command is
    planned here, so a bad axis value cannot waste the GPU's time, and its timing budget is
    held under half its step's limit (gates, warm-up and compiles take the rest)."""
    args = _step("verify suite")
    limit = int(args[2])
    argv = args[args.index("run"):]
    argv[argv.index("--out") + 1] = str(tmp_path)
    assert main([*argv, "--plan", "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    by_case = {r["case"]: r for r in rows}
    assert {"attention.mla_verify", "moe.experts", "comm.allreduce_sweep", "layer.decoder"} <= set(by_case)
    assert int(by_case["comm.allreduce_sweep"]["points"]) == 6 * 2  # the six sizes, eager and graph
    budget_s = float(argv[argv.index("--budget-s") + 1])
    # at most: every variant run, those this host cannot make too (CuPy, peer access)
    worst = sum(int(r["variant_runs"]) + int(r["variants_not_run"]) for r in rows) * budget_s
    assert sum(float(r["budget_s"]) for r in rows) <= worst <= limit / 2, (worst, limit)
    assert not os.listdir(tmp_path)  # nothing ran, nothing was written
    assert argv[argv.index("--device") + 1] == "cuda"


def test_gpu_check_tunes_every_point_a_moe_speed_target_reads():
    """A bar measured against the fused baseline "with its best tuned configuration" needs
    that baseline tuned: the check's tune step covers each verify-suite point of moe.experts
    that a stated target reads (INT4 and bf16), INT4 (the model's) first, so a search cut
    short by the step's limit keeps the model's point."""
    from microbench.aot import case_points
    from microbench.cli import _axis_picks
    from microbench.targets import stated

    args = _step("tune")
    picks = _axis_picks([args[i + 1] for i, a in enumerate(args) if a == "--axis"])
    case = cases_pkg.get_case(args[args.index("--case") + 1])
    tuned = case_points(case, "verify", picks)
    read = [p for p in case_points(case, "verify", {}) if any(t.covers(p) for t in stated()[case.id])]
    assert read and all(p in tuned for p in read), (read, tuned)
    assert [p["weights"] for p in tuned] == ["int4", "bf16"]


def test_gpu_check_model_and_report_steps_run_on_a_gpu_result_file(tmp_path):
    """The check's last steps, as the script writes them, on a result file that says it ran
    on an H100: two step models on that GPU's profile, the whole table, and a headline
    whose missing points leave their one-line errors in headline.md, not a failed step."""
    doc = {"schema": "microbench.result", "schema_version": 1,
           "run": {"id": "gpu", "device": "cuda", "complete": True},
           "fingerprint": {"device": {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}},
           "records": [{"case": "moe.experts", "variant": "fused", "status": "SKIPPED", "reason": "r",
                        "axes": {"layout": "kimi-tp8", "weights": "int4", "tokens": 4, "routing": "router",
                                 "dtype": "bf16"}}]}
    latest = tmp_path / "run.json"
    latest.write_text(json.dumps(doc))
    lines = _script().splitlines()
    env = {"$PY": sys.executable, "$latest": str(latest), "$OUT": str(tmp_path)}
    for name in ("model", "report"):
        (i,) = [i for i, ln in enumerate(lines) if ln.strip().startswith(f'step "{name}"')]
        j = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(("#", "step ", "cat ", "fi")))
        argv = shlex.split("\n".join(lines[i:j]))[3:]  # past: step NAME SECONDS (quotes span lines)
        assert argv[:2] in (["sh", "-c"], ["bash", "-c"]), argv
        argv = argv[:3] + [functools.reduce(lambda a, kv: a.replace(*kv), env.items(), a) for a in argv[3:]]
        p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert p.returncode == 0, (name, p.stderr[-2000:])
    model = (tmp_path / "model.md").read_text()
    assert model.count("step-time model: kimi-k2.5 at TP8 on h100-sxm") == 2
    assert "verify attention kernel verify, MoE kernel few_token" in model
    assert "### moe.experts" in (tmp_path / "table.md").read_text()
    head = (tmp_path / "headline.md").read_text()
    assert "--case attention.mla_verify: no such case" in head and "### moe.experts" in head
    # the speed targets: the point ran, the baseline was skipped and the few-token kernel has no record
    assert "#### Speed targets" in head and "few_token: not in this file; fused: SKIPPED (r)" in head
    assert "2 NO TIME" in head and "bars stated for h200-sxm; this run's GPU is NVIDIA H100 80GB HBM3" in head
