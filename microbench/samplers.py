"""The samplers behind :func:`microbench.timing.measure`: one per device kind and mode
(see that module for what each mode times), each a ``take()`` returning one sample's
per-call seconds, after warm-up, batch sizing and (graph mode) capture."""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

#: Used when the L2 (or CPU last-level cache) size is unknown: larger than any current
#: GPU L2 (H200: 60 MB, RTX PRO 6000 Blackwell: 128 MB), so flushing still flushes.
_FALLBACK_CACHE_BYTES = 128 * 1024 * 1024

#: The spin kernel (``torch.cuda._sleep``) run before a start event, so the timed work is
#: already enqueued when the events start counting. At least ~100 µs at 2 GHz (more than a
#: graph launch's host latency); before a cold call, twice the call's measured host time
#: (a 5-launch MoE call's Python can outlast the flush), at most ~10 ms. Cycles are counted
#: at a nominal 2 GHz (H100 / H200 boost: 1.98 GHz): at a lower clock the spin lasts longer,
#: the safe side.
_LEAD_MIN_CYCLES = 200_000
_LEAD_MAX_CYCLES = 20_000_000
_NOMINAL_CLOCK_HZ = 2e9

#: The step of ``cudaEventElapsedTime``: "a resolution of around 0.5 microseconds" (CUDA
#: runtime API); recent GPUs are seen counting in ~1.024 µs. Only a fallback: a
#: measurement's tick is read from its samples (:func:`microbench.stats.sample_tick`),
#: and this stands in where all of them are equal.
CUDA_EVENT_RESOLUTION_S = 0.5e-6


def cpu_timer_resolution_s() -> float:
    """The step of the host clock the CPU samplers read (``perf_counter_ns`` reads the
    clock ``perf_counter`` does)."""
    return time.get_clock_info("perf_counter").resolution


@dataclass
class _Sampler:
    take: Callable[[], float]
    mode: str
    timer: str
    batch: int
    copies: int
    warmup_calls: int
    flush_bytes: int
    notes: list[str]
    warmup_s: float = 0.0  # set by timing._prepare: the wall time until the first sample

    @property
    def resolution_s(self) -> float:
        """The timer's documented step per call: a sample is ``batch`` calls."""
        per_sample = CUDA_EVENT_RESOLUTION_S if self.timer == "cuda-events" else cpu_timer_resolution_s()
        return per_sample / self.batch


def _is_cuda(device: str) -> bool:
    return device.startswith("cuda")


#: Graph mode's rotating copies cover this many times the cache, with at most this many
#: copies (a few-byte input cannot be made cold by copies, nor does its cache state matter).
COLD_FACTOR = 4
MAX_COPIES = 256


def fallback_cache_bytes() -> int:
    """The cache size assumed where the device's is unknown."""
    return _FALLBACK_CACHE_BYTES


def copies_for_cold_cache(working_set_bytes: int, cache_bytes: int | None, factor: int = COLD_FACTOR,
                          max_copies: int = MAX_COPIES, max_total_bytes: int = 4 << 30) -> int:
    """Input copies needed so rotating through them touches ``factor`` x the cache."""
    cache = cache_bytes or _FALLBACK_CACHE_BYTES
    if working_set_bytes <= 0:
        return 1
    want = math.ceil(factor * cache / working_set_bytes)
    afford = max(1, max_total_bytes // working_set_bytes)
    return max(1, min(want, max_copies, afford))


def graph_calls(copies: int, asked: int = 0) -> int:
    """Calls captured in one graph rotating through ``copies`` input copies: ``asked`` (0:
    at least 16), rounded up to whole rotations when it holds more than one copy's turn.
    A graph replays back to back, so its last call is followed by its first: with 16 calls
    over 5 copies, copy 0 would run twice in a row, its data still in L2."""
    n = asked or max(copies, 16)
    if n <= copies:
        return n
    return copies * math.ceil(n / copies)


_flush_buffers: dict[str, Any] = {}


def _flush_buffer(device: str, nbytes: int):
    """The flush's int64 buffer of at least ``nbytes`` on ``device`` (kept for the next
    measurement) and a fresh 0-d int64 for its sum."""
    import torch

    buf = _flush_buffers.get(device)
    if buf is None or buf.numel() * 8 < nbytes:
        buf = torch.empty(max(1, nbytes // 8), dtype=torch.int64, device=device)
        _flush_buffers[device] = buf
    return buf, torch.zeros((), dtype=torch.int64, device=device)


def _flush_cache(buf, total) -> None:
    """Write ``buf`` (1-D int64, 2x the cache), then read it all into the 0-d int64
    ``total``: the cache ends up holding clean lines of ``buf`` alone. Both are int64 so
    the sum reads ``buf`` in place (a sum into a wider type first copies its input)."""
    import torch

    buf.zero_()
    torch.sum(buf, dim=0, out=total)


def _same(x: float) -> float:
    return x


def lead_cycles(host_s: float) -> int:
    """Spin cycles before a start event so that a call whose host side takes ``host_s`` is
    wholly enqueued by the time the events count: twice that at the nominal clock, within
    [_LEAD_MIN_CYCLES, _LEAD_MAX_CYCLES]."""
    want = math.ceil(2.0 * max(0.0, host_s) * _NOMINAL_CLOCK_HZ)
    return int(min(_LEAD_MAX_CYCLES, max(_LEAD_MIN_CYCLES, want)))


def lead_shortfall(host_s: float) -> str | None:
    """The note a cold measurement carries when the call's host side outlasts the longest
    spin (:func:`lead_cycles` capped it): the GPU may then idle between the start event
    and the call's first kernel, and that wait is counted. None when the spin covers it."""
    if host_s * _NOMINAL_CLOCK_HZ <= _LEAD_MAX_CYCLES:
        return None
    return (f"the call's host side ({host_s * 1e3:.1f} ms) outlasts the spin before the start event "
            f"(at most {_LEAD_MAX_CYCLES / _NOMINAL_CLOCK_HZ * 1e3:.0f} ms): samples may include host time "
            "(launch latency, or waits on the GPU inside the call); graph mode times the GPU work alone")


_HOST_TRIES = 3


def _host_s(calls: Sequence[Callable[[], Any]], sync: Callable[[], None],
            agreed: Callable[[float], float] = _same, tries: int = _HOST_TRIES) -> float:
    """The longest host-side time of a call (from its start on an idle GPU to its return:
    the launches and the Python between them) over ``tries`` warm calls; with several
    ranks the slowest rank's, so every rank spins alike."""
    worst = 0.0
    for j in range(tries):
        sync()
        t0 = time.perf_counter()
        calls[j % len(calls)]()
        worst = max(worst, time.perf_counter() - t0)
    sync()
    return agreed(worst)


def _warm(calls: Sequence[Callable[[], Any]], sync: Callable[[], None], warmup_s: float,
          agreed: Callable[[float], float] = _same, steady: list[float] | None = None) -> int:
    """Warm-up calls made; ``steady``, when given, receives each warm-by-time call's host
    seconds (its launch to its ``sync``; the ranks' agreement before it is not counted)."""
    # The first call of each copy compiles / autotunes / allocates; then warm by time so
    # clocks ramp up and caches of the allocator settle. With several ranks the elapsed
    # time is agreed (the slowest rank's), so every rank makes the same number of calls.
    for fn in calls:
        fn()
    sync()
    n = len(calls)
    t0 = time.perf_counter()
    while agreed(time.perf_counter() - t0) < warmup_s:
        t = time.perf_counter()
        calls[n % len(calls)]()
        n += 1
        sync()
        if steady is not None:
            steady.append(time.perf_counter() - t)
    return n


_MAX_BATCH = 1000


def _batch_size(time_n: Callable[[int], float], min_sample_s: float,
                agreed: Callable[[float], float] = _same, known_s: float | None = None) -> tuple[int, int]:
    """(calls per hot sample, so that a sample lasts at least ``min_sample_s``; the calls
    made to find it out, which count as warm-up).

    ``time_n(n)`` times n back-to-back calls. The run length doubles until one run lasts
    ``min_sample_s`` (timeit's autorange), and unless a single call already lasts twice
    that, the batch is sized from the best of three runs of that length. One call's time
    alone is a poor estimate: one preempted call made a batch 10x too small. With several
    ranks each run's time is agreed, so every rank makes the same calls. ``known_s``: the
    fastest of some warm calls, timed on the same clock (already agreed); when that lasts
    twice ``min_sample_s`` the batch is one call with no run made (a preempted call only
    lasts longer, so the fastest cannot overstate a call by much; on the interpreter a
    call lasts seconds, and a sizing run would be one more of them).
    """
    if known_s is not None and known_s >= 2 * min_sample_s:
        return 1, 0
    n = 1
    t = agreed(time_n(n))
    made = n
    while t < min_sample_s and n < _MAX_BATCH:
        n *= 2
        t = agreed(time_n(n))
        made += n
    if n > 1 or t < 2 * min_sample_s:
        t = min(t, *(agreed(time_n(n)) for _ in range(2)))
        made += 2 * n
    if t <= 0:
        return _MAX_BATCH, made
    return int(min(_MAX_BATCH, max(1, math.ceil(min_sample_s * n / t - 1e-9)))), made


def free_cached_memory(device: str, sync: bool = False, error: BaseException | None = None) -> None:
    """Give a failed call's cached blocks back to the device (after waiting for its work
    if ``sync``). For error paths: it never raises, since the call's own error is the one
    to report.

    ``error``: the exception being handled. Its traceback holds the failed call's frames,
    and their locals (intermediates, a half-built workload) would keep their blocks
    allocated past this call: those frames are cleared first (report the error before).
    """
    if error is not None:
        _clear_frames(error)
    if device.startswith("cuda"):
        import torch

        try:
            if sync:
                torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass


def _clear_frames(error: BaseException) -> None:
    """Drop the locals of the finished frames in ``error``'s traceback and in those of the
    errors it was raised from or during (the frame handling it is still running: kept)."""
    from microbench.outcome import error_chain  # outcome imports this module

    for e in error_chain(error):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)


def _end_routing_to_pool(device: int, pool: tuple[int, int]) -> None:
    """Stop the caching allocator routing allocations to a failed capture's pool. Before
    torch 2.12, ``capture_end`` raises on an invalidated capture (a sync or ``.item()``
    among the calls) before it ends the routing, and the allocator then believes a
    capture is under way for the rest of the process: every later ``empty_cache`` (which
    each capture begins with) fails an internal assert. Later torch ends it itself, and
    ending it twice raises, which is what the ``except`` is for."""
    import torch

    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except Exception:  # noqa: BLE001 - already ended (torch 2.12 and later)
        pass


def _capture(calls: Sequence[Callable[[], Any]], n: int):
    """A CUDA graph of ``n`` calls (rotating through ``calls``), captured on a stream of
    its own into a memory pool of its own. A capture that fails leaves this thread on the
    stream it was on and the allocator no longer routing to the capture's pool, so the
    rest of the run (later captures, ``empty_cache``) is unharmed; on torch before 2.12
    the memory the failed capture took stays reserved until the process ends. One that
    captured no GPU work is refused (replaying it would time nothing)."""
    import warnings

    import torch

    graph = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream()
    dev, pool = torch.cuda.current_device(), torch.cuda.graph_pool_handle()
    k = len(calls)
    try:
        # the outer stream context restores this thread's stream even when capture_end
        # raises (torch.cuda.graph's own context is then never exited); thread_local:
        # another thread's CUDA calls during the capture (NCCL's watchdog polling its
        # events, a sampling thread) neither break it nor are captured
        with torch.cuda.stream(cap), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.cuda.graph(graph, pool=pool, stream=cap, capture_error_mode="thread_local"):
                for j in range(n):
                    calls[j % k]()
    except Exception as e:  # capture errors are the case's, report them plainly
        _end_routing_to_pool(dev, pool)
        del graph
        free_cached_memory("cuda", sync=True, error=e)
        raise RuntimeError(f"CUDA graph capture failed: {type(e).__name__}: {e}") from e
    empty = [w for w in caught if "CUDA Graph is empty" in str(w.message)]
    for w in caught:  # the capture's other warnings are shown as they would have been
        if w not in empty:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if empty:
        raise RuntimeError("CUDA graph capture recorded no GPU work (the calls ran on another "
                           "stream or device, or launch nothing): nothing to replay")
    return graph


def _cuda_sampler(calls, device, mode, opts, cache_bytes, agreed=_same, meet=None) -> _Sampler:
    import torch

    idx = torch.device(device).index  # "cuda" alone means the current device
    if idx is not None:
        torch.cuda.set_device(idx)
    sync = torch.cuda.synchronize
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    notes: list[str] = []
    k = len(calls)
    state = {"i": 0}
    # several ranks: the GPUs meet (a collective) just before each start event, so no
    # rank's sample holds the time its GPU waited for the ranks that left the host-side
    # meeting later
    ready = meet or (lambda: None)

    def elapsed_s() -> float:
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    if mode == "graph":
        # Warm up (compile) on a side stream before capture, as CUDA graphs require.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = _warm(calls, side.synchronize, 0.0, agreed)
        torch.cuda.current_stream().wait_stream(side)
        # one count on every rank (the ranks' copies follow each one's own L2 size): a graph
        # of collectives captured with more calls on one rank than another would never meet
        n = int(agreed(float(graph_calls(k, opts.graph_calls))))
        if n < k:
            notes.append(f"graph of {n} calls rotates through {n} of the {k} input copies")
            k = n
        elif opts.graph_calls and n != opts.graph_calls:
            notes.append(f"graph of {n} calls, not {opts.graph_calls}: whole rotations through the {k} input copies")
        graph = _capture(calls, n)
        warm += _warm([graph.replay], sync, opts.warmup_s, agreed) * n

        def take() -> float:
            torch.cuda._sleep(_LEAD_MIN_CYCLES)
            ready()  # after the spin: the ranks' meeting stays next to the start event
            start.record()
            graph.replay()
            end.record()
            return elapsed_s() / n

        return _Sampler(take, mode, "cuda-events", n, k, warm, 0, notes)

    warm = _warm(calls, sync, opts.warmup_s, agreed)
    if mode == "cold":
        nbytes = 2 * (cache_bytes or _FALLBACK_CACHE_BYTES)
        if not cache_bytes:
            notes.append("L2 size unknown: flushed 2x128 MiB")
        flush, total = _flush_buffer(device, nbytes)
        # the flush alone (tens of µs) can be shorter than the call's host side: a spin
        # after it keeps the events on GPU time, the host's launch latency left out
        host = _host_s(calls, sync, agreed, _HOST_TRIES)
        lead = lead_cycles(host)
        notes += [n for n in (lead_shortfall(host),) if n]
        warm += _HOST_TRIES

        def take() -> float:
            fn = calls[state["i"] % k]
            state["i"] += 1
            _flush_cache(flush, total)
            torch.cuda._sleep(lead)
            ready()
            start.record()
            fn()
            end.record()
            return elapsed_s()

        return _Sampler(take, mode, "cuda-events", 1, k, warm, nbytes, notes)

    # hot: a batch of back-to-back calls per sample
    def time_n(n: int) -> float:
        ready()
        start.record()
        for j in range(n):
            calls[j % k]()
        end.record()
        return elapsed_s()

    batch, sizing = _batch_size(time_n, opts.resolved_min_sample_s(device), agreed)
    warm += sizing

    def take() -> float:
        ready()
        start.record()
        for j in range(batch):
            calls[(state["i"] + j) % k]()
        end.record()
        state["i"] += batch
        return elapsed_s() / batch

    return _Sampler(take, mode, "cuda-events", batch, k, warm, 0, notes)


def _cpu_sampler(calls, mode, opts, cache_bytes, agreed=_same) -> _Sampler:
    import numpy as np

    k = len(calls)
    state = {"i": 0}
    notes: list[str] = []
    steady: list[float] = []
    warm = _warm(calls, lambda: None, opts.warmup_s, agreed, steady)
    flush = None
    nbytes = 0
    if mode == "cold":
        nbytes = 2 * (cache_bytes or _FALLBACK_CACHE_BYTES)
        flush = np.empty(nbytes // 8, dtype=np.int64)
        batch = 1
    else:
        def time_n(n: int) -> float:
            t0 = time.perf_counter_ns()
            for j in range(n):
                calls[j % k]()
            return (time.perf_counter_ns() - t0) * 1e-9

        known = agreed(min(steady)) if steady else None  # every rank warms alike: all or none agree here
        batch, sizing = _batch_size(time_n, opts.resolved_min_sample_s("cpu"), agreed, known)
        warm += sizing

    def take() -> float:
        if flush is not None:
            flush.fill(state["i"])
            flush.sum()
        i = state["i"]
        t = time.perf_counter_ns()
        for j in range(batch):
            calls[(i + j) % k]()
        dt = time.perf_counter_ns() - t
        state["i"] = i + batch
        return dt * 1e-9 / batch

    return _Sampler(take, mode, "perf_counter_ns", batch, k, warm, nbytes, notes)
