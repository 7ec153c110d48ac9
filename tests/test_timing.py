"""The timing engine: the stopping rule against synthetic timers, and the CPU path for real."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from microbench.samplers import copies_for_cold_cache
from microbench.stats import median_rel_noise
from microbench.timing import (TimingOptions, measure, measure_interleaved, run_interleaved, run_until_stable,
                               stop_reason)

from .helpers import FakeClock


def test_quiet_timer_stops_on_noise_after_min_samples():
    clock = FakeClock()
    opts = TimingOptions(min_samples=10, min_time_s=0.0, max_noise=0.005, budget_s=10.0)
    samples, reason, _ = run_until_stable(clock.sampler(np.random.default_rng(0), 1e-3, 0.001), opts, clock)
    assert reason == "noise"
    assert len(samples) == 10  # 0.1% noise meets a 0.5% target as soon as it is allowed to stop


def test_noisier_timer_needs_more_samples_roughly_by_variance():
    counts = []
    for sigma in (0.01, 0.04):
        clock = FakeClock()
        opts = TimingOptions(min_samples=10, min_time_s=0.0, max_noise=0.005, budget_s=1e9, max_samples=100_000)
        samples, reason, _ = run_until_stable(clock.sampler(np.random.default_rng(1), 1e-3, sigma), opts, clock)
        assert reason == "noise"
        counts.append(len(samples))
    # n ~ (z sigma / target)^2: four times the noise needs ~16x the samples
    assert 6 < counts[1] / counts[0] < 40, counts


def test_budget_ends_a_noisy_measurement_and_says_so():
    clock = FakeClock()
    opts = TimingOptions(min_samples=10, max_noise=0.001, budget_s=0.5)
    samples, reason, elapsed = run_until_stable(clock.sampler(np.random.default_rng(2), 1e-2, 0.3), opts, clock)
    assert reason == "budget"
    assert 0.5 <= elapsed < 0.5 + 0.2  # stops within a sample or so of the budget
    assert len(samples) < 100


def test_min_time_holds_even_when_noise_is_met():
    clock = FakeClock()
    opts = TimingOptions(min_samples=5, min_time_s=0.1, max_noise=0.5, budget_s=10)
    samples, reason, _ = run_until_stable(clock.sampler(np.random.default_rng(3), 1e-3, 0.0001), opts, clock)
    assert reason == "noise" and sum(samples) >= 0.1 and len(samples) >= 100


def test_max_samples_caps_and_floor_of_three_under_budget():
    assert stop_reason(50, 1.0, 0.0, math.inf, TimingOptions(min_samples=10, max_samples=50)) == "max_samples"
    # a 2 s call under a 1 s budget still gets three samples: one gives no spread
    opts = TimingOptions(budget_s=1.0)
    assert stop_reason(1, 2.0, 2.0, math.inf, opts) is None
    assert stop_reason(3, 6.0, 6.0, math.inf, opts) == "budget"


def test_interleaved_pairs_rounds_and_waits_for_every_variant():
    clock = FakeClock()
    rng = np.random.default_rng(4)
    quiet, noisy = clock.sampler(rng, 1e-3, 0.001), clock.sampler(rng, 1e-3, 0.03)
    opts = TimingOptions(min_samples=10, min_time_s=0.0, max_noise=0.005, budget_s=100)
    (a, b), reason, _ = run_interleaved([quiet, noisy], opts, clock)
    # the quiet one waited for the noisy one to meet the target
    assert reason == "noise" and median_rel_noise(b) <= 0.005 and len(a) == len(b) > 100


def _placed_takes(clock, k, times, place_factor, rng, sigma=0.005):
    """k takes whose call lasts times[i] x place_factor[p], p its place in the round
    (calls are counted across takes: the p-th call of a round), x lognormal noise."""
    made = {"calls": 0}
    order: list[int] = []

    def make(i):
        def take():
            p = made["calls"] % k
            made["calls"] += 1
            order.append(i)
            s = times[i] * place_factor[p] * float(rng.lognormal(0.0, sigma))
            clock.t += s
            return s
        return take
    return [make(i) for i in range(k)], order


def test_interleaved_rounds_rotate_the_order_and_end_on_whole_rotations():
    clock = FakeClock()
    takes, order = _placed_takes(clock, 3, [1e-3] * 3, [1.0] * 3, np.random.default_rng(5), sigma=0.0)
    opts = TimingOptions(min_samples=3, min_time_s=0.0, max_noise=0.5, budget_s=100)
    samples, reason, _ = run_interleaved(takes, opts, clock)
    rounds = [order[i:i + 3] for i in range(0, len(order), 3)]
    assert rounds[:4] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    # noise was met at once: the loop still waits for 6 whole rotations (the verdict's least)
    assert reason == "noise" and len(samples[0]) == len(rounds) == 18


def test_a_place_in_the_round_that_runs_faster_does_not_make_a_verdict():
    """The second call of a round 3% faster (a 2-core CPU showed 1.4%): identical
    variants interleaved A B A B would read FASTER; rotated, each pair of rounds gives
    both places to both, and the verdict is SAME; 10% more work is still SLOWER."""
    from microbench.verdicts import compare_paired

    for slower, want in ((1.0, "SAME"), (1.10, "SLOWER")):
        clock = FakeClock()
        takes, _ = _placed_takes(clock, 2, [1e-3, 1e-3 * slower], [1.0, 0.97], np.random.default_rng(6))
        (a, b), _, _ = run_interleaved(takes, TimingOptions(min_samples=40, min_time_s=0.0, budget_s=100), clock)
        v = compare_paired(a, b, rotation=2)
        assert v.label == want and v.ratio == pytest.approx(slower, rel=0.005), v.explain()
        assert compare_paired(a[::2], b[::2]).ratio == pytest.approx(0.97 * slower, rel=0.005)  # B second


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="mode"):
        TimingOptions(mode="warm")
    with pytest.raises(ValueError, match="graph mode needs a CUDA"):
        TimingOptions(mode="graph").resolved_mode("cpu")
    for bad in ({"budget_s": float("nan")}, {"max_noise": float("nan")}, {"budget_s": 0.0}, {"max_noise": -0.1}):
        with pytest.raises(ValueError, match="must be positive"):
            TimingOptions(**bad)
    assert TimingOptions(budget_s=math.inf).budget_s == math.inf  # no budget: noise or max_samples ends it


def test_cpu_measure_real_function_keeps_raw_samples_and_stats():
    a = torch.randn(64, 64)
    m = measure(lambda: a @ a, device="cpu", options=TimingOptions(budget_s=0.3))
    assert m.timer == "perf_counter_ns" and m.mode == "hot"
    assert m.summary.count == len(m.samples_s) >= 10
    assert m.summary.min <= m.summary.p20 <= m.summary.median <= m.summary.p80 <= m.summary.max
    assert m.stop_reason in ("noise", "budget")
    d = m.to_dict()
    assert type(m).from_dict(d).samples_s == m.samples_s
    # a record's timing, with what the runner adds beside the measurement's own fields
    assert type(m).from_dict({**d, "interleaved": True, "budget_s": 0.1}) == m
    # the timer's step per call, and the tick its samples show (ns / the calls of a sample)
    assert m.resolution_s == pytest.approx(time.get_clock_info("perf_counter").resolution / m.batch)
    assert 0 < m.summary.tick < 1e-3 * m.summary.median
    # a measurement written before ticks were kept loads, their tick unknown
    del d["resolution_s"], d["summary"]["tick"]
    old = type(m).from_dict(d)
    assert (old.resolution_s, old.summary.tick) == (0.0, 0.0) and old.summary.median == m.summary.median


def test_cpu_cold_mode_flushes_and_times_one_call_per_sample():
    m = measure(lambda: time.sleep(0), device="cpu", options=TimingOptions(mode="cold", budget_s=0.2),
                cache_bytes=1 << 20)
    assert m.batch == 1 and m.flush_bytes == 2 << 20


def test_the_cuda_flush_writes_then_reads_the_whole_buffer():
    """The cold flush's two passes (the same torch calls run on the GPU): every element is
    written and then summed, into the preallocated scalar."""
    from microbench.samplers import _flush_buffer, _flush_cache

    buf, total = _flush_buffer("cpu", 1 << 12)
    buf.fill_(7)
    total.fill_(-1)
    _flush_cache(buf, total)
    assert buf.numel() * 8 >= 1 << 12 and int(buf.abs().sum()) == 0 and int(total) == 0
    assert total.dtype == torch.int64 and total.dim() == 0


def test_the_flush_reads_its_buffer_in_place():
    """A sum into a wider type first copies its whole input: the flush would move 3x the
    bytes it means to and hold a second buffer of 2x the L2."""
    from microbench.samplers import _flush_buffer, _flush_cache

    buf, total = _flush_buffer("cpu", 1 << 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _flush_cache(buf, total)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::sum" in ops and not ops & {"aten::to", "aten::_to_copy", "aten::copy_"}, ops


def _batched_take(clock, per_call_s, batch):
    """A synthetic sample of ``batch`` calls: the clock moves by the whole batch, the sample
    returned is per call (as the hot and graph samplers return it)."""
    rng = np.random.default_rng(5)

    def take() -> float:
        s = float(per_call_s * rng.lognormal(0.0, 0.001))
        clock.t += s * batch
        return s
    return take


def test_min_time_counts_each_sample_whole_not_per_call():
    # 256 calls of 2 µs a sample: 0.5 ms a sample, so 10 ms of measured time takes 20
    # samples; counted per call it would take 2000 and end on the budget instead
    clock = FakeClock()
    opts = TimingOptions(min_samples=10, min_time_s=0.01, max_noise=0.005, budget_s=1.0)
    samples, reason, _ = run_until_stable(_batched_take(clock, 2e-6, 256), opts, clock, batch=256)
    assert reason == "noise" and 19 <= len(samples) <= 21
    (a, b), reason, _ = run_interleaved([_batched_take(clock, 2e-6, 256), _batched_take(clock, 4e-6, 128)], opts,
                                        clock, batches=[256, 128])
    assert reason == "noise" and len(a) == len(b) <= 21


def test_cuda_hot_samples_are_longer_than_cpu_ones():
    assert TimingOptions().resolved_min_sample_s("cuda:0") == 1e-3
    assert TimingOptions().resolved_min_sample_s("cpu") == 20e-6
    assert TimingOptions(min_sample_s=5e-5).resolved_min_sample_s("cuda") == 5e-5


@pytest.mark.serial
def test_interleaved_cpu_measurements_have_equal_counts():
    x = torch.randn(32, 32)
    ms = measure_interleaved([[lambda: x @ x], [lambda: x @ x @ x]], device="cpu",
                             options=TimingOptions(budget_s=0.2))
    assert len(ms[0].samples_s) == len(ms[1].samples_s)
    assert ms[1].summary.median > ms[0].summary.median
    assert [m.rotation for m in ms] == [2, 2] and measure(lambda: x @ x, device="cpu").rotation == 1


def test_exceptions_from_the_call_propagate():
    def boom():
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        measure(boom, device="cpu")


def test_copies_cover_four_times_the_cache():
    assert copies_for_cold_cache(10 << 20, 60 << 20) == 24
    assert copies_for_cold_cache(1 << 30, 60 << 20) == 1
    assert copies_for_cold_cache(1 << 10, 60 << 20) == 256  # capped


@pytest.mark.gpu
def test_cuda_modes_agree_on_a_bandwidth_bound_copy():
    # 512 MiB each way: a cold sample ends with up to an L2 of the copy's own writes still
    # dirty in the cache (the next flush writes them back, outside the sample), which graph
    # replay pays within its samples; at 1 GiB of traffic that is a few percent, not the
    # third it would be at 64 MiB
    n = 512 << 20
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    cold = measure(lambda: dst.copy_(src), device="cuda", options=TimingOptions(mode="cold"),
                   cache_bytes=torch.cuda.get_device_properties(0).L2_cache_size)
    srcs = [torch.randn(n // 4, device="cuda") for _ in range(4)]
    dsts = [torch.empty_like(s) for s in srcs]
    calls = [lambda s=s, d=d: d.copy_(s) for s, d in zip(srcs, dsts)]
    graph = measure(calls, device="cuda", options=TimingOptions(mode="graph"))
    assert cold.timer == graph.timer == "cuda-events"
    # 1 GiB per copy at >1 TB/s: hundreds of µs; graph and cold agree within 30%
    assert 0.7 < graph.summary.median / cold.summary.median < 1.3


def test_the_spin_before_a_start_event_outlasts_the_calls_host_side():
    from microbench.samplers import _LEAD_MAX_CYCLES, _LEAD_MIN_CYCLES, _host_s, lead_cycles

    assert lead_cycles(0.0) == _LEAD_MIN_CYCLES == 200_000  # ~100 µs at 2 GHz, whatever the call
    assert lead_cycles(1e-3) == 4_000_000  # twice a 1 ms host side at 2 GHz
    assert lead_cycles(60.0) == _LEAD_MAX_CYCLES  # a call that waits on the GPU: capped
    # and the measurement says so once the capped spin (10 ms) no longer covers the host side
    from microbench.samplers import lead_shortfall

    assert lead_shortfall(0.004) is None and lead_shortfall(0.010) is None
    assert lead_shortfall(0.0125).startswith("the call's host side (12.5 ms) outlasts the spin before the start "
                                             "event (at most 10 ms)")
    syncs: list[int] = []
    calls = [lambda: time.sleep(0.002), lambda: None]
    t = _host_s(calls, lambda: syncs.append(1), agreed=lambda x: 2 * x)
    assert t >= 2 * 0.002  # the slowest of the tries (the sleeping call), as the ranks agree it
    assert len(syncs) == 4  # the GPU idle before each try and after the last


class _FakeCudaTimer:
    """Just enough of torch.cuda for the cold sampler: events, the spin, a sync; every GPU
    step goes into one log, in the order the stream would run it."""

    def __init__(self):
        self.log: list = []
        fake = self

        class Event:
            made = 0

            def __init__(self, enable_timing=False):
                self.name = ("start", "end")[Event.made % 2]
                Event.made += 1

            def record(self):
                fake.log.append(self.name)

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return 0.05  # ms

        self.Event = Event
        self.set_device = lambda i: None
        self.synchronize = lambda: fake.log.append("sync")
        self._sleep = lambda cycles: fake.log.append(("spin", cycles))

    def install(self, monkeypatch):
        from microbench import samplers

        for name in ("Event", "set_device", "synchronize", "_sleep"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(samplers, "_flush_buffer", lambda device, nbytes: ("buf", "total"))
        monkeypatch.setattr(samplers, "_flush_cache", lambda buf, total: self.log.append("flush"))


def test_a_cold_sample_spins_after_the_flush_so_the_events_see_gpu_time(monkeypatch):
    """The flush, then a spin twice as long as the call's host side (a slow multi-launch
    call here: 3 ms of Python), then the events around the call: the call is wholly
    enqueued before the start event fires."""
    from microbench.samplers import _cuda_sampler, lead_cycles

    fake = _FakeCudaTimer()
    fake.install(monkeypatch)

    def call():
        time.sleep(0.003)
        fake.log.append("call")

    s = _cuda_sampler([call], "cuda:0", "cold", TimingOptions(warmup_s=0.0), 60 << 20)
    fake.log.clear()
    assert s.take() == pytest.approx(0.05e-3)
    (spin,) = [x for x in fake.log if isinstance(x, tuple)]
    assert fake.log == ["flush", spin, "start", "call", "end"]
    assert spin[1] >= lead_cycles(0.003) >= 12_000_000 and s.flush_bytes == 2 * (60 << 20)
    assert s.warmup_calls >= 1 + 3  # the first call, and the three that timed the host side


def test_interleaved_budget_is_the_budget_of_each_variant_in_turn():
    # two noisy variants under a 0.5 s budget each: the shared loop may take 1 s
    clock = FakeClock()
    rng = np.random.default_rng(13)
    opts = TimingOptions(min_samples=10, max_noise=0.001, budget_s=0.5)
    (a, b), reason, elapsed = run_interleaved([clock.sampler(rng, 1e-2, 0.3), clock.sampler(rng, 1e-2, 0.3)],
                                              opts, clock)
    assert reason == "budget" and 1.0 <= elapsed < 1.0 + 0.2 and len(a) == len(b)


def test_interleaved_noise_rule_waits_for_a_whole_rotation():
    # 13 rounds meet the rule at once (least: 13), but 13 is no whole rotation of two
    opts = TimingOptions(min_samples=10, min_time_s=0.0, max_noise=0.005, budget_s=100)
    clock = FakeClock()
    takes, _ = _placed_takes(clock, 2, [1e-3] * 2, [1.0] * 2, np.random.default_rng(15), sigma=0.001)
    (a, b), reason, _ = run_interleaved(takes, replace(opts, min_samples=13, max_noise=0.5), clock)
    assert reason == "noise" and len(a) == len(b) == 14


def test_outlying_samples_do_not_hold_up_the_median_noise_rule():
    # every fifth sample preempted (5x): the mean's interval would stay wide for
    # thousands of samples; the median's is narrow once the outliers are in the tails
    clock = FakeClock()
    rng = np.random.default_rng(16)
    taken = {"n": 0}

    def take():
        taken["n"] += 1
        s = 1e-3 * float(rng.lognormal(0.0, 0.001)) * (5.0 if taken["n"] % 5 == 0 else 1.0)
        clock.t += s
        return s
    opts = TimingOptions(min_samples=10, min_time_s=0.0, max_noise=0.005, budget_s=1.0)
    samples, reason, _ = run_until_stable(take, opts, clock)
    assert reason == "noise" and len(samples) <= 40


@pytest.mark.serial
def test_measure_counts_min_time_by_each_batched_sample_whole():
    # ~0.1 ms samples of many tiny calls: 10 ms of measured time is ~100 samples; counted
    # per call it would take ~1e5 samples, and end on the budget instead
    m = measure(lambda: None, device="cpu",
                options=TimingOptions(min_time_s=0.01, max_noise=0.5, budget_s=2.0, min_sample_s=1e-4))
    assert m.batch > 10 and m.stop_reason == "noise" and sum(m.samples_s) * m.batch >= 0.01
