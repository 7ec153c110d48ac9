"""Small cases for harness tests: fast, CPU-only, with a knob to make them slower or wrong."""

from __future__ import annotations

import torch

#: Where tests run Triton kernels: the GPU when there is one, else the CPU interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from microbench.case import Case, Cost, Variant, Workload
from microbench.cases.common import randn


class Scaled(Case):
    """fn(a, b, c): c = a @ b, computed ``reps`` times (more reps = more work, same path)."""

    id = "test.scaled"
    title = "test case"
    baseline = "base"

    def __init__(self, reps: int = 30, other_reps: int | None = None, wrong: bool = False, boom_at: int | None = None):
        self.reps, self.other_reps, self.wrong, self.boom_at = reps, other_reps or reps, wrong, boom_at
        self.calls = 0

    def _work(self, reps):
        def fn(a, b, c):
            for _ in range(reps):
                torch.mm(a, b, out=c)
            if self.wrong:
                c[-1, -1] += 1.0

        return fn

    def variants(self):
        def boom(a, b, c):
            self.calls += 1
            if self.boom_at is not None and self.calls >= self.boom_at:
                raise KeyboardInterrupt
            torch.mm(a, b, out=c)

        return [Variant("base", self._work(self.reps), devices=("cpu",)),
                Variant("other", self._work(self.other_reps), devices=("cpu",)),
                Variant("boom", boom, devices=("cpu",))]

    def axes(self, suite, device="cuda"):
        return {"n": [32, 48]} if suite == "smoke" else {}

    def setup(self, point, device, seed):
        n = point["n"]
        return Workload({"a": randn((n, n), torch.float32, device, seed),
                         "b": randn((n, n), torch.float32, device, seed + 1)},
                        {"c": torch.empty(n, n)}, Cost(bytes=3 * n * n * 4, flops=2 * n**3))

    def reference(self, w):
        return {"c": w.inputs["a"].double() @ w.inputs["b"].double()}
