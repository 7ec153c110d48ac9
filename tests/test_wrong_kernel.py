"""Prove the checker can say no: deliberately wrong Triton kernels are rejected by the gate.

Each is one plausible bug away from kernels/rmsnorm.py: an off-by-one mask that never
writes the last column (caught by the NaN poison), and a mean over the padded block
instead of the row (wrong values everywhere the row is not a power of two).
"""

from __future__ import annotations

import triton
import triton.language as tl

from microbench.cases.rmsnorm import RMSNormCase
from microbench.gate import check_variant
from microbench.planning import RunOptions, plan
from microbench.runner import Runner

from .helpers import DEVICE


@triton.jit
def _off_by_one_kernel(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H - 1  # the bug: the last column is never loaded or stored
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(out_ptr + row * H + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mean_over_block_kernel(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / BLOCK + eps)  # the bug: BLOCK, not H
    tl.store(out_ptr + row * H + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launcher(kernel):
    def fn(x, weight, eps, out, residual=None):
        assert residual is None
        kernel[(x.shape[0],)](x, weight, out, x.shape[1], eps, BLOCK=triton.next_power_of_2(x.shape[1]))

    return fn


def _gate(kernel):
    case = RMSNormCase()
    point = {"tokens": 3, "norm": "kv_a", "dtype": "fp32"}
    w = case.setup(point, DEVICE, seed=11)
    return check_variant(_launcher(kernel), w.inputs, w.outputs, case.reference(w), **case.gate_tolerances(point),
                         seed=11)


def test_off_by_one_mask_is_rejected_by_the_poison():
    g = _gate(_off_by_one_kernel)
    assert not g.passed
    (rep,) = g.reports
    assert rep.nan == 3 and rep.mismatched >= 3  # one unwritten element per row (and a short sum)
    assert rep.worst_index == [0, 511]
    assert "3 NaN" in g.summary()


def test_mean_over_the_padded_block_is_rejected_by_value(monkeypatch):
    # kv_a is 512 wide: a power of two, where this bug is invisible — so widen it to 500.
    import microbench.cases.rmsnorm as mod

    monkeypatch.setattr(mod, "_widths", lambda device: {"kv_a": (500, False)})
    g = _gate(_mean_over_block_kernel)
    assert not g.passed
    (rep,) = g.reports
    assert rep.nan == 0 and rep.mismatched > 1000 and rep.max_rel > 0.01


def test_a_wrong_variant_in_a_run_is_failed_and_not_timed(monkeypatch):
    from microbench.case import Variant

    case = RMSNormCase()
    monkeypatch.setattr(case, "variants", lambda: [Variant("torch", lambda **kw: None), Variant(
        "wrong", _launcher(_off_by_one_kernel))])
    monkeypatch.setattr(case, "axes", lambda suite, device="cuda": {"tokens": [2], "norm": ["kv_a"], "dtype": ["fp32"]})
    opts = RunOptions(suite="smoke", device=DEVICE, variants=["wrong"], probe=False)
    (rec,) = Runner(opts, None, progress=lambda _: None).run(plan([case], opts))
    assert rec["status"] == "FAILED" and rec["timing"] is None and "NaN" in rec["reason"]


def test_an_attention_kernel_a_little_off_everywhere_is_rejected_by_the_norm():
    # a softmax normaliser 0.6% too large (say, one block's sum counted at a stale max)
    # scales every output by 1/1.006: inside the elementwise bound, not inside the
    # attention case's bound on the whole output's relative L2 error
    from microbench.cases.mla import MLAVerifyCase
    from microbench.kernels.mla_verify import mla_verify

    def slightly_off(q, kv_new, kv_cache, plan, out):
        mla_verify(q, kv_new, kv_cache, plan, out=out)
        out.div_(1.006)

    case = MLAVerifyCase()
    point = {"batch": 1, "draft_tokens": 4, "context": 65, "page": 64, "dtype": "fp16"}
    w = case.setup(point, DEVICE, seed=3)
    tol = case.gate_tolerances(point)
    g = check_variant(slightly_off, w.inputs, w.outputs, case.reference(w), **tol, seed=3)
    (rep,) = g.reports
    assert not g.passed and rep.mismatched == 0 and rep.rel_l2 > tol["norm_tol"]
    assert "relative L2 error" in g.summary()
    elementwise = check_variant(slightly_off, w.inputs, w.outputs, case.reference(w), **{**tol, "norm_tol": None},
                                seed=3)
    assert elementwise.passed  # what the gate would have said without the norm
    right = check_variant(lambda **kw: mla_verify(**kw), w.inputs, w.outputs, case.reference(w), **tol, seed=3)
    assert right.passed and right.reports[0].rel_l2 < tol["norm_tol"] / 4
