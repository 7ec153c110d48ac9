"""Component times read back from result files, for the step-time model.

Only GPU records that passed their gate are used (a CPU result times the interpreter, not a
kernel), at the exact point the budget needs (batch, draft tokens and context for
attention, at the model's heads per rank; the token count for the MoE, by layout, and
for the norms, at the model's widths); the allreduce is interpolated in log bytes between
the sizes measured at the same world size and capture mode, never extrapolated. A
component's time is its kernels' GPU time: records timed ``cold`` or ``graph``, never
``hot`` (back-to-back calls, whose host launch cost the model adds on its own). Each hit
carries its source: the case, variant, point, timing mode and file.
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

    def _find(self, case: str, variant: str | None, facts: dict[str, Any] | None = None,
              modes: tuple[str, ...] | None = ("cold", "graph"), **axes: Any) -> _Hit | None:
        """The first record of ``case`` (``variant``) at ``axes``, with ``facts`` (the shapes
        the axes do not say), timed in one of ``modes`` (None: any)."""
        for r, where in self.records:
            if r["case"] != case or (variant is not None and r["variant"] != variant):
                continue
            mode = r["timing"].get("mode")
            if modes is not None and mode not in modes:
                continue
            if all(r["axes"].get(k) == v for k, v in axes.items()) and all(
                    (r.get("facts") or {}).get(k) == v for k, v in (facts or {}).items()):
                point = " ".join(f"{k}={v}" for k, v in axes.items())
                return _Hit(_median(r), f"measured: {case} {r['variant']} {point}, {mode} ({where})")
        return None

    def attention(self, batch: int, q_len: int, context: int, kernel: str, heads: int) -> _Hit | None:
        """At ``heads`` per rank: the case measures Kimi-K2.5 TP8's 8, which another layout
        or model does not take."""
        return self._find("attention.mla_verify", kernel, {"heads": heads}, batch=batch, draft_tokens=q_len,
                          context=context, dtype="bf16")

    def experts(self, layout: str, tokens: int, weights: str, kernel: str) -> _Hit | None:
        return self._find("moe.experts", kernel, layout=layout, tokens=tokens, weights=weights, routing="router",
                          dtype="bf16")

    def router(self, layout: str, tokens: int) -> _Hit | None:
        return self._find("moe.router", None, layout=layout, tokens=tokens, dtype="bf16")

    def norms(self, tokens: int, widths: dict[str, int | None]) -> _Hit | None:
        """The layer's RMSNorms (input and post-attention with the residual add, q_a, kv_a)
        at ``tokens``, Triton variant, at the model's ``widths`` (q_a None: a model whose
        query is not compressed has no q_a norm); None unless every one was measured."""
        names = [n for n in ("input", "q_a", "kv_a") if widths.get(n)]
        hits = {n: self._find("norm.rmsnorm", "triton", {"width": widths[n]}, tokens=tokens, norm=n, dtype="bf16")
                for n in names}
        if any(h is None for h in hits.values()):
            return None
        total = hits["input"].seconds + sum(h.seconds for h in hits.values())
        return _Hit(total, f"measured: norm.rmsnorm triton tokens={tokens} (2 x input, {', '.join(names[1:])})")

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
        return self._find("calibration.launch", "torch_tiny_op", modes=None, capture="eager")

    def kernel_floor(self) -> _Hit | None:
        """The GPU's own per-kernel floor: the same op replayed from a CUDA graph."""
        return self._find("calibration.launch", "torch_tiny_op", modes=None, capture="graph")
