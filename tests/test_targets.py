"""Speed targets: declarations checked, verdicts read off intervals, and every shipped
target able to find its points in a GPU run of the verify suite."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from microbench import targets
from microbench.cases import all_cases
from microbench.case import expand
from microbench.planning import variant_skip
from microbench.targets import Target

US = 1e-6


def _rec(variant, axes, median, n=60, sigma=0.01, seed=0, status="OK", case="c.k", floor=None, baseline="base",
         reason=None):
    rng = np.random.default_rng(seed)
    samples = list(median * np.exp(rng.normal(0.0, sigma, n)))
    r = {"case": case, "axes": dict(axes), "variant": variant, "baseline": baseline, "device": "cuda",
         "status": status, "reason": reason}
    if status == "OK":
        r["timing"] = {"samples_s": samples, "summary": {"median": float(np.median(samples)), "count": n,
                                                   "rel_noise": sigma}}
        if floor is not None:
            r["floor_s"] = floor
    return r


def _doc(records, device="cuda", gpu="NVIDIA H200", complete=True):
    return {"run": {"id": "r1", "device": device, "min_effect": 0.02, "complete": complete},
            "fingerprint": {"device": {"name": gpu}}, "records": records}


def _rows(t, recs, **kw):
    return targets.evaluate({"c.k": [t]}, _doc(recs, **kw))


@pytest.mark.parametrize("kw, msg", [
    ({"kind": "faster"}, "kind 'faster'"),
    ({"bar": 0}, "bar must be a positive number"),
    ({"bar": float("nan")}, "bar must be a positive number"),
    ({"bar": float("inf")}, "bar must be a positive number"),
    ({"variants": "new"}, "non-empty tuple"),
    ({"ref": None}, "needs ref"),
    ({"kind": "floor"}, "takes no ref"),
    ({"ref": "new"}, "one of its own variants"),
    ({"where": {"t": 4}}, r"where\['t'\]"),
    ({"where": {"t": ()}}, r"where\['t'\]"),
])
def test_bad_target_is_refused_naming_the_field(kw, msg):
    args = {"text": "x", "variants": ("new",), "kind": "speedup", "bar": 2.0, "ref": "base", **kw}
    with pytest.raises(ValueError, match=msg):
        Target(**args)


def test_speedup_verdicts_follow_the_interval():
    """2x a reference that is 2.4x, 1.6x and exactly 2x slower: MET, MISSED, UNSURE
    (the interval of a ratio that sits on the bar straddles it)."""
    t = Target("2x base", ("new",), "speedup", 2.0, ref="other")
    for ratio, want in ((2.4, "MET"), (1.6, "MISSED"), (2.0, "UNSURE")):
        recs = [_rec("new", {"t": 4}, 10 * US, seed=1), _rec("other", {"t": 4}, ratio * 10 * US, seed=2)]
        (row,) = _rows(t, recs)
        assert row["verdict"] == want, (ratio, row)
        assert row["lo"] <= row["value"] <= row["hi"] and abs(row["value"] - ratio) < 0.02 * ratio


def test_speedup_over_the_baseline_is_the_tables_own_verdict():
    """Against the case's baseline the row reuses the record's vs_baseline (paired when the
    run interleaved), so the targets and the table never disagree."""
    t = Target("2x base", ("new",), "speedup", 2.0, ref="base")
    new = _rec("new", {"t": 4}, 10 * US)
    new["vs_baseline"] = {"ratio": 0.25, "lo": 0.24, "hi": 0.26, "label": "FASTER"}
    (row,) = _rows(t, [new, _rec("base", {"t": 4}, 20 * US)])
    assert row["value"] == pytest.approx(4.0) and row["verdict"] == "MET"
    assert (row["lo"], row["hi"]) == (pytest.approx(1 / 0.26), pytest.approx(1 / 0.24))


@pytest.mark.parametrize("kind, bar, lo, hi, want", [
    ("speedup", 2.0, 0.25, 0.5, "MET"),  # speedup in [2, 4]: on the bar is at least the bar
    ("speedup", 2.0, 0.5, 1.0, "UNSURE"),  # [1, 2]: touches the bar, so not wholly short of it
    ("time_ratio", 1.25, 1.0, 1.25, "MET"),  # [1, 1.25]: at most the bar
    ("time_ratio", 1.25, 1.25, 1.5, "UNSURE"),
])
def test_an_interval_that_touches_the_bar(kind, bar, lo, hi, want):
    """MET: the whole interval on the bar's side, the bar itself included; MISSED only when
    the whole interval is beyond it (exact binary fractions, read off vs_baseline)."""
    t = Target("bar", ("new",), kind, bar, ref="base")
    new = _rec("new", {"t": 4}, 10 * US)
    new["vs_baseline"] = {"ratio": (lo + hi) / 2, "lo": lo, "hi": hi, "label": "FASTER"}
    (row,) = _rows(t, [new, _rec("base", {"t": 4}, 20 * US)])
    assert row["verdict"] == want, row


def test_a_speedup_over_another_variant_ignores_the_baseline_verdict():
    """vs_baseline is the ratio to the case's baseline: a bar against another variant reads
    the two variants' own samples (1.6x here), not the 4x over the baseline."""
    t = Target("2x other", ("new",), "speedup", 2.0, ref="other")
    new = _rec("new", {"t": 4}, 10 * US, seed=1)
    new["vs_baseline"] = {"ratio": 0.25, "lo": 0.24, "hi": 0.26, "label": "FASTER"}
    (row,) = _rows(t, [new, _rec("other", {"t": 4}, 16 * US, seed=2), _rec("base", {"t": 4}, 40 * US, seed=3)])
    assert row["value"] == pytest.approx(1.6, rel=0.02) and row["verdict"] == "MISSED", row


def test_an_interleaved_run_pairs_its_rounds():
    """Interleaved, both variants see each round's drift, so the paired ratio of 1.13 is
    MISSED against a 1.10 bar; the same samples read as a sequential run's stay UNSURE."""
    rng = np.random.default_rng(12)
    drift = np.repeat([1.0, 1.06, 0.94], 40)
    base = 10 * US * drift * np.exp(rng.normal(0, 0.003, 120))
    new = 1.13 * base * np.exp(rng.normal(0, 0.003, 120))
    t = Target("within 10%", ("new",), "time_ratio", 1.10, ref="decode")
    recs = [_rec("new", {"t": 1}, 11.3 * US), _rec("decode", {"t": 1}, 10 * US)]
    recs[0]["timing"].update(samples_s=list(new), passes=[40, 40, 40])
    recs[1]["timing"].update(samples_s=list(base), passes=[40, 40, 40])
    for interleave, verdict in ((True, "MISSED"), (False, "UNSURE")):
        doc = _doc(recs)
        doc["run"]["interleave"] = interleave
        (row,) = targets.evaluate({"c.k": [t]}, doc)
        assert row["verdict"] == verdict and row["value"] == pytest.approx(1.13, rel=0.01), (interleave, row)


def test_a_ratio_to_another_variant_is_widened_by_the_runs_wander():
    """Two variants timed at different moments of a sequential run: the machine drifting 6%
    between passes makes a ratio of 1.13 against a 1.10 bar UNSURE, as the table's own
    verdicts would call it, not a MISSED read off the two sample clouds alone."""
    rng = np.random.default_rng(11)
    drift = [1.0, 1.06, 0.94]

    def passes(median):
        return [x for d in drift for x in median * d * np.exp(rng.normal(0, 0.003, 40))]

    t = Target("within 10%", ("new",), "time_ratio", 1.10, ref="decode")
    recs = [_rec("new", {"t": 1}, 11.3 * US), _rec("decode", {"t": 1}, 10 * US)]
    recs[0]["timing"].update(samples_s=passes(11.3 * US), passes=[40, 40, 40])
    recs[1]["timing"].update(samples_s=list(reversed(passes(10 * US))), passes=[40, 40, 40])
    (row,) = _rows(t, recs)
    assert row["value"] == pytest.approx(1.13, rel=0.03) and row["verdict"] == "UNSURE", row
    assert row["lo"] < 1.0 < 1.2 < row["hi"]


def test_time_ratio_and_floor():
    within = Target("within 10% of decode", ("new",), "time_ratio", 1.10, ref="decode")
    recs = [_rec("new", {"t": 1}, 10.4 * US, seed=3), _rec("decode", {"t": 1}, 10 * US, seed=4),
            _rec("new", {"t": 2}, 13 * US, seed=5), _rec("decode", {"t": 2}, 10 * US, seed=6)]
    rows = {r["point"]: r for r in _rows(within, recs)}
    assert rows["t=1"]["verdict"] == "MET" and rows["t=2"]["verdict"] == "MISSED"
    assert rows["t=2"]["value"] == pytest.approx(1.3, rel=0.02)
    floor = Target("80% of the floor", ("new",), "floor", 0.8)
    recs = [_rec("new", {"t": 1}, 10 * US, floor=9 * US), _rec("new", {"t": 2}, 10 * US, floor=7 * US),
            _rec("new", {"t": 3}, 10 * US, n=4, floor=9 * US)]
    rows = {r["point"]: r for r in _rows(floor, recs)}  # floors from a datasheet: exact as stated
    assert rows["t=1"]["verdict"] == "MET" and rows["t=1"]["value"] == pytest.approx(0.9, rel=0.01)
    assert rows["t=2"]["verdict"] == "MISSED"
    # four samples: no interval for the median, so no verdict either way
    assert rows["t=3"]["verdict"] == "UNSURE" and rows["t=3"]["hi"] == math.inf


def _measured_floor(copy_noise):
    """A point whose floor (9 µs) comes from the copy bandwidth this run measured, with
    that copy's median known to ``copy_noise``."""
    copy = _rec("torch", {"bytes": 1 << 30}, 1e-3, case="calibration.copy", baseline="torch")
    copy["bytes"], copy["timing"]["summary"]["rel_noise"] = 1 << 30, copy_noise
    bw = (1 << 30) / copy["timing"]["summary"]["median"]
    rec = _rec("new", {"t": 1}, 10 * US, floor=9 * US)
    rec.update(bytes=9 * US * bw, floor_source="measured in this run")
    doc = _doc([rec, copy])
    doc["run"]["ceilings"] = {"memory_bandwidth": {"value": bw, "unit": "B/s", "source": "calibration.copy in this run",
                                                   "axes": {"bytes": 1 << 30}}}
    return doc


def test_a_measured_floor_carries_its_ceilings_noise():
    floor = Target("80% of the floor", ("new",), "floor", 0.8)
    exact = targets.evaluate({"c.k": [floor]}, _measured_floor(0.0))[0]
    (quiet,) = targets.evaluate({"c.k": [floor]}, _measured_floor(0.01))
    assert quiet["verdict"] == "MET" and quiet["value"] == pytest.approx(exact["value"])
    assert quiet["lo"] < exact["lo"] and quiet["hi"] > exact["hi"]
    assert math.log(exact["value"] / quiet["lo"]) == pytest.approx(
        math.hypot(math.log(exact["value"] / exact["lo"]), math.log1p(0.01)))
    (loud,) = targets.evaluate({"c.k": [floor]}, _measured_floor(0.2))  # 0.9 of a floor known to ±20%
    assert loud["verdict"] == "UNSURE" and loud["lo"] < 0.8
    lost = _measured_floor(0.01)
    lost["records"].pop()  # the copy's record is not in the file: how well the floor is known, unknown
    (row,) = targets.evaluate({"c.k": [floor]}, lost)
    assert row["verdict"] == "UNSURE" and "no record in this file says" in row["why"]


def test_a_value_a_bar_names_that_the_file_lacks_is_a_row():
    t = Target("80% of the floor at 16K keys and more", ("new",), "floor", 0.8, where={"t": (1, 2)})
    rows = _rows(t, [_rec("new", {"t": 1}, 10 * US, floor=9 * US)])
    assert [(r["point"], r["verdict"]) for r in rows] == [("-", "MET"), ("t=2", None)]
    assert rows[1]["why"] == "no such point in this file"


def test_variants_timed_one_after_the_other_too_short_to_show_their_wander_are_unsure():
    t = Target("8x extend", ("verify",), "speedup", 8.0, ref="extend")
    recs = [_rec("verify", {"t": 1}, 11 * US, n=8, baseline="other"), _rec("extend", {"t": 1}, 100 * US, n=8)]
    (row,) = _rows(t, recs)
    assert row["lo"] > 8.0 and row["verdict"] == "UNSURE" and "too few samples to see" in row["why"], row
    recs = [_rec("verify", {"t": 1}, 11 * US, n=60, baseline="other"), _rec("extend", {"t": 1}, 100 * US, n=60)]
    assert _rows(t, recs)[0]["verdict"] == "MET"


def test_rows_without_a_time_say_why():
    t = Target("2x other", ("new", "alt"), "speedup", 2.0, ref="other", where={"t": (4,)})
    recs = [_rec("new", {"t": 4}, 10 * US), _rec("other", {"t": 4}, 0, status="FAILED", reason="max abs err 3.1"),
            _rec("alt", {"t": 4}, 0, status="SKIPPED", reason="not on this GPU"), _rec("new", {"t": 8}, 10 * US)]
    rows = {r["variant"]: r for r in _rows(t, recs)}
    assert rows["new"]["verdict"] == "NO TIME" and rows["new"]["why"] == "other: FAILED (max abs err 3.1)"
    assert rows["alt"]["why"] == "alt: SKIPPED (not on this GPU); other: FAILED (max abs err 3.1)"
    # a floor target on a record with no floor (no ceiling) has no time to judge either
    (row,) = _rows(Target("floor", ("new",), "floor", 0.5), [_rec("new", {"t": 4}, 10 * US)])
    assert row["verdict"] == "NO TIME" and "no floor" in row["why"]
    # points the file does not hold: one row, no verdict
    (row,) = _rows(Target("far", ("new",), "floor", 0.5, where={"t": (64,)}), recs)
    assert row["verdict"] is None and row["why"] == "no such point in this file"
    (row,) = targets.evaluate({"c.k": [Target("far", ("new",), "floor", 0.5, where={"t": (64,)})]}, _doc(recs),
                              selected=True)
    assert row["why"] == "no such point among the records selected"
    # a time the statistics refuse is said, not a crash
    bad = _rec("new", {"t": 4}, 10 * US, floor=US)
    bad["timing"]["samples_s"] = [0.0] * 10
    (row,) = _rows(Target("floor", ("new",), "floor", 0.5), [bad])
    assert row["verdict"] == "NO TIME" and "median time 0.0" in row["why"]


def test_a_failed_variant_gets_no_verdict_though_it_has_samples():
    """A later --repeat pass that fails marks the record FAILED and keeps the first pass's
    samples: no verdict is read off them."""
    t = Target("2x other", ("new",), "speedup", 2.0, ref="other")
    new = _rec("new", {"t": 4}, 10 * US)
    new.update(status="FAILED", reason="pass 2: incorrect")
    (row,) = _rows(t, [new, _rec("other", {"t": 4}, 30 * US)])
    assert (row["verdict"], row["value"], row["why"]) == ("NO TIME", None, "new: FAILED (pass 2: incorrect)")


def test_a_target_covers_only_points_that_have_its_axes():
    t = Target("at t=4", ("new",), "floor", 0.5, where={"t": (4,)})
    (row,) = _rows(t, [_rec("new", {"u": 4}, 10 * US, floor=9 * US)])
    assert row["verdict"] is None and row["why"] == "no such point in this file"


def test_a_floor_interval_brackets_its_value():
    floor = Target("80% of the floor", ("new",), "floor", 0.8)
    (row,) = _rows(floor, [_rec("new", {"t": 1}, 10 * US, floor=9 * US)])
    assert row["lo"] < row["value"] < row["hi"] and row["value"] == pytest.approx(0.9, rel=0.01)
    # four samples bound no median: [0, inf], shown as such; a file that does not say
    # whether its run finished is not called incomplete
    doc = _doc([_rec("new", {"t": 1}, 10 * US, n=4, floor=9 * US)])
    del doc["run"]["complete"]
    text = targets.render(doc, targets.evaluate({"c.k": [floor]}, doc))
    assert "[0.0%, ∞]" in text and "UNSURE" in text and "INCOMPLETE" not in text


def test_render_names_whose_bar_it_is():
    t = Target("2x other", ("new",), "speedup", 2.0, ref="other", stated_for="h200-sxm", details=("config",))
    recs = [_rec("new", {"t": 4}, 10 * US), _rec("other", {"t": 4}, 30 * US)]
    recs[1]["derived"] = {"config": "tuned"}
    doc = _doc(recs, gpu="NVIDIA H100 80GB HBM3")
    text = targets.render(doc, targets.evaluate({"c.k": [t]}, doc), "markdown")
    assert "| MET " in text and "other config=tuned" in text and "1 MET" in text
    assert "bars stated for h200-sxm; this run's GPU is NVIDIA H100 80GB HBM3 (profile h100-sxm)" in text
    doc = _doc(recs, gpu="NVIDIA H200")
    assert "bars stated for" not in targets.render(doc, targets.evaluate({"c.k": [t]}, doc))
    # a CPU run shows what it measured and judges nothing
    doc = _doc(recs, device="cpu", complete=False)
    text = targets.render(doc, targets.evaluate({"c.k": [t]}, doc))
    (row,) = [line for line in text.splitlines() if line.startswith("c.k")]
    assert "n/a (CPU)" in row and "MET" not in row and "no verdicts on a CPU run" in text
    assert "INCOMPLETE run" in text


def test_every_shipped_target_finds_its_points_in_the_verify_suite():
    """A target's variants, reference and axis values are the case's own, and the verify
    suite on a GPU runs at least one point of each (a typo would leave the bar unread)."""
    seen = 0
    for case in all_cases():
        names = {v.name for v in case.variants()}
        axes = case.axes("verify", "cuda")
        for t in case.targets():
            seen += 1
            assert set(t.variants) <= names and (t.ref is None or t.ref in names), (case.id, t.text)
            for axis, values in t.where.items():
                assert axis in axes and set(values) <= set(axes[axis]), (case.id, t.text, axis)
            points = [p for p in expand(axes) if t.covers(p) and case.skip(p, "cuda") is None]
            assert points, (case.id, t.text)
            for v in (*t.variants, *([t.ref] if t.ref else [])):
                assert any(variant_skip(case, case.variant(v), p, "cuda") is None for p in points), (case.id, v)
    assert seen >= 5


def test_cli_targets(tmp_path, capsys):
    from microbench.cli import main

    recs = [_rec("verify", {"batch": 1, "draft_tokens": 4, "context": 16384}, 10 * US, case="attention.mla_verify",
                 baseline="extend"),
            _rec("extend", {"batch": 1, "draft_tokens": 4, "context": 16384}, 50 * US, case="attention.mla_verify",
                 baseline="extend")]
    from microbench.results import SCHEMA, SCHEMA_VERSION

    def write(doc):
        path.write_text(json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **doc}))

    path = tmp_path / "run.json"
    write(_doc(recs))
    assert main(["targets", str(path)]) == 0
    out = capsys.readouterr().out
    assert "8x the extend kernel" in out and "5.00×" in out and "MISSED" in out
    assert main(["targets", str(path), "--fail-on", "missed"]) == 1
    capsys.readouterr()
    # --variant keeps the variant a kept one is measured against, and leaves the others' rows out
    assert main(["targets", str(path), "--variant", "verify"]) == 0
    out = capsys.readouterr().out
    assert "5.00×" in out and "extend: not in this file" not in out and "verify_dv2" not in out
    assert main(["targets", str(path), "--case", "moe"]) == 2  # no such case in the file
    assert "--case moe: no such case" in capsys.readouterr().err
    assert main(["targets", str(path), "--variant", "extend"]) == 0
    assert "no speed target is stated for extend" in capsys.readouterr().out
    # a file with both cases: --case and --variant together keep what the kept bars need
    moe = {"layout": "kimi-tp8", "weights": "int4", "tokens": 4, "routing": "router", "dtype": "bf16"}
    both = recs + [_rec("few_token", moe, 10 * US, case="moe.experts", baseline="fused", floor=8 * US),
                   _rec("fused", moe, 20 * US, case="moe.experts", baseline="fused")]
    write(_doc(both))
    assert main(["targets", str(path), "--case", "moe", "--variant", "few_token"]) == 0
    out = capsys.readouterr().out
    assert "2.00×" in out and re.search(r" (79\.\d|80\.\d)% ", out) and "2 MET" in out and "attention" not in out
    assert main(["targets", str(path), "--case", "attention", "--variant", "verify", "--axis", "batch=1"]) == 0
    out = capsys.readouterr().out
    assert "5.00×" in out and "no such point among the records selected" in out and "moe" not in out
    # a CPU run is not judged, so it cannot fail --fail-on missed
    write(_doc(both, device="cpu"))
    assert main(["targets", str(path), "--fail-on", "missed"]) == 0
    assert "n/a (CPU)" in capsys.readouterr().out
    write(_doc([_rec("x", {"t": 1}, US, case="norm.rmsnorm")]))
    assert main(["targets", str(path)]) == 0
    assert "states a speed target (cases that do: attention.mla_verify, moe.experts)" in capsys.readouterr().out


def test_a_gpu_run_prints_the_targets_it_reached():
    """`microbench run` adds the table after a GPU run that timed a target's points: not
    after a CPU run, nor one whose points none of the targets covers."""
    at = {"batch": 1, "draft_tokens": 1, "context": 1024, "page": 1, "dtype": "bf16"}
    recs = [_rec("verify", at, 10 * US, case="attention.mla_verify", baseline="extend"),
            _rec("decode", at, 10 * US, seed=9, case="attention.mla_verify", baseline="extend")]
    text = targets.for_run(_doc(recs), "markdown")
    assert "within 10% of the decode kernel" in text and "| context=1024" not in text and "| MET " in text
    assert "8x the extend kernel" not in text  # the points it did not reach are not listed
    assert targets.for_run(_doc(recs, device="cpu")) == "" and targets.for_run(_doc(recs), "csv") == ""
    far = [dict(r, axes={**at, "batch": 4}) for r in recs]
    assert targets.for_run(_doc(far)) == ""


def test_a_tried_variant_is_read_against_every_bar():
    """`microbench try` reads the user's variant against the case's bars, beside the case's
    own variants: a kernel that is 2x slower than decode at q_len 1 reads MISSED there."""
    at = {"batch": 1, "draft_tokens": 1, "context": 1024, "page": 1, "dtype": "bf16"}
    recs = [_rec(v, at, t * US, seed=i, case="attention.mla_verify", baseline="extend")
            for i, (v, t) in enumerate([("verify", 10), ("decode", 10), ("mine", 20)])]
    text = targets.for_run(_doc(recs), also="mine")
    (row,) = [line for line in text.splitlines() if " mine " in line]
    assert "2.00×" in row and "MISSED" in row
    assert "| mine |" not in targets.for_run(_doc(recs), "markdown")  # not asked for: the case's own alone


def test_every_shipped_target_round_trips_through_json():
    for ts in targets.stated().values():
        for t in ts:
            assert Target.from_dict(json.loads(json.dumps(t.to_dict()))) == t


@pytest.mark.parametrize("raw, msg", [
    ({"c.k": [{"text": "x", "variants": ["v"], "kind": "speedup"}]}, r"run.targets\['c.k'\]: a stored target needs"),
    ({"c.k": [{"text": "x", "variants": ["v"], "kind": "speedup", "bar": 2, "ref": "b", "where": [1]}]},
     "where must be an object"),
    ({"c.k": [{"text": "x", "variants": ["v"], "kind": "speedup", "bar": -1, "ref": "b"}]},
     "bar must be a positive number"),
    ({"c.k": {"text": "x"}}, r"run.targets\['c.k'\] must be a list"),
    (["c.k"], "run.targets must be an object"),
])
def test_a_malformed_stored_bar_is_refused_naming_it(raw, msg):
    doc = _doc([])
    doc["run"]["targets"] = raw
    with pytest.raises(ValueError, match=msg):
        targets.of_run(doc)


def _verify_run(bar=None):
    """An H200 run at the 8x point: verify 5x the extend kernel; ``bar``: the 8x bar as
    the run stored it, changed to ``bar`` (None: the file stores no bars)."""
    at = {"batch": 1, "draft_tokens": 4, "context": 16384}
    doc = _doc([_rec("verify", at, 10 * US, case="attention.mla_verify", baseline="extend"),
                _rec("extend", at, 50 * US, case="attention.mla_verify", baseline="extend")])
    doc["fingerprint"]["git"] = {"short": "abc1234"}
    if bar is not None:
        from dataclasses import replace

        ts = targets.stated()["attention.mla_verify"]
        doc["run"]["targets"] = {"attention.mla_verify": [
            replace(t, bar=bar).to_dict() if t.kind == "speedup" else t.to_dict() for t in ts]}
    return doc


def test_a_file_is_read_against_the_bars_its_run_stored():
    """A run stores its bars; a file is read against those by default, today's on request,
    and the line under the table says whose, naming a case where the two differ."""
    speed = "8x the extend kernel at q_len 4, batch 1, 16K keys"
    same = _verify_run(bar=8.0)
    chosen, line = targets.bars(same)
    assert chosen == {"attention.mla_verify": targets.stated()["attention.mla_verify"]}
    assert line == "bars: as the run (made at abc1234) stated them"

    older = _verify_run(bar=4.0)  # its code asked 4x: 5x is MET there, MISSED against today's 8x
    for source, verdict, says in [(None, "MET", "today's code states other bars for attention.mla_verify: "
                                               "--bars code reads those"),
                                  ("run", "MET", "--bars code"),
                                  ("code", "MISSED", "the run (made at abc1234) stated other bars")]:
        chosen, line = targets.bars(older, source)
        (row,) = [r for r in targets.evaluate(chosen, older) if r["target"].text == speed and r["variant"] == "verify"]
        assert row["verdict"] == verdict and row["target"].bar == (8.0 if source == "code" else 4.0)
        assert says in line
        assert line in targets.render(older, [row], "text", line)
    # the table printed after the run reads the run's own bars too
    assert re.search(r"\| MET +\|", targets.for_run(older, "markdown"))

    old = _verify_run()  # written before runs stored bars: today's, said so; --bars run refused
    chosen, line = targets.bars(old)
    assert chosen == targets.stated() and "this file was written before runs stored their bars" in line
    with pytest.raises(ValueError, match="stores no bars"):
        targets.bars(old, "run")


def test_cli_targets_bars(tmp_path, capsys):
    from microbench.cli import main
    from microbench.results import SCHEMA, SCHEMA_VERSION

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **_verify_run(bar=4.0)}))
    assert main(["targets", str(path), "--fail-on", "missed", "--variant", "verify"]) == 0
    out = capsys.readouterr().out
    assert "bars: as the run (made at abc1234) stated them; today's code states other bars" in out
    assert main(["targets", str(path), "--fail-on", "missed", "--variant", "verify", "--bars", "code"]) == 1
    assert "bars: today's code; the run" in capsys.readouterr().out
    path.write_text(json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **_verify_run()}))
    assert main(["targets", str(path), "--bars", "run"]) == 2
    err = capsys.readouterr().err
    assert "stores no bars" in err and "Traceback" not in err


def test_a_run_stores_the_bars_its_cases_state():
    import argparse

    from microbench.cli import run_meta

    class Broken:
        id = "x.broken"

        def targets(self):
            raise ValueError("a bad bar")

    cases = [c for c in all_cases() if c.id in ("attention.mla_verify", "norm.rmsnorm")] + [Broken()]
    opts = argparse.Namespace(suite="verify", device="cuda", timing=argparse.Namespace(), repeat=1)
    a = argparse.Namespace(seed=0, interleave=False, min_effect=0.02, threads=None)
    meta = json.loads(json.dumps(run_meta(a, opts, cases)))
    assert list(meta["targets"]) == ["attention.mla_verify"]  # rmsnorm states none; the broken one is left out
    assert targets.of_run({"run": meta}) == {"attention.mla_verify": targets.stated()["attention.mla_verify"]}
