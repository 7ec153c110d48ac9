"""The correctness gate: a variant that is not correct is not timed.

For each variant, at the case's own shape: fresh seeded random inputs, outputs poisoned
(NaN for floating point, a sentinel for integers) so that an element the kernel never
wrote fails, one call, then every output compared in fp32 with the reference. NaN or Inf
in the output fails whatever the tolerance. A failure explains itself: how many elements
are off, the worst one (index, got, want), the max abs and rel error.

Beside the elementwise bound ``|got - want| <= atol + rtol |want|``, a case may bound the
whole output's relative L2 error, ``||got - want|| / ||want||`` (``norm_tol``). The
elementwise bound must leave room for the worst element's rounding, so its ``atol`` is a
few ulps of the output's largest values; where most values are much smaller (attention
over a long context averages many keys), a wrong key moves them by less than that, and
only the norm of the whole error sees it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch

#: Integer outputs are poisoned with this value (no index or count is ever -2**31 + 7).
INT_POISON = -(2**31) + 7


@dataclass
class MismatchReport:
    """How one output compares with its reference."""

    name: str
    shape: list[int]
    dtype: str
    numel: int
    atol: float
    rtol: float
    mismatched: int = 0
    nan: int = 0
    inf: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst_index: list[int] | None = None
    worst_got: float | None = None
    worst_want: float | None = None
    error: str | None = None  # shape / dtype problems
    rel_l2: float = 0.0  # ||got - want|| / ||want|| over the finite elements (floating point)
    norm_tol: float | None = None  # the bound on rel_l2, when the case sets one

    @property
    def norm_failed(self) -> bool:
        return self.norm_tol is not None and not self.rel_l2 <= self.norm_tol

    @property
    def passed(self) -> bool:
        return (self.error is None and self.mismatched == 0 and self.nan == 0 and self.inf == 0
                and not self.norm_failed)

    def __str__(self) -> str:
        if self.error:
            return f"{self.name}: {self.error}"
        norm = f", relative L2 {self.rel_l2:.3g}" if self.norm_tol is not None else ""
        if self.passed:
            return f"{self.name}: ok (max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}{norm})"
        parts = [f"{self.mismatched}/{self.numel} elements off"] if self.mismatched or not self.norm_failed else []
        if self.nan or self.inf:
            parts.append(f"{self.nan} NaN, {self.inf} Inf")
        if self.norm_failed:
            parts.append(f"relative L2 error {self.rel_l2:.3g} over the whole output (bound {self.norm_tol:g})")
        parts[0] = f"{self.name} {tuple(self.shape)} {self.dtype}: {parts[0]}"
        if self.worst_index is not None:
            parts.append(f"worst at {tuple(self.worst_index)}: got {self.worst_got:.6g}, want {self.worst_want:.6g}")
        parts.append(f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g} (atol {self.atol:g}, rtol {self.rtol:g})")
        return "; ".join(parts)


@dataclass
class GateResult:
    passed: bool
    seed: int
    checked: bool = True  # False only when the case has nothing to check (says why)
    reports: list[MismatchReport] = field(default_factory=list)
    reason: str | None = None

    @property
    def wrong(self) -> int:
        """Elements that failed (off, NaN or Inf), over every output: nccl-tests' #wrong."""
        return sum(r.mismatched if r.error is None else r.numel for r in self.reports)

    def summary(self) -> str:
        if not self.checked:
            return f"not checked: {self.reason}"
        if self.passed:
            return "ok"
        return "; ".join(str(r) for r in self.reports if not r.passed) or (self.reason or "failed")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary()
        return d


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with values no correct kernel leaves behind."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        # a type too narrow for INT_POISON gets its least plausible value: the most negative
        # for a signed one, the largest for an unsigned one (its minimum, 0, is what an
        # index or count most often is)
        info = torch.iinfo(t.dtype)
        t.fill_(info.max if info.min == 0 else max(INT_POISON, info.min))
    return t


def compare(got: torch.Tensor, want: torch.Tensor, *, atol: float, rtol: float, name: str = "out",
            norm_tol: float | None = None) -> MismatchReport:
    """Compare ``got`` with ``want`` elementwise in fp32: |got - want| <= atol + rtol*|want|,
    and, with ``norm_tol``, the whole output: ||got - want|| / ||want|| <= norm_tol.

    Integer and bool outputs must match exactly, whatever the reference's dtype. Complex
    outputs are compared as their [..., 2] view of (real, imaginary) parts, each part with
    the tolerance, and the report describes that view. NaN/Inf in ``got`` always fail (a
    NaN in ``want`` means a broken reference and is reported as such).
    """
    rep = MismatchReport(name, list(got.shape), str(got.dtype).replace("torch.", ""), got.numel(), atol, rtol)
    rep.norm_tol = norm_tol
    if tuple(got.shape) != tuple(want.shape):
        rep.error = f"shape {tuple(got.shape)} but the reference has {tuple(want.shape)}"
        return rep
    if got.is_complex() or want.is_complex():
        # a cast to a real dtype would keep the real part alone: compare the [..., 2] view
        # of (real, imaginary) parts, and report on it
        got = torch.view_as_real(got.detach().to(torch.complex64).resolve_conj())
        want = torch.view_as_real(want.detach().to(torch.complex64).resolve_conj())
        rep.shape, rep.numel = list(got.shape), got.numel()
    exact = not got.is_floating_point()
    # compare where the output lives: a 1 GiB output compared on the host would cost
    # seconds and several GB of host memory
    g = got.detach().to(dtype=torch.float64 if exact else torch.float32)
    w = want.detach().to(device=g.device, dtype=g.dtype)
    if not torch.isfinite(w).all():
        rep.error = "the reference itself has NaN/Inf"
        return rep
    nan, inf = torch.isnan(g), torch.isinf(g)
    rep.nan, rep.inf = int(nan.sum()), int(inf.sum())
    diff = (g - w).abs()
    bound = torch.zeros_like(w) if exact else atol + rtol * w.abs()
    bad = (diff > bound) | nan | inf
    rep.mismatched = int(bad.sum())
    finite = ~(nan | inf)
    if g.numel():
        d = torch.where(finite, diff, torch.zeros_like(diff))
        rep.max_abs = float(d.max())
        rep.max_rel = float((d / w.abs().clamp_min(1e-12)).max())
        if not exact:
            err, ref = (torch.linalg.vector_norm(x, dtype=torch.float64) for x in (d, w))
            rep.rel_l2 = float(err / ref) if ref > 0 else (0.0 if err == 0 else float("inf"))
        # worst = the element furthest past its bound; non-finite ones first
        excess = torch.where(finite, diff - bound, torch.full_like(diff, float("inf")))
        flat = int(torch.argmax(excess))
        if rep.mismatched:
            idx = list(torch.unravel_index(torch.tensor(flat), tuple(g.shape))) if g.dim() else []
            rep.worst_index = [int(i) for i in idx]
            rep.worst_got = float(g.reshape(-1)[flat])
            rep.worst_want = float(w.reshape(-1)[flat])
    return rep


def check_variant(
    fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    outputs: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    atol: float,
    rtol: float,
    seed: int,
    norm_tol: float | None = None,
) -> GateResult:
    """Poison ``outputs``, call ``fn(**inputs, **outputs)`` once, compare with ``expected``.

    ``expected`` names outputs, or inputs the variant must update in place.
    If ``fn`` returns tensors they are taken as its outputs (in the order of ``outputs``);
    anything else it returns (a Triton launch's handle) is not an output.
    Exceptions from ``fn`` propagate to the caller, which records them.

    Two more ways to be wrong are caught: each output is handed to the call inside a
    poisoned guard band (:data:`GUARD_BYTES` before and after it), so a write past either
    end fails; and an input the case does not expect to change (none of ``expected``,
    up to :data:`CHECKED_INPUT_BYTES` of them) must come back bit for bit as it went in.
    """
    if not expected:
        return GateResult(passed=True, seed=seed, checked=False, reason="the case writes no output to check")
    guarded = {k: _guarded(t, inputs) for k, t in outputs.items()}
    handed = {k: g[1] if g else t for (k, t), g in zip(outputs.items(), guarded.values())}
    for t in handed.values():
        poison_(t)
    kept = _kept_inputs(inputs, expected, handed)
    ret = fn(**inputs, **handed)
    # An expected name may be an input the variant updates in place (e.g. the residual
    # of a fused add + RMSNorm); the reference was computed before the call.
    got = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    got.update(handed)
    if ret is not None:
        rets = ret if isinstance(ret, (tuple, list)) else (ret,)
        names = list(outputs) or list(expected)
        got.update({n: r for n, r in zip(names, rets) if isinstance(r, torch.Tensor)})
    if _is_cuda(got):
        torch.cuda.synchronize()
    reports, seen = [], []
    for name, g in guarded.items():
        if g is not None and (outside := _outside(*g)):
            t = outputs[name]
            reports.append(MismatchReport(name, list(t.shape), str(t.dtype).removeprefix("torch."), t.numel(), atol,
                                          rtol, error=f"written outside it: {outside}"))
    for name, before in kept.items():
        after = inputs[name]
        if not torch.equal(_bytes(before), _bytes(after)):
            reports.append(MismatchReport(name, list(after.shape), str(after.dtype).removeprefix("torch."),
                                          after.numel(), atol, rtol,
                                          error="an input the case does not expect to change was changed"))
    for name, want in expected.items():
        if name not in got:
            reports.append(MismatchReport(name, list(want.shape), "-", want.numel(), atol, rtol, error="not produced"))
            continue
        # one tensor under two names (an in-place result returned as the output) with one
        # expectation is compared once: its wrong elements are counted once
        if any(t is got[name] and torch.equal(w, want) for t, w in seen):
            continue
        seen.append((got[name], want))
        reports.append(compare(got[name], want, atol=atol, rtol=rtol, name=name, norm_tol=norm_tol))
    return GateResult(passed=all(r.passed for r in reports), seed=seed, reports=reports)


#: Bytes of poisoned guard band before and after each output the gate hands a variant: a
#: multiple of 16, so the output's address keeps the alignment Triton specialises on.
GUARD_BYTES = 512
#: The most input bytes the gate copies to check them unchanged (a model's expert weights
#: or a long latent cache are left unchecked beyond it: their copies would double memory).
CHECKED_INPUT_BYTES = 256 << 20


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _guarded(t: Any, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(buffer, a view shaped like ``t`` inside it, guard elements each side) for a
    contiguous output that shares no memory with an input (an in-place output stays as
    it is); None otherwise."""
    if not isinstance(t, torch.Tensor) or not t.is_contiguous() or not t.numel():
        return None
    if any(isinstance(v, torch.Tensor) and _overlaps(t, v) for v in inputs.values()):
        return None
    pad = max(1, GUARD_BYTES // t.element_size())
    buf = torch.empty(t.numel() + 2 * pad, dtype=t.dtype, device=t.device)
    poison_(buf)
    return buf, buf[pad: pad + t.numel()].view(t.shape), pad


def _outside(buf: torch.Tensor, view: torch.Tensor, pad: int) -> str:
    """How the guard bands of ``buf`` differ from their poison ('' when they do not)."""
    ref = poison_(torch.empty(pad, dtype=buf.dtype, device=buf.device))
    counts = []
    for side, band in (("before", buf[:pad]), ("after", buf[-pad:])):
        differ = (_bytes(band) != _bytes(ref)).view(pad, -1).any(dim=1)
        n = int(differ.sum())
        if n:
            counts.append(f"{n} element(s) {side} it")
    return ", ".join(counts)


def _kept_inputs(inputs: Mapping[str, Any], expected: Mapping[str, Any],
                 handed: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Copies of the tensor inputs a call must leave unchanged: not expected to change,
    not sharing memory with an output, within :data:`CHECKED_INPUT_BYTES` in all."""
    kept, budget = {}, CHECKED_INPUT_BYTES
    for k, v in inputs.items():
        if not isinstance(v, torch.Tensor) or k in expected or not v.numel():
            continue
        size = v.numel() * v.element_size()
        if size > budget or any(isinstance(o, torch.Tensor) and _overlaps(v, o) for o in handed.values()):
            continue
        kept[k], budget = v.clone(), budget - size
    return kept


def _is_cuda(tensors: Mapping[str, Any]) -> bool:
    return any(getattr(t, "is_cuda", False) for t in tensors.values())
