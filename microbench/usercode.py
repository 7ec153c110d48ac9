"""A kernel developer's own file as a variant of any case: load it, check its signature,
wrap it so its errors name its file and line, and add it to the case.

``load_variant("path/to/my_kernel.py::my_fn", case)`` imports the file (any path, not
installed) under a private module name, finds the function, checks that it accepts the
case's arguments (by binding a real workload's argument names, before any launch), and
returns a :class:`~microbench.case.Variant` whose call reports an exception raised in the
user's code as :class:`UserCodeError`: the error, then the deepest frame in the user's
file (``file:line in function`` and the source line) — never a traceback through the
harness. :func:`with_variant` makes a case that runs its own variants plus that one.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import traceback
from typing import Any, Callable, Sequence

from microbench.case import Case, Point, Variant, Workload
from microbench.outcome import error_chain


class UserCodeError(Exception):
    """The user's file failed (to load, to bind, or in a call): one block, file and line."""


def where(e: BaseException, path: str) -> str:
    """``path:line in func: source`` of the deepest traceback frame inside ``path`` (or of a
    SyntaxError's position), else ''."""
    if isinstance(e, SyntaxError) and e.filename and os.path.abspath(e.filename) == os.path.abspath(path):
        return f"{path}:{e.lineno}: {(e.text or '').strip()}"
    # the error raised from (or during) another: Triton's interpreter raises its own error
    # from the one in the kernel's body, whose frames alone reach the kernel's line
    for err in reversed(error_chain(e)):  # the deepest cause first
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if os.path.abspath(f.filename) == os.path.abspath(path)]
        if frames:
            f = frames[-1]
            return f"{path}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
    return ""


def error_summary(e: BaseException, max_lines: int = 1) -> str:
    """``Type: message`` in at most ``max_lines`` lines; a Triton compile error as its
    position and its reason (the last line of its message), then the source line it points
    at with the caret under it."""
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    name = type(e).__name__
    if "CompilationError" in name or any(ln.strip() == "^" for ln in lines):
        caret = next((i for i, ln in enumerate(lines) if ln.strip() == "^"), None)
        reason = lines[-1].strip() if lines and caret != len(lines) - 1 else ""
        head = f"{name}: {lines[0].rstrip(':') if lines else ''}: {reason}".rstrip(": ")
        return head + (f"\n    {lines[caret - 1]}\n    {lines[caret]}" if caret else "")
    return "\n".join([f"{name}: {lines[0] if lines else ''}".rstrip(": "), *lines[1:max_lines]])


def describe(e: BaseException, path: str) -> str:
    """:func:`error_summary`, with the deepest frame in the user's file after its first line."""
    head, _, rest = error_summary(e).partition("\n")
    at = where(e, path)
    return head + (f"\n  at {at}" if at else "") + (f"\n{rest}" if rest else "")


def parse_target(target: str) -> tuple[str, str]:
    """``FILE::FUNCTION`` -> (file, function); UserCodeError when malformed or missing."""
    path, sep, name = target.rpartition("::")
    if not sep or not path or not name.isidentifier():
        raise UserCodeError(f"{target!r}: expected FILE::FUNCTION, e.g. my_kernel.py::my_rmsnorm")
    if os.path.isdir(path):
        raise UserCodeError(f"{path}: a folder, not a Python file")
    if not os.path.isfile(path):
        raise UserCodeError(f"{path}: no such file")
    return path, name


def load_function(path: str, name: str) -> Callable[..., Any]:
    """Import ``path`` fresh (a new module each time, so an edited file is re-read) and
    return its ``name``; UserCodeError naming the file and line on any failure."""
    mod_name = f"microbench_user_{abs(hash(os.path.abspath(path)))}_{os.stat(path).st_mtime_ns}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # Triton's @jit reads the module's source through it
    folder = os.path.dirname(os.path.abspath(path))
    # the modules beside it import as they would with the file run from its folder, and are
    # read again with it (an edited helper is not a stale one)
    for key, mod in list(sys.modules.items()):
        origin = getattr(mod, "__file__", None) or ""
        if (origin and os.path.dirname(os.path.abspath(origin)) == folder and key != "__main__"
                and not key.startswith("microbench")):
            del sys.modules[key]
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - SyntaxError, ImportError, anything at import
        sys.modules.pop(mod_name, None)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise UserCodeError(f"{path}: cannot be loaded: {describe(e, path)}") from None
    finally:
        sys.path.remove(folder)
    fn = getattr(module, name, None)
    if not callable(fn):
        have = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                      and getattr(v, "__module__", None) == mod_name)
        raise UserCodeError(f"{path}: no function {name!r} (functions there: {', '.join(have) or 'none'})")
    if type(fn).__name__ in ("JITFunction", "InterpretedFunction", "Autotuner", "Heuristics"):
        raise UserCodeError(f"{path}: {name} is a @triton.jit kernel: name the Python function that launches it "
                            "(it takes the case's arguments and calls the kernel with its grid)")
    return fn


def check_signature(fn: Callable[..., Any], case: Case, workload: Workload, path: str) -> None:
    """UserCodeError unless ``fn`` accepts exactly the case's arguments (by name)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: let the call say
    try:
        sig.bind(**workload.kwargs())
    except TypeError as e:
        line = inspect.getsourcelines(fn)[1] if hasattr(fn, "__code__") else "?"
        raise UserCodeError(f"{path}:{line}: {fn.__name__}{sig} does not take the case's arguments ({e}).\n"
                            f"  {case.id} calls fn({', '.join(workload.kwargs())});\n  "
                            + "\n  ".join(case.signature().splitlines())) from None


def wrap(fn: Callable[..., Any], path: str) -> Callable[..., Any]:
    def user_variant(**kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - reported as the user's, with their line
            raise UserCodeError(describe(e, path)) from None

    user_variant.__wrapped__ = fn  # type: ignore[attr-defined]
    return user_variant


def load_variant(target: str, case: Case, point: Point, device: str, name: str | None = None) -> Variant:
    """The user's ``FILE::FUNCTION`` as a variant of ``case``, its signature checked
    against the workload of ``point`` on ``device`` (nothing is launched)."""
    path, fname = parse_target(target)
    fn = load_function(path, fname)
    check_signature(fn, case, case.setup(point, device, 0), path)
    doc = (inspect.getdoc(fn) or "").splitlines()
    tags = getattr(fn, "tags", None)  # e.g. a collective's {"path", "placement"} for its table
    return Variant(name or fname, wrap(fn, path), doc=f"{path}::{fname}" + (f": {doc[0]}" if doc else ""),
                   tags={str(k): str(v) for k, v in tags.items()} if isinstance(tags, dict) else {})


class NameTaken(UserCodeError):
    """The variant's name is one the case already has: the command line's mistake (--name)."""


class WithVariant(Case):
    """``inner`` with one more variant; everything else is the inner case's."""

    def __init__(self, inner: Case, extra: Variant):
        if any(v.name == extra.name for v in inner.variants()):
            raise NameTaken(f"variant name {extra.name!r} is taken in {inner.id} (its variants: "
                                f"{', '.join(v.name for v in inner.variants())}): choose another with --name")
        self.inner, self.extra = inner, extra
        for attr in ("id", "title", "baseline", "order", "tolerances", "norm_tolerances", "unseeded_axes", "ceiling", "timing_mode", "distributed",
                     "profile_calls", "scaffold_from"):
            setattr(self, attr, getattr(inner, attr))

    def variants(self) -> Sequence[Variant]:
        return [*self.inner.variants(), self.extra]

    def axes(self, suite, device="cuda"):
        return self.inner.axes(suite, device)

    def skip(self, point, device):
        return self.inner.skip(point, device)

    def skip_variant(self, variant, point, device):
        return None if variant == self.extra.name else self.inner.skip_variant(variant, point, device)

    def setup(self, point, device, seed):
        return self.inner.setup(point, device, seed)

    def reference(self, workload):
        return self.inner.reference(workload)

    def reference_for(self, workload, variant):
        return self.inner.reference_for(workload, variant)

    def tolerance(self, point):
        return self.inner.tolerance(point)

    def point_timing_mode(self, point):
        return self.inner.point_timing_mode(point)

    def parse_axis_value(self, axis, text):
        return self.inner.parse_axis_value(axis, text)

    def derive(self, records):
        return self.inner.derive(records)

    def summarize(self, records):
        return self.inner.summarize(records)

    def targets(self):
        return self.inner.targets()

    def signature(self):
        return self.inner.signature()

    def check_axes(self, device):
        return self.inner.check_axes(device)
