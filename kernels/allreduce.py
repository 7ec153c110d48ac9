"""Tensor-parallel allreduce paths, each in place and out of place, with one reference.

Every layer of the model ends its attention and its MoE with a sum over the TP ranks of a
[T, hidden] bf16 activation. Servers send that sum down one of these paths:

``torch``   ``torch.distributed.all_reduce`` on the process group (NCCL on GPUs, gloo on
            CPU). In place: the activation is reduced where it lies. Out of place, as
            functional collectives (the torch.compile path) do it: a fresh output, the
            input copied in, the copy reduced in place. Over one rank that in-place sum
            does nothing, so the out-of-place call is mostly its own copy.
``cupy``    a pynccl-style communicator: NCCL called directly through
            ``cupy.cuda.nccl`` on torch's current stream, with no process-group machinery
            in between (what servers use inside CUDA graphs). In place: one pointer as send
            and receive buffer; out of place: a fresh receive buffer.
``oneshot`` torch's symmetric-memory one-shot allreduce: every rank reads every peer's
            buffer over NVLink and sums locally (one pass, latency-optimal for small sizes).
``twoshot`` symmetric-memory two-shot: a reduce-scatter then an all-gather over peer
            memory (half the traffic per rank of one-shot; better once bandwidth matters).

The symmetric-memory paths need their input in a buffer every peer has mapped; servers
keep one such buffer per group and copy the activation into it (the copy is part of the
path's cost, so it is inside the timed call here too). The result is written straight
into the activation (in place) or into a fresh tensor (out of place).

Availability is explicit: ``*_unavailable(device)`` returns a reason (CuPy missing, no
NCCL in CuPy, CUDA needed, the installed torch lacks the op) or None; a CuPy communicator
that could not be made says why through :meth:`CupyNccl.failed`, and is not tried again.
What is kept per process group goes with :func:`release`, before the group is destroyed.

The kernels know nothing of the harness; the process group is an argument.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

#: Integer inputs are drawn in [-VALUE_RANGE, VALUE_RANGE] (narrowed for large worlds) so
#: every partial sum is an integer exactly representable in bf16 (8 significand bits:
#: every integer up to 256), whatever order a path adds in: the sum is known exactly.
VALUE_RANGE = 4
EXACT_LIMIT = {torch.bfloat16: 256, torch.float16: 2048, torch.float32: 1 << 24}

# --------------------------------------------------------------------------- reference


def value_range(world_size: int, dtype: torch.dtype) -> int:
    """Largest |value| per rank such that any partial sum over ``world_size`` ranks is exact
    in ``dtype``; 0 when no integer inputs can be (the world is too large)."""
    return min(VALUE_RANGE, EXACT_LIMIT[dtype] // max(1, world_size))


def rank_input(count: int, rank: int, world_size: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rank ``rank``'s input: ``count`` seeded integers in [-v, v], never all zero.

    Every rank can draw every other rank's input (the seed names it), so each rank knows
    the exact sum without communicating."""
    return _rank_ints(count, rank, seed, _exact_range(world_size, dtype), device).to(dtype)


def _exact_range(world_size: int, dtype: torch.dtype) -> int:
    """:func:`value_range`, or ValueError when no integer inputs can be exact."""
    v = value_range(world_size, dtype)
    if v < 1:
        raise ValueError(f"world size {world_size}: no integer inputs keep a {dtype} sum exact "
                         f"(limit {EXACT_LIMIT[dtype]} ranks)")
    return v


def _rank_ints(count: int, rank: int, seed: int, v: int, device: str) -> torch.Tensor:
    """:func:`rank_input`'s integers, int32."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank)
    x = torch.randint(-v, v + 1, (count,), generator=g, device=device, dtype=torch.int32)
    x[0] = rank % v + 1  # never an all-zero input, on any rank; in [1, v], so the sum stays exact
    return x


def allreduce_ref(count: int, world_size: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The exact sum over ranks of :func:`rank_input`, fp32 ``[count]``.

    Cost of the real operation per rank (the ring / nccl-tests convention): algbw = size /
    time, busbw = algbw * 2 (n - 1) / n, the bytes each rank's link must carry; no FLOPs
    worth counting (n - 1 adds per element)."""
    v = _exact_range(world_size, dtype)
    total = torch.zeros(count, dtype=torch.float32, device=device)
    for r in range(world_size):
        # summed from the integers: no tensor of the input's dtype and size is left behind
        # for an output's allocation to be handed (over one rank it would hold the sum)
        total += _rank_ints(count, r, seed, v, device)
    return total


# --------------------------------------------------------------------------- torch.distributed


def torch_inplace(x: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(x, group=group)
    return x


def torch_outplace(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = torch.empty_like(x)
    out.copy_(x)
    dist.all_reduce(out, group=group)
    return out


# --------------------------------------------------------------------------- CuPy NCCL


def _error(e: BaseException) -> str:
    """``Type: first line``: a reason on one line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


@functools.lru_cache(maxsize=None)
def cupy_unavailable(device_kind: str) -> str | None:
    """Why the CuPy NCCL path cannot run on this kind of device, or None."""
    if device_kind != "cuda":
        return "NCCL through CuPy needs CUDA devices"
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is a reason, not a crash
        return f"CuPy is not importable ({type(e).__name__}: {e}); install microbench[cupy12] or [cupy13]"
    try:
        from cupy.cuda import nccl

        # CuPy without an NCCL it can load still imports the module, with available False
        # and none of its functions (calling one would read as an AttributeError)
        if not getattr(nccl, "available", True):
            return ("CuPy's NCCL binding is not available (cupy.cuda.nccl.available is False: "
                    "CuPy found no NCCL library it could load)")
        nccl.get_version()
    except Exception as e:  # noqa: BLE001
        return f"CuPy has no usable NCCL ({_error(e)})"
    return None


#: dtype -> (CuPy's constant, ncclDataType_t value in nccl.h: used when a CuPy build lacks the
#: name, e.g. bf16, which NCCL has had since 2.10)
_NCCL_TYPES = {torch.float16: ("NCCL_FLOAT16", 6), torch.float32: ("NCCL_FLOAT32", 7),
               torch.bfloat16: ("NCCL_BFLOAT16", 9)}


class CupyNccl:
    """One NCCL communicator per process group, built on CuPy, used on torch's stream.

    The unique id is made on the group's rank 0 and broadcast through the group itself.
    One that could not be made is not tried again: its error is kept instead, so later
    points skip at once rather than each repeat the broadcast and ncclCommInitRank (on
    several ranks, a rank retrying alone would wait in a broadcast its peers, holding their
    communicator, never send)."""

    #: id(group) -> its communicator, or why it could not be made
    _by_group: dict[int, "CupyNccl | str"] = {}

    def __init__(self, group: Any):
        from cupy.cuda import nccl

        self.nccl = nccl
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        uid = [nccl.get_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(uid, src=dist.get_global_rank(group, 0), group=group)
        self.comm = nccl.NcclCommunicator(world, uid[0], rank)

    @classmethod
    def for_group(cls, group: Any) -> "CupyNccl":
        key = id(group)
        if key not in cls._by_group:
            try:
                cls._by_group[key] = cls(group)
            except Exception as e:
                cls._by_group[key] = f"the CuPy NCCL communicator could not be made ({_error(e)})"
                raise
        have = cls._by_group[key]
        if isinstance(have, str):
            raise RuntimeError(have)
        return have

    @classmethod
    def failed(cls, group: Any) -> str | None:
        """Why ``group``'s communicator could not be made, once that was tried; else None."""
        have = cls._by_group.get(id(group))
        return have if isinstance(have, str) else None

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _NCCL_TYPES:
            raise TypeError(f"CuPy NCCL path: dtype {x.dtype} not supported")
        if not (x.is_contiguous() and out.is_contiguous()):
            raise ValueError("CuPy NCCL path: tensors must be contiguous")
        stream = torch.cuda.current_stream(x.device).cuda_stream  # the capture stream inside a graph
        name, value = _NCCL_TYPES[x.dtype]
        self.comm.allReduce(x.data_ptr(), out.data_ptr(), x.numel(), getattr(self.nccl, name, value),
                            getattr(self.nccl, "NCCL_SUM", 0), stream)
        return out


def cupy_inplace(x: torch.Tensor, group: Any) -> torch.Tensor:
    return CupyNccl.for_group(group).all_reduce(x, x)


def cupy_outplace(x: torch.Tensor, group: Any) -> torch.Tensor:
    return CupyNccl.for_group(group).all_reduce(x, torch.empty_like(x))


# --------------------------------------------------------------------------- symmetric memory

_SYMM_OPS = {"oneshot": "one_shot_all_reduce_out", "twoshot": "two_shot_all_reduce_out"}


def symm_unavailable(device_kind: str, path: str) -> str | None:
    """Why the symmetric-memory ``path`` ("oneshot" | "twoshot") cannot run, or None."""
    if device_kind != "cuda":
        return "symmetric memory needs CUDA devices with peer access"
    try:
        import torch.distributed._symmetric_memory as symm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch {torch.__version__} has no symmetric memory ({type(e).__name__}: {e})"
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, _SYMM_OPS[path]):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.{_SYMM_OPS[path]}"
    return None


#: What torch's symmetric-memory all-reduce kernels are built for: bf16 and fp32 elements
#: (fp16 is not dispatched), a message a multiple of 4 bytes (their narrowest vector), and for
#: the two-shot kernel the world sizes 2, 4 and 8 alone (the one-shot kernel also takes any
#: other size, unrolled less). Both two-shot variants here call the out-of-place kernel, the
#: in-place one with its input as the output, so the rule holds for both.
SYMM_DTYPES = (torch.bfloat16, torch.float32)
SYMM_TWO_SHOT_WORLDS = (2, 4, 8)


def symm_unsupported(path: str, nbytes: int, dtype: torch.dtype, world: int | None) -> str | None:
    """Why torch's ``path`` kernel ("oneshot" | "twoshot") refuses this message, or None.
    ``world`` None (no process group yet, as when planning) skips the world-size rule."""
    if dtype not in SYMM_DTYPES:
        return f"torch.ops.symm_mem.{_SYMM_OPS[path]} takes bf16 and fp32 only, not {str(dtype).split('.')[-1]}"
    if nbytes % 4:
        return f"torch.ops.symm_mem.{_SYMM_OPS[path]} needs a multiple of 4 bytes ({nbytes} given)"
    if path == "twoshot" and world is not None and world not in SYMM_TWO_SHOT_WORLDS:
        return (f"torch.ops.symm_mem.{_SYMM_OPS[path]} is built for world sizes "
                f"{', '.join(map(str, SYMM_TWO_SHOT_WORLDS))} only (this one: {world})")
    return None


class SymmBuffer:
    """One symmetric buffer per (group, dtype, device), grown to the largest call, mapped by
    every peer (rendezvous is collective: every rank allocates the same size in step)."""

    _by_key: dict[tuple, "SymmBuffer"] = {}

    def __init__(self, group: Any, numel: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm

        self.buf = symm.empty(numel, dtype=dtype, device=device)
        self.group_name = group.group_name
        symm.rendezvous(self.buf, self.group_name)  # by name: every torch that has the ops accepts it

    @classmethod
    def get(cls, group: Any, numel: int, dtype: torch.dtype, device: torch.device) -> "SymmBuffer":
        key = (id(group), dtype, str(device))
        have = cls._by_key.get(key)
        if have is None or have.buf.numel() < numel:
            cls._by_key[key] = have = cls(group, numel, dtype, device)
        return have


def _symm(path: str, x: torch.Tensor, group: Any, out: torch.Tensor) -> torch.Tensor:
    sb = SymmBuffer.get(group, x.numel(), x.dtype, x.device)
    staged = sb.buf[: x.numel()].view_as(x)
    staged.copy_(x)
    getattr(torch.ops.symm_mem, _SYMM_OPS[path])(staged, "sum", sb.group_name, out)
    return out


def symm_try(group: Any, device: str) -> None:
    """One one-shot sum through a symmetric buffer on ``device`` for ``group`` (an
    allocation, its rendezvous, the kernel); raises what this host refuses. Torch having the
    ops does not mean the host can map the memory (a VM without the driver's fabric or IPC
    handles, a sandbox refusing the handle exchange's socket). The rendezvous is collective:
    every rank of ``group`` must call this together."""
    x = torch.ones(64, dtype=torch.float32, device=device)
    _symm("oneshot", x, group, torch.empty_like(x))
    torch.cuda.synchronize(x.device)


def release() -> None:
    """Drop every communicator (destroyed) and symmetric buffer kept here: call before the
    process group they were made for is destroyed. They are kept by ``id(group)``, which
    outlives the group (a later group may get the same id and be handed a dead
    communicator), and a communicator holds NCCL's buffers and threads until destroyed."""
    comms = [c for c in CupyNccl._by_group.values() if isinstance(c, CupyNccl)]
    CupyNccl._by_group.clear()
    SymmBuffer._by_key.clear()
    for c in comms:
        c.comm.destroy()


def oneshot_inplace(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _symm("oneshot", x, group, x)


def oneshot_outplace(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _symm("oneshot", x, group, torch.empty_like(x))


def twoshot_inplace(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _symm("twoshot", x, group, x)


def twoshot_outplace(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _symm("twoshot", x, group, torch.empty_like(x))
