"""Hardware profiles: the datasheet ceilings every table reports "% of floor" against.

A profile is a JSON file, shipped in ``microbench.cases`` under ``hardware/<name>.json``
or anywhere on disk, and meant to be edited by hand.  Every number is a *figure* that
carries its unit and where it comes from, because a ceiling without a source is a rumour
too.  Schema (units are checked, so "GB/s" cannot slip in where "B/s" is meant)::

    {
      "name": "h200-sxm",
      "description": "one line",
      "figures": {
        "memory_bandwidth": {"value": 4.8e12,  "unit": "B/s",    "source": "..."},  # required
        "bf16_dense_flops": {"value": 989e12,  "unit": "FLOP/s", "source": "..."},  # required, no sparsity
        "fp8_dense_flops":  {"value": 1979e12, "unit": "FLOP/s", "source": "..."},  # optional
        "l2_bytes":         {"value": 62914560, "unit": "B",     "source": "..."},  # required
        "sm_count":         {"value": 132,     "unit": "count",  "source": "..."},  # required
        "memory_bytes":     {"value": 141e9,   "unit": "B",      "source": "..."},  # required
        "launch_overhead":  {"value": 4e-6,    "unit": "s",      "source": "..."},  # optional (the step model needs it)
        "kernel_floor":     {"value": 2e-6,    "unit": "s",      "source": "..."}   # optional (the step model needs it)
      },
      "int4_note": "optional text: which units run INT4 weight-only GEMMs",
      "measured": {"copy_bandwidth": {...}, "bf16_matmul_flops": {...}},  # optional ceilings seen in real runs
      "interconnect": {
        "kind": "nvlink" | "pcie",
        "bandwidth_per_direction": {"value": 450e9, "unit": "B/s", "source": "..."},
        "latency": {"value": 2e-6, "unit": "s", "source": "..."}   # alpha of an alpha-beta allreduce model
      },
      "aliases": ["h200"],  # optional: other names it answers to (exact, unique among shipped profiles)
      "match": ["H200"],  # words of torch.cuda.get_device_name() this profile applies to
      "exclude": ["NVL"],  # optional: words that take a matching name out (H200 NVL is another board)
      "sm": {             # optional: one SM's limits, for `microbench compile` (fit and occupancy)
        "compute_capability": "9.0", "registers_per_sm": 65536, "max_warps_per_sm": 64,
        "max_blocks_per_sm": 32, "max_threads_per_block": 1024, "shared_per_sm": 233472,
        "shared_per_block": 232448, "shared_reserved_per_block": 1024, "source": "..."
      }
    }

Datasheet figures are peaks; ``measured`` records what a real run reached (a copy or a
matmul never hits the datasheet), and the harness measures both again in every run.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .models import ConfigError, _read_json, _shipped

__all__ = ["Figure", "HardwareProfile", "SmLimits", "list_profiles", "load_profile", "profile_for_device_name",
           "shipped_listing"]

# figure name -> (unit it must be given in, required?)
_FIGURES: dict[str, tuple[str, bool]] = {
    "memory_bandwidth": ("B/s", True),
    "bf16_dense_flops": ("FLOP/s", True),
    "fp8_dense_flops": ("FLOP/s", False),
    "l2_bytes": ("B", True),
    "sm_count": ("count", True),
    "memory_bytes": ("B", True),
    "launch_overhead": ("s", False),
    "kernel_floor": ("s", False),
}
_INTERCONNECT_FIGURES = {"bandwidth_per_direction": "B/s", "latency": "s"}
_INTERCONNECT_KINDS = ("nvlink", "pcie")
# Units a "measured" figure may use: each is a rate or a time the harness also reports.
_MEASURED_UNITS = ("B/s", "FLOP/s", "s")


@dataclass(frozen=True)
class Figure:
    """One number, its unit (``B/s``, ``FLOP/s``, ``B``, ``s``, ``count``) and its source."""

    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class SmLimits:
    """What one SM of a compute capability holds, and what one block may take: the limits a
    kernel build must fit (shared memory and registers per block) and the occupancy they
    leave.  Shared memory in bytes (``shared_per_block`` is the opt-in maximum a kernel may
    ask for; each resident block also takes ``shared_reserved_per_block``); registers are
    32-bit, allocated per warp in units of ``register_granularity``."""

    compute_capability: str
    registers_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    max_threads_per_block: int
    shared_per_sm: int
    shared_per_block: int
    shared_reserved_per_block: int
    source: str
    register_granularity: int = 256
    max_registers_per_thread: int = 255

    @property
    def arch(self) -> int:
        """The capability as Triton's target names it: major * 10 + minor (9.0 -> 90)."""
        major, minor = self.compute_capability.split(".")
        return int(major) * 10 + int(minor)


_SM_INTS = ("registers_per_sm", "max_warps_per_sm", "max_blocks_per_sm", "max_threads_per_block",
            "shared_per_sm", "shared_per_block", "shared_reserved_per_block")


def _sm_limits(raw: Any, label: str) -> SmLimits | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{label}: key 'sm' must be an object")
    cc = raw.get("compute_capability")
    if not isinstance(cc, str) or not re.fullmatch(r"\d+\.\d", cc):
        raise ConfigError(f"{label}: sm.compute_capability must be a string like \"9.0\", got {cc!r}")
    vals: dict[str, int] = {}
    for key in _SM_INTS:
        v = raw.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "shared_reserved_per_block" else 1):
            raise ConfigError(f"{label}: missing or bad sm.{key} (a positive integer), got {v!r}")
        vals[key] = v
    if not isinstance(raw.get("source"), str) or not raw["source"]:
        raise ConfigError(f"{label}: sm.source must say where these limits come from")
    unknown = sorted(set(raw) - set(_SM_INTS) - {"compute_capability", "source"})
    if unknown:
        raise ConfigError(f"{label}: unknown key sm.{unknown[0]}")
    return SmLimits(compute_capability=cc, source=raw["source"], **vals)


@dataclass(frozen=True)
class HardwareProfile:
    """Peak figures of one GPU model and its interconnect.

    ``memory_bandwidth`` in B/s and ``*_flops`` in FLOP/s are datasheet peaks (dense, no
    sparsity); ``l2_bytes`` and ``memory_bytes`` in bytes; ``interconnect`` is
    ``{"kind": "nvlink"|"pcie", "bandwidth_per_direction": Figure (B/s), "latency":
    Figure (s)}``, the β and α of an α–β allreduce model; ``measured`` holds ceilings
    reached by real runs (e.g. ``copy_bandwidth``, ``bf16_matmul_flops``).
    """

    name: str
    description: str
    memory_bandwidth: Figure
    bf16_dense_flops: Figure
    l2_bytes: Figure
    sm_count: Figure
    memory_bytes: Figure
    interconnect: dict[str, Any]
    match: list[str]
    exclude: tuple[str, ...] = ()  # words that take a matching device name out
    aliases: tuple[str, ...] = ()  # short names it answers to ("h100" for h100-sxm)
    fp8_dense_flops: Figure | None = None
    int4_note: str | None = None
    launch_overhead: Figure | None = None
    kernel_floor: Figure | None = None  # the shortest a kernel takes on the GPU, replayed
    measured: dict[str, Figure] = field(default_factory=dict)
    sm: SmLimits | None = None  # one SM's limits (microbench compile)

    def peak_flops(self, dtype: str) -> Figure | None:
        """The dense tensor-core peak for GEMM operands of ``dtype`` ("bf16", "fp16",
        "fp8", or "int4" weight-only, which dequantises to bf16); None when unknown."""
        d = dtype.lower()
        if d in ("bf16", "fp16", "int4"):
            return self.bf16_dense_flops
        if d == "fp8":
            return self.fp8_dense_flops
        return None

    def ridge_point(self, dtype: str = "bf16") -> float | None:
        """FLOP per byte at which ``dtype`` GEMMs turn from memory- to compute-bound."""
        peak = self.peak_flops(dtype)
        return peak.value / self.memory_bandwidth.value if peak is not None else None

    def figures(self) -> dict[str, Figure]:
        """Every figure by a flat name (interconnect ones prefixed ``interconnect.``,
        measured ones ``measured.``), for printing beside a result."""
        out = {k: getattr(self, k) for k in _FIGURES if getattr(self, k) is not None}
        out.update({f"interconnect.{k}": self.interconnect[k] for k in _INTERCONNECT_FIGURES})
        out.update({f"measured.{k}": v for k, v in self.measured.items()})
        return out


def _figure(raw: Any, key: str, unit: str | tuple[str, ...], label: str) -> Figure:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{label}: figure {key!r} must be an object with value, unit and source")
    for part in ("value", "unit", "source"):
        if part not in raw:
            raise ConfigError(f"{label}: figure {key!r} is missing {part!r}")
    value, got_unit, source = raw["value"], raw["unit"], raw["source"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{label}: figure {key!r} value must be a positive number, got {value!r}")
    allowed = (unit,) if isinstance(unit, str) else unit
    if got_unit not in allowed:
        raise ConfigError(f"{label}: figure {key!r} unit must be {' or '.join(allowed)!s}, got {got_unit!r}")
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"{label}: figure {key!r} needs a non-empty source")
    return Figure(float(value), got_unit, source)


def _profile(data: Mapping[str, Any], label: str) -> HardwareProfile:
    for key in ("name", "description"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ConfigError(f"{label}: missing key {key!r} (a non-empty string)")
    figs = data.get("figures")
    if not isinstance(figs, Mapping):
        raise ConfigError(f"{label}: missing key 'figures' (an object)")
    unknown = sorted(set(figs) - set(_FIGURES))
    if unknown:
        raise ConfigError(f"{label}: unknown figure {unknown[0]!r}; known: {', '.join(_FIGURES)}")
    parsed: dict[str, Figure | None] = {}
    for key, (unit, required) in _FIGURES.items():
        if key in figs and figs[key] is not None:
            parsed[key] = _figure(figs[key], key, unit, label)
        elif required:
            raise ConfigError(f"{label}: missing figure {key!r}")
        else:
            parsed[key] = None
    ic = data.get("interconnect")
    if not isinstance(ic, Mapping):
        raise ConfigError(f"{label}: missing key 'interconnect' (an object)")
    if ic.get("kind") not in _INTERCONNECT_KINDS:
        raise ConfigError(f"{label}: interconnect kind must be one of {', '.join(_INTERCONNECT_KINDS)}, "
                          f"got {ic.get('kind')!r}")
    interconnect: dict[str, Any] = {k: v for k, v in ic.items() if k not in _INTERCONNECT_FIGURES}
    for key, unit in _INTERCONNECT_FIGURES.items():
        if key not in ic:
            raise ConfigError(f"{label}: missing figure 'interconnect.{key}'")
        interconnect[key] = _figure(ic[key], f"interconnect.{key}", unit, label)
    match = data.get("match")
    if not isinstance(match, list) or not match or not all(isinstance(m, str) and m for m in match):
        raise ConfigError(f"{label}: key 'match' must be a non-empty list of device-name substrings")
    exclude = data.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(m, str) and m for m in exclude):
        raise ConfigError(f"{label}: key 'exclude' must be a list of device-name words")
    aliases = _aliases(data.get("aliases", []), label)
    measured_raw = data.get("measured") or {}
    if not isinstance(measured_raw, Mapping):
        raise ConfigError(f"{label}: key 'measured' must be an object")
    measured = {k: _figure(v, f"measured.{k}", _MEASURED_UNITS, label) for k, v in measured_raw.items()}
    note = data.get("int4_note")
    if note is not None and not isinstance(note, str):
        raise ConfigError(f"{label}: key 'int4_note' must be a string")
    return HardwareProfile(
        name=data["name"], description=data["description"], interconnect=interconnect,
        match=list(match), exclude=tuple(exclude), aliases=aliases, int4_note=note, measured=measured,
        sm=_sm_limits(data.get("sm"), label), **parsed,  # type: ignore[arg-type]
    )


def _has_words(name: str, words: str) -> bool:
    """``words`` in ``name``, case-insensitively, not inside a longer word; punctuation and
    spaces alike separate words (``Max-Q`` is in "... Max-Q ..." and in a file name's
    ``...-max-q-...``)."""
    plain = lambda s: " ".join(re.sub(r"[^a-z0-9]+", " ", s.lower()).split())  # noqa: E731
    return re.search(rf"(?<![a-z0-9]){re.escape(plain(words))}(?![a-z0-9])", plain(name)) is not None


def list_profiles() -> list[str]:
    """Names of the shipped hardware profiles (``microbench.cases/hardware/*.json``)."""
    return sorted(_shipped("hardware"))


def _aliases(raw: Any, label: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(a, str) and re.fullmatch(r"[a-z0-9][a-z0-9.-]*", a)
                                            for a in raw):
        raise ConfigError(f"{label}: key 'aliases' must be a list of short lowercase names (letters, digits, "
                          f"'-', '.'), got {raw!r}")
    return tuple(raw)


def _shipped_aliases(shipped: Mapping[str, str]) -> dict[str, str]:
    """Alias -> shipped profile name; a ConfigError when two profiles claim one name."""
    owner: dict[str, str] = {}
    for name, path in shipped.items():
        for alias in _aliases(_read_json(path).get("aliases", []), os.path.basename(path)):
            other = owner.get(alias) or (alias if alias in shipped else None)
            if other is not None:
                raise ConfigError(f"hardware profiles {other} and {name} both answer to {alias!r}; "
                                  f"an alias must name one profile")
            owner[alias] = name
    return owner


def shipped_listing() -> str:
    """The shipped profiles for help and error text, each alias after its
    profile: ``"h100-pcie, h100-sxm (alias h100), …"``."""
    shipped = _shipped("hardware")
    aliases = _shipped_aliases(shipped)
    return ", ".join(n + "".join(f" (alias {a})" for a, owner in sorted(aliases.items()) if owner == n)
                     for n in shipped) or "none"


def load_profile(name_or_path: str | os.PathLike) -> HardwareProfile:
    """A shipped profile by name (``"h200-sxm"``), by an alias it declares (``"h200"``), by a
    prefix naming one profile only (``"rtx-pro"``), or a profile JSON at a path."""
    shipped = _shipped("hardware")
    key = os.fspath(name_or_path)
    aliases = _shipped_aliases(shipped)
    prefixed = sorted(n for n in shipped if n.startswith(key)) if key else []
    looks_like_path = key.endswith(".json") or os.sep in key or os.path.exists(key)
    if key in shipped:
        path = shipped[key]
    elif key in aliases:
        path = shipped[aliases[key]]
    elif len(prefixed) == 1:
        path = shipped[prefixed[0]]
    elif looks_like_path:
        path = key
    elif prefixed:
        raise ConfigError(f"hardware profile {key!r} is ambiguous: {', '.join(prefixed)} all begin with it; "
                          f"name one in full")
    else:
        raise ConfigError(f"unknown hardware profile {key!r}; shipped profiles: "
                          f"{shipped_listing()} (or pass the path of a profile JSON)")
    return _profile(_read_json(path), os.path.basename(path))


def profile_for_device_name(device_name: str) -> HardwareProfile | None:
    """The shipped profile one of whose ``match`` entries occurs in ``device_name`` (as
    ``torch.cuda.get_device_name()`` reports it, compared case-insensitively) as whole
    words (``H200`` is in "NVIDIA H200", not in "NVIDIA GH200 480GB"), and none of whose
    ``exclude`` words does ("NVIDIA H200 NVL" is another board); the longest match wins so
    a more specific profile beats a general one.  None when none applies."""
    best: tuple[int, HardwareProfile] | None = None
    for path in _shipped("hardware").values():
        profile = _profile(_read_json(path), os.path.basename(path))
        hit = match_length(profile, device_name)
        if hit and (best is None or hit > best[0]):
            best = (hit, profile)
    return best[1] if best else None


def match_length(profile: HardwareProfile, device_name: str) -> int:
    """The longest of ``profile``'s ``match`` entries found in ``device_name`` as whole words
    (case-insensitively); 0 when none is, or when one of its ``exclude`` words is."""
    if any(_has_words(device_name, x) for x in profile.exclude):
        return 0
    return max((len(m) for m in profile.match if _has_words(device_name, m)), default=0)
