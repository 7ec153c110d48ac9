"""The tensor-parallel allreduce: every path servers take, in place and out of place,
eager and inside CUDA graphs, on every rank of a torch.distributed world.

Each layer ends its attention and its MoE with a sum over the TP ranks of [T, hidden]
bf16 (hidden from the model's config: 14,336 bytes per token on Kimi-K2.5). Two cases:

``comm.allreduce``        the model's sizes: T tokens x hidden, T 1..128
``comm.allreduce_sweep``  an nccl-tests-style sweep of message sizes, 8 B .. 64 MiB
                          (``--axis bytes=...`` takes any size: 4K, 1M, 3000 ...)

Axis ``capture``: ``eager`` is back-to-back calls from Python (the harness's hot mode,
what an uncaptured step pays, launch cost included); ``graph`` is N calls captured once
and replayed (the launch-free time; CUDA only). Eager minus graph is the launch cost.

Inputs are seeded integers small enough that every partial sum is exact in bf16, so each
rank checks the exact sum; any element off is counted in ``#wrong`` (summed over ranks)
and the variant is FAILED, not timed. At world size 1 the sum is the input itself, so
an in-place path that did nothing would pass: the check has teeth from two ranks up.
An out-of-place path's fresh output could likewise be handed a freed block that already
holds the sum (an earlier variant's output, over one rank the input itself): before each
variant, blocks of the input's size are filled with NaN, so an output left unwritten
fails. Over one rank NCCL itself does nothing in place (out of place it copies), so the
NCCL paths' in-place graph rows are skipped as empty; their eager rows time the call
alone. ``torch-oop`` is the functional path: the input copied into a fresh output, summed
there in place, so its time holds that copy, which NCCL's own out-of-place sum
(``cupy-oop``) does not; over one rank its row is mostly the copy. Its records carry timing
notes saying so, marked in the table.

The table is nccl-tests': size, count, type, redop, then per placement time, algbw
(size / time) and busbw (algbw x 2(n-1)/n), #wrong; the time is the slowest rank's per
lock-step sample (see microbench.distributed).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import torch

from microbench import distributed
from microbench.case import Case, Cost, Point, Variant, Workload
from microbench.cases.common import DTYPES, model, on_cuda

#: capture axis value -> the harness timing mode it forces
CAPTURE = {"eager": "hot", "graph": "graph"}

#: (path, in-place, out-of-place, what it is); functions live in microbench.kernels.allreduce
PATHS = (
    ("torch", "torch_inplace", "torch_outplace", "torch.distributed.all_reduce on the process group"),
    ("cupy", "cupy_inplace", "cupy_outplace", "pynccl-style: NCCL through cupy.cuda.nccl on torch's stream"),
    ("oneshot", "oneshot_inplace", "oneshot_outplace", "symmetric memory one-shot (copy in, read every peer)"),
    ("twoshot", "twoshot_inplace", "twoshot_outplace", "symmetric memory two-shot (reduce-scatter + all-gather)"),
)
PLACEMENTS = {"ip": "in-place", "oop": "out-of-place"}
#: the paths that call NCCL itself (over one rank its in-place sum is a no-op)
NCCL_PATHS = ("torch", "cupy")
#: on every torch-oop record, and at world size 1 (see the module docstring)
TORCH_OOP_NOTE = ("torch-oop: the input copied into a fresh output, summed there in place (the functional path): "
                  "the copy is in its time; cupy-oop is NCCL's own out-of-place sum")
ONE_RANK_COPY_NOTE = ("world size 1: a sum over one rank does nothing, so torch-oop's time is mostly its copy, "
                      "not an out-of-place allreduce")
#: blocks of the input's size filled with NaN before each out-of-place variant (reference_for)
POISON_BLOCKS = 4

#: nccl-tests' default sweep: x2 from 8 B to 64 MiB (24 sizes)
SWEEP_BYTES = [8 << k for k in range(24)]
_UNITS = {"": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "B": 1}


def parse_bytes(text: str, element_size: int = 2) -> int:
    """``8``, ``4K``, ``1MiB``, ``64M`` -> bytes; ValueError unless a positive multiple of
    the element size."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 8, 4K, 1MiB, 64M)")
    n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if n <= 0 or n % element_size:
        raise ValueError(f"{n} bytes is not a positive multiple of the element size ({element_size} bytes)")
    return n


_symm_setup: dict[tuple, str | None] = {}


def _release() -> None:
    """The world's process groups are about to be destroyed: forget what was kept for them,
    here (set-up answers) and in the kernels (communicators, symmetric buffers)."""
    from microbench.kernels import allreduce

    _symm_setup.clear()
    allreduce.release()


distributed.on_destroy(_release)


def _symm_setup_error(group: Any, device: str) -> str | None:
    """Why symmetric memory cannot be set up here for ``group`` of one rank, or None; tried
    once per group and device (``allreduce.symm_try``). A host that cannot map the memory is
    a reason to skip, not a kernel failing. Only a world of one is tried, where nobody waits
    on the rendezvous; in a larger one it is collective, so a failure there stays the
    variant's (FAILED, with its error, agreed by every rank)."""
    from microbench.kernels import allreduce
    from microbench.outcome import error_text

    key = (id(group), str(device))
    if key not in _symm_setup:
        try:
            allreduce.symm_try(group, device)
            _symm_setup[key] = None
        except Exception as e:  # noqa: BLE001 - any failure is this host's reason
            _symm_setup[key] = f"symmetric memory could not be set up here ({error_text(e)})"
    return _symm_setup[key]


class _AllReduce(Case):
    distributed = True
    launches_triton = False  # NCCL, CuPy and symmetric-memory collectives
    baseline = "torch-ip"
    #: last: a path whose graph capture fails cannot disturb the single-rank cases' numbers
    order = 150
    #: integer inputs: the sum is exact in every dtype (see kernels.allreduce.value_range)
    tolerances = {"fp32": (0.0, 0.0), "fp16": (0.0, 0.0), "bf16": (0.0, 0.0)}

    def variants(self) -> Sequence[Variant]:
        # Each variant is the kernel function itself, resolved here, not a wrapper that looks
        # it up per call: the timed call is the path alone (an import and a getattr per call
        # are ~1 µs, much of a one-rank eager allreduce). Importing the module this early is
        # safe: it is torch.distributed alone, no Triton kernel that the device choice decides.
        from microbench.kernels import allreduce

        out = []
        for path, ip, oop, doc in PATHS:
            devices = ("cuda", "cpu") if path == "torch" else ("cuda",)
            out.append(Variant(f"{path}-ip", getattr(allreduce, ip), doc=f"{doc}; in place", devices=devices,
                               tags={"path": path, "placement": "in-place"}))
            out.append(Variant(f"{path}-oop", getattr(allreduce, oop), doc=f"{doc}; out of place (a fresh output)",
                               devices=devices, tags={"path": path, "placement": "out-of-place"}))
        return out

    def signature(self) -> str:
        return ("Variant signature: fn(x, group) -> the sum over the group's ranks of x [count] dtype "
                "(x itself when in place, a new tensor when out of place); every rank calls it together.")

    #: (name, {suite: values}) of the axis that sets the message size
    size_axis: tuple[str, Mapping[str, Sequence[int]]]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        name, by_suite = self.size_axis
        if suite not in by_suite:
            return {}
        # graph capture exists on CUDA only: on CPU the axis has eager alone
        return {name: by_suite[suite], "dtype": ["bf16"], "capture": list(CAPTURE) if on_cuda(device) else ["eager"]}

    def point_timing_mode(self, point: Point) -> str | None:
        return CAPTURE[point["capture"]]

    def _count(self, point: Point) -> tuple[int, torch.dtype]:
        raise NotImplementedError

    def skip(self, point: Point, device: str) -> str | None:
        if point["capture"] == "graph" and not on_cuda(device):
            return "CUDA graphs need a CUDA device"
        import torch.distributed as dist

        from microbench.kernels.allreduce import EXACT_LIMIT, value_range

        dtype = DTYPES[point["dtype"]]
        if dist.is_initialized() and value_range(dist.get_world_size(), dtype) < 1:
            return (f"world size {dist.get_world_size()}: no integer input keeps a {point['dtype']} sum exact "
                    f"beyond {EXACT_LIMIT[dtype]} ranks")
        return None

    def skip_variant(self, variant: str, point: Point, device: str) -> str | None:
        import torch.distributed as dist

        from microbench.kernels import allreduce

        kind = "cuda" if on_cuda(device) else "cpu"
        path, _, placement = variant.rpartition("-")
        # the world's size, or (planning a run that starts its world of one later) the size it will have
        world = distributed.world_size()
        group = dist.group.WORLD if dist.is_initialized() else None
        reason = None
        if path == "cupy":
            reason = (allreduce.cupy_unavailable(kind)
                      or (allreduce.CupyNccl.failed(group) if group is not None else None))
        elif path in ("oneshot", "twoshot"):
            count, dtype = self._count(point)
            # the set-up is tried only on a world that exists, never while planning
            reason = (allreduce.symm_unavailable(kind, path)
                      or allreduce.symm_unsupported(path, count * dtype.itemsize, dtype, world)
                      or (_symm_setup_error(group, device) if world == 1 and group is not None else None))
        if reason is None and path in NCCL_PATHS and placement == "ip" and world == 1 and point["capture"] == "graph":
            # NCCL's one-rank path: out of place a copy, in place nothing at all
            reason = ("world size 1: NCCL's in-place sum over one rank launches no work, so its graph "
                      "is empty; the eager row times the call itself")
        return reason

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        import torch.distributed as dist

        from microbench.kernels.allreduce import rank_input

        count, dtype = self._count(point)
        world, rank = dist.get_world_size(), dist.get_rank()
        x = rank_input(count, rank, world, seed, dtype, device)
        nbytes = count * x.element_size()
        facts = {"collective": "allreduce", "redop": "sum", "bytes": nbytes, "count": count,
                 "dtype": str(point.get("dtype", "bf16")), "world_size": world, "backend": dist.get_backend()}
        # Cost.bytes 0: what a collective moves is link traffic, not memory traffic; its
        # table reports algbw / busbw from facts instead of a memory-bandwidth floor.
        return Workload({"x": x, "group": dist.group.WORLD}, {}, Cost(bytes=0),
                        meta={"seed": seed, "count": count, "dtype": dtype, "world": world}, facts=facts)

    def reference(self, w: Workload) -> Mapping[str, Any]:
        from microbench.kernels.allreduce import allreduce_ref

        m = w.meta
        return {"out": allreduce_ref(m["count"], m["world"], m["seed"], m["dtype"], str(w.inputs["x"].device))}

    def reference_for(self, w: Workload, variant: Variant) -> Mapping[str, Any]:
        """The sum, returned; and where the variant's placement says it lands: in place, in
        ``x`` too; out of place, not in ``x``, which keeps the rank's own input (a copy of
        it taken now, before the call). A variant that names no placement: the sum alone."""
        ref = dict(self.reference(w))
        placement = variant.tags.get("placement")
        if placement == "in-place":
            ref["x"] = ref["out"]
        elif placement == "out-of-place":
            x = w.inputs["x"]
            ref["x"] = x.float()  # a new fp32 tensor: the input as it is before the call
            # the variant's fresh output comes from the allocator's freed blocks, one of which
            # may hold the sum already (an earlier variant's output; over one rank, the
            # reference's own draw of the input): the blocks of that size now hold NaN
            poison = [torch.full_like(x, float("nan")) for _ in range(POISON_BLOCKS)]
            del poison
        return ref

    def derive(self, records: Sequence[dict[str, Any]]) -> None:
        """A torch-oop time says what it holds: the copy into its fresh output, and over one
        rank little else (see the module docstring)."""
        for r in records:
            if r["variant"] != "torch-oop" or r["status"] != "OK":
                continue
            notes = r["timing"].setdefault("notes", [])
            add = [TORCH_OOP_NOTE] + ([ONE_RANK_COPY_NOTE] if (r.get("facts") or {}).get("world_size") == 1 else [])
            notes += [n for n in add if n not in notes]


class AllReduceCase(_AllReduce):
    """The model's allreduce: [tokens, hidden] bf16, hidden from the model config."""

    id = "comm.allreduce"
    title = "TP allreduce of [T, hidden] bf16: every path, in/out of place, eager/graph"

    size_axis = ("tokens", {"verify": [1, 2, 4, 8, 16, 32, 64, 128], "smoke": [1, 4]})

    def _count(self, point: Point) -> tuple[int, torch.dtype]:
        return point["tokens"] * model().hidden_size, DTYPES[point["dtype"]]


class AllReduceSweepCase(_AllReduce):
    """Any message size (bytes, a multiple of the element size), nccl-tests style."""

    id = "comm.allreduce_sweep"
    scaffold_from = "comm.allreduce"  # the same signature
    title = "allreduce message-size sweep, nccl-tests style (8 B .. 64 MiB)"

    size_axis = ("bytes", {"verify": SWEEP_BYTES, "smoke": [8, 256, 8192, 262144]})

    def parse_axis_value(self, axis: str, text: str) -> Any:
        if axis == "bytes":
            return parse_bytes(text)
        return super().parse_axis_value(axis, text)

    def _count(self, point: Point) -> tuple[int, torch.dtype]:
        dtype = DTYPES[point["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        if point["bytes"] % size:
            raise ValueError(f"{point['bytes']} bytes is not a multiple of the {point['dtype']} element size")
        return point["bytes"] // size, dtype


def allreduce_times(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, int], list[tuple[int, float]]]:
    """Time per call as a function of bytes, per (variant, capture, world size), from a run's
    OK records of either case — what the step model reads. Sorted by bytes."""
    out: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    for r in records:
        f = r.get("facts") or {}
        if f.get("collective") != "allreduce" or r.get("status") != "OK" or not r.get("timing"):
            continue
        key = (r["variant"], r["axes"]["capture"], int(f["world_size"]))
        out.setdefault(key, []).append((int(f["bytes"]), float(r["timing"]["summary"]["median"])))
    return {k: sorted(v) for k, v in out.items()}
