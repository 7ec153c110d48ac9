"""Speed targets: the bars a case sets for its own points, read against a result file.

A case states what its kernels are meant to reach (:meth:`Case.targets`), e.g. "the
verify kernel at least 8x faster than the extend kernel at q_len 4, batch 1, 16K keys".
:func:`evaluate` reads each :class:`Target` against a run's records and gives one row per
(variant, point) it covers, with the measured value, its 95% interval and a verdict:

========  ====================================================================
MET       the whole interval is on the bar's side
MISSED    the whole interval is on the other side
UNSURE    the interval straddles the bar (more samples, or a quieter machine, decide)
NO TIME   the point ran but the variant (or the one it is measured against) has no
          time: FAILED its correctness gate, SKIPPED, ... (the reason is given)
========  ====================================================================

The measures (``kind``):

- ``speedup``: time of ``ref`` / time of the variant at the same point, at least ``bar``;
  its interval is the table's own "vs baseline" verdict where ``ref`` is the case's
  baseline, else the same rule between the two (:func:`microbench.verdicts.within_run`),
  and as there, two variants timed one after the other whose records are too short to
  show their wander are UNSURE whatever the interval;
- ``time_ratio``: time of the variant / time of ``ref``, at most ``bar`` ("within 10%
  of the decode kernel" is ``time_ratio`` 1.10);
- ``floor``: the record's floor (bytes / measured bandwidth, the roofline) / its median
  time, at least ``bar``; the interval is the median's distribution-free one, at least
  one timer tick wide (:func:`microbench.stats.median_ci`), widened in quadrature by the
  ceiling's own noise where the run measured it (a datasheet's figure is exact as stated).

A value a bar names that no record has (a run narrowed by ``--axis``) is a row saying so.

A bar is stated for one GPU (``stated_for``, a hardware profile name): on another the
rows still say where the kernels stand, and the table says whose bar it is. Nothing here
knows a kernel; the case names its variants, axes and bars.

A run stores the bars its cases stated (``run.targets``, :func:`stored`), so a result file
is read against the bars of the code that made it, not against whatever today's code
states (:func:`bars`: the run's by default, today's on request, and a line saying which
and whether the two differ). A file written before runs stored them is read against
today's bars, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["KINDS", "VERDICTS", "Target", "bars", "evaluate", "for_run", "of_run", "render", "stated", "stored"]

#: kind -> (the direction a value must lie from the bar, how it reads)
KINDS = {"speedup": (">=", "x"), "time_ratio": ("<=", "x"), "floor": (">=", "%")}
VERDICTS = ("MET", "MISSED", "UNSURE", "NO TIME")


@dataclass(frozen=True)
class Target:
    """One bar: ``variants`` measured by ``kind`` against ``bar`` at the points whose axes
    take the values in ``where`` (an axis left out: any value).

    ``text``: the goal as a sentence ("8x the extend kernel at q_len 4, batch 1, 16K keys");
    ``ref``: the variant a ``speedup`` or ``time_ratio`` is measured against;
    ``stated_for``: the hardware profile the bar is stated for ("h200-sxm"), "" for any;
    ``details``: derived columns of the records involved to show beside the verdict
    (e.g. which launch configuration the baseline ran).
    """

    text: str
    variants: tuple[str, ...]
    kind: str
    bar: float
    where: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    ref: str | None = None
    stated_for: str = ""
    details: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Target {self.text!r}: kind {self.kind!r}, expected one of {', '.join(KINDS)}")
        if not (isinstance(self.bar, (int, float)) and math.isfinite(self.bar) and self.bar > 0):
            raise ValueError(f"Target {self.text!r}: bar must be a positive number, got {self.bar!r}")
        if isinstance(self.variants, str) or not self.variants:
            raise ValueError(f"Target {self.text!r}: variants must be a non-empty tuple of names")
        if (self.ref is None) == (self.kind != "floor"):
            raise ValueError(f"Target {self.text!r}: kind {self.kind!r} "
                             + ("needs ref, the variant it is measured against" if self.ref is None
                                else "takes no ref"))
        if self.ref is not None and self.ref in self.variants:
            raise ValueError(f"Target {self.text!r}: ref {self.ref!r} is one of its own variants")
        for axis, values in self.where.items():
            if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)) or not values:
                raise ValueError(f"Target {self.text!r}: where[{axis!r}] must be a non-empty tuple of values")

    def covers(self, axes: Mapping[str, Any]) -> bool:
        return all(k in axes and axes[k] in v for k, v in self.where.items())

    def bar_text(self) -> str:
        op, unit = KINDS[self.kind]
        return f"{'≥' if op == '>=' else '≤'} " + _fmt(self.bar, unit)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples as lists (what :meth:`from_dict` reads back)."""
        return {"text": self.text, "variants": list(self.variants), "kind": self.kind, "bar": self.bar,
                "where": {k: list(v) for k, v in self.where.items()}, "ref": self.ref,
                "stated_for": self.stated_for, "details": list(self.details)}

    @classmethod
    def from_dict(cls, d: Any) -> "Target":
        """A stored bar; ValueError naming what is wrong with it."""
        need = ("text", "variants", "kind", "bar")
        if not isinstance(d, dict) or any(k not in d for k in need):
            raise ValueError(f"a stored target needs {', '.join(need)}; got {d!r:.120}")
        where = d.get("where") or {}
        if not isinstance(where, dict):
            raise ValueError(f"stored target {d['text']!r}: where must be an object, got {where!r:.80}")

        def tup(x: Any) -> Any:
            return tuple(x) if isinstance(x, list) else x

        return cls(text=str(d["text"]), variants=tup(d["variants"]), kind=d["kind"], bar=d["bar"],
                   where={k: tup(v) for k, v in where.items()}, ref=d.get("ref"),
                   stated_for=str(d.get("stated_for") or ""), details=tuple(d.get("details") or ()))


def stated() -> dict[str, list[Target]]:
    """Every shipped case's bars, by case id (the cases that state none left out)."""
    from microbench.cases import all_cases

    return {c.id: ts for c in all_cases() if (ts := list(c.targets()))}


def stored(cases: Sequence[Any]) -> dict[str, list[dict[str, Any]]]:
    """What a run writes as ``run.targets``: the bars ``cases`` state, by case id. A case
    whose ``targets()`` raises stores none (the run goes on; ``microbench targets`` with
    ``--bars code`` shows the error)."""
    out = {}
    for c in cases:
        try:
            ts = list(c.targets())
        except Exception:  # noqa: BLE001 - a broken declaration must not stop a run
            continue
        if ts:
            out[c.id] = [t.to_dict() for t in ts]
    return out


def of_run(doc: dict[str, Any]) -> dict[str, list[Target]] | None:
    """The bars a result file's run stated (``run.targets``), or None for a file written
    before runs stored them. ValueError naming the case for a malformed entry."""
    raw = (doc.get("run") or {}).get("targets")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"run.targets must be an object by case id, got {type(raw).__name__}")
    out = {}
    for cid, ts in raw.items():
        if not isinstance(ts, list):
            raise ValueError(f"run.targets[{cid!r}] must be a list, got {type(ts).__name__}")
        try:
            out[cid] = [Target.from_dict(t) for t in ts]
        except ValueError as e:
            raise ValueError(f"run.targets[{cid!r}]: {e}") from None
    return out


def bars(doc: dict[str, Any], source: str | None = None) -> tuple[dict[str, list[Target]], str]:
    """The bars to read ``doc`` against, by case id, and a line saying whose they are.

    ``source``: "run" (the bars the run stored), "code" (today's), or None: the run's where
    the file holds them, else today's. Where both exist and differ for a case the file
    holds, the line says so and how to read the other. ValueError: "run" asked of a file
    that stores none, or a malformed stored entry."""
    if source not in (None, "run", "code"):
        raise ValueError(f"bars source {source!r}, expected run or code")
    run_bars = of_run(doc)
    if source == "run" and run_bars is None:
        raise ValueError("this file stores no bars (written before runs stored them); --bars code reads today's")
    held = {r["case"] for r in doc.get("records", [])}
    if run_bars is None:
        return stated(), "bars: today's code (this file was written before runs stored their bars)"
    sha = ((doc.get("fingerprint") or {}).get("git") or {}).get("short")
    made = f" (made at {sha})" if sha else ""
    if source == "code":
        chosen, other = stated(), run_bars
        line, also = "bars: today's code", f"the run{made} stated other bars for {{}}: --bars run reads those"
    else:
        chosen = run_bars
        try:
            other = stated()
        except Exception:  # noqa: BLE001 - today's code cannot state its bars: the run's are still read
            other = run_bars
        line, also = f"bars: as the run{made} stated them", "today's code states other bars for {}: --bars code reads those"

    def as_stored(c: str, side: Mapping[str, list[Target]]) -> list[dict[str, Any]]:  # tuples as lists, both sides
        return [t.to_dict() for t in side.get(c, [])]

    differ = sorted(c for c in held if as_stored(c, chosen) != as_stored(c, other))
    return chosen, line + ("; " + also.format(", ".join(differ)) if differ else "")


def _on_cpu(doc: dict[str, Any]) -> bool:
    return str((doc.get("run") or {}).get("device", "")).startswith("cpu")


def _fmt(x: float, unit: str) -> str:
    if not math.isfinite(x):
        return "∞" if x > 0 else "-"
    return f"{100 * x:.1f}%" if unit == "%" else f"{x:.2f}×"


def _judge(lo: float, hi: float, bar: float, op: str) -> str:
    if op == ">=":
        return "MET" if lo >= bar else "MISSED" if hi < bar else "UNSURE"
    return "MET" if hi <= bar else "MISSED" if lo > bar else "UNSURE"


def _timed(r: dict[str, Any] | None) -> bool:
    return bool(r) and r["status"] == "OK" and bool((r.get("timing") or {}).get("samples_s"))


def _why_untimed(name: str, r: dict[str, Any] | None) -> str:
    if r is None:
        return f"{name}: not in this file"
    if r["status"] != "OK":
        return f"{name}: {r['status']}" + (f" ({r['reason']})" if r.get("reason") else "")
    return f"{name}: no samples"


def _floor_noise(doc: Mapping[str, Any], rec: Mapping[str, Any]) -> float | None:
    """The relative 95% half-width of the ceiling under ``rec``'s floor: 0 for a datasheet
    figure, the measuring record's median noise for one this run measured, None when that
    record cannot be found (a file that does not say which point set the ceiling)."""
    if "in this run" not in str(rec.get("floor_source")):
        return 0.0
    ceilings = (doc.get("run") or {}).get("ceilings") or {}
    for kind, amount in (("memory_bandwidth", rec.get("bytes")), ("matmul_flops", rec.get("flops"))):
        c = ceilings.get(kind)
        if not (c and amount and math.isclose(amount / c["value"], rec["floor_s"], rel_tol=1e-9)):
            continue
        case, field = str(c.get("source", "")).removesuffix(" in this run"), _AMOUNT[kind]
        for r in doc["records"]:  # the record that set it: its point, and the work over time it read
            if (r["case"] == case and r.get("axes") == c.get("axes") and r["status"] == "OK" and r.get("timing")
                    and r.get(field) and math.isclose(r[field] / r["timing"]["summary"]["median"], c["value"],
                                                      rel_tol=1e-9)):
                noise = r["timing"]["summary"]["rel_noise"]
                return noise if math.isfinite(noise) else None
    return None


#: the record field a ceiling's work is counted in
_AMOUNT = {"memory_bandwidth": "bytes", "matmul_flops": "flops"}


def _measure(t: Target, rec: dict[str, Any], ref: dict[str, Any] | None,
             run: Mapping[str, Any], floor_noise: float = 0.0) -> tuple[float, float, float]:
    """(value, lo, hi) of ``t``'s measure for ``rec`` (against ``ref``); ValueError when
    the samples cannot give one (a non-positive time). ``floor_noise``: the relative
    half-width of the floor's own ceiling (:func:`_floor_noise`)."""
    import numpy as np

    from microbench.stats import median_ci
    from microbench.verdicts import within_run

    if t.kind == "floor":
        samples = rec["timing"]["samples_s"]
        tm = float(np.median(samples))
        if not tm > 0:
            raise ValueError(f"{rec['variant']}: median time {tm!r}")
        lo_t, hi_t = median_ci(samples, resolution=rec["timing"].get("resolution_s") or 0.0)
        floor = rec["floor_s"]
        value = floor / tm
        lo, hi = (floor / hi_t if math.isfinite(hi_t) else 0.0), (floor / lo_t if lo_t > 0 else math.inf)
        # a floor from a ceiling this run measured is known to its median's noise too: the two
        # log half-widths add in quadrature (a datasheet's figure is exact as stated)
        c = math.log1p(floor_noise)
        if c and lo > 0:
            lo = value * math.exp(-math.hypot(math.log(value / lo), c))
        if c and math.isfinite(hi):
            hi = value * math.exp(math.hypot(math.log(hi / value), c))
        return value, lo, hi
    assert ref is not None
    vb = rec.get("vs_baseline")
    if vb and rec.get("baseline") == t.ref:  # the table's own verdict: ratio = variant / ref
        ratio, lo, hi = vb["ratio"], vb["lo"], vb["hi"]
    else:  # the rule the table's verdicts follow, between these two variants
        v = within_run(ref["timing"], rec["timing"], interleaved=bool(run.get("interleave")),
                       min_effect=float(run.get("min_effect") or 0.02))
        ratio, lo, hi = v.ratio, v.lo, v.hi
    if t.kind == "time_ratio":
        return ratio, lo, hi
    return 1.0 / ratio, (1.0 / hi if hi > 0 else 0.0), (1.0 / lo if lo > 0 else math.inf)


def evaluate(case_targets: Mapping[str, Sequence[Target]], doc: dict[str, Any],
             selected: bool = False) -> list[dict[str, Any]]:
    """One row per (case, target, variant, point) of ``doc`` that a target covers:
    ``{"case", "target", "variant", "point", "value", "lo", "hi", "verdict", "why",
    "details"}``. A target none of whose points is in the file (among the records
    ``selected`` by a filter) gives one row, verdict None, saying so. A CPU run's rows
    keep their values and are not judged (verdict "n/a (CPU)")."""
    from microbench.case import point_label
    from microbench.results import record_key
    from microbench.verdicts import wander_known

    run = doc.get("run") or {}
    on_cpu = _on_cpu(doc)
    absent = "no such point among the records selected" if selected else "no such point in this file"
    rows: list[dict[str, Any]] = []
    for case_id, targets in case_targets.items():
        recs = [r for r in doc["records"] if r["case"] == case_id]
        by = {record_key(r): r for r in recs}

        def find(axes: Mapping[str, Any], variant: str | None) -> dict[str, Any] | None:
            return by.get(record_key({"case": case_id, "axes": axes, "variant": variant})) if variant else None

        for t in targets:
            points = list({record_key(r)[1]: r["axes"] for r in recs if t.covers(r["axes"])}.values())
            base = {"case": case_id, "target": t, "value": None, "lo": None, "hi": None, "details": ""}
            if not points:
                rows.append({**base, "variant": ", ".join(t.variants), "point": "-", "verdict": None, "why": absent})
                continue
            # a value the bar names that no record has (a run narrowed by --axis): said, not dropped
            gaps = [f"{a}={json_value}" for a, values in t.where.items() for json_value in values
                    if not any(p.get(a) == json_value for p in points)]
            names = list(dict.fromkeys(a for p in points for a in p))
            varying = [a for a in names if len({repr(p.get(a)) for p in points}) > 1]
            for v in t.variants:
                for p in points:
                    rec, ref = find(p, v), find(p, t.ref)
                    row = {**base, "variant": v, "point": point_label({a: p.get(a) for a in varying}) or "-",
                           "why": ""}
                    shown = [x for x in (rec, ref) if x]
                    details = [f"{x['variant']} {k}={x['derived'][k]}" for x in shown
                               for k in t.details if k in (x.get("derived") or {})]
                    if t.kind == "floor" and rec and rec.get("floor_source"):
                        details.append(f"floor: {rec['floor_source']}")
                    row["details"] = "; ".join(details)
                    missing = [(n, x) for n, x in ((v, rec), (t.ref, ref)) if n and not _timed(x)]
                    if not missing and t.kind == "floor" and not rec.get("floor_s"):
                        missing = [(v, None)]
                        row["why"] = f"{v}: no floor (no measured or profiled ceiling for this run)"
                    if missing:
                        row["verdict"] = "NO TIME"
                        row["why"] = row["why"] or "; ".join(_why_untimed(n, x) for n, x in missing)
                        rows.append(row)
                        continue
                    noise = _floor_noise(doc, rec) if t.kind == "floor" else 0.0
                    try:
                        value, lo, hi = _measure(t, rec, ref, run, noise or 0.0)
                    except ValueError as e:  # a time the statistics refuse (<= 0): said, not a crash
                        row.update(verdict="NO TIME", why=str(e))
                        rows.append(row)
                        continue
                    verdict = "n/a (CPU)" if on_cpu else _judge(lo, hi, t.bar, KINDS[t.kind][0])
                    if noise is None and verdict in ("MET", "MISSED"):
                        verdict, row["why"] = "UNSURE", "the floor's ceiling: no record in this file says how well it was measured"
                    if (t.kind != "floor" and verdict in ("MET", "MISSED")
                            and not wander_known(ref["timing"], rec["timing"], interleaved=bool(run.get("interleave")))):
                        # as the run's own table says: timed one after the other, each too
                        # short to show how far it wandered meanwhile
                        verdict, row["why"] = "UNSURE", ("timed one after the other, too few samples to see either's "
                                                         "wander: run longer or with --interleave")
                    row.update(value=value, lo=lo, hi=hi, verdict=verdict)
                    rows.append(row)
            for gap in gaps:
                rows.append({**base, "variant": ", ".join(t.variants), "point": gap, "verdict": None, "why": absent})
    return rows


def _gpu_note(doc: dict[str, Any], rows: Sequence[dict[str, Any]]) -> list[str]:
    """Whose bars these are, against what this run ran on."""
    from microbench.hardware import profile_for_device_name

    run, fp = doc.get("run") or {}, doc.get("fingerprint") or {}
    name = (fp.get("device") or {}).get("name") or str(run.get("device") or "?")
    stated = sorted({r["target"].stated_for for r in rows if r["target"].stated_for})
    notes = []
    if _on_cpu(doc):
        notes.append(f"a CPU run ({name}): the bars are GPU goals and CPU times (Triton under the interpreter, "
                     "reduced shapes) say nothing of them, so no row is judged; a GPU run fills these rows")
    elif stated:
        prof = profile_for_device_name(name)
        here = prof.name if prof else None
        other = [s for s in stated if s != here]
        if other:
            notes.append(f"bars stated for {', '.join(other)}; this run's GPU is {name}"
                         f" ({'profile ' + here if here else 'no shipped profile'}): each row is where the kernels "
                         "stand on this GPU against that bar, not the bar's verdict on its own GPU")
    if not run.get("complete", True):
        notes.append("INCOMPLETE run: a point it did not reach has no row (a bar none of whose points it reached "
                     "reads 'no such point')")
    return notes


def render(doc: dict[str, Any], rows: Sequence[dict[str, Any]], fmt: str = "text", whose: str = "") -> str:
    """The rows as a table (text | markdown | csv) with the run's device, and what the
    verdicts say, under it; ``whose``: the line :func:`bars` gives, said under it too."""
    from microbench.report import render_table

    head = ["case", "target", "variant", "point", "measured", "95% interval", "bar", "verdict", "details"]
    run = doc.get("run") or {}
    on_cpu = _on_cpu(doc)
    table = []
    for r in rows:
        t: Target = r["target"]
        unit = KINDS[t.kind][1]
        if r["value"] is None:
            measured, interval = "-", "-"
        else:
            measured = _fmt(r["value"], unit)
            interval = f"[{_fmt(r['lo'], unit)}, {_fmt(r['hi'], unit)}]"
        verdict = r["verdict"] or "-"
        detail = "; ".join(x for x in (r["why"], r["details"]) if x)
        table.append([r["case"], t.text, r["variant"], r["point"], measured, interval, t.bar_text(), verdict, detail])
    out = render_table(table, head, fmt)
    if fmt == "csv":
        return out
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    tally = ("no verdicts on a CPU run" if on_cpu
             else ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no row with a time")
    lines = [f"speed targets of run {run.get('id', '?')} ({run.get('device', '?')}): {tally}"]
    lines += _gpu_note(doc, rows)
    lines += [whose] if whose else []
    lines.append("MET / MISSED: the whole 95% interval is on that side of the bar; UNSURE: it straddles the bar")
    if fmt == "markdown":
        return "#### Speed targets\n\n" + out + "\n" + "".join(f"_{x}_  \n" for x in lines)
    return "== speed targets ==\n" + out + "\n" + "\n".join(lines) + "\n"


def for_run(doc: dict[str, Any], fmt: str = "text", also: str | None = None) -> str:
    """The speed-target table ``microbench run`` prints after a GPU run's tables: the
    targets of the cases it ran, when at least one of their rows got a time; "" otherwise
    (a CPU run, a run of other cases or shapes, CSV output). ``also``: one more variant
    (``microbench try``'s) read against every bar beside the case's own."""
    from dataclasses import replace

    if fmt == "csv" or _on_cpu(doc):
        return ""
    held = {r["case"] for r in doc["records"]}
    own, _ = bars(doc)  # what the run stored as it began: its own code's bars
    chosen = {cid: [replace(t, variants=(*t.variants, also)) if also and also not in t.variants else t for t in ts]
              for cid, ts in own.items() if cid in held}
    rows = [r for r in evaluate(chosen, doc) if r["verdict"] is not None]
    return render(doc, rows, fmt) if any(r["value"] is not None for r in rows) else ""
