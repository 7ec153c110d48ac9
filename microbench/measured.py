"""Component times read back from result files, for the step-time model.

Only GPU records that passed their gate are used (a CPU result times the interpreter, not a
kernel), at the exact point the budget needs (batch, draft tokens and context for
attention; the token count for the MoE and norms); the allreduce is interpolated in log
bytes between the sizes measured at the same world size and capture mode, never
extrapolated. Each hit carries its source: the case, variant, point and file.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

from microbench.results import load


class _Hit:
    __slots__ = ("seconds", "source")

    def __init__(self, seconds: float, source: str):
        self.seconds, self.source = seconds, source


def _median(r: dict[str, Any]) -> float:
    return float(r["timing"]["summary"]["median"])


class Measured:
    """The usable records of some result files (paths or loaded documents)."""

    def __init__(self, docs: Sequence[Any]):
        self.records: list[tuple[dict[str, Any], str]] = []
        self.notes: list[str] = []
        #: the GPU names (fingerprint ``device.name``) of the files used, in order, once each
        self.gpus: list[str] = []
        for d in docs:
            doc = load(d) if isinstance(d, (str, os.PathLike)) else d
            name = os.path.basename(str(d)) if isinstance(d, (str, os.PathLike)) else doc["run"].get("id", "result")
            device = str(doc["run"].get("device", ""))
            if not device.startswith("cuda"):
                self.notes.append(f"{name}: ran on {device or 'an unknown device'}, not a GPU: not used")
                continue
            gpu = ((doc.get("fingerprint") or {}).get("device") or {}).get("name") or device
            ok = [r for r in doc["records"] if r.get("status") == "OK" and r.get("timing")]
            self.records += [(r, f"{name} on {gpu}") for r in ok]
            if gpu not in self.gpus:
                self.gpus.append(gpu)
            self.notes.append(f"{name}: {len(ok)} OK records from {gpu}")

    def _find(self, case: str, variant: str | None, **axes: Any) -> _Hit | None:
        for r, where in self.records:
            if r["case"] != case or (variant is not None and r["variant"] != variant):
                continue
            if all(r["axes"].get(k) == v for k, v in axes.items()):
                point = " ".join(f"{k}={v}" for k, v in axes.items())
                return _Hit(_median(r), f"measured: {case} {r['variant']} {point} ({where})")
        return None

    def attention(self, batch: int, q_len: int, context: int, kernel: str) -> _Hit | None:
        return self._find("attention.mla_verify", kernel, batch=batch, draft_tokens=q_len, context=context,
                          dtype="bf16")

    def experts(self, layout: str, tokens: int, weights: str, kernel: str) -> _Hit | None:
        return self._find("moe.experts", kernel, layout=layout, tokens=tokens, weights=weights, routing="router",
                          dtype="bf16")

    def router(self, layout: str, tokens: int) -> _Hit | None:
        return self._find("moe.router", None, layout=layout, tokens=tokens, dtype="bf16")

    def norms(self, tokens: int) -> _Hit | None:
        """The layer's four RMSNorms (input and post-attention with the residual add, q_a,
        kv_a) at ``tokens``, Triton variant; None unless all three widths were measured."""
        hits = [self._find("norm.rmsnorm", "triton", tokens=tokens, norm=n, dtype="bf16") for n in ("input", "q_a",
                                                                                                   "kv_a")]
        if any(h is None for h in hits):
            return None
        total = 2 * hits[0].seconds + hits[1].seconds + hits[2].seconds
        return _Hit(total, f"measured: norm.rmsnorm triton tokens={tokens} (2 x input, q_a, kv_a)")

    def allreduce(self, nbytes: int, capture: str, world: int, variant: str = "torch-ip") -> _Hit | None:
        """One allreduce of ``nbytes`` at ``world`` ranks, interpolated in log-log between
        the nearest measured sizes of ``variant`` in ``capture`` mode."""
        pts = sorted((int(r["facts"]["bytes"]), _median(r), where) for r, where in self.records
                     if r["variant"] == variant and (r.get("facts") or {}).get("collective") == "allreduce"
                     and int(r["facts"]["world_size"]) == world and r["axes"].get("capture") == capture)
        for b, t, where in pts:
            if b == nbytes:
                return _Hit(t, f"measured: allreduce {variant} {capture} {b} B at {world} ranks ({where})")
        below = [p for p in pts if p[0] < nbytes]
        above = [p for p in pts if p[0] > nbytes]
        if not below or not above:
            return None
        (b0, t0, where), (b1, t1, _) = below[-1], above[0]
        w = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
        t = math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
        return _Hit(t, f"measured: allreduce {variant} {capture} at {world} ranks, interpolated "
                       f"{b0}..{b1} B ({where})")

    def layer(self, layout: str, phase: str, batch: int, draft_tokens: int, context: int, capture: str,
              variant: str, weights: str) -> _Hit | None:
        """One decoder layer as ``layer.decoder`` measured it (per layer: the call over its
        stacked layers), in bf16 with the model's routed-expert ``weights``; its allreduce
        was a one-rank stand-in."""
        for r, where in self.records:
            a = r["axes"]
            if (r["case"] == "layer.decoder" and r["variant"] == variant and a.get("layer") == layout
                    and a.get("dtype") == "bf16" and a.get("weights") == weights
                    and a.get("phase") == phase and a.get("batch") == batch and a.get("context") == context
                    and a.get("capture") == capture and (phase == "decode" or a.get("draft_tokens") == draft_tokens)):
                n = (r.get("facts") or {}).get("layers") or 1
                return _Hit(_median(r) / n, f"measured: layer.decoder {variant} {phase} {capture} batch={batch} "
                                            f"context={context}, per layer of {n} ({where})")
        return None

    def launch_cost(self) -> _Hit | None:
        """The eager launch floor: calibration.launch's torch one-element op, back to back."""
        return self._find("calibration.launch", "torch_tiny_op", capture="eager")

    def kernel_floor(self) -> _Hit | None:
        """The GPU's own per-kernel floor: the same op replayed from a CUDA graph."""
        return self._find("calibration.launch", "torch_tiny_op", capture="graph")
