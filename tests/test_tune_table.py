"""`microbench tune` and the table it updates: a table that cannot be read (not JSON, not
this schema, another device's) or written stops it before any search, in one line;
`--out` updates its own file; points that write the same entries are tuned once; a GPU
with little shared memory searches from its own default."""

from __future__ import annotations

import json

import pytest

from microbench import cli
from microbench import tune as tune_mod
from microbench.cases import moe as moe_cases
from microbench.kernels.moe_tuning import TuningTable, default_config, search_space

TUNE = ["tune", "--device", "cpu", "--max-trials", "1", "--budget-s", "0.02"]


@pytest.fixture
def trials(monkeypatch, tmp_path):
    """Candidates judged without running them (each 1 µs): the labels tried, in order."""
    monkeypatch.setattr(moe_cases, "TUNING_DIR", str(tmp_path / "tuning"))
    labels: list[str] = []

    def judged(self, fn, w, expected, label=""):
        labels.append(label)
        return 1e-6
    monkeypatch.setattr(tune_mod.Trial, "__call__", judged)
    return labels


@pytest.mark.parametrize(("text", "why"), [
    pytest.param('{"schema": "microbench.moe_tuning", "ver', "not JSON", id="truncated"),
    pytest.param("[]", "not a microbench.moe_tuning v1 file", id="a-list"),
    pytest.param('{"schema": "microbench.moe_tuning", "version": 1, "device": "cpu", "entries": null}',
                 "'entries' a list", id="entries-null"),
    pytest.param('{"schema": "microbench.moe_tuning", "version": 1, "device": "cpu", "entries": [3]}',
                 "entry 0: an object expected", id="entry-a-number"),
    pytest.param('{"schema": "microbench.moe_tuning", "version": 1, "device": "nvidia-h200", "entries": []}',
                 "tuned on nvidia-h200, not cpu", id="another-device"),
])
def test_a_table_that_cannot_be_read_stops_tune_before_any_search(trials, tmp_path, capsys, text, why):
    table = tmp_path / "tuning" / "cpu.json"
    table.parent.mkdir()
    table.write_text(text)
    with pytest.raises(ValueError, match=why):
        TuningTable.load(str(table), "cpu")
    assert cli.main([*TUNE, "--axis", "weights=bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"tuning table {table}: cannot be updated" in err and why in err, err
    assert trials == [] and table.read_text() == text
    # the same file given as --out is refused alike
    assert cli.main([*TUNE, "--axis", "weights=bf16", "--out", str(table)]) == 2
    assert f"--out {table}: cannot be updated" in capsys.readouterr().err and table.read_text() == text


def test_a_table_folder_that_cannot_be_written_stops_tune_before_any_search(monkeypatch, trials, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setattr(moe_cases, "TUNING_DIR", str(afile / "tuning"))
    assert cli.main([*TUNE, "--axis", "weights=bf16"]) == 2
    assert f"{afile} is not a folder" in capsys.readouterr().err and trials == []


def test_out_updates_its_own_file_and_leaves_the_device_table_alone(trials, tmp_path, capsys):
    out = tmp_path / "mine.json"
    assert cli.main([*TUNE, "--axis", "weights=bf16", "--out", str(out)]) == 0
    assert cli.main([*TUNE, "--axis", "weights=int4", "--out", str(out)]) == 0
    entries = json.loads(out.read_text())["entries"]
    assert {e["weights"] for e in entries} == {"bf16", "int4"} and len(entries) == 6
    assert not (tmp_path / "tuning" / "cpu.json").exists()


def test_points_that_write_the_same_entries_are_tuned_once(trials, capsys):
    case = moe_cases.MoEExpertsCase()
    point = {"layout": "mini", "weights": "bf16", "tokens": 4, "routing": "router", "dtype": "fp16"}
    items = [(case, point), (case, {**point, "routing": "distinct"}), (case, {**point, "tokens": 8}),
             (case, {**point, "layout": "kimi-tp8"}), (case, {**point, "layout": "dsv3-tp8"})]
    kept, shared = tune_mod.distinct_items(items)
    assert [p for _, p in kept] == [items[0][1], items[2][1], items[3][1]] and shared == 2
    logs: list[str] = []
    rows, written, unsaved = tune_mod.tune(items[:2], "cpu", max_trials=1, log=logs.append)
    assert len(trials) == 3 and {r["routing"] for r in rows} == {"router"}  # one point's three searches
    assert "1 point(s) share their table entries with an earlier one" in logs[0] and len(written) == 1 and not unsaved


def test_a_gpu_with_little_shared_memory_searches_from_its_own_default():
    args = ("few_token", "w13", "bf16", 512, 7168, 4)
    small = search_space(*args, small_shared=True)
    assert small[0] == default_config(*args, small_shared=True) and small[0].num_stages == 2
    assert {c.num_stages for c in small} == {2, 3}
    assert {c.num_stages for c in search_space(*args)} == {3, 4}


def test_a_table_that_cannot_be_written_keeps_the_search_and_its_winners_printed(trials, monkeypatch, tmp_path,
                                                                                 capsys):
    def full(self, path=None):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(TuningTable, "save", full)
    assert cli.main([*TUNE, "--axis", "weights=bf16"]) == 1
    out, err = capsys.readouterr()
    assert len(trials) == 3 and "few_token" in out  # every search ran, its winners in the table
    assert "the tuning table could not be written (No space left on device)" in err
    assert "no table holds the winners of 1 point(s)" in err


def test_a_failed_table_write_leaves_the_old_table_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    TuningTable("cpu", [], None).save(str(path))
    before = path.read_text()

    def full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(json, "dump", full)
    with pytest.raises(OSError):
        TuningTable("cpu", [], None).save(str(path))
    assert path.read_text() == before and not (tmp_path / "t.json.tmp").exists()
