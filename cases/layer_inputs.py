"""Seeded weights, batches and inputs for the decoder-layer case.

Weights give unit-variance GEMM outputs (N(0, 1/K)); routed experts come from
``moe_inputs.expert_weights`` (INT4 drawn packed). The batch is a shuffled paged latent
cache (page size 1) with spare pages for the step's new tokens.

**Routing that both paths agree on.** The layer runs its real router, and the reference
its own, on hidden states that differ by bf16 rounding; near-ties at the top-k boundary
would send a token to different experts in the two. So the inputs put each token's
layer input x, large next to the rest, along the least-norm direction whose gate logits
are equal on ``top_k`` chosen experts (from ``topk_group`` groups, two per group, as
grouped routing needs) and zero on every other: after the norms the chosen logits are
~sqrt(H / k), the others ~0 +- 0.1, and both paths pick the same set by a wide margin.
The steer is in x, not in the residual: the layer adds x and its attention output to the
residual in place at every call, and a timing loop makes thousands of calls on the same
inputs; a steer in the residual would be outgrown by the summed x within ~10 calls and
the timed calls would route elsewhere than the gated one. In x, each call adds more of the
same direction, so every timed call routes as the first did.
The chosen sets are drawn independently per token, so T tokens touch ~E (1 - (1 - k/E)^T)
experts, as random routing does. The kernels' cost does not depend on the values.
"""

from __future__ import annotations

import math

import torch

from microbench.cases.common import model, randn
from microbench.cases.moe_inputs import MoEShape, expert_weights
from microbench.kernels.decoder_layer import LayerBatch, LayerShape, LayerWeights
from microbench.kernels.mla_common import HEAD_DIM, KV_LORA_RANK, plan_mla
from microbench.kernels.moe_common import prepare_weights

#: CPU interpreter scale: the latent stays 512 + 64 (the kernels' fixed head), the rest shrinks
MINI = LayerShape(hidden=128, heads=2, q_lora=64, nope=16, v_head=16, experts=16, top_k=8, moe_inter=32,
                  shared_inter=32, n_group=1, topk_group=1, scaling=2.5, mscale=2.0)  # Kimi's YaRN: 2.005


def layer_shape(name: str) -> LayerShape:
    """``mini`` (CPU) or a model at TP8 ("kimi-tp8", "dsv3-tp8"), from the model files."""
    if name == "mini":
        return MINI
    from microbench.layout import ParallelLayout, rank_shapes

    models = {"kimi-tp8": "kimi-k2.5", "dsv3-tp8": "deepseek-v3"}
    if name not in models:
        raise ValueError(f"layer: unknown {name!r} (known: mini, {', '.join(models)})")
    m = model(models[name])
    r = rank_shapes(m, ParallelLayout(tp=8, ep=1))
    return LayerShape(hidden=r.hidden, heads=r.heads_per_rank, q_lora=r.q_lora_rank or r.hidden,
                      nope=r.q_head_dim - r.qk_rope_head_dim, v_head=r.v_head_dim, experts=r.experts_per_rank,
                      top_k=r.top_k, moe_inter=r.moe_intermediate_per_rank,
                      shared_inter=r.shared_intermediate_per_rank, n_group=m.n_group, topk_group=m.topk_group,
                      scaling=m.routed_scaling_factor, eps=m.rms_norm_eps, mscale=m.attention_mscale)


def layer_weights(s: LayerShape, kind: str, dtype: torch.dtype, device: str, seed: int) -> LayerWeights:
    def w(shape, k, i):
        return randn(shape, dtype, device, seed + i, 1 / math.sqrt(k))

    def norm(n, i):
        return (1.0 + randn((n,), torch.float32, device, seed + i, 0.1)).to(dtype)

    ms = MoEShape("layer", s.experts, s.experts, s.hidden, s.moe_inter, s.top_k, s.n_group, s.topk_group, s.scaling,
                  True, 0)
    ck = expert_weights(ms, kind, dtype, device, seed + 50)
    experts = prepare_weights(ck["w13"], ck["w2"], w13_scales=ck.get("w13_scales"), w2_scales=ck.get("w2_scales"))
    return LayerWeights(
        shape=s, input_norm=norm(s.hidden, 1), qkv_a=w((s.hidden, s.q_lora + HEAD_DIM), s.hidden, 2),
        q_a_norm=norm(s.q_lora, 3), kv_a_norm=norm(KV_LORA_RANK, 4),
        q_b=w((s.q_lora, s.heads * s.q_head), s.q_lora, 5), w_kc=w((s.heads, s.nope, KV_LORA_RANK), s.nope, 6),
        w_vc=w((s.heads, KV_LORA_RANK, s.v_head), KV_LORA_RANK, 7),
        o_proj=w((s.heads * s.v_head, s.hidden), s.heads * s.v_head, 8), post_norm=norm(s.hidden, 9),
        gate=w((s.experts, s.hidden), s.hidden, 10), gate_bias=randn((s.experts,), torch.float32, device, seed + 11,
                                                                    0.01),
        experts=experts, experts_ckpt=ck, shared_w13=w((s.hidden, 2 * s.shared_inter), s.hidden, 12),
        shared_w2=w((s.shared_inter, s.hidden), s.shared_inter, 13))


def layer_batch(s: LayerShape, batch: int, q_len: int, context: int, dtype: torch.dtype, device: str,
                seed: int) -> LayerBatch:
    """``batch`` requests of ``context`` cached tokens each plus ``q_len`` new ones; the
    prefix pages shuffled through the pool, the new tokens' slots after them; the softmax
    scale ``mscale / sqrt(q head dim)``, as the model's attention uses it (YaRN's factor)."""
    prefix_pages = batch * context
    pages = prefix_pages + batch * q_len
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(prefix_pages, generator=g).to(torch.int32)
    cache = randn((pages, 1, HEAD_DIM), dtype, device, seed + 1)
    i32 = dict(dtype=torch.int32, device=device)
    plan = plan_mla(torch.arange(0, batch + 1, **i32) * q_len, torch.arange(0, batch + 1, **i32) * context,
                    order.to(device), torch.full((batch,), context, **i32), page_size=1, num_pages=pages,
                    sm_scale=s.mscale / math.sqrt(s.q_head))
    positions = (context + torch.arange(q_len, device=device)).repeat(batch)
    slots = torch.arange(prefix_pages, pages, device=device, dtype=torch.int64)
    return LayerBatch(plan, cache, positions, slots)


def layer_inputs(w: LayerWeights, tokens: int, dtype: torch.dtype, device: str,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, residual, chosen)``: x [T, H] along each token's chosen experts' gate rows plus
    N(0, 1) (see the module docstring); residual ~ N(0, 1) [T, H]; chosen [T, top_k] the
    expert ids."""
    s = w.shape
    g = torch.Generator().manual_seed(seed)
    per_group = s.experts // s.n_group
    chosen = torch.empty(tokens, s.top_k, dtype=torch.int64)
    for t in range(tokens):
        if s.n_group == 1:
            chosen[t] = torch.randperm(s.experts, generator=g)[: s.top_k]
            continue
        groups = torch.randperm(s.n_group, generator=g)[: s.topk_group]
        each = s.top_k // s.topk_group
        ids = [grp * per_group + torch.randperm(per_group, generator=g)[:each] for grp in groups.tolist()]
        chosen[t] = torch.cat(ids)[: s.top_k]
    gate = w.gate.double()  # [E, H], E <= H
    target = torch.zeros(tokens, s.experts, dtype=torch.float64, device=gate.device)
    target.scatter_(1, chosen.to(gate.device), 1.0)
    # the least-norm direction whose gate logits are exactly 1 on the chosen experts, 0 elsewhere
    direction = torch.linalg.solve(gate @ gate.T, target.T).T @ gate  # [T, H]
    direction = direction / direction.norm(dim=1, keepdim=True) * math.sqrt(s.top_k)
    x = (4.0 * math.sqrt(s.hidden) * direction).float() + randn((tokens, s.hidden), torch.float32, device, seed + 1)
    residual = randn((tokens, s.hidden), torch.float32, device, seed + 2)
    return x.to(dtype), residual.to(dtype), chosen
