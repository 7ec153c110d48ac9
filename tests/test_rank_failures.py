"""A rank that misbehaves in a multi-rank run (tests/dist_worker.py under torchrun, 2 gloo
ranks): a wrong sum, a result in the wrong place, an error after the collective or in its
set-up, a rank that dies and one that quietly leaves. The variant fails on every rank and
the run goes on, or every rank stops quickly and the result file is kept."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from microbench import distributed

from .helpers import ROOT, SUBPROCESS_ENV as ENV, only_result as _doc


def _worker(mode, out, nproc=2, timeout_s=20):
    cmd = distributed.torchrun_command(nproc, [])[:-3] + [os.path.join(ROOT, "tests", "dist_worker.py"), mode,
                                                          str(out), str(timeout_s)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=240)
    return p, time.monotonic() - t0


def _records(mode, out):
    """The records of a worker run in ``mode`` that finished (exit 0)."""
    p, _ = _worker(mode, out)
    assert p.returncode == 0, p.stderr[-3000:]
    return _doc(out)["records"]


@pytest.mark.multirank
def test_a_rank_with_a_wrong_sum_fails_the_variant_everywhere_and_the_run_goes_on(tmp_path):
    recs = _records("wrong", tmp_path)
    odd = [r for r in recs if r["variant"] == "odd"]
    assert [r["status"] for r in odd] == ["FAILED", "FAILED"] and [r["wrong"] for r in odd] == [1, 1]
    assert all("rank 1:" in r["reason"] for r in odd)
    assert [r["status"] for r in recs if r["variant"] == "torch-ip"] == ["OK", "OK"]


@pytest.mark.multirank
def test_a_variant_that_sums_out_of_place_under_an_in_place_tag_is_failed(tmp_path):
    # the right sum, returned: but its input, which an in-place sum overwrites, still holds
    # the rank's own values
    recs = _records("out-of-place", tmp_path)
    assert [r["status"] for r in recs] == ["OK", "FAILED", "OK", "FAILED"]
    assert recs[1]["reason"].startswith("incorrect: rank 0: x (4,) bfloat16: 4/4 elements off")
    assert [rep["name"] for rep in recs[1]["correctness"]["reports"]] == ["out", "x"]


@pytest.mark.multirank
def test_a_rank_that_raises_after_the_collective_fails_the_variant_not_the_run(tmp_path):
    recs = _records("raise-after", tmp_path)
    assert [r["status"] for r in recs] == ["OK", "FAILED", "OK", "FAILED"]
    assert "rank 1: RuntimeError: raised after the collective" in recs[1]["reason"]


@pytest.mark.multirank
def test_a_rank_whose_set_up_fails_fails_the_variant_before_any_rank_enters_its_collective(tmp_path):
    # the ranks agree on set-up before the call: the others never wait in a collective the
    # failing rank will not enter (which would stop the run on their timeout)
    p, elapsed = _worker("setup-raise", tmp_path, timeout_s=30)
    assert p.returncode == 0 and elapsed < 30, p.stderr[-3000:]
    doc = _doc(tmp_path)
    assert doc["run"]["complete"] is True
    assert [r["status"] for r in doc["records"]] == ["OK", "FAILED", "OK", "OK"]
    assert doc["records"][1]["reason"] == "rank 1: RuntimeError: set-up failed on the last rank"


@pytest.mark.multirank
def test_a_rank_that_dies_stops_every_rank_quickly_and_keeps_the_file(tmp_path):
    p, elapsed = _worker("exit", tmp_path)
    assert p.returncode != 0 and elapsed < 60
    assert "exitcode" in p.stderr and "7" in p.stderr  # torchrun names the rank that died
    doc = _doc(tmp_path)
    assert doc["run"]["complete"] is False


@pytest.mark.multirank
def test_a_rank_that_quietly_leaves_is_noticed_within_the_timeout(tmp_path):
    p, elapsed = _worker("exit0", tmp_path, timeout_s=4)
    assert p.returncode != 0 and elapsed < 60, p.stderr[-2000:]
    assert "rank(s) 1 did not reach" in p.stderr and "stopping every rank" in p.stderr
    doc = _doc(tmp_path)
    assert doc["run"]["complete"] is False and "did not reach" in doc["run"]["error"]
