"""The step-time budget (:mod:`microbench.budget`) as a table: µs per rank per component,
decode and verify, eager and graph, each line's sources numbered under it, then the
throughput summary."""

from __future__ import annotations

import math

from microbench.budget import MODES, PHASES, Budget, Line


def fmt_us(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    us = seconds * 1e6
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


# --------------------------------------------------------------------------- the table


def render(b: Budget, fmt: str = "text", modes: tuple[str, ...] = MODES) -> str:
    """The budget as a table (µs per rank), the step totals and the throughput summary;
    each line's sources are numbered under the table."""
    from tabulate import tabulate

    s = b.scenario
    tablefmt = "github" if fmt == "markdown" else "simple"
    cols = [(p, m) for p in PHASES for m in modes]
    notes: list[str] = []

    def ref(line: Line) -> str:
        out = []
        for c in line.cells.values():
            if c.source not in notes:
                notes.append(c.source)
            tag = f"[{notes.index(c.source) + 1}]"
            if tag not in out:
                out.append(tag)
        return " ".join(out)

    def row(name, scope, launches, values, source=""):
        return [name, scope, launches, *(fmt_us(v) for v in values), source]

    rows = []
    for group, key in ((b.moe_layer, "moe layer"), (b.dense_layer, "dense layer")):
        if not group:  # a model with no dense layer
            continue
        for x in group:
            if key == "dense layer" and x.name != "dense MLP" and not x.name.startswith("launches"):
                continue  # the attention half is the MoE layer's, line for line
            rows.append(row(x.name, x.scope, f"{x.launches['decode']}/{x.launches['verify']}",
                            [x.seconds(p, m) for p, m in cols], ref(x)))
        launches = {p: sum(x.launches[p] for x in group[:-1]) for p in PHASES}
        label = "= MoE layer" if key == "moe layer" else "= dense layer (attention as above + dense MLP)"
        rows.append(row(label, "", f"{launches['decode']}/{launches['verify']}", [b.totals[key][c] for c in cols]))
        if key == "moe layer" and b.measured_layer:
            meas = Line("measured layer (layer.decoder, one rank)", "MoE layer", {p: 0 for p in PHASES},
                        dict(b.measured_layer))
            rows.append([meas.name, meas.scope, "", *(fmt_us(b.measured_layer[c].seconds) if c in b.measured_layer
                                                      else "-" for c in cols), ref(meas)])
            rows.append(["model of it (allreduces as its stand-ins)", "MoE layer", "",
                         *(fmt_us(b.model_as_measured[c]) for c in cols), ""])
            rows.append(["model / measured - 1", "", "",
                         *("-" if b.model_error(*c) is None else f"{100 * b.model_error(*c):+.0f}%" for c in cols),
                         ""])
    m = s.model
    rows.append(row(f"x {m.n_moe_layers} MoE layers", "step", "", [m.n_moe_layers * b.totals["moe layer"][c]
                                                                    for c in cols]))
    if m.n_dense_layers:
        rows.append(row(f"x {m.n_dense_layers} dense layer(s)", "step", "",
                        [m.n_dense_layers * b.totals["dense layer"][c] for c in cols]))
    for x in b.step:
        rows.append(row(x.name, x.scope, f"{x.launches['decode']}/{x.launches['verify']}",
                        [x.seconds(p, mm) for p, mm in cols], ref(x)))
    rows.append(row("= step", "", "", [b.totals["step"][c] for c in cols]))
    headers = ["component", "per", "launches d/v", *(f"{p} {mm} (us)" for p, mm in cols), "source"]
    table = tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)
    head = (f"step-time model: {m.name} at TP{s.layout.tp}" + (f" EP{s.layout.ep}" if s.layout.ep > 1 else "")
            + f" on {s.hw.name} ({s.hw.interconnect['kind']}), per rank; batch {s.batch}, context {s.context}; "
            f"verify scores {s.draft_tokens} draft tokens + 1 per request (T = {s.tokens('verify')}); "
            f"verify attention kernel {s.attention}, MoE kernel {s.moe}, routed weights {m.quant.routed_experts}")
    summ = []
    for mm in modes:
        x = b.summary(mm)
        summ.append([mm, fmt_us(x["decode_step_s"]), f"{x['decode_tok_s']:,.1f}", fmt_us(x["draft_s"]),
                     fmt_us(x["verify_step_s"]), f"{s.accept_len:g}", f"{x['spec_tok_s']:,.1f}",
                     f"{x['speedup']:.2f}x", f"{x['break_even_accept_len']:.2f}"])
    summary = tabulate(summ, headers=["mode", "decode step (us)", "decode tok/s", "draft (us)", "verify step (us)",
                                      "accept len", "spec tok/s", "spec / decode", "break-even accept len"],
                       tablefmt=tablefmt, disable_numparse=True)
    nl = "  \n" if fmt == "markdown" else "\n"
    foot = nl.join(f"[{i}] {n}" for i, n in enumerate(notes, 1))
    extra = nl.join([*b.notes, *(layer_replay_lines(b) if "graph" in modes else [])])
    return f"{head}\n\n{table}\n{foot}\n\n{summary}\n{extra}\n"


#: The layer's speed target: under graph replay the composed layer takes at most this many
#: times the sum of its kernels measured alone.
LAYER_REPLAY_BAR = 1.2


def layer_replay_lines(b: Budget) -> list[str]:
    """With a measured verify layer under graph replay: the measured layer over the model
    of it (the sum of its kernels, each priced alone: measured where the results have it,
    else its roofline line), against the verify layer's :data:`LAYER_REPLAY_BAR`."""
    error = b.model_error("verify", "graph")
    if error is None:
        return []
    ratio = 1.0 / (1.0 + error)
    return [f"layer under graph replay, verify: measured {fmt_us(b.measured_layer[('verify', 'graph')].seconds)} us "
            f"= {ratio:.2f}x the sum of its kernels priced alone ({fmt_us(b.model_as_measured[('verify', 'graph')])} "
            f"us; the lines' sources above say which were measured): "
            f"{'within' if ratio <= LAYER_REPLAY_BAR else 'over'} the {LAYER_REPLAY_BAR:g}x target "
            f"(one measurement against a model: no interval)"]
