"""``microbench compare BASE NEW``: is a difference code, noise, or environment?

Records are matched by case id, axis values and variant. Each matched pair gets a verdict
from its raw samples (:func:`microbench.verdicts.compare_samples`): the ratio new/base of the
medians with a bootstrap confidence interval, corrected by the environment probe timed
beside each point in both runs when both have it. Then an environment section lists every
difference able to explain a change without any code changing: the SM clock during a case
(NVML), throttle reasons, temperature, power limit, the GPU, driver and library versions,
the git commit — so "slower" is never said before "the clocks differ".
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from tabulate import tabulate

from microbench import stats, verdicts
from microbench.report import fmt_time, sig
from microbench.results import record_key
from microbench.wander import block_wander

#: A mean SM clock differing by more than this between runs can explain a change alone.
CLOCK_TOLERANCE = 0.02
#: Temperatures further apart than this (°C) are worth a line: boost clocks follow them.
TEMPERATURE_TOLERANCE_C = 10.0
#: Throttle reasons that say nothing about slowdown.
BENIGN_REASONS = {"gpu_idle", "none", "applications_clocks_setting"}

#: Fingerprint fields whose difference alone can move timings: (label, path in the fingerprint).
ENV_FIELDS: list[tuple[str, tuple[str, ...]]] = [
    ("GPU model", ("device", "name")),
    ("GPU UUID", ("device", "uuid")),
    ("compute capability", ("device", "compute_capability")),
    ("driver", ("device", "driver_version")),
    ("CUDA runtime", ("device", "cuda_runtime_version")),
    ("power limit (W)", ("nvml", "gpu", "power_limit_w")),
    ("SM clock max (MHz)", ("nvml", "gpu", "sm_clock_max_mhz")),
    ("persistence mode", ("nvml", "gpu", "persistence_mode")),
    # the link's maximum, not its current state: an idle GPU trains its link down (Gen1 at
    # rest is common), so the current one, read when the run starts, differs for no cause
    ("PCIe gen (max)", ("nvml", "gpu", "pcie_gen_max")),
    ("PCIe width (max)", ("nvml", "gpu", "pcie_width_max")),
    ("torch", ("software", "torch")),
    ("triton", ("software", "triton")),
    ("NCCL", ("software", "nccl")),
    ("CuPy", ("software", "cupy")),
    ("python", ("software", "python")),
    ("TRITON_INTERPRET", ("software", "triton_interpret")),
    ("git commit", ("git", "commit")),
    ("git dirty", ("git", "dirty")),
    ("host", ("host", "hostname")),
    ("CPU model", ("host", "cpu_model")),
]


#: Run settings whose difference alone can move timings: (label, path in the run).
RUN_FIELDS: list[tuple[str, tuple[str, ...]]] = [
    ("device", ("device",)),
    ("ranks", ("world", "world_size")),
    ("backend", ("world", "backend")),
    ("CPU threads", ("cpu_threads",)),
    ("interleaved", ("interleave",)),
    ("timing mode", ("timing", "mode")),
    ("input seed", ("seed",)),
]


def _get(d: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, Mapping) or k not in d:
            return None
        d = d[k]
    return d


def _probe_samples(r: Mapping[str, Any]) -> tuple[int | None, list[float] | None]:
    p = r.get("probe") or {}
    return p.get("version"), p.get("samples_s")


def _clock_mean(r: Mapping[str, Any]) -> float | None:
    return _get(r.get("clocks") or {}, ("sm_clock_mhz", "mean"))


def _reasons(r: Mapping[str, Any]) -> set[str]:
    return set((r.get("clocks") or {}).get("throttle_reasons") or []) - BENIGN_REASONS


def _relative_series(r: Mapping[str, Any], index: Mapping[tuple, Mapping[str, Any]]) -> tuple[Any, Any, float] | str:
    """Per-round ratios of a record to its point's baseline record (an interleaved run;
    one per whole rotation where its order rotated), with the pass boundaries and the two
    records' half-ticks together (how far the ratios' median may lie off from their
    timers' ticks alone); or the reason there are none."""
    if r["variant"] == r.get("baseline"):
        return "the baseline itself"
    base = index.get(record_key({**r, "variant": r.get("baseline")}))
    if base is None or base["status"] != "OK" or not base.get("timing"):
        return "no baseline record at this point"
    if (not base["timing"].get("interleaved", False)
            or len(base["timing"]["samples_s"]) != len(r["timing"]["samples_s"])):
        return "not an interleaved run (run with --interleave for paired ratios)"
    ratios, passes = verdicts.paired_ratios(base["timing"]["samples_s"], r["timing"]["samples_s"],
                                            verdicts.rotations(r["timing"]), r["timing"].get("passes"))
    if not ratios.size:
        return "not one whole rotation of the interleaved order (a run cut short)"
    return list(ratios), passes, stats.timing_half_tick(base["timing"]) + stats.timing_half_tick(r["timing"])


def _per_floor(b: Mapping[str, Any], n: Mapping[str, Any]) -> tuple[float, float] | str:
    """Each record's floor (seconds at its run's ceilings), or why the pair has none."""
    fb, fn = b.get("floor_s"), n.get("floor_s")
    if not (isinstance(fb, (int, float)) and fb > 0 and isinstance(fn, (int, float)) and fn > 0):
        return "per floor: no floor for this point (no bytes or FLOPs, or no ceiling in a run)"
    return float(fb), float(fn)


def _pair(b: Mapping[str, Any], n: Mapping[str, Any], min_effect: float, quantile: float,
          probe_correct: bool, relative: tuple[Mapping, Mapping] | None = None,
          pooled: tuple[float, int] | None = None, per_floor: bool = False, same_run: bool = True) -> dict[str, Any]:
    """One matched pair's row. ``pooled``: the run's typical wander, used when this
    record's own could not be estimated (too few samples for two blocks). ``per_floor``:
    each sample divided by its record's floor first (time over the roofline of its own
    run's ceilings), so runs on different GPUs compare in efficiency, not in time."""
    row: dict[str, Any] = {"case": n["case"], "axes": n["axes"], "variant": n["variant"],
                           "base_time": None, "new_time": None, "label": "n/a", "notes": []}
    if b["status"] != "OK" or n["status"] != "OK":
        row["label"] = "BROKEN" if b["status"] == "OK" else f"{b['status']}->{n['status']}"
        row["notes"].append(n.get("reason") or b.get("reason") or "")
        for side, r in (("base_time", b), ("new_time", n)):  # the side that was timed keeps its time
            if r["status"] == "OK":
                row[side] = float(np.quantile(r["timing"]["samples_s"], quantile))
        return row
    bs, ns = b["timing"]["samples_s"], n["timing"]["samples_s"]
    bpass, npass = b["timing"].get("passes"), n["timing"].get("passes")
    (bv, bp), (nv, np_) = _probe_samples(b), _probe_samples(n)
    probes = bool(bp and np_ and bv == nv)
    if bp and np_ and bv != nv:
        row["probe_versions"] = [bv, nv]
    if per_floor:
        floors = _per_floor(b, n)
        if isinstance(floors, str):
            row["notes"].append(floors)
            return row
        bs, ns = [x / floors[0] for x in bs], [x / floors[1] for x in ns]
        probes = False  # the probe's move between two GPUs is the difference the floors take out
        kinds = {"measured" if "in this run" in str(r.get("floor_source")) else "datasheet" for r in (b, n)}
        if len(kinds) > 1:
            row["notes"].append("floors from a measured ceiling on one side, a datasheet on the other")
    row["base_time"], row["new_time"] = float(np.quantile(bs, quantile)), float(np.quantile(ns, quantile))
    # each side's half-tick over its statistic: relative, so per floor it is its time's
    ticks = (stats.timing_half_tick(b["timing"], quantile), stats.timing_half_tick(n["timing"], quantile))
    if relative is not None:
        sb, sn = _relative_series(b, relative[0]), _relative_series(n, relative[1])
        if isinstance(sb, str) or isinstance(sn, str):
            row["notes"].append(f"relative: {sb if isinstance(sb, str) else sn}")
            return row
        (bs, bpass, tb), (ns, npass, tn) = sb, sn
        ticks, probes = (tb, tn), False
        if (b["timing"].get("rotation", 1) > 1) != (n["timing"].get("rotation", 1) > 1):
            row["notes"].append("interleaved order rotated on one side only (a file from before rotation): "
                                "a call's place in its round may show in the ratio")
    # each side's wander; a side too short to show its own takes the run's typical one
    sides = [block_wander(bs, bpass), block_wander(ns, npass)]
    own_df = sides[0][1] + sides[1][1]
    row["short"] = not all(d for _, d in sides)  # a side without its own wander: the run's is lent
    wander, df = math.hypot(sides[0][0], sides[1][0]), own_df
    if pooled is not None and row["short"]:
        # the run's typical wander is a pair's (both sides together): half its variance a side
        lent = [(pooled[0] / math.sqrt(2), pooled[1]) if not d else (w, d) for w, d in sides]
        wander, df = math.hypot(lent[0][0], lent[1][0]), max(d for _, d in lent)
        row["notes"].append(f"too few samples to see its own wander: the run's typical ±{100 * pooled[0]:.1f}% used")
    if probes and probe_correct:
        # dividing by the probe's move brings in the probe's own wander too
        (pb, pdb), (pn, pdn) = block_wander(bp), block_wander(np_)
        wander, df = math.sqrt(wander ** 2 + pb ** 2 + pn ** 2), df + pdb + pdn
    env = float(np.median(np_) / np.median(bp)) if probes else None
    # an uncorrected probe move bounds what the machine alone could have done to this case
    shift = abs(math.log(env)) if env and not probe_correct else 0.0
    v = verdicts.compare_samples(bs, ns, min_effect=min_effect, env_sigma=wander, env_df=df, quantile=quantile,
                              base_probe=bp if probes and probe_correct else None,
                              new_probe=np_ if probes and probe_correct else None, env_shift=shift,
                              half_ticks=ticks, identical_is_same=same_run)
    row.update(label=v.label, ratio=v.ratio, lo=v.lo, hi=v.hi, raw_ratio=v.raw_ratio, env_ratio=env,
               wander=wander, wander_df=own_df, explain=v.explain())
    if wander > min_effect:
        row["notes"].append(f"wandered ±{100 * wander:.1f}% within a run")
    if env is not None and abs(env - 1) > min_effect and not probe_correct:
        moved = abs(v.raw_ratio - 1) > min_effect and (v.raw_ratio > 1) == (env > 1)
        row["notes"].append(f"environment {100 * (env - 1):+.1f}%" + (", this case moved with it" if moved else ""))
    if b["timing"].get("mode") != n["timing"].get("mode"):
        row["notes"].append(f"timing mode {b['timing'].get('mode')} vs {n['timing'].get('mode')}")
    cb, cn = _clock_mean(b), _clock_mean(n)
    if cb and cn and abs(cn / cb - 1) > CLOCK_TOLERANCE:
        row["notes"].append(f"SM clock {cb:.0f}->{cn:.0f} MHz ({100 * (cn / cb - 1):+.1f}%)")
    thr = _reasons(b) | _reasons(n)
    if thr:
        row["notes"].append("throttled: " + ", ".join(sorted(thr)))
    return row


def compare_runs(base: Mapping[str, Any], new: Mapping[str, Any], *, min_effect: float = 0.02,
                 variant_map: Mapping[str, str] | None = None, quantile: float | None = None,
                 probe_correct: bool = False, relative: bool = False, per_floor: bool = False) -> dict[str, Any]:
    """Match records and give each pair a verdict; collect the environment differences.

    ``quantile``: the statistic compared (default the median). ``probe_correct``: divide
    each ratio by the environment probe's ratio. Off by default: on a shared 2-core CPU
    machine the probe and a case did not move together (over 14 A/A pairs the corrected
    ratio was further from 1 than the raw one in 10), so the probe explains, and two
    things widen the interval: the record's own wander over time
    (:func:`microbench.wander.block_sigma`; for a record too short to estimate it, the
    median wander of the run's other records), and the probe's move between the runs (a
    case is not corrected by it, but a change no larger than it is not called code).

    ``relative``: compare each variant's per-round ratio to its point's baseline variant
    (runs made with ``--interleave``; merged per whole rotation of the order,
    :func:`microbench.verdicts.paired_ratios`) instead of its absolute time. Both sides of a round
    meet the same machine state, so what moves the machine cancels and what is left is the
    change of this variant relative to an unchanged baseline: on a 2-core machine whose
    absolute times wandered ±15% between runs, the paired ratio held to about ±0.5%.

    ``per_floor``: compare each record's time over its floor (the roofline at its own
    run's ceilings, measured in that run where it calibrated) instead of its time: for two
    runs on different GPUs (an H100 and an H200: 3.35 and 4.8 TB/s), a memory-bound kernel
    that keeps its % of floor reads SAME. Not with ``relative`` (its ratios need no floor)
    nor ``probe_correct`` (the probe's move between two GPUs is what the floors take out)."""
    if per_floor and (relative or probe_correct):
        raise ValueError(f"per_floor and {'relative' if relative else 'probe_correct'} are two different "
                         "normalisations: choose one")
    vmap = dict(variant_map or {})

    def key(r: Mapping[str, Any], side: str) -> tuple:
        if side == "base" and r["variant"] in vmap:
            r = {**r, "variant": vmap[r["variant"]]}
        return record_key(r)

    # a mapped comparison puts base's `old` where `new` was: base's own `new` steps aside
    bmap = {key(r, "base"): r for r in base["records"]
            if r["variant"] in vmap or r["variant"] not in vmap.values()}
    nmap = {key(r, "new"): r for r in new["records"]}
    q = 0.5 if quantile is None else quantile
    rel = (({record_key(r): r for r in base["records"]}, {record_key(r): r for r in new["records"]})
           if relative else None)
    keys = [k for k in nmap if k in bmap]
    # one run on both sides (a file with itself): equal samples are one measurement, SAME;
    # two runs whose quantised samples agree by chance are judged as any other pair
    same = base["run"].get("id") is not None and base["run"].get("id") == new["run"].get("id")
    rows = [_pair(bmap[k], nmap[k], min_effect, q, probe_correct, rel, per_floor=per_floor, same_run=same)
            for k in keys]
    # a record too short to show its own wander borrows the run's typical one (per side)
    seen = [(r["wander"], r["wander_df"]) for r in rows if r.get("wander_df") and not r.get("short")]
    if seen:
        pooled = (float(np.median([w for w, _ in seen])), int(min(d for _, d in seen)))
        rows = [_pair(bmap[k], nmap[k], min_effect, q, probe_correct, rel, pooled, per_floor, same)
                if r.get("short") else r for r, k in zip(rows, keys)]
    for row, k in zip(rows, keys):
        if vmap and bmap[k]["variant"] != nmap[k]["variant"]:
            row["variant"] = f"{bmap[k]['variant']}->{nmap[k]['variant']}"
    return {
        "rows": rows,
        "only_base": [_label(bmap[k]) for k in bmap if k not in nmap],
        "only_new": [_label(nmap[k]) for k in nmap if k not in bmap],
        "env": environment_diff(base, new, rows, min_effect),
        "quantile": q,
        "probe_correct": probe_correct,
        "relative": relative,
        "per_floor": per_floor,
        "base_run": base["run"].get("id"), "new_run": new["run"].get("id"),
        "min_effect": min_effect,
    }


def _label(r: Mapping[str, Any]) -> str:
    return f"{r['case']} {' '.join(f'{k}={v}' for k, v in r['axes'].items())} {r['variant']}"


def environment_diff(base: Mapping[str, Any], new: Mapping[str, Any], rows: list[dict[str, Any]],
                     min_effect: float = 0.02) -> list[str]:
    """Lines naming each difference that could explain a change without code; a probe's
    move or a run's wander counts from ``min_effect``, the size a verdict calls real."""
    out = []
    fb, fn = base.get("fingerprint") or {}, new.get("fingerprint") or {}
    sides = [(label, _get(fb, path), _get(fn, path)) for label, path in ENV_FIELDS]
    sides += [(label, _get(base["run"], path), _get(new["run"], path)) for label, path in RUN_FIELDS]
    for label, a, b in sides:
        if a != b and not (a is None and b is None):
            out.append(f"{label}: {a} -> {b}")
    clock_rows = [r for r in rows if any(n.startswith("SM clock") for n in r["notes"])]
    if clock_rows:
        out.append(f"SM clock differs by more than {100 * CLOCK_TOLERANCE:.0f}% in {len(clock_rows)} of "
                   f"{len(rows)} cases (see each row)")
    thr = sorted({n for r in rows for n in r["notes"] if n.startswith("throttled")})
    if thr:
        out.append(f"throttle reasons seen during cases: {'; '.join(t.split(': ', 1)[1] for t in thr)}")
    tb, tn = _max_temp(base), _max_temp(new)
    if tb is not None and tn is not None and abs(tn - tb) > TEMPERATURE_TOLERANCE_C:
        out.append(f"max GPU temperature during cases: {tb:.0f} -> {tn:.0f} °C")
    envs = [r["env_ratio"] for r in rows if r.get("env_ratio")]
    if envs:
        g = stats.geomean(envs)
        moved = abs(g - 1) > min_effect
        out.append(f"environment probe {'moved' if moved else 'steady'}: ×{g:.3f} (geomean over {len(envs)} points)")
    versions = sorted({tuple(r["probe_versions"]) for r in rows if r.get("probe_versions")}, key=str)
    if versions:
        pairs = ", ".join(f"{a} -> {b}" for a, b in versions)
        out.append(f"environment probe version differs ({pairs}): another workload, so no point is set beside "
                   "the environment's move")
    wand = [r["wander"] for r in rows if r.get("wander")]
    if wand and max(wand) > min_effect:
        out.append(f"timings wandered within the runs (up to ±{100 * max(wand):.1f}% between blocks of one "
                   "measurement): intervals are widened by it, so changes smaller than that read UNSURE")
    for side, doc in (("base", base), ("new", new)):
        if not doc["run"].get("complete", True):
            out.append(f"{side} run is incomplete (interrupted or crashed): only its finished cases compared")
    return out


def _max_temp(doc: Mapping[str, Any]) -> float | None:
    temps = [_get(r.get("clocks") or {}, ("temperature_c", "max")) for r in doc["records"]]
    temps = [t for t in temps if isinstance(t, (int, float))]
    return max(temps) if temps else None


def _cell_ratio(r: Mapping[str, Any]) -> str:
    if r.get("ratio") is None:
        return "-"
    return f"×{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"


def _cell_env(r: Mapping[str, Any]) -> str:
    e = r.get("env_ratio")
    return "-" if e is None or not math.isfinite(e) else f"×{e:.3f}"


def _cell_floor(x: float | None) -> str:
    """A time over its floor, as the % of floor tables show."""
    return "-" if x is None or not math.isfinite(x) or x <= 0 else f"{sig(100 / x)}%"


def render(result: Mapping[str, Any], fmt: str = "text") -> str:
    tablefmt = "github" if fmt == "markdown" else "simple"
    per_floor = result.get("per_floor", False)
    cell = _cell_floor if per_floor else fmt_time
    # a note on one line, and in markdown no `|` to end its cell early (an error's text may hold one)
    text = (lambda v: str(v).replace("\n", " ").replace("|", "\\|")) if fmt == "markdown" else \
        (lambda v: str(v).replace("\n", " "))
    rows = [[text(r["case"]), text(" ".join(f"{k}={v}" for k, v in r["axes"].items())), text(r["variant"]),
             cell(r["base_time"]), cell(r["new_time"]), _cell_ratio(r), _cell_env(r), r["label"],
             text("; ".join(n for n in r["notes"] if n))] for r in result["rows"]]
    q = result.get("quantile", 0.5)
    stat = "median" if q == 0.5 else f"p{100 * q:g}"
    unit = " (% floor)" if per_floor else ""
    headers = ["case", "axes", "variant", f"base {stat}{unit}", f"new {stat}{unit}", "new/base [95% CI]", "env",
               "verdict", "notes"]
    what = (f"the {stat} of each variant's per-round ratio to its baseline" if result.get("relative") else
            f"the {stat} of time over each record's floor (its run's ceilings)" if per_floor else f"the {stat}")
    head = (f"compare {result['base_run']} -> {result['new_run']}: ratio of {what}, min effect "
            f"{100 * result['min_effect']:.0f}%, interval widened by each record's wander over time"
            + ("; corrected by the environment probe" if result.get("probe_correct") else ""))
    parts = [f"**{head}**" if fmt == "markdown" else head,
             tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)]
    counts = {}
    for r in result["rows"]:
        counts[r["label"]] = counts.get(r["label"], 0) + 1
    parts.append("verdicts: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    for title, items in (("only in base", result["only_base"]), ("only in new", result["only_new"])):
        if items:
            parts.append(f"{title}: " + "; ".join(items))
    env_title = "### Environment" if fmt == "markdown" else "Environment:"
    env_lines = result["env"] or ["no difference that could explain a change without code"]
    parts.append(env_title + "\n" + "\n".join(f"- {line}" for line in env_lines))
    return "\n\n".join(parts) + "\n"
