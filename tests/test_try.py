"""`microbench try` / `scaffold`: a user's own file as a variant — accepted and timed when
correct, rejected at the small odd shapes when subtly wrong, and every kind of error in
the file reported as one block naming the file and line."""

from __future__ import annotations

import glob
import json
import os

import pytest

from microbench import cli_try
from microbench.cases import all_cases
from microbench.cli import main

from .helpers import DEVICE

QUICK = ["--case", "norm.rmsnorm", "--device", DEVICE, "--budget-s", "0.05", "--axis", "tokens=1",
         "--axis", "norm=kv_a", "--no-probe"]


@pytest.fixture
def scaffold(tmp_path, capsys):
    path = tmp_path / "mine.py"
    assert main(["scaffold", "--case", "norm.rmsnorm", str(path)]) == 0
    assert f"microbench try {path}::my_rmsnorm --case norm.rmsnorm" in capsys.readouterr().out
    return path


def test_scaffold_names_its_public_function(tmp_path, capsys):
    assert main(["scaffold", "--case", "attention.mla_verify", str(tmp_path / "m.py")]) == 0
    assert "m.py::my_mla --case attention.mla_verify" in capsys.readouterr().out


def test_a_correct_file_is_checked_gated_timed_and_compared(scaffold, tmp_path, capsys):
    out = tmp_path / "res"
    assert main(["try", f"{scaffold}::my_rmsnorm", *QUICK, "--out", str(out), "--format", "markdown"]) == 0
    cap = capsys.readouterr()
    assert cap.err.count("check ok ") >= 2 and "interleaved with the case's variants" in cap.err
    assert "| my_rmsnorm" in cap.out and "vs best" in cap.out
    (path,) = glob.glob(os.path.join(str(out), "*.json"))
    doc = json.load(open(path))
    mine = [r for r in doc["records"] if r["variant"] == "my_rmsnorm"]
    assert len(mine) == 1 and mine[0]["status"] == "OK" and mine[0]["vs_baseline"]["method"] == "paired-median"
    assert mine[0]["timing"]["interleaved"] and "tried" in doc["run"]
    assert "vs torch" in mine[0]["derived"]["vs best"] or "vs triton" in mine[0]["derived"]["vs best"]


def test_an_off_by_one_mask_is_rejected_at_the_odd_shapes_and_not_timed(scaffold, tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text(scaffold.read_text().replace("mask = offs < width", "mask = offs < width - 1"))
    assert main(["try", f"{bad}::my_rmsnorm", *QUICK, "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "check BAD tokens=5" in err and "elements off" in err and "seed" in err
    assert "incorrect at the small shapes above: not timed" in err
    assert not glob.glob(str(tmp_path / "r" / "*.json"))


@pytest.mark.parametrize(("source", "message"), [
    ("def f(x, weight, eps, out, residual=None):\n    return x +\n",
     ["cannot be loaded: SyntaxError", ":2: return x +"]),
    ("import no_such_module_anywhere\n", ["cannot be loaded: ModuleNotFoundError", ":1"]),
    ("def f(x, w):\n    return x\n", ["f(x, w) does not take the case's arguments",
                                      "norm.rmsnorm calls fn(", "Variant signature: fn(x, weight, eps, out"]),
    ("def helper():\n    raise RuntimeError('launch failed')\n\ndef f(x, weight, eps, out, residual=None):\n"
     "    helper()\n", ["RuntimeError: launch failed", ":2 in helper: raise RuntimeError('launch failed')"]),
])
def test_errors_in_the_file_are_one_block_with_file_and_line(tmp_path, capsys, source, message):
    p = tmp_path / "user.py"
    p.write_text(source)
    assert main(["try", f"{p}::f", *QUICK, "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    for m in message:
        assert m in err, err
    assert "Traceback" not in err and "microbench/runner.py" not in err


@pytest.mark.parametrize(("target", "message", "rc"), [
    ("nope.py::f", "no such file", 2),  # the command line's mistakes: exit 2
    ("{file}", "expected FILE::FUNCTION", 2),
    ("{dir}::f", "a folder, not a Python file", 2),
    ("{file}::g", "no function 'g'", 1),  # the file's: exit 1
])
def test_bad_targets(tmp_path, capsys, target, message, rc):
    p = tmp_path / "u.py"
    p.write_text("def f(x, weight, eps, out, residual=None):\n    pass\n")
    assert main(["try", target.format(file=p, dir=tmp_path), *QUICK]) == rc
    assert message in capsys.readouterr().err


def test_a_variant_name_the_case_has_is_refused_and_an_exit_in_the_file_is_its_error(scaffold, tmp_path, capsys):
    assert main(["try", f"{scaffold}::my_rmsnorm", "--name", "torch", *QUICK]) == 2
    assert ("variant name 'torch' is taken in norm.rmsnorm (its variants: torch, triton): choose another with "
            "--name") in capsys.readouterr().err
    p = tmp_path / "leaves.py"
    p.write_text("import sys\n\ndef f(x, weight, eps, out, residual=None):\n    sys.exit(0)\n")
    assert main(["try", f"{p}::f", *QUICK, "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "SystemExit: 0" in err and "leaves.py:4 in f" in err and "not timed" in err


def test_every_scaffold_passes_its_gate_unchanged(tmp_path):
    from microbench.usercode import WithVariant, load_variant

    cases = [c for c in all_cases() if c.scaffold() is not None]
    # every case with a reference ships one (the launch floor checks nothing: it has none)
    assert {c.id for c in all_cases()} - {c.id for c in cases} == {"calibration.launch"}
    for case in cases:
        if case.distributed:  # as `try` runs them: one rank, in process
            from microbench.distributed import solo_world

            solo_world(DEVICE)
        path = tmp_path / f"{case.id}.py"
        assert main(["scaffold", "--case", case.id, str(path)]) == 0
        fn = cli_try.scaffold_function(path.read_text())
        small = [p for p in cli_try_points(case)]
        v = load_variant(f"{path}::{fn}", case, small[0], DEVICE)
        checks = cli_try._check_small(WithVariant(case, v), v, DEVICE, 0)
        assert checks and all(ok for _, _, ok in checks), [t for _, t, ok in checks if not ok]


def cli_try_points(case):
    from microbench.case import expand

    return [p for p in expand(case.check_axes(DEVICE)) if not case.skip(p, DEVICE)]


def test_scaffold_refuses_to_overwrite_and_names_cases_without_one(scaffold, capsys):
    assert main(["scaffold", "--case", "norm.rmsnorm", str(scaffold)]) == 2
    assert "exists: pass --force" in capsys.readouterr().err
    assert main(["scaffold", "--case", "calibration.launch"]) == 2
    assert "calibration.launch has no scaffold yet (cases with one: calibration.copy" in capsys.readouterr().err


def test_watch_prints_one_line_per_save(scaffold, monkeypatch, capsys):
    calls = {"n": 0}

    def sleep(_):
        calls["n"] += 1
        if calls["n"] == 1:  # the user saves a broken version
            text = scaffold.read_text().replace("mask = offs < width", "mask = offs < width - 1")
            scaffold.write_text(text)
            os.utime(scaffold, ns=(os.stat(scaffold).st_mtime_ns + 10**9,) * 2)
            return
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_try.time, "sleep", sleep)
    monkeypatch.setattr(cli_try, "WATCH_BUDGET_S", 0.05)
    assert main(["try", f"{scaffold}::my_rmsnorm", *QUICK, "--watch"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert len(lines) == 2
    assert " correct " in lines[0] and "vs torch" in lines[0]
    assert " INCORRECT " in lines[1] and "elements off" in lines[1]


def test_ctrl_c_while_timing_keeps_what_finished_and_exits_130(scaffold, tmp_path, capsys):
    """Ctrl-C (here raised from the variant itself once the checks passed) ends `try` as
    it ends `run`: the table of what finished, the file marked interrupted, exit 130."""
    src = scaffold.read_text() + (
        "\n_calls = [0]\n\n\ndef stopping(x, weight, eps, out, residual=None):\n"
        "    _calls[0] += 1\n    if _calls[0] > 60:\n        raise KeyboardInterrupt\n"
        "    return my_rmsnorm(x, weight, eps, out, residual)\n")
    path = tmp_path / "stopping.py"
    path.write_text(src)
    out = tmp_path / "res"
    argv = ["try", f"{path}::stopping", *QUICK[:-5], "--axis", "tokens=1,5", "--axis", "norm=kv_a,input", "--no-probe"]
    assert main([*argv, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "interrupted:" in err and "(marked incomplete)" in err and "Traceback" not in err
    (result,) = glob.glob(os.path.join(str(out), "*.json"))
    doc = json.load(open(result))
    assert doc["run"]["interrupted"] and not doc["run"]["complete"]


def test_ctrl_c_outside_a_commands_own_handling_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(a):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_try, "cmd_try", interrupted)
    import microbench.cli as cli_mod

    parser = cli_mod.build_parser

    def patched():
        p = parser()
        p._subparsers._group_actions[0].choices["try"].set_defaults(func=interrupted)
        return p
    monkeypatch.setattr(cli_mod, "build_parser", patched)
    assert main(["try", "x.py::f", "--case", "norm.rmsnorm"]) == 130
    assert capsys.readouterr().err.strip() == "microbench: interrupted"
