"""The fused-expert kernels' tile configurations and the per-device table that tunes them.

**Tile configurations** (:class:`GemmConfig`) are looked up in one typed table per
device (:class:`TuningTable`, written by ``microbench tune``), keyed by
``(kernel, gemm, weights, N, K, T)``.  Fallback, in order: the entry for the same key at
the nearest token count (by ratio; ties to the larger T) — for the few-token kernel only
among those with the same tile rows (:func:`tile_rows`: 16, 32 or 64, set by T, so a
configuration tuned for 16 rows is not borrowed by a 64-row tile whose registers and
shared memory it never sized); else :func:`default_config`, a fixed rule documented there.
The table never fails a run: a missing file is an empty table.

Layout: constants → the configuration → the default rule and the search space → the table.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import triton

__all__ = [
    "KERNELS",
    "GemmConfig",
    "TuningEntry",
    "TuningTable",
    "default_config",
    "search_space",
    "tile_rows",
]

#: Kernel families with tuning entries, and the GEMM keys each one tunes.
KERNELS = {"fused": ("w13+w2",), "few_token": ("w13", "w2")}
#: The few-token kernel's tile rows: all of an expert's tokens up to T = 64 (its range);
#: tl.dot needs at least 16.
MIN_TILE_ROWS, MAX_TILE_ROWS = 16, 64
TUNING_SCHEMA = "microbench.moe_tuning"
TUNING_VERSION = 1


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
                   small_shared: bool = False, whole_words: bool = True) -> GemmConfig:
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
    Which reading is faster is the GPU's to say: ``microbench tune`` tries both. An INT4
    group that is not a power of two (``whole_words`` False) cannot be read a word at a
    time: one load per input row then.
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
    unpack = 1 if weights == "int4" and whole_words else 0
    return GemmConfig(block_n=64 if n >= 64 else max(16, triton.next_power_of_2(n)), block_k=bk, split_k=split,
                      num_warps=4, num_stages=2 if small_shared and not unpack else 3, unpack=unpack)


def search_space(kernel: str, gemm: str, weights: str, n: int, k: int, tokens: int,
                 small_shared: bool = False) -> list[GemmConfig]:
    """The configurations ``microbench tune`` tries, the default first, then the rest in
    an order that puts the likelier winners early (so a capped search still helps).
    ``small_shared`` (a GPU whose block may take less than 128 KiB of shared memory): the
    default is that GPU's (:func:`default_config`), and the stages tried are 2 and 3, not
    3 and 4.

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
    first = default_config(kernel, gemm, weights, n, k, tokens, small_shared)
    stages = (2, 3) if small_shared else (3, 4)
    out = [first]
    unpacks = (1, 0) if kernel == "few_token" and weights == "int4" else (0,)
    if len(unpacks) > 1:
        out.append(replace(first, unpack=0))
    if kernel == "few_token":
        out += [replace(first, num_warps=8, unpack=u) for u in unpacks]
    if kernel == "fused":
        bks = sorted((64, 128), key=lambda bk: bk != first.block_k)  # the default's K step first
        grid = [dict(block_m=m, block_n=bn, block_k=bk, group_m=g, num_stages=st)
                for g in (1, 8) for m in (16, 32, 64) for bk in bks for bn in (64, 128, 32) for st in stages]
    else:
        splits = (4, 2, 8, 1) if gemm == "w13" else (1, 2)
        grid = [dict(block_n=bn, block_k=bk, split_k=sk, num_stages=st, unpack=u)
                for sk in splits for bn in (64, 32, 128) for bk in (128, 64) for st in stages for u in unpacks]
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
        file raises ``ValueError`` naming the file (and the entry); so does a table tuned on
        another device than ``device`` (when given): its configurations were searched on
        that device's memory and shared-memory sizes, and would be labelled "tuned" here."""
        if not os.path.exists(path):
            return cls(device, [], path)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if (not isinstance(doc, dict) or doc.get("schema") != TUNING_SCHEMA
                or doc.get("version") != TUNING_VERSION):
            raise ValueError(f"{path}: not a {TUNING_SCHEMA} v{TUNING_VERSION} file")
        tuned_on, raw = doc.get("device", device), doc.get("entries", [])
        if not isinstance(tuned_on, str) or not isinstance(raw, list):
            raise ValueError(f"{path}: 'device' must be a string and 'entries' a list")
        if device and tuned_on and tuned_on != device:
            raise ValueError(f"{path}: tuned on {tuned_on}, not {device} (a table serves the device it was "
                             "tuned on: retune here, or give this device its own file)")
        entries = []
        for i, e in enumerate(raw):
            try:
                if not isinstance(e, dict):
                    raise TypeError(f"an object expected, got {type(e).__name__}")
                cfg = GemmConfig(**e["config"])
                entry = TuningEntry(str(e["kernel"]), str(e["gemm"]), str(e["weights"]), int(e["n"]), int(e["k"]),
                                    int(e["tokens"]), cfg, e.get("median_s"))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: entry {i}: {exc}") from None
            if entry.kernel not in KERNELS or entry.gemm not in KERNELS[entry.kernel]:
                raise ValueError(f"{path}: entry {i}: unknown kernel/gemm {entry.kernel}/{entry.gemm}")
            entries.append(entry)
        return cls(tuned_on or device, entries, path)

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
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:  # a full disk: the old table stays, and no half-written temporary
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path

