"""Shared test set-up.

Without a GPU, Triton kernels run on CPU tensors under the interpreter, which Triton
switches on when a kernel is *decorated* — so the variable is set here, before any test
module imports a kernel. Tests marked ``gpu`` are skipped without CUDA, with the reason.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # as `microbench run` does on CPU: a busy second core stalls OpenMP barriers
    torch.set_num_threads(1)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    # the interpreter's bf16 tl.dot multiplies raw bit patterns; made to compute as a tensor
    # core does, so the kernels' bf16 paths are checked on CPU too (tests/interp_bf16.py)
    from tests.interp_bf16 import install as _install_bf16_dot

    BF16_DOT = _install_bf16_dot()
else:
    BF16_DOT = True  # compiled kernels: the GPU's own bf16 dot


def pytest_report_header(config: pytest.Config) -> str:
    """Which torch and Triton the kernels ran under (scripts/test-triton-floor puts an
    older Triton first on the path), and whether Triton interpreted them."""
    try:
        import triton

        tri = f"triton {triton.__version__} ({os.path.dirname(triton.__file__)})"
    except ImportError:
        tri = "triton: not importable"
    mode = "compiled"
    if INTERPRETED:
        mode = "interpreter" + ("" if BF16_DOT else ", bf16 dot not patched")
        from tests.interp_checks import checks

        mode += {True: ", debug checks on", False: ", debug checks off"}.get(checks(), "")
    return f"microbench: torch {torch.__version__}, {tri}, kernels {mode}, CUDA {HAS_CUDA}"


def pytest_configure(config: pytest.Config) -> None:
    if INTERPRETED:  # off unless asked for, as a compiled kernel runs (tests/interp_checks.py)
        from tests.interp_checks import set_checks

        set_checks(config.getoption("--triton-checks"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--mb-budget-s", type=float, default=1.0,
                     help="microbench benches: time budget per bench in seconds (default 1.0)")
    parser.addoption("--mb-suite", default=None,
                     help="microbench benches: the suite whose points to bench (default: verify on a GPU, "
                          "smoke on CPU)")
    parser.addoption("--triton-checks", action="store_true",
                     help="interpreted kernels: raise on an int32 add, sub or mul that overflows and on a failed "
                          "tl.device_assert (Triton's debug mode; about a third of an interpreted MoE kernel's "
                          "time). Off by default, as a compiled kernel runs; scripts/test-triton-floor turns "
                          "them on for every kernel's tests")


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the benches time cases through pytest-benchmark, which switches itself off under xdist
    bench = os.path.join(os.path.dirname(__file__), "bench") + os.sep
    for item in items:
        if str(item.path).startswith(bench):
            item.add_marker(pytest.mark.serial)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
