"""Ahead-of-time builds: every Triton kernel a case launches, compiled for a GPU this host
need not have, with what each build takes on one SM of it.

Inside :func:`compile_only`, a Triton launch compiles its kernel for the target (a fake
Triton driver answers "this device is sm_90", say) and runs nothing: a case's variants are
called as usual, on CPU tensors at the GPU's shapes, and every distinct build they ask for
(kernel, constexprs, warps, stages) is recorded once with its registers, spills, stack and
shared memory (ptxas' own report of the build), the blocks per SM those leave, and whether
it fits the target at all — shared memory over the per-block limit, more threads than a
block may hold, or more registers than an SM has, each of which fails at launch on the GPU.
A kernel that does not compile for the target is recorded with the compiler's message.

Nothing here runs a kernel, so nothing here times or checks one: this tells a developer on
a CPU host that a configuration builds and fits, and what it costs in registers and
occupancy, before the GPU run that measures it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from .hardware import SmLimits

__all__ = ["AotError", "Build", "Failure", "Session", "compile_cases", "compile_only", "occupancy", "problems"]


class AotError(RuntimeError):
    """Ahead-of-time compilation cannot start here (no Triton, an interpreter build, a
    Triton without the hooks it needs)."""


@dataclass
class Build:
    """One compiled kernel: what it is, what ptxas says it takes, and who asked for it."""

    kernel: str  # module.function, the package prefix dropped
    hash: str
    config: dict[str, Any]  # constexpr parameters by name
    signature: str  # the runtime parameters' types, e.g. "*bf16,*bf16,i32"
    num_warps: int
    num_stages: int
    shared: int  # bytes of shared memory per block
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None  # bytes of stack frame per thread
    compile_s: float = 0.0
    uses: dict[str, int] = field(default_factory=dict)  # "case/variant" -> points
    max_grid: int = 0  # the largest number of programs one launch asked for

    @property
    def threads(self) -> int:
        return self.num_warps * 32

    def to_json(self, sm: SmLimits) -> dict[str, Any]:
        return {"kernel": self.kernel, "hash": self.hash, "config": {k: _jsonable(v) for k, v in self.config.items()},
                "signature": self.signature, "num_warps": self.num_warps, "num_stages": self.num_stages,
                "shared_bytes": self.shared, "registers": self.registers, "spill_stores": self.spill_stores,
                "spill_loads": self.spill_loads, "stack_bytes": self.stack, "compile_s": round(self.compile_s, 3),
                "blocks_per_sm": occupancy(self, sm), "problems": problems(self, sm), "uses": dict(self.uses),
                "max_grid": self.max_grid}


@dataclass
class Failure:
    """A variant at a point that did not get through its launches: a compile error (with the
    kernel and config that raised it) or any other error before or between launches."""

    where: str  # "case/variant point"
    error: str
    kernel: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"where": self.where, "kernel": self.kernel, "error": self.error}


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def occupancy(b: Build, sm: SmLimits) -> int:
    """Blocks of this build one SM holds at once (0: it cannot launch at all), limited by
    warps, registers (allocated per warp in units of ``register_granularity``), shared memory
    (with the per-block reservation) and the block count."""
    if b.threads > sm.max_threads_per_block or b.shared > sm.shared_per_block:
        return 0
    limits = [sm.max_blocks_per_sm, sm.max_warps_per_sm // b.num_warps]
    if b.registers:
        per_warp = -(-b.registers * 32 // sm.register_granularity) * sm.register_granularity
        limits.append((sm.registers_per_sm // per_warp) // b.num_warps)
    if b.shared:
        limits.append(sm.shared_per_sm // (b.shared + sm.shared_reserved_per_block))
    return max(0, min(limits))


def problems(b: Build, sm: SmLimits) -> list[str]:
    """Why this build cannot launch on the target (empty: it fits)."""
    out = []
    if b.shared > sm.shared_per_block:
        out.append(f"shared memory {b.shared} B over the {sm.shared_per_block} B a block may take")
    if b.threads > sm.max_threads_per_block:
        out.append(f"{b.threads} threads over the {sm.max_threads_per_block} a block may hold")
    if b.registers and b.registers * b.threads > sm.registers_per_sm:
        out.append(f"{b.registers} registers x {b.threads} threads over the {sm.registers_per_sm} an SM has")
    return out


# ---------------------------------------------------------------------------- ptxas' report

_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RESOURCE = re.compile(r"REG:(\d+) STACK:(\d+)")


def _from_ptxas_log(log: str) -> tuple[int, int, int, int] | None:
    regs, spill = _REGS.search(log), _SPILL.search(log)
    if not regs or not spill:
        return None
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2)), int(spill.group(3))


def _from_cubin(cubin: bytes) -> tuple[int, int] | None:
    """Registers and stack bytes from cuobjdump (a build Triton took from its cache, where
    ptxas did not run: no spill counts then)."""
    from triton import knobs

    tool = getattr(knobs.nvidia, "cuobjdump", None)
    path = getattr(tool, "path", None) if tool is not None else None
    if not path:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([path, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = _RESOURCE.search(out)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---------------------------------------------------------------------------- the session


def _short(name: str) -> str:
    for prefix in ("microbench.kernels.", "microbench.", "kernels."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _kernel_name(fn: Any) -> str:
    """``module.function`` of a JIT function; a user's file (loaded under a private module
    name by ``--file``) by its file name."""
    module = str(getattr(fn, "__module__", "?"))
    if module.startswith("microbench_user_"):
        code = getattr(getattr(fn, "fn", None), "__code__", None)
        if code is not None:
            module = os.path.splitext(os.path.basename(code.co_filename))[0]
    return _short(f"{module}.{getattr(fn, '__name__', '?')}")


def _grid_size(grid: Any) -> int:
    if callable(grid):
        return 0
    n = 1
    for g in (grid if isinstance(grid, (tuple, list)) else (grid,)):
        n *= int(g)
    return n


class Session:
    """What one :func:`compile_only` block built: :attr:`builds` by hash, :attr:`failures`,
    and the use (``case/variant point``) :meth:`using` names for the launches inside it."""

    def __init__(self, sm: SmLimits):
        self.sm = sm
        self.builds: dict[str, Build] = {}
        self.failures: list[Failure] = []
        self._use: str | None = None
        self._point: str = ""
        self._counted: set[tuple[str, str, str]] = set()

    @contextlib.contextmanager
    def using(self, use: str, point: str) -> Iterator[None]:
        self._use, self._point = use, point
        try:
            yield
        finally:
            self._use = None

    def absorb(self, builds: Sequence[Build], failures: Sequence[Failure]) -> None:
        """Take in another session's builds and failures (one of the processes that built a
        share of the points): a build both made counts the uses of each, and keeps ptxas'
        report where only one of them has it (the other found the build in a shared cache)."""
        self.failures.extend(failures)
        for b in builds:
            mine = self.builds.get(b.hash)
            if mine is None:
                self.builds[b.hash] = b
                continue
            for use, n in b.uses.items():
                mine.uses[use] = mine.uses.get(use, 0) + n
            mine.max_grid = max(mine.max_grid, b.max_grid)
            if mine.spill_stores is None and b.spill_stores is not None:
                mine.registers, mine.stack = b.registers, b.stack
                mine.spill_stores, mine.spill_loads = b.spill_stores, b.spill_loads

    def fail(self, error: BaseException, kernel: str | None = None) -> None:
        from .usercode import error_summary

        self.failures.append(Failure(f"{self._use} {self._point}".strip(), error_summary(error, 6), kernel))

    def _record(self, fn: Any, kernel: Any, log: str, seconds: float, grid: Any) -> None:
        md = kernel.metadata
        b = self.builds.get(md.hash)
        if b is None:
            b = self.builds[md.hash] = _new_build(fn, kernel, log, seconds)
        b.max_grid = max(b.max_grid, _grid_size(grid))
        use = self._use or "(outside a case)"
        key = (md.hash, use, self._point)
        if key not in self._counted:
            self._counted.add(key)
            b.uses[use] = b.uses.get(use, 0) + 1


def _new_build(fn: Any, kernel: Any, log: str, seconds: float) -> Build:
    """A :class:`Build` from Triton's compiled kernel and ptxas' report (``log``)."""
    md, src = kernel.metadata, kernel.src
    names = list(getattr(fn, "arg_names", []))
    sig = getattr(src, "signature", {}) or {}
    types = list(sig.values())
    config: dict[str, Any] = {}
    for path, value in (getattr(src, "constants", {}) or {}).items():
        if isinstance(path, tuple) and len(path) == 1 and isinstance(path[0], int) and path[0] < len(names):
            config[names[path[0]]] = value
    # integer arguments Triton specialised as multiples of 16 (each combination its own build)
    div16 = [names[p[0]] for p, a in (getattr(src, "attrs", {}) or {}).items()
             if isinstance(p, tuple) and len(p) == 1 and p[0] < min(len(names), len(types))
             and str(types[p[0]]).startswith("i") and ["tt.divisibility", 16] in [list(x) for x in a]]
    if div16:
        config["%16"] = ",".join(div16)
    b = Build(kernel=_kernel_name(fn), hash=md.hash, config=config,
              signature=",".join(str(v) for v in types if v != "constexpr"),
              num_warps=md.num_warps, num_stages=md.num_stages, shared=md.shared, compile_s=seconds)
    parsed = _from_ptxas_log(log)
    if parsed:
        b.registers, b.stack, b.spill_stores, b.spill_loads = parsed
    elif "cubin" in kernel.asm:
        res = _from_cubin(kernel.asm["cubin"])
        if res:
            b.registers, b.stack = res
    return b


class _TargetDriver:
    """Just enough of a Triton driver for launches to compile for ``arch`` and stop there."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = f"aot:sm{arch}"

    def get_current_device(self) -> str:
        return self.device

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


def _triton_parts() -> tuple[Any, Any, Any]:
    try:
        import triton
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except ImportError as e:
        raise AotError(f"Triton is not importable here ({e}); microbench compile needs it") from None
    if not hasattr(driver, "set_active") or not hasattr(JITFunction, "run"):
        raise AotError(f"Triton {triton.__version__} lacks the driver hook microbench compile uses")
    return knobs, driver, JITFunction


def toolchain(arch: int) -> dict[str, str]:
    """The Triton and ptxas versions a build for ``arch`` uses (the report depends on both)."""
    import triton
    from triton import knobs

    out = {"triton": triton.__version__}
    try:
        try:  # the backend's own choice: Triton 3.9 builds sm_90 with ptxas-blackwell, 3.6 with ptxas
            from triton.backends.nvidia.compiler import get_ptxas

            tool = get_ptxas(arch)
        except ImportError:
            tool = knobs.nvidia.ptxas if arch < 100 else knobs.nvidia.ptxas_blackwell
        out["ptxas"] = str(tool.version)
    except Exception as e:  # noqa: BLE001 - a missing tool shows when a build fails
        out["ptxas"] = f"unknown ({type(e).__name__})"
    return out


def check_not_interpreted(kernel: Any) -> None:
    """Raise :class:`AotError` when ``kernel`` was built by Triton's interpreter, which
    compiles nothing (TRITON_INTERPRET=1 was set before its module was imported)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    if isinstance(kernel, InterpretedFunction):
        raise AotError("the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 was set before they "
                       "were imported), which compiles nothing: run microbench compile in a process without it")


@contextlib.contextmanager
def compile_only(sm: SmLimits, cache_dir: str | None = None, sm_count: int | None = None) -> Iterator[Session]:
    """Within the block, every Triton launch compiles for ``sm``'s capability and returns
    without running; the yielded :class:`Session` collects the builds.  Triton's cache is a
    private directory (so ptxas runs and reports on every build) unless ``cache_dir`` is
    given.  ``sm_count``: the target's SMs, which launchers that split work by them read
    (None: the CPU's stand-in, an H200's).  Everything is put back on exit."""
    knobs, driver, JITFunction = _triton_parts()
    from microbench.kernels import checks

    session = Session(sm)
    original = JITFunction.run

    def compile_instead(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        log = io.StringIO()
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(log):  # ptxas' report, printed by Triton on request
                kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:
            session.fail(e, _kernel_name(self))
            raise
        session._record(self, kernel, log.getvalue(), time.perf_counter() - t0, grid)
        return kernel

    saved_driver = driver._active
    saved_log, saved_cache = knobs.nvidia.dump_ptxas_log, knobs.cache.dir
    saved = checks.COMPILE_ONLY, checks.COMPILE_SHARED_PER_BLOCK, checks.COMPILE_SM_COUNT
    with tempfile.TemporaryDirectory(prefix="microbench-aot-") as tmp:
        driver.set_active(_TargetDriver(sm.arch))
        JITFunction.run = compile_instead
        knobs.nvidia.dump_ptxas_log = True
        knobs.cache.dir = cache_dir or tmp
        checks.COMPILE_ONLY = True
        checks.COMPILE_SHARED_PER_BLOCK = sm.shared_per_block
        checks.COMPILE_SM_COUNT = sm_count
        try:
            yield session
        finally:
            JITFunction.run = original
            driver._active = saved_driver
            knobs.nvidia.dump_ptxas_log = saved_log
            knobs.cache.dir = saved_cache
            checks.COMPILE_ONLY, checks.COMPILE_SHARED_PER_BLOCK, checks.COMPILE_SM_COUNT = saved


def case_points(case: Any, suite: str, picks: dict[str, list[str]]) -> list[dict[str, Any]]:
    """The points of ``case``'s GPU axes in ``suite``, narrowed by the ``picks`` that name
    its axes (as ``--axis`` does), less those the case skips on CUDA.

    Raises:
        ValueError: a value ``picks`` names that the axis does not have.
    """
    from .case import expand, narrow

    suite_axes = case.axes(suite, "cuda")
    axes = narrow(suite_axes, {k: v for k, v in picks.items() if k in suite_axes}, case.id, case.parse_axis_value)
    return [p for p in expand(axes) if case.skip(p, "cuda") is None]


def compile_cases(cases: Sequence[Any], suite: str, picks: dict[str, list[str]], session: Session, seed: int = 0,
                  variants: Sequence[str] = (), progress: Callable[[str], None] | None = None,
                  take: Callable[[int], bool] | None = None) -> int:
    """Call every variant of ``cases`` at each point of ``suite``'s GPU axes (narrowed by
    ``picks``, as ``--axis`` does) on CPU inputs, inside a :func:`compile_only` session, so
    each launch builds for the target.  Cases that launch no Triton kernel, and multi-rank
    cases, are left out; so are variants that run only on CUDA (they are not Triton).
    ``take``: called with each point's index among all the cases' points, in order, once
    each; only the points it returns True for are built (one process's share of the work
    when several build, each taking the next point not yet taken; their sessions together
    hold every build, see :meth:`Session.absorb`).  Returns the number of (point, variant)
    calls made.

    Raises:
        ValueError: an axis or value ``picks`` names that a case does not have.
    """
    import gc

    from .case import point_label

    calls, seen = 0, 0
    for case in cases:
        if case.distributed or not case.launches_triton:
            continue
        points = case_points(case, suite, picks)
        chosen = [v for v in case.variants() if v.runs_on("cpu") and (not variants or v.name in variants)]
        if progress and take is None:
            progress(f"{case.id}: {len(points)} points x {len(chosen)} variants")
        for n, point in enumerate(points):
            seen += 1
            if take is not None and not take(seen - 1):
                continue
            label = point_label(point)
            if progress and take is not None:
                progress(f"{case.id}: point {n + 1} of {len(points)} x {len(chosen)} variants ({label})")
            with session.using(f"{case.id} (setup)", label):
                try:
                    workload = case.setup(point, "cpu", case.input_seed(seed, point))
                except Exception as e:  # noqa: BLE001 - recorded; the next point still builds
                    session.fail(e)
                    continue
            for v in chosen:
                if case.skip_variant(v.name, point, "cuda") is not None:
                    continue
                calls += 1
                failed = len(session.failures)
                with session.using(f"{case.id}/{v.name}", label):
                    try:
                        v.fn(**workload.kwargs())
                    except Exception as e:  # noqa: BLE001 - recorded; the next variant still builds
                        if len(session.failures) == failed:  # not already recorded by the launch that raised
                            session.fail(e)
            del workload
            gc.collect()
    return calls
