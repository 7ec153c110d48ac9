"""The command line end to end: list, run, report, compare, env, and every bad input."""

from __future__ import annotations

import csv
import functools
import glob
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import microbench.cases as cases_pkg
from microbench.case import Variant
from microbench.cli import main

from .helpers import DEVICE, Scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--case", "norm.rmsnorm", "--axis", "tokens=1", "--axis", "norm=kv_a", "--budget-s", "0.1"]


def _files(d):
    return sorted(glob.glob(os.path.join(str(d), "*.json")))


def test_list_shows_suites_cases_variants_axes(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for word in ("smoke", "verify", "calibration.copy", "norm.rmsnorm", "triton", "tokens=1,4,16,64"):
        assert word in out
    assert main(["list", "--case", "norm.rmsnorm"]) == 0
    assert "signature: Variant signature: fn(x, weight, eps, out, residual=None)" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "--suite", "nope"], "unknown suite 'nope'"),
    (["run", "--case", "nope"], "unknown case 'nope'"),
    (["run", "--case", "norm.rmsnorm", "--variant", "cuda_magic"], "unknown variant cuda_magic"),
    (["run", "--case", "norm.rmsnorm", "--axis", "tokens=3"], "axis tokens has no value 3"),
    (["run", "--case", "norm.rmsnorm", "--axis", "heads=8"], "no selected case has axis heads"),
    (["run", "--case", "norm.rmsnorm", "--axis", "tokens"], "expected name=v1,v2"),
    (["run", "--device", "tpu"], "use auto, cpu, cuda"),
    (["list", "--device", "tpu"], "use auto, cpu, cuda"),
    (["env", "--device", "tpu"], "use auto, cpu, cuda"),
    (["run", *QUICK, "--repeat", "0"], "--repeat 0: need at least 1 pass"),
    (["run", *QUICK, "--repeat", "-1", "--plan"], "--repeat -1: need at least 1 pass"),
    (["run", *QUICK, "--device", "cpu", "--mode", "graph"], "graph mode needs a CUDA device"),
    (["try", "x.py::f", "--case", "norm.rmsnorm", "--suite", "nope"], "unknown suite 'nope'"),
    (["try", "x.py::f", "--case", "norm.rmsnorm", "--device", "cpu", "--mode", "graph"], "graph mode needs a CUDA"),
    (["tune", "--device", "cpu", "--axis", "token=4"], "no selected case has axis token"),
    (["compare", "/nonexistent/a.json", "/nonexistent/b.json"], "no such file"),
    (["report", __file__], "not a JSON result file"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    if argv[:3] == ["run", "--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cuda_requested_without_cuda_is_a_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert main(["run", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_run_report_compare_round_trip(tmp_path, capsys):
    assert main(["run", *QUICK, "--device", DEVICE, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== norm.rmsnorm ==" in out and "triton" in out
    assert ("CPU timings" in out) == (DEVICE == "cpu")
    (path,) = _files(tmp_path)
    doc = json.load(open(path))
    assert doc["run"]["complete"] and {r["status"] for r in doc["records"]} == {"OK"}
    assert doc["fingerprint"]["software"]["torch"] == torch.__version__

    for fmt, marker in (("text", "== norm.rmsnorm =="), ("markdown", "### norm.rmsnorm"), ("csv", "case,axes,variant")):
        assert main(["report", path, "--format", fmt]) == 0
        assert marker in capsys.readouterr().out

    assert main(["compare", path, path, "--fail-on", "slower"]) == 0
    out = capsys.readouterr().out
    assert "verdicts: 2 SAME" in out
    assert main(["compare", path, path, "--format", "markdown"]) == 0
    assert "| case" in capsys.readouterr().out

    # a table to paste: one variant (or case, or axis value) of the file
    assert main(["report", path, "--variant", "triton", "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert rows and {r["variant"] for r in rows} == {"triton"}
    assert main(["compare", path, path, "--case", "norm", "--variant", "triton"]) == 0
    assert "verdicts: 1 SAME" in capsys.readouterr().out
    assert main(["compare", path, path, "--per-floor"]) == 0  # no calibration in this run, no profile on a CPU
    out = capsys.readouterr().out
    # on a CPU no ceiling was measured here and no profile applies; on a GPU its profile does
    assert "(% floor)" in out and ("no floor for this point" if DEVICE == "cpu" else "verdicts: 2 SAME") in out
    assert main(["compare", path, path, "--per-floor", "--relative"]) == 2
    assert "choose one" in capsys.readouterr().err
    assert main(["report", path, "--variant", "tritn"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "microbench: error: --variant tritn: no such variant; variants in the result file: torch, triton"


def test_fail_on_slower_exits_1(tmp_path, capsys):
    """Exit codes from the verdicts of two (synthetic, so deterministic) result files."""
    import numpy as np

    from microbench.results import ResultWriter
    from microbench.stats import summarize

    rng = np.random.default_rng(0)
    paths = []
    for name, scale in (("a", 1.0), ("b", 1.2)):
        s = list(1e-4 * scale * rng.lognormal(0, 0.02, 300))
        w = ResultWriter(str(tmp_path / name), {"device": "cpu"}, {"git": {}, "host": {}})
        w.add([{"case": "c", "axes": {"n": 1}, "variant": "v", "status": "OK",
                "timing": {"samples_s": s, "summary": summarize(s).to_dict(), "mode": "hot"}}])
        paths.append(w.close(complete=True))
    a, b = paths
    assert main(["compare", a, b, "--fail-on", "slower"]) == 1
    assert "SLOWER" in capsys.readouterr().out
    assert main(["compare", b, a, "--fail-on", "slower"]) == 0  # faster is not a failure
    assert main(["compare", a, b]) == 0  # without --fail-on a verdict never fails the command


def test_compare_filters_keep_the_base_side_of_a_mapped_variant(tmp_path, capsys):
    """``--map-variant old=new --variant new``: the base's `old` is what `new` is compared
    with, so the filter keeps it there (and only there)."""
    import numpy as np

    from microbench.results import ResultWriter
    from microbench.stats import summarize

    rng = np.random.default_rng(1)
    paths = []
    for name in ("a", "b"):
        w = ResultWriter(str(tmp_path / name), {"device": "cpu"}, {"git": {}, "host": {}})
        for v in ("old", "new"):
            s = list(1e-4 * rng.lognormal(0, 0.02, 200))
            w.add([{"case": "c", "axes": {"n": 1}, "variant": v, "status": "OK",
                    "timing": {"samples_s": s, "summary": summarize(s).to_dict(), "mode": "hot"}}])
        paths.append(w.close(complete=True))
    assert main(["compare", *paths, "--map-variant", "old=new", "--variant", "new"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^c\s+n=1\s+old->new\s", out, re.M), out
    assert "only in" not in out and "verdicts: 1 " in out
    # a name a file does not hold is a typo, not a row quietly gone from the table
    for mapping, side in (("nope=new", "(base) holds no variant nope"), ("old=nope", "(new) holds no variant nope")):
        assert main(["compare", *paths, "--map-variant", mapping]) == 2
        err = capsys.readouterr().err
        assert side in err and "its variants: new, old" in err and len(err.strip().splitlines()) == 1


def test_files_with_nothing_to_compare_or_report_say_so(tmp_path, capsys):
    """Two files with no point in common compare nothing: an error, so that a gate on
    `--fail-on slower` cannot pass on them; a run that finished no point says so."""
    from microbench.results import ResultWriter

    paths = []
    for case in ("a", "b"):
        w = ResultWriter(str(tmp_path / case), {"device": "cpu"}, {"git": {}, "host": {}})
        w.add([{"case": case, "axes": {"n": 1}, "variant": "v", "status": "OK",
                "timing": {"samples_s": [1e-4, 2e-4], "summary": {"median": 1.5e-4, "count": 2, "rel_noise": 0.1},
                           "mode": "hot"}}])
        paths.append(w.close(complete=True))
    assert main(["compare", *paths, "--fail-on", "slower"]) == 2
    assert "no point (case, axes, variant) is in both" in capsys.readouterr().err
    empty = ResultWriter(str(tmp_path / "empty"), {"device": "cpu"}, {"git": {}, "host": {}})
    path = empty.close(complete=False, interrupted=True)
    assert main(["report", path]) == 0
    assert "no records: the run finished no point before it ended" in capsys.readouterr().out
    assert main(["report", paths[0], "--plot", paths[1]]) == 2
    assert "cannot make a directory there" in capsys.readouterr().err


def test_a_reader_that_leaves_early_is_no_error():
    """`microbench ... | head`: the pipe closes under the command's output; it stops
    without a traceback (now or at exit), with a shell's status for SIGPIPE."""
    code = ("import sys\nfrom microbench.cli import main\n"
            "sys.exit(main(['list', '--device', 'cpu', '--case', 'norm.rmsnorm', '--case', 'moe.experts']))")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    p.stdout.close()  # before the command writes a line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "Broken pipe" not in err, err


def test_ctrl_c_keeps_finished_points_in_an_incomplete_file(tmp_path, monkeypatch, capsys):
    case = Scaled()

    def interrupted_at_48(a, b, c):
        if a.shape[0] == 48:
            raise KeyboardInterrupt
        torch.mm(a, b, out=c)

    case.variants = lambda: [Variant("base", interrupted_at_48, devices=("cpu",))]
    monkeypatch.setattr(cases_pkg, "all_cases", lambda: [case])
    assert main(["run", "--case", "test.scaled", "--device", "cpu", "--out", str(tmp_path), "--budget-s", "0.1"]) == 130
    (path,) = _files(tmp_path)
    doc = json.load(open(path))
    assert doc["run"]["complete"] is False and doc["run"]["interrupted"] is True
    assert [r["axes"]["n"] for r in doc["records"]] == [32]
    assert "interrupted" in capsys.readouterr().err


def _terminate_after(argv, tmp_path, marker, timeout=120):
    """Start ``microbench ARGV --out TMP``; SIGTERM it (it alone, not its process group) once
    ``marker`` appears on its stderr. Returns (exit status, stderr, seconds it took to stop)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "microbench", *argv, "--out", str(tmp_path)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in p.stderr:
        lines.append(line)
        if marker in line:
            break
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, "".join(lines) + err, time.monotonic() - t0, out


def test_sigterm_keeps_finished_points_as_ctrl_c_does(tmp_path):
    # what `timeout`, a job scheduler or the GPU check's step limit sends
    rc, err, _, out = _terminate_after(["run", "--device", "cpu", "--case", "norm.rmsnorm", "--budget-s", "0.5",
                                        "--repeat", "1"], tmp_path, "[2/4]")
    assert rc == 130, err[-2000:]
    (path,) = _files(tmp_path)
    doc = json.load(open(path))
    assert doc["run"]["complete"] is False and doc["run"]["interrupted"] is True
    assert 1 <= len(doc["records"]) < 8 and "interrupted" in err
    assert "norm.rmsnorm" in out  # the table of what it finished


@pytest.mark.multirank
def test_sigterm_during_a_multi_rank_run_stops_its_ranks_and_keeps_their_points(tmp_path):
    rc, err, stop_s, _ = _terminate_after(["run", "--device", "cpu", "--case", "comm.allreduce_sweep",
                                           "--nproc", "2", "--budget-s", "0.3", "--repeat", "1"], tmp_path, "[2/")
    assert rc == 130, err[-2000:]
    assert stop_s < 60
    (path,) = _files(tmp_path)
    doc = json.load(open(path))
    assert doc["run"]["interrupted"] is True and len(doc["records"]) >= 1, err[-2000:]


def test_env_prints_reasons_for_what_is_missing(capsys):
    assert main(["env", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out
    assert main(["env", "--device", "cpu", "--json"]) == 0
    assert "software" in json.loads(capsys.readouterr().out)


def test_main_job_command_runs_the_smoke_suite_as_a_subprocess(tmp_path):
    """What the README's main job runs after set-up, with a short budget and one pass over
    the plan (the main job's three passes only pool more samples)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "microbench", "run", "--device", "cpu", "--budget-s", "0.05",
                        "--repeat", "1", "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "== calibration.copy ==" in p.stdout and "== norm.rmsnorm ==" in p.stdout
    assert "points" in p.stderr and "[1/" in p.stderr  # count before the run, progress per point
    assert len(_files(tmp_path)) == 1


def test_shapes_of_a_model_and_a_bad_config(tmp_path, capsys):
    assert main(["shapes", "--model", "kimi-k2.5", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "heads_per_rank" in out and "14336" in out and "int4, group 32" in out
    bad = tmp_path / "config.json"
    cfg = json.load(open(os.path.join(ROOT, "cases", "models", "deepseek-v3.json")))
    del cfg["kv_lora_rank"]
    bad.write_text(json.dumps(cfg))
    assert main(["shapes", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "kv_lora_rank" in err and len(err.strip().splitlines()) == 1
    assert main(["shapes", "--tp", "7"]) == 2
    assert "tp=7 does not divide num_attention_heads=64" in capsys.readouterr().err


def test_gpu_check_runs_the_gpu_tests_only():
    """The GPU check's test step selects the tests marked gpu (each a bf16, CUDA-timing or
    capture check), not the CPU suite, whose interpreter smoke run alone would outlast the
    step's limit on a GPU host."""
    import re
    import shlex

    script = open(os.path.join(ROOT, "scripts", "gpu-check")).read()
    limits = dict(re.findall(r'^\s*step "([^"]+)" (\d+) ', script, re.M))
    limits = {k: int(v) for k, v in limits.items()}
    # the prebuild runs beside env and tune: the check waits for it only past their limits
    (grace, prebuild), = [(int(g), int(n)) for g, n in re.findall(r"timeout --kill-after=(\d+) (\d+) .* compile ",
                                                                   script.replace("\\\n", " "))]
    waited = max(0, prebuild + grace - limits["env"] - limits["tune"])
    # the check's steps fit in 8 minutes, with room for what runs between them (the CUDA
    # probe, a gzip of a large result file, a SIGTERM'd step's 5 s grace)
    assert len(limits) >= 6 and sum(limits.values()) + waited <= 8 * 60 - 15
    (line,) = [ln for ln in script.splitlines() if ln.startswith('step "tests"')]
    args = shlex.split(line)
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
    import shlex

    from microbench.cli import build_parser
    from microbench.cli_compile import _selection

    script = open(os.path.join(ROOT, "scripts", "gpu-check")).read().replace("\\\n", " ")
    lines = script.splitlines()
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
    import shlex

    script = open(os.path.join(ROOT, "scripts", "gpu-check")).read().replace("\\\n", " ")
    (line,) = [ln for ln in script.splitlines() if ln.startswith('step "verify suite"')]
    args = shlex.split(line)
    limit, deadline = int(args[2]), float(args[args.index("--deadline-s") + 1])
    assert 0.8 * limit <= deadline <= limit - 15


def test_gpu_check_tunes_every_point_a_moe_speed_target_reads():
    """A bar measured against the fused baseline "with its best tuned configuration" needs
    that baseline tuned: the check's tune step covers each verify-suite point of moe.experts
    that a stated target reads (INT4 and bf16), INT4 (the model's) first, so a search cut
    short by the step's limit keeps the model's point."""
    import shlex

    from microbench.aot import case_points
    from microbench.cli import _axis_picks
    from microbench.targets import stated

    script = open(os.path.join(ROOT, "scripts", "gpu-check")).read().replace("\\\n", " ")
    (line,) = [ln for ln in script.splitlines() if ln.startswith('step "tune"')]
    args = shlex.split(line)
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
    import shlex

    doc = {"schema": "microbench.result", "schema_version": 1,
           "run": {"id": "gpu", "device": "cuda", "complete": True},
           "fingerprint": {"device": {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}},
           "records": [{"case": "moe.experts", "variant": "fused", "status": "SKIPPED", "reason": "r",
                        "axes": {"layout": "kimi-tp8", "weights": "int4", "tokens": 4, "routing": "router",
                                 "dtype": "bf16"}}]}
    latest = tmp_path / "run.json"
    latest.write_text(json.dumps(doc))
    lines = open(os.path.join(ROOT, "scripts", "gpu-check")).read().replace("\\\n", " ").splitlines()
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


def test_plan_sizes_a_gpu_run_without_a_gpu_and_runs_nothing(tmp_path, capsys):
    """`run --plan --device cuda` needs no GPU: the GPU check's own verify-suite command is
    planned here, so a bad axis value cannot waste the GPU's time, and its timing budget is
    held under half its step's limit (gates, warm-up and compiles take the rest)."""
    import shlex

    script = open(os.path.join(ROOT, "scripts", "gpu-check")).read().replace("\\\n", " ")
    (line,) = [ln for ln in script.splitlines() if ln.startswith('step "verify suite"')]
    args = shlex.split(line)
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


def test_plan_of_the_smoke_suite_counts_what_a_run_does(capsys):
    assert main(["run", "--device", "cpu", "--plan", "--budget-s", "0.5", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "Plan: suite smoke on cpu, nothing run" in out
    (total,) = [ln for ln in out.splitlines() if ln.startswith("total")]
    # 15 points here and 6 on the ranks; the multi-rank cases' CuPy / symmetric-memory paths need CUDA
    assert total.split()[1] == "21"
    assert "comm.allreduce" in out and "Not run:" in out and "symmetric memory" in out
    assert main(["run", "--device", "tpu", "--plan"]) == 2
    assert "use auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    assert main(["run", "--device", "cuda", "--plan", "--case", "norm.rmsnorm", "--axis", "tokens=3"]) == 2
    assert "tokens has no value 3" in capsys.readouterr().err


def test_the_run_header_counts_the_variant_runs_it_makes_and_bounds_their_timing(tmp_path, capsys):
    assert main(["run", "--device", "cpu", "--case", "norm.rmsnorm", "--variant", "triton", "--axis", "tokens=1",
                 "--budget-s", "0.05", "--repeat", "1", "--no-probe", "--out", str(tmp_path)]) == 0
    head = capsys.readouterr().err.splitlines()[0]
    assert "2 points (2 variant runs)" in head and "timing at most 0.1 s" in head, head


def test_the_readmes_command_lines_use_options_the_commands_have():
    """Every `microbench SUB --option` in the README's shell blocks names a subcommand and
    options its parser knows, so a renamed flag cannot leave the README stale."""
    import argparse
    import shlex

    from microbench.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    seen = 0
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#")[0].split("&&"):
                words = shlex.split(part)
                if len(words) < 2 or words[0] != "microbench":
                    continue
                parser = sub.choices.get(words[1])
                assert parser is not None, f"README: unknown subcommand in {part.strip()!r}"
                known = {o for a in parser._actions for o in a.option_strings}
                for w in words[2:]:
                    if w.startswith("--"):
                        assert w.split("=")[0] in known, f"README: {words[1]} has no option {w} ({part.strip()!r})"
                seen += 1
    assert seen >= 30


def test_run_with_a_deadline_records_it_and_refuses_a_bad_one(tmp_path, capsys):
    from microbench.pace import DEADLINE_NOTE

    assert main(["run", *QUICK, "--device", DEVICE, "--out", str(tmp_path), "--deadline-s", "0"]) == 2
    assert "--deadline-s 0: need a positive number of seconds" in capsys.readouterr().err
    assert not _files(tmp_path)
    assert main(["run", *QUICK, "--device", DEVICE, "--out", str(tmp_path), "--deadline-s", "0.01"]) == 0
    err = capsys.readouterr().err
    assert "(budgets cut as needed to end by --deadline-s 0.01)" in err and "points timed on a cut budget" in err
    (path,) = _files(tmp_path)
    doc = json.load(open(path))
    assert doc["run"]["deadline_s"] == 0.01
    assert all(r["status"] == "OK" and DEADLINE_NOTE in r["timing"]["notes"] for r in doc["records"])


def test_ranks_get_what_is_left_of_the_deadline():
    from microbench.cli import build_parser
    from microbench.ranks import child_argv
    from microbench.runner import RunOptions

    a = build_parser().parse_args(["run", "--case", "comm.allreduce", "--deadline-s", "100"])
    comm = [cases_pkg.get_case("comm.allreduce")]
    argv = child_argv(a, "smoke", "cpu", comm, RunOptions(suite="smoke", deadline_at=time.monotonic() + 40), "/tmp")
    assert 39 < float(argv[argv.index("--deadline-s") + 1]) <= 40
    argv = child_argv(a, "smoke", "cpu", comm, RunOptions(suite="smoke", deadline_at=time.monotonic() - 5), "/tmp")
    assert float(argv[argv.index("--deadline-s") + 1]) > 0  # past it: the ranks still run, on the least budget
    assert "--deadline-s" not in child_argv(a, "smoke", "cpu", comm, RunOptions(suite="smoke"), "/tmp")


def test_the_deadline_counts_from_the_commands_start(monkeypatch):
    """What comes before the first point (imports, NCCL set-up, the fingerprint) spends the
    deadline too: a step limit just above it then leaves the run's ending its few seconds."""
    from microbench import cli
    from microbench.cli import build_parser, run_options

    a = build_parser().parse_args(["run", "--device", "cpu", "--deadline-s", "100"])
    monkeypatch.setattr(cli, "_started", time.monotonic() - 30)  # 30 s of set-up before the options
    assert 69 < run_options(a, "smoke", "cpu", []).deadline_at - time.monotonic() <= 70
    monkeypatch.setattr(cli, "_started", None)  # run_options called outside main: from now
    assert 99 < run_options(a, "smoke", "cpu", []).deadline_at - time.monotonic() <= 100


def test_a_named_cuda_device_is_made_current(monkeypatch):
    """Triton launches on the current device: --device cuda:1 with device 0 current would
    run the first gate's kernels against another GPU's pointers."""
    import torch

    from microbench.cli import UsageError, resolve_device

    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert resolve_device("cuda:1") == "cuda:1" and current == [1]
    assert resolve_device("cuda") == "cuda" and current == [1]  # the current one stays
    with pytest.raises(UsageError, match="only 2 CUDA device"):
        resolve_device("cuda:2")
    assert resolve_device("cuda:3", present=False) == "cuda:3" and current == [1]  # named only (--plan)
