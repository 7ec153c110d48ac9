"""Model shapes as data: a frozen description read from a Hugging Face ``config.json``.

Every size a kernel, case or step-time model uses comes from here, so no number like
7168 appears anywhere but a config file.  Two layers:

* :class:`ModelConfig` — the DeepSeek-V3-family text model as its ``config.json`` states it
  (MLA attention, routed + shared experts, dense first layers) and how its weights are
  quantised (:class:`Quantization`).  Kimi-K2.5 nests the text model under
  ``"text_config"``; its ``quantization_config`` may sit at the top level or inside
  ``text_config``.  Both forms, and the flat DeepSeek-V3 form, are read.
* :class:`~microbench.layout.RankShapes` — what one rank holds under a
  :class:`~microbench.layout.ParallelLayout` (tp, ep): :mod:`microbench.layout`.

Shipped configs live in ``microbench.cases`` under ``models/<name>.json``.  Any error in a
config is a :class:`ConfigError` whose one-line message names the file and the key.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ConfigError", "ModelConfig", "Quantization", "cases_dir", "list_models", "load_model"]

# Activations (and therefore the TP allreduce payload) travel in bf16: 2 bytes per value.
ACTIVATION_BYTES = 2

# Hugging Face spells dtypes as torch names; the project's short names are what kernels,
# cases and tables use.
_DTYPE_NAMES = {
    "bfloat16": "bf16", "torch.bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "torch.float16": "fp16", "fp16": "fp16", "half": "fp16",
    "float32": "fp32", "torch.float32": "fp32", "fp32": "fp32", "float": "fp32",
}


#: bits per element of each storage a weight or a scale can have
_STORAGE_BITS = {"int4": 4, "fp8": 8, "bf16": 16, "fp16": 16, "fp32": 32}
_QUANTISED = ("int4", "fp8")
#: scale dtypes compressed-tensors may name beyond the model dtypes
_SCALE_NAMES = {**_DTYPE_NAMES, "float8_e4m3fn": "fp8", "torch.float8_e4m3fn": "fp8"}


class ConfigError(ValueError):
    """A model or hardware config that cannot be used; the message is one line naming the
    file and the key at fault."""


def cases_dir(kind: str) -> str:
    """The folder of shipped ``<kind>`` JSON files (``"models"`` or ``"hardware"``) inside
    the ``microbench.cases`` package.

    Found through the import system without executing ``microbench.cases`` (whose
    ``__init__`` defines cases and may import this module), so it works both from an
    installed package and from a plain checkout.
    """
    import importlib.util

    spec = importlib.util.find_spec("microbench.cases")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ConfigError("cannot locate the microbench.cases package (is microbench installed?)")
    return os.path.join(locations[0], kind)


def _shipped(kind: str) -> dict[str, str]:
    """Shipped name -> path for ``<kind>/*.json``."""
    folder = cases_dir(kind)
    if not os.path.isdir(folder):
        return {}
    return {f[:-5]: os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".json")}


def _read_json(path: str) -> dict[str, Any]:
    """The top-level JSON object of ``path``; a clear ConfigError for anything else."""
    label = os.path.basename(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{label}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{label}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: top level must be a JSON object, got {type(data).__name__}")
    return data


# ---- Typed field readers: each names the file and the key in its error. --------------

def _get(d: Mapping[str, Any], key: str, label: str) -> Any:
    if key not in d:
        raise ConfigError(f"{label}: missing key {key!r}")
    return d[key]


def _int(d: Mapping[str, Any], key: str, label: str, minimum: int = 1) -> int:
    v = _get(d, key, label)
    # bool is an int subclass in Python; `true` as a size is a typo, not 1.
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{label}: key {key!r} must be an integer, got {type(v).__name__} {v!r}")
    if v < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        raise ConfigError(f"{label}: key {key!r} must be {what}, got {v}")
    return v


def _opt_int(d: Mapping[str, Any], key: str, label: str) -> int | None:
    return None if _get(d, key, label) is None else _int(d, key, label)


def _float(d: Mapping[str, Any], key: str, label: str) -> float:
    v = _get(d, key, label)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{label}: key {key!r} must be a number, got {type(v).__name__} {v!r}")
    if not v > 0:
        raise ConfigError(f"{label}: key {key!r} must be positive, got {v}")
    return float(v)


def _str(d: Mapping[str, Any], key: str, label: str) -> str:
    v = _get(d, key, label)
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{label}: key {key!r} must be a non-empty string, got {v!r}")
    return v


def _bool(d: Mapping[str, Any], key: str, label: str) -> bool:
    v = _get(d, key, label)
    if not isinstance(v, bool):
        raise ConfigError(f"{label}: key {key!r} must be true or false, got {v!r}")
    return v


def _dtype(d: Mapping[str, Any], label: str) -> str:
    """The model's unquantised dtype (``torch_dtype``, or ``dtype`` in newer configs).

    Within one object ``torch_dtype`` wins over ``dtype``; the caller passes the text
    model's object when it names either key, the top-level one otherwise (a multimodal
    config's top-level dtype describes the whole checkpoint, the text model's its own
    weights). Neither key: bfloat16.
    """
    key = "torch_dtype" if "torch_dtype" in d else "dtype"
    raw = d.get(key, "bfloat16")
    name = _DTYPE_NAMES.get(str(raw).lower())
    if name is None:
        raise ConfigError(f"{label}: key {key!r} has unsupported dtype {raw!r}")
    return name


# ---- Quantization --------------------------------------------------------------------

@dataclass(frozen=True)
class Quantization:
    """How the weights are stored.

    ``routed_experts`` is the storage of the routed-expert GEMM weights ("int4", "fp8" or
    "bf16"); ``other`` that of everything else (attention, shared experts, dense MLP).
    ``group_size`` is the number of consecutive K-elements sharing one scale (INT4 group
    quantisation), ``weight_block`` the ``[N, K]`` tile sharing one scale (FP8 block
    quantisation); ``scale_dtype`` the dtype the scales are stored in; ``source`` says
    where in the config this was read.
    """

    routed_experts: str
    group_size: int | None
    symmetric: bool | None
    scale_dtype: str | None
    source: str
    other: str
    weight_block: tuple[int, int] | None = None

    @property
    def routed_bits(self) -> int:
        """Bits per routed-expert weight element (scales not counted)."""
        return _STORAGE_BITS[self.routed_experts]

    def matrix_bytes(self, n: int, k: int, storage: str | None = None) -> float:
        """Bytes of one ``[N, K]`` weight matrix held as ``storage`` (default: the routed
        experts' storage): its elements, and for a quantised storage its scales.

        The scales follow this scheme when ``storage`` is the routed experts' own: one per
        ``group_size`` K-elements, else one per ``weight_block`` tile, else one per row (a
        per-channel scheme); each of ``scale_dtype``. Another quantised storage (attention
        in FP8 beside INT4 experts) has a scheme this description does not keep: it is
        priced with one scale per row.
        """
        storage = storage or self.routed_experts
        nbytes = n * k * _STORAGE_BITS[storage] / 8
        if storage not in _QUANTISED:
            return nbytes
        own = storage == self.routed_experts
        if own and self.group_size:
            scales = n * -(-k // self.group_size)
        elif own and self.weight_block:
            bn, bk = self.weight_block
            scales = -(-n // bn) * -(-k // bk)
        else:
            scales = n
        return nbytes + scales * _STORAGE_BITS[self.scale_dtype or "bf16"] / 8


def _ct_matches(pattern: str, name: str) -> bool:
    """compressed-tensors name matching: ``re:`` prefixes a regex (``re.match``), anything
    else is an exact module name or a trailing component of one."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _ct_scheme(names: list[str], groups: Mapping[str, Any], ignore: list[str], label: str) -> dict | None:
    """The ``weights`` scheme that applies to a module known by any of ``names``, or None
    when it stays unquantised (ignored, or targeted by no group)."""
    if any(_ct_matches(p, n) for p in ignore for n in names):
        return None
    for gname, group in groups.items():
        if not isinstance(group, Mapping):
            raise ConfigError(f"{label}: quantization_config.config_groups.{gname} must be an object")
        targets = group.get("targets", [])
        if not _strings(targets):
            raise ConfigError(f"{label}: quantization_config.config_groups.{gname}.targets must be a list of "
                              f"strings, got {targets!r}")
        # "Linear" targets a module class: every projection in these models is a Linear.
        if any(t == "Linear" or any(_ct_matches(t, n) for n in names) for t in targets):
            weights = group.get("weights")
            if weights is not None and not isinstance(weights, Mapping):
                raise ConfigError(f"{label}: quantization_config.config_groups.{gname}.weights must be an object")
            return dict(weights) if weights is not None else None
    return None


def _ct_storage(w: Mapping[str, Any], label: str) -> str:
    bits, kind = w.get("num_bits"), w.get("type")
    if (bits, kind) == (4, "int"):
        return "int4"
    if (bits, kind) == (8, "float"):
        return "fp8"
    raise ConfigError(f"{label}: quantization_config weights num_bits={bits} type={kind!r} is not supported "
                      "(int4 or fp8)")


def _module_names(suffix: str, nested: bool) -> list[str]:
    # Kimi-K2.5's text model sits under `language_model.` in its checkpoint.
    names = [f"model.layers.{suffix}"]
    return names + [f"language_model.model.layers.{suffix}"] if nested else names


def _quantization(top: Mapping[str, Any], text: Mapping[str, Any], nested: bool, label: str) -> Quantization:
    base = _dtype(text if ("torch_dtype" in text or "dtype" in text) else top, label)
    qc = text.get("quantization_config", top.get("quantization_config"))
    if qc is None:
        return Quantization(base, None, None, None, f"{label}: no quantization_config ({base} weights)", base)
    if not isinstance(qc, Mapping):
        raise ConfigError(f"{label}: key 'quantization_config' must be an object")
    method = _str(qc, "quant_method", f"{label}: quantization_config")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and not _two_positive_ints(block):
            raise ConfigError(f"{label}: key 'weight_block_size' must be two positive integers, got {block!r}")
        # DeepSeek-V3 FP8 checkpoints store one fp32 `weight_scale_inv` per 128x128 block.
        src = f"{label}: quantization_config fp8 {qc.get('fmt', 'e4m3')} block {block}"
        return Quantization("fp8", None, True, "fp32", src, "fp8", tuple(block) if block else None)
    if method != "compressed-tensors":
        raise ConfigError(f"{label}: quantization_config quant_method {method!r} is not supported "
                          "(fp8 or compressed-tensors)")
    groups = _get(qc, "config_groups", f"{label}: quantization_config")
    ignore = qc.get("ignore") or []
    if not isinstance(groups, Mapping) or not _strings(ignore):
        raise ConfigError(f"{label}: quantization_config config_groups must be an object and ignore a list of "
                          f"strings, got ignore={ignore!r}")
    moe_layer = _first_moe_layer(text)
    w = _ct_scheme(_module_names(f"{moe_layer}.mlp.experts.0.down_proj", nested), groups, ignore, label)
    attn = _ct_scheme(_module_names("0.self_attn.kv_b_proj", nested), groups, ignore, label)
    other = base if attn is None else _ct_storage(attn, label)
    fmt = qc.get("format", "?")
    if w is None:
        return Quantization(base, None, None, None, f"{label}: compressed-tensors {fmt}, routed experts ignored", other)
    storage, strategy = _ct_storage(w, label), w.get("strategy")
    group = w.get("group_size") if strategy == "group" else None
    block = w.get("block_structure") if strategy == "block" else None
    if block is not None and not _two_positive_ints(block):
        raise ConfigError(f"{label}: key 'block_structure' must be two positive integers, got {block!r}")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group <= 0):
        raise ConfigError(f"{label}: key 'group_size' must be a positive integer, got {group!r}")
    sym = w.get("symmetric")
    scale = w.get("scale_dtype")
    # Without an explicit scale dtype, compressed-tensors stores scales in the model dtype.
    scale_name = _SCALE_NAMES.get(str(scale).lower()) if scale is not None else base
    if scale_name is None:
        raise ConfigError(f"{label}: key 'scale_dtype' has unsupported dtype {scale!r} "
                          "(bfloat16, float16, float32 or float8_e4m3fn)")
    src = f"{label}: quantization_config compressed-tensors {fmt}, {strategy} strategy"
    return Quantization(storage, group, None if sym is None else bool(sym), scale_name, src, other,
                        tuple(block) if block else None)


def _strings(v: Any) -> bool:
    """A list of strings (compressed-tensors' ``targets`` and ``ignore``: a bare string
    would be read character by character)."""
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _two_positive_ints(v: Any) -> bool:
    return (isinstance(v, list) and len(v) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in v))


def _first_moe_layer(text: Mapping[str, Any]) -> int:
    """The first routed layer by the HF DeepseekV3 rule (i >= first_k_dense_replace and
    i % moe_layer_freq == 0), whose experts' scheme is the one read; the values are
    checked later, with the rest of the config."""
    first, freq = text.get("first_k_dense_replace", 0), text.get("moe_layer_freq", 1)
    if isinstance(first, int) and isinstance(freq, int) and first >= 0 and freq > 0:
        return -(-first // freq) * freq
    return 0


# ---- ModelConfig ---------------------------------------------------------------------

_INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
             "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "vocab_size",
             "n_group", "topk_group")


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3-family text model, as its ``config.json`` states it.

    Attention is MLA: queries go through a ``q_lora_rank`` bottleneck (None: a direct
    projection) into ``num_attention_heads`` heads of ``qk_nope_head_dim + qk_rope_head_dim``;
    the KV cache holds one shared latent of ``kv_lora_rank + qk_rope_head_dim`` per token.
    Layers ``< first_k_dense_replace`` have a dense MLP of ``intermediate_size``; the rest
    (every ``moe_layer_freq``-th) route each token to ``num_experts_per_tok`` of
    ``n_routed_experts`` experts of ``moe_intermediate_size`` plus ``n_shared_experts``.
    """

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    vocab_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str | None
    norm_topk_prob: bool
    rms_norm_eps: float
    quant: Quantization
    moe_layer_freq: int = 1
    #: YaRN's attention factor, mscale(factor, mscale_all_dim)^2 (1.0 without YaRN scaling)
    attention_mscale: float = 1.0

    @property
    def qk_head_dim(self) -> int:
        """Query/key head width: ``qk_nope_head_dim + qk_rope_head_dim`` (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """The attention logits' scale: ``qk_head_dim ** -0.5`` times YaRN's
        ``attention_mscale`` (HF DeepseekV3Attention; Kimi-K2.5: 0.0722 x 2.005 = 0.1447)."""
        return self.qk_head_dim ** -0.5 * self.attention_mscale

    @property
    def kv_cache_dim(self) -> int:
        """Per-token latent KV cache width: ``kv_lora_rank + qk_rope_head_dim`` (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        """Layers with routed experts: index ``>= first_k_dense_replace`` and a multiple of
        ``moe_layer_freq`` (HF DeepseekV3 rule)."""
        return sum(1 for i in range(self.first_k_dense_replace, self.num_hidden_layers)
                   if i % self.moe_layer_freq == 0)

    @property
    def n_dense_layers(self) -> int:
        """Layers with a dense MLP: ``num_hidden_layers - n_moe_layers``."""
        return self.num_hidden_layers - self.n_moe_layers

    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any], name: str | None = None) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` (a path, a folder holding one, or the parsed
        dict).  ``name`` defaults to the file's stem (or folder name for ``config.json``)."""
        if isinstance(source, Mapping):
            top, label = source, name or "<config dict>"
            name = name or str(source.get("_name_or_path") or source.get("model_type") or "model")
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            top, label = _read_json(path), os.path.basename(path)
            stem = os.path.splitext(label)[0]
            name = name or (os.path.basename(os.path.dirname(os.path.abspath(path))) if stem == "config" else stem)
        nested = "text_config" in top
        text = top["text_config"] if nested else top
        if not isinstance(text, Mapping):
            raise ConfigError(f"{label}: key 'text_config' must be an object")
        sizes = {k: _int(text, k, label) for k in _INT_KEYS}
        model = cls(
            name=name,
            q_lora_rank=_opt_int(text, "q_lora_rank", label),
            n_shared_experts=_int(text, "n_shared_experts", label, minimum=0),
            first_k_dense_replace=_int(text, "first_k_dense_replace", label, minimum=0),
            routed_scaling_factor=_float(text, "routed_scaling_factor", label),
            scoring_func=_str(text, "scoring_func", label),
            topk_method=None if text.get("topk_method") is None else _str(text, "topk_method", label),
            norm_topk_prob=_bool(text, "norm_topk_prob", label),
            rms_norm_eps=_float(text, "rms_norm_eps", label),
            quant=_quantization(top, text, nested, label),
            moe_layer_freq=_int(text, "moe_layer_freq", label) if "moe_layer_freq" in text else 1,
            attention_mscale=_yarn_mscale(text, label),
            **sizes,
        )
        model._check(label)
        return model

    def _check(self, label: str) -> None:
        """Relations between keys that the HF model code (grouped top-k routing) assumes."""
        for small, big in (("num_experts_per_tok", "n_routed_experts"), ("topk_group", "n_group"),
                           ("first_k_dense_replace", "num_hidden_layers")):
            if getattr(self, small) > getattr(self, big):
                raise ConfigError(f"{label}: {small}={getattr(self, small)} exceeds {big}={getattr(self, big)}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"{label}: n_group={self.n_group} does not divide "
                              f"n_routed_experts={self.n_routed_experts}")


def _yarn_mscale(text: Mapping[str, Any], label: str) -> float:
    """``mscale^2`` with ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` when
    ``rope_scaling`` is YaRN with a factor above 1 and a non-zero ``mscale_all_dim`` (how
    DeepSeek-V3 sharpens its softmax for the extended context), else 1."""
    rs = text.get("rope_scaling")
    if rs is None:
        return 1.0
    if not isinstance(rs, Mapping):
        raise ConfigError(f"{label}: key 'rope_scaling' must be an object or null")
    if rs.get("type", rs.get("rope_type")) != "yarn":
        return 1.0
    factor, all_dim = _float(rs, "factor", f"{label}: rope_scaling"), rs.get("mscale_all_dim", 0)
    if isinstance(all_dim, bool) or not isinstance(all_dim, (int, float)) or all_dim < 0:
        raise ConfigError(f"{label}: rope_scaling key 'mscale_all_dim' must be a number >= 0, got {all_dim!r}")
    if factor <= 1 or not all_dim:
        return 1.0
    return (0.1 * all_dim * math.log(factor) + 1.0) ** 2


def list_models() -> list[str]:
    """Names of the shipped model configs (``microbench.cases/models/*.json``), sorted."""
    return sorted(_shipped("models"))


def load_model(name_or_path: str) -> ModelConfig:
    """A shipped model by name (``"kimi-k2.5"``, ``"deepseek-v3"``) or a config at a path."""
    shipped = _shipped("models")
    key = str(name_or_path)
    if key in shipped:
        return ModelConfig.from_hf(shipped[key], name=key)
    if key.endswith(".json") or os.sep in key or os.path.exists(key):
        return ModelConfig.from_hf(key)
    raise ConfigError(f"unknown model {key!r}; shipped models: {', '.join(sorted(shipped)) or 'none'} "
                      "(or pass the path of a config.json)")
