"""What a run prints as it ends: the table of an interrupted run and where its file is,
the speed-target table, the results line (``run`` and ``try`` alike)."""

from __future__ import annotations

import sys
from typing import Any

from microbench.cli import EXIT_INTERRUPTED


def close_interrupted(writer: Any, fmt: str) -> int:
    """Ctrl-C or SIGTERM during a run: its file closed as incomplete, the table of what it
    finished, where that is; the exit status."""
    from microbench import report

    path = writer.close(complete=False, interrupted=True)
    print(report.render(writer.doc, fmt), end="")
    print(f"interrupted: {len(writer.records)} records " + (f"kept in {path} (marked incomplete)" if path else
                                                            "(not written: see above)"), file=sys.stderr)
    return EXIT_INTERRUPTED


def results_line(path: str | None, what: str = "results") -> None:
    """Where the run's file is, on stderr; nothing when none could be written (the writer
    said why)."""
    if path:
        print(f"{what}: {path}", file=sys.stderr)


def print_targets(command: str, doc: dict[str, Any], fmt: str, path: str, also: str | None = None) -> None:
    """After a GPU run that reached a case's speed-target points, their table (with
    ``also``, a tried variant, read against every bar too); never fails the command."""
    from microbench.targets import for_run

    try:
        goals = for_run(doc, fmt, also=also)
    except Exception as e:  # noqa: BLE001 - the run and its file are done; this table is extra
        goals = ""
        print(f"microbench {command}: the speed-target table failed ({type(e).__name__}: {e}); "
              f"`microbench targets {path}` reads them", file=sys.stderr)
    print("\n" + goals if goals else "", end="")
