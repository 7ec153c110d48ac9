"""The correctness gate — and proof that it can say no."""

from __future__ import annotations

import pytest
import torch

from microbench.gate import INT_POISON, check_variant, compare, poison_


def test_compare_passes_close_and_reports_worst_element():
    want = torch.randn(4, 5)
    got = want.clone()
    assert compare(got, want, atol=1e-6, rtol=1e-6).passed
    got[2, 3] += 1.0
    got[0, 1] += 0.5
    rep = compare(got, want, atol=1e-3, rtol=1e-3)
    assert not rep.passed and rep.mismatched == 2
    assert rep.worst_index == [2, 3] and rep.max_abs == pytest.approx(1.0, rel=1e-5)
    text = str(rep)
    assert "2/20 elements off" in text and "worst at (2, 3)" in text


def test_nan_and_inf_always_fail():
    want = torch.randn(10)
    got = want.clone()
    got[3] = float("nan")
    got[7] = float("inf")
    rep = compare(got, want, atol=1e9, rtol=1e9)
    assert not rep.passed and rep.nan == 1 and rep.inf == 1
    assert "1 NaN, 1 Inf" in str(rep)


def test_shape_mismatch_and_bad_reference_are_errors():
    assert "shape" in str(compare(torch.zeros(3), torch.zeros(4), atol=1, rtol=1))
    assert "reference itself" in str(compare(torch.zeros(2), torch.tensor([0.0, float("nan")]), atol=1, rtol=1))


def test_integer_outputs_must_match_exactly_and_are_poisoned_with_a_sentinel():
    t = torch.empty(5, dtype=torch.int32)
    poison_(t)
    assert (t == INT_POISON).all()
    assert not compare(torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]), atol=10, rtol=10).passed
    b = torch.empty(3, dtype=torch.bool)
    assert poison_(b).all()


def _copy_ok(src, dst):
    dst.copy_(src)


def _copy_skips_last(src, dst):  # deliberately wrong: leaves the last element unwritten
    dst[:-1].copy_(src[:-1])


def test_unwritten_output_fails_because_it_was_poisoned():
    src = torch.randn(17)
    exp = {"dst": src.clone()}
    good = check_variant(_copy_ok, {"src": src}, {"dst": torch.empty(17)}, exp, atol=0, rtol=0, seed=1)
    assert good.passed and good.seed == 1
    bad = check_variant(_copy_skips_last, {"src": src}, {"dst": torch.empty(17)}, exp, atol=0, rtol=0, seed=1)
    assert not bad.passed
    assert "1 NaN" in bad.summary() and "worst at (16,)" in bad.summary()


def test_returned_outputs_and_in_place_inputs_are_checked():
    x = torch.randn(6)
    exp = {"out": x * 2}
    assert check_variant(lambda x: x * 2, {"x": x}, {}, exp, atol=1e-6, rtol=0, seed=0).passed
    r = torch.randn(6)
    exp_r = {"r": r + 1}
    def bump(r):
        r.add_(1)

    assert check_variant(bump, {"r": r}, {}, exp_r, atol=1e-6, rtol=0, seed=0).passed
    missing = check_variant(lambda x: None, {"x": x}, {}, {"y": x}, atol=0, rtol=0, seed=0)
    assert not missing.passed and "not produced" in missing.summary()


def test_nothing_to_check_says_so_instead_of_passing_silently():
    g = check_variant(lambda: None, {}, {}, {}, atol=0, rtol=0, seed=3)
    assert not g.checked and "no output" in g.summary()
