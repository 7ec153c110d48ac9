"""What both fused-expert kernels share: the weight layout they read, argument checks,
the tile configuration and its tuning table, and the ``@triton.jit`` weight-tile loader.

Weights are repacked once, at load time (:func:`prepare_weights`), never in the timed
step:

- **bf16** stays as the checkpoint has it: ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, the
  inputs (K) contiguous — what servers' fused-MoE kernel reads.
- **INT4** (checkpoint: ``qweight [E, N, K/8]`` with 8 nibbles along K per int32, scales
  ``[E, N, K/32]``, see ``moe_reference``) is transposed to ``[E, K/8, N]`` words and
  ``[E, K/32, N]`` scales: a tile's row of words is then contiguous across the N output
  channels, so a warp's loads coalesce along N while the 8 inputs of one word are
  unpacked in registers.  The bits are unchanged.

**Tile configurations** (:class:`GemmConfig`) are looked up in one typed table per
device (:class:`TuningTable`, written by ``microbench tune``), keyed by
``(kernel, gemm, weights, N, K, T)``.  Fallback, in order: the entry for the same key at
the nearest token count (by ratio; ties to the larger T) — for the few-token kernel only
among those with the same tile rows (:func:`tile_rows`: 16, 32 or 64, set by T, so a
configuration tuned for 16 rows is not borrowed by a 64-row tile whose registers and
shared memory it never sized); else :func:`default_config`, a fixed rule documented there.
The table never fails a run: a missing file is an empty table.

Layout: constants → the ``@triton.jit`` helper → weights → checks → configurations.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from microbench.kernels.checks import check_tensor
from microbench.kernels.moe_reference import INT4_PER_WORD, check_int4_weight

__all__ = [
    "ACTIVATION_DTYPES",
    "KERNELS",
    "ExpertWeights",
    "GemmConfig",
    "TuningEntry",
    "TuningTable",
    "check_moe_args",
    "default_config",
    "prepare_weights",
    "search_space",
    "tile_rows",
]

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

#: Activation dtypes: bf16 is the model's; fp16 and fp32 also serve the CPU interpreter,
#: whose own bf16 tl.dot is broken (the tests patch it: tests/interp_bf16.py).
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Kernel families with tuning entries, and the GEMM keys each one tunes.
KERNELS = {"fused": ("w13+w2",), "few_token": ("w13", "w2")}
#: The few-token kernel's tile rows: all of an expert's tokens up to T = 64 (its range);
#: tl.dot needs at least 16.
MIN_TILE_ROWS, MAX_TILE_ROWS = 16, 64
TUNING_SCHEMA = "microbench.moe_tuning"
TUNING_VERSION = 1


# --------------------------------------------------------------------------------------
# The weight-tile loader (both kernels)
# --------------------------------------------------------------------------------------


@triton.jit
def _mma(a, w):
    """``a @ w`` with ``w`` cast to ``a``'s dtype, accumulated in fp32. fp32 operands are
    multiplied at full precision: compiled, ``tl.dot`` would use TF32 (a 10-bit mantissa)
    by default, which the interpreter never does and an fp32 gate over K = 7168 rejects."""
    if a.dtype == tl.float32:
        return tl.dot(a, w.to(a.dtype), input_precision="ieee")
    else:
        return tl.dot(a, w.to(a.dtype))


@triton.jit
def _weight_tile(w_ptr, s_ptr, offs_k, offs_n, mask, stride_k, stride_n, stride_sk, stride_sn,
                 INT4: tl.constexpr, GROUP: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` tile of one expert's weight (``w_ptr``/``s_ptr`` already
    at the expert): bf16/fp16 as stored, or INT4 dequantised to fp32.

    INT4: word ``k // 8`` holds input k at bits ``4 * (k % 8)`` as ``q + 8``; the eight
    inputs of a word are loaded from the same address (one transaction, cached) and
    shifted apart in registers.
    """
    if INT4:
        words = tl.load(w_ptr + (offs_k // 8)[:, None] * stride_k + offs_n[None, :] * stride_n, mask=mask, other=0)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        sc = tl.load(s_ptr + (offs_k // GROUP)[:, None] * stride_sk + offs_n[None, :] * stride_sn, mask=mask,
                     other=0.0)
        return (q - 8).to(tl.float32) * sc.to(tl.float32)
    else:
        return tl.load(w_ptr + offs_k[:, None] * stride_k + offs_n[None, :] * stride_n, mask=mask, other=0.0)


@triton.jit
def _int4_tile_once(w_ptr, s_ptr, k0, k_hi, offs_n, n_ok, stride_k, stride_n, stride_sk, stride_sn,
                    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The INT4 tile of inputs ``[k0, k0 + BLOCK_K)`` (``k0`` a multiple of 8 and of the
    group when ``BLOCK_K >= GROUP``; inputs from ``k_hi`` on read as zero weights), with
    each word and each scale loaded once: ``BLOCK_K / 8`` rows of words are shifted into
    a ``[BLOCK_K / 8, 8, BLOCK_N]`` block and reshaped (row ``k = 8 * word + nibble``),
    the ``BLOCK_K / GROUP`` scale rows broadcast over their groups. A tuning option of
    the few-token kernel (``GemmConfig.unpack = 1``): :func:`_weight_tile` issues eight
    loads per word (one per input row, served from L1), this one none redundant, at the
    cost of the reshape's register shuffles; which is faster is the GPU's to say.
    """
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptr + offs_w[:, None] * stride_k + offs_n[None, :] * stride_n,
                    mask=(offs_w * 8 < k_hi)[:, None] & n_ok[None, :], other=0)
    q = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    q = tl.reshape(q, (BLOCK_K, BLOCK_N))
    if BLOCK_K >= GROUP:
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        sc = tl.load(s_ptr + offs_g[:, None] * stride_sk + offs_n[None, :] * stride_sn,
                     mask=(offs_g * GROUP < k_hi)[:, None] & n_ok[None, :], other=0.0)
        sc = tl.reshape(tl.broadcast_to(sc[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N)), (BLOCK_K, BLOCK_N))
    else:  # the whole tile inside one group
        sc = tl.load(s_ptr + (k0 // GROUP) * stride_sk + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
    k_ok = (k0 + tl.arange(0, BLOCK_K)) < k_hi
    return tl.where(k_ok[:, None], (q - 8).to(tl.float32) * sc.to(tl.float32), 0.0)


# --------------------------------------------------------------------------------------
# Weights in the kernels' layout
# --------------------------------------------------------------------------------------


@dataclass
class ExpertWeights:
    """One layer's routed-expert weights as the kernels read them (see the module doc).

    ``kind`` is ``"bf16"`` (dense, any half or fp32 dtype) or ``"int4"``; ``inter`` is
    the per-rank intermediate I (w13 has 2I output rows).
    """

    kind: str
    num_experts: int
    hidden: int
    inter: int
    group_size: int
    w13: Tensor  # dense [E, 2I, H]; int4 [E, H/8, 2I] int32
    w2: Tensor  # dense [E, H, I]; int4 [E, I/8, H] int32
    s13: Tensor | None = None  # int4 [E, H/G, 2I]
    s2: Tensor | None = None  # int4 [E, I/G, H]

    @property
    def int4(self) -> bool:
        return self.kind == "int4"

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def gemm(self, which: str) -> tuple[Tensor, Tensor, tuple[int, ...]]:
        """``(weight, scales, strides)`` of ``which`` ("w13" or "w2") for a kernel:
        strides are (expert, k, n, scale expert, scale k, scale n); dense weights pass
        themselves as the (unread) scales."""
        w, s = (self.w13, self.s13) if which == "w13" else (self.w2, self.s2)
        if self.int4:
            return w, s, (w.stride(0), w.stride(1), w.stride(2), s.stride(0), s.stride(1), s.stride(2))
        return w, w, (w.stride(0), w.stride(2), w.stride(1), 0, 0, 0)


def prepare_weights(w13: Tensor, w2: Tensor, *, w13_scales: Tensor | None = None,
                    w2_scales: Tensor | None = None) -> ExpertWeights:
    """Check checkpoint-layout weights and repack them for the kernels (load time).

    Args:
        w13: dense ``[E, 2I, H]`` (gate rows, then up rows), or INT4 ``[E, 2I, H/8]`` int32.
        w2: dense ``[E, H, I]``, or INT4 ``[E, H, I/8]`` int32.
        w13_scales, w2_scales: the INT4 scales ``[E, 2I, H/G]`` / ``[E, H, I/G]``; both or
            neither.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, a packed tensor of the wrong
            shape, or a group size that does not divide the input dimension — naming the
            argument.
    """
    for name, t in (("w13", w13), ("w2", w2)):
        check_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D [E, N, K] tensor, got shape {tuple(t.shape)}")
    if (w13_scales is None) != (w2_scales is None):
        raise ValueError("w13_scales / w2_scales: give both (INT4 weights) or neither (dense weights)")
    if w2.device != w13.device:
        raise ValueError(f"w2: on {w2.device}, but w13 is on {w13.device}")
    e, n13 = w13.shape[0], w13.shape[1]
    if n13 % 2:
        raise ValueError(f"w13: {n13} output rows cannot be split into gate and up halves")
    inter = n13 // 2
    if w2.shape[0] != e:
        raise ValueError(f"w2: {w2.shape[0]} experts, but w13 has {e}")
    if w13_scales is None:
        h = w13.shape[2]
        if w13.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"w13: dtype {w13.dtype} is not a dense weight dtype {ACTIVATION_DTYPES}")
        check_tensor("w2", w2, shape=(e, h, inter), like_name="w13's [E, H, I]")
        if w2.dtype != w13.dtype:
            raise ValueError(f"w2: dtype {w2.dtype} does not match w13 ({w13.dtype})")
        return ExpertWeights("bf16", e, h, inter, 0, w13, w2)
    h = w13.shape[2] * INT4_PER_WORD
    g13 = check_int4_weight("w13", w13, w13_scales)
    if tuple(w2.shape[:2]) != (e, h):
        raise ValueError(f"w2: expected [{e}, {h}, I/8] int32 to match w13, got {tuple(w2.shape)}")
    g2 = check_int4_weight("w2", w2, w2_scales, k=inter)
    if g13 != g2:
        raise ValueError(f"w2_scales: group size {g2} differs from w13's {g13}")
    for name, t in (("w13_scales", w13_scales), ("w2_scales", w2_scales)):
        check_tensor(name, t)
        if t.device != w13.device:
            raise ValueError(f"{name}: on {t.device}, but w13 is on {w13.device}")
    t13, t2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    return ExpertWeights("int4", e, h, inter, g13, t13, t2,
                         w13_scales.transpose(1, 2).contiguous(), w2_scales.transpose(1, 2).contiguous())


# --------------------------------------------------------------------------------------
# Argument checks shared by the launchers
# --------------------------------------------------------------------------------------


def check_moe_args(hidden: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor,
                   out: Tensor | None, check_ids: bool) -> tuple[int, int]:
    """Raise ``ValueError`` naming the argument unless a fused-experts call is well formed;
    return ``(T, top_k)``.  ``check_ids`` reads the ids on the host (a synchronisation)."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights: expected ExpertWeights (from prepare_weights), got {type(weights).__name__}")
    check_tensor("hidden", hidden)
    if hidden.dim() != 2 or hidden.shape[1] != weights.hidden:
        raise ValueError(f"hidden: expected [T, {weights.hidden}] (the weights' H), got {tuple(hidden.shape)}")
    if hidden.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"hidden: dtype {hidden.dtype} not supported; use one of {ACTIVATION_DTYPES}")
    if not weights.int4 and weights.w13.dtype != hidden.dtype:
        raise ValueError(f"weights: dense dtype {weights.w13.dtype} does not match hidden ({hidden.dtype})")
    if weights.device != hidden.device:
        raise ValueError(f"weights: on {weights.device}, but hidden is on {hidden.device}")
    check_tensor("topk_ids", topk_ids)
    t = hidden.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype != torch.int32:
        raise ValueError(f"topk_ids: expected int32 [{t}, top_k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    # No upper bound from the weights: under expert parallelism a rank may hold fewer
    # experts than a token picks (its other choices are -1).
    if k < 1:
        raise ValueError(f"topk_ids: top_k = {k} must be at least 1")
    check_tensor("topk_weights", topk_weights, shape=(t, k), like_name="topk_ids")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights: dtype {topk_weights.dtype}, expected torch.float32")
    for name, x in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if x.device != hidden.device:
            raise ValueError(f"{name}: on {x.device}, but hidden is on {hidden.device}")
    if out is not None:
        check_tensor("out", out, like=hidden, like_name="hidden")
    if check_ids and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= weights.num_experts:
            raise ValueError(f"topk_ids: expert ids must lie in 0..{weights.num_experts - 1} (or -1: another "
                             f"rank's expert), got range {lo}..{hi}")
    return t, k


# --------------------------------------------------------------------------------------
# Tile configurations and the per-device tuning table
# --------------------------------------------------------------------------------------


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class GemmConfig:
    """The launch parameters of one expert GEMM.

    ``block_m``: rows per block — for the fused (baseline) kernel the alignment's block
    size, for the few-token kernel unused (a tile holds all of an expert's tokens).
    ``group_m``: the baseline's row-block swizzle.  ``split_k``: the few-token kernel's
    K-split (partial sums merged by the next step).  ``unpack``: how the few-token kernel
    reads INT4 words — 0, one load per input row (eight per word, as servers' kernels
    do), or 1, each word once, unpacked by a reshape (``_int4_tile_once``); bf16 and the
    baseline ignore it.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 16
    group_m: int = 1
    split_k: int = 1
    unpack: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{f.name}: expected an int, got {v!r}")
        for name in ("block_n", "block_k", "block_m", "num_warps"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"{name}: must be a power of two, got {getattr(self, name)}")
        if self.block_k < 16 or self.block_m < 1 or self.block_n < 16:
            raise ValueError(f"block_k and block_n must be >= 16 (tl.dot), got {self.block_k}, {self.block_n}")
        if self.unpack not in (0, 1):
            raise ValueError(f"unpack: 0 (a load per input row) or 1 (each word once), got {self.unpack}")
        if self.num_stages < 1 or self.group_m < 1 or self.split_k < 1:
            raise ValueError(f"num_stages, group_m, split_k must be >= 1, got "
                             f"{self.num_stages}, {self.group_m}, {self.split_k}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def tile_rows(kernel: str, tokens: int) -> int | None:
    """Rows of the few-token kernel's tile at ``tokens`` (the next power of two, 16..64:
    an expert can receive every token); None for the fused kernel, whose rows are its
    configuration's ``block_m``."""
    if kernel != "few_token":
        return None
    return min(max(triton.next_power_of_2(max(tokens, 1)), MIN_TILE_ROWS), MAX_TILE_ROWS)


def default_config(kernel: str, gemm: str, weights: str, n: int, k: int, tokens: int,
                   small_shared: bool = False) -> GemmConfig:
    """The fallback when the tuning table has no entry for the key (a fixed rule).

    ``fused`` (baseline): 16-row blocks (servers' smallest alignment block, the one
    their small-batch configurations use), 64-wide N tiles, K steps of 128 for bf16 and
    64 for INT4 (its dequantisation holds more registers), 4 warps, 3 stages.
    ``few_token``: 64-wide N tiles (narrower when N is), the same K steps, and a K split
    of 4 for the w13 GEMM when K >= 2048 (K = H is long and N = 2I short, so one expert
    alone gives too few programs) and 1 for w2 (K = I is short, N = H wide). INT4 words
    read once (``unpack=1``), 3 stages: by ptxas for sm_90 at Kimi-K2.5 TP8 the w13 tile
    then holds 105 registers and 20 KiB of shared memory at 4 blocks/SM, against 254
    registers and 108 KiB at 2 blocks/SM with eight loads per word, whose pipeline buffers
    every word eight times (at 64 token rows: 214 registers, no spill, against 255 and a
    44-byte spill); it fits sm_120's blocks at 3 stages too (20-32 KiB). Those are Triton
    3.9's builds; under Triton 3.6 (ptxas 12.8) the 16-row tile stops at 128 registers and
    spills 12 B, as do 4 of the other 5 four-warp tiles of 32-128 columns at 3 or 4 stages
    (4-8 B; none at 2 stages or with 8 warps). bf16: 3 stages,
    or 2 on a GPU whose block may take less than 128 KiB of shared memory
    (``small_shared``: sm_86/89/120), where by ptxas for sm_120 a third stage leaves the
    16-row w13 tile one block per SM (72 KiB) and spills the 64-row one (80 B; 2 stages:
    none).
    Which reading is faster is the GPU's to say: ``microbench tune`` tries both.
    bf16 tiles of 32 and 64 rows (T > 16) take K steps of 64: by ptxas for sm_90 at Kimi-K2.5
    TP8, steps of 128 spill there (w13 at 32 rows 255 registers + 20 B, w2 at 64 rows 255 +
    40 B; w13 at 64 rows fits one block per SM, 144 KiB), steps of 64 do not (180 / 248
    registers, w13 at 64 rows 206 registers, 72 KiB, 2 blocks per SM).
    """
    if kernel not in KERNELS or gemm not in KERNELS[kernel]:
        raise ValueError(f"kernel/gemm: unknown pair {kernel!r}/{gemm!r} (known: {KERNELS})")
    bk = 64 if weights == "int4" or (kernel == "few_token" and tile_rows(kernel, tokens) > MIN_TILE_ROWS) else 128
    if kernel == "fused":
        return GemmConfig(block_n=64, block_k=bk, block_m=16, num_warps=4, num_stages=3)
    split = 4 if gemm == "w13" and k >= 2048 else 1
    unpack = 1 if weights == "int4" else 0
    return GemmConfig(block_n=64 if n >= 64 else max(16, triton.next_power_of_2(n)), block_k=bk, split_k=split,
                      num_warps=4, num_stages=2 if small_shared and not unpack else 3, unpack=unpack)


def search_space(kernel: str, gemm: str, weights: str, n: int, k: int, tokens: int) -> list[GemmConfig]:
    """The configurations ``microbench tune`` tries, the default first, then the rest in
    an order that puts the likelier winners early (so a capped search still helps).

    ``fused``: block_m 16/32/64 (the alignment block) x block_n 32/64/128 x block_k
    64/128 x group_m 1/8 x stages 3/4 — 72 configurations, ordered so that a short search
    varies what matters at few tokens first: block_n and stages (the first six), then
    block_k, then block_m (more padding rows per expert), group_m last (it reorders the
    tiles of an expert's row blocks; at few tokens each expert has one block).  ``few_token``: block_n
    32/64/128 x block_k 64/128 x split_k 1/2/4/8 (w13; w2: 1/2) x stages 3/4 — 48 / 24,
    and for INT4 each of them with ``unpack`` 1 and 0 (the default with 0 second).
    Warps stay 4 (at these row counts a tile is at most 64 x 128), except that the
    few-token default is also tried with 8 (next, with each ``unpack``): more loads in
    flight for a memory-bound tile, and under Triton 3.6 (ptxas 12.8) the 8-warp INT4 w13
    tiles do not spill where 4-warp ones do (``default_config``).
    """
    first = default_config(kernel, gemm, weights, n, k, tokens)
    out = [first]
    unpacks = (1, 0) if kernel == "few_token" and weights == "int4" else (0,)
    if len(unpacks) > 1:
        out.append(replace(first, unpack=0))
    if kernel == "few_token":
        out += [replace(first, num_warps=8, unpack=u) for u in unpacks]
    if kernel == "fused":
        bks = sorted((64, 128), key=lambda bk: bk != first.block_k)  # the default's K step first
        grid = [dict(block_m=m, block_n=bn, block_k=bk, group_m=g, num_stages=st)
                for g in (1, 8) for m in (16, 32, 64) for bk in bks for bn in (64, 128, 32) for st in (3, 4)]
    else:
        splits = (4, 2, 8, 1) if gemm == "w13" else (1, 2)
        grid = [dict(block_n=bn, block_k=bk, split_k=sk, num_stages=st, unpack=u)
                for sk in splits for bn in (64, 32, 128) for bk in (128, 64) for st in (3, 4) for u in unpacks]
    for g in grid:
        c = GemmConfig(num_warps=4, **g)
        if c not in out:
            out.append(c)
    return out


@dataclass(frozen=True)
class TuningEntry:
    kernel: str
    gemm: str
    weights: str
    n: int
    k: int
    tokens: int
    config: GemmConfig
    median_s: float | None = None

    def key(self) -> tuple:
        return (self.kernel, self.gemm, self.weights, self.n, self.k)


class TuningTable:
    """One device's tuned configurations: a typed JSON file, loaded and validated whole.

    File: ``{"schema": "microbench.moe_tuning", "version": 1, "device": NAME,
    "entries": [{"kernel", "gemm", "weights", "n", "k", "tokens", "config": {...},
    "median_s"}]}``.
    """

    def __init__(self, device: str, entries: list[TuningEntry] | None = None, path: str | None = None):
        self.device, self.entries, self.path = device, list(entries or []), path

    @classmethod
    def load(cls, path: str, device: str = "") -> "TuningTable":
        """The table at ``path``; an empty one when the file does not exist.  A malformed
        file raises ``ValueError`` naming the file and the entry."""
        if not os.path.exists(path):
            return cls(device, [], path)
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("schema") != TUNING_SCHEMA or doc.get("version") != TUNING_VERSION:
            raise ValueError(f"{path}: not a {TUNING_SCHEMA} v{TUNING_VERSION} file")
        entries = []
        for i, e in enumerate(doc.get("entries", [])):
            try:
                cfg = GemmConfig(**e["config"])
                entry = TuningEntry(str(e["kernel"]), str(e["gemm"]), str(e["weights"]), int(e["n"]), int(e["k"]),
                                    int(e["tokens"]), cfg, e.get("median_s"))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: entry {i}: {exc}") from None
            if entry.kernel not in KERNELS or entry.gemm not in KERNELS[entry.kernel]:
                raise ValueError(f"{path}: entry {i}: unknown kernel/gemm {entry.kernel}/{entry.gemm}")
            entries.append(entry)
        return cls(str(doc.get("device", device)), entries, path)

    def lookup(self, kernel: str, gemm: str, weights: str, n: int, k: int, tokens: int,
               small_shared: bool = False) -> tuple[GemmConfig, str]:
        """``(config, source)``: the exact entry, else the nearest token count of the same
        key (few-token: with the same :func:`tile_rows`), else :func:`default_config` (for a
        GPU with little shared memory per block when ``small_shared``); ``source`` says
        which ("tuned", "tuned at T=8", "default")."""
        rows = tile_rows(kernel, tokens)
        same = [e for e in self.entries if e.key() == (kernel, gemm, weights, n, k)
                and tile_rows(kernel, e.tokens) == rows]
        for e in same:
            if e.tokens == tokens:
                return e.config, "tuned"
        if same:
            best = min(same, key=lambda e: (abs(math.log(max(e.tokens, 1) / max(tokens, 1))), -e.tokens))
            return best.config, f"tuned at T={best.tokens}"
        return default_config(kernel, gemm, weights, n, k, tokens, small_shared), "default"

    def put(self, entry: TuningEntry) -> None:
        """Add or replace the entry for its key and token count."""
        self.entries = [e for e in self.entries if (e.key(), e.tokens) != (entry.key(), entry.tokens)]
        self.entries.append(entry)

    def save(self, path: str | None = None) -> str:
        """Write the table (sorted, atomically: a crash leaves the old file)."""
        path = path or self.path
        if not path:
            raise ValueError("path: the table was not loaded from a file; give one")
        doc: dict[str, Any] = {
            "schema": TUNING_SCHEMA, "version": TUNING_VERSION, "device": self.device,
            "entries": [{"kernel": e.kernel, "gemm": e.gemm, "weights": e.weights, "n": e.n, "k": e.k,
                         "tokens": e.tokens, "config": e.config.to_dict(), "median_s": e.median_s}
                        for e in sorted(self.entries, key=lambda e: (*e.key(), e.tokens))],
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
        return path

