"""Pictures (matplotlib, the optional ``plots`` extra): a step budget as stacked bars, and
time against token count per kernel variant from a result file. Both write PNGs."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

#: the axis a "time vs tokens" plot runs along, per case family (first one present wins)
TOKEN_AXES = ("draft_tokens", "tokens")


class PlotError(RuntimeError):
    """Plots cannot be made here (matplotlib missing, nothing to plot): one line for the user."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a GPU host
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotError(f"plots need matplotlib ({e}); install microbench[plots]") from None
    return plt


def budget_components(b: Any) -> "OrderedDict[str, dict[tuple[str, str], float]]":
    """Seconds per step of each component, per (phase, mode): MoE-layer lines x MoE
    layers + dense-layer lines x dense layers + once-per-step lines, same names merged."""
    m = b.scenario.model
    out: OrderedDict[str, dict[tuple[str, str], float]] = OrderedDict()
    for lines, times in ((b.moe_layer, m.n_moe_layers), (b.dense_layer, m.n_dense_layers), (b.step, 1)):
        for x in lines:
            name = "launches exposed (eager)" if x.name.startswith("launches") else x.name
            slot = out.setdefault(name, {})
            for key, cell in x.cells.items():
                slot[key] = slot.get(key, 0.0) + times * cell.seconds
    return out


def plot_budget(b: Any, path: str) -> str:
    """Stacked bars of one step per rank: decode and verify, eager and graph."""
    plt = _pyplot()
    kind = os.path.splitext(path)[1].lstrip(".").lower()
    known = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if kind not in known:
        raise PlotError(f"--plot {path}: the file name's extension says which picture to write: "
                        f"one of {', '.join(sorted(known))}")
    comps = budget_components(b)
    bars = [("decode", "eager"), ("decode", "graph"), ("verify", "eager"), ("verify", "graph")]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    bottom = [0.0] * len(bars)
    cmap = plt.get_cmap("tab20")
    for i, (name, cells) in enumerate(comps.items()):
        ms = [cells.get(k, 0.0) * 1e3 for k in bars]
        ax.bar(range(len(bars)), ms, bottom=bottom, label=name, color=cmap(i % 20))
        bottom = [a + c for a, c in zip(bottom, ms)]
    ax.set_xticks(range(len(bars)), [f"{p}\n{m}" for p, m in bars])
    ax.set_ylabel("ms per step (one rank)")
    s = b.scenario
    ax.set_title(f"{s.model.name} TP{s.layout.tp} on {s.hw.name}: batch {s.batch}, context {s.context}, "
                 f"{s.draft_tokens} draft tokens", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_results(doc: dict[str, Any], out_dir: str) -> list[str]:
    """One PNG per case that has a token axis: median time against it, a line per variant
    and value of the other axes (log-log). Returns the paths written."""
    plt = _pyplot()
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:  # a file of that name, a place that cannot be written
        raise PlotError(f"--plot {out_dir}: cannot make a directory there ({e.strerror or e})") from None
    by_case: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
    for r in doc["records"]:
        if r.get("status") == "OK" and r.get("timing") and any(a in r["axes"] for a in TOKEN_AXES):
            by_case.setdefault(r["case"], []).append(r)
    if not by_case:
        raise PlotError("no OK record with a token axis (draft_tokens, tokens) to plot")
    paths = []
    for case, recs in by_case.items():
        axis = next(a for a in TOKEN_AXES if a in recs[0]["axes"])
        series: OrderedDict[str, list[tuple[float, float]]] = OrderedDict()
        for r in recs:
            rest = " ".join(f"{k}={v}" for k, v in r["axes"].items() if k != axis)
            series.setdefault(f"{r['variant']} {rest}".strip(), []).append(
                (r["axes"][axis], r["timing"]["summary"]["median"] * 1e6))
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(axis)
        ax.set_ylabel("median time (us)")
        ax.set_title(f"{case} ({doc['run'].get('device')})", fontsize=10)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        path = os.path.join(out_dir, f"{case.replace('.', '_')}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
