"""CUDA graph capture (``microbench.samplers._capture``): a failed capture leaves the
stream, the allocator and later captures as they were, and a capture of no GPU work is
refused. Off the GPU, against a stand-in for the parts of torch.cuda capture touches."""

from __future__ import annotations

import pytest
import torch


_CAPTURE_AFTER_A_FAILED_ONE = """
import torch
from microbench.samplers import _capture
x = torch.randn(1 << 20, device="cuda")
def waits():  # allocates in the capture's pool, then syncs: invalid while capturing
    return (x * 2).sum().item()
try:
    _capture([waits], 2)
except RuntimeError as e:
    assert "CUDA graph capture failed" in str(e), e
else:
    raise SystemExit("a capture of .item() did not fail")
torch.cuda.empty_cache()  # the allocator is not left mid-capture
out = torch.empty_like(x)
g = _capture([lambda: out.copy_(x * 3)], 2)
g.replay()
torch.cuda.synchronize()
torch.testing.assert_close(out, x * 3)
print("ok")
"""


@pytest.mark.gpu
def test_a_failed_capture_on_the_gpu_leaves_later_captures_working():
    # in a process of its own: were the allocator left mid-capture, the tests after this one
    # would fail with it
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _CAPTURE_AFTER_A_FAILED_ONE], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


class _FakeCuda:
    """Just enough of torch.cuda for graph capture: a current stream, stream contexts, an
    allocator that routes to a capture's pool (and, as torch's does, fails ``empty_cache``
    while it still routes to one), and a graph context whose exit (capture_end) fails or
    warns as asked. A failing capture_end ends the routing first when ``ends_routing``
    (torch 2.12 and later), or leaves it (torch 2.11)."""

    def __init__(self, fail: bool = False, empty: bool = False, ends_routing: bool = False):
        import contextlib
        import warnings

        self.current, self.freed, self.routing, self.pools = "default", 0, set(), 0
        fake = self

        @contextlib.contextmanager
        def stream(s):
            prev, fake.current = fake.current, s
            try:
                yield
            finally:
                fake.current = prev

        class Graph:
            def __init__(self, g, pool=None, stream=None, capture_error_mode="global"):
                self.stream, self.pool = stream, pool

            def __enter__(self):  # torch.cuda.graph: enters its stream, begins the capture
                self.prev, fake.current = fake.current, self.stream
                fake.routing.add(self.pool)
                return self

            def __exit__(self, *exc):  # capture_end runs before the stream is restored
                if fail:
                    if ends_routing:
                        fake.routing.discard(self.pool)
                    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
                fake.routing.discard(self.pool)
                if empty:
                    warnings.warn("The CUDA Graph is empty. This usually means that the graph was attempted "
                                  "to be captured on wrong device or stream.")
                fake.current = self.prev
                return False

        self.stream, self.graph = stream, Graph
        self.CUDAGraph, self.Stream = object, lambda: "capture-stream"
        self.synchronize = lambda: None
        self.current_device = lambda: 0

    def graph_pool_handle(self):
        self.pools += 1
        return (0, self.pools)

    def end_allocate_to_pool(self, device, pool):
        if pool not in self.routing:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.routing.discard(pool)

    def empty_cache(self):
        if self.routing:
            raise RuntimeError("captures_underway.empty() INTERNAL ASSERT FAILED")
        self.freed += 1

    def install(self, monkeypatch):
        for name in ("stream", "graph", "CUDAGraph", "Stream", "synchronize", "empty_cache",
                     "current_device", "graph_pool_handle"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", self.end_allocate_to_pool, raising=False)


@pytest.mark.parametrize("ends_routing", [False, True], ids=["torch-2.11", "torch-2.12+"])
def test_a_failed_capture_leaves_the_stream_and_memory_as_they_were(monkeypatch, ends_routing):
    from microbench.samplers import _capture, free_cached_memory

    fake = _FakeCuda(fail=True, ends_routing=ends_routing)
    fake.install(monkeypatch)
    calls = []
    with pytest.raises(RuntimeError, match="CUDA graph capture failed: RuntimeError: CUDA error: operation not"):
        _capture([lambda: calls.append(fake.current)], 3)
    assert calls == ["capture-stream"] * 3  # the calls ran inside the capture
    # the allocator routes to no pool, so its cache is freed now and by every later capture
    assert fake.current == "default" and not fake.routing and fake.freed == 1
    ok = _FakeCuda()
    ok.routing = fake.routing
    ok.install(monkeypatch)
    assert _capture([lambda: None], 2) is not None and not ok.routing
    # and the runner's error-path free never raises, even where the allocator would
    fake.routing.add((0, 99))
    free_cached_memory("cuda", sync=True)
    free_cached_memory("cpu")


def test_a_capture_of_no_gpu_work_is_refused(monkeypatch):
    from microbench.samplers import _capture

    _FakeCuda(empty=True).install(monkeypatch)
    with pytest.raises(RuntimeError, match="recorded no GPU work"):
        _capture([lambda: None], 2)
    ok = _FakeCuda()
    ok.install(monkeypatch)
    assert _capture([lambda: None], 2) is not None and ok.current == "default"
