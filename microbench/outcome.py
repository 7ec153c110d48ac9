"""What became of one variant's step (its set-up and gate, its timing): an error is
recorded, not raised, so a failing variant does not stop the run; with several ranks, the
one outcome every rank agrees on (an error on any rank fails the variant everywhere, an
error of the communication layer itself stops every rank)."""

from __future__ import annotations

import inspect
import traceback
from typing import Any, Callable, Sequence

from microbench.samplers import free_cached_memory

__all__ = ["agreed_outcome", "agreed_reason", "attempt", "culprit", "error_chain", "error_text", "failure", "is_dist"]


def error_chain(e: BaseException) -> list[BaseException]:
    """``e``, then the error it was raised from or during, and so on (each once)."""
    chain: list[BaseException] = []
    err: BaseException | None = e
    while err is not None and all(err is not c for c in chain):
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".rstrip(": ")


def failure(e: BaseException) -> dict[str, Any]:  # a variant's error, as the ranks agree on it
    return {"error": error_text(e), "traceback": traceback.format_exc(limit=6), "dist": is_dist(e)}


def is_dist(e: BaseException) -> bool:
    """An error of the communication layer itself (timeout, lost peer): the ranks may be out
    of step after it, so the run cannot go on."""
    try:
        import torch.distributed as dist

        if isinstance(e, getattr(dist, "DistError", ())):
            return True
    except Exception:  # noqa: BLE001
        pass
    text = str(e).lower()
    return any(k in text for k in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe"))


def attempt(world: Any, tag: str, dev: str, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``(fn(), outcome)``, the outcome every rank agrees on; an error is the outcome's (its
    text and traceback, the device's cached memory freed), not raised: a failing variant
    must not stop the run."""
    try:
        value, outcome = fn(), {"error": None}
    except Exception as e:  # noqa: BLE001
        value, outcome = None, failure(e)
        if world is None:  # one process: the caller may ask which of its calls raised (culprit)
            outcome["exception"] = _Frames(e)
        free_cached_memory(dev, error=e)
    return value, agreed_outcome(world, tag, outcome)


class _Frames:
    """The code objects of an error's traceback and of the errors it was raised from (a
    failed graph capture wraps the call's own error), kept without their frames (whose
    locals the caller frees): what :func:`culprit` reads. ``device_lost``: a CUDA error,
    after which every call on the device fails, whichever variant makes it."""

    def __init__(self, e: BaseException) -> None:
        self.codes = []
        self.device_lost = False
        for err in error_chain(e):
            self.device_lost |= type(err).__name__ == "AcceleratorError" or "CUDA error" in str(err)
            tb = err.__traceback__
            while tb is not None:
                self.codes.append(tb.tb_frame.f_code)
                tb = tb.tb_next


def culprit(frames: Any, fns: Sequence[Callable[..., Any]]) -> int | None:
    """Which of ``fns`` (variants timed together) raised the error ``frames`` keeps: the
    one whose code is in its traceback, or None when none is, when the code is several
    variants' (closures of one function), or when the error is the device's (a CUDA error:
    an illegal access leaves every later call failing, so its traceback names whichever
    variant ran next, and its launch may not even be the one that faulted)."""
    if not isinstance(frames, _Frames) or frames.device_lost:  # a lost device fails whoever calls next
        return None
    # a variant's own code, and the code it wraps (a user's function inside the wrapper that
    # reports its errors: the wrapper's frame is the one an error raised there passes)
    codes = [{getattr(g, "__code__", None) for g in (f, inspect.unwrap(f))} - {None} for f in fns]
    every = [c for cs in codes for c in cs]
    hits = {i for i, cs in enumerate(codes) if any(c in frames.codes and every.count(c) == 1 for c in cs)}
    return hits.pop() if len(hits) == 1 else None


def agreed_reason(world: Any, tag: str, why: str | None) -> str | None:
    """A skip decision every rank shares: skipped when any rank has a reason."""
    if world is None:
        return why
    every = world.agree(tag, why)
    hits = [(r, w) for r, w in enumerate(every) if w]
    if not hits:
        return None
    if all(w == hits[0][1] for _, w in hits) and len(hits) == len(every):
        return hits[0][1]
    return "; ".join(f"rank {r}: {w}" for r, w in hits)


def agreed_outcome(world: Any, tag: str, outcome: dict[str, Any]) -> dict[str, Any]:
    """One outcome for every rank: an error on any rank fails the variant everywhere; an
    error of the communication layer stops every rank; gate mismatches are summed."""
    if world is None:
        return outcome
    every = world.agree(tag, outcome)
    errors = [(r, o) for r, o in enumerate(every) if o.get("error")]
    # a world of one cannot fall out of step: its communication errors fail the variant
    lost = [(r, o) for r, o in errors if o.get("dist")] if len(every) > 1 else []
    if lost:
        r, o = lost[0]
        # a rank's own error is what a peer's timeout usually follows from: name it first
        cause = [(c, x) for c, x in errors if not x.get("dist")]
        first = f"rank {cause[0][0]}: {cause[0][1]['error']}, then " if cause else ""
        world.fatal(f"{tag}: {first}rank {r}: {o['error']}")
    if errors:
        r, o = errors[0]
        where = "every rank" if len(errors) == len(every) else f"rank {r}"
        return {**o, "error": f"{where}: {o['error']}"}
    if "passed" not in outcome:
        return outcome
    wrong = sum(int(o.get("wrong") or 0) for o in every)
    failing = [(r, o) for r, o in enumerate(every) if not o["passed"]]
    summary = outcome["summary"] if not failing else "; ".join(f"rank {r}: {o['summary']}" for r, o in failing)
    return {"error": None, "passed": not failing, "wrong": wrong, "summary": summary}
