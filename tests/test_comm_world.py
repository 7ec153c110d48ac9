"""The one-rank world of ``microbench run --nproc 1`` and what the allreduce paths keep per
process group: the world (and the symmetric-memory probe) only after every other case is
timed and on disk, the result file closed before the world is left, the variants as the
kernel functions themselves, torch-oop's one-rank time named a copy, CuPy without NCCL or
with a communicator that could not be made, and the per-group caches dropped on close."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

from microbench import distributed
from microbench.cases import comm
from microbench.cases.comm import ONE_RANK_COPY_NOTE, PATHS, TORCH_OOP_NOTE, AllReduceCase, AllReduceSweepCase
from microbench.cli import main
from microbench.kernels import allreduce
from microbench.planning import RunOptions, plan
from microbench.report import render
from microbench.runner import Runner
from microbench.timing import TimingOptions

from .helpers import DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = TimingOptions(budget_s=0.05, max_noise=0.05)


@pytest.fixture(scope="module")
def solo():
    return distributed.solo_world(DEVICE)  # gloo on CPU, NCCL on a GPU


def _doc(d):
    (path,) = glob.glob(os.path.join(str(d), "*.json"))
    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------------- the world starts last

#: A fresh process (no process group yet, as on the GPU host): ``microbench run`` of a
#: single-rank case and the allreduce at --nproc 1, noting the world size the plan's count
#: and the pacing read, what is on disk when the world starts, and when the symmetric-memory
#: probe runs (made to look available, then refused).
_LATE_WORLD = r"""
import glob, json, sys
import torch.distributed as dist
from microbench import cli, distributed, planning, runner
from microbench.kernels import allreduce

out, events = sys.argv[1], []
real_init, real_planned_runs, real_pace = distributed.init_world, planning.planned_runs, runner.Pace

def planned_runs(*args):
    events.append(["count", distributed.world_size(), dist.is_initialized()])
    return real_planned_runs(*args)

def pace(*args, **kwargs):
    events.append(["pace", distributed.world_size(), dist.is_initialized()])
    return real_pace(*args, **kwargs)

def init_world(*args, **kwargs):
    (path,) = glob.glob(out + "/*.json")
    with open(path) as f:
        events.append(["init", [[r["case"], r["status"], (r.get("timing") or {}).get("passes")]
                                for r in json.load(f)["records"]]])
    return real_init(*args, **kwargs)

def symm_try(group, device):
    events.append(["probe", dist.is_initialized()])
    raise RuntimeError("no fabric on this host")

distributed.init_world, planning.planned_runs, runner.Pace = init_world, planned_runs, pace
allreduce.symm_unavailable = lambda kind, path: None
allreduce.symm_try = symm_try
rc = cli.main(["run", "--device", "cpu", "--case", "comm.allreduce,calibration.copy", "--nproc", "1",
               "--budget-s", "0.02", "--repeat", "2", "--no-probe", "--no-table", "--out", out])
print(json.dumps({"rc": rc, "events": events}))
"""


def test_the_one_rank_world_starts_after_every_other_case_is_timed_and_on_disk(tmp_path):
    """A hang or a poisoned CUDA context in the world's start or the symmetric-memory probe
    can cost the allreduce points alone: neither runs at plan time, and by the time the
    world starts every pass of the single-rank case is done and written. The plan's count
    and the pacing read the size the world will have, before it exists."""
    p = subprocess.run([sys.executable, "-c", _LATE_WORLD, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0
    count, pace, (init, on_disk), probe = got["events"]
    assert count == ["count", 1, False] and pace == ["pace", 1, False]  # the size to come, no world yet
    assert init == "init" and len(on_disk) == 1
    case, status, passes = on_disk[0]
    assert (case, status, len(passes)) == ("calibration.copy", "OK", 2)  # both passes pooled, on disk
    assert probe == ["probe", True]  # once, on the world that exists
    assert "3 points (5 variant runs) x 2 passes" in p.stderr  # the copy; torch-ip, torch-oop at 2 sizes (CPU)
    lines = p.stderr.splitlines()
    first_comm = next(i for i, line in enumerate(lines) if "comm.allreduce" in line)
    assert any("(pass 2/2) calibration.copy" in line for line in lines[:first_comm])
    recs = _doc(tmp_path)["records"]
    oneshot = [r for r in recs if r["variant"].startswith("oneshot")]
    assert oneshot and all(r["status"] == "SKIPPED" and "no fabric on this host" in r["reason"] for r in oneshot)
    assert {r["status"] for r in recs if r["variant"].startswith("torch")} == {"OK"}


def test_a_plan_counts_the_skips_of_the_world_it_will_start(monkeypatch):
    """On a GPU, before its world of one exists, the plan already counts two-shot (built for
    2, 4, 8 ranks) and NCCL's in-place graph (empty over one rank) as skipped, and probes
    no symmetric memory; with no world expected the size is unknown, as in ``--plan``."""
    from microbench.planning import planned_runs

    def probe(group, device):
        raise AssertionError("probed while planning")

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(allreduce, "cupy_unavailable", lambda kind: "no CuPy here")
    monkeypatch.setattr(allreduce, "symm_unavailable", lambda kind, path: None)
    monkeypatch.setattr(allreduce, "symm_try", probe)
    p = plan([AllReduceSweepCase()], RunOptions(suite="verify", device="cuda", axis_picks={"bytes": ["8"]}))
    assert len(p.items) == 2  # eager, graph
    assert planned_runs(p, [], "cuda") == (12, 4)  # torch, one-shot, two-shot x ip, oop x 2; cupy skipped
    with distributed.expecting(1):
        # eager: torch-ip, torch-oop, oneshot-ip, oneshot-oop; graph: the same less torch-ip
        assert distributed.world_size() == 1 and planned_runs(p, [], "cuda") == (7, 9)
    assert distributed.world_size() is None


def test_run_plan_counts_the_skips_of_the_world_size_it_names(capsys):
    """``run --plan`` reads the world size its --nproc gives (1 here): two-shot and NCCL's
    in-place graph count as not run, as the run itself will count them."""
    assert main(["run", "--suite", "verify", "--device", "cuda", "--plan", "--case", "comm.allreduce_sweep",
                 "--axis", "bytes=8", "--nproc", "1"]) == 0
    out = capsys.readouterr().out
    assert "world size 1: NCCL's in-place sum over one rank launches no work" in out
    assert "two_shot_all_reduce_out is built for world sizes 2, 4, 8 only (this one: 1)" in out or \
        "symmetric memory" in out  # a torch without the op says that first
    assert distributed._expected is None  # the expected size was the plan's alone


def test_the_result_file_is_closed_before_the_world_and_a_failing_close_keeps_it(solo, monkeypatch, tmp_path,
                                                                                   capsys):
    """destroy_process_group can fail or hang on a broken NCCL: the file is complete by
    then, and a close that raises is a warning on stderr, not a lost or incomplete run."""
    seen = []

    def close(self):
        seen.append(_doc(tmp_path)["run"]["complete"])
        raise RuntimeError("NCCL error in destroy_process_group")

    monkeypatch.setattr(distributed.World, "close", close)
    assert main(["run", "--device", "cpu", "--case", "comm.allreduce_sweep", "--axis", "bytes=8",
                 "--variant", "torch-ip,torch-oop", "--nproc", "1", "--budget-s", "0.02", "--repeat", "1",
                 "--no-probe", "--out", str(tmp_path)]) == 0
    assert seen == [True]  # the world was left once, its file already complete
    err = capsys.readouterr().err
    assert "warning: closing the process group failed (RuntimeError: NCCL error in destroy_process_group)" in err
    assert "results: " in err and _doc(tmp_path)["run"]["complete"] is True


# --------------------------------------------------------------------------- the variants


def test_each_variant_is_the_kernel_function_itself():
    """No wrapper on the timed call: an import and a lookup per call (~1 µs) would inflate
    an eager one-rank allreduce row."""
    fns = {v.name: v.fn for v in AllReduceSweepCase().variants()}
    for path, ip, oop, _ in PATHS:
        assert fns[f"{path}-ip"] is getattr(allreduce, ip) and fns[f"{path}-oop"] is getattr(allreduce, oop)


def test_torch_out_of_place_is_named_a_copy_and_at_one_rank_mostly_one(solo):
    """torch-oop copies its input into its fresh output, then sums that in place: its record
    says so at every world size (cupy-oop is NCCL's own out-of-place sum), and over one rank,
    where the sum does nothing, that it is mostly the copy; the table marks its time."""
    opts = RunOptions(suite="smoke", device=solo.device, timing=FAST, probe=False, world=solo,
                      axis_picks={"bytes": ["8"], "capture": ["eager"]}, variants=["torch-ip", "torch-oop"])
    got = Runner(opts, None, progress=lambda line: None).run(plan([AllReduceSweepCase()], opts))
    recs = {r["variant"]: r for r in got}
    assert recs["torch-oop"]["status"] == "OK"
    assert recs["torch-oop"]["timing"]["notes"][-2:] == [TORCH_OOP_NOTE, ONE_RANK_COPY_NOTE]
    assert not {TORCH_OOP_NOTE, ONE_RANK_COPY_NOTE} & set(recs["torch-ip"]["timing"]["notes"])
    text = render({"run": {"device": solo.device, "suite": "smoke"}, "fingerprint": {}, "records": got})
    line = next(row for row in text.splitlines() if " torch " in f" {row} ")
    assert re.search(r"\d \[1\] \[2\]", line) and f"\n[1] {TORCH_OOP_NOTE}" in text, text
    wide = {"variant": "torch-oop", "status": "OK", "facts": {"world_size": 2}, "timing": {"notes": []}}
    AllReduceSweepCase().derive([wide])
    assert wide["timing"]["notes"] == [TORCH_OOP_NOTE]
    AllReduceSweepCase().derive([recs["torch-oop"]])  # derived again (a later pass): noted once
    assert recs["torch-oop"]["timing"]["notes"].count(ONE_RANK_COPY_NOTE) == 1


@pytest.mark.gpu
def test_an_out_of_place_path_that_leaves_its_fresh_output_unwritten_fails_at_one_rank(solo):
    """Over one rank the sum is the input: a freed block of the input's size (torch-oop's
    output before it, the reference's draw) holds it, and the caching allocator hands such
    a block to the next fresh output. The gate fills those blocks with NaN first."""
    from microbench.case import Variant

    class Lazy(AllReduceSweepCase):
        def variants(self):
            real = [v for v in super().variants() if v.name == "torch-oop"]
            return real + [Variant("lazy-oop", lambda x, group: torch.empty_like(x),
                                   tags={"path": "lazy", "placement": "out-of-place"})]

    opts = RunOptions(suite="smoke", device=solo.device, timing=FAST, probe=False, world=solo,
                      axis_picks={"bytes": ["1M"], "capture": ["eager"]})
    recs = {r["variant"]: r for r in Runner(opts, None, progress=lambda line: None).run(plan([Lazy()], opts))}
    assert recs["torch-oop"]["status"] == "OK", recs["torch-oop"]["reason"]
    assert recs["lazy-oop"]["status"] == "FAILED" and recs["lazy-oop"]["wrong"] > 0, recs["lazy-oop"]


# --------------------------------------------------------------------------- CuPy's NCCL


def test_cupy_without_an_nccl_it_can_load_says_so(monkeypatch):
    """CuPy imports cupy.cuda.nccl without NCCL, with ``available`` False and no functions:
    the reason says that, not "AttributeError: ... get_version"."""
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = False
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    for name, mod in {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    reason = allreduce.cupy_unavailable.__wrapped__("cuda")  # not the cached answer of this host
    assert "cupy.cuda.nccl.available is False" in reason and "AttributeError" not in reason
    nccl.available, nccl.get_version = True, lambda: 22703
    assert allreduce.cupy_unavailable.__wrapped__("cuda") is None


def test_a_cupy_communicator_that_fails_is_not_tried_again(solo, monkeypatch):
    """Its error is kept per group: the point after the one that failed skips at once, with
    it, instead of repeating the broadcast and ncclCommInitRank."""
    tries = []

    def init(self, group):
        tries.append(group)
        raise RuntimeError("NCCL error: unhandled system error\nmore detail")

    monkeypatch.setattr(allreduce.CupyNccl, "_by_group", {})
    monkeypatch.setattr(allreduce.CupyNccl, "__init__", init)
    monkeypatch.setattr(allreduce, "cupy_unavailable", lambda kind: None)
    group = dist.group.WORLD
    case = AllReduceCase()
    at = {"tokens": 1, "dtype": "bf16", "capture": "eager"}
    assert case.skip_variant("cupy-ip", at, "cuda") is None  # not tried yet
    x = torch.ones(4)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="NCCL error: unhandled system error"):
            allreduce.cupy_inplace(x, group)
    assert len(tries) == 1
    why = "the CuPy NCCL communicator could not be made (RuntimeError: NCCL error: unhandled system error)"
    assert allreduce.CupyNccl.failed(group) == why
    assert case.skip_variant("cupy-oop", at, "cuda") == why and case.skip_variant("cupy-ip", at, "cuda") == why


# --------------------------------------------------------------------------- closing the world


def test_closing_the_world_drops_what_was_kept_per_group_before_destroying_it(monkeypatch, capsys):
    """The caches are keyed by id(group), which outlives the group: World.close empties them
    (CuPy communicators destroyed) while the group still exists; a communicator whose
    destroy fails is a warning, and the group is destroyed all the same."""
    destroyed, at_destroy = [], []

    class Comm:
        def __init__(self, fail=False):
            self.fail = fail

        def destroy(self):
            destroyed.append(self)
            if self.fail:
                raise RuntimeError("ncclCommDestroy failed")

    def communicator(fail=False):
        c = object.__new__(allreduce.CupyNccl)
        c.comm = Comm(fail)
        return c

    def destroy_process_group():
        at_destroy.append((dict(allreduce.CupyNccl._by_group), dict(allreduce.SymmBuffer._by_key),
                           dict(comm._symm_setup)))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)
    for fail in (False, True):
        good = communicator(fail)
        monkeypatch.setattr(allreduce.CupyNccl, "_by_group", {1: good, 2: "could not be made"})
        monkeypatch.setattr(allreduce.SymmBuffer, "_by_key", {(1, torch.bfloat16, "cuda:0"): object()})
        monkeypatch.setattr(comm, "_symm_setup", {(1, "cuda:0"): None})
        world = distributed.World(0, 1, 0, "gloo", "cpu", object(), object(), None, "in-process", 5.0)
        world.close()
        assert destroyed[-1] is good.comm and at_destroy[-1] == ({}, {}, {})
    assert len(at_destroy) == 2  # the failing destroy did not keep the group
    assert "releasing per-group state failed (RuntimeError: ncclCommDestroy failed)" in capsys.readouterr().err
