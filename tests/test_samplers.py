"""The samplers' batch sizing and warm-up: how many calls a hot sample holds, and the
calls and seconds spent before the first sample."""

from __future__ import annotations

import time

import pytest

from microbench.samplers import _batch_size
from microbench.timing import TimingOptions, measure


@pytest.mark.serial
def test_cpu_batches_tiny_calls_so_each_sample_is_long_enough():
    m = measure(lambda: None, device="cpu", options=TimingOptions(budget_s=0.1, min_sample_s=50e-6))
    assert m.batch > 10
    assert m.summary.median < 5e-6  # per call, not per batch


def _fake_runs(per_call_s, first_s=None):
    """A time_n for _batch_size: n calls take n * per_call_s, the first run first_s."""
    runs = []

    def time_n(n):
        runs.append(n)
        return first_s if (first_s is not None and len(runs) == 1) else n * per_call_s
    return time_n, runs


def test_batch_size_is_not_fooled_by_one_slow_call():
    # One preempted call (5.5 us for a 0.1 us call) sized the batch at 9 when it was read
    # from a single call; the doubled runs and the best of three size it from 0.1 us.
    time_n, runs = _fake_runs(1e-7, first_s=5.5e-6)
    assert _batch_size(time_n, 50e-6) == (500, sum(runs))
    assert runs[:3] == [1, 2, 4] and runs[-3:] == [512, 512, 512]


def test_batch_size_of_a_long_call_is_one_without_extra_runs():
    time_n, runs = _fake_runs(1e-3)
    assert _batch_size(time_n, 20e-6) == (1, 1)
    assert runs == [1]


def test_batch_size_of_a_call_a_warm_call_showed_long_makes_no_run():
    time_n, runs = _fake_runs(1e-3)
    assert _batch_size(time_n, 20e-6, known_s=40e-6) == (1, 0) and runs == []
    # a warm call under twice the sample's length proves nothing: the runs decide
    time_n, runs = _fake_runs(15e-6)
    assert _batch_size(time_n, 20e-6, known_s=39e-6) == (2, 7) and runs == [1, 2, 2, 2]


def test_a_call_lasting_longer_than_the_warm_up_is_warmed_and_sized_in_two_calls():
    """Under the interpreter one call lasts seconds: the first call and one warm call are
    all the warm-up, and that warm call's time sizes the batch at one call (no sizing
    run, which would be a third call). The seconds before the first sample are kept."""
    made = []

    def call():
        made.append(1)
        time.sleep(0.01)
    m = measure(call, device="cpu", options=TimingOptions(budget_s=0.02, warmup_s=0.005))
    assert m.batch == 1 and m.warmup_calls == 2
    assert len(made) == 2 + m.summary.count
    assert 0.02 <= m.warmup_s < 0.5 and m.to_dict()["warmup_s"] == m.warmup_s


@pytest.mark.serial  # times real calls: a preempted warm call would size the batch
def test_the_ranks_agreement_during_warm_up_does_not_size_a_fast_calls_batch():
    """With several ranks each warm-up step agrees the elapsed time (a collective, here
    1 ms): that wait is not the call's, so a fast call is still batched."""
    from microbench.samplers import _cpu_sampler

    def agreed(x):
        time.sleep(1e-3)
        return x
    s = _cpu_sampler([lambda: None], "hot", TimingOptions(warmup_s=0.005), None, agreed)
    assert s.batch > 10


def test_batch_size_near_the_threshold_is_confirmed_and_capped():
    time_n, runs = _fake_runs(15e-6)  # 1 call: under 20 us; 2 calls: 30 us
    assert _batch_size(time_n, 20e-6) == (2, 7) and runs == [1, 2, 2, 2]
    time_n, runs = _fake_runs(1e-12)
    assert _batch_size(time_n, 20e-6)[0] == 1000 and max(runs) == 1024


def test_batch_size_agrees_every_run_so_ranks_make_the_same_calls():
    seen = []

    def agreed(x):  # the slowest rank's time: here a rank 3x slower than this one
        seen.append(x)
        return 3 * x
    time_n, runs = _fake_runs(1e-6)
    assert _batch_size(time_n, 20e-6, agreed)[0] == 20 // 3 + 1
    assert len(seen) == len(runs)


def test_batch_doubling_stops_at_the_first_run_that_lasts_a_samples_length():
    time_n, runs = _fake_runs(10e-6)  # 2 calls: exactly 20 us, long enough
    assert _batch_size(time_n, 20e-6) == (2, 7) and runs == [1, 2, 2, 2]


def test_warm_up_calls_each_copy_once_then_rotates_through_them_for_the_warm_up_time():
    from microbench.samplers import _warm

    made, syncs, steady = [], [], []
    calls = [lambda i=i: (made.append(i), time.sleep(1e-3)) for i in range(3)]
    t0 = time.perf_counter()
    n = _warm(calls, lambda: syncs.append(1), 0.02, steady=steady)
    assert time.perf_counter() - t0 >= 0.02 and 3 < n == len(made) <= 3 + 21  # each warm call lasts >= 1 ms
    assert made[:5] == [0, 1, 2, 0, 1]
    assert len(steady) == n - 3 and min(steady) >= 1e-3 and len(syncs) == 1 + len(steady)


def test_each_sample_takes_the_next_input_copies_in_turn():
    from microbench.samplers import _cpu_sampler

    made = []
    calls = [lambda i=i: made.append(i) for i in range(3)]
    cold = _cpu_sampler(calls, "cold", TimingOptions(warmup_s=0.0), 1 << 12)
    made.clear()
    for _ in range(4):
        cold.take()
    assert cold.batch == 1 and made == [0, 1, 2, 0]
    hot = _cpu_sampler(calls, "hot", TimingOptions(warmup_s=0.0, min_sample_s=1.0), None)  # the largest batch
    made.clear()
    hot.take()
    hot.take()
    assert hot.batch == 1000 and made == [i % 3 for i in range(2000)]


def test_a_cpu_cold_sample_writes_and_reads_the_flush_buffer_before_its_call(monkeypatch):
    import numpy as np

    from microbench.samplers import _cpu_sampler

    log, bufs = [], []

    class Buf:
        def __init__(self, n, dtype):
            bufs.append((n, dtype))

        def fill(self, v):
            log.append("write")

        def sum(self):
            log.append("read")

    monkeypatch.setattr(np, "empty", Buf)
    s = _cpu_sampler([lambda: log.append("call")], "cold", TimingOptions(warmup_s=0.0), 1 << 20)
    log.clear()
    s.take()
    s.take()
    assert log == ["write", "read", "call"] * 2
    assert bufs == [((2 << 20) // 8, np.int64)] and s.flush_bytes == 2 << 20


def test_the_host_side_time_is_the_slowest_of_the_tries():
    from microbench.samplers import _host_s

    assert _host_s([lambda: time.sleep(0.003), lambda: None, lambda: None], lambda: None) >= 0.003


def test_a_graph_holds_whole_rotations_of_its_input_copies():
    from microbench.samplers import graph_calls

    # replays run back to back: the last call's copy must not be the first call's, nor
    # any copy come round again before every other copy has had its turn
    for k in range(1, 40):
        n = graph_calls(k)
        assert n >= 16 and (n % k == 0), (k, n)
        order = [j % k for j in range(n)] * 2  # two replays
        for i in range(k, len(order)):
            assert order[i] not in order[i - k + 1:i], (k, n, i)
    assert graph_calls(5) == 20 and graph_calls(16) == 16 and graph_calls(40) == 40
    assert graph_calls(6, asked=20) == 24 and graph_calls(30, asked=8) == 8  # fewer calls than copies: as asked
