"""compare: verdicts from raw samples, wander-aware intervals, and the environment section."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from microbench import compare, stats, verdicts

T0 = 1e-4


def _samples(rng, n=400, sigma=0.02, scale=T0, drift=0.0):
    x = scale * rng.lognormal(0.0, sigma, n)
    return list(x * (1 + drift * np.linspace(0, 1, n)))


def _doc(samples_by_variant, fp=None, clocks=None, probe=None, device="cpu", status=None):
    recs = []
    for v, s in samples_by_variant.items():
        recs.append({"case": "c", "axes": {"tokens": 4}, "variant": v, "status": (status or {}).get(v, "OK"),
                     "reason": None, "timing": {"samples_s": s, "mode": "hot", "summary": stats.summarize(s).to_dict()},
                     "clocks": clocks, "probe": probe})
    return {"schema": "microbench.result", "schema_version": 1, "run": {"id": "r", "device": device, "complete": True},
            "fingerprint": fp or {}, "records": recs}


def test_a_file_against_itself_is_same_everywhere():
    rng = np.random.default_rng(0)
    d = _doc({"a": _samples(rng, sigma=0.2), "b": _samples(rng, n=8, sigma=0.3)})
    res = compare.compare_runs(d, copy.deepcopy(d))
    assert [r["label"] for r in res["rows"]] == ["SAME", "SAME"]


def test_ten_percent_slower_is_slower_and_unchanged_is_not_a_verdict():
    rng = np.random.default_rng(1)
    base = _doc({"k": _samples(rng)})
    slower = compare.compare_runs(base, _doc({"k": _samples(rng, scale=1.1 * T0)}))
    assert slower["rows"][0]["label"] == "SLOWER" and abs(slower["rows"][0]["ratio"] - 1.1) < 0.01
    for seed in range(20):
        r = np.random.default_rng(100 + seed)
        same = compare.compare_runs(_doc({"k": _samples(r)}), _doc({"k": _samples(r)}))
        assert same["rows"][0]["label"] in ("SAME", "UNSURE")


def test_a_run_that_wandered_cannot_call_a_shift_of_that_size():
    """The new run spent its second half 15% slower (the machine, not the code): the
    median moved, the bootstrap alone would say SLOWER, the wander says UNSURE."""
    rng = np.random.default_rng(2)
    n = 400
    new = np.array(_samples(rng, n=n))
    new[n // 2:] *= 1.15
    res = compare.compare_runs(_doc({"k": _samples(rng, n=n)}), _doc({"k": list(new)}))
    row = res["rows"][0]
    assert verdicts.compare_samples(_samples(np.random.default_rng(2), n=n), list(new)).label == "SLOWER"
    assert row["label"] == "UNSURE", row
    assert any("wandered" in n for n in row["notes"])
    assert any("wandered within the runs" in line for line in res["env"])


def test_failures_and_unmatched_records_are_reported():
    rng = np.random.default_rng(3)
    base = _doc({"a": _samples(rng), "b": _samples(rng)})
    new = _doc({"a": _samples(rng), "c": _samples(rng)}, status={"a": "FAILED"})
    res = compare.compare_runs(base, new)
    assert res["rows"][0]["label"] == "BROKEN"
    assert res["only_base"] == ["c tokens=4 b"] and res["only_new"] == ["c tokens=4 c"]


def test_variant_map_compares_a_variant_with_another_across_runs():
    rng = np.random.default_rng(4)
    base = _doc({"work": _samples(rng), "work+10%": _samples(rng, scale=1.1 * T0)})
    new = _doc({"work": _samples(rng), "work+10%": _samples(rng, scale=1.1 * T0)})
    res = compare.compare_runs(base, new, variant_map={"work": "work+10%"})
    (row,) = res["rows"]
    assert row["variant"] == "work->work+10%" and row["label"] == "SLOWER"


def test_environment_section_names_what_could_explain_a_change():
    rng = np.random.default_rng(5)
    fp_a = {"device": {"name": "NVIDIA H200", "driver_version": "580.1"}, "software": {"torch": "2.11"},
            "git": {"commit": "aaa", "dirty": False}}
    fp_b = {"device": {"name": "NVIDIA H200", "driver_version": "580.2"}, "software": {"torch": "2.12"},
            "git": {"commit": "bbb", "dirty": True}}
    ca = {"sm_clock_mhz": {"mean": 1980.0}, "throttle_reasons": ["gpu_idle"], "temperature_c": {"max": 40}}
    cb = {"sm_clock_mhz": {"mean": 1755.0}, "throttle_reasons": ["sw_power_cap"], "temperature_c": {"max": 71}}
    probe_a = {"version": 2, "samples_s": _samples(rng, n=50)}
    probe_b = {"version": 2, "samples_s": _samples(rng, n=50, scale=1.2 * T0)}
    res = compare.compare_runs(_doc({"k": _samples(rng)}, fp_a, ca, probe_a, "cuda"),
                               _doc({"k": _samples(rng)}, fp_b, cb, probe_b, "cuda"))
    env = "\n".join(res["env"])
    for text in ("driver: 580.1 -> 580.2", "torch: 2.11 -> 2.12", "git commit: aaa -> bbb", "git dirty",
                 "SM clock differs", "sw_power_cap", "40 -> 71", "environment probe moved"):
        assert text in env, (text, env)
    notes = "; ".join(res["rows"][0]["notes"])
    assert "SM clock 1980->1755 MHz" in notes and "environment +20" in notes
    assert "gpu_idle" not in env  # benign reasons are not news
    md = compare.render(res, "markdown")
    assert "| case" in md and "### Environment" in md


def test_probe_correction_is_opt_in_and_separates_environment_from_code():
    rng = np.random.default_rng(6)
    pa = {"version": 2, "samples_s": _samples(rng, n=200)}
    pb = {"version": 2, "samples_s": _samples(rng, n=200, scale=1.18 * T0)}
    base, new = _doc({"k": _samples(rng)}, probe=pa), _doc({"k": _samples(rng, scale=1.18 * T0)}, probe=pb)
    plain = compare.compare_runs(base, new)["rows"][0]
    assert plain["label"] == "UNSURE" and "moved with it" in "; ".join(plain["notes"])
    row = compare.compare_runs(base, new, probe_correct=True)["rows"][0]
    assert row["label"] == "SAME" and "moved with it" in row["explain"]


def test_a_change_no_larger_than_the_environment_move_is_not_called_code():
    """12% slower reads SLOWER on a steady machine, UNSURE when the probe itself moved 15%;
    a change well past the move is still seen."""
    rng = np.random.default_rng(11)
    steady = {"version": 2, "samples_s": _samples(rng, n=200)}
    moved = {"version": 2, "samples_s": _samples(rng, n=200, scale=1.15 * T0)}
    base = _doc({"k": _samples(rng)}, probe=steady)
    slower = compare.compare_runs(base, _doc({"k": _samples(rng, scale=1.12 * T0)}, probe=steady))
    assert slower["rows"][0]["label"] == "SLOWER"
    row = compare.compare_runs(base, _doc({"k": _samples(rng, scale=1.12 * T0)}, probe=moved))["rows"][0]
    assert row["label"] == "UNSURE" and row["hi"] > 1.12 * 1.14 and row["lo"] < 1.12 / 1.14
    far = compare.compare_runs(base, _doc({"k": _samples(rng, scale=1.6 * T0)}, probe=moved))["rows"][0]
    assert far["label"] == "SLOWER"


def test_a_record_too_short_for_its_own_wander_borrows_the_runs():
    """Ten samples cannot show wander (one block); the run's other records wandered ±10%,
    so a 10% move in the short record is not a verdict — yet it would be on its own."""
    rng = np.random.default_rng(12)

    def run(short_scale):
        long_ = np.array(_samples(rng, n=400, sigma=0.01))
        long_[200:] *= rng.choice([0.9, 1.1])
        return _doc({"long": list(long_), "short": _samples(rng, n=10, sigma=0.005, scale=short_scale * T0)})

    alone = compare.compare_runs(_doc({"short": _samples(rng, n=10, sigma=0.005)}),
                                 _doc({"short": _samples(rng, n=10, sigma=0.005, scale=1.1 * T0)}))
    assert alone["rows"][0]["label"] == "SLOWER" and alone["rows"][0]["wander"] == 0.0
    res = compare.compare_runs(run(1.0), run(1.1))
    short = res["rows"][1]
    assert short["variant"] == "short" and short["wander"] > 0.05, short
    assert short["label"] == "UNSURE" and any("typical" in n for n in short["notes"])


def _interleaved_doc(rng, factors, n=600):
    """One interleaved run: every round's machine state hits all variants of the round alike
    (state: a factor that jumps between blocks of rounds, like a co-tenant coming and going)."""
    state = np.repeat(rng.choice([1.0, 1.4, 1.8], size=n // 50), 50)
    recs = []
    for v, f in factors.items():
        s = list(T0 * f * state * rng.lognormal(0.0, 0.01, n))
        recs.append({"case": "c", "axes": {"size": 64}, "variant": v, "baseline": "anchor", "status": "OK",
                     "timing": {"samples_s": s, "mode": "hot", "interleaved": True,
                                "summary": stats.summarize(s).to_dict()}})
    return {"schema": "microbench.result", "schema_version": 1, "run": {"id": "r", "device": "cpu", "complete": True},
            "fingerprint": {}, "records": recs}


def test_relative_compare_sees_ten_percent_through_a_machine_that_moves():
    rng = np.random.default_rng(7)
    base = _interleaved_doc(rng, {"anchor": 1.0, "work": 1.0})
    slower = _interleaved_doc(rng, {"anchor": 1.0, "work": 1.1})
    same = _interleaved_doc(rng, {"anchor": 1.0, "work": 1.0})
    absolute = compare.compare_runs(base, slower)["rows"][1]
    assert absolute["label"] == "UNSURE"  # the states swamp 10% in absolute time
    rel = compare.compare_runs(base, slower, relative=True)["rows"]
    assert rel[0]["label"] == "n/a" and "baseline itself" in rel[0]["notes"][0]
    assert rel[1]["label"] == "SLOWER" and abs(rel[1]["ratio"] - 1.1) < 0.01
    assert compare.compare_runs(base, same, relative=True)["rows"][1]["label"] == "SAME"


def test_relative_compare_merges_rotations_and_says_when_one_side_did_not_rotate():
    """A rotated run's ratios are merged per rotation (a place in the round cancels);
    a file from before rotation is compared all the same, with a note, and a run cut
    before one whole rotation has no relative ratio."""
    rng = np.random.default_rng(9)
    old, new = (_interleaved_doc(rng, {"anchor": 1.0, "work": 1.0}) for _ in range(2))
    for r in new["records"]:
        r["timing"]["rotation"] = 2
    row = compare.compare_runs(old, new, relative=True)["rows"][1]
    assert row["label"] == "SAME" and any("rotated on one side only" in n for n in row["notes"])
    assert not any("rotated" in n for n in compare.compare_runs(new, new, relative=True)["rows"][1]["notes"])
    for r in new["records"]:
        r["timing"]["rotation"] = 4
        r["timing"]["samples_s"] = r["timing"]["samples_s"][:3]
    row = compare.compare_runs(new, new, relative=True)["rows"][1]
    assert row["label"] == "n/a" and "not one whole rotation" in row["notes"][0]


def test_relative_compare_needs_interleaved_runs():
    rng = np.random.default_rng(8)
    d = _doc({"anchor": _samples(rng), "work": _samples(rng)})
    for r in d["records"]:
        r["baseline"] = "anchor"
    row = compare.compare_runs(d, copy.deepcopy(d), relative=True)["rows"][1]
    assert row["label"] == "n/a" and "--interleave" in row["notes"][0]


def _floored(doc, floor_s, source="calibration.copy in this run"):
    for r in doc["records"]:
        r["floor_s"], r["floor_source"] = floor_s, source
    return doc


def test_per_floor_compares_efficiency_across_gpus():
    """An H100 run against an H200 one: the kernel took 4.8 / 3.35 as long on the slower
    memory (SLOWER in time), at the same % of its own floor (SAME per floor); a kernel that
    lost efficiency is SLOWER either way."""
    rng = np.random.default_rng(7)
    h200 = _floored(_doc({"k": _samples(rng, scale=T0), "worse": _samples(rng, scale=T0)},
                         fp={"device": {"name": "NVIDIA H200"}}), 0.8 * T0)
    slow_mem = 4.8 / 3.35
    h100 = _floored(_doc({"k": _samples(rng, scale=slow_mem * T0), "worse": _samples(rng, scale=1.6 * slow_mem * T0)},
                         fp={"device": {"name": "NVIDIA H100 80GB HBM3"}}), slow_mem * 0.8 * T0)
    by_time = {r["variant"]: r for r in compare.compare_runs(h200, h100)["rows"]}
    assert by_time["k"]["label"] == "SLOWER"
    res = compare.compare_runs(h200, h100, per_floor=True)
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["k"]["label"] == "SAME" and abs(rows["k"]["ratio"] - 1) < 0.01
    assert rows["worse"]["label"] == "SLOWER" and abs(rows["worse"]["ratio"] - 1.6) < 0.03
    assert any(line.startswith("GPU model: NVIDIA H200 -> NVIDIA H100") for line in res["env"])
    text = compare.render(res)
    assert "base median (% floor)" in text and re.search(r" (79|80|81)\.\d% ", text)  # 0.8 T0 floor, ~T0 median
    assert "time over each record's floor" in text
    # a point with no floor says so instead of a verdict; a datasheet floor against a measured one is noted
    del h100["records"][0]["floor_s"]
    _floored(h200, 0.8 * T0, "profile h200-sxm (datasheet)")
    rows = {r["variant"]: r for r in compare.compare_runs(h200, h100, per_floor=True)["rows"]}
    assert rows["k"]["label"] == "n/a" and rows["k"]["notes"][0].startswith("per floor: no floor for this point")
    assert "floors from a measured ceiling on one side, a datasheet on the other" in rows["worse"]["notes"]
    with pytest.raises(ValueError, match="choose one"):
        compare.compare_runs(h200, h100, per_floor=True, relative=True)


TICK = 1.024e-6  # CUDA events' step on recent GPUs


def _ticked(rng, counts, n=200):
    """n samples on whole ticks, ``counts``: ticks -> share, as CUDA events time a µs call."""
    ks, p = list(counts), np.array(list(counts.values()), dtype=float)
    return list(TICK * rng.choice(ks, size=n, p=p / p.sum()))


def test_medians_read_in_ticks_are_not_a_verdict_within_a_tick():
    """A µs kernel timed by CUDA events in two runs: mostly 4 ticks, then mostly 5. The
    bootstrap alone says SLOWER with an interval of width 0; each median is known only to
    ±half a tick, so the row is UNSURE and says why. A file from before ticks were kept
    (no summary.tick, no resolution_s) compares the same: the tick is read from its samples."""
    rng = np.random.default_rng(20)
    base, new = _doc({"k": _ticked(rng, {4: 0.8, 5: 0.2})}), _doc({"k": _ticked(rng, {4: 0.2, 5: 0.8})})
    bs, ns = base["records"][0]["timing"]["samples_s"], new["records"][0]["timing"]["samples_s"]
    assert verdicts.compare_samples(bs, ns, half_ticks=(0.0, 0.0)).label == "SLOWER"  # as it read before
    row = compare.compare_runs(base, new)["rows"][0]
    assert row["label"] == "UNSURE" and row["lo"] <= 1.0 and row["hi"] >= 5.5 / 3.5, row
    assert "timer's tick" in row["explain"]
    for d in (base, new):
        del d["records"][0]["timing"]["summary"]["tick"]
    assert compare.compare_runs(base, new)["rows"][0] == row
    # samples all equal show no tick: the resolution the run recorded stands in for it
    flat, flat2 = _doc({"k": [4 * TICK] * 200}), _doc({"k": [4 * TICK] * 199})
    assert compare.compare_runs(flat, flat2)["rows"][0]["label"] == "SAME"  # [1, 1]: no tick known
    for d in (flat, flat2):
        d["records"][0]["timing"]["resolution_s"] = 0.5e-6
    row = compare.compare_runs(flat, flat2)["rows"][0]
    assert row["label"] == "UNSURE" and row["lo"] == pytest.approx((4 * TICK - 0.25e-6) / (4 * TICK + 0.25e-6))


def test_within_run_and_relative_verdicts_hold_each_median_to_half_a_tick():
    """The table's vs-baseline verdict (sequential or interleaved) and compare --relative
    between two interleaved runs: per-round ratios of tick values collapse as the times
    do, and are widened alike."""
    rng = np.random.default_rng(21)
    a = {"samples_s": _ticked(rng, {4: 0.8, 5: 0.2}), "resolution_s": 0.5e-6}
    b = {"samples_s": _ticked(rng, {4: 0.2, 5: 0.8}), "resolution_s": 0.5e-6}
    for interleaved in (False, True):
        v = verdicts.within_run(a, b, interleaved=interleaved)
        assert v.label == "UNSURE" and v.tick > 0.2, v.explain()

    def run(work):
        recs = [{"case": "c", "axes": {"size": 64}, "variant": name, "baseline": "anchor", "status": "OK",
                 "timing": {"samples_s": s, "mode": "cold", "interleaved": True,
                            "summary": stats.summarize(s).to_dict()}}
                for name, s in (("anchor", [4 * TICK] * 300), ("work", _ticked(rng, work, n=300)))]
        return {"schema": "microbench.result", "schema_version": 1, "fingerprint": {}, "records": recs,
                "run": {"id": "r", "device": "cuda", "complete": True}}

    row = compare.compare_runs(run({4: 0.8, 5: 0.2}), run({4: 0.2, 5: 0.8}), relative=True)["rows"][1]
    assert row["label"] == "UNSURE" and row["lo"] <= 1.0, row


def test_environment_differences_are_named_whichever_side_has_them():
    """Throttling, heat and fields seen in the base run only, a field one file lacks, the
    power limit; an SM clock 3% apart is a note (past 2%), 1% apart is not."""
    rng = np.random.default_rng(13)
    fp_a = {"nvml": {"gpu": {"power_limit_w": 700.0}}, "software": {"torch": "2.11", "triton": "3.5"}}
    fp_b = {"nvml": {"gpu": {"power_limit_w": 500.0}}, "software": {"torch": "2.11"}}
    hot = {"sm_clock_mhz": {"mean": 2000.0}, "throttle_reasons": ["hw_slowdown"], "temperature_c": {"max": 50}}
    cool = {"sm_clock_mhz": {"mean": 1940.0}, "throttle_reasons": [], "temperature_c": {"max": 60}}
    base = _doc({"k": _samples(rng), "k2": _samples(rng)}, fp_a, hot, device="cuda")
    base["records"][1]["clocks"] = {**hot, "temperature_c": {"max": 80}}  # the run's hottest case
    new = _doc({"k": _samples(rng), "k2": _samples(rng)}, fp_b, cool, device="cuda")
    res = compare.compare_runs(base, new)
    env = "\n".join(res["env"])
    for text in ("power limit (W): 700.0 -> 500.0", "triton: 3.5 -> None", "throttle reasons seen during cases: hw_slowdown",
                 "max GPU temperature during cases: 80 -> 60 °C", "SM clock differs by more than 2% in 2 of 2 cases"):
        assert text in env, (text, env)
    assert "torch" not in env
    notes = "; ".join(res["rows"][0]["notes"])
    assert "SM clock 2000->1940 MHz (-3.0%)" in notes and "throttled: hw_slowdown" in notes
    near = _doc({"k": _samples(rng)}, clocks={**hot, "sm_clock_mhz": {"mean": 1980.0}, "throttle_reasons": []})
    row = compare.compare_runs(_doc({"k": _samples(rng)}, clocks={**hot, "throttle_reasons": []}), near)["rows"][0]
    assert not any("SM clock" in n for n in row["notes"]), row["notes"]


def test_a_probe_of_another_version_is_no_environment_ratio_and_a_move_against_it_is_not_with_it():
    rng = np.random.default_rng(14)
    p1 = {"version": 1, "samples_s": _samples(rng, n=200)}
    p2 = {"version": 2, "samples_s": _samples(rng, n=200, scale=1.2 * T0)}
    res = compare.compare_runs(_doc({"k": _samples(rng)}, probe=p1), _doc({"k": _samples(rng)}, probe=p2))
    row = res["rows"][0]
    assert row["env_ratio"] is None and not any("environment" in n for n in row["notes"]), row
    assert not any("environment probe moved" in line or "steady" in line for line in res["env"])
    assert "environment probe version differs (1 -> 2): another workload, so no point is set beside the " \
           "environment's move" in res["env"]
    # the probe 20% slower, this case 10% faster: the environment is noted, not "moved with it"
    p2["version"] = 1
    row = compare.compare_runs(_doc({"k": _samples(rng)}, probe=p1),
                               _doc({"k": _samples(rng, scale=T0 / 1.1)}, probe=p2))["rows"][0]
    notes = "; ".join(row["notes"])
    assert "environment +20" in notes and "moved with it" not in notes, notes


def test_rows_and_run_lines_say_what_differs_besides_the_times():
    rng = np.random.default_rng(15)
    base = _doc({"a": _samples(rng), "b": _samples(rng)}, status={"a": "FAILED"})
    new = _doc({"a": _samples(rng), "b": _samples(rng)})
    new["records"][1]["timing"]["mode"] = "cold"
    new["run"]["complete"] = False
    res = compare.compare_runs(base, new)
    assert res["rows"][0]["label"] == "FAILED->OK"  # fixed, not broken
    assert compare.compare_runs(base, base)["rows"][0]["label"] == "FAILED->FAILED"  # broken before, not by new
    assert "timing mode hot vs cold" in res["rows"][1]["notes"]
    assert "new run is incomplete (interrupted or crashed): only its finished cases compared" in res["env"]
    assert not any(line.startswith("base run") for line in res["env"])


def test_a_short_record_borrows_the_median_wander_of_the_run():
    rng = np.random.default_rng(16)

    def run():
        recs = {}
        for name, jump in (("calm", 1.01), ("mid", 1.05), ("wild", 1.3)):
            x = np.array(_samples(rng, n=400, sigma=0.005))
            x[200:] *= jump
            recs[name] = list(x)
        recs["short"] = _samples(rng, n=10, sigma=0.005)
        return _doc(recs)

    rows = {r["variant"]: r for r in compare.compare_runs(run(), run())["rows"]}
    own = [rows[v]["wander"] for v in ("calm", "mid", "wild")]
    assert own[0] < own[1] < own[2]
    assert rows["short"]["wander"] == pytest.approx(own[1]) and rows["short"]["wander_df"] == 0


def test_relative_compare_needs_rounds_of_equal_count():
    rng = np.random.default_rng(17)
    d = _interleaved_doc(rng, {"anchor": 1.0, "work": 1.0})
    d["records"][1]["timing"]["samples_s"] = d["records"][1]["timing"]["samples_s"][:500]
    row = compare.compare_runs(d, copy.deepcopy(d), relative=True)["rows"][1]
    assert row["label"] == "n/a" and "--interleave" in row["notes"][0]


def test_a_quantile_and_the_min_effect_are_what_the_table_shows():
    rng = np.random.default_rng(18)
    bs, ns = _samples(rng, sigma=0.1), _samples(rng, sigma=0.1)
    res = compare.compare_runs(_doc({"k": bs}), _doc({"k": ns}), quantile=0.2, min_effect=0.05)
    row = res["rows"][0]
    assert row["base_time"] == np.quantile(bs, 0.2) and row["new_time"] == np.quantile(ns, 0.2)
    text = compare.render(res)
    assert "ratio of the p20, min effect 5%" in text and "base p20" in text


def test_a_floor_of_zero_is_no_floor():
    rng = np.random.default_rng(19)
    base, new = _floored(_doc({"k": _samples(rng)}), 0.8 * T0), _floored(_doc({"k": _samples(rng)}), 0.0)
    row = compare.compare_runs(base, new, per_floor=True)["rows"][0]
    assert row["label"] == "n/a" and row["notes"][0].startswith("per floor: no floor for this point")


def test_within_run_merges_the_rotation_of_an_interleaved_order():
    """Two variants interleaved with their order rotated round by round, the one timed
    first in a round 10% slower: per round the ratio swings ×1.1 / ×0.91, per whole
    rotation it is ×1 — the same code reads SAME only when the rotation is merged."""
    rng = np.random.default_rng(22)
    n = 400
    first = np.where(np.arange(n) % 2 == 0, 1.1, 1.0)  # base first in even rounds, new first in odd ones
    base = {"samples_s": list(T0 * first * rng.lognormal(0.0, 0.005, n)), "rotation": 2}
    new = {"samples_s": list(T0 * first[::-1] * rng.lognormal(0.0, 0.005, n)), "rotation": 2}
    v = verdicts.within_run(base, new, interleaved=True)
    assert v.label == "SAME" and abs(v.ratio - 1) < 0.005, v.explain()
    assert verdicts.within_run(base, {**new, "rotation": 1}, interleaved=True).label == "UNSURE"


def test_the_environment_section_counts_a_move_from_the_min_effect():
    """A probe 3% slower is a move at a 2% min effect, steady at 5%; so is a run's wander."""
    rng = np.random.default_rng(23)
    p1 = {"version": 1, "samples_s": _samples(rng, n=200, sigma=0.002)}
    p2 = {"version": 1, "samples_s": _samples(rng, n=200, sigma=0.002, scale=1.03 * T0)}

    def wandering():
        x = np.array(_samples(rng, n=400, sigma=0.002))
        x[200:] *= 1.03
        return list(x)

    base, new = _doc({"k": wandering()}, probe=p1), _doc({"k": wandering()}, probe=p2)
    for effect, word in ((0.02, "moved"), (0.05, "steady")):
        env = "\n".join(compare.compare_runs(base, new, min_effect=effect)["env"])
        assert f"environment probe {word}: ×1.03" in env, (effect, env)
        assert ("timings wandered" in env) == (effect == 0.02), (effect, env)


def test_run_settings_that_can_move_timings_are_named_in_the_environment_section():
    """Rank count, backend, CPU threads, interleaving, the timing mode and the input seed
    are the run's, not the fingerprint's: a change of any of them is a line too."""
    rng = np.random.default_rng(21)
    base, new = _doc({"k": _samples(rng)}), _doc({"k": _samples(rng)})
    base["run"].update(world={"world_size": 2, "backend": "gloo"}, cpu_threads=1, interleave=False, seed=0,
                       timing={"mode": None})
    new["run"].update(world={"world_size": 8, "backend": "nccl"}, cpu_threads=2, interleave=True, seed=3,
                      timing={"mode": "graph"})
    env = "\n".join(compare.compare_runs(base, new)["env"])
    for text in ("ranks: 2 -> 8", "backend: gloo -> nccl", "CPU threads: 1 -> 2", "interleaved: False -> True",
                 "timing mode: None -> graph", "input seed: 0 -> 3"):
        assert text in env, (text, env)
    assert "ranks" not in "\n".join(compare.compare_runs(base, copy.deepcopy(base))["env"])


def test_a_note_with_a_pipe_or_a_newline_stays_in_its_markdown_cell():
    rng = np.random.default_rng(22)
    base = _doc({"k": _samples(rng)})
    new = _doc({"k": _samples(rng)}, status={"k": "FAILED"})
    new["records"][0]["reason"] = "TypeError: unsupported operand type(s) for |: 'int'\nand 'str'"
    out = compare.render(compare.compare_runs(base, new), "markdown")
    row = next(line for line in out.splitlines() if "BROKEN" in line)
    assert row.count(" | ") + row.count("| ") - row.count("\\|") >= 8 and "for \\|: 'int' and 'str'" in row, row
    cells = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    assert len(cells) == 9, cells
