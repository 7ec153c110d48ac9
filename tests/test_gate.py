"""The correctness gate — and proof that it can say no."""

from __future__ import annotations

import math

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


def test_the_norm_bound_sees_a_small_error_spread_over_the_whole_output():
    # every element 1% off its value: within 2e-2 elementwise, but 1e-2 relative L2
    want = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    got = want * 1.01
    assert compare(got, want, atol=2e-2, rtol=2e-2).passed
    rep = compare(got, want, atol=2e-2, rtol=2e-2, norm_tol=5e-3)
    assert not rep.passed and rep.mismatched == 0 and rep.rel_l2 == pytest.approx(1e-2, rel=1e-4)
    assert str(rep) == ("out (1000,) float32: relative L2 error 0.01 over the whole output (bound 0.005); "
                        f"max abs {rep.max_abs:.3g}, max rel 0.01 (atol 0.02, rtol 0.02)")
    ok = compare(got, want, atol=2e-2, rtol=2e-2, norm_tol=2e-2)
    assert ok.passed and str(ok).endswith("relative L2 0.01)")
    # both kinds of failure are named together
    got[3] += 5
    assert str(compare(got, want, atol=2e-2, rtol=2e-2, norm_tol=5e-3)).startswith(
        "out (1000,) float32: 1/1000 elements off; relative L2 error")
    # a zero reference: any error is an infinite relative one; none is none
    assert compare(torch.zeros(3), torch.zeros(3), atol=0, rtol=0, norm_tol=1e-9).passed
    assert not compare(torch.full((3,), 1e-9), torch.zeros(3), atol=1, rtol=0, norm_tol=1e-9).passed
    # integers are exact already: no norm
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 2]), atol=0, rtol=0, norm_tol=0.0).passed


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


def _seeded(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_the_bound_is_atol_plus_rtol_times_the_references_magnitude():
    # |want| in [1, 2], both signs: rtol=0.5 allows 0.5|want| + 1e-3, whatever the sign
    # and however far the output itself is off (the bound is not taken from |got|)
    want = (1 + torch.rand(64, generator=torch.Generator().manual_seed(7))) * _seeded(64, seed=8).sign()
    assert compare(want * 1.4, want, atol=1e-3, rtol=0.5).passed
    assert compare(want * 0.6, want, atol=1e-3, rtol=0.5).passed
    assert compare(want * 1.6, want, atol=1e-3, rtol=0.5).mismatched == 64
    assert compare(want + 2e-3, want, atol=1e-3, rtol=0.0).mismatched == 64
    assert compare(want + 5e-4, want, atol=1e-3, rtol=0.0).passed


def test_the_worst_element_is_the_one_furthest_past_its_bound_with_its_got_and_want():
    want = _seeded(8, 8, seed=2)
    want[1, 2], want[5, 6] = 100.0, 0.5
    got = want.clone()
    got[1, 2] += 2.0  # the largest error, but within 5% of 100
    got[5, 6] += 0.25  # a smaller one, 0.22 past its bound
    assert compare(want.clone(), want, atol=1e-3, rtol=0.05).worst_index is None  # a pass has no worst
    rep = compare(got, want, atol=1e-3, rtol=0.05)
    assert rep.mismatched == 1 and rep.worst_index == [5, 6]
    assert rep.worst_got == pytest.approx(0.75) and rep.worst_want == pytest.approx(0.5)
    assert rep.max_abs == pytest.approx(2.0) and rep.max_rel == pytest.approx(0.5)  # relative to want
    got[0, 0] = float("nan")  # a NaN is the worst, but the max errors stay the finite ones
    rep = compare(got, want, atol=1e-3, rtol=0.05)
    assert rep.mismatched == 2 and rep.worst_index == [0, 0] and math.isnan(rep.worst_got)
    assert rep.max_abs == pytest.approx(2.0) and rep.max_rel == pytest.approx(0.5)


def test_a_transposed_output_is_a_shape_error_not_compared_element_by_element():
    want = _seeded(2, 3, seed=3)
    rep = compare(want.t().contiguous(), want, atol=1, rtol=1)
    assert not rep.passed and "shape (3, 2) but the reference has (2, 3)" in str(rep)


def test_large_integers_off_by_one_fail_and_a_float_output_of_an_integer_reference_has_tolerance():
    gen = torch.Generator().manual_seed(5)
    want = torch.randint(1 << 30, 1 << 40, (16,), generator=gen, dtype=torch.int64)  # past fp32's 2**24
    got = want.clone()
    got[7] += 1
    rep = compare(got, want, atol=0, rtol=0)
    assert rep.mismatched == 1 and rep.worst_index == [7] and rep.worst_got == float(want[7]) + 1
    small = torch.randint(-50, 50, (16,), generator=gen)
    assert compare(small.float() + 1e-4 * _seeded(16, seed=6), small, atol=1e-3, rtol=0).passed


def test_every_output_must_pass_and_the_failing_ones_alone_are_summed_and_summarized():
    a, b = _seeded(5, seed=9), _seeded(7, seed=10)

    def one_wrong(a, b, x, y):
        x.copy_(a)
        y.copy_(b)
        y[2] += 1.0

    g = check_variant(one_wrong, {"a": a, "b": b}, {"x": torch.empty(5), "y": torch.empty(7)},
                      {"x": a.clone(), "y": b.clone(), "z": b.clone()}, atol=1e-6, rtol=0, seed=9)
    assert [r.passed for r in g.reports] == [True, False, False] and not g.passed
    assert g.wrong == 1 + 7  # y's one element off, and every element of z, never produced
    assert g.summary().startswith("y (7,) float32: 1/7 elements off; worst at (2,)")
    assert g.summary().endswith("; z: not produced")


@pytest.mark.parametrize("dtype, poison", [(torch.uint8, 255), (torch.int8, -128), (torch.int16, -(2**15)),
                                           (torch.int64, INT_POISON)])
def test_a_narrow_integer_is_poisoned_with_its_least_plausible_value(dtype, poison):
    # an unsigned type's minimum is 0, the value an index or count most often is: an
    # element left unwritten over a 0 in the reference would pass
    assert (poison_(torch.empty(4, dtype=dtype)) == poison).all()
    want = torch.tensor([3, 0, 7, 0], dtype=dtype)
    g = check_variant(_copy_skips_last, {"src": want}, {"dst": torch.empty(4, dtype=dtype)}, {"dst": want.clone()},
                      atol=0, rtol=0, seed=4)
    assert not g.passed and g.reports[0].worst_index == [3]


def test_complex_outputs_are_compared_in_both_parts():
    gen = torch.Generator().manual_seed(11)
    want = torch.complex(torch.randn(6, generator=gen), torch.randn(6, generator=gen))
    assert compare(want.clone(), want, atol=1e-6, rtol=0).passed
    rep = compare(want.conj(), want, atol=1e-6, rtol=0)  # the same real parts
    assert rep.mismatched == 6 and rep.worst_index[-1] == 1  # off in the imaginary part
    assert str(rep).startswith("out (6, 2) complex64: 6/12 elements off")
    got = want.clone()
    got[4] = complex(float("nan"), 0.0)
    assert compare(got, want, atol=1e-6, rtol=0).nan == 1


def test_an_integer_output_matches_a_float_reference_exactly():
    want = torch.tensor([3.0, 4.4, -2.0])
    assert compare(torch.tensor([3, 4, -2]), want, atol=0.5, rtol=0.5).mismatched == 1
    assert compare(torch.tensor([3, 4, -2]), torch.tensor([3.0, 4.0, -2.0]), atol=0, rtol=0).passed


def test_one_tensor_under_two_names_with_one_expectation_is_counted_once():
    # an in-place variant returns its input: "out" and "x" are one tensor, both meant to
    # hold the sum; three wrong elements are three, not six
    def in_place(x):
        x.mul_(2)
        x[:3] += 1
        return x

    want = torch.arange(8.0) * 2
    g = check_variant(in_place, {"x": torch.arange(8.0)}, {}, {"out": want, "x": want.clone()}, atol=0, rtol=0, seed=0)
    assert not g.passed and g.wrong == 3 and [r.name for r in g.reports] == ["out"]
    # different expectations for the one tensor (an out-of-place variant that returned its
    # input): each is compared
    g = check_variant(lambda x: x, {"x": torch.arange(8.0)}, {}, {"out": want, "x": torch.arange(8.0)}, atol=0,
                      rtol=0, seed=0)
    assert [r.name for r in g.reports] == ["out", "x"] and not g.passed


def test_a_write_past_either_end_of_an_output_fails():
    src = torch.randn(17)
    exp = {"dst": src.clone()}

    def one_past(src, dst):
        dst.copy_(src)
        flat = dst.as_strided((18,), (1,))  # the element after the last
        flat[17] = 0.0

    def one_before(src, dst):
        dst.copy_(src)
        dst.as_strided((1,), (1,), dst.storage_offset() - 1).fill_(1.0)

    for fn, side in ((one_past, "1 element(s) after it"), (one_before, "1 element(s) before it")):
        bad = check_variant(fn, {"src": src}, {"dst": torch.empty(17)}, exp, atol=0, rtol=0, seed=1)
        assert not bad.passed and f"written outside it: {side}" in bad.summary(), bad.summary()
    assert check_variant(_copy_ok, {"src": src}, {"dst": torch.empty(17)}, exp, atol=0, rtol=0, seed=1).passed


def test_an_input_changed_that_the_case_does_not_expect_to_change_fails():
    src = torch.randn(17)
    exp = {"dst": src.clone()}

    def clobbers(src, dst):
        dst.copy_(src)
        src.zero_()

    bad = check_variant(clobbers, {"src": src}, {"dst": torch.empty(17)}, exp, atol=0, rtol=0, seed=1)
    assert not bad.passed and "src" in bad.summary() and "does not expect to change was changed" in bad.summary()


def test_a_returned_handle_that_is_not_a_tensor_is_not_an_output():
    # on a GPU `return kernel[grid](...)` returns the launch's CompiledKernel
    src = torch.randn(17)

    def returns_handle(src, dst):
        dst.copy_(src)
        return object()

    assert check_variant(returns_handle, {"src": src}, {"dst": torch.empty(17)}, {"dst": src.clone()},
                         atol=0, rtol=0, seed=1).passed
