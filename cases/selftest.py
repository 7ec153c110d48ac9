"""The instrument's own check: the same code path doing 10% more work must read SLOWER.

``selftest.cpu_work`` runs a fixed amount of small torch CPU work (``reps`` matmuls of a
[size, size] fp32 block) three ways: ``anchor`` (the baseline, never changed), ``work``
(the function under test, the same work) and ``work+10%`` (the function under test after
a change that gives it 10% more of the very same work). Within one run, ``--interleave``
gives the paired A/B verdict; across two runs, ``compare --map-variant work=work+10%``
plays "the function got 10% slower" — in absolute time, and with ``--relative`` as a ratio
to the unchanged anchor. ``scripts/aa-study`` repeats that many times to count false and
missed verdicts on this machine.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from microbench.case import Case, Cost, Point, Variant, Workload
from microbench.cases.common import randn

#: 40 reps of a 64x64 matmul take ~0.2 ms on one core: long enough for perf_counter_ns,
#: short enough that hundreds of samples fit a 1 s budget.
BASE_REPS = 40


def work(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        torch.mm(a, b, out=c)


class CpuWork(Case):
    """Variant signature: fn(a, b, c) — a, b [size, size] fp32 in, c [size, size] fp32 written (= a @ b)."""

    # the three variants are timed alternately by --interleave; budget per variant and pass

    id = "selftest.cpu_work"
    scaffold_from = "calibration.matmul"  # the same signature: c = a @ b
    title = "harness self-test: the same CPU work, and 10% more of it"
    baseline = "anchor"
    launches_triton = False  # torch matmuls on the CPU

    def __init__(self, reps: int = BASE_REPS, extra: float = 0.10):
        self.reps = reps
        self.extra_reps = round(reps * (1 + extra))

    def variants(self) -> Sequence[Variant]:
        return [
            Variant("anchor", lambda a, b, c: work(a, b, c, self.reps), devices=("cpu",),
                    doc=f"{self.reps} matmuls: the unchanged baseline"),
            Variant("work", lambda a, b, c: work(a, b, c, self.reps), devices=("cpu",), doc=f"{self.reps} matmuls"),
            Variant("work+10%", lambda a, b, c: work(a, b, c, self.extra_reps), devices=("cpu",),
                    doc=f"{self.extra_reps} matmuls: the same path, 10% more work"),
        ]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        return {"size": [64]} if suite == "selftest" else {}

    def check_axes(self, device: str) -> Mapping[str, Sequence[Any]]:
        return self.axes("selftest", device)  # no smoke axes: check at the self-test's own shape

    def skip(self, point: Point, device: str) -> str | None:
        return None if device == "cpu" else "the self-test times CPU work (run it with --device cpu)"

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        n = point["size"]
        a, b = randn((n, n), torch.float32, device, seed), randn((n, n), torch.float32, device, seed + 1)
        return Workload({"a": a, "b": b}, {"c": torch.empty(n, n)}, Cost(bytes=3 * n * n * 4 * self.reps,
                                                                        flops=2 * n**3 * self.reps))

    def reference(self, w: Workload) -> Mapping[str, Any]:
        return {"c": (w.inputs["a"].double() @ w.inputs["b"].double()).float()}
