"""Benchmarks through microbench's engine: ``pytest tests/bench --benchmark-only``."""

from __future__ import annotations

import pytest
import torch

from microbench import env

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SUITE = "verify" if DEVICE == "cuda" else "smoke"


def pytest_benchmark_update_machine_info(config, machine_info):  # noqa: ARG001 - pytest-benchmark hook
    # the machine alone: --benchmark-compare warns when machine_info differs, and the clocks,
    # temperature and power of the moment (and the commit) differ on every run; they go
    # into each bench's extra_info instead ("environment", the `moment` fixture)
    machine_info["microbench"] = env.split_fingerprint(env.fingerprint(DEVICE))[0]


@pytest.fixture(scope="session")
def cache_bytes() -> int | None:
    return env.l2_cache_bytes(DEVICE)


@pytest.fixture(scope="session")
def moment() -> dict:
    """The session's readings of the moment: what machine_info leaves out."""
    return env.split_fingerprint(env.fingerprint(DEVICE))[1]


@pytest.fixture
def mb_bench(benchmark, cache_bytes, moment, request):
    """``mb_bench(case, point, variant)``: gate, then time through the engine into ``benchmark``."""
    from microbench.bench import bench_case
    from microbench.timing import TimingOptions

    budget = request.config.getoption("--mb-budget-s")

    def run(case, point, variant):
        opts = TimingOptions(mode=case.point_timing_mode(point), budget_s=budget)
        info = bench_case(benchmark, case, point, variant, device=DEVICE, cache_bytes=cache_bytes, options=opts)
        benchmark.extra_info["environment"] = moment
        return info

    return run
