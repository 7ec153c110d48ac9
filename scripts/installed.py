"""Whether this Python environment already holds what scripts/setup.sh installs, so that
set-up can skip pip (about 10 s for the editable build alone, on every `scripts/test`).

    python scripts/installed.py            exit 0: up to date; exit 1: the reason, on stderr
    python scripts/installed.py --record   after an install: remember pyproject.toml's state

Up to date means all of:
  - the install was recorded for this checkout and this exact pyproject.toml (its hash):
    a changed dependency, package directory or package-data rule needs a new install;
  - `microbench` is installed editable from this checkout;
  - every requirement of the package and of its `test` extra that applies to this
    platform is installed, at a version its specifier allows (nothing was removed or
    swapped since).
The record lives in the environment itself (sys.prefix), so a new environment installs.
Standard library only, plus `packaging` (pip's own copy when none is installed).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib import metadata
from urllib.parse import unquote, urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(sys.prefix, ".microbench-install.json")
EXTRAS = ("test",)


def _state() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"root": ROOT, "pyproject_sha256": digest, "extras": list(EXTRAS)}


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def why_not_current() -> str | None:
    """None when the environment is up to date, else why not (one line)."""
    try:
        with open(RECORD) as f:
            recorded = json.load(f)
    except FileNotFoundError:
        return "no install recorded in this environment"
    except (OSError, ValueError) as e:
        return f"unreadable install record {RECORD}: {e}"
    if recorded != _state():
        return "pyproject.toml or the checkout changed since the last install"
    try:
        dist = metadata.distribution("microbench")
    except metadata.PackageNotFoundError:
        return "microbench is not installed"
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    where = urlparse(direct.get("url", "")).path
    if not direct.get("dir_info", {}).get("editable") or os.path.realpath(unquote(where)) != os.path.realpath(ROOT):
        return f"microbench is not installed editable from {ROOT}"
    Requirement = _requirement_class()
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *EXTRAS)):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            return f"{req.name} is not installed"
        if not req.specifier.contains(have, prereleases=True):
            return f"{req.name} {have} does not satisfy {req.specifier}"
    return None


def main(argv: list[str]) -> int:
    if argv == ["--record"]:
        with open(RECORD + ".tmp", "w") as f:
            json.dump(_state(), f)
        os.replace(RECORD + ".tmp", RECORD)
        return 0
    if argv:
        print(f"usage: {sys.argv[0]} [--record]", file=sys.stderr)
        return 2
    why = why_not_current()
    if why:
        print(why, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
