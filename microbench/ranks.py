"""``microbench run`` on several ranks: the torchrun side and the side that starts it.

``run_on_ranks`` (in a plain ``microbench run`` with ``--nproc N > 1``) starts torchrun on
this host with the multi-rank cases, waits, and merges rank 0's records and every rank's
fingerprint into the run's own result file — kept even when a rank failed.
``run_ranks`` is what each torchrun worker runs (started by ``run_on_ranks`` or by the
user's own torchrun, any number of nodes): join the world, run the multi-rank cases in
lock step, rank 0 writes the result file and prints the table.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from microbench.children import ending_with_parent

#: Set in the environment of the torchrun a plain ``microbench run --nproc N`` starts.
RANKS_OF_A_RUN = "MICROBENCH_RANKS_OF_A_RUN"


def child_argv(a: argparse.Namespace, suite: str, device_kind: str, cases: Sequence[Any], opts: Any,
               out: str) -> list[str]:
    """The ``microbench run`` arguments each rank gets: the multi-rank cases, their axis
    picks and variants, and every timing option of this run."""
    axes = {k for c in cases for k in c.axes(suite, device_kind)}
    names = {v.name for c in cases for v in c.variants()}
    argv = ["run", "--suite", suite, "--device", device_kind, "--out", out, "--no-table",
            "--case", ",".join(c.id for c in cases), "--budget-s", repr(a.budget_s), "--max-noise", repr(a.max_noise),
            "--min-effect", repr(a.min_effect), "--seed", str(a.seed), "--threads", str(a.threads),
            "--repeat", str(opts.repeat), "--dist-timeout", repr(a.dist_timeout)]
    argv += ["--mode", a.mode] if a.mode else []
    if opts.deadline_at is not None:  # what is left of this run's deadline, the ranks' to spread
        from microbench.pace import MIN_DEADLINE_BUDGET_S

        argv += ["--deadline-s", repr(max(MIN_DEADLINE_BUDGET_S, opts.deadline_at - time.monotonic()))]
    argv += ["--backend", a.backend] if a.backend else []
    argv += ["--interleave"] if a.interleave else []
    argv += ["--no-probe"] if a.no_probe else []
    picked = [v for v in opts.variants if v in names]
    argv += ["--variant", ",".join(picked)] if picked else []
    for name, values in opts.axis_picks.items():
        if name in axes:
            argv += ["--axis", f"{name}={','.join(values)}"]
    return argv


def run_on_ranks(a: argparse.Namespace, suite: str, device_kind: str, cases: Sequence[Any], nproc: int, opts: Any,
                 writer: Any) -> int:
    """Run ``cases`` on ``nproc`` local ranks under torchrun; merge into ``writer``; the exit
    status of torchrun (0 when every rank finished)."""
    from microbench.distributed import torchrun_command

    if device_kind == "cuda":  # this process's cached blocks would sit on rank 0's GPU meanwhile
        import torch

        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="microbench-ranks-") as tmp:
        cmd = torchrun_command(nproc, child_argv(a, suite, device_kind, cases, opts, tmp))
        print(f"microbench run: {len(cases)} multi-rank case(s) on {nproc} ranks: {shlex.join(cmd)}",
              file=sys.stderr, flush=True)
        # OMP_NUM_THREADS set: torchrun would otherwise set 1 and print a banner about it
        # torchrun (and so its ranks) ends with this process, however it ends: a kill leaves
        # no ranks running on, their file never merged
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(a.threads)), RANKS_OF_A_RUN: "1"}
        if opts.deadline_at is not None:  # the run's deadline as a time of day: the ranks' launch counts
            from microbench.cli import DEADLINE_EPOCH

            env[DEADLINE_EPOCH] = repr(time.time() + opts.deadline_at - time.monotonic())
        proc = subprocess.Popen(ending_with_parent(cmd), env=env)
        try:
            rc = proc.wait()
        except BaseException as e:  # Ctrl-C or SIGTERM: torchrun stops its ranks, then their files are merged
            # Ctrl-C at a terminal reaches torchrun too: a second signal would cut its own
            # shutdown short, so it is given a moment to end by itself first
            _stop(proc, first_wait_s=5.0 if isinstance(e, KeyboardInterrupt) and not e.args else 0.0)
            raise
        finally:
            kept = _merge(tmp, writer)
    if rc:
        print(f"microbench: the {nproc}-rank run exited with status {rc}; {kept} record(s) of it kept",
              file=sys.stderr)
    return rc


def _stop(proc: subprocess.Popen, grace_s: float = 45.0, first_wait_s: float = 0.0) -> None:
    """SIGTERM to torchrun, which passes it to its ranks (each then keeps what it finished),
    unless it ends within ``first_wait_s`` by itself; SIGKILL only if it has not exited
    within ``grace_s`` more (torchrun itself gives its ranks 30 s)."""
    if first_wait_s > 0:
        try:
            proc.wait(first_wait_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _merge(directory: str, writer: Any) -> int:
    from microbench.results import ResultError, load

    files = sorted(glob.glob(os.path.join(directory, "*.json")))
    if not files:
        return 0
    try:
        doc = load(files[0])
    except ResultError as e:
        print(f"microbench: rank 0's result file is unusable: {e}", file=sys.stderr)
        return 0
    writer.add(doc["records"])
    writer.doc["ranks"] = doc.get("ranks")
    writer.doc["run"]["world"] = doc["run"].get("world")
    if doc["run"].get("summaries"):  # the multi-rank cases' lines beside this process's own
        writer.doc["run"].setdefault("summaries", {}).update(doc["run"]["summaries"])
    if doc["run"].get("error"):
        writer.doc["run"]["ranks_error"] = doc["run"]["error"]
    writer.flush()
    return len(doc["records"])


def run_ranks(a: argparse.Namespace) -> int:
    """One torchrun worker: join, run the selected multi-rank cases in lock step, and (rank 0)
    write the result file with every rank's fingerprint."""
    import torch

    from microbench import cli, cli_out, distributed, env, report
    from microbench.runner import Runner

    want_cuda = a.device.startswith("cuda") or (a.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise cli.UsageError(f"--device {a.device}: no CUDA device on this rank")
    kind = "cuda" if want_cuda else "cpu"
    if kind == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(a.threads)
    try:
        world = distributed.init_world(kind, a.backend, a.dist_timeout)
    except distributed.WorldError as e:
        raise cli.UsageError(str(e)) from None
    lead = world.rank == 0
    suite, cases, variants = cli.run_selection(a, kind)
    multi = [c for c in cases if c.distributed]
    if not multi:
        raise cli.UsageError("no multi-rank case selected: under torchrun only comm.* cases run "
                             "(run the others with a plain `microbench run`)")
    if lead and len(multi) < len(cases):
        print("microbench run: single-rank cases are not run under torchrun: "
              + ", ".join(c.id for c in cases if not c.distributed), file=sys.stderr)
    opts = cli.run_options(a, suite, world.device, variants, world)
    p = cli.make_plan(multi, opts, multi)
    fingerprints = world.agree("fingerprint", env.fingerprint(world.device))
    writer = None
    if lead:
        print(f"microbench run: suite {suite} on {world.size} rank(s) ({world.backend}, {world.device} on rank 0): "
              f"{len(p.items)} points from {len(multi)} case(s)", file=sys.stderr, flush=True)
        writer = cli.open_writer(a.out, cli.run_meta(a, opts, multi), fingerprints[0])
        # every point on disk as it ends: a rank lost mid-run can leave this one stuck in a
        # collective, where no signal handler runs, until torchrun kills it
        writer.min_interval_s = 0
        writer.doc["run"]["world"] = world.describe()
        writer.doc["ranks"] = [{"rank": r, "fingerprint": fp} for r, fp in enumerate(fingerprints)]
        world.on_fatal(lambda line: writer.close(complete=False, error=line))
    runner = Runner(opts, writer, progress=None if lead else (lambda line: None))
    try:
        runner.run(p)
    except BaseException as e:  # SIGTERM from torchrun, Ctrl-C, a crash: the points finished so far stay on disk
        if writer is not None:
            stopped = isinstance(e, KeyboardInterrupt)
            writer.close(complete=False, interrupted=stopped, error=None if stopped else f"{type(e).__name__}: {e}")
        raise
    if writer is not None:
        path = writer.close(complete=True)
        if not a.no_table:
            print(report.render(writer.doc, a.format), end="")
        if not os.environ.get(RANKS_OF_A_RUN):  # else the run that started torchrun merges it and says where
            cli_out.results_line(path)
    world.close()
    return 0
