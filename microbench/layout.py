"""A parallel layout (tp, ep) and the per-rank shapes it gives a model: what one rank of a
tensor- or expert-parallel server holds, the sizes every component reads. A layout that
does not split the model evenly is a :class:`~microbench.models.ConfigError` naming the
size and the degree."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from microbench.models import ACTIVATION_BYTES, ConfigError, ModelConfig

__all__ = ["ParallelLayout", "RankShapes", "rank_shapes"]


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor-parallel degree ``tp`` and expert-parallel degree ``ep`` (1 or ``tp``)."""

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for key in ("tp", "ep"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"ParallelLayout: {key} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class RankShapes:
    """The shapes one rank works on; every component reads its sizes from here.

    Attention (heads split across TP ranks; the latent KV cache is replicated):
      heads_per_rank     = num_attention_heads / tp
      q_head_dim         = qk_nope_head_dim + qk_rope_head_dim
      kv_lora_rank, qk_rope_head_dim, v_head_dim, q_lora_rank: as in the config
      kv_cache_dim       = kv_lora_rank + qk_rope_head_dim           (576)
      hidden             = hidden_size
    Routed experts — one of two layouts:
      ep == 1  (TP-sharded): every rank holds all experts, each sliced along its
               intermediate dim: experts_per_rank = n_routed_experts,
               moe_intermediate_per_rank = moe_intermediate_size / tp
      ep == tp (EP-distributed): each rank owns whole experts:
               experts_per_rank = n_routed_experts / ep,
               moe_intermediate_per_rank = moe_intermediate_size
      top_k              = num_experts_per_tok
    Always TP-sharded:
      shared_intermediate_per_rank = n_shared_experts * moe_intermediate_size / tp
      dense_intermediate_per_rank  = intermediate_size / tp
      vocab_per_rank               = vocab_size / tp
    Communication:
      allreduce_bytes_per_token    = hidden_size * 2   (one bf16 row per token, per allreduce)
    """

    model: ModelConfig
    layout: ParallelLayout
    heads_per_rank: int
    q_head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    kv_cache_dim: int
    v_head_dim: int
    hidden: int
    q_lora_rank: int | None
    experts_per_rank: int
    top_k: int
    moe_intermediate_per_rank: int
    shared_intermediate_per_rank: int
    dense_intermediate_per_rank: int
    vocab_per_rank: int
    allreduce_bytes_per_token: int

    def as_dict(self) -> dict[str, Any]:
        """The per-rank sizes with the model name and layout, for recording in a result."""
        d = {k: v for k, v in asdict(self).items() if k not in ("model", "layout")}
        return {"model": self.model.name, "tp": self.layout.tp, "ep": self.layout.ep, **d}


def _split(total: int, parts: int, what: str, by: str) -> int:
    if total % parts:
        raise ConfigError(f"{by}={parts} does not divide {what}={total}")
    return total // parts


def _whole_units(size: int, units: tuple[int, ...], what: str, storage: str, tp: int) -> None:
    for unit in units:
        if size % unit:
            raise ConfigError(f"{what}={size} is not a multiple of the {storage} scale group of {unit} (tp={tp})")


def rank_shapes(model: ModelConfig, layout: ParallelLayout) -> RankShapes:
    """Per-rank shapes of ``model`` under ``layout``; ConfigError when the layout does not
    split the model evenly (tp must divide heads, vocab and every TP-sharded intermediate
    size; ep must be 1 or tp and divide the experts; a quantised expert's per-rank K must
    hold whole scale groups, and every FP8 per-rank intermediate whole [N, K] blocks)."""
    tp, ep = layout.tp, layout.ep
    if ep not in (1, tp):
        raise ConfigError(f"ep={ep} must be 1 (TP-sharded experts) or equal tp={tp} (EP-distributed experts)")
    experts = _split(model.n_routed_experts, ep, "n_routed_experts", "ep")
    heads = _split(model.num_attention_heads, tp, "num_attention_heads", "tp")
    moe_inter = (_split(model.moe_intermediate_size, tp, "moe_intermediate_size", "tp") if ep == 1
                 else model.moe_intermediate_size)
    q = model.quant
    # The per-rank intermediate is the gate/up projection's N and the down projection's K:
    # a scale group (along K) or an FP8 block ([N, K]) split across ranks has no owner
    # (servers reject such layouts at weight load).
    blocks = tuple(dict.fromkeys(q.weight_block)) if q.weight_block else ()
    _whole_units(moe_inter, (q.group_size,) if q.group_size else blocks, "moe_intermediate_per_rank",
                 q.routed_experts, tp)
    shared = (_split(model.n_shared_experts * model.moe_intermediate_size, tp,
                     "n_shared_experts*moe_intermediate_size", "tp") if model.n_shared_experts else 0)
    dense = _split(model.intermediate_size, tp, "intermediate_size", "tp") if model.n_dense_layers else 0
    if q.other == "fp8":  # the shared experts and the dense MLP are in the same blocks
        _whole_units(shared, blocks, "shared_intermediate_per_rank", "fp8", tp)
        _whole_units(dense, blocks, "dense_intermediate_per_rank", "fp8", tp)
    return RankShapes(
        model=model, layout=layout, heads_per_rank=heads, q_head_dim=model.qk_head_dim,
        kv_lora_rank=model.kv_lora_rank, qk_rope_head_dim=model.qk_rope_head_dim,
        kv_cache_dim=model.kv_cache_dim, v_head_dim=model.v_head_dim, hidden=model.hidden_size,
        q_lora_rank=model.q_lora_rank, experts_per_rank=experts, top_k=model.num_experts_per_tok,
        moe_intermediate_per_rank=moe_inter, shared_intermediate_per_rank=shared,
        dense_intermediate_per_rank=dense, vocab_per_rank=_split(model.vocab_size, tp, "vocab_size", "tp"),
        allreduce_bytes_per_token=model.hidden_size * ACTIVATION_BYTES,
    )
