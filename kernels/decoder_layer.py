"""One rank's DeepSeek-V3 / Kimi-K2.5 decoder layer, built from this project's kernels,
and its torch reference.

The forward, in the order a server runs it (absorbed MLA, TP-sharded heads and experts)::

    h = rmsnorm(x + residual)                      input norm, residual add fused (Triton)
    [q_a | kv_a | k_pe] = h @ W_qkv_a               fused q_a / kv_a projection (one GEMM)
    q_a = rmsnorm(q_a);  c_kv = rmsnorm(kv_a)       q_a and kv_a norms (Triton)
    [q_nope | q_pe] = q_a @ W_q_b                   q_b projection, per-rank heads
    q_pe, k_pe = rope(q_pe), rope(k_pe)             rotary on the 64 rope channels
    q_lat = q_nope x W_kc                           absorb: per head [nope] -> [512]
    cache[slots] = [c_kv | k_pe]                    latent KV-cache write
    o = attention([q_lat | q_pe], [c_kv | k_pe], cache)   decode / extend / verify kernel
    o = (o x W_vc) @ W_o                            per head [512] -> [v], then o_proj
    allreduce(o)                                    a real one on several ranks, else a stand-in
    h2 = rmsnorm(o + residual)                      post-attention norm (fused add)
    w, ids = route(h2)                              gate GEMM + grouped top-k (Triton)
    y = experts(h2, w, ids) + shared(h2)            routed (fused or few_token) + shared expert
    allreduce(y)

GEMMs are torch (cuBLAS, as servers run them); the kernels under study are this
project's. :func:`decoder_layer_ref` is the same computation in fp32 from the references
(``rmsnorm_ref``, ``mla_attention_ref``, ``router_ref``, ``fused_moe_ref``) and plain fp32
matmuls; its cost: every weight read once (routed experts: the touched ones), the
latent cache read once per request (once per head by the extend kernel), activations
negligible next to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from microbench.kernels.mla_common import KV_LORA_RANK, ROPE_DIM, MLAPlan
from microbench.kernels.moe_common import ExpertWeights

#: DeepSeek-V3's rope base (config ``rope_theta``); the cost does not depend on it.
ROPE_THETA = 10000.0
ATTENTION = ("decode", "extend", "verify")
MOE = ("fused", "few_token")


@dataclass(frozen=True)
class LayerShape:
    """One rank's layer sizes (from ``microbench.layout.rank_shapes``, or scaled down)."""

    hidden: int
    heads: int
    q_lora: int
    nope: int  # qk_nope_head_dim
    v_head: int
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    n_group: int
    topk_group: int
    scaling: float
    eps: float = 1e-6
    mscale: float = 1.0  # YaRN's attention factor on the softmax scale (ModelConfig.attention_mscale)

    @property
    def q_head(self) -> int:
        return self.nope + ROPE_DIM


@dataclass
class LayerWeights:
    """Weights in the layouts the forward reads (``[K, N]`` for torch GEMMs)."""

    shape: LayerShape
    input_norm: Tensor  # [H]
    qkv_a: Tensor  # [H, q_lora + 512 + 64]
    q_a_norm: Tensor  # [q_lora]
    kv_a_norm: Tensor  # [512]
    q_b: Tensor  # [q_lora, heads * q_head]
    w_kc: Tensor  # [heads, nope, 512]
    w_vc: Tensor  # [heads, 512, v_head]
    o_proj: Tensor  # [heads * v_head, H]
    post_norm: Tensor  # [H]
    gate: Tensor  # [E, H] (router)
    gate_bias: Tensor  # [E] fp32 correction bias
    experts: ExpertWeights  # for the kernels
    experts_ckpt: dict[str, Tensor]  # the checkpoint layout, for the reference
    shared_w13: Tensor  # [H, 2 * shared_inter]
    shared_w2: Tensor  # [shared_inter, H]

    def nbytes(self, touched: int | None = None) -> int:
        """Bytes of the layer's weights as the kernels hold them; with ``touched``, of those a
        step reads: the routed experts only ``touched`` of ``num_experts`` (every expert
        tensor leads with the expert dimension)."""
        ts = [self.input_norm, self.qkv_a, self.q_a_norm, self.kv_a_norm, self.q_b, self.w_kc, self.w_vc, self.o_proj,
              self.post_norm, self.gate, self.gate_bias, self.shared_w13, self.shared_w2]
        ex = [t for t in (self.experts.w13, self.experts.w2, self.experts.s13, self.experts.s2) if t is not None]
        dense = sum(t.numel() * t.element_size() for t in ts)
        experts = sum(t.numel() * t.element_size() for t in ex)
        if touched is None:
            return dense + experts
        if not 0 <= touched <= self.experts.num_experts:
            raise ValueError(f"touched: {touched} experts of {self.experts.num_experts}")
        return dense + experts * touched // self.experts.num_experts


@dataclass
class LayerBatch:
    """Where the step's tokens sit: the attention plan, the paged latent cache, each new
    token's position (for rope) and cache slot (page id, page size 1 for the write)."""

    plan: MLAPlan
    kv_cache: Tensor  # [pages, page_size, 576]
    positions: Tensor  # [T] int64
    slots: Tensor  # [T] int64 rows of kv_cache.view(-1, 576) the new latents go to


def rope(x: Tensor, positions: Tensor, theta: float = ROPE_THETA) -> Tensor:
    """Rotary embedding on the last dim (64), rotate-half layout, in x's dtype: [..., T, 64]
    with positions [T] broadcast over leading dims after the token dim.

    The models pair channels (2i, 2i + 1) (servers' ``is_neox_style=False``) and stretch
    the frequencies with YaRN; this pairs (i, i + 32) at plain ``theta`` frequencies. With
    random weights that is a fixed permutation of the rope channels and other angles: the
    same elementwise work on the same bytes, which is what the layer times."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # [T, 32]
    shape = [positions.numel()] + [1] * (x.dim() - 2) + [half]
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def stand_in_allreduce(x: Tensor) -> Tensor:
    """One rank: no sum to take. This moves the same bytes (read + write [T, H]) so the
    layer keeps a kernel where the allreduce would be; records call it a stand-in."""
    return x.mul_(1.0)


def _attention(kind: str, q: Tensor, kv_new: Tensor, batch: LayerBatch) -> Tensor:
    if kind == "decode":
        from microbench.kernels.mla_decode import mla_decode as fn
    elif kind == "extend":
        from microbench.kernels.mla_extend import mla_extend as fn
    elif kind == "verify":
        from microbench.kernels.mla_verify import mla_verify as fn
    else:
        raise ValueError(f"attention: expected one of {', '.join(ATTENTION)}, got {kind!r}")
    return fn(q, kv_new, batch.kv_cache, batch.plan)


def decoder_layer(x: Tensor, residual: Tensor, w: LayerWeights, batch: LayerBatch, *, attention: str,
                  moe: str, allreduce: Callable[[Tensor], Any] = stand_in_allreduce,
                  moe_config: Mapping[str, Any] | None = None) -> tuple[Tensor, Tensor]:
    """One layer on one rank: x, residual [T, H] -> (the layer's output [T, H], residual).

    ``residual`` is updated in place (x + residual, then + the attention output), as the
    fused norms do in servers; ``attention`` in ("decode", "extend", "verify"), ``moe`` in
    ("fused", "few_token"); ``allreduce(t)`` sums t in place across the TP ranks;
    ``moe_config`` the MoE kernels' tiles ({"fused", "w13", "w2"}: GemmConfig), each
    missing one the kernel's default."""
    from microbench.kernels.moe_routing import route
    from microbench.kernels.rmsnorm import rmsnorm

    if moe not in MOE:
        raise ValueError(f"moe: expected one of {', '.join(MOE)}, got {moe!r}")
    s = w.shape
    t = x.shape[0]
    h = rmsnorm(x, w.input_norm, s.eps, residual=residual)
    qkv = h @ w.qkv_a
    q_a = rmsnorm(qkv[:, : s.q_lora].contiguous(), w.q_a_norm, s.eps)
    c_kv = rmsnorm(qkv[:, s.q_lora: s.q_lora + KV_LORA_RANK].contiguous(), w.kv_a_norm, s.eps)
    k_pe = rope(qkv[:, s.q_lora + KV_LORA_RANK:], batch.positions)
    q = (q_a @ w.q_b).view(t, s.heads, s.q_head)
    q_pe = rope(q[..., s.nope:], batch.positions)
    q_lat = torch.bmm(q[..., : s.nope].transpose(0, 1), w.w_kc).transpose(0, 1)  # [T, heads, 512]
    q_full = torch.cat([q_lat, q_pe], dim=-1)
    kv_new = torch.cat([c_kv, k_pe], dim=-1)
    batch.kv_cache.view(-1, KV_LORA_RANK + ROPE_DIM).index_copy_(0, batch.slots, kv_new)
    o = _attention(attention, q_full, kv_new, batch)  # [T, heads, 512]
    o = torch.bmm(o.transpose(0, 1), w.w_vc).transpose(0, 1).reshape(t, s.heads * s.v_head) @ w.o_proj
    allreduce(o)
    h2 = rmsnorm(o, w.post_norm, s.eps, residual=residual)
    topk_w, topk_ids = route(h2, w.gate, w.gate_bias, top_k=s.top_k, n_group=s.n_group, topk_group=s.topk_group,
                             routed_scaling_factor=s.scaling)
    cfg = moe_config or {}
    if moe == "fused":
        from microbench.kernels.moe_fused import fused_moe

        y = fused_moe(h2, w.experts, topk_w, topk_ids, config=cfg.get("fused"))
    else:
        from microbench.kernels.moe_few_token import few_token_moe

        y = few_token_moe(h2, w.experts, topk_w, topk_ids, config_w13=cfg.get("w13"), config_w2=cfg.get("w2"))
    gu = h2 @ w.shared_w13
    y = y + (torch.nn.functional.silu(gu[:, : s.shared_inter]) * gu[:, s.shared_inter:]) @ w.shared_w2
    allreduce(y)
    return y, residual


def decoder_layer_ref(x: Tensor, residual: Tensor, w: LayerWeights, batch: LayerBatch) -> tuple[Tensor, Tensor]:
    """:func:`decoder_layer` in fp32 from the references (one rank; the allreduce of one
    rank is the identity). Returns (output [T, H], updated residual [T, H]) in fp32; the
    inputs are not modified."""
    from microbench.kernels.moe_reference import fused_moe_ref, router_ref
    from microbench.kernels.reference import mla_attention_ref, rmsnorm_ref

    s = w.shape
    f = lambda t: t.float()  # noqa: E731
    t = x.shape[0]
    h, res = rmsnorm_ref(x, w.input_norm, s.eps, residual)
    qkv = h @ f(w.qkv_a)
    q_a = rmsnorm_ref(qkv[:, : s.q_lora], w.q_a_norm, s.eps)[0]
    c_kv = rmsnorm_ref(qkv[:, s.q_lora: s.q_lora + KV_LORA_RANK], w.kv_a_norm, s.eps)[0]
    k_pe = rope(qkv[:, s.q_lora + KV_LORA_RANK:], batch.positions)
    q = (q_a @ f(w.q_b)).view(t, s.heads, s.q_head)
    q_pe = rope(q[..., s.nope:], batch.positions)
    q_lat = torch.einsum("thn,hnc->thc", q[..., : s.nope], f(w.w_kc))
    q_full = torch.cat([q_lat, q_pe], dim=-1)
    kv_new = torch.cat([c_kv, k_pe], dim=-1)
    o = mla_attention_ref(q_full, kv_new, batch.kv_cache.float(), batch.plan)
    o = torch.einsum("thc,hcv->thv", o, f(w.w_vc)).reshape(t, -1) @ f(w.o_proj)
    h2, res = rmsnorm_ref(o, w.post_norm, s.eps, res)
    topk_w, topk_ids = router_ref(h2, w.gate, w.gate_bias, top_k=s.top_k, n_group=s.n_group,
                                  topk_group=s.topk_group, routed_scaling_factor=s.scaling)
    ck = w.experts_ckpt
    y = fused_moe_ref(h2, ck["w13"], ck["w2"], topk_w, topk_ids, w13_scales=ck.get("w13_scales"),
                      w2_scales=ck.get("w2_scales"))
    gu = h2 @ f(w.shared_w13)
    y = y + (torch.nn.functional.silu(gu[:, : s.shared_inter]) * gu[:, s.shared_inter:]) @ f(w.shared_w2)
    return y, res
