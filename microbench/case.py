"""What a case is: named axes, a workload per point, variants, one reference.

A case binds kernels to the harness. It knows the shapes it runs at (per suite, as named
axes the harness expands), how to build seeded inputs for one point, how many bytes and
FLOPs one call moves and does, which reference checks it, and which variants compete.
The harness knows nothing of any particular kernel; a kernel knows nothing of the harness.

Variant calling convention: ``fn(**workload.inputs, **workload.outputs)``. A variant
writes the preallocated outputs (which the gate poisons with NaN first), or returns its
outputs (a tensor, or a tuple in the order of ``workload.outputs``) instead.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

Point = dict[str, Any]

#: The hardware profile Triton launches build for while ``microbench compile`` runs (else
#: None): a case that picks per-device launch configurations (a tuning table) picks the
#: target's then, since the tensors it is handed are on the CPU.
COMPILE_TARGET: Any = None


@dataclass(frozen=True)
class Cost:
    """Bytes one call must move through memory (each input read once, each output written
    once) and the FLOPs it must do: the floor every table reports against."""

    bytes: int
    flops: int = 0


@dataclass
class Workload:
    """The arguments of one call at one point: inputs (tensors and scalars), outputs."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    cost: Cost
    meta: dict[str, Any] = field(default_factory=dict)
    #: JSON-able facts about this point's inputs, stored in its records (e.g. the experts a
    #: routing touched): what a reader needs to interpret the time.
    facts: dict[str, Any] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        return {**self.inputs, **self.outputs}

    def clone(self) -> "Workload":
        """A copy with its own tensors (for rotating cold-cache copies in graph mode)."""
        return Workload(_clone_all(self.inputs), _clone_all(self.outputs), self.cost, dict(self.meta), dict(self.facts))

    @property
    def working_set_bytes(self) -> int:
        return sum(_nbytes(v) for v in itertools.chain(self.inputs.values(), self.outputs.values()))

    def timed_calls(self, fn: Callable[..., Any], mode: str,
                    cache_bytes: int | None) -> tuple[list[Callable[[], Any]], str | None]:
        """The calls the timer rotates through, and a note when they cannot keep the cache cold.

        One call, except in graph mode (no flush between replayed calls): then rotating
        copies of the inputs, enough to cover ``COLD_FACTOR`` x the cache within the copy
        budget. Where that budget binds (a working set of gigabytes) or a call touches far
        fewer bytes than it is handed (a few experts of a whole layer's weights), each
        call's data may stay L2-resident between replays; the note says by how much the
        copies fall short, and the table shows it beside the time. So does the copy cap
        (``MAX_COPIES``) for small working sets: 256 copies of 64 KiB stay in a 50 MiB L2.
        Calls that touch a page or less (a launch, an 8-byte allreduce) get no note: no
        copies make them cold, nor does their cache state weigh.
        """
        from microbench.samplers import COLD_FACTOR, copies_for_cold_cache, fallback_cache_bytes

        copies, note = [self], None
        if mode == "graph":
            ws = self.working_set_bytes
            n = copies_for_cold_cache(ws, cache_bytes)
            copies += [self.clone() for _ in range(n - 1)]
            touched = min(ws, self.cost.bytes) if self.cost.bytes else ws
            want = COLD_FACTOR * (cache_bytes or fallback_cache_bytes())
            if touched > _PAGE_BYTES and n * touched < want:
                note = (f"graph mode: {n} input cop{'y' if n == 1 else 'ies'} x {touched / 2**20:.1f} MiB a call "
                        f"touches cover {n * touched / 2**20:.0f} MiB of the {want / 2**20:.0f} MiB "
                        f"({COLD_FACTOR}x L2) a cold cache needs: replayed calls may find their data in L2")
        return [functools.partial(fn, **c.kwargs()) for c in copies], note


#: Calls that touch no more than this get no cold-cache note in graph mode (a launch's few bytes).
_PAGE_BYTES = 4096


def _is_tensor(v: Any) -> bool:
    return callable(getattr(v, "numel", None)) and hasattr(v, "element_size") and hasattr(v, "clone")


def _nbytes(v: Any) -> int:
    """Bytes of every tensor in ``v``: a tensor, or a list, tuple, dict or dataclass of them
    (an expert-weight set, a list of per-layer caches), recursively."""
    if _is_tensor(v):
        return int(v.numel() * v.element_size())
    if isinstance(v, (list, tuple)):
        return sum(_nbytes(x) for x in v)
    if isinstance(v, Mapping):
        return sum(_nbytes(x) for x in v.values())
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return sum(_nbytes(getattr(v, f.name)) for f in dataclasses.fields(v))
    return 0


def _clone(v: Any) -> Any:
    """``v`` with its own copy of every tensor in it (the containers of :func:`_nbytes`);
    anything else (a process group, a config, a number) is shared."""
    if _is_tensor(v):
        return v.clone()
    if isinstance(v, (list, tuple)) and _nbytes(v):
        return type(v)(_clone(x) for x in v) if not hasattr(v, "_fields") else type(v)(*(_clone(x) for x in v))
    if isinstance(v, Mapping) and _nbytes(v):
        return {k: _clone(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type) and _nbytes(v):
        return dataclasses.replace(v, **{f.name: _clone(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init})
    return v


def _clone_all(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _clone(v) for k, v in d.items()}


@dataclass(frozen=True)
class Variant:
    """One implementation of a case's operation."""

    name: str
    fn: Callable[..., Any]
    devices: tuple[str, ...] = ("cuda", "cpu")
    doc: str = ""
    #: Labels a table may group by (e.g. a collective's path and placement); stored in records.
    tags: Mapping[str, str] = field(default_factory=dict)

    def runs_on(self, device: str) -> bool:
        return device.split(":")[0] in self.devices


class Case:
    """Base class of every case; subclasses set the class attributes and override the hooks.

    ``axes(suite, device)`` returns the named axes of a suite (empty = not in that suite), each a
    sequence of JSON-able values; the harness expands their product, asks ``skip`` about
    each point, and narrows it by ``--axis``.
    """

    id: ClassVar[str]
    title: ClassVar[str] = ""
    baseline: ClassVar[str]
    order: ClassVar[int] = 100  # calibration runs first so its ceilings apply to the rest
    #: Output tolerances per dtype name, (atol, rtol): bf16 operands land 1e-3..1e-2.
    tolerances: ClassVar[Mapping[str, tuple[float, float]]] = {
        "fp32": (1e-4, 1e-4),
        "fp16": (2e-3, 2e-3),
        "bf16": (1.6e-2, 1.6e-2),
    }
    #: Axes the inputs do not depend on: points that differ only there get the same seed, so
    #: the same inputs (the MoE's INT4 and bf16 rows route the same tokens to the same experts).
    unseeded_axes: ClassVar[tuple[str, ...]] = ()
    #: Bounds on the whole output's relative L2 error per dtype name (none: elementwise only).
    norm_tolerances: ClassVar[Mapping[str, float]] = {}
    #: Set on calibration cases: which ceiling their best OK result measures.
    ceiling: ClassVar[str | None] = None
    #: Timing mode forced by the case (e.g. the launch floor is back-to-back by nature).
    timing_mode: ClassVar[str | None] = None
    #: A multi-rank case: its variants are collectives, run on every rank of a
    #: torch.distributed world in lock step (see microbench.distributed).
    distributed: ClassVar[bool] = False
    #: On CUDA, after the gate, count the call's GPU launches and its host time once
    #: (microbench.profile), into the record's ``profile``.
    profile_calls: ClassVar[bool] = False
    #: Whether its variants launch Triton kernels: ``microbench compile`` leaves out a case
    #: that launches none (a torch copy or matmul would only cost CPU time there).
    launches_triton: ClassVar[bool] = True
    #: A case with the same variant signature whose scaffold this one shares (None: its own).
    scaffold_from: ClassVar[str | None] = None

    def variants(self) -> Sequence[Variant]:
        raise NotImplementedError

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        """Named axes of ``suite`` on ``device`` (shapes may differ between CPU and GPU);
        empty when the case is not in that suite."""
        raise NotImplementedError

    def skip(self, point: Point, device: str) -> str | None:
        """A reason when the point is invalid or unsupported on ``device``, else None."""
        return None

    def counts_for_ceiling(self, record: dict[str, Any]) -> bool:
        """Whether an OK record of a calibration case may set its ceiling (default: all)."""
        return True

    def check_axes(self, device: str) -> Mapping[str, Sequence[Any]]:
        """The small, odd shapes a new variant must pass before it is timed at the model's
        (``microbench try``); default: the ``smoke`` suite's."""
        return self.axes("smoke", device)

    def scaffold(self) -> str | None:
        """Source of a starting file for ``microbench scaffold``: a simple, correct Triton
        kernel and launcher with this case's variant signature; None when there is none.
        Default: ``cases/scaffolds/<case id with _ for .>.py`` when it exists, or the file of
        :attr:`scaffold_from` (a case with the same signature) with that case's id replaced."""
        import os

        import microbench.cases

        source = self.scaffold_from or self.id
        here = os.path.join(os.path.dirname(os.path.abspath(microbench.cases.__file__)), "scaffolds",
                            source.replace(".", "_") + ".py")
        if not os.path.exists(here):
            return None
        with open(here) as f:
            return f.read().replace(source, self.id)

    def point_timing_mode(self, point: Point) -> str | None:
        """The timing mode this point forces (e.g. an eager/graph axis), else the case's."""
        return self.timing_mode

    def parse_axis_value(self, axis: str, text: str) -> Any:
        """A value of ``axis`` given on the command line that is not one of the suite's
        (e.g. any message size); raise ValueError with the reason when it is invalid.
        The default accepts only the declared values."""
        raise KeyError(text)

    def skip_variant(self, variant: str, point: Point, device: str) -> str | None:
        """A reason when one variant cannot run at this point (others still do), else None."""
        return None

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        raise NotImplementedError

    def derive(self, records: Sequence[dict[str, Any]]) -> None:
        """Add case-specific columns to finished records, as ``record["derived"][name] =
        text`` (e.g. a speed-up, or a time composed from another point); shown by every table."""

    def summarize(self, records: Sequence[dict[str, Any]]) -> list[Any]:
        """Lines drawn across the case's finished points (e.g. the token count at which the
        baseline overtakes a variant: :func:`microbench.report.crossovers`), each a
        :func:`microbench.report.summary` (its text, and the axis values and variants it
        speaks of) or a plain string (the whole case); stored in the result file's
        ``run.summaries`` and printed under the case's table."""
        return []

    def targets(self) -> Sequence[Any]:
        """The speed goals this case's variants are meant to reach, each a
        :class:`microbench.targets.Target` (a bar at some of the case's points);
        ``microbench targets`` reads them against a result file. Default: none."""
        return ()

    def tune(self, point: Point, device: str, trial: Any) -> list[dict[str, Any]]:
        """Search this point's launch configurations (``microbench tune``); ``trial(fn,
        workload, expected, label)`` gates and times one candidate and returns its median
        seconds, or None when it is incorrect; ``trial.out`` is the table to update
        (None: the device's own).  Returns one row per search (its winner); a case with
        nothing to tune returns []."""
        return []

    def save_tuning(self, device: str, path: str | None = None) -> str | None:
        """Write what :meth:`tune` found (to ``path``, else the device's own table);
        return the path, or None when the case tunes nothing or has found nothing yet."""
        return None

    def tuning_file(self, device: str) -> str | None:
        """The device's own table, which :meth:`save_tuning` writes by default (None: none)."""
        return None

    def load_tuning(self, device: str, path: str | None = None) -> None:
        """Read the table a tune would update (``path``, else the device's own) before any
        search: ``ValueError`` (naming the file) when it is malformed or another device's."""

    def tuning_key(self, point: Point) -> Any:
        """What identifies the table entries tuning ``point`` writes: points with equal keys
        are tuned once (the first in plan order). None: every point its own."""
        return None

    def reference(self, workload: Workload) -> Mapping[str, Any]:
        """Expected outputs (fp32), keyed like ``workload.outputs``; empty = nothing to check
        (only for cases whose call writes nothing, like the launch floor)."""
        raise NotImplementedError

    def input_seed(self, run_seed: int, point: Point) -> int:
        """The seed of the inputs at ``point`` (:func:`point_seed` over the axes the inputs
        depend on)."""
        return point_seed(run_seed, self.id, {k: v for k, v in point.items() if k not in self.unseeded_axes})

    def reference_for(self, workload: Workload, variant: Variant) -> Mapping[str, Any]:
        """What ``variant`` must produce on ``workload``: :meth:`reference`, unless a case
        checks more of some variants (say, where the result lands: in place or not)."""
        return self.reference(workload)

    def tolerance(self, point: Point) -> tuple[float, float]:
        return self.tolerances[str(point.get("dtype", "fp32"))]

    def gate_tolerances(self, point: Point) -> dict[str, Any]:
        """The gate's keyword arguments at ``point``: ``atol``, ``rtol`` (:meth:`tolerance`)
        and ``norm_tol`` (from :attr:`norm_tolerances`, None where it has no entry)."""
        atol, rtol = self.tolerance(point)
        return {"atol": atol, "rtol": rtol, "norm_tol": self.norm_tolerances.get(str(point.get("dtype", "fp32")))}

    def signature(self) -> str:
        """The variant signature, for ``microbench list --case`` (subclasses describe shapes)."""
        return (self.__doc__ or "").strip()

    # ---------------------------------------------------------------- helpers for the harness

    def variant(self, name: str) -> Variant:
        for v in self.variants():
            if v.name == name:
                return v
        raise KeyError(name)

    def suites(self, known: Sequence[str], device: str = "cuda") -> list[str]:
        return [s for s in known if self.axes(s, device)]


def expand(axes: Mapping[str, Sequence[Any]]) -> list[Point]:
    """The product of named axes, in declaration order (the last axis varies fastest).

    No axes means the case is not in the suite: no points (not one empty point)."""
    if not axes:
        return []
    names = list(axes)
    return [dict(zip(names, combo)) for combo in itertools.product(*(axes[n] for n in names))]


def narrow(axes: Mapping[str, Sequence[Any]], picks: Mapping[str, Sequence[str]], case_id: str,
           parse: Callable[[str, str], Any] | None = None) -> dict[str, list[Any]]:
    """Keep only the axis values named by ``--axis name=v1,v2`` (strings matched to values;
    a value the suite lacks is offered to ``parse(axis, text)``, a case's
    :meth:`Case.parse_axis_value`, which may accept it).

    Raises ValueError naming the axis or the value when one is unknown to the case.
    """
    out = {k: list(v) for k, v in axes.items()}
    for name, wanted in picks.items():
        if name not in out:
            raise ValueError(f"case {case_id} has no axis {name!r} (axes: {', '.join(out) or 'none'})")
        by_text = {str(v): v for v in out[name]}
        chosen, missing = [], []
        for w in wanted:
            if w in by_text:
                chosen.append(by_text[w])
                continue
            try:
                chosen.append(parse(name, w) if parse else by_text[w])
            except KeyError:
                missing.append(w)
            except ValueError as e:
                raise ValueError(f"case {case_id}: axis {name}={w}: {e}") from None
        if missing:
            raise ValueError(
                f"case {case_id}: axis {name} has no value {', '.join(missing)} (values: {', '.join(by_text)})"
            )
        # a value named twice ("4,4", or "8,8B" for one size) is one point, timed once
        out[name] = [v for i, v in enumerate(chosen) if v not in chosen[:i]]
    return out


def point_seed(run_seed: int, case_id: str, point: Point) -> int:
    """A deterministic per-point seed: the same run seed gives the same inputs, and two
    points never share inputs by accident."""
    key = f"{run_seed}|{case_id}|" + "|".join(f"{k}={point[k]}" for k in sorted(point))
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def point_label(point: Point) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())
