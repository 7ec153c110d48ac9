"""RMSNorm kernels against their torch reference, the norm.rmsnorm case, plus the empty launch.

Runs on CPU tensors under Triton's interpreter when no CUDA device is present, and on
the GPU otherwise.  Shapes are small and odd (H = 5, 123, 130: below, just under and
just over a power of two) so that the masked tail of the block is exercised; inputs are
fresh seeded random values and outputs are poisoned with NaN, so an element the kernel
fails to write, or writes out of bounds, fails the test.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
# The interpreter must be switched on before triton and the kernel modules are imported:
# @triton.jit decides at decoration time whether it builds an interpreted kernel.
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from microbench.kernels.launch import empty_launch  # noqa: E402
from microbench.kernels.reference import rmsnorm_cost, rmsnorm_ref  # noqa: E402
from microbench.kernels.rmsnorm import MAX_HIDDEN, rmsnorm  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-6  # DeepSeek-V3's rms_norm_eps

DTYPE_TOLS = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 2e-3, 2e-3, id="fp16"),
    # bf16 keeps 8 mantissa bits (relative spacing 2**-8 ≈ 3.9e-3); the kernels widen
    # bf16 to fp32 before any arithmetic, so the interpreter runs them as the GPU does
    pytest.param(torch.bfloat16, 1.6e-2, 1.6e-2, id="bf16"),
]


def _inputs(T: int, H: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Fresh seeded inputs: x and residual ~ N(0, 1), weight ~ 1 + 0.5·N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32)  # noqa: E731
    return {
        "x": make(T, H).to(DEVICE, dtype),
        "residual": make(T, H).to(DEVICE, dtype),
        "weight": (1.0 + 0.5 * make(H)).to(DEVICE, dtype),
    }


def _nan_buffer(
    T: int, H: int, dtype: torch.dtype, guard: int = 7
) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled flat buffer and a [T, H] view of its start; the ``guard`` elements
    after the view stay NaN unless the kernel writes past the end of its rows."""
    buf = torch.full((T * H + guard,), float("nan"), dtype=dtype, device=DEVICE)
    return buf, buf[: T * H].view(T, H)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOLS)
@pytest.mark.parametrize("T", [1, 3, 7])
@pytest.mark.parametrize("H", [5, 123, 130])
def test_rmsnorm_matches_reference(
    dtype: torch.dtype, atol: float, rtol: float, T: int, H: int
) -> None:
    inp = _inputs(T, H, dtype, seed=1000 * T + H)
    x, weight = inp["x"], inp["weight"]
    x_before = x.clone()
    buf, out = _nan_buffer(T, H, dtype)

    got = rmsnorm(x, weight, EPS, out=out)

    assert got is out
    want, new_res = rmsnorm_ref(x_before, weight, EPS)
    assert new_res is None
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    assert torch.isnan(buf[T * H :]).all(), "kernel wrote past the end of out"
    assert torch.equal(x, x_before), "x must not be modified"


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOLS)
@pytest.mark.parametrize("T", [1, 3, 7])
@pytest.mark.parametrize("H", [5, 123, 130])
def test_fused_add_rmsnorm_matches_reference(
    dtype: torch.dtype, atol: float, rtol: float, T: int, H: int
) -> None:
    inp = _inputs(T, H, dtype, seed=7 + 1000 * T + H)
    x, weight = inp["x"], inp["weight"]
    x_before = x.clone()
    # The residual lives in a NaN-guarded buffer too, to catch out-of-bounds stores.
    res_buf, residual = _nan_buffer(T, H, dtype)
    residual.copy_(inp["residual"])
    res_before = residual.clone()
    res_ptr = residual.data_ptr()
    out_buf, out = _nan_buffer(T, H, dtype)

    got = rmsnorm(x, weight, EPS, residual=residual, out=out)

    assert got is out
    want, want_res = rmsnorm_ref(x_before, weight, EPS, residual=res_before)
    assert want_res is not None
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    # residual <- x + residual, in place and in x.dtype.
    assert residual.data_ptr() == res_ptr and residual.dtype == dtype
    torch.testing.assert_close(residual.float(), want_res, atol=atol, rtol=rtol)
    assert not torch.equal(residual, res_before), "residual was not updated in place"
    assert torch.isnan(out_buf[T * H :]).all(), "kernel wrote past the end of out"
    assert torch.isnan(res_buf[T * H :]).all(), "kernel wrote past the end of residual"
    assert torch.equal(x, x_before), "x must not be modified"


def test_allocates_out_in_x_dtype() -> None:
    inp = _inputs(3, 123, torch.float16, seed=5)
    got = rmsnorm(inp["x"], inp["weight"], EPS)
    assert got.shape == (3, 123) and got.dtype == torch.float16 and got.device == inp["x"].device
    want, _ = rmsnorm_ref(inp["x"], inp["weight"], EPS)
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def test_in_place_on_x_is_allowed() -> None:
    """out may be x itself: each program reads its row before writing it."""
    inp = _inputs(3, 130, torch.float32, seed=6)
    x = inp["x"]
    want, _ = rmsnorm_ref(x.clone(), inp["weight"], EPS)
    got = rmsnorm(x, inp["weight"], EPS, out=x)
    assert got is x
    torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)


def test_eps_is_applied() -> None:
    """A large eps must change the result, and the kernel must follow the reference."""
    inp = _inputs(3, 5, torch.float32, seed=8)
    small = rmsnorm(inp["x"], inp["weight"], 1e-6)
    large = rmsnorm(inp["x"], inp["weight"], 10.0)
    torch.testing.assert_close(large, rmsnorm_ref(inp["x"], inp["weight"], 10.0)[0])
    assert not torch.allclose(small, large, atol=1e-2)


def test_zero_rows() -> None:
    x = torch.empty(0, 123, device=DEVICE)
    got = rmsnorm(x, torch.ones(123, device=DEVICE), EPS)
    assert got.shape == (0, 123)


def _bad_calls() -> list:
    """(description, the failing call, argument name its message must start with)."""
    f32, f16 = torch.float32, torch.float16
    t = lambda *shape, dtype=f32: torch.randn(*shape, device=DEVICE, dtype=dtype)  # noqa: E731
    w = t(8)

    def out_is_residual() -> None:
        r = t(2, 8)
        rmsnorm(t(2, 8), w, EPS, residual=r, out=r)

    def out_overlaps_residual() -> None:
        buf = t(3 * 8)  # out starts one row into residual
        rmsnorm(t(2, 8), w, EPS, residual=buf[:16].view(2, 8), out=buf[8:].view(2, 8))

    def out_overlaps_weight() -> None:
        buf = t(2 * 8)  # weight is out's second row
        rmsnorm(t(2, 8), buf[8:], EPS, out=buf.view(2, 8))

    def out_overlaps_x_partly() -> None:
        buf = t(3 * 8)  # out starts one row into x: row 1 of x written (as row 0 of out) before it is read
        rmsnorm(buf[:16].view(2, 8), w, EPS, out=buf[8:].view(2, 8))

    i32 = torch.ones(2, 8, dtype=torch.int32, device=DEVICE)
    return [
        ("x 1-D", lambda: rmsnorm(t(8), w, EPS), "x"),
        ("x int", lambda: rmsnorm(i32, w, EPS), "x"),
        ("x non-contiguous", lambda: rmsnorm(t(8, 2).t(), w, EPS), "x"),
        ("H too large", lambda: rmsnorm(t(1, MAX_HIDDEN + 1), t(MAX_HIDDEN + 1), EPS), "x"),
        ("H zero", lambda: rmsnorm(t(2, 0), t(0), EPS), "x"),
        ("weight shape", lambda: rmsnorm(t(2, 8), t(7), EPS), "weight"),
        ("weight dtype", lambda: rmsnorm(t(2, 8), t(8, dtype=f16), EPS), "weight"),
        ("weight non-contiguous", lambda: rmsnorm(t(2, 8), t(16)[::2], EPS), "weight"),
        ("weight device", lambda: rmsnorm(t(2, 8), torch.ones(8, device="meta"), EPS), "weight"),
        ("residual shape", lambda: rmsnorm(t(2, 8), w, EPS, residual=t(3, 8)), "residual"),
        ("residual dtype", lambda: rmsnorm(t(2, 8), w, EPS, residual=t(2, 8, dtype=f16)),
         "residual"),
        ("residual strided", lambda: rmsnorm(t(2, 8), w, EPS, residual=t(8, 2).t()), "residual"),
        ("out shape", lambda: rmsnorm(t(2, 8), w, EPS, out=t(2, 9)), "out"),
        ("out dtype", lambda: rmsnorm(t(2, 8), w, EPS, out=t(2, 8, dtype=f16)), "out"),
        ("out is residual", out_is_residual, "out"),
        ("out overlaps residual", out_overlaps_residual, "out"),
        ("out overlaps weight", out_overlaps_weight, "out"),
        ("out overlaps x partly", out_overlaps_x_partly, "out"),
        ("eps negative", lambda: rmsnorm(t(2, 8), w, -1.0), "eps"),
        ("eps bool", lambda: rmsnorm(t(2, 8), w, True), "eps"),
        ("eps nan", lambda: rmsnorm(t(2, 8), w, float("nan")), "eps"),
    ]


_BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("what, call, name", _BAD_CALLS, ids=[c[0] for c in _BAD_CALLS])
def test_bad_arguments_raise_value_error(what: str, call, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()


def test_cost_formula() -> None:
    # bf16, T=4, H=7168: plain = read x + weight + write y; fused adds residual r/w.
    T, H, e = 4, 7168, 2
    assert rmsnorm_cost(T, H, e, fused_residual=False) == ((2 * T * H + H) * e, 4 * T * H)
    assert rmsnorm_cost(T, H, e, fused_residual=True) == ((4 * T * H + H) * e, 5 * T * H)
    assert rmsnorm_cost(0, H, e, fused_residual=True) == (H * e, 0)  # no rows: the weight alone
    for bad in ((-1, H, e), (T, 0, e), (T, H, 0)):
        with pytest.raises(ValueError, match="rmsnorm_cost"):
            rmsnorm_cost(*bad, fused_residual=False)


def test_eps_zero_is_allowed() -> None:
    inp = _inputs(3, 123, torch.float32, seed=9)
    got = rmsnorm(inp["x"], inp["weight"], 0.0)
    torch.testing.assert_close(got, rmsnorm_ref(inp["x"], inp["weight"], 0.0)[0], atol=1e-5, rtol=1e-5)


def test_the_widest_row_runs() -> None:
    inp = _inputs(1, MAX_HIDDEN, torch.float32, seed=10)
    got = rmsnorm(inp["x"], inp["weight"], EPS)
    torch.testing.assert_close(got, rmsnorm_ref(inp["x"], inp["weight"], EPS)[0], atol=1e-5, rtol=1e-5)


def test_out_may_sit_right_after_residual_in_one_buffer() -> None:
    """Touching but disjoint spans are not an overlap."""
    inp = _inputs(2, 8, torch.float32, seed=11)
    buf = torch.empty(2 * 2 * 8, device=DEVICE)
    residual, out = buf[:16].view(2, 8), buf[16:].view(2, 8)
    residual.copy_(inp["residual"])
    want, want_res = rmsnorm_ref(inp["x"], inp["weight"], EPS, residual=inp["residual"])
    rmsnorm(inp["x"], inp["weight"], EPS, residual=residual, out=out)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(residual, want_res, atol=1e-5, rtol=1e-5)


def test_arguments_that_are_not_tensors_raise_type_error() -> None:
    x, w = torch.randn(2, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    for call, name in ((lambda: rmsnorm(x.tolist(), w, EPS), "x"), (lambda: rmsnorm(x, w.tolist(), EPS), "weight"),
                       (lambda: rmsnorm(x, w, EPS, residual=x.tolist()), "residual"),
                       (lambda: rmsnorm(x, w, EPS, out=x.tolist()), "out"), (lambda: empty_launch([0.0]), "x")):
        with pytest.raises(TypeError, match=rf"^{name}:"):
            call()


def test_a_compiled_kernel_refuses_cpu_tensors_unless_launches_only_compile(monkeypatch) -> None:
    from microbench.kernels import checks

    not_interpreted = object()
    with pytest.raises(ValueError, match=r"^x: on cpu; the kernel needs a CUDA tensor"):
        checks.require_runnable(not_interpreted, torch.zeros(1))
    monkeypatch.setattr(checks, "COMPILE_ONLY", True)
    checks.require_runnable(not_interpreted, torch.zeros(1))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_the_case_normalises_the_layers_widths_and_fuses_the_residual_into_the_input_norm(dtype: str) -> None:
    from microbench.cases.common import model
    from microbench.cases.rmsnorm import RMSNormCase

    m, case = model(), RMSNormCase()
    for norm, width, fused in (("input", m.hidden_size, True), ("q_a", m.q_lora_rank, False),
                               ("kv_a", m.kv_lora_rank, False)):
        w = case.setup({"tokens": 2, "norm": norm, "dtype": dtype}, DEVICE, 0)
        x, weight = w.inputs["x"], w.inputs["weight"]
        assert x.shape == (2, width) and w.outputs["out"].shape == (2, width) and w.inputs["eps"] == m.rms_norm_eps
        assert ("residual" in w.inputs) is fused
        assert (w.cost.bytes, w.cost.flops) == rmsnorm_cost(2, width, x.element_size(), fused)
        assert float(weight.float().std()) > 0.1  # a weight of ones would hide one left unapplied
        ref = case.reference(w)
        assert set(ref) == ({"out", "residual"} if fused else {"out"})
        if fused:  # an x + residual that is not 2x: normalising x alone would match it
            assert not torch.equal(w.inputs["residual"], x)
            torch.testing.assert_close(ref["residual"], x.float() + w.inputs["residual"].float())


def test_both_case_variants_update_the_residual_and_follow_the_reference_at_a_large_eps() -> None:
    from microbench.cases.rmsnorm import RMSNormCase

    for v in RMSNormCase().variants():
        for fused in (False, True):
            inp = _inputs(3, 130, torch.float32, seed=12)
            residual = inp["residual"].clone() if fused else None
            out = torch.full_like(inp["x"], float("nan"))
            v.fn(inp["x"], inp["weight"], 4.0, out, residual=residual)
            want, want_res = rmsnorm_ref(inp["x"], inp["weight"], 4.0, residual=inp["residual"] if fused else None)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            if fused:
                torch.testing.assert_close(residual, want_res, atol=1e-5, rtol=1e-5)


def test_the_case_checks_bf16_on_the_gpu_alone() -> None:
    from microbench.cases.rmsnorm import RMSNormCase

    case = RMSNormCase()
    assert "bf16 is checked on the GPU" in case.skip({"tokens": 1, "norm": "kv_a", "dtype": "bf16"}, "cpu")
    assert case.skip({"tokens": 1, "norm": "kv_a", "dtype": "bf16"}, "cuda:0") is None
    assert case.skip({"tokens": 1, "norm": "kv_a", "dtype": "fp16"}, "cpu") is None


def test_empty_launch_runs() -> None:
    x = torch.zeros(4, device=DEVICE)
    assert empty_launch(x) is None
    assert torch.equal(x, torch.zeros(4, device=DEVICE)), "the empty kernel must not write"
    if CUDA:
        torch.cuda.synchronize()


def test_empty_launch_is_one_program_of_one_warp(monkeypatch) -> None:
    from microbench.kernels import launch

    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(launch, "_empty_kernel", Kernel())
    monkeypatch.setattr(launch, "require_runnable", lambda kernel, t: None)
    x = torch.zeros(4, device=DEVICE)
    launch.empty_launch(x)
    assert launches == [((1,), (x,), {"num_warps": 1})]


def test_cupy_empty_launch_passes_the_stream_and_enters_a_device_only_when_it_differs(monkeypatch) -> None:
    """CuPy itself needs a GPU; a stand-in records what the launcher hands it."""
    import sys
    import types

    from microbench.kernels import launch

    calls, entered = [], []

    class Kernel:
        def __init__(self, source, name):
            assert name in source

        def __call__(self, grid, block, args, **kwargs):
            calls.append((grid, block, args, kwargs))

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            return False

    current, wrapped = {"device": 0}, []
    cuda = types.SimpleNamespace(
        ExternalStream=lambda ptr: wrapped.append(ptr) or ("stream", ptr), Device=Device,
        runtime=types.SimpleNamespace(getDevice=lambda: current["device"]))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawKernel=Kernel, cuda=cuda))
    monkeypatch.setattr(launch, "_cupy_state", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=1234))
    x = types.SimpleNamespace(device=torch.device("cuda", 1), data_ptr=lambda: 99)  # what the launcher reads

    current["device"] = 1
    launch.cupy_empty_launch(x)
    assert calls == [((1,), (1,), (99,), {"stream": ("stream", 1234)})] and entered == []
    current["device"] = 0
    launch.cupy_empty_launch(x)
    assert len(calls) == 2 and calls[1] == calls[0] and entered == [1]
    assert wrapped == [1234]  # the stream is wrapped once, not on every timed call
