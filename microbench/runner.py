"""The run loop: case -> points -> inputs -> gate -> timer -> record.

For each point of each selected case: every variant that runs on the device is gated on
fresh seeded inputs (a failure is recorded FAILED and not timed); the ones that pass are
timed — one after the other, or alternately with ``interleave`` — under one NVML clock
sampler; an environment probe (a fixed reference workload) is timed beside them; then
the records of the point are appended to the result file, which is rewritten atomically
so nothing finished is lost. A case that raises, out-of-memory included, is recorded
FAILED with its error and the run goes on.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from microbench import probe, stats, verdicts
from microbench.case import Case, Point, point_label
from microbench.env import ClockSampler
from microbench.gate import check_variant
from microbench.outcome import agreed_outcome, agreed_reason, attempt, culprit, error_text, failure
from microbench.pace import DEADLINE_NOTE, Pace
from microbench.passes import later_variants, merge_pass
from microbench.planning import Plan, RunOptions, runs_per_point, variant_skip
from microbench.profile import attached_note as cupti_note
from microbench.profile import profile_call
from microbench.results import ResultWriter
from microbench.samplers import free_cached_memory
from microbench.timing import Measurement, measure, measure_interleaved


def _profiles(device: str) -> bool:
    """Whether ``Case.profile_calls`` profiles on ``device`` (the torch profiler's CUDA trace)."""
    return device.startswith("cuda")


def _record(case: Case, point: Point, variant: str, device: str, status: str, **kw: Any) -> dict[str, Any]:
    rec = {"case": case.id, "axes": dict(point), "variant": variant, "baseline": case.baseline, "device": device,
           "status": status,
           "reason": None, "correctness": None, "timing": None, "bytes": None, "flops": None,
           "gbps": None, "tflops": None, "floor_s": None, "pct_of_floor": None, "floor_source": None,
           "clocks": None, "probe": None, "vs_baseline": None}
    rec.update(kw)
    return rec


class Runner:
    """Runs a plan into a :class:`ResultWriter`, printing one progress line per point.

    ``start_world`` (with no ``opts.world``): starts the world the multi-rank cases run on
    and returns it, called once, just before their first point (see :meth:`_start_world`)."""

    def __init__(self, opts: RunOptions, writer: ResultWriter | None, progress: Callable[[str], None] | None = None,
                 start_world: Callable[[], Any] | None = None):
        self.opts = opts
        self.writer = writer
        self.progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        self.records: list[dict[str, Any]] = []
        self.ceilings: dict[str, dict] = {}
        self.start_world = start_world
        self.no_world: str | None = None  # why the world did not start: its points are SKIPPED

    # ------------------------------------------------------------------ ceilings / floors

    def _ceiling(self, kind: str) -> tuple[float | None, str | None]:
        if kind in self.ceilings:
            return self.ceilings[kind]["value"], "measured in this run"
        fig = self.opts.profile_ceilings.get(kind)
        if fig:
            return fig["value"], fig["source"]
        return None, None

    def _floor(self, rec: dict[str, Any]) -> None:
        t = rec["timing"]["summary"]["median"]
        bw, bw_src = self._ceiling("memory_bandwidth")
        fl, fl_src = self._ceiling("matmul_flops")
        rec["gbps"] = rec["bytes"] / t / 1e9 if rec["bytes"] else None
        rec["tflops"] = rec["flops"] / t / 1e12 if rec["flops"] else None
        terms = []
        if rec["bytes"] and bw:
            terms.append((rec["bytes"] / bw, bw_src))
        if rec["flops"] and fl:
            terms.append((rec["flops"] / fl, fl_src))
        rec["floor_s"] = rec["floor_source"] = rec["pct_of_floor"] = None  # against no ceiling: none
        if terms:
            floor, src = max(terms)
            rec["floor_s"], rec["floor_source"] = floor, src
            rec["pct_of_floor"] = 100.0 * floor / t

    def _update_ceilings(self, case: Case, recs: list[dict[str, Any]]) -> None:
        """Raise (or set) ``case.ceiling`` to the best of ``recs``: OK records whose median
        has a bound (a finite noise), each read at its own (pooled) median."""
        ok = [r for r in recs if r["status"] == "OK" and r.get("timing") and case.counts_for_ceiling(r)
              and math.isfinite(r["timing"]["summary"].get("rel_noise", math.inf))]
        if not case.ceiling or not ok:
            return
        src = f"{case.id} in this run"
        med = lambda r: r["timing"]["summary"]["median"]  # noqa: E731
        if case.ceiling == "memory_bandwidth":
            unit, value = "B/s", (lambda r: r["bytes"] / med(r))
        elif case.ceiling == "matmul_flops":
            unit, value = "FLOP/s", (lambda r: r["flops"] / med(r))
        else:
            unit, value = "s", med
        win = (min if unit == "s" else max)(ok, key=value)
        best = value(win)
        prev = self.ceilings.get(case.ceiling)
        better = prev is None or (best < prev["value"] if unit == "s" else best > prev["value"])
        if better:
            self.ceilings[case.ceiling] = {"value": best, "unit": unit, "source": src, "axes": win["axes"]}

    def _settle_ceilings(self, cases: Sequence[Case]) -> None:
        """The run's ceilings from its kept records (pooled over --repeat passes; a record
        failed in a later pass no longer counts), and every OK record's floor against them:
        the points timed before a ceiling was measured, or raised, are read against it too."""
        self.ceilings = {}
        for case in cases:
            self._update_ceilings(case, [r for r in self.records if r["case"] == case.id])
        for r in self.records:
            if r["status"] == "OK" and r.get("timing"):
                self._floor(r)
        if self.writer is not None:
            self.writer.doc["run"]["ceilings"] = self.ceilings

    # ------------------------------------------------------------------ one point

    def run_point(self, case: Case, point: Point, budget_s: float | None = None,
                  only: set[str] | None = None) -> list[dict[str, Any]]:
        """Gate and time every variant of ``case`` at ``point`` (of ``only``, when given);
        ``budget_s``: the timing budget per variant when a deadline cut it below the run's
        (recorded and noted)."""
        o = self.opts
        dev = o.device
        seed = case.input_seed(o.seed, point)
        forced = case.point_timing_mode(point)
        cut = budget_s is not None and budget_s < o.timing.budget_s
        timing = replace(o.timing, mode=forced or o.timing.mode, budget_s=budget_s if cut else o.timing.budget_s)
        mode = timing.resolved_mode(dev)
        world = o.world if case.distributed else None
        recs: dict[str, dict[str, Any]] = {}
        ready: list[tuple[Variant, list[Callable[[], Any]]]] = []
        notes: dict[str, str | None] = {}
        profiled: dict[str, Callable[[], Any]] = {}  # the calls to profile once the point is timed
        variants = [v for v in case.variants() if (not o.variants or v.name in o.variants)
                    and (only is None or v.name in only)]
        for v in variants:
            why = agreed_reason(world, f"{case.id} {v.name} skip", variant_skip(case, v, point, dev))
            extra = {"tags": dict(v.tags)} if v.tags else {}
            if why:
                recs[v.name] = _record(case, point, v.name, dev, "SKIPPED", reason=why, **extra)
                continue
            t0 = time.perf_counter()
            # set-up and reference first, agreed: on several ranks the call below holds a
            # collective, which a rank that failed before it would leave the others waiting in
            try:
                w = case.setup(point, dev, seed)
                expected = case.reference_for(w, v)
                outcome = {"error": None}
            except Exception as e:  # noqa: BLE001 - a failing variant must not stop the run
                outcome = failure(e)
                free_cached_memory(dev, error=e)
            if world is not None:
                outcome = agreed_outcome(world, f"{case.id} {v.name} set-up", outcome)
            if outcome["error"]:
                recs[v.name] = _record(case, point, v.name, dev, "FAILED", reason=outcome["error"],
                                       traceback=outcome.get("traceback"), prep_s=time.perf_counter() - t0, **extra)
                continue
            try:
                gate = check_variant(v.fn, w.inputs, w.outputs, expected, **case.gate_tolerances(point), seed=seed)
                base = dict(correctness=gate.to_dict(), bytes=w.cost.bytes, flops=w.cost.flops, facts=w.facts or None,
                            **extra)
                outcome = {"error": None, "passed": gate.passed, "wrong": gate.wrong, "summary": gate.summary()}
            except Exception as e:  # noqa: BLE001 - a failing variant must not stop the run
                outcome = failure(e)
                free_cached_memory(dev, error=e)
            outcome = agreed_outcome(world, f"{case.id} {v.name} gate", outcome)
            if outcome["error"]:
                recs[v.name] = _record(case, point, v.name, dev, "FAILED", reason=outcome["error"],
                                       traceback=outcome.get("traceback"), prep_s=time.perf_counter() - t0, **extra)
                continue
            if world is not None:
                base["wrong"] = outcome["wrong"]
            if not outcome["passed"]:
                recs[v.name] = _record(case, point, v.name, dev, "FAILED", reason="incorrect: " + outcome["summary"],
                                       prep_s=time.perf_counter() - t0, **base)
                continue

            prepared, outcome = attempt(world, f"{case.id} {v.name} timing set-up", dev,
                                        functools.partial(w.timed_calls, v.fn, mode, o.cache_bytes))
            if outcome["error"]:  # e.g. no memory left for the input copies a cold cache needs
                recs[v.name] = _record(case, point, v.name, dev, "FAILED", reason=outcome["error"],
                                       traceback=outcome.get("traceback"), prep_s=time.perf_counter() - t0, **base)
                continue
            calls, notes[v.name] = prepared
            recs[v.name] = _record(case, point, v.name, dev, "OK", prep_s=time.perf_counter() - t0, **base)
            ready.append((v, calls))
            if case.profile_calls and _profiles(dev):
                profiled[v.name] = functools.partial(v.fn, **w.kwargs())
        clocks = None
        if ready:
            before, probe_note = self._probe(dev)
            with ClockSampler(_device_index(dev)) as sampler:
                measured = self._time(ready, dev, timing, recs, world)
            clocks = sampler.result()
            after, after_note = self._probe(dev) if before else (None, None)
            env_probe, probe_note = (probe.pool(before, after) if after else None), probe_note or after_note
            attached = cupti_note() if _profiles(dev) else None
            for v, m in measured.items():
                r = recs[v]
                r["timing"], r["clocks"], r["probe"] = m.to_dict(), clocks, env_probe
                r["timing"]["notes"] += [n for n in (notes.get(v), attached, probe_note) if n]
                r["timing"]["interleaved"] = o.interleave and len(measured) > 1
                if cut:
                    r["timing"]["budget_s"] = timing.budget_s
                    r["timing"]["notes"].append(DEADLINE_NOTE)
            # a calibration point's own ceiling first: its rows are read against what they measured
            self._update_ceilings(case, [recs[v] for v in measured])
            for v in measured:
                self._floor(recs[v])
            self._vs_baseline(case, recs)
        for name, call in profiled.items():  # after the timing: a profiler session never precedes it
            if recs[name]["status"] == "OK":
                recs[name]["profile"] = profile_call(call)
        return [recs[v.name] for v in variants if v.name in recs]

    def _probe(self, dev: str) -> tuple[dict[str, Any] | None, str | None]:
        """The environment probe (None when the run takes none) and, when it failed (say,
        out of memory beside the point's inputs), a note saying so: the point keeps its
        timings, without a probe."""
        if not self.opts.probe:
            return None, None
        try:
            return probe.measure_probe(dev, self.opts.cache_bytes), None
        except Exception as e:  # noqa: BLE001 - the probe is context; the timings stand without it
            note = f"environment probe failed ({error_text(e)}): no probe for this point"
            free_cached_memory(dev, error=e)
            return None, note

    def _time(self, ready, dev, timing, recs, world=None) -> dict[str, Measurement]:
        """Time the variants that passed the gate; on several ranks, in lock step, each
        record then carrying every rank's own median (``ranks``)."""
        o = self.opts
        lock = world.lockstep() if world is not None else None
        measured: dict[str, Measurement] = {}
        ready = list(ready)
        while o.interleave and len(ready) > 1:
            ms, outcome = attempt(world, "interleaved timing", dev, lambda: measure_interleaved(
                [c for _, c in ready], device=dev, options=timing, cache_bytes=o.cache_bytes, lockstep=lock))
            if not outcome["error"]:
                measured = {v.name: m for (v, _), m in zip(ready, ms)}
                self._rank_medians(world, lock, measured, recs)
                return measured
            # one process, and the error's traceback names the variant that raised: that one
            # fails, the others are timed again without it (on several ranks, every one fails)
            i = culprit(outcome.get("exception"), [v.fn for v, _ in ready]) if world is None else None
            for v, _ in ready if i is None else [ready[i]]:
                recs[v.name].update(status="FAILED", reason=outcome["error"], traceback=outcome.get("traceback"))
            if i is None:
                return {}
            ready.pop(i)
        for v, calls in ready:
            m, outcome = attempt(world, f"{v.name} timing", dev, functools.partial(
                measure, calls, device=dev, options=timing, cache_bytes=o.cache_bytes, lockstep=lock))
            if outcome["error"]:
                recs[v.name].update(status="FAILED", reason=outcome["error"], traceback=outcome.get("traceback"))
                continue
            measured[v.name] = m
            self._rank_medians(world, lock, {v.name: m}, recs)
        return measured

    @staticmethod
    def _rank_medians(world, lock, measured: dict[str, Measurement], recs) -> None:
        """Every rank's own median of the measurements just taken (the lock's last ones)."""
        if world is None:
            return
        mine = [stats.summarize(xs).median for xs in lock.local[-len(measured):]]
        every = world.agree("rank medians", mine)
        for i, name in enumerate(measured):
            recs[name]["ranks"] = [{"rank": r, "median_s": meds[i]} for r, meds in enumerate(every)]

    def _vs_baseline(self, case: Case, recs: dict[str, dict], measured: Any = None) -> None:
        """Each OK variant's ratio to the baseline, from the (pooled) samples of the records;
        none for a record that is not OK, nor for any when the baseline is not (a verdict
        an earlier pass gave is taken back when a later one fails)."""
        base = recs.get(case.baseline)
        base_ok = base is not None and base["status"] == "OK" and bool(base.get("timing"))
        for r in recs.values():
            if not base_ok or r["status"] != "OK":
                r.pop("vs_baseline", None)
        if not base_ok:
            return
        bt = base["timing"]
        for name, r in recs.items():
            if name == case.baseline or r["status"] != "OK" or not r.get("timing"):
                continue
            v = verdicts.within_run(bt, r["timing"], interleaved=bool(self.opts.interleave),
                                    min_effect=self.opts.min_effect)
            r["vs_baseline"] = v.to_dict()

    # ------------------------------------------------------------------ the whole plan

    def run(self, p: Plan, after_runs: int = 0) -> list[dict[str, Any]]:
        """Run every point; with ``repeat`` R > 1, R passes over the whole plan, each point's
        samples pooled across passes (so they span the run's duration, not one moment; a
        later pass runs the variants OK in the first, :mod:`microbench.passes`). The
        single-rank points' passes come first, then the multi-rank points' (the plan's own
        order where its points are all of one kind). ``after_runs``: variant runs another
        process makes after this plan (its ranks), which --deadline-s leaves their share."""
        for case, point, reason in p.skipped:
            self._keep(self._skipped(case, point, reason))
        total, passes = len(p.items), max(1, self.opts.repeat)
        parts = ([i for i, (case, _) in enumerate(p.items) if not case.distributed],
                 [i for i, (case, _) in enumerate(p.items) if case.distributed])
        order = [(k, i) for part in parts for k in range(passes) for i in part]
        kept: dict[int, list[dict[str, Any]]] = {}
        t0 = time.perf_counter()
        runs = runs_per_point(p, self.opts)
        pace = Pace(self.opts, [runs[i] for _, i in order], after=after_runs)
        at = {ki: j for j, ki in enumerate(order)}
        for k, i in order:
            case, point = p.items[i]
            only = later_variants(kept[i]) if k else None
            if k and not only:  # nothing of this point to pool into: its later passes are not run
                pace.done([])
                continue
            if case.distributed and self.start_world is not None:
                self._start_world()
            tag = f" (pass {k + 1}/{passes})" if passes > 1 else ""
            budget = pace.budget()
            if case.distributed and self.opts.world is not None and self.opts.world.size > 1 and budget:
                budget = min(self.opts.world.agree("deadline budget", budget))  # lock step needs one rule
            cut = f" (budget {budget:.3g} s: --deadline-s)" if budget and budget < self.opts.timing.budget_s else ""
            self.progress(f"[{i + 1}/{total}]{tag} {case.id} {point_label(point)}{cut}")
            if case.distributed and self.no_world:
                recs = self._skipped(case, point, self.no_world)
            elif case.distributed:  # on every rank in lock step: a rank may not leave it alone
                recs = self.run_point(case, point, budget, only)
            else:
                try:
                    recs = self.run_point(case, point, budget, only)
                except Exception as e:  # noqa: BLE001 - outside any variant's guard: the run goes on
                    reason = f"the point failed outside its variants: {error_text(e)}"
                    free_cached_memory(self.opts.device, error=e)
                    recs = [_record(case, point, v.name, self.opts.device, "FAILED", reason=reason)
                            for v in case.variants() if (not self.opts.variants or v.name in self.opts.variants)
                            and (only is None or v.name in only)]
            pace.done(recs)
            if k == 0:
                kept[i] = recs
                self._keep(recs)
                for later in range(1, passes):  # what the later passes will run here
                    pace.runs[at[(later, i)]] = len(later_variants(recs))
            else:
                merge_pass(kept[i], recs, k)
                for r in kept[i]:
                    if r["status"] == "OK":
                        self._floor(r)
                self._vs_baseline(case, {r["variant"]: r for r in kept[i]})
                self._keep([])
            for r in kept[i]:
                self.progress("    " + progress_text(r))
        if total:
            self.progress(time_split_text([r for recs in kept.values() for r in recs], time.perf_counter() - t0))
            if pace.cut_points:
                self.progress(pace.summary())
        self._settle_ceilings(list({c.id: c for c, _ in p.items}.values()))
        self._derive(p)
        return self.records

    def _start_world(self) -> None:
        """Start the multi-rank cases' world (``start_world``), once, just before their first
        point: every single-rank point is timed by then and forced to disk first, so a hang
        or a crash in the world's device work (its communicator, a symmetric-memory probe at
        the first point) can cost only the multi-rank points. A world that does not start
        skips them, with its error."""
        start, self.start_world = self.start_world, None
        if self.writer is not None:
            self.writer.flush(force=True)
        try:
            self.opts = replace(self.opts, world=start())
        except Exception as e:  # noqa: BLE001 - an NCCL or driver fault: the other cases are done, these skip
            self.no_world = f"the process group did not start ({error_text(e)})"
            self.progress(f"{self.no_world}; the multi-rank cases are SKIPPED")

    def _skipped(self, case: Case, point: Point, reason: str) -> list[dict[str, Any]]:
        return [_record(case, point, v.name, self.opts.device, "SKIPPED", reason=reason) for v in case.variants()
                if not self.opts.variants or v.name in self.opts.variants]

    def _derive(self, p: Plan) -> None:
        by_case: dict[str, list[dict[str, Any]]] = {}
        for r in self.records:
            by_case.setdefault(r["case"], []).append(r)
        from microbench.report import summary

        summaries: dict[str, list[dict[str, Any]]] = {}
        for case in {c.id: c for c, _ in p.items}.values():
            try:
                case.derive(by_case.get(case.id, []))
                lines = [summary(x) for x in case.summarize(by_case.get(case.id, []))]
            except Exception as e:  # noqa: BLE001 - a broken derived column must not lose the run
                self.progress(f"    {case.id}: derived columns or summary failed: {error_text(e)}")
                continue
            if lines:
                summaries[case.id] = lines
        if summaries and self.writer is not None:  # beside any a ranks' run brought in
            self.writer.doc["run"].setdefault("summaries", {}).update(summaries)
        if self.writer is not None:
            self.writer.flush()

    def _keep(self, recs: list[dict[str, Any]]) -> None:
        self.records.extend(recs)
        if self.writer is not None:
            self.writer.add(recs)
            self.writer.doc["run"]["ceilings"] = self.ceilings
            self.writer.flush()


def time_split_text(recs: Sequence[dict[str, Any]], wall_s: float) -> str:
    """Where a run's wall time went: preparing variants (set-up, references, correctness
    gates with their first-call compiles), warming them up (warm-up calls, batch sizing,
    graph capture), timing them, and the rest."""
    prep = sum(r.get("prep_s") or 0.0 for r in recs)
    warm = sum((r.get("timing") or {}).get("warmup_s", 0.0) for r in recs)  # each variant warms on its own
    timed, shared = 0.0, {}  # variants timed interleaved share one loop: count it once per point
    for r in recs:
        t = r.get("timing")
        if t and t.get("interleaved"):
            key = (r["case"], point_label(r["axes"]))
            shared[key] = max(shared.get(key, 0.0), t["elapsed_s"])
        elif t:
            timed += t["elapsed_s"]
    timed += sum(shared.values())
    slowest = max((r for r in recs if r.get("prep_s") is not None), key=lambda r: r["prep_s"], default=None)
    tail = (f"; slowest to prepare: {slowest['case']} {point_label(slowest['axes'])} {slowest['variant']} "
            f"{slowest['prep_s']:.1f} s" if slowest else "")
    return (f"run: {wall_s:.1f} s wall, {prep:.1f} s preparing variants (set-up, references, gates with "
            f"first-call compiles), {warm:.1f} s warming them up (warm-up calls, batch sizing, graph capture), "
            f"{timed:.1f} s timing them, {max(0.0, wall_s - prep - warm - timed):.1f} s "
            f"the rest (environment probes, clock sampling, result writes){tail}")


def progress_text(r: dict[str, Any]) -> str:
    if r["status"] != "OK":
        return f"{r['variant']:<14} {r['status']}: {r['reason']}"
    t = r["timing"]
    s = t["summary"]
    from microbench.report import fmt_time  # local: report imports nothing from here

    extra = f" {r['gbps']:.1f} GB/s" if r.get("gbps") else ""
    vb = r.get("vs_baseline")
    if vb:
        extra += f"  ×{vb['ratio']:.3f} vs baseline {vb['label']}"
    if r.get("prep_s") is not None:  # set-up, reference, gate (first-call compiles); warm-up, capture
        extra += f"  [prep {r['prep_s']:.1f} s, warm-up {t.get('warmup_s', 0.0):.1f} s, timing {t['elapsed_s']:.1f} s]"
    return (f"{r['variant']:<14} {fmt_time(s['median'])} ±{100 * s['rel_noise']:.2f}% "
            f"n={s['count']} ({t['stop_reason']}){extra}")


def _device_index(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.device(device).index or 0 if ":" in device else torch.cuda.current_device()
