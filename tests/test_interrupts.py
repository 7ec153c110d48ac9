"""Ctrl-C, SIGTERM and SIGKILL during a run: the finished points kept in a file marked
incomplete, the command's exit 130, and no ranks left running after their run."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import microbench.cases as cases_pkg
from microbench.case import Variant
from microbench.cli import main

from .helpers import ROOT, Scaled


def _files(d):
    return sorted(glob.glob(os.path.join(str(d), "*.json")))


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


def _marked(mark):
    """PIDs of live processes whose environment holds ``mark``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark.encode() in env and state != "Z":
            found.append(int(pid))
    return found


@pytest.mark.multirank
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_run_killed_outright_leaves_no_ranks_running(tmp_path):
    """SIGKILL to `run --nproc 2` (no handler runs): torchrun and its ranks end with it."""
    mark = f"MICROBENCH_TEST_MARK={os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", mark.split("=")[0]: mark.split("=")[1]}
    p = subprocess.Popen([sys.executable, "-m", "microbench", "run", "--device", "cpu", "--case", "comm.allreduce_sweep",
                          "--nproc", "2", "--budget-s", "20", "--repeat", "1", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if "[1/" in line and "comm." in line:  # the ranks are running their first point
            break
    assert len(_marked(mark)) >= 3  # this run, torchrun, its ranks
    p.kill()
    p.wait()
    deadline = time.monotonic() + 45  # the ranks had minutes of timing left
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _marked(mark), "processes of the killed run still running"
