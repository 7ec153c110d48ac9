"""The environment probe: a fixed reference workload timed beside every point.

Separate runs are not independent: on a shared 2-core machine the same code timed in
separate processes moves by up to ~20% while each run's own interval of the median is
under 1%. A within-run interval cannot see that shift. So every point also times this
probe — the same work in every run, forever — and ``compare`` divides a case's ratio by
the probe's ratio: "the environment moved 18%, this case moved with it".

The workload mirrors what the cases spend time on: on CPU, interpreter-bound dispatch of
small torch ops plus a little arithmetic (the Triton interpreter is that kind of load);
on CUDA, a device copy of 64 MiB (memory clock and bandwidth state), whose SM-clock
counterpart the NVML sampler records.
"""

from __future__ import annotations

from typing import Any, Callable

from microbench.timing import TimingOptions, measure

#: Version of the workload below: a probe is only comparable with the same version.
PROBE_VERSION = 2
#: Short and noisy-tolerant: the probe must cost little beside each point.
PROBE_TIMING = TimingOptions(mode="hot", min_samples=15, max_samples=400, min_time_s=0.005,
                             budget_s=0.08, max_noise=0.01, warmup_s=0.005)


def _cpu_workload() -> Callable[[], Any]:
    import torch

    g = torch.Generator().manual_seed(1234)
    a = torch.randn(48, 48, generator=g)
    b = torch.randn(48, 48, generator=g)
    c = torch.empty(48, 48)
    # 4 MiB: beyond L2, inside a typical LLC: sees a co-tenant's cache and memory pressure,
    # which the small in-L1 matmuls alone do not (a 384^3 matmul moved 49% between two runs
    # while a matmul-only probe moved 0%).
    src = torch.randn(1 << 20, generator=g)
    dst = torch.empty_like(src)

    def work() -> None:
        for _ in range(4):
            torch.mm(a, b, out=c)
            c.add_(a)
        dst.copy_(src)

    return work


def _cuda_workload(device: str) -> Callable[[], Any]:
    import torch

    n = (64 << 20) // 4
    src = torch.arange(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def measure_probe(device: str, cache_bytes: int | None = None) -> dict[str, Any]:
    """Time the probe on ``device``; returns {"version", "workload", "median_s", "samples_s"}.

    The runner calls it before and after each point and pools the two (:func:`pool`), so
    the probe sees the environment of the whole point, not only of its end."""
    cuda = device.startswith("cuda")
    fn = _cuda_workload(device) if cuda else _cpu_workload()
    opts = TimingOptions(**{**PROBE_TIMING.__dict__, "mode": "cold" if cuda else "hot"})
    m = measure(fn, device=device, options=opts, cache_bytes=cache_bytes)
    return {
        "version": PROBE_VERSION,
        "workload": "cuda copy 64 MiB" if cuda else "cpu 4x(48x48 mm + add) + 4 MiB copy",
        "median_s": m.summary.median,
        "rel_noise": m.summary.rel_noise,
        "samples_s": m.samples_s,
    }


def pool(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One probe record from the probes taken before and after a point."""
    import numpy as np

    samples = list(before["samples_s"]) + list(after["samples_s"])
    return {**before, "median_s": float(np.median(samples)), "samples_s": samples, "n_before": len(before["samples_s"]),
            "before_median_s": before["median_s"], "after_median_s": after["median_s"], "rel_noise": None}
