"""pytest-benchmark integration: time a case point through microbench's own engine.

``pytest tests/bench --benchmark-only`` on a GPU host gates each (case, point, variant)
and times it with CUDA events (the engine's cold mode by default), then hands the raw
per-call samples to pytest-benchmark, so its tables, ``--benchmark-save`` and
``--benchmark-compare`` work on device times rather than host clocks. GB/s, % of floor,
the noise and the stopping rule go into ``extra_info``; the GPU fingerprint goes into
``machine_info`` (see tests/bench/conftest.py). Without a GPU each bench runs once as a
correctness check and says so in ``extra_info``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from microbench.case import Case, Point
from microbench.gate import check_variant
from microbench.timing import TimingOptions, measure


class GateFailure(AssertionError):
    """A variant failed its correctness gate: it is not timed."""


def _profile_floor(device: str, nbytes: int, flops: int) -> tuple[float | None, str | None]:
    if not device.startswith("cuda"):
        return None, None
    import torch

    from microbench.hardware import profile_for_device_name

    prof = profile_for_device_name(torch.cuda.get_device_name())
    if prof is None:
        return None, None
    terms = [nbytes / prof.memory_bandwidth.value if nbytes else 0.0,
             flops / prof.bf16_dense_flops.value if flops else 0.0]
    return max(terms), f"profile {prof.name} (datasheet)"


def bench_case(benchmark: Any, case: Case, point: Point, variant: str, *, device: str,
               options: TimingOptions | None = None, seed: int = 0, cache_bytes: int | None = None) -> dict[str, Any]:
    """Gate ``variant`` of ``case`` at ``point`` and time it into ``benchmark``; returns extra_info."""
    v = case.variant(variant)
    if case.distributed:  # one rank here: the path's fixed cost per call
        from microbench.distributed import solo_world

        solo_world(device)
    s = case.input_seed(seed, point)
    w = case.setup(point, device, s)
    gate = check_variant(v.fn, w.inputs, w.outputs, case.reference_for(w, v), **case.gate_tolerances(point), seed=s)
    if not gate.passed:
        raise GateFailure(f"{case.id} {point} {variant}: {gate.summary()}")
    info: dict[str, Any] = {"case": case.id, "axes": dict(point), "variant": variant, "device": device,
                            "bytes": w.cost.bytes, "flops": w.cost.flops, "seed": s, "gate": gate.summary()}
    if getattr(benchmark, "disabled", False):
        return info
    if device.startswith("cuda"):
        opts = options or TimingOptions(mode=case.point_timing_mode(point))
        calls, note = w.timed_calls(v.fn, opts.resolved_mode(device), cache_bytes)  # as `microbench run` times it
        m = measure(calls, device=device, options=opts, cache_bytes=cache_bytes)
        samples = m.samples_s
        if note or m.notes:
            info["timing_notes"] = [*m.notes, *([note] if note else [])]
        t = m.summary.median
        floor, src = _profile_floor(device, w.cost.bytes, w.cost.flops)
        info.update(timer=m.timer, mode=m.mode, median_s=t, rel_noise=m.summary.rel_noise,
                    stop_reason=m.stop_reason, batch=m.batch,
                    gbps=w.cost.bytes / t / 1e9 if w.cost.bytes else None,
                    tflops=w.cost.flops / t / 1e12 if w.cost.flops else None,
                    pct_of_floor=100 * floor / t if floor else None, floor_source=src)
    else:
        call = functools.partial(v.fn, **w.kwargs())
        t0 = time.perf_counter()
        call()
        samples = [time.perf_counter() - t0]
        info.update(timer="perf_counter", note="no GPU: run once as a correctness check, not a timing")
    _feed(benchmark, samples)
    benchmark.extra_info.update({k: v for k, v in info.items() if v is not None})
    return info


def _feed(benchmark: Any, samples: list[float]) -> None:
    """Give pytest-benchmark our samples as its rounds (one call per round)."""
    make = getattr(benchmark, "_make_stats", None)
    if make is None:  # pragma: no cover - depends on the installed pytest-benchmark
        raise RuntimeError("this pytest-benchmark has no _make_stats(); microbench needs pytest-benchmark >= 4")
    benchmark._mode = "microbench.bench_case(...)"
    stats = make(1)
    for x in samples:
        stats.update(x)
