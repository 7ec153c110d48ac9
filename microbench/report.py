"""Tables of one run: text for the terminal, GitHub markdown for a PR, CSV for a sheet.

One table per case (each case has its own axes). Columns: the axes, variant, status,
median time, ±noise (half-width of the median's 95% CI, relative), samples and the rule
that stopped them, GB/s, TFLOP/s, % of the floor (floor = max(bytes / bandwidth,
FLOPs / matmul rate) over the measured time: 100% is the roofline), and the ratio to
the case's baseline variant with its verdict.
"""

from __future__ import annotations

import csv
import io
import math
from collections import OrderedDict
from typing import Any, Iterable, Mapping, Sequence

from tabulate import tabulate

FORMATS = ("text", "markdown", "csv")


def fmt_time(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3f} {unit}" if unit != "s" else f"{s:.3f} s"
    return f"{s / 1e-9:.1f} ns"


def sig(x: float | None) -> str:
    """Three significant digits, without exponent for the ranges tables show."""
    if x is None or not math.isfinite(x):
        return "-"
    a = abs(x)
    if a >= 100 or a == 0:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def _verdict_cell(vb: dict[str, Any] | None) -> str:
    if not vb:
        return ""
    return f"×{vb['ratio']:.3f} [{vb['lo']:.3f}, {vb['hi']:.3f}] {vb['label']}"


def group_by_case(records: Iterable[dict[str, Any]]) -> "OrderedDict[str, list[dict[str, Any]]]":
    groups: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
    for r in records:
        groups.setdefault(r["case"], []).append(r)
    return groups


def summary(text: str | Mapping[str, Any], axes: Mapping[str, Any] | None = None,
            variants: Sequence[str] = ()) -> dict[str, Any]:
    """One line a case draws across its points (:meth:`Case.summarize`), with the axis
    values and variants it speaks of, so a filtered report keeps it exactly when those are
    shown: ``{"text", "axes", "variants"}``. A plain string is a line about the whole case;
    a mapping (one read back from a result file) is normalised."""
    if isinstance(text, Mapping):
        return {"text": str(text["text"]), "axes": dict(text.get("axes") or {}),
                "variants": list(text.get("variants") or [])}
    return {"text": str(text), "axes": dict(axes or {}), "variants": list(variants)}


def crossovers(records: Iterable[dict[str, Any]], axis: str, baseline: str) -> list[dict[str, Any]]:
    """Along ``axis`` (e.g. tokens), for each other variant and each setting of the other
    axes: the variant's time ratio to ``baseline`` at every value (each record's own
    vs_baseline verdict, so the rule is the table's) and the first value at which the
    baseline is the faster one (SLOWER) — where the baseline overtakes the variant."""
    groups: OrderedDict[tuple, list[tuple[Any, dict[str, Any]]]] = OrderedDict()
    for r in records:
        vb = r.get("vs_baseline")
        if r["variant"] == baseline or r["status"] != "OK" or not vb or axis not in r["axes"]:
            continue
        rest = tuple((k, v) for k, v in r["axes"].items() if k != axis)
        groups.setdefault((r["variant"], rest), []).append((r["axes"][axis], vb))
    out = []
    for (variant, rest), pts in groups.items():
        if len(pts) < 2:  # one value: the table's own ratio column says it all
            continue
        if all(isinstance(v, (int, float)) for v, _ in pts):  # as the axis grows, whatever order it ran in
            pts = sorted(pts, key=lambda p: p[0])
        trail = ", ".join(f"{v} ×{vb['ratio']:.2f}" + ("" if vb["label"] in ("FASTER", "SLOWER") else
                                                         f" ({vb['label']})") for v, vb in pts)
        at = next((i for i, (_, vb) in enumerate(pts) if vb["label"] == "SLOWER"), None)
        if at is not None:
            verdict = f"{baseline} overtakes at {axis} = {pts[at][0]}"
            again = next((v for v, vb in pts[at + 1:] if vb["label"] == "FASTER"), None)
            if again is not None:
                verdict += f" ({variant} faster again at {axis} = {again})"
        elif all(vb["label"] == "FASTER" for _, vb in pts):
            verdict = f"{variant} faster at every {axis} measured (up to {pts[-1][0]})"
        else:
            verdict = f"{baseline} faster at no {axis} measured (up to {pts[-1][0]})"
        where = " ".join(f"{k}={v}" for k, v in rest)
        out.append(summary(f"{variant} / {baseline} time by {axis}" + (f" ({where})" if where else "")
                           + f": {trail}; {verdict}", dict(rest), (variant, baseline)))
    return out


def _marks(texts: list[Any], notes: list[str]) -> str:
    """`` [i]`` for each text, numbered in ``notes`` (the lines under a table), once per
    distinct text."""
    out = ""
    for text in texts:
        text = _short(text, 160)
        if text not in notes:
            notes.append(text)
        out += f" [{notes.index(text) + 1}]"
    return out


def _row(r: dict[str, Any], axes: list[str], derived: list[str], notes: list[str]) -> list[Any]:
    status = r["status"]
    # a record failed in a later --repeat pass keeps its earlier timing in the file; its row
    # shows none of it
    timing = (r.get("timing") or {}) if status == "OK" else {}
    t = timing.get("summary") or {}
    # a reason (not OK) or a timing note (OK, e.g. a cache graph mode could not keep cold)
    # goes under the table, numbered, once per distinct text
    status += _marks([r.get("reason")] if r["status"] != "OK" else timing.get("notes") or [], notes)
    return [*(r["axes"].get(a, "") for a in axes), r["variant"], status, fmt_time(t.get("median")),
            ("inf" if t["rel_noise"] == math.inf else _num(100 * t["rel_noise"], ".2f") + "%") if t else "-",
            f"{t['count']} {timing.get('stop_reason', '')}" if t else "-",
            sig(r.get("gbps")), sig(r.get("tflops")), sig(r.get("pct_of_floor")),
            _verdict_cell(r.get("vs_baseline")), *((r.get("derived") or {}).get(d, "") for d in derived)]


def _short(reason: str | None, n: int = 70) -> str:
    reason = (reason or "").replace("\n", " ")
    return reason if len(reason) <= n else reason[: n - 1] + "…"


HEADERS = ["variant", "status", "median", "±noise", "n (stop)", "GB/s", "TFLOP/s", "% floor", "vs baseline"]


def describe_run(doc: dict[str, Any]) -> str:
    """One paragraph on where the numbers come from: device, timer, mode, floors."""
    run, fp = doc["run"], doc.get("fingerprint", {})
    dev = fp.get("device", {})
    name = dev.get("name") or (fp.get("host") or {}).get("cpu_model") or run.get("device")
    modes = sorted({(r.get("timing") or {}).get("mode") for r in doc["records"] if r.get("timing")} - {None})
    lines = [f"device: {run.get('device')} ({name}); suite {run.get('suite')}; timing mode {', '.join(modes) or '-'}"
             f"; {'interleaved' if run.get('interleave') else 'sequential'}; seed {run.get('seed')}"]
    if str(run.get("device", "")).startswith("cpu"):
        interp = (fp.get("software") or {}).get("triton_interpret")
        lines.append("CPU timings" + (" (Triton kernels under the interpreter)" if interp == "1" else "")
                     + ": they check the harness end to end; they are not GPU performance.")
    ceil = run.get("ceilings") or {}
    if ceil:
        parts = [f"{k} {_ceiling_text(k, v)} ({v['source']})" for k, v in ceil.items()]
        lines.append("ceilings measured in this run: " + "; ".join(parts))
    srcs = sorted({r["floor_source"] for r in doc["records"] if r.get("floor_source")})
    if srcs:
        lines.append("% floor against: " + "; ".join(srcs))
    lines += _ceiling_warnings(ceil, name, doc["records"])
    if not run.get("complete", True):
        lines.append("INCOMPLETE run" + (" (interrupted)" if run.get("interrupted") else "") + ": finished cases only.")
    if not doc["records"]:
        lines.append("no records: the run finished no point" + ("" if run.get("complete", True) else " before it ended"))
    return "\n".join(lines)


#: a measured ceiling this far from the datasheet's is worth a line: (below, above)
CEILING_SANE = (0.5, 1.05)


def _ceiling_warnings(ceil: dict[str, Any], device_name: Any, records: list[dict[str, Any]]) -> list[str]:
    """Lines for what can make "% floor" mislead: a measured ceiling far from the GPU's
    datasheet figure (a busy or throttled GPU reads low, and every row against it reads
    high), and rows faster than their floor."""
    out = []
    try:
        from microbench.hardware import profile_for_device_name

        prof = profile_for_device_name(device_name) if isinstance(device_name, str) else None
    except Exception:  # noqa: BLE001 - a note, never a failure of the report
        prof = None
    sheet = {"memory_bandwidth": getattr(prof, "memory_bandwidth", None),
             "matmul_flops": getattr(prof, "bf16_dense_flops", None)}
    for kind, v in ceil.items():
        fig = sheet.get(kind)
        if fig is None or not fig.value:
            continue
        share = v["value"] / fig.value
        if not CEILING_SANE[0] <= share <= CEILING_SANE[1]:
            out.append(f"note: measured {kind} is {100 * share:.0f}% of {prof.name}'s datasheet "
                       f"{_ceiling_text(kind, {'value': fig.value})}: the rows read against it read "
                       f"{'high' if share < 1 else 'low'}")
    over = [r for r in records if (r.get("pct_of_floor") or 0) > 100]
    if over:
        out.append(f"note: {len(over)} row(s) ran faster than their floor (% floor over 100): the ceiling they "
                   "are read against is low, or their bytes / FLOPs are over-counted")
    return out


def _ceiling_text(kind: str, v: dict[str, Any]) -> str:
    if kind == "memory_bandwidth":
        return f"{v['value'] / 1e9:.1f} GB/s"
    if kind == "matmul_flops":
        return f"{v['value'] / 1e12:.2f} TFLOP/s"
    return fmt_time(v["value"])


def render(doc: dict[str, Any], fmt: str = "text") -> str:
    """The run's tables in ``fmt`` (text | markdown | csv)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if fmt == "csv":
        return render_csv(doc["records"])
    tablefmt = "github" if fmt == "markdown" else "simple"
    out = []
    run = doc.get("run") or {}
    head = describe_run(doc)
    out.append("\n".join(f"_{line}_" for line in head.splitlines()) if fmt == "markdown" else head)
    for case, recs in group_by_case(doc["records"]).items():
        axes = list(OrderedDict.fromkeys(a for r in recs for a in r["axes"]))
        derived = list(OrderedDict.fromkeys(d for r in recs for d in (r.get("derived") or {})))
        title = f"### {case}" if fmt == "markdown" else f"== {case} =="
        if all((r.get("facts") or {}).get("collective") or r["status"] == "SKIPPED" for r in recs) and any(
                (r.get("facts") or {}).get("collective") for r in recs):
            out.append(collective_tables(title, recs, tablefmt, fmt == "markdown"))
            continue
        notes: list[str] = []
        rows = [_row(r, axes, derived, notes) for r in recs]
        table = tabulate(rows, headers=axes + HEADERS + derived, tablefmt=tablefmt, disable_numparse=True)
        foot = "".join(f"\n[{i}] {n}" + ("  " if fmt == "markdown" else "") for i, n in enumerate(notes, 1))
        lines = [summary(x)["text"] for x in (run.get("summaries") or {}).get(case) or []]
        under = "".join(f"\n{line}" + ("  " if fmt == "markdown" else "") for line in lines)
        out.append(f"{title}\n{table}{foot}" + (f"\n{under}" if under else ""))
    return "\n\n".join(out) + "\n"


# --------------------------------------------------------------------------- collectives

#: nccl-tests' columns, per placement
_PLACEMENTS = ("out-of-place", "in-place")


def _bus_factor(world: int) -> float:
    """busbw / algbw for an allreduce over ``world`` ranks (nccl-tests: 2(n-1)/n)."""
    return 2 * (world - 1) / world if world > 0 else 0.0


def _placement_cells(r: dict[str, Any] | None, notes: list[str]) -> list[str]:
    if r is None:
        return ["", "", "", "", ""]
    if r["status"] != "OK":
        wrong = r.get("wrong")
        return [f"{r['status']}{_marks([r.get('reason')], notes)}", "", "", "", "-" if wrong is None else str(wrong)]
    f, s = r["facts"], r["timing"]["summary"]
    t = s["median"]
    algbw = f["bytes"] / t / 1e9
    # a timing note (a one-rank copy, copies short of a cold cache, a deadline) marks the time
    return [f"{t * 1e6:.2f}{_marks(r['timing'].get('notes') or [], notes)}", f"{100 * s['rel_noise']:.1f}%",
            f"{algbw:.2f}", f"{algbw * _bus_factor(int(f['world_size'])):.2f}", str(r.get("wrong") or 0)]


def collective_tables(title: str, recs: list[dict[str, Any]], tablefmt: str, markdown: bool) -> str:
    """One nccl-tests-style table per capture (eager, graph): a row per (size, path) with
    out-of-place then in-place time (µs, the slowest rank's), ±noise, algbw and busbw
    (GB/s), #wrong (summed over ranks)."""
    lead = [a for r in recs for a in r["axes"] if a not in ("capture", "dtype", "bytes")]
    lead = list(OrderedDict.fromkeys(lead))
    facts_of: dict[tuple, dict[str, Any]] = {}
    groups: OrderedDict[str, OrderedDict[tuple, dict[str, dict]]] = OrderedDict()
    worlds: dict[str, tuple] = {}
    for r in recs:
        tags = r.get("tags") or {}
        axes = r["axes"]
        f = r.get("facts") or {}
        gkey = axes.get("capture", "")
        point = tuple(json_key(axes.get(a)) for a in lead) + (axes.get("bytes"), axes.get("dtype"))
        row = (point, tags.get("path", r["variant"]))
        groups.setdefault(gkey, OrderedDict()).setdefault(row, {})[tags.get("placement", "in-place")] = r
        if f:
            facts_of[point] = f
            worlds.setdefault(gkey, (f.get("world_size"), f.get("backend")))
    parts = []
    for capture, rows in groups.items():
        world, backend = worlds.get(capture, (None, None))
        notes: list[str] = []
        body = []
        # a path SKIPPED at every size for one reason is a line under the table, not a row per size
        seen: dict[str, set] = {}
        for (_, path), by_place in rows.items():
            seen.setdefault(path, set()).update((r["status"], r.get("reason")) for r in by_place.values())
        absent = {path: next(iter(st))[1] for path, st in seen.items()
                  if len(st) == 1 and next(iter(st))[0] == "SKIPPED"}
        for (point, path), by_place in rows.items():
            if path in absent:
                continue
            f = facts_of.get(point, {})
            size = f.get("bytes", point[-2])
            body.append([*point[:len(lead)], size if size is not None else "-", f.get("count", "-"),
                         f.get("dtype", point[-1]), f.get("redop", "sum"), path,
                         *(c for p in _PLACEMENTS for c in _placement_cells(by_place.get(p), notes))])
        headers = [*lead, "size (B)", "count", "type", "redop", "path"]
        for p in ("oop", "ip"):
            headers += [f"{p} time (us)", "±", "algbw (GB/s)", "busbw (GB/s)", "#wrong"]
        where = (f"{capture or '-'}, {world if world is not None else '?'} rank(s)"
                 + (f" ({backend})" if backend else ""))
        head = f"{title} {where}" if not markdown else f"{title} — {where}"
        table = tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)
        foot = "".join(f"\n[{i}] {n}" + ("  " if markdown else "") for i, n in enumerate(notes, 1))
        foot += "".join(f"\nnot run: {path}: {why}" + ("  " if markdown else "") for path, why in absent.items())
        parts.append(f"{head}\n{table}{foot}")
    return "\n\n".join(parts)


def json_key(v: Any) -> Any:
    return v if isinstance(v, (int, float, str)) or v is None else str(v)


CSV_FIELDS = ["case", "axes", "variant", "device", "status", "reason", "median_s", "mean_s", "min_s", "p20_s",
              "p80_s", "rel_noise", "tick_s", "count", "stop_reason", "mode", "bytes", "flops", "gbps", "tflops",
              "pct_of_floor", "floor_source", "vs_baseline_ratio", "vs_baseline_lo", "vs_baseline_hi",
              "vs_baseline_label", "derived"]


def render_table(rows: list[list[Any]], head: list[str], fmt: str) -> str:
    """``rows`` under ``head`` as text, a GitHub table (markdown) or CSV."""
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(head)
        w.writerows(rows)
        return buf.getvalue()
    return tabulate(rows, head, tablefmt="github" if fmt == "markdown" else "simple") + "\n"


def render_csv(records: Iterable[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_FIELDS)
    for r in records:
        # a record failed in a later --repeat pass keeps its earlier timing in the file: as in
        # the tables, a row that is not OK shows none of it
        ok = r["status"] == "OK"
        t = (r.get("timing") or {}) if ok else {}
        s = t.get("summary") or {}
        vb = (r.get("vs_baseline") or {}) if ok else {}
        m = r if ok else {}
        w.writerow([r["case"], " ".join(f"{k}={v}" for k, v in r["axes"].items()), r["variant"], r.get("device"),
                    r["status"], r.get("reason") or "", s.get("median"), s.get("mean"), s.get("min"), s.get("p20"),
                    s.get("p80"), s.get("rel_noise"), s.get("tick"), s.get("count"), t.get("stop_reason"),
                    t.get("mode"), r.get("bytes"), r.get("flops"), m.get("gbps"), m.get("tflops"),
                    m.get("pct_of_floor"), m.get("floor_source"), vb.get("ratio"), vb.get("lo"), vb.get("hi"),
                    vb.get("label"),
                    "; ".join(f"{k}={v}" for k, v in (r.get("derived") or {}).items())])
    return buf.getvalue()
