"""The allreduce cases and the multi-rank runner: exact sums, lock-step timing, the
torchrun launcher with 2 and 8 gloo ranks, the cross-rank merge, and every bad input
(a rank that misbehaves: tests/test_rank_failures.py)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest
import torch

from microbench import distributed
from microbench.cases.comm import AllReduceCase, AllReduceSweepCase, allreduce_times, parse_bytes
from microbench.cli import main
from microbench.kernels.allreduce import allreduce_ref, rank_input, value_range
from microbench.planning import RunOptions, plan
from microbench.report import collective_tables, render
from microbench.runner import Runner
from microbench.timing import TimingOptions, measure

from .helpers import DEVICE, ROOT, SUBPROCESS_ENV
from .helpers import only_result as _doc

ENV = SUBPROCESS_ENV
FAST = TimingOptions(budget_s=0.05, max_noise=0.05)


def _files(d):
    return sorted(glob.glob(os.path.join(str(d), "*.json")))


# --------------------------------------------------------------------------- inputs, reference


@pytest.mark.parametrize(("text", "want"), [("8", 8), ("4K", 4096), ("1MiB", 1 << 20), ("64M", 64 << 20),
                                             ("2 kb", 2048)])
def test_sizes_parse_with_units(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize(("text", "message"), [("3", "multiple of the element size"), ("0", "positive multiple"),
                                                ("1.5K", "not a size"), ("8X", "not a size")])
def test_bad_sizes_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(text)


def test_a_world_too_large_for_exact_sums_is_refused(monkeypatch):
    assert value_range(64, torch.bfloat16) == 4 and value_range(100, torch.bfloat16) == 2
    assert value_range(300, torch.bfloat16) == 0
    with pytest.raises(ValueError, match="world size 300"):
        rank_input(8, 0, 300, 0, torch.bfloat16, "cpu")
    import torch.distributed as dist

    world = [300]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world[0])
    point = {"tokens": 1, "dtype": "bf16", "capture": "eager"}
    assert AllReduceCase().skip(point, "cpu") == ("world size 300: no integer input keeps a bf16 sum exact "
                                                  "beyond 256 ranks")
    world[0] = 256
    assert AllReduceCase().skip(point, "cpu") is None


def test_the_model_case_takes_hidden_from_the_config_and_the_sweep_any_size():
    c = AllReduceCase()
    assert c._count({"tokens": 4, "dtype": "bf16"}) == (4 * 7168, torch.bfloat16)
    assert c.axes("verify", "cuda")["tokens"] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert c.axes("verify", "cuda")["capture"] == ["eager", "graph"] and c.axes("smoke", "cpu")["capture"] == ["eager"]
    s = AllReduceSweepCase()
    sweep = s.axes("verify", "cuda")["bytes"]
    assert sweep[0] == 8 and sweep[-1] == 64 << 20 and len(sweep) == 24
    assert s.parse_axis_value("bytes", "3K") == 3072
    with pytest.raises(ValueError):
        s.parse_axis_value("bytes", "3")
    assert s.skip({"bytes": 8, "dtype": "bf16", "capture": "graph"}, "cpu") == "CUDA graphs need a CUDA device"
    names = [v.name for v in s.variants()]
    assert names == ["torch-ip", "torch-oop", "cupy-ip", "cupy-oop", "oneshot-ip", "oneshot-oop", "twoshot-ip",
                     "twoshot-oop"]
    point = {"bytes": 8, "dtype": "bf16", "capture": "eager"}
    for n in names[2:]:  # no GPU here: each says why
        assert "CUDA" in s.skip_variant(n, point, "cpu")
    assert s.skip_variant("torch-ip", point, "cpu") is None


# --------------------------------------------------------------------------- a world of one, in process


@pytest.fixture(scope="module")
def solo():
    return distributed.solo_world(DEVICE)  # gloo on CPU, NCCL on a GPU


def test_world_of_one_runs_both_torch_paths_gated_and_timed(solo):
    case = AllReduceSweepCase()
    opts = RunOptions(suite="smoke", device=solo.device, timing=FAST, probe=False, world=solo,
                      axis_picks={"bytes": ["8", "3000"], "capture": ["eager"]}, variants=["torch-ip", "torch-oop"])
    recs = Runner(opts, None, progress=lambda line: None).run(plan([case], opts))
    ok = [r for r in recs if r["status"] == "OK"]
    assert {(r["axes"]["bytes"], r["variant"]) for r in ok} == {(8, "torch-ip"), (8, "torch-oop"),
                                                                (3000, "torch-ip"), (3000, "torch-oop")}
    for r in ok:
        assert r["wrong"] == 0 and r["facts"]["world_size"] == 1 and r["facts"]["count"] == r["axes"]["bytes"] // 2
        assert r["timing"]["mode"] == "hot" and r["ranks"][0]["rank"] == 0 and r["tags"]["path"] == "torch"
    times = allreduce_times(recs)
    assert times[("torch-ip", "eager", 1)] == sorted(times[("torch-ip", "eager", 1)]) and len(times) == 2
    text = render({"run": {"device": solo.device, "suite": "smoke"}, "fingerprint": {}, "records": recs})
    assert f"== comm.allreduce_sweep == eager, 1 rank(s) ({solo.backend})" in text and "busbw (GB/s)" in text


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's reasons")
def test_paths_that_need_a_gpu_say_so_under_the_table(solo):
    opts = RunOptions(suite="smoke", device="cpu", timing=FAST, probe=False, world=solo, axis_picks={"bytes": ["8"]},
                      variants=["torch-ip", "cupy-ip", "oneshot-oop"])
    recs = Runner(opts, None, progress=lambda line: None).run(plan([AllReduceSweepCase()], opts))
    text = render({"run": {"device": "cpu", "suite": "smoke"}, "fingerprint": {}, "records": recs})
    assert "not run: cupy: NCCL through CuPy needs CUDA devices" in text
    assert "not run: oneshot: symmetric memory needs CUDA devices" in text


@pytest.mark.gpu
def test_every_path_on_one_gpu_eager_and_in_a_graph(solo):
    """World size 1 on the GPU: each path's fixed cost per call, eager and replayed. torch's
    path must pass; CuPy and symmetric memory pass or say why they cannot run here."""
    opts = RunOptions(suite="verify", device=solo.device, timing=FAST, probe=False, world=solo,
                      axis_picks={"bytes": ["8", "1M"]})
    recs = Runner(opts, None, progress=lambda line: None).run(plan([AllReduceSweepCase()], opts))
    assert len(recs) == 2 * 2 * 8
    for r in recs:
        if r["variant"] == "torch-ip" and r["axes"]["capture"] == "graph":
            assert r["status"] == "SKIPPED" and "launches no work" in r["reason"]
        elif r["variant"].startswith("torch"):
            assert r["status"] == "OK", r["reason"]
        else:
            assert r["status"] in ("OK", "SKIPPED"), (r["variant"], r["axes"], r["reason"])
        if r["status"] == "OK":
            assert r["wrong"] == 0 and r["timing"]["mode"] == {"eager": "hot", "graph": "graph"}[r["axes"]["capture"]]


def test_an_in_place_nccl_sum_over_one_rank_is_not_timed_in_a_graph(solo):
    """NCCL returns at once for an in-place sum over one rank: a graph of it holds no work,
    and its replay time would read as a free allreduce. Eager and out of place still run."""
    case = AllReduceCase()
    at = {"tokens": 4, "dtype": "bf16"}
    for variant in ("torch-ip", "cupy-ip"):
        reason = case.skip_variant(variant, {**at, "capture": "graph"}, "cuda")
        assert reason is not None
        if variant == "torch-ip":  # (CuPy may be missing here: then that is its reason)
            assert "world size 1" in reason and "launches no work" in reason
    assert case.skip_variant("torch-ip", {**at, "capture": "eager"}, "cuda") is None
    assert case.skip_variant("torch-oop", {**at, "capture": "graph"}, "cuda") is None


def test_cupys_in_place_sum_over_one_rank_is_not_timed_in_a_graph_either(solo, monkeypatch):
    """CuPy's path is NCCL too: where it can run, its in-place graph at world size 1 is
    skipped for the same reason as torch's, its out-of-place one is not."""
    from microbench.kernels import allreduce

    monkeypatch.setattr(allreduce, "cupy_unavailable", lambda kind: None)
    monkeypatch.setattr(allreduce.CupyNccl, "_by_group", {})
    case, at = AllReduceCase(), {"tokens": 4, "dtype": "bf16", "capture": "graph"}
    assert "launches no work" in case.skip_variant("cupy-ip", at, "cuda")
    assert case.skip_variant("cupy-oop", at, "cuda") is None


def test_symmetric_memory_is_probed_only_in_a_world_of_one(solo, monkeypatch):
    """In a larger world the probe's rendezvous is collective: a rank probing alone while
    its peers plan would wait for them; there a failure is the variant's, not a skip."""
    from microbench.cases import comm
    from microbench.kernels import allreduce

    def probe(group, device):
        raise AssertionError("probed")

    monkeypatch.setattr(allreduce, "symm_unavailable", lambda kind, path: None)
    monkeypatch.setattr(allreduce, "symm_try", probe)
    monkeypatch.setattr(comm, "_symm_setup", {})
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    point = {"bytes": 8, "dtype": "bf16", "capture": "eager"}
    assert AllReduceSweepCase().skip_variant("oneshot-ip", point, "cuda") is None


def test_a_point_states_its_message_in_bytes_and_elements_and_sums_every_ranks_input(solo):
    case = AllReduceSweepCase()
    w = case.setup({"bytes": 16, "dtype": "bf16", "capture": "eager"}, solo.device, 3)
    x = w.inputs["x"]
    assert x.dtype == torch.bfloat16 and x.numel() == 8
    assert (w.facts["bytes"], w.facts["count"], w.facts["world_size"], w.facts["dtype"]) == (16, 8, 1, "bf16")
    assert torch.equal(x, rank_input(8, 0, 1, 3, torch.bfloat16, solo.device))
    assert torch.equal(case.reference(w)["out"], x.float())  # the sum over one rank
    w.meta["world"] = 3  # the reference sums the world's ranks, each its own input
    assert torch.equal(case.reference(w)["out"], allreduce_ref(8, 3, 3, torch.bfloat16, solo.device))
    assert case._count({"bytes": 16, "dtype": "fp32"}) == (4, torch.float32)


def test_the_step_model_reads_ok_times_per_variant_capture_and_world_sorted_by_bytes():
    def rec(variant, nbytes, median, status="OK", capture="eager", world=2, collective="allreduce"):
        return {"variant": variant, "status": status, "axes": {"capture": capture},
                "facts": {"collective": collective, "bytes": nbytes, "world_size": world},
                "timing": {"summary": {"median": median}}}

    recs = [rec("torch-ip", 4096, 3e-5), rec("torch-ip", 8, 1e-5), rec("torch-ip", 64, 2e-5),
            rec("torch-ip", 128, 9.0, status="FAILED"),  # failed in a later pass: its first pass's timing kept
            rec("torch-ip", 8, 5e-6, capture="graph"), rec("torch-ip", 8, 4e-5, world=8),
            rec("torch-ip", 8, 1.0, collective="allgather")]
    assert allreduce_times(recs) == {("torch-ip", "eager", 2): [(8, 1e-5), (64, 2e-5), (4096, 3e-5)],
                                     ("torch-ip", "graph", 2): [(8, 5e-6)], ("torch-ip", "eager", 8): [(8, 4e-5)]}


def test_lockstep_at_world_one_is_the_plain_engine(solo):
    lock = solo.lockstep()
    assert lock.device_meet is None  # the GPUs meet only in an NCCL world of several ranks
    m = measure(lambda: sum(range(200)), device="cpu", options=TimingOptions(mode="hot", budget_s=0.05), lockstep=lock)
    assert len(lock.local) == 1 and lock.local[0] == m.samples_s  # one rank: its samples are the slowest's
    assert lock.max(1.0, 2.0) == [1.0, 2.0]


def test_a_wrong_inplace_path_is_failed_with_its_wrong_count(solo):
    from microbench.case import Variant

    class Off(AllReduceSweepCase):
        def variants(self):
            def off(x, group):
                x[1::2] += 1
                return x

            return [Variant("torch-ip", off, tags={"path": "off", "placement": "in-place"})]

    opts = RunOptions(suite="smoke", device=solo.device, timing=FAST, probe=False, world=solo,
                      axis_picks={"bytes": ["16"], "capture": ["eager"]})
    (r,) = Runner(opts, None, progress=lambda line: None).run(plan([Off()], opts))
    assert r["status"] == "FAILED" and r["wrong"] == 4 and "4/8 elements off" in r["reason"] and r["timing"] is None


def test_collective_table_counts_busbw_over_n_ranks():
    def rec(variant, placement, t, status="OK"):
        return {"case": "comm.x", "axes": {"bytes": 1 << 20, "dtype": "bf16", "capture": "graph"}, "variant": variant,
                "status": status, "reason": None if status == "OK" else "why", "wrong": 0,
                "tags": {"path": "torch", "placement": placement},
                "facts": {"collective": "allreduce", "bytes": 1 << 20, "count": 1 << 19, "dtype": "bf16",
                          "redop": "sum", "world_size": 8, "backend": "nccl"},
                "timing": {"samples_s": [t], "summary": {"median": t, "rel_noise": 0.01, "count": 1}} if status == "OK" else None}

    text = collective_tables("== comm.x ==", [rec("torch-oop", "out-of-place", 100e-6),
                                             rec("torch-ip", "in-place", 50e-6)], "simple", False)
    assert "graph, 8 rank(s) (nccl)" in text
    row = next(line for line in text.splitlines() if line.startswith("1048576"))
    cells = row.split()
    # oop: 100 us -> algbw 10.49 GB/s, busbw x 2*7/8 = 18.35; ip: 50 us -> 20.97, 36.70
    assert cells[5:10] == ["100.00", "1.0%", "10.49", "18.35", "0"]
    assert cells[10:15] == ["50.00", "1.0%", "20.97", "36.70", "0"]


def test_symmetric_memory_paths_are_skipped_where_torch_kernels_refuse_the_message():
    """torch builds its out-of-place two-shot kernel for 2, 4 and 8 ranks only, and both
    kernels for bf16 / fp32 and 4-byte multiples: those points are SKIPPED with the reason
    (the one-GPU check runs at world size 1), not FAILED with a CUDA error."""
    from microbench.kernels.allreduce import symm_unsupported

    assert symm_unsupported("twoshot", 1 << 20, torch.bfloat16, 8) is None
    assert symm_unsupported("oneshot", 1 << 20, torch.bfloat16, 1) is None
    assert symm_unsupported("twoshot", 1 << 20, torch.bfloat16, None) is None  # planning: no group yet
    assert "world sizes 2, 4, 8 only (this one: 1)" in symm_unsupported("twoshot", 8, torch.bfloat16, 1)
    assert "(this one: 6)" in symm_unsupported("twoshot", 8, torch.float32, 6)
    assert "multiple of 4 bytes (6 given)" in symm_unsupported("oneshot", 6, torch.bfloat16, 8)
    assert "bf16 and fp32 only, not float16" in symm_unsupported("oneshot", 8, torch.float16, 8)



def test_symmetric_memory_a_world_of_one_cannot_set_up_is_skipped_with_its_error(solo, monkeypatch):
    """torch having the ops does not mean the host can map the memory: at world size 1 the
    set-up is tried once (nobody waits on its rendezvous) and its error is the skip reason."""
    from microbench.cases import comm
    from microbench.kernels import allreduce

    tries = []

    def refused(path, x, group, out):
        tries.append(path)
        raise RuntimeError("CUDA driver error: operation not supported\nmore detail")

    monkeypatch.setattr(allreduce, "symm_unavailable", lambda kind, path: None)
    monkeypatch.setattr(allreduce, "_symm", refused)
    monkeypatch.setattr(comm, "_symm_setup", {})
    case, point = AllReduceSweepCase(), {"bytes": 8, "dtype": "bf16", "capture": "eager"}
    for variant in ("oneshot-ip", "oneshot-oop"):
        assert case.skip_variant(variant, point, solo.device) == (
            "symmetric memory could not be set up here (RuntimeError: CUDA driver error: operation not supported)")
    assert tries == ["oneshot"]  # once per group and device
    monkeypatch.setattr(comm, "_symm_setup", {})
    monkeypatch.setattr(allreduce, "_symm", lambda path, x, group, out: tries.append(path))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert case.skip_variant("oneshot-oop", point, solo.device) is None and len(tries) == 2
    assert case.skip_variant("oneshot-ip", point, solo.device) is None and len(tries) == 2


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("argv", "message"), [
    (["--backend", "mpi"], "unknown backend 'mpi'"),
    (["--backend", "nccl"], "backend nccl needs CUDA devices"),
    (["--nproc", "0"], "need at least one rank"),
    (["--dist-timeout", "0"], "--dist-timeout 0: must be a positive number of seconds"),
    (["--dist-timeout", "nan"], "--dist-timeout nan: must be a positive number of seconds"),
    (["--axis", "bytes=3"], "axis bytes=3: 3 bytes is not a positive multiple of the element size"),
    (["--axis", "bytes=lots"], "'lots' is not a size"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    assert main(["run", "--case", "comm.allreduce_sweep", "--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not _files(tmp_path)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(distributed.WorldError, match="more ranks than CUDA devices"):
        distributed.check_nproc(8, "cuda")
    distributed.check_nproc(8, "cpu")  # gloo processes: any number


def test_an_nccl_world_is_bound_to_its_ranks_gpu(monkeypatch):
    """Under torchrun, local rank 1 of an NCCL world initialises on cuda:1 with device_id
    (its communicator made there at init); a gloo world on CPU gets no device."""
    import torch.distributed as dist

    seen = []

    class Stop(Exception):
        pass

    def init(backend, **kw):
        seen.append((backend, kw.get("device_id")))
        raise Stop

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(Stop):
        distributed.init_world("cuda")
    with pytest.raises(Stop):
        distributed.init_world("cpu")
    assert seen == [("nccl", torch.device("cuda:1")), ("gloo", None)]


def test_a_process_group_that_does_not_start_skips_its_cases_alone(monkeypatch, tmp_path, capsys):
    """A one-rank world that fails to start (an NCCL or driver fault on the host) costs the
    multi-rank cases, SKIPPED with the reason, not the rest of the run."""
    def broken(*args, **kwargs):
        raise RuntimeError("ncclUnhandledCudaError")

    monkeypatch.setattr(distributed, "init_world", broken)
    assert main(["run", "--device", "cpu", "--case", "comm.allreduce,calibration.copy", "--nproc", "1", "--budget-s", "0.02",
                 "--repeat", "1", "--no-probe", "--out", str(tmp_path)]) == 0
    assert ("the process group did not start (RuntimeError: ncclUnhandledCudaError); the multi-rank cases are SKIPPED"
            in capsys.readouterr().err)
    recs = _doc(tmp_path)["records"]
    comm = [r for r in recs if r["case"] == "comm.allreduce"]
    assert comm and all(r["status"] == "SKIPPED" and "ncclUnhandledCudaError" in r["reason"] for r in comm)
    assert [r["status"] for r in recs if r["case"] == "calibration.copy"] == ["OK"]


# --------------------------------------------------------------------------- several ranks, under torchrun


def _run(argv, timeout=300):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "microbench", *argv], capture_output=True, text=True, cwd=ROOT,
                       env=ENV, timeout=timeout)
    return p, time.monotonic() - t0


@pytest.mark.multirank
def test_run_starts_torchrun_with_two_ranks_and_merges_rank_zero_into_its_file(tmp_path):
    p, _ = _run(["run", "--device", "cpu", "--case", "comm.allreduce,comm.allreduce_sweep,norm.rmsnorm",
                 "--axis", "bytes=8,4K", "--axis", "tokens=1", "--axis", "norm=kv_a", "--nproc", "2",
                 "--budget-s", "0.03", "--repeat", "1", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "torch.distributed.run" in p.stderr and "--nproc-per-node=2" in p.stderr
    for title in ("== comm.allreduce == eager, 2 rank(s) (gloo)", "== comm.allreduce_sweep == eager, 2 rank(s) (gloo)",
                  "== norm.rmsnorm =="):
        assert title in p.stdout
    doc = _doc(tmp_path)  # one file: the single-rank case and both multi-rank ones
    assert doc["run"]["complete"] and doc["run"]["world"] == {"world_size": 2, "backend": "gloo",
                                                               "launcher": "torchrun"}
    assert [x["rank"] for x in doc["ranks"]] == [0, 1] and all(x["fingerprint"]["host"] for x in doc["ranks"])
    comm = [r for r in doc["records"] if r["case"].startswith("comm.")]
    ok = [r for r in comm if r["status"] == "OK"]
    assert {r["variant"] for r in ok} == {"torch-ip", "torch-oop"} and len(ok) == 2 * 3
    for r in ok:
        assert r["wrong"] == 0 and r["facts"]["world_size"] == 2 and len(r["ranks"]) == 2
        # each recorded sample is the slowest rank's, so its median is at least every rank's own
        assert max(x["median_s"] for x in r["ranks"]) <= r["timing"]["summary"]["median"] + 1e-12
    assert {r["status"] for r in comm if r["variant"].startswith(("cupy", "oneshot"))} == {"SKIPPED"}
    assert any(r["case"] == "norm.rmsnorm" and r["status"] == "OK" for r in doc["records"])


@pytest.mark.multirank
def test_eight_gloo_ranks_gate_and_time_every_cpu_path(tmp_path):
    p, _ = _run(["run", "--device", "cpu", "--case", "comm.allreduce_sweep", "--axis", "bytes=8,2K",
                 "--variant", "torch-ip,torch-oop", "--nproc", "8", "--budget-s", "0.02", "--repeat", "1",
                 "--no-probe", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "eager, 8 rank(s) (gloo)" in p.stdout
    doc = _doc(tmp_path)
    assert len(doc["ranks"]) == 8
    recs = doc["records"]
    assert len(recs) == 4 and {r["status"] for r in recs} == {"OK"}
    assert all(r["wrong"] == 0 and len(r["ranks"]) == 8 and r["facts"]["world_size"] == 8 for r in recs)


@pytest.mark.multirank
def test_under_torchrun_only_multi_rank_cases_run(tmp_path):
    cmd = distributed.torchrun_command(2, ["run", "--device", "cpu", "--case", "norm.rmsnorm", "--out", str(tmp_path)])
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=240)
    assert p.returncode != 0
    assert p.stderr.count("microbench: error: no multi-rank case selected") == 1  # one line, from rank 0
