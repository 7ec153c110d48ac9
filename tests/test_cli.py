"""The command line end to end: list, run, report, compare, env, and every bad input
(scripts/gpu-check's own tests: tests/test_gpu_check_script.py)."""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import microbench.cases as cases_pkg
from microbench.cli import main
from microbench.results import ResultWriter
from microbench.stats import summarize

from .helpers import DEVICE

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
    (["run", *QUICK, "--threads", "0"], "--threads 0: need at least 1"),
    (["tune", "--device", "cpu", "--threads", "-1"], "--threads -1: need at least 1"),
    (["run", "--suite", "selftest", "--case", "norm.rmsnorm"],
     "case norm.rmsnorm has no points in suite selftest (its suites: smoke, verify)"),
    (["run", "--case", "comm.allreduce", "--device", "cpu", "--plan", "--backend", "mpi"], "unknown backend 'mpi'"),
    (["run", *QUICK, "--plan", "--dist-timeout", "0"], "--dist-timeout 0: must be a positive number of seconds"),
    (["scaffold", "--case", "norm.rmsnorm", "/nonexistent/folder/x.py"],
     "scaffold /nonexistent/folder/x.py: no folder /nonexistent/folder"),
    (["model", "--plot", "/nonexistent/folder/x.png"], "--plot /nonexistent/folder/x.png: no folder"),
    (["report", __file__], "not a JSON result file"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    if argv[:3] == ["run", "--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["run", *QUICK, "--plan"], ["compare", "a.json", "b.json"],
                                  ["try", "x.py::f", "--case", "norm.rmsnorm"]])
@pytest.mark.parametrize("value", ["-0.01", "nan", "inf", "2%"])
def test_a_min_effect_that_is_no_fraction_is_refused_by_the_parser(capsys, argv, value):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--min-effect", value])
    assert e.value.code == 2 and f"argument --min-effect: '{value}': a fraction >= 0" in capsys.readouterr().err


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


def _result_file(path, records) -> str:
    """A complete result file of ``records`` (a CPU run, no fingerprint to speak of)."""
    w = ResultWriter(str(path), {"device": "cpu"}, {"git": {}, "host": {}})
    w.add(records)
    return w.close(complete=True)


def _timed(rng, variant="v", scale=1.0, n=300, case="c"):
    """An OK record of ``n`` synthetic samples around 100 µs x ``scale``, 2% spread."""
    s = list(1e-4 * scale * rng.lognormal(0, 0.02, n))
    return {"case": case, "axes": {"n": 1}, "variant": variant, "status": "OK",
            "timing": {"samples_s": s, "summary": summarize(s).to_dict(), "mode": "hot"}}


def test_fail_on_slower_exits_1(tmp_path, capsys):
    """Exit codes from the verdicts of two (synthetic, so deterministic) result files."""
    rng = np.random.default_rng(0)
    a, b = (_result_file(tmp_path / name, [_timed(rng, scale=scale)]) for name, scale in (("a", 1.0), ("b", 1.2)))
    assert main(["compare", a, b, "--fail-on", "slower"]) == 1
    assert "SLOWER" in capsys.readouterr().out
    assert main(["compare", b, a, "--fail-on", "slower"]) == 0  # faster is not a failure
    assert main(["compare", a, b]) == 0  # without --fail-on a verdict never fails the command


def test_fail_on_slower_exits_1_when_any_one_case_is_slower(tmp_path, capsys):
    """One SLOWER case among cases that are SAME still fails the gate."""
    rng = np.random.default_rng(2)
    paths = [_result_file(tmp_path / name, [_timed(rng, "same"), _timed(rng, "slower", scale)])
             for name, scale in (("a", 1.0), ("b", 1.2))]
    assert main(["compare", *paths, "--fail-on", "slower"]) == 1
    assert "verdicts: 1 SAME, 1 SLOWER" in capsys.readouterr().out
    assert main(["compare", *paths, "--fail-on", "broken"]) == 0


def test_fail_on_broken_exits_1_when_a_point_that_was_ok_failed(tmp_path, capsys):
    failed = {"case": "c", "axes": {"n": 1}, "variant": "v", "status": "FAILED",
              "reason": "incorrect: out (8,) float32: 3/8 elements off"}
    paths = [_result_file(tmp_path / "a", [_timed(np.random.default_rng(3))]), _result_file(tmp_path / "b", [failed])]
    assert main(["compare", *paths, "--fail-on", "slower"]) == 0  # a broken point is not a slower one
    assert main(["compare", *paths, "--fail-on", "slower", "--fail-on", "broken"]) == 1
    assert "BROKEN" in capsys.readouterr().out
    assert main(["compare", paths[1], paths[0], "--fail-on", "broken"]) == 0  # fixed is not broken
    # a record failed in a later pass keeps its earlier timing in the file; no report shows it
    doc = json.load(open(paths[1]))
    doc["records"][0]["timing"] = json.load(open(paths[0]))["records"][0]["timing"]
    with open(paths[1], "w") as f:
        json.dump(doc, f)
    capsys.readouterr()
    assert main(["report", paths[1], "--format", "csv"]) == 0
    (row,) = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert row["status"] == "FAILED" and row["median_s"] == "" and row["count"] == ""


def test_fail_on_broken_exits_1_when_an_unfinished_run_lacks_points_that_were_ok(tmp_path, capsys):
    rng = np.random.default_rng(4)
    base = _result_file(tmp_path / "a", [_timed(rng, "v"), _timed(rng, "w")])
    w = ResultWriter(str(tmp_path / "b"), {"device": "cpu"}, {"git": {}, "host": {}})
    w.add([_timed(rng, "v")])
    crashed = w.close(complete=False, error="RuntimeError: boom")
    assert main(["compare", base, crashed, "--fail-on", "slower"]) == 0
    assert main(["compare", base, crashed, "--fail-on", "broken"]) == 1
    assert "1 point(s) of" in capsys.readouterr().err
    finished = _result_file(tmp_path / "c", [_timed(rng, "v")])  # a narrower run that finished: not broken
    assert main(["compare", base, finished, "--fail-on", "broken"]) == 0


def test_compare_filters_keep_the_base_side_of_a_mapped_variant(tmp_path, capsys):
    """``--map-variant old=new --variant new``: the base's `old` is what `new` is compared
    with, so the filter keeps it there (and only there)."""
    rng = np.random.default_rng(1)
    paths = [_result_file(tmp_path / name, [_timed(rng, v, n=200) for v in ("old", "new")]) for name in ("a", "b")]
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
    rng = np.random.default_rng(4)
    paths = [_result_file(tmp_path / case, [_timed(rng, case=case, n=2)]) for case in ("a", "b")]
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
    assert "2 points (2 variant runs)" in head and "timing budget 0.1 s" in head, head


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
    from microbench.planning import RunOptions

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


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for argv, message in ((["run", *QUICK, "--out", str(afile)], f"--out {afile}: {afile} is not a folder"),
                          (["run", *QUICK, "--out", ""], "--out: an empty path"),
                          (["try", "x.py::f", "--case", "norm.rmsnorm", "--out", str(afile / "r")],
                           f"{afile} is not a folder"),
                          (["scaffold", "--case", "norm.rmsnorm", "--force", str(tmp_path)], "a folder, not a file")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert afile.read_text() == "keep me"


def test_tune_does_not_replace_a_file_that_is_not_a_tuning_table(tmp_path, capsys):
    other = tmp_path / "result.json"
    other.write_text('{"schema": "microbench.result"}')
    assert main(["tune", "--device", "cpu", "--axis", "weights=bf16", "--max-trials", "1", "--out", str(other)]) == 2
    assert f"--out {other}: cannot be updated, so it is not replaced (" in capsys.readouterr().err
    assert other.read_text() == '{"schema": "microbench.result"}'


def test_a_case_or_value_named_twice_is_timed_once(tmp_path, capsys):
    argv = ["run", "--case", "norm.rmsnorm", "--case", "norm.rmsnorm", "--axis", "tokens=1,1", "--axis", "norm=kv_a",
            "--variant", "torch", "--budget-s", "0.02", "--repeat", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = _files(tmp_path)
    recs = json.load(open(path))["records"]
    assert [(r["axes"]["tokens"], r["variant"]) for r in recs] == [(1, "torch")]


def test_an_ok_record_without_a_timing_is_a_malformed_file(tmp_path, capsys):
    w = ResultWriter(str(tmp_path), {"device": "cpu"}, {"git": {}, "host": {}})
    w.add([{"case": "c", "axes": {"n": 1}, "variant": "v", "status": "OK", "timing": None}])
    path = w.close(complete=True)
    assert main(["compare", path, path]) == 2
    assert "record 0 (c n=1 v) is malformed: status OK but no timing" in capsys.readouterr().err


def test_a_case_without_any_variant_named_is_said_and_not_counted(tmp_path, capsys):
    assert main(["run", "--case", "norm.rmsnorm,moe.align", "--variant", "torch", "--plan"]) == 0
    cap = capsys.readouterr()
    assert "--variant torch: not in moe.align, whose points are not run" in cap.err
    assert "moe.align" not in cap.out and "norm.rmsnorm" in cap.out
