"""What the ranks of a world agree on after each step of a variant: one rank's failed gate,
error or skip reason is every rank's, named by rank; a communication error stops them all."""

from __future__ import annotations

import pytest

from microbench.outcome import agreed_outcome, agreed_reason, attempt, error_text, failure, is_dist


class _FakeWorld:
    def __init__(self, size):
        self.size = size

    def agree(self, tag, payload):
        return [payload] * self.size

    def fatal(self, message):
        raise SystemExit(message)


def test_a_communication_error_stops_every_rank_but_only_fails_a_world_of_one():
    outcome = {"error": "NCCL watchdog: collective timed out", "dist": True}
    with pytest.raises(SystemExit, match="rank 0: NCCL watchdog"):
        agreed_outcome(_FakeWorld(2), "torch-ip timing", outcome)
    # one in-process rank cannot fall out of step: the variant fails, the run goes on
    assert agreed_outcome(_FakeWorld(1), "torch-ip timing", outcome)["error"] == \
        "every rank: NCCL watchdog: collective timed out"


def test_a_timeout_that_follows_another_ranks_own_error_names_that_error_first():
    class _Two(_FakeWorld):
        def agree(self, tag, payload):
            return [{"error": "DistBackendError: Timed out waiting 120000ms", "dist": True},
                    {"error": "MemoryError: out of host memory", "dist": False}]

    with pytest.raises(SystemExit, match=r"^v gate: rank 1: MemoryError: out of host memory, then rank 0: "
                                         r"DistBackendError: Timed out"):
        agreed_outcome(_Two(2), "v gate", {"error": None})


class _RanksWorld(_FakeWorld):
    """A world whose ranks said ``payloads`` (rank 0 is this one)."""

    def __init__(self, *payloads):
        super().__init__(len(payloads))
        self.payloads = list(payloads)

    def agree(self, tag, payload):
        assert payload == self.payloads[0]
        return self.payloads


def test_a_gate_failing_on_one_rank_fails_every_rank_with_the_wrong_elements_summed():
    ok = {"error": None, "passed": True, "wrong": 0, "summary": "ok"}
    bad = {"error": None, "passed": False, "wrong": 3, "summary": "out (8,) float32: 3/8 elements off"}
    assert agreed_outcome(_RanksWorld(ok, ok), "v gate", ok) == ok
    assert agreed_outcome(_RanksWorld(ok, bad), "v gate", ok) == {
        "error": None, "passed": False, "wrong": 3, "summary": "rank 1: out (8,) float32: 3/8 elements off"}
    both = agreed_outcome(_RanksWorld(bad, bad), "v gate", bad)
    assert not both["passed"] and both["wrong"] == 6 and both["summary"].startswith("rank 0: out (8,)")
    # an error on one rank (not the communication layer's) fails the variant on every rank
    err = {"error": "ValueError: bad shape", "traceback": "tb", "dist": False}
    out = agreed_outcome(_RanksWorld({"error": None}, err), "v timing", {"error": None})
    assert out["error"] == "rank 1: ValueError: bad shape" and out["traceback"] == "tb"


def test_a_skip_any_rank_has_a_reason_for_skips_every_rank_and_names_the_ranks():
    assert agreed_reason(None, "v skip", "no fp8") == "no fp8"
    assert agreed_reason(_RanksWorld(None, None), "v skip", None) is None
    assert agreed_reason(_RanksWorld("no fp8", "no fp8"), "v skip", "no fp8") == "no fp8"
    assert agreed_reason(_RanksWorld(None, "no fp8"), "v skip", None) == "rank 1: no fp8"
    assert agreed_reason(_RanksWorld("no fp8", None), "v skip", "no fp8") == "rank 0: no fp8"
    assert agreed_reason(_RanksWorld("a", "b"), "v skip", "a") == "rank 0: a; rank 1: b"


def test_communication_errors_are_told_from_a_variants_own_by_their_text():
    for text in ("Watchdog caught collective operation timeout", "NCCL: operation timed out",
                 "Connection reset by peer", "Connection closed by peer", "Broken pipe"):
        assert is_dist(RuntimeError(text)), text
    assert not is_dist(ValueError("expected a tensor of shape (4, 8)"))
    assert error_text(ValueError("first line\nsecond line")) == "ValueError: first line"
    assert error_text(KeyError()) == "KeyError"
    f = failure(RuntimeError("NCCL: operation timed out"))
    assert f["dist"] and f["error"] == "RuntimeError: NCCL: operation timed out"


def test_a_failed_call_s_tensors_are_gone_before_the_cache_is_emptied(monkeypatch):
    # the traceback holds the failing call's frames: their locals (a tensor here, device
    # memory on a GPU) must be dropped before empty_cache, or their blocks stay reserved
    import weakref

    import torch

    seen = []

    def fails():
        scratch = torch.ones(1024)
        seen.append(weakref.ref(scratch))
        inner(scratch)

    def inner(t):
        raise RuntimeError("out of memory")

    alive_at_empty = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_at_empty.append(seen[0]() is not None))
    value, outcome = attempt(None, "timing", "cuda", fails)
    assert value is None and outcome["error"] == "RuntimeError: out of memory"
    assert "inner(scratch)" in outcome["traceback"]  # reported before the frames were cleared
    assert alive_at_empty == [False]


def test_the_culprit_is_found_through_the_error_it_was_raised_from_and_never_on_a_lost_device():
    from microbench.outcome import culprit

    def good():
        pass

    def bad():
        raise ValueError("cannot be captured: it syncs")

    def capture(fn):  # what a failed graph capture does: its own error, from the call's
        try:
            fn()
        except ValueError as e:
            raise RuntimeError(f"CUDA graph capture failed: {e}") from e

    _, outcome = attempt(None, "interleaved timing", "cpu", lambda: capture(bad))
    assert culprit(outcome["exception"], [good, bad]) == 1

    def faults():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _, outcome = attempt(None, "interleaved timing", "cpu", faults)
    assert culprit(outcome["exception"], [good, faults]) is None  # every later call would fail: no one variant
