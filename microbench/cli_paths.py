"""Where a command writes, checked before it does any work: one line and exit 2 for a
path it could not write (a file where a folder should be, a missing or read-only
folder), rather than a traceback after minutes of builds or timings."""

from __future__ import annotations

import os

from microbench.cli import UsageError


def _writable_folder(path: str) -> str | None:
    """Why files cannot be made in folder ``path`` (made if missing), or None: the nearest
    existing ancestor must be a folder this process can write in."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"no permission to write in {probe}"
    return None


def check_output_dir(path: str, flag: str) -> None:
    """UsageError (one line) unless ``path`` is a writable folder; a missing one is made."""
    if not path:
        raise UsageError(f"{flag}: an empty path")
    why = _writable_folder(path)
    if not why:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            why = f"cannot make it ({e.strerror or e})"
    if why:
        raise UsageError(f"{flag} {path}: {why}")


def check_output_file(path: str, flag: str, make_parents: bool = False) -> None:
    """UsageError (one line) unless a file can be written at ``path``: not a folder, in a
    writable folder that exists (or, with ``make_parents``, is made). An existing file is
    replaced: callers that must not replace it check first."""
    if not path:
        raise UsageError(f"{flag}: an empty path")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: a folder, not a file")
    parent = os.path.dirname(os.path.abspath(path))
    if make_parents:
        check_output_dir(parent, f"{flag} {path}: folder")
    elif not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: no folder {parent}")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: no permission to write in {parent}")
