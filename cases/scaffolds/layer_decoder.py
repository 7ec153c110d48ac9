"""A starting point for layer.decoder: the whole layer, with the shared expert's SiLU-and-mul in this file's kernel.

Signature (microbench list --case layer.decoder): fn(xs, residuals, weights, batches, phase, capture="eager",
  moe_config=None) -> out [layers, T, H]. Per layer: xs[i], residuals[i] [T, H] (residuals[i] updated in place:
  x + residual, then + the attention output), weights[i] a LayerWeights, batches[i] a LayerBatch
  (microbench.kernels.decoder_layer); phase "decode" (one new token per request) | "verify"
  (draft tokens + 1 per request); moe_config the MoE kernels' tuned tiles for this device
  ({"fused", "w13", "w2"}: GemmConfig; the defaults where the table has none). The harness
  does the graph capture (capture="graph"): the function runs the same in every capture mode.

The layer below is microbench/kernels/decoder_layer.py's forward, spelled out so each step can
be changed: the project's Triton kernels for the norms, the routing, the attention (decode
kernel for decode, extend kernel for verify) and the fused MoE, torch GEMMs in between, a
stand-in allreduce (one rank). One piece is this file's own simple Triton kernel: the shared
expert's silu(gate) * up. Start there: fuse the SiLU-and-mul into the shared w13 GEMM's
epilogue, or the shared expert's down projection and its add into the routed MoE's output;
then replace other steps (the rope + latent-cache write, the absorb bmm's) with kernels of
your own. The output must stay within the case's tolerance of decoder_layer_ref.

Check and time it:   microbench try THIS_FILE::my_decoder --case layer.decoder
Iterate on save:     microbench try THIS_FILE::my_decoder --case layer.decoder --watch
"""

import torch
import triton
import triton.language as tl

from microbench.kernels.decoder_layer import rope, stand_in_allreduce
from microbench.kernels.mla_common import KV_LORA_RANK, ROPE_DIM
from microbench.kernels.mla_decode import mla_decode
from microbench.kernels.mla_extend import mla_extend
from microbench.kernels.moe_fused import fused_moe
from microbench.kernels.moe_routing import route
from microbench.kernels.rmsnorm import rmsnorm


@triton.jit
def _my_silu_and_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    """out[t, c] = silu(gu[t, c]) * gu[t, inter + c], in fp32, stored in out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < inter
    g = tl.load(gu_ptr + t * 2 * inter + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * 2 * inter + inter + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * inter + c, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def _silu_and_mul(gu):
    tokens, two_inter = gu.shape
    inter = two_inter // 2
    assert gu.is_contiguous()
    out = torch.empty((tokens, inter), dtype=gu.dtype, device=gu.device)
    BLOCK = min(1024, triton.next_power_of_2(inter))
    _my_silu_and_mul_kernel[(tokens, triton.cdiv(inter, BLOCK))](gu, out, inter, BLOCK=BLOCK)
    return out


def _layer(x, residual, w, batch, phase, fused_config):
    """One layer on one rank: x, residual [T, H] -> the layer's output [T, H]; residual updated."""
    s = w.shape
    t = x.shape[0]
    h = rmsnorm(x, w.input_norm, s.eps, residual=residual)  # residual <- x + residual
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
    attend = mla_decode if phase == "decode" else mla_extend
    o = attend(q_full, kv_new, batch.kv_cache, batch.plan)  # [T, heads, 512]
    o = torch.bmm(o.transpose(0, 1), w.w_vc).transpose(0, 1).reshape(t, s.heads * s.v_head) @ w.o_proj
    stand_in_allreduce(o)
    h2 = rmsnorm(o, w.post_norm, s.eps, residual=residual)  # residual <- o + residual
    topk_w, topk_ids = route(h2, w.gate, w.gate_bias, top_k=s.top_k, n_group=s.n_group, topk_group=s.topk_group,
                             routed_scaling_factor=s.scaling)
    y = fused_moe(h2, w.experts, topk_w, topk_ids, config=fused_config)
    y = y + _silu_and_mul(h2 @ w.shared_w13) @ w.shared_w2  # the shared expert
    stand_in_allreduce(y)
    return y


def my_decoder(xs, residuals, weights, batches, phase, capture="eager", moe_config=None):
    fused = (moe_config or {}).get("fused")
    return torch.stack([_layer(x, r, w, b, phase, fused) for x, r, w, b in zip(xs, residuals, weights, batches)])
