"""A point's records pooled over the passes of ``run --repeat R``: each later pass's
samples join the first pass's record, so a record's samples span the run rather than one
moment (:meth:`microbench.runner.Runner.run`)."""

from __future__ import annotations

from typing import Any

from microbench import stats


def later_variants(first: list[dict[str, Any]]) -> set[str]:
    """The variants a later pass runs at a point: those OK in its first pass. One that
    failed or was skipped there has no record to pool into, so running it again would
    spend its set-up and budget on samples that are thrown away."""
    return {r["variant"] for r in first if r["status"] == "OK"}


def merge_pass(old: list[dict[str, Any]], new: list[dict[str, Any]], k: int) -> None:
    """Pool pass ``k``'s records (of :func:`later_variants`) into the first pass's, by
    variant. A variant that fails in pass ``k`` fails (its earlier figures go with it); one
    SKIPPED there keeps what it pooled, with a note; a pass's notes (a --deadline-s cut)
    join the record's, and ``timing.budget_s`` is the least budget any pass had."""
    by = {r["variant"]: r for r in new}
    for o in old:
        n = by.get(o["variant"])
        if o["status"] != "OK" or n is None:
            continue
        t = o["timing"]
        if n["status"] == "SKIPPED":  # a later skip (a path gone) takes nothing back
            note = f"pass {k + 1} skipped: {n.get('reason')}"
            t["notes"] = [*t.get("notes", []), note]
            continue
        if n["status"] != "OK":
            # its rates go with it: a FAILED row shows no figure of a pass that ran before
            o.update(status="FAILED", reason=f"pass {k + 1}: {n['reason']}", gbps=None, tflops=None,
                     pct_of_floor=None, floor_s=None, floor_source=None)
            continue
        nt = n["timing"]
        t.setdefault("passes", [len(t["samples_s"])]).append(len(nt["samples_s"]))
        t["samples_s"] = t["samples_s"] + nt["samples_s"]
        t["summary"] = stats.summarize(t["samples_s"], t.get("resolution_s") or 0.0).to_dict()
        t["elapsed_s"] += nt["elapsed_s"]
        t["warmup_s"] = t.get("warmup_s", 0.0) + nt.get("warmup_s", 0.0)
        t["notes"] = [*t.get("notes", []), *(x for x in nt.get("notes", []) if x not in t.get("notes", []))]
        budgets = [b for b in (t.get("budget_s"), nt.get("budget_s")) if b is not None]
        if budgets:
            t["budget_s"] = min(budgets)
        # interleaved, a pass in which a variant failed rotated its order over fewer (1: not interleaved)
        t.setdefault("rotations", [t.get("rotation", 1)]).append(nt.get("rotation", 1))
        o["prep_s"] = (o.get("prep_s") or 0.0) + (n.get("prep_s") or 0.0)
        t.setdefault("stop_reasons", [t["stop_reason"]]).append(nt["stop_reason"])
        t["stop_reason"] = nt["stop_reason"] if nt["stop_reason"] != "noise" else t["stop_reason"]
        if o.get("probe") and n.get("probe"):
            pooled = o["probe"]["samples_s"] + n["probe"]["samples_s"]
            o["probe"] = {**o["probe"], "samples_s": pooled, "median_s": stats.summarize(pooled).median}
        if n.get("clocks"):
            o.setdefault("clocks_passes", []).append(n["clocks"])
        if n.get("ranks"):
            o.setdefault("ranks_passes", []).append(n["ranks"])
