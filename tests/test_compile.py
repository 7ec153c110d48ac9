"""``microbench compile``: every Triton kernel built for a GPU this host lacks, its
resources read from ptxas, its fit and occupancy judged against the target's SM limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from microbench.aot import AotError, Build, check_not_interpreted, occupancy, problems
from microbench.hardware import load_profile
from microbench.models import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "tests", "aot_kernels.py")
H200 = load_profile("h200").sm
ONE_NORM = ["--case", "norm.rmsnorm", "--axis", "tokens=4", "--axis", "norm=input"]


def _compile(args, tmp_path, timeout=600, out=None, env=None):
    """The command in a fresh process (the test process built its kernels with the interpreter),
    its --json report in ``out`` (default tmp_path/compile.json), ``env`` added to the environment."""
    env = {**os.environ, **(env or {})}
    env["TRITON_INTERPRET"] = "1"  # what a CPU shell often has: the command must not care
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = out or tmp_path / "compile.json"
    p = subprocess.run([sys.executable, "-m", "microbench", "compile", *args, "--json", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    doc = json.loads(out.read_text()) if out.exists() else None
    return p, doc


def _build(**kw):
    base = dict(kernel="k", hash="h", config={}, signature="", num_warps=4, num_stages=2, shared=0, registers=32)
    return Build(**{**base, **kw})


def test_occupancy_follows_registers_shared_memory_and_warps():
    # 255 registers round up to 8192 per warp: 8 warps per SM, one 8-warp block
    assert occupancy(_build(registers=255, num_warps=8), H200) == 1
    # 32 registers x 4 warps: the warp limit (64 / 4 = 16) binds before the registers (16)
    assert occupancy(_build(registers=32, num_warps=4), H200) == 16
    # 100 KiB of shared memory + 1 KiB reserved: two blocks in 228 KiB
    assert occupancy(_build(shared=100 * 1024), H200) == 2
    # tiny blocks stop at 32 per SM
    assert occupancy(_build(registers=16, num_warps=1), H200) == 32
    assert occupancy(_build(shared=H200.shared_per_block + 1), H200) == 0


def test_problems_name_each_limit_a_build_breaks():
    assert problems(_build(), H200) == []
    assert problems(_build(shared=H200.shared_per_block), H200) == []  # the opt-in maximum itself fits
    bad = problems(_build(shared=H200.shared_per_block + 1, num_warps=64), H200)
    assert any("shared memory" in p for p in bad) and any("2048 threads" in p for p in bad)
    rtx = load_profile("rtx-pro-6000").sm
    assert rtx.arch == 120 and H200.arch == 90
    # what fits an H200 block can be too much for an RTX PRO 6000 one
    assert problems(_build(shared=128 * 1024), H200) == [] and problems(_build(shared=128 * 1024), rtx)


def test_describe_keeps_a_compile_errors_reason_and_source_line():
    msg = ("at 4:50:\ndef k(x):\n    a = tl.load(x)\n    tl.store(x, tl.dot(a, a))\n              ^\n"
           "Input shapes should have M >= 1, N >= 1 and K >= 16")
    from microbench.usercode import error_summary

    CompilationError = type("CompilationError", (Exception,), {})
    text = error_summary(CompilationError(msg))
    assert text.startswith("CompilationError: at 4:50: Input shapes should have M >= 1, N >= 1 and K >= 16")
    assert "tl.store(x, tl.dot(a, a))" in text and text.rstrip().endswith("^")


def test_interpreted_kernels_are_refused():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("this process compiles its kernels")
    from microbench.kernels import launch

    with pytest.raises(AotError, match="interpreter"):
        check_not_interpreted(launch._empty_kernel)


def test_profile_sm_block_is_checked():
    from microbench.hardware import _sm_limits

    good = {"compute_capability": "9.0", "registers_per_sm": 65536, "max_warps_per_sm": 64, "max_blocks_per_sm": 32,
            "max_threads_per_block": 1024, "shared_per_sm": 233472, "shared_per_block": 232448,
            "shared_reserved_per_block": 1024, "source": "a table"}
    assert _sm_limits(good, "p").arch == 90
    for key, bad in [("compute_capability", "sm90"), ("shared_per_block", 0), ("registers_per_sm", "64K"),
                     ("source", ""), ("extra", 1)]:
        with pytest.raises(ConfigError, match=key):
            _sm_limits({**good, key: bad}, "p")


def test_moe_picks_the_targets_tuning_table(monkeypatch, tmp_path):
    from microbench import case as case_mod
    from microbench.cases import moe

    (tmp_path / "nvidia-h200.json").write_text("{}")
    (tmp_path / "nvidia-rtx-pro-6000-blackwell-server-edition.json").write_text("{}")
    monkeypatch.setattr(moe, "TUNING_DIR", str(tmp_path))
    assert moe.device_slug("cpu") == "cpu"
    monkeypatch.setattr(case_mod, "COMPILE_TARGET", load_profile("h200"))
    assert moe.device_slug("cpu") == "nvidia-h200"
    monkeypatch.setattr(case_mod, "COMPILE_TARGET", load_profile("rtx-pro-6000"))
    assert moe.device_slug("cpu") == "nvidia-rtx-pro-6000-blackwell-server-edition"
    # other boards' tables beside it (a GH200, an H200 NVL, a Max-Q) are not the target's
    for other in ("nvidia-gh200-480gb", "nvidia-h200-nvl", "nvidia-rtx-pro-6000-blackwell-max-q-workstation-edition"):
        (tmp_path / f"{other}.json").write_text("{}")
    assert moe.device_slug("cpu") == "nvidia-rtx-pro-6000-blackwell-server-edition"
    monkeypatch.setattr(case_mod, "COMPILE_TARGET", load_profile("h200"))
    assert moe.device_slug("cpu") == "nvidia-h200"


def test_cli_builds_a_suites_kernels_for_h200(tmp_path):
    p, doc = _compile([*ONE_NORM, "--target", "h200"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "rmsnorm._fused_add_rmsnorm_kernel" in p.stdout and "sm_90" in p.stderr
    assert doc["arch"] == 90 and doc["failures"] == []
    (b,) = [b for b in doc["builds"] if b["kernel"] == "rmsnorm._fused_add_rmsnorm_kernel"]
    assert b["registers"] > 0 and b["spill_stores"] == 0 and b["problems"] == [] and b["blocks_per_sm"] >= 1
    assert b["uses"] == {"norm.rmsnorm/triton": 1} and b["config"]["BLOCK"] == 8192  # hidden 7168 -> 8192
    assert b["signature"].startswith("*bf16")  # the verify suite's dtype, compiled, not interpreted


def test_cli_reports_a_build_that_cannot_fit_and_one_that_does_not_compile(tmp_path):
    p, doc = _compile([*ONE_NORM, "--file", f"{KERNELS}::big_tiles", "--variant", "big_tiles"], tmp_path)
    assert p.returncode == 1, p.stderr
    (b,) = doc["builds"]
    assert b["kernel"] == "aot_kernels._big_tiles" and b["shared_bytes"] > H200.shared_per_block
    assert "shared memory" in b["problems"][0] and b["blocks_per_sm"] == 0
    assert "NO: shared memory" in p.stdout and "1 do not fit" in p.stdout

    p, doc = _compile([*ONE_NORM, "--file", f"{KERNELS}::tiny_dot", "--variant", "tiny_dot"], tmp_path)
    assert p.returncode == 1
    (f,) = doc["failures"]  # once, though the user's wrapper re-raises it
    assert f["kernel"] == "aot_kernels._tiny_dot" and "K >= 16" in f["error"] and "tl.dot(a, a)" in f["error"]
    assert "FAILED norm.rmsnorm/tiny_dot" in p.stdout

    p, doc = _compile([*ONE_NORM, "--file", f"{KERNELS}::fits", "--variant", "fits", "--target", "rtx-pro-6000"],
                      tmp_path)
    assert p.returncode == 0, p.stderr
    assert doc["arch"] == 120 and doc["builds"][0]["problems"] == []


@pytest.mark.parametrize(("args", "message"), [
    (["--target", "nope"], "unknown hardware profile 'nope'"),
    (["--case", "norm.rmsnorm", "--axis", "tokens=3"], "axis tokens has no value 3"),
    (["--case", "norm.rmsnorm", "--axis", "bogus=1"], "no selected case has axis bogus"),
    (["--case", "calibration.copy"], "no selected case launches Triton kernels"),
    (["--case", "norm.rmsnorm", "--suite", "nope"], "unknown suite 'nope'"),
    (["--suite", "selftest"], "no selected case launches Triton kernels"),
    (["--case", "norm.rmsnorm", "--variant", "nope"], "unknown variant nope"),
    (["--case", "norm.rmsnorm", "--file", "missing.py::f"], "missing.py: no such file"),
    (["--case", "norm.rmsnorm", "--jobs", "-1"], "--jobs -1: give a number of processes, or 0 for one per core"),
    pytest.param(["--case", "norm.rmsnorm", "--target", "auto"], "--target auto: no CUDA device is visible here",
                 marks=pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="a GPU is visible")),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, message, monkeypatch, capsys):
    # refused before anything is built, so in this process (whose kernels are interpreted)
    from microbench.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the command drops it; put it back after
    assert main(["compile", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_split_rules_read_the_targets_sm_count(monkeypatch):
    """An H100 PCIe has 114 SMs: its decode and verify split counts (which set constexprs
    and argument specialisations) are its own, not the CPU stand-in's 132."""
    import torch

    from microbench.kernels import checks
    from microbench.kernels.mla_common import CPU_SM_STAND_IN, sm_count

    cpu = torch.device("cpu")
    monkeypatch.setattr(checks, "COMPILE_SM_COUNT", 114)
    assert sm_count(cpu) == CPU_SM_STAND_IN == 132  # not while launches run (the interpreter)
    monkeypatch.setattr(checks, "COMPILE_ONLY", True)
    assert sm_count(cpu) == 114 == load_profile("h100-pcie").sm_count.value
    monkeypatch.setattr(checks, "COMPILE_SM_COUNT", None)
    assert sm_count(cpu) == 132


def test_launchers_read_the_targets_shared_memory(monkeypatch):
    from microbench.kernels import checks
    from microbench.kernels.moe_tuning import TuningTable, default_config

    assert checks.shared_memory_per_block("cpu") is None and not checks.small_shared("cpu")
    monkeypatch.setattr(checks, "COMPILE_ONLY", True)
    monkeypatch.setattr(checks, "COMPILE_SHARED_PER_BLOCK", load_profile("rtx-pro-6000").sm.shared_per_block)
    assert checks.small_shared("cpu")
    monkeypatch.setattr(checks, "COMPILE_SHARED_PER_BLOCK", H200.shared_per_block)
    assert not checks.small_shared("cpu")
    monkeypatch.setattr(checks, "COMPILE_SHARED_PER_BLOCK", checks.SMALL_SHARED_PER_BLOCK)
    assert not checks.small_shared("cpu")  # small means below the line
    # the few-token kernel's bf16 w13 tile takes 3 stages only where they fit (144 KiB at 64
    # rows); INT4 read a word at a time needs a fifth of that and keeps 3 everywhere
    big = default_config("few_token", "w13", "bf16", 512, 7168, 4)
    small = default_config("few_token", "w13", "bf16", 512, 7168, 4, small_shared=True)
    assert (big.num_stages, small.num_stages) == (3, 2) and small.block_n == big.block_n
    table = TuningTable("x", [], None)
    assert table.lookup("few_token", "w13", "bf16", 512, 7168, 4, True) == (small, "default")
    int4 = default_config("few_token", "w13", "int4", 512, 7168, 4, small_shared=True)
    assert (int4.num_stages, int4.unpack) == (3, 1)
    assert default_config("fused", "w13+w2", "int4", 512, 7168, 4, small_shared=True).num_stages == 3


def _compile_pair(args_a, args_b, tmp_path):
    """Two compile runs side by side (one per CPU core)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs, outs = [], []
    for i, args in enumerate((args_a, args_b)):
        out = tmp_path / f"c{i}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-m", "microbench", "compile", *args, "--json", str(out)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p, out in zip(procs, outs):
        stdout, stderr = p.communicate(timeout=900)
        results.append((p.returncode, stdout, stderr, json.loads(out.read_text()) if out.exists() else None))
    return results


# The verify suite's launches at the points that pick distinct tiles: q_len 1 (decode),
# 4 (BLOCK_M 32) and 8 (BLOCK_M 64); Kimi-K2.5 TP8 experts at T = 4 and 64 (M_TILE 16 / 64)
# in both weight formats; routing, alignment and norms at all their points.
VERIFY_TILES = ["--case", "attention.mla_verify,moe.experts,moe.router,moe.align,norm.rmsnorm",
                "--axis", "batch=1", "--axis", "context=1024", "--axis", "draft_tokens=1,4,8",
                "--axis", "layout=kimi-tp8", "--axis", "tokens=4,64", "--axis", "routing=router"]


@pytest.mark.slow
def test_every_verify_kernel_builds_and_fits_on_h200_and_rtx_pro_6000(tmp_path):
    (rc_h, _, err_h, h200), (rc_r, _, err_r, rtx) = _compile_pair(
        [*VERIFY_TILES, "--target", "h200"], [*VERIFY_TILES, "--target", "rtx-pro-6000"], tmp_path)
    assert rc_h == 0, err_h
    assert rc_r == 0, err_r  # the 99 KiB blocks of sm_120 take the small-shared tiles
    for doc in (h200, rtx):
        kernels = {b["kernel"] for b in doc["builds"]}
        for k in ("mla_extend._mla_extend_kernel", "mla_verify._mla_verify_split_kernel",
                  "mla_decode._mla_decode_stage1_kernel", "moe_fused._fused_moe_kernel",
                  "moe_few_token._few_w13_kernel", "moe_routing._grouped_topk_kernel"):
            assert k in kernels, (doc["target"], k)
        assert doc["failures"] == [] and all(b["problems"] == [] for b in doc["builds"])
    ext = {d["target"]: [b for b in d["builds"] if b["kernel"] == "mla_extend._mla_extend_kernel"][0]
           for d in (h200, rtx)}
    assert ext["h200-sxm"]["config"]["BLOCK_N"] == 64 and ext["rtx-pro-6000-blackwell"]["config"]["BLOCK_N"] == 32
    # the Hopper tile is what would not launch on sm_120
    assert ext["h200-sxm"]["shared_bytes"] > load_profile("rtx-pro-6000").sm.shared_per_block


def test_ptxas_report_is_parsed():
    from microbench.aot import _from_ptxas_log

    log = ("ptxas info    : Compiling entry function '_k' for 'sm_90a'\n"
           "ptxas info    : Function properties for _k\n"
           "    40 bytes stack frame, 36 bytes spill stores, 32 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 40 bytes cumulative stack size\n")
    assert _from_ptxas_log(log) == (255, 40, 36, 32)
    assert _from_ptxas_log("") is None


def test_a_cached_build_is_read_from_its_cubin(tmp_path):
    # a build Triton already holds was not reported on by ptxas: registers come from cuobjdump
    script = f"""
import json, os, torch
from microbench.aot import compile_only
from microbench.hardware import load_profile
from microbench.kernels.rmsnorm import rmsnorm
sm = load_profile("h200").sm
x, w = torch.randn(2, 512, dtype=torch.bfloat16), torch.randn(512, dtype=torch.bfloat16)
out = []
for _ in range(2):
    with compile_only(sm, cache_dir={str(tmp_path)!r}) as s:
        rmsnorm(x, w, 1e-6)
    (b,) = s.builds.values()
    out.append([b.registers, b.stack, b.spill_stores])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    first, again = json.loads(p.stdout.strip().splitlines()[-1])
    assert first[0] > 0 and first[2] == 0  # from ptxas: registers and spills
    assert again[0] == first[0] and again[1] == first[1] and again[2] is None  # from the cubin: no spill count


def test_a_profile_without_sm_limits_is_refused(tmp_path):
    doc = json.load(open(os.path.join(ROOT, "cases", "hardware", "h200-sxm.json")))
    del doc["sm"]
    path = tmp_path / "no-sm.json"
    path.write_text(json.dumps(doc))
    p, _ = _compile(["--target", str(path), "--case", "norm.rmsnorm"], tmp_path, timeout=120)
    assert p.returncode == 2 and "has no 'sm' block" in p.stderr and "Traceback" not in p.stderr


def test_baseline_shows_what_a_change_did_to_each_build(tmp_path, monkeypatch, capsys):
    from microbench.cli import main
    from microbench.cli_compile import diff

    p, doc = _compile(ONE_NORM, tmp_path)
    assert p.returncode == 0, p.stderr
    (b,) = doc["builds"]
    assert diff(doc["builds"], doc["builds"], "text")[1] == {"changed": 0, "added": 0, "removed": 0, "same": 1}
    # the same build with fewer registers before, and a build that no longer exists
    gone = {**b, "config": {**b["config"], "BLOCK": 4096}}
    old = {**doc, "builds": [{**b, "registers": b["registers"] - 5, "spill_stores": 8}, gone]}
    base = tmp_path / "base.json"
    base.write_text(json.dumps(old))
    p, _ = _compile([*ONE_NORM, "--baseline", str(base)], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "1 changed, 0 added (+), 1 removed (-), 0 the same" in p.stdout
    assert f"{b['registers'] - 5} -> {b['registers']}" in p.stdout and "8 -> 0" in p.stdout
    assert "BLOCK=4096" in p.stdout
    # a report for another target, or not a report at all, is refused before anything builds
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["compile", *ONE_NORM, "--baseline", str(base), "--target", "rtx-pro-6000"]) == 2
    assert "built for sm_90, not sm_120" in capsys.readouterr().err
    (tmp_path / "other.json").write_text(json.dumps({"schema": "microbench.result"}))
    assert main(["compile", *ONE_NORM, "--baseline", str(tmp_path / "other.json")]) == 2
    assert "not a microbench compile report" in capsys.readouterr().err


def test_sessions_of_several_processes_add_up():
    from microbench.aot import Failure, Session

    mine = Session(H200)
    a = _build(hash="x", uses={"c/v": 2}, max_grid=4, spill_stores=None, spill_loads=None, registers=30, stack=0)
    mine.absorb([a], [])
    # the same build from a process that compiled it (ptxas' report) and one only the other made
    b = _build(hash="x", uses={"c/v": 1, "d/v": 1}, max_grid=9, spill_stores=8, spill_loads=4, registers=40, stack=16)
    other = _build(hash="y", uses={"d/v": 3})
    mine.absorb([b, other], [Failure("c/v p", "boom")])
    x = mine.builds["x"]
    assert x.uses == {"c/v": 3, "d/v": 1} and x.max_grid == 9
    assert (x.registers, x.stack, x.spill_stores, x.spill_loads) == (40, 16, 8, 4)
    assert mine.builds["y"] is other and [f.error for f in mine.failures] == ["boom"]


NORMS = ["--case", "norm.rmsnorm", "--axis", "norm=input,q_a"]


def test_worker_processes_build_what_one_process_builds(tmp_path):
    (rc1, out1, err1, serial), (rc2, out2, err2, parallel) = _compile_pair(
        NORMS, [*NORMS, "--jobs", "2"], tmp_path)
    assert rc1 == 0 and rc2 == 0, (err1, err2)
    assert "2 processes" in err2 and " 1 process:" not in err2
    assert "] norm.rmsnorm: point " in err2  # each worker names each point it takes

    def by_hash(doc):
        return {b["hash"]: {k: b[k] for k in ("kernel", "uses", "registers", "spill_stores", "max_grid")}
                for b in doc["builds"]}

    # every point built once, by one worker or the other: the same builds, uses and ptxas reports
    assert by_hash(parallel) == by_hash(serial) and len(serial["builds"]) >= 2
    summary = [ln for ln in out1.splitlines() if " calls: " in ln]
    assert summary == [ln for ln in out2.splitlines() if " calls: " in ln] and "from 16 calls" in summary[0]


def test_a_dead_worker_is_a_failure_not_a_hang(tmp_path):
    p, doc = _compile(["--case", "norm.rmsnorm", "--axis", "norm=input", "--file", f"{KERNELS}::dies",
                       "--variant", "dies", "--jobs", "2"], tmp_path, timeout=300)
    assert p.returncode == 1, p.stderr
    assert doc["failures"] and all("a worker process died" in f["error"] for f in doc["failures"])
    assert "FAILED worker 1/2: a worker process died" in p.stdout


def test_into_cache_leaves_the_builds_where_a_run_looks(tmp_path):
    """--into-cache builds into Triton's own cache directory: a later launch of the same
    kernels for the same architecture (here a second build, through the same launch path a
    GPU run takes) finds each there instead of compiling it, so ptxas reports nothing."""
    cache = tmp_path / "triton-cache"
    env = {"TRITON_CACHE_DIR": str(cache)}
    args = [*ONE_NORM, "--axis", "tokens=1,4", "--into-cache"]
    first, doc = _compile(args, tmp_path, out=tmp_path / "first.json", env=env)
    assert first.returncode == 0, first.stderr
    assert f"into Triton's cache ({cache})" in first.stderr
    built = doc["builds"]
    cubins = [f for _, _, files in os.walk(cache) for f in files if f.endswith(".cubin")]
    assert built and len(cubins) == len(built)
    again, doc = _compile(args, tmp_path, out=tmp_path / "again.json", env=env)
    assert again.returncode == 0, again.stderr
    found = doc["builds"]
    assert [b["hash"] for b in found] == [b["hash"] for b in built]
    assert all(b["spill_stores"] is None and b["registers"] for b in found)  # read from the cubins
    assert "unknown ('?')" in again.stdout
    # so --fail-on-spill cannot call them free of spills
    strict, _ = _compile([*args, "--fail-on-spill"], tmp_path, out=tmp_path / "strict.json", env=env)
    assert strict.returncode == 1 and "came from a cache, where ptxas reports no spills" in strict.stderr
    # without --into-cache the command keeps to a private cache: Triton's own is left alone
    private, _ = _compile(ONE_NORM, tmp_path, out=tmp_path / "private.json",
                          env={"TRITON_CACHE_DIR": str(tmp_path / "no")})
    assert private.returncode == 0 and not (tmp_path / "no").exists()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_stopping_the_command_stops_its_workers(tmp_path, sig):
    """SIGTERM (as Ctrl-C) ends the command at once with one line, its workers with it, not
    after their share; a SIGKILL, which the command cannot see, ends them too (each asks the
    kernel for a SIGTERM when its parent goes)."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, "-m", "microbench", "compile", "--suite", "verify", "--jobs", "2"], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = []
    try:
        for line in p.stderr:  # a worker has taken a point
            if "] " in line and ": point " in line:
                break
        children = _children(p.pid)
        assert len(children) >= 2, children
        p.send_signal(getattr(signal, sig))
        p.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)]
    finally:
        for c in [p.pid, *children]:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
    err = p.stderr.read()  # every writer has gone
    if sig == "SIGTERM":
        assert p.returncode == 130 and "microbench compile: interrupted (signal 15) after" in err, err[-2000:]
        assert "Traceback" not in err


def _children(pid):
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def test_target_auto_is_the_profile_of_the_gpu_present(monkeypatch):
    import torch

    from microbench.cli import UsageError
    from microbench.cli_compile import _target

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert _target("auto").name == "h100-sxm"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert _target("auto").name == "h200-sxm" and _target("rtx-pro-6000").sm.arch == 120
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(UsageError, match="no shipped profile matches Tesla T4"):
        _target("auto")
