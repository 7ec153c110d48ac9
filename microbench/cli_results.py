"""``microbench compare`` and ``microbench report``: the commands that read result files."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Sequence

from microbench.cli import UsageError, _split, min_effect_arg


def _load(path: str) -> dict[str, Any]:
    from microbench.results import ResultError, load

    try:
        return load(path)
    except ResultError as e:
        raise UsageError(str(e)) from None


def _selected(a: argparse.Namespace, docs: list[dict[str, Any]],
              also_base: Sequence[str] = ()) -> list[dict[str, Any]]:
    """``--case`` / ``--variant`` / ``--axis`` applied to the loaded result files;
    ``also_base``: variants the first (base) file keeps besides (``--map-variant`` sources)."""
    from microbench.cli import _axis_picks
    from microbench.results import ResultError, select

    cases, variants, axes = _split(a.case), _split(a.variant), _axis_picks(a.axis)
    if not (cases or variants or axes):
        return docs
    extra = [v for v in also_base if v not in variants] if variants else []
    try:
        out = select(docs, cases, [*variants, *extra], axes, parse=_parse_axis)
    except ResultError as e:
        raise UsageError(str(e)) from None
    for d in out[1:]:  # a mapped source is the base's alone: the new file's is not compared
        d["records"] = [r for r in d["records"] if r["variant"] not in extra]
    return out


def _parse_axis(case_id: str, axis: str, text: str) -> Any:
    """An axis value as ``run --axis`` reads it for that case (``bytes=1K`` is 1024)."""
    from microbench.cases import get_case

    return get_case(case_id).parse_axis_value(axis, text)


def cmd_report(a: argparse.Namespace) -> int:
    from microbench import report

    (doc,) = _selected(a, [_load(a.result)])
    print(report.render(doc, a.format), end="")
    if a.plot:
        from microbench.plots import PlotError, plot_results

        try:
            for path in plot_results(doc, a.plot):
                print(f"plot: {path}", file=sys.stderr)
        except PlotError as e:
            raise UsageError(str(e)) from None
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    from microbench import compare

    mapping = {}
    for item in a.map_variant or []:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise UsageError(f"--map-variant {item!r}: expected BASE_VARIANT=NEW_VARIANT")
        mapping[old] = new
    if a.per_floor and (a.relative or a.probe_correct):
        raise UsageError(f"--per-floor and {'--relative' if a.relative else '--probe-correct'} are two different "
                         "normalisations: choose one")
    sources = [src for src, dst in mapping.items() if dst in _split(a.variant)]
    docs = [_load(a.base), _load(a.new)]
    sides = (("base", a.base, docs[0], mapping.keys()), ("new", a.new, docs[1], mapping.values()))
    for side, path, doc, names in sides:
        held = {r["variant"] for r in doc["records"]}
        missing = [v for v in names if v not in held]
        if missing:
            raise UsageError(f"--map-variant: {path} ({side}) holds no variant {', '.join(missing)} "
                             f"(its variants: {', '.join(sorted(held))})")
    base, new = _selected(a, docs, also_base=sources)
    result = compare.compare_runs(base, new, min_effect=a.min_effect, variant_map=mapping, quantile=a.stat,
                                  probe_correct=a.probe_correct, relative=a.relative, per_floor=a.per_floor)
    print(compare.render(result, a.format), end="")
    if not result["rows"]:  # a gate on "no SLOWER" must not pass on files that share nothing
        raise UsageError(f"no point (case, axes, variant) is in both {a.base} and {a.new}: nothing was compared")
    failing = {"slower": "SLOWER", "broken": "BROKEN"}
    if any(row["label"] == failing[f] for f in a.fail_on or [] for row in result["rows"]):
        return 1
    if "broken" in (a.fail_on or []) and result["only_base"] and not new["run"].get("complete", True):
        # a run that crashed half-way has no row for the points it never reached
        print(f"compare: {len(result['only_base'])} point(s) of {a.base} are missing from {a.new}, an incomplete "
              "run (interrupted or crashed): broken", file=sys.stderr)
        return 1
    return 0


def cmd_targets(a: argparse.Namespace) -> int:
    from microbench import targets

    doc = _load(a.result)
    try:
        stated, whose = targets.bars(doc, a.bars)
    except ValueError as e:
        raise UsageError(f"{a.result}: {e}") from None
    # --variant keeps what a kept variant is measured against: the references of the
    # targets of the cases --case keeps, where the file holds them
    (scoped,) = _selected(argparse.Namespace(case=a.case, variant=None, axis=None), [doc])
    refs = ({t.ref for ts in stated.values() for t in ts if t.ref}
            & {r["variant"] for r in scoped["records"]})
    (doc,) = _selected(a, [doc], also_base=sorted(refs))
    held = {r["case"] for r in doc["records"]}
    wanted = {cid: ts for cid, ts in stated.items() if cid in held}
    if a.variant:  # the bars of the variants asked for
        keep = _split(a.variant)
        wanted = {cid: [dataclasses.replace(t, variants=tuple(v for v in t.variants if v in keep))
                        for t in ts if set(t.variants) & set(keep)] for cid, ts in wanted.items()}
        wanted = {cid: ts for cid, ts in wanted.items() if ts}
        if not wanted:
            print(f"no speed target is stated for {', '.join(keep)} in {a.result} (targets' variants: "
                  + ", ".join(sorted({v for ts in stated.values() for t in ts for v in t.variants})) + ")")
            return 0
    if not wanted:
        print(f"no case in {a.result} states a speed target (cases that do: {', '.join(stated) or 'none'})")
        return 0
    rows = targets.evaluate(wanted, doc, selected=bool(a.case or a.variant or a.axis))
    print(targets.render(doc, rows, a.format, whose), end="")
    if a.fail_on == "missed" and any(r["verdict"] == "MISSED" for r in rows):
        return 1
    return 0


def _quantile(text: str) -> float:
    if text == "median":
        return 0.5
    try:
        q = float(text[1:]) / 100 if text.startswith("p") else float("nan")
    except ValueError:
        q = float("nan")
    if not 0 < q < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use median or pN with 0 < N < 100 (e.g. p5)")
    return q


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--case", action="append", metavar="ID", help="only these cases: ids or dotted prefixes "
                   "(moe = every moe.* case), comma-separated or repeated")
    p.add_argument("--variant", action="append", metavar="NAME", help="only these variants, comma-separated or "
                   "repeated")
    p.add_argument("--axis", action="append", metavar="NAME=V1,V2", help="only the points whose axis NAME has "
                   "one of these values (repeatable: every axis given must match)")


def add_parsers(sub: Any) -> None:
    c = sub.add_parser("compare", help="verdicts between two result files (FASTER/SLOWER/SAME/UNSURE)")
    c.add_argument("base")
    c.add_argument("new")
    c.add_argument("--format", choices=["text", "markdown"], default="text")
    c.add_argument("--min-effect", type=min_effect_arg, default=0.02, help="smallest ratio change called real (default 2%%)")
    c.add_argument("--fail-on", choices=["slower", "broken"], action="append",
                   help="exit 1 when any point is SLOWER (slower), or OK in base and FAILED or SKIPPED in new, "
                        "or missing from a new run that did not finish (broken); repeatable")
    c.add_argument("--stat", type=_quantile, metavar="median|pN",
                   help="statistic compared: median (default) or a percentile like p5")
    c.add_argument("--relative", action="store_true",
                   help="compare each variant's paired ratio to its baseline (runs made with --interleave): "
                        "robust to the machine moving between runs")
    c.add_argument("--per-floor", action="store_true",
                   help="compare each time over its record's floor (its own run's ceilings) instead of the time: "
                        "runs on different GPUs compare in efficiency (not with --relative or --probe-correct)")
    c.add_argument("--probe-correct", action="store_true",
                   help="divide each ratio by the environment probe's ratio between the runs")
    c.add_argument("--map-variant", action="append", metavar="BASE=NEW",
                   help="compare variant BASE of the base run with variant NEW of the new run")
    _add_selection(c)
    c.set_defaults(func=cmd_compare)

    rep = sub.add_parser("report", help="print a result file's tables")
    rep.add_argument("result")
    rep.add_argument("--format", choices=["text", "markdown", "csv"], default="text")
    rep.add_argument("--plot", metavar="DIR", help="also draw time vs token count per variant, a PNG per case "
                     "(matplotlib)")
    _add_selection(rep)
    rep.set_defaults(func=cmd_report)

    tg = sub.add_parser("targets", help="a result file against the speed targets its cases state (MET/MISSED/UNSURE)",
                        description="Each speed target a case states (a bar at some of its points: a speed-up over "
                                    "another variant, a time ratio, a fraction of the floor), read against a result "
                                    "file: one row per variant and point, with the measured value, its 95% interval "
                                    "and a verdict (MET / MISSED: the whole interval on that side of the bar; "
                                    "UNSURE: it straddles the bar; NO TIME: the point ran but has no time).")
    tg.add_argument("result", help="a result file (.json, or .json.gz)")
    tg.add_argument("--format", choices=["text", "markdown", "csv"], default="text")
    tg.add_argument("--fail-on", choices=["missed"], help="exit 1 when any row is MISSED")
    tg.add_argument("--bars", choices=["run", "code"],
                    help="read the bars the run stored as it began (run: the default where the file holds them) "
                         "or those today's code states (code: the default for a file written before runs stored "
                         "them); a line under the table says which, and names the cases where the two differ")
    _add_selection(tg)
    tg.set_defaults(func=cmd_targets)
