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


def _failing_after(scaffold, tmp_path, name, calls, error):
    """A copy of the scaffold with ``name``: the scaffold's function for ``calls`` calls
    (the small-shape checks pass), then ``raise error``."""
    path = tmp_path / f"{name}.py"
    path.write_text(scaffold.read_text() + (
        f"\n_calls = [0]\n\n\ndef {name}(x, weight, eps, out, residual=None):\n"
        f"    _calls[0] += 1\n    if _calls[0] > {calls}:\n        raise {error}\n"
        "    return my_rmsnorm(x, weight, eps, out, residual)\n"))
    return path


def test_ctrl_c_while_timing_keeps_what_finished_and_exits_130(scaffold, tmp_path, capsys):
    """Ctrl-C (here raised from the variant itself once the checks passed) ends `try` as
    it ends `run`: the table of what finished, the file marked interrupted, exit 130."""
    path = _failing_after(scaffold, tmp_path, "stopping", 60, "KeyboardInterrupt")
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


def test_a_tried_variant_failing_while_timed_fails_alone(scaffold, tmp_path, capsys):
    """Its error in the timing loop (out of memory at a timed shape, say) is its own: the
    case's variants keep their times and the table its verdicts."""
    path = _failing_after(scaffold, tmp_path, "late", 12, "RuntimeError('out of memory at a timed shape')")
    out = tmp_path / "res"
    assert main(["try", f"{path}::late", *QUICK, "--out", str(out)]) == 1
    (result,) = glob.glob(os.path.join(str(out), "*.json"))
    by = {r["variant"]: r for r in json.load(open(result))["records"]}
    assert by["late"]["status"] == "FAILED" and "out of memory at a timed shape" in by["late"]["reason"]
    assert by["torch"]["status"] == by["triton"]["status"] == "OK"


def test_a_file_imports_the_modules_beside_it_and_reads_them_again_when_loaded_again(tmp_path):
    from microbench.usercode import load_function

    (tmp_path / "helper_scale.py").write_text("FACTOR = 2\n")
    main_file = tmp_path / "uses_helper.py"
    main_file.write_text("from helper_scale import FACTOR\n\n\ndef f():\n    return FACTOR\n")
    assert load_function(str(main_file), "f")() == 2
    (tmp_path / "helper_scale.py").write_text("FACTOR = 3\n")
    assert load_function(str(main_file), "f")() == 3  # an edited helper is not a stale one


def test_a_jit_kernel_named_as_the_variant_is_told_to_name_its_launcher(tmp_path):
    from microbench.usercode import UserCodeError, load_function

    path = tmp_path / "kern.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef k(x_ptr):\n    pass\n")
    with pytest.raises(UserCodeError, match="k is a @triton.jit kernel: name the Python function that launches it"):
        load_function(str(path), "k")


def test_the_line_of_an_error_raised_from_another_is_the_users(tmp_path):
    from microbench.usercode import load_function, where

    path = tmp_path / "deep.py"
    path.write_text("def inner():\n    raise ValueError('in the kernel body')\n")
    inner = load_function(str(path), "inner")
    try:
        try:
            inner()
        except ValueError as e:  # what Triton's interpreter does: its own error, from the kernel's
            raise RuntimeError("InterpreterError") from e
    except RuntimeError as err:
        assert where(err, str(path)) == f"{path}:2 in inner: raise ValueError('in the kernel body')"
