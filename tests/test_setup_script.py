"""scripts/installed.py: when set-up may skip pip, and that it says why it may not."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from importlib import metadata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeDist:
    def __init__(self, requires, url, editable=True):
        self.requires = requires
        self._direct = {"url": url, "dir_info": {"editable": editable}}

    def read_text(self, name):
        return json.dumps(self._direct) if name == "direct_url.json" else None


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The script as a module, on a copy of pyproject.toml in tmp_path, recording into
    tmp_path, with `microbench`'s distribution replaced by ``installed.dist``."""
    spec = importlib.util.spec_from_file_location("installed_script", os.path.join(ROOT, "scripts", "installed.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "pyproject.toml").write_text(open(os.path.join(ROOT, "pyproject.toml")).read())
    monkeypatch.setattr(mod, "ROOT", str(tmp_path))
    monkeypatch.setattr(mod, "RECORD", str(tmp_path / "record.json"))
    mod.dist = FakeDist(["pytest>=1", 'no-such-dist-4f2a>=1; extra == "cupy12"'], tmp_path.as_uri())

    def distribution(name):
        assert name == "microbench"
        if mod.dist is None:
            raise metadata.PackageNotFoundError(name)
        return mod.dist

    monkeypatch.setattr(mod, "metadata", types.SimpleNamespace(
        distribution=distribution, version=metadata.version, PackageNotFoundError=metadata.PackageNotFoundError))
    return mod


def test_current_only_after_an_install_is_recorded(installed):
    assert installed.why_not_current() == "no install recorded in this environment"
    assert installed.main([]) == 1
    assert installed.main(["--record"]) == 0
    # the extra it does not install (cupy12) asks for a package nobody has: not its business
    assert installed.why_not_current() is None
    assert installed.main([]) == 0


def test_a_changed_pyproject_or_checkout_needs_an_install(installed, tmp_path, monkeypatch):
    installed.main(["--record"])
    with open(tmp_path / "pyproject.toml", "a") as f:
        f.write("\n# a comment is a change too: the hash cannot tell\n")
    assert "pyproject.toml or the checkout changed" in installed.why_not_current()
    installed.main(["--record"])
    assert installed.why_not_current() is None
    monkeypatch.setattr(installed, "ROOT", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "pyproject.toml").write_text((tmp_path / "pyproject.toml").read_text())
    assert "changed" in installed.why_not_current()


def test_the_package_must_be_installed_editable_from_this_checkout(installed, tmp_path):
    installed.main(["--record"])
    installed.dist = None
    assert installed.why_not_current() == "microbench is not installed"
    installed.dist = FakeDist([], tmp_path.as_uri(), editable=False)
    assert "not installed editable" in installed.why_not_current()
    installed.dist = FakeDist([], (tmp_path / "other").as_uri())
    assert "not installed editable" in installed.why_not_current()


@pytest.mark.parametrize("requirement, reason", [
    ("no-such-dist-4f2a>=1", "no-such-dist-4f2a is not installed"),
    ('no-such-dist-4f2a; extra == "test"', "no-such-dist-4f2a is not installed"),
    ("pytest>=999", f"pytest {metadata.version('pytest')} does not satisfy >=999"),
])
def test_a_requirement_removed_or_unsatisfied_needs_an_install(installed, tmp_path, requirement, reason):
    installed.main(["--record"])
    installed.dist = FakeDist(["pytest>=1", requirement], tmp_path.as_uri())
    assert installed.why_not_current() == reason


def test_an_unreadable_record_and_bad_arguments(installed, tmp_path):
    (tmp_path / "record.json").write_text("{not json")
    assert "unreadable install record" in installed.why_not_current()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "installed.py"), "--bogus"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "usage" in p.stderr
