"""The interpreter's debug checks: int32 overflow and device asserts, run or skipped.

Triton's interpreter redoes every int32 add, sub and mul a kernel makes in int64 and
compares the result with the int32 bounds (``sanitize_overflow``, on by default), then
hands that to a device assert that does nothing unless ``debug`` is set, and the
interpreter never sets it (Triton 3.6 to 3.9): the default pays for a check it throws
away, about a third of an interpreted MoE kernel's time. :func:`set_checks` makes the
two agree: on, an int32 overflow or a failed ``tl.device_assert`` raises an error (the
interpreter wraps the ``AssertionError``); off, neither is computed, and an overflow
wraps as it does in a compiled kernel built without ``debug``.

``tests/conftest.py`` turns them off unless pytest is given ``--triton-checks``, which
``scripts/test-triton-floor`` gives: every kernel's tests run once in CI with the checks.
"""

from __future__ import annotations

import dataclasses

_FIELDS = ("sanitize_overflow", "debug")


def interpreter_builder():
    """The interpreter's builder, whose ``options`` its semantics read at each operation;
    None where this Triton has none with both options."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not all(hasattr(options, f) for f in _FIELDS):
        return None
    return builder


def set_checks(on: bool) -> bool:
    """Run (True) or skip (False) the interpreter's overflow checks and device asserts;
    False where this Triton's interpreter has no such options (nothing is changed then).
    Takes effect at the next interpreted operation."""
    builder = interpreter_builder()
    if builder is None:
        return False
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=on, debug=on)
    return True


def checks() -> bool | None:
    """Whether the interpreter runs its debug checks now (None: it has no such options)."""
    builder = interpreter_builder()
    if builder is None:
        return None
    return builder.options.sanitize_overflow and builder.options.debug
