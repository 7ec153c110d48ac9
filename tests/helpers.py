"""Small cases for harness tests: fast, CPU-only, with a knob to make them slower or wrong."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch

#: Where tests run Triton kernels: the GPU when there is one, else the CPU interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: the checkout, and the environment a test's subprocess (a CLI run, torchrun) imports it from
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}

from microbench.case import Case, Cost, Variant, Workload
from microbench.cases.common import randn
from microbench.models import cases_dir


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


#: The contexts of a 16-request verify batch at Kimi-K2.5 TP8 shapes, from empty to 16K:
#: where the prefix is short the draft tokens carry much of the attention, so their mask
#: moves the outputs by O(1). At a 16K context alone it moves them by under 1e-3, and a
#: kernel that ignored the mask would pass a bf16 check there.
KIMI_MIXED_PREFIXES = (0, 1, 3, 17, 63, 64, 65, 127, 200, 511, 1000, 1500, 3000, 4095, 8191, 16384)


def kimi_tree_inputs(dtype: torch.dtype, seed: int, atol: float):
    """16 requests of 4 tokens (3 drafts + 1) under random tree masks, 8 heads, 64-token
    pages, over ``KIMI_MIXED_PREFIXES``; checked to be inputs where the same tokens under
    the causal mask give outputs more than 10 x ``atol`` away (so a test at ``atol`` can
    tell the tree from causal)."""
    from microbench.cases.mla_inputs import make_mla_inputs
    from microbench.kernels.reference import mla_attention_ref

    def inputs(tree):  # the same values either way: they are drawn before the masks
        return make_mla_inputs([4] * len(KIMI_MIXED_PREFIXES), list(KIMI_MIXED_PREFIXES), heads=8, page_size=64,
                               dtype=dtype, device=DEVICE, seed=seed, tree=tree)

    x, causal = inputs(True), inputs(False)
    assert torch.equal(x.q, causal.q) and torch.equal(x.kv_cache, causal.kv_cache)
    moved = (mla_attention_ref(x.q, x.kv_new, x.kv_cache, x.plan)
             - mla_attention_ref(causal.q, causal.kv_new, causal.kv_cache, causal.plan)).abs().max().item()
    assert moved > 10 * atol, f"the tree mask moves the outputs by only {moved:.2e}: no test of it at atol {atol}"
    return x


class FakeClock:
    """A clock that advances by each synthetic sample, plus a fixed overhead per sample."""

    def __init__(self, overhead_s: float = 0.0):
        self.t = 0.0
        self.overhead = overhead_s

    def __call__(self) -> float:
        return self.t

    def sampler(self, rng: np.random.Generator, median_s: float, sigma: float):
        def take() -> float:
            s = float(median_s * rng.lognormal(0.0, sigma))
            self.t += s + self.overhead
            return s

        return take


def lognormal(rng: np.random.Generator, n: int, sigma: float, scale: float = 1e-3) -> np.ndarray:
    """[n] seconds: ``scale`` times lognormal noise of log-sigma ``sigma`` (median = scale)."""
    return scale * np.exp(sigma * rng.standard_normal(n))


def shipped_json(kind: str, name: str) -> dict:
    """A shipped config or profile (``cases/<kind>/<name>.json``) as parsed JSON, to edit."""
    with open(os.path.join(cases_dir(kind), f"{name}.json"), encoding="utf-8") as f:
        return json.load(f)


def only_result(folder) -> dict:
    """The one result file a run wrote into ``folder``, parsed."""
    (path,) = sorted(glob.glob(os.path.join(str(folder), "*.json")))
    return json.load(open(path))
