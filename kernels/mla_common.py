"""The shared contract of the MLA attention kernels (extend, decode, verify): layout and plan.

Absorbed MLA at one rank: every query head attends over one shared latent cache.

* ``q``        [T, H, D]  the new tokens' queries, D = 576 = 512 latent (``kv_lora_rank``)
  + 64 rope channels; T = sum of the requests' q_len (draft tokens per request).
* ``kv_new``   [T, D]     the new tokens' own latent rows (key; the value is the first 512).
* ``kv_cache`` [num_pages, page_size, D]  the pool of the prefix (context) latents; page
  size 1 is a pool of token slots.
* ``out``      [T, H, Dv]  Dv = 512.

Which pages hold which request's prefix, in which (arbitrary, shuffled) order, and how the
new tokens see each other is the **plan**, built once per batch on the host by
:func:`plan_mla` (as a server builds its attention metadata once per forward and reuses it
for every layer): it validates everything before any launch and keeps the host-side
integers a launcher needs (max q_len, max prefix, split counts) so a launch never
synchronises. Request ``b``:

* new tokens ``qo_indptr[b] : qo_indptr[b+1]`` (q_len = the difference, 1 .. MAX_Q_LEN);
* prefix of ``prefix_lens[b]`` tokens in pages ``kv_indices[kv_indptr[b] : kv_indptr[b+1]]``
  (exactly ceil(prefix_len / page_size) pages; the last may be partly filled);
* new token i sees the whole prefix, and new token j where the mask allows: causal
  (j <= i) when ``tree_mask`` is None, else ``tree_mask[mask_indptr[b] + i*q_len + j]``
  (an EAGLE tree: every token sees itself, and its ancestors).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from microbench.kernels import checks

#: Largest q_len per request: EAGLE-3 verify uses 1 + draft steps (x top-k in a tree);
#: 16 covers a 3-step top-4 tree's 13 nodes and keeps q_len x heads rows within a tile.
MAX_Q_LEN = 16
#: DeepSeek-V3-family MLA: 512 latent channels + 64 rope channels; the value is the latent.
KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM
#: SM count used off the GPU (the interpreter), so split rules run as on an H200 (132 SMs).
CPU_SM_STAND_IN = 132


@dataclass(frozen=True)
class MLAPlan:
    """A validated batch layout (device tensors for the kernels, host ints for launchers)."""

    qo_indptr: Tensor  # [B+1] int32
    kv_indptr: Tensor  # [B+1] int32
    kv_indices: Tensor  # [P] int32 page ids
    prefix_lens: Tensor  # [B] int32
    tree_mask: Tensor | None  # [sum q_len^2] bool, row-major per request; None = causal
    mask_indptr: Tensor | None  # [B+1] int32 offsets into tree_mask
    page_size: int
    num_pages: int
    sm_scale: float
    logit_cap: float
    q_lens: tuple[int, ...]
    prefix_lens_host: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_prefix(self) -> int:
        return max(self.prefix_lens_host)

    @property
    def total_prefix(self) -> int:
        return sum(self.prefix_lens_host)


def _int_vector(name: str, t: object, n: int | None = None) -> list[int]:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected a 1-D int32 tensor, got {tuple(t.shape)} {t.dtype}")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name}: expected {n} entries, got {t.numel()}")
    return [int(v) for v in t.tolist()]


def _indptr(name: str, t: Tensor, n: int | None = None) -> list[int]:
    v = _int_vector(name, t, n)
    if not v or v[0] != 0:
        raise ValueError(f"{name}: must start at 0")
    bad = [i for i in range(1, len(v)) if v[i] < v[i - 1]]
    if bad:
        raise ValueError(f"{name}: not monotone at entry {bad[0]} ({v[bad[0] - 1]} then {v[bad[0]]})")
    return v


def plan_mla(
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    prefix_lens: Tensor,
    *,
    page_size: int,
    num_pages: int,
    sm_scale: float,
    tree_mask: Tensor | None = None,
    logit_cap: float = 0.0,
) -> MLAPlan:
    """Validate a batch layout and return its plan (ValueError naming the argument)."""
    for name, v in (("page_size", page_size), ("num_pages", num_pages)):
        # an int: a fractional size would count pages one way here and read them another
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    for name, v, low in (("sm_scale", sm_scale, "> 0"), ("logit_cap", logit_cap, ">= 0 (0: no cap)")):
        # inf or NaN would make every kernel and the reference NaN alike (a NaN cap: no cap)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
                or not (v > 0 if name == "sm_scale" else v >= 0):
            raise ValueError(f"{name}: expected a finite number {low}, got {v!r}")
    qo = _indptr("qo_indptr", qo_indptr)
    batch = len(qo) - 1
    if batch < 1:
        raise ValueError("qo_indptr: needs at least one request (B+1 >= 2 entries)")
    q_lens = [qo[i + 1] - qo[i] for i in range(batch)]
    if min(q_lens) < 1:
        raise ValueError(f"qo_indptr: request {q_lens.index(min(q_lens))} has no new token")
    if max(q_lens) > MAX_Q_LEN:
        raise ValueError(f"qo_indptr: q_len {max(q_lens)} over the supported maximum {MAX_Q_LEN}")
    kv = _indptr("kv_indptr", kv_indptr, batch + 1)
    idx = _int_vector("kv_indices", kv_indices, kv[-1])
    out_of_range = [i for i in idx if not 0 <= i < num_pages]
    if out_of_range:
        raise ValueError(f"kv_indices: page {out_of_range[0]} out of range [0, {num_pages})")
    pl = _int_vector("prefix_lens", prefix_lens, batch)
    for b, n in enumerate(pl):
        pages = -(-n // page_size)
        if n < 0 or kv[b + 1] - kv[b] != pages:
            raise ValueError(f"prefix_lens: request {b} has {n} tokens, needing {pages} pages of {page_size}, "
                             f"but kv_indptr gives it {kv[b + 1] - kv[b]}")
    devices = {t.device for t in (qo_indptr, kv_indptr, kv_indices, prefix_lens)}
    mask_indptr = None
    if tree_mask is not None:
        if not isinstance(tree_mask, Tensor) or tree_mask.dim() != 1:
            raise ValueError("tree_mask: expected a flat 1-D bool tensor (see pack_tree_masks)")
        want = sum(q * q for q in q_lens)
        if tree_mask.numel() != want:
            raise ValueError(f"tree_mask: {tree_mask.numel()} entries, but the q_lens need {want} (sum of q_len^2)")
        # the kernels read it as flat contiguous bytes: a strided view would be misread
        tree_mask = tree_mask.to(torch.bool, copy=True).contiguous()
        flat = tree_mask.cpu()
        off = 0
        for b, q in enumerate(q_lens):
            diag = flat[off: off + q * q].view(q, q).diagonal()
            if not bool(diag.all()):
                raise ValueError(f"tree_mask: request {b} has a token that does not see itself")
            off += q * q
        mask_indptr = torch.tensor([0] + [sum(q * q for q in q_lens[: b + 1]) for b in range(batch)],
                                   dtype=torch.int32, device=tree_mask.device)
        devices.add(tree_mask.device)
    if len(devices) > 1:
        raise ValueError(f"plan tensors are on several devices: {sorted(map(str, devices))}")
    # copies: the plan's checks hold for what it keeps, whatever the caller does with its own
    as32 = lambda t: t.to(torch.int32, copy=True).contiguous()  # noqa: E731
    return MLAPlan(as32(qo_indptr), as32(kv_indptr), as32(kv_indices), as32(prefix_lens), tree_mask, mask_indptr,
                   int(page_size), int(num_pages), float(sm_scale), float(logit_cap), tuple(q_lens), tuple(pl))


def pack_tree_masks(masks: Sequence[Tensor]) -> Tensor:
    """Per-request [q_len, q_len] bool masks -> the flat row-major layout of the plan."""
    return torch.cat([m.reshape(-1).to(torch.bool) for m in masks])


def check_mla_tensors(q: Tensor, kv_new: Tensor, kv_cache: Tensor, plan: MLAPlan, out: Tensor | None) -> Tensor:
    """Check the tensors against the plan (no device sync); return ``out`` (allocated if None)."""
    if not isinstance(plan, MLAPlan):
        raise TypeError(f"plan: expected an MLAPlan (from plan_mla), got {type(plan).__name__}")
    if out is not None and not isinstance(out, Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    for name, t in (("q", q), ("kv_new", kv_new), ("kv_cache", kv_cache)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} does not match q ({q.dtype})")
        if t.device != plan.qo_indptr.device:
            raise ValueError(f"{name}: on {t.device}, but the plan is on {plan.qo_indptr.device}")
    if q.dim() != 3 or q.shape[0] != plan.total_q or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q: expected [{plan.total_q}, H, {HEAD_DIM}], got {tuple(q.shape)}")
    if tuple(kv_new.shape) != (plan.total_q, HEAD_DIM):
        raise ValueError(f"kv_new: expected [{plan.total_q}, {HEAD_DIM}], got {tuple(kv_new.shape)}")
    if tuple(kv_cache.shape) != (plan.num_pages, plan.page_size, HEAD_DIM):
        raise ValueError(f"kv_cache: expected [{plan.num_pages}, {plan.page_size}, {HEAD_DIM}], "
                         f"got {tuple(kv_cache.shape)}")
    shape = (plan.total_q, q.shape[1], KV_LORA_RANK)
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {list(shape)} {q.dtype} tensor on {q.device}")
    return out


def mla_cost(plan: MLAPlan, num_heads: int, elem_bytes: int) -> tuple[int, int]:
    """(bytes, FLOPs) of one call: the floor a kernel is measured against.

    Bytes: the prefix latents read once (total_prefix x 576), the new tokens' latents, q
    and out, the page indices and per-request vectors (int32: two indptrs of B + 1 and the
    B prefix lengths), and a tree mask with its offsets when there is one. FLOPs: q.k over 576 channels and p.v over 512
    for every (query, head, visible-or-not key) pair: 2 x T x H x L x (576 + 512), L the
    request's prefix + q_len.
    """
    t, h = plan.total_q, num_heads
    nbytes = elem_bytes * (plan.total_prefix * HEAD_DIM + t * HEAD_DIM + t * h * (HEAD_DIM + KV_LORA_RANK))
    nbytes += 4 * (len(plan.kv_indices) + 3 * plan.batch + 2)
    if plan.tree_mask is not None:
        nbytes += plan.tree_mask.numel() + 4 * (plan.batch + 1)
    flops = sum(2 * q * h * (p + q) * (HEAD_DIM + KV_LORA_RANK) for q, p in zip(plan.q_lens, plan.prefix_lens_host))
    return int(nbytes), int(flops)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of ``device`` (cached per device) for the split rules; off the GPU the compile
    target's while launches only compile, else :data:`CPU_SM_STAND_IN`."""
    if device.type != "cuda":
        return (checks.COMPILE_SM_COUNT or CPU_SM_STAND_IN) if checks.COMPILE_ONLY else CPU_SM_STAND_IN
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
