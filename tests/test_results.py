"""Result files: schema round trip, atomic writes, never overwriting, clear load errors."""

from __future__ import annotations

import datetime
import json
import os
import re
import time

import pytest

from microbench.results import (
    SCHEMA_VERSION,
    ResultError,
    ResultWriter,
    load,
    record_key,
    result_filename,
    write_atomic,
)

FP = {"git": {"short": "abc1234"}, "host": {"hostname": "gpu-host"}}


def _rec(**kw):
    r = {"case": "c", "axes": {"tokens": 4}, "variant": "v", "status": "OK",
         "timing": {"samples_s": [1e-3, 2e-3], "summary": {"median": 1.5e-3, "count": 2, "rel_noise": 0.5}}}
    r.update(kw)
    return r


def test_round_trip_keeps_everything(tmp_path):
    w = ResultWriter(str(tmp_path), {"suite": "smoke"}, FP)
    w.add([_rec(), _rec(variant="w", status="FAILED", reason="incorrect")])
    path = w.close(complete=True)
    doc = load(path)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["run"]["complete"] is True
    assert doc["records"][0]["timing"]["samples_s"] == [1e-3, 2e-3]
    assert doc["records"][1]["reason"] == "incorrect"
    assert os.path.basename(path).endswith("_gpu-host_abc1234.json")


def test_two_writers_in_the_same_second_never_share_a_file(tmp_path):
    paths = {ResultWriter(str(tmp_path), {}, FP).path for _ in range(3)}
    assert len(paths) == 3 and all(os.path.exists(p) for p in paths)


def test_a_run_is_on_disk_before_it_finishes_and_marked_incomplete(tmp_path):
    w = ResultWriter(str(tmp_path), {}, FP, min_interval_s=0.0)
    w.add([_rec()])
    w.flush()
    assert load(w.path)["run"]["complete"] is False and len(load(w.path)["records"]) == 1
    w.close(complete=False, interrupted=True)
    assert load(w.path)["run"]["interrupted"] is True


def test_result_files_keep_the_permissions_a_new_file_gets(tmp_path):
    # a later write replaces the file with a temporary one, which starts private (0600)
    old = os.umask(0o022)
    try:
        w = ResultWriter(str(tmp_path), {}, FP, min_interval_s=0.0)
        w.add([_rec()])
        w.flush()
        assert os.stat(w.path).st_mode & 0o777 == 0o644
        os.chmod(w.path, 0o640)  # and a mode the owner set stays
        w.close(complete=True)
        assert os.stat(w.path).st_mode & 0o777 == 0o640
        write_atomic(str(tmp_path / "fresh.json"), {"a": 1})
        assert os.stat(tmp_path / "fresh.json").st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


def test_flushes_are_rate_limited_but_close_always_writes(tmp_path):
    w = ResultWriter(str(tmp_path), {}, FP, min_interval_s=3600.0)  # the creating write started the window
    w.add([_rec()])
    w.flush()
    assert load(w.path)["records"] == []  # inside the window: not rewritten
    w.flush(force=True)
    assert len(load(w.path)["records"]) == 1
    w.add([_rec(variant="w")])
    w.close(complete=True)
    doc = load(w.path)
    assert doc["run"]["complete"] is True and [r["variant"] for r in doc["records"]] == ["v", "w"]


def test_a_gzip_compressed_result_file_loads_as_the_plain_one(tmp_path):
    import gzip

    path = ResultWriter(str(tmp_path), {"suite": "smoke"}, FP).close(complete=True)
    gz = str(tmp_path / "r.json.gz")
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        dst.write(src.read())
    assert load(gz) == load(path)
    with open(str(tmp_path / "cut.json.gz"), "wb") as f:
        f.write(open(gz, "rb").read()[:20])
    with pytest.raises(ResultError, match="cut.json.gz: cannot read"):
        load(str(tmp_path / "cut.json.gz"))


def test_atomic_write_leaves_the_old_file_when_serialisation_fails(tmp_path):
    path = str(tmp_path / "r.json")
    write_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_atomic(path, {"a": object()})
    assert json.load(open(path)) == {"a": 1}
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / "r.json")
    write_atomic(path, {"a": 1})
    during = []

    def full_disk(fd):
        during.append(sorted(os.listdir(tmp_path)))
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, {"a": 2})
    # the new text went to a temporary file beside the result (so os.replace stays on one
    # file system), synced before it could replace it; the failure removed it
    (names,) = during
    assert len(names) == 2 and "r.json" in names and any(n.endswith(".tmp") for n in names)
    assert json.load(open(path)) == {"a": 1} and os.listdir(tmp_path) == ["r.json"]


def test_close_records_how_the_run_ended(tmp_path):
    w = ResultWriter(str(tmp_path), {}, FP)
    w.close(complete=False, error="RuntimeError: boom")
    run = load(w.path)["run"]
    assert (run["complete"], run["interrupted"], run["error"]) == (False, False, "RuntimeError: boom")
    assert run["finished_utc"].endswith("Z")


def test_filename_without_git_says_so():
    assert result_filename(None, "h").endswith("_h_nogit.json")


def test_filename_is_utc_time_host_and_sha(monkeypatch):
    when = datetime.datetime(2025, 3, 4, 5, 6, 7, tzinfo=datetime.timezone.utc)
    assert result_filename("abc1234", "gpu host/7", when) == "20250304T050607Z_gpu-host-7_abc1234.json"
    # without a time: now, in UTC whatever the machine's time zone (here UTC+5:30)
    monkeypatch.setenv("TZ", "IST-5:30")
    time.tzset()
    try:
        before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        name = result_filename("abc1234", "h")
        after = datetime.datetime.now(datetime.timezone.utc)
    finally:
        monkeypatch.undo()
        time.tzset()
    stamp = datetime.datetime.strptime(name.split("_")[0], "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.timezone.utc)
    assert before <= stamp <= after, (name, before, after)


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not a JSON result file"),
    (json.dumps({"hello": 1}), "not a microbench result file"),
    (json.dumps({"schema": "microbench.result", "schema_version": 99, "run": {}, "records": []}), "schema version 99"),
    (json.dumps({"schema": "microbench.result", "schema_version": SCHEMA_VERSION, "run": {}, "records": [{"x": 1}]}),
     "record 0 is malformed"),
    (json.dumps({"schema": "microbench.result", "schema_version": SCHEMA_VERSION, "run": {},
                 "records": [{"case": "c", "axes": {}, "variant": "v", "status": "MAYBE"}]}), "unknown status"),
])
def test_bad_files_give_one_clear_error(tmp_path, content, message):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(ResultError, match=message):
        load(str(p))


def _set(path, value):
    """A change to a record: its key path (a.b.c, or a list index) set to value (None: deleted)."""
    def apply(r):
        *where, last = path.split(".")
        for k in where:
            r = r[int(k)] if isinstance(r, list) else r[k]
        if value is None and not isinstance(r, list):
            del r[last]
        else:
            r[int(last) if isinstance(r, list) else last] = value
    return apply


@pytest.mark.parametrize(("change", "message"), [
    (_set("timing.samples_s.1", 0.0), "timing sample 1 is 0.0: a time must be a finite number > 0"),
    (_set("timing.samples_s.0", float("nan")), "timing sample 0 is nan"),
    (_set("timing.samples_s.0", -1e-3), "timing sample 0 is -0.001"),
    (_set("timing.samples_s.0", "fast"), "timing sample 0 is 'fast'"),
    (_set("timing.samples_s", []), "timing has no samples"),
    (_set("timing.samples_s", None), "timing has no samples"),
    (_set("timing", {}), "timing has no samples"),
    (_set("timing", "fast"), "timing must be an object"),
    (_set("timing.summary", None), "timing has no positive median"),
    (_set("timing.summary.median", float("inf")), "timing has no positive median"),
    (_set("timing.summary.count", 0), "summary.count 0 is not a count"),
    (_set("timing.summary.rel_noise", float("nan")), "summary.rel_noise nan is not a number >= 0"),
    (_set("timing.summary.tick", -1e-6), "summary.tick -1e-06 is not a finite number >= 0"),
    (_set("timing.resolution_s", "fine"), "resolution_s 'fine' is not a finite number >= 0"),
    (_set("timing.passes", [1, 2]), "passes [1, 2] do not add up to its 2 samples"),
    (_set("timing.rotation", "two"), "rotation 'two' is not a count"),
    (_set("timing.rotations", [2, 2]), "rotations [2, 2] are not one count per pass"),
    (_set("axes", [4]), "axes must be an object"),
    (_set("axes", {"tokens": [4]}), "axes must be an object"),
    (_set("variant", 3), "case and variant must be strings"),
    (_set("floor_s", -1.0), "floor_s -1.0 is not a finite number >= 0"),
    (_set("gbps", "x"), "gbps 'x' is not a finite number >= 0"),
    (_set("bytes", True), "bytes True is not a finite number >= 0"),
    (_set("facts", "big"), "facts must be an object"),
    (_set("vs_baseline", {"label": "SAME"}), "vs_baseline must be an object with a label, a positive ratio"),
    (_set("vs_baseline", {"ratio": 0}), "vs_baseline must be an object with a label, a positive ratio"),
    (_set("vs_baseline", {"label": "SAME", "ratio": 1.0}), "vs_baseline must be an object with a label"),
    (_set("reason", 5), "reason 5 is not a string"),
    (_set("floor_source", ["h200"]), "floor_source ['h200'] is not a string"),
    (_set("timing.notes", [1]), "timing's notes must be a list of strings"),
    (_set("timing.mode", ["hot"]), "timing's notes must be a list of strings and its mode a string"),
    (_set("probe", {"samples_s": ["fast"]}), "probe.samples_s must be a list of finite times > 0"),
    (_set("probe", {"samples_s": [0.0, 1e-3]}), "probe.samples_s must be a list of finite times > 0"),
    (_set("clocks", {"sm_clock_mhz": {"mean": "fast"}}), "clocks.sm_clock_mhz must be an object whose mean"),
    (_set("clocks", {"throttle_reasons": 5}), "clocks.throttle_reasons must be a list of names"),
])
def test_a_record_the_commands_cannot_read_is_refused_by_name(tmp_path, change, message):
    """A record with parts no run writes (a time of 0 or NaN, bookkeeping that does not add
    up, a string where a number goes) is refused at load, naming the record and the part,
    rather than crashing whichever command reads that part."""
    w = ResultWriter(str(tmp_path), {"suite": "smoke"}, FP)
    w.add([_rec(), _rec(variant="w", timing={**_rec()["timing"], "passes": [2], "rotations": [1]})])
    path = w.close(complete=True)
    load(path)  # as written: fine
    doc = json.load(open(path))
    change(doc["records"][1])
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(ResultError) as e:
        load(path)
    assert "record 1 (c " in str(e.value) and message in str(e.value), str(e.value)


@pytest.mark.parametrize(("doc", "message"), [
    ({"fingerprint": None}, "the fingerprint, and its device"),
    ({"fingerprint": {"device": "NVIDIA H200"}}, "the fingerprint, and its device"),
    ({"run": {"ceilings": "fast"}}, "run.ceilings must be an object"),
    ({"run": {"targets": ["attention.mla_verify"]}}, "run.targets must be an object"),
    ({"run": {"summaries": "none"}}, "run.summaries must be an object"),
    ({"records": None}, "malformed result file (missing run or records)"),
    ({"run": None}, "malformed result file (missing run or records)"),
    ({"schema_version": "1"}, "schema version '1' but"),
    ({"schema_version": True}, "schema version True but"),
    ({"run": {"ceilings": {"memory_bandwidth": 5}}}, "run.ceilings.memory_bandwidth must be an object with a"),
    ({"run": {"ceilings": {"memory_bandwidth": {"value": "x", "source": "s"}}}}, "run.ceilings.memory_bandwidth"),
    ({"run": {"summaries": {"c": [{}]}}}, "run.summaries.c must be a list of lines"),
    ({"run": {"summaries": {"c": 5}}}, "run.summaries.c must be a list of lines"),
    ({"records": [_rec(), _rec()]}, "records 0 and 1 are both c"),
])
def test_a_file_whose_parts_are_of_the_wrong_kind_is_refused(tmp_path, doc, message):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"schema": "microbench.result", "schema_version": SCHEMA_VERSION, "run": {},
                             "fingerprint": FP, "records": [_rec()], **doc}))
    with pytest.raises(ResultError, match=re.escape(message)):
        load(str(p))


def test_a_document_nested_too_deeply_to_read_is_refused(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ResultError, match="nested too deeply"):
        load(str(p))


def test_missing_file(tmp_path):
    with pytest.raises(ResultError, match="no such file"):
        load(str(tmp_path / "nope.json"))


def test_a_records_identity_does_not_depend_on_the_order_of_its_axes():
    a, b = _rec(axes={"tokens": 4, "weights": "int4"}), _rec(axes={"weights": "int4", "tokens": 4})
    assert record_key(a) == record_key(b) != record_key(_rec(axes={"tokens": 8, "weights": "int4"}))


def _doc(records, summaries=None):
    run = {"summaries": summaries} if summaries else {}
    return {"schema": "microbench.result", "schema_version": SCHEMA_VERSION, "run": run, "records": records}


def test_select_keeps_what_every_filter_matches_and_names_what_is_not_there():
    from microbench.results import select

    recs = [_rec(case=c, variant=v, axes={"tokens": t, "weights": w})
            for c in ("moe.experts", "moe.router", "attention.mla_verify") for v in ("a", "b")
            for t in (1, 4) for w in ("int4", "bf16")]
    int4 = {"text": "b / a by tokens (weights=int4)", "axes": {"weights": "int4"}, "variants": ["b", "a"]}
    bf16 = {**int4, "text": "b / a by tokens (weights=bf16)", "axes": {"weights": "bf16"}}
    doc = _doc(recs, {"moe.experts": [int4, bf16, "about the whole case"], "attention.mla_verify": ["other"]})
    (got,) = select([doc], cases=["moe"])  # a dotted prefix: both moe.* cases
    assert {r["case"] for r in got["records"]} == {"moe.experts", "moe.router"}
    assert got["run"]["summaries"] == {"moe.experts": [int4, bf16, "about the whole case"]}
    (got,) = select([doc], cases=["moe.experts"], variants=["b"], axes={"tokens": ["4"], "weights": ["int4"]})
    assert [(r["variant"], r["axes"]["tokens"]) for r in got["records"]] == [("b", 4)]
    # the int4 line (it spans tokens, names b) stays, the bf16 one goes with its points
    assert got["run"]["summaries"] == {"moe.experts": [int4, "about the whole case"]}
    assert len(doc["records"]) == 24 and len(doc["run"]["summaries"]) == 2  # the loaded document is untouched
    for kw, message in ((dict(cases=["mo"]), "--case mo: no such case; cases in the result file: "
                                             "attention.mla_verify, moe.experts, moe.router"),
                        (dict(variants=["c"]), "--variant c: no such variant; variants in the result file: a, b"),
                        (dict(axes={"batch": ["1"]}), "--axis batch: no such axis; axes in the result file: tokens, "
                                                      "weights"),
                        (dict(axes={"tokens": ["3"]}), "--axis tokens=3: no such value; tokens values in the result "
                                                       "file: 1, 4"),
                        (dict(cases=["attention"], variants=["a"], axes={"weights": ["int4"], "tokens": ["1"]}), None)):
        if message is None:
            assert len(select([doc], **kw)[0]["records"]) == 1
            continue
        with pytest.raises(ResultError) as e:
            select([doc], **kw)
        assert str(e.value) == message
    # two files (compare): a name either one holds is fine, and each keeps its own records
    new = _doc([_rec(case="moe.experts", variant="c", axes={"tokens": 1, "weights": "int4"})])
    base, newer = select([doc, new], variants=["c"])
    assert base["records"] == [] and len(newer["records"]) == 1
    with pytest.raises(ResultError, match="no record matches --case, --variant and --axis together"):
        select([doc, new], variants=["c"], axes={"weights": ["bf16"]})  # each exists, not together


def test_select_reads_an_axis_value_as_run_does():
    """``--axis bytes=1K`` names the 1024-byte point, as ``run --axis bytes=1K`` made it; a
    text the case's parser refuses is matched as typed."""
    from microbench.results import select

    doc = _doc([_rec(case="comm.allreduce_sweep", axes={"bytes": b}) for b in (8, 1024)])

    def parse(case_id, axis, text):
        assert (case_id, axis) == ("comm.allreduce_sweep", "bytes")
        if text.endswith("K"):
            return int(text[:-1]) * 1024
        raise ValueError(text)

    (got,) = select([doc], axes={"bytes": ["1K"]}, parse=parse)
    assert [r["axes"]["bytes"] for r in got["records"]] == [1024]
    (got,) = select([doc], axes={"bytes": ["8", "1K"]}, parse=parse)
    assert len(got["records"]) == 2
    with pytest.raises(ResultError, match="--axis bytes=2K: no such value; bytes values in the result file: 1024, 8"):
        select([doc], axes={"bytes": ["2K"]}, parse=parse)
    with pytest.raises(ResultError, match="--axis bytes=1K: no such value"):
        select([doc], axes={"bytes": ["1K"]})  # without the case's reading, as typed


def test_the_ranks_file_brings_its_summaries_into_the_runs(tmp_path):
    from microbench.ranks import _merge

    ranks = ResultWriter(str(tmp_path / "ranks"), {}, FP)
    ranks.add([_rec(case="comm.x")])
    ranks.doc["run"]["summaries"] = {"comm.x": [{"text": "t", "axes": {}, "variants": []}]}
    ranks.close(complete=True)
    main = ResultWriter(str(tmp_path / "main"), {"summaries": {"c": ["mine"]}}, FP)
    assert _merge(str(tmp_path / "ranks"), main) == 1
    assert main.doc["run"]["summaries"] == {"c": ["mine"], "comm.x": [{"text": "t", "axes": {}, "variants": []}]}


def test_a_write_that_fails_does_not_stop_the_run_and_its_file_lands_elsewhere(tmp_path, monkeypatch, capsys):
    """A full disk under the run's folder: flushes say so once and the run goes on; the
    last write goes to the fallback folder and says where."""
    from microbench import results

    out, fallback = tmp_path / "out", tmp_path / "fallback"
    monkeypatch.setattr(results, "FALLBACK_DIR", str(fallback))
    w = ResultWriter(str(out), {"suite": "smoke"}, FP, min_interval_s=0)
    real = results.write_atomic

    def full(path, doc, indent=None):
        if path.startswith(str(out)):
            raise OSError(28, "No space left on device")
        real(path, doc, indent)
    monkeypatch.setattr(results, "write_atomic", full)
    for i in range(3):
        w.add([_rec(variant=f"v{i}")])
        w.flush()  # no exception: the run goes on
    err = capsys.readouterr().err
    assert err.count("cannot write") == 1 and "No space left on device" in err
    path = w.close(complete=True)
    assert path.startswith(str(fallback)) and len(load(path)["records"]) == 3
    assert f"the results are in {path}" in capsys.readouterr().err
    # nowhere to write at all: None, and both places named
    monkeypatch.setattr(results, "write_atomic", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    w2 = ResultWriter(str(out), {"suite": "smoke"}, FP)
    assert w2.close(complete=True) is None
    assert "the results could not be written" in capsys.readouterr().err


def test_a_folder_removed_under_a_run_is_made_again_for_its_last_write(tmp_path):
    import shutil

    out = tmp_path / "out"
    w = ResultWriter(str(out), {"suite": "smoke"}, FP, min_interval_s=0)
    w.add([_rec()])
    shutil.rmtree(out)
    w.flush()  # the folder is gone: said, not raised
    path = w.close(complete=True)
    assert path == w.path and path.startswith(str(out)) and load(path)["records"]
