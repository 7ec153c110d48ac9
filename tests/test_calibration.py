"""The calibration cases and the harness self-test: the work each call does, and the bytes
and FLOPs each declares for it (a ceiling is a rate, so a wrong count is a wrong ceiling)."""

from __future__ import annotations

import math

import pytest
import torch

from microbench.cases.calibration import MiB, CopyBandwidth, LaunchFloor, MatmulRate
from microbench.cases.common import on_cuda
from microbench.cases.selftest import CpuWork


def test_the_copy_moves_its_size_read_and_written():
    case = CopyBandwidth()
    w = case.setup({"size_mib": 1}, "cpu", 0)
    src = w.inputs["src"]
    assert src.numel() * src.element_size() == MiB and w.outputs["dst"].shape == src.shape
    assert w.cost.bytes == 2 * MiB and w.cost.flops == 0
    assert torch.equal(case.reference(w)["dst"], src)


def test_the_matmul_counts_two_flops_per_multiply_add_and_each_matrix_once():
    case = MatmulRate()
    w = case.setup({"n": 24, "dtype": "fp32"}, "cpu", 0)
    assert w.cost.flops == 2 * 24**3 and w.cost.bytes == 3 * 24 * 24 * 4
    a, b = w.inputs["a"], w.inputs["b"]
    torch.testing.assert_close(case.reference(w)["c"], a @ b)
    atol, rtol = case.tolerances["bf16"]
    assert case.tolerance({"n": 64, "dtype": "bf16"}) == (atol * math.sqrt(64), rtol)  # |c| grows as sqrt(n)


def test_the_launch_floor_quotes_the_eager_torch_op_and_captures_no_python_call():
    case = LaunchFloor()
    assert case.counts_for_ceiling({"variant": "torch_tiny_op", "axes": {"capture": "eager"}})
    assert not case.counts_for_ceiling({"variant": "torch_tiny_op", "axes": {"capture": "graph"}})
    assert not case.counts_for_ceiling({"variant": "triton_empty", "axes": {"capture": "eager"}})
    assert "nothing to capture" in case.skip_variant("python_noop", {"grid": 1, "capture": "graph"}, "cuda")
    assert case.skip_variant("python_noop", {"grid": 1, "capture": "eager"}, "cuda") is None
    assert case.skip_variant("cupy_empty", {"grid": 1, "capture": "eager"}, "cpu") == "CuPy kernels need a CUDA device"


def test_the_launch_floors_torch_op_dispatches_one_in_place_op_that_changes_nothing():
    from torch.overrides import TorchFunctionMode

    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    fn = {v.name: v.fn for v in LaunchFloor().variants()}["torch_tiny_op"]
    x = torch.ones(1)
    with Record():
        fn(x)
    assert seen == ["add_"] and x.item() == 1.0


def test_the_self_test_runs_the_same_matmuls_and_ten_percent_more(monkeypatch):
    case = CpuWork(reps=40)
    assert case.extra_reps == 44
    w = case.setup({"size": 8}, "cpu", 0)
    assert w.cost.flops == 2 * 8**3 * 40 and w.cost.bytes == 3 * 8 * 8 * 4 * 40
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, out: calls.append(1) or real_mm(a, b, out=out))
    counts = {}
    for v in case.variants():
        calls.clear()
        v.fn(**w.inputs, **w.outputs)
        counts[v.name] = len(calls)
    assert counts == {"anchor": 40, "work": 40, "work+10%": 44}
    torch.testing.assert_close(w.outputs["c"], case.reference(w)["c"], atol=1e-5, rtol=1e-5)
    assert case.skip({"size": 64}, "cpu") is None and "--device cpu" in case.skip({"size": 64}, "cuda")


@pytest.mark.parametrize(("device", "cuda"), [("cuda", True), ("cuda:1", True), ("cpu", False)])
def test_any_cuda_device_is_on_cuda(device, cuda):
    assert on_cuda(device) is cuda


def test_a_large_input_is_drawn_unless_launches_only_compile(monkeypatch):
    """Only ``microbench compile`` may leave a large tensor undrawn (nothing reads it): a
    timed copy of 64 MiB checks drawn values, not whatever memory held."""
    from microbench.cases import common
    from microbench.kernels import checks

    shape = (common.UNDRAWN_NUMEL,)
    want = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(common.randn(shape, torch.float32, "cpu", 3), want)
    small = torch.randn(8, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(common.randn((8,), torch.float32, "cpu", 4), small)  # the seed names the draw
    monkeypatch.setattr(checks, "COMPILE_ONLY", True)
    assert torch.equal(common.randn((8,), torch.float32, "cpu", 3), small)  # small inputs are still drawn
