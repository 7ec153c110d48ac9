"""A torchrun worker for the multi-rank tests: one allreduce variant that misbehaves on the
last rank in a chosen way, run through the harness's own runner (not the CLI).

    torchrun --nproc-per-node N tests/dist_worker.py MODE OUTDIR [TIMEOUT_S]

MODE: ``ok`` (a correct variant), ``wrong`` (the last rank's result is off by one in one
element after the collective), ``raise-after`` (the last rank raises after the collective),
``exit`` (the last rank's process dies inside the gate's collective), ``exit0`` (it leaves
with status 0, so torchrun does not stop the others: the timeout must), ``setup-raise`` (the
last rank's set-up of the first point's second variant raises), ``out-of-place`` (the
variant says it sums in place but returns a new tensor, leaving its input alone). Rank 0
writes the result file into OUTDIR.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from microbench import distributed
from microbench.case import Variant
from microbench.cases.comm import AllReduceSweepCase
from microbench.kernels.allreduce import torch_inplace, torch_outplace
from microbench.results import ResultWriter
from microbench.planning import RunOptions, plan
from microbench.runner import Runner
from microbench.timing import TimingOptions


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0

    setups = []

    class Misbehaving(AllReduceSweepCase):
        id = "test.misbehaving"
        baseline = "torch-ip"

        def setup(self, point, device, seed):
            setups.append(point)
            if mode == "setup-raise" and len(setups) == 2 and dist.get_rank() == dist.get_world_size() - 1:
                raise RuntimeError("set-up failed on the last rank")
            return super().setup(point, device, seed)

        def variants(self):
            def odd(x, group):
                last = dist.get_rank() == dist.get_world_size() - 1
                if mode == "exit" and last:
                    os._exit(7)
                if mode == "exit0" and last:
                    os._exit(0)  # a rank that quietly leaves: no launcher teardown, only timeouts help
                if mode == "out-of-place":
                    return torch_outplace(x, group)
                torch_inplace(x, group)
                if mode == "wrong" and last:
                    x[0] += 1
                if mode == "raise-after" and last:
                    raise RuntimeError("raised after the collective")
                return x

            return [Variant("torch-ip", torch_inplace, tags={"path": "torch", "placement": "in-place"}),
                    Variant("odd", odd, tags={"path": "odd", "placement": "in-place"})]

    world = distributed.init_world("cpu", "gloo", timeout)
    opts = RunOptions(suite="smoke", device="cpu", world=world, axis_picks={"bytes": ["8", "256"]},
                      timing=TimingOptions(budget_s=0.05), probe=False)
    writer = None
    if world.rank == 0:
        writer = ResultWriter(out, {"suite": "smoke", "device": "cpu", "world": world.describe()}, {})
        world.on_fatal(lambda line: writer.close(complete=False, error=line))
    Runner(opts, writer, progress=(lambda line: None)).run(plan([Misbehaving()], opts))
    if writer is not None:
        writer.close(complete=True)
    world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
