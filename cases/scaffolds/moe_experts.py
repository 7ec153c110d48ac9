"""A starting point for moe.experts: one Triton program per (token, choice) x I tile for w13
and SiLU-and-mul, then one per (token, H tile) for w2 summing the token's top-k choices.

Signature (microbench list --case moe.experts): fn(hidden, weights, topk_weights, topk_ids, configs, out)
  hidden [T, H] dtype; weights: microbench.kernels.moe_common.ExpertWeights, kind "bf16"
  (dense w13 [E, 2I, H], w2 [E, H, I], the activation dtype) or "int4" (w13 [E, H/8, 2I],
  w2 [E, I/8, H] int32 words of 8 nibbles along K, scales s13 [E, H/G, 2I], s2 [E, I/G, H];
  input k is (word >> 4 * (k % 8)) & 0xF, minus 8, times its group's scale);
  weights.gemm("w13" / "w2") gives (weight, scales, strides (expert, k, n, scale e, k, n)).
  topk_weights [T, k] fp32; topk_ids [T, k] int32, -1 for an expert on another rank (skipped);
  configs: tile configurations (GemmConfig) of the case's own kernels, ignored here;
  out [T, H] written: out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate) * up),
  [gate; up] = w13[e] @ hidden[t], e = topk_ids[t, j].

This is the simplest correct kernel: it re-reads an expert's weights once per (token, choice)
that picks it, keeps an fp32 intermediate in memory, and uses no tensor cores. Make it fast:
group the pairs by expert so each touched expert's weights are read once, use tl.dot, split K
across programs for the long w13 GEMM (K = H), fuse the SiLU and the top-k sum.

Check and time it:   microbench try THIS_FILE::my_moe --case moe.experts
Iterate on save:     microbench try THIS_FILE::my_moe --case moe.experts --watch
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _weight_tile(w_ptr, s_ptr, offs_k, offs_n, mask, stride_k, stride_n, stride_sk, stride_sn,
                 INT4: tl.constexpr, GROUP: tl.constexpr):
    """The fp32 [BLOCK_K, BLOCK_N] tile of one expert's weight (pointers already at the expert)."""
    if INT4:
        words = tl.load(w_ptr + (offs_k // 8)[:, None] * stride_k + offs_n[None, :] * stride_n, mask=mask, other=0)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        sc = tl.load(s_ptr + (offs_k // GROUP)[:, None] * stride_sk + offs_n[None, :] * stride_sn, mask=mask,
                     other=0.0)
        return (q - 8).to(tl.float32) * sc.to(tl.float32)
    else:
        w = tl.load(w_ptr + offs_k[:, None] * stride_k + offs_n[None, :] * stride_n, mask=mask, other=0.0)
        return w.to(tl.float32)


@triton.jit
def _w13_silu_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, top_k, hidden, inter,
                     stride_e, stride_k, stride_n, stride_se, stride_sk, stride_sn,
                     INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)  # t * top_k + j
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    e = tl.load(ids_ptr + pair)
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    if e >= 0:  # -1: another rank's expert, nothing to compute (the w2 kernel skips it too)
        w = w_ptr + e.to(tl.int64) * stride_e
        s = s_ptr + e.to(tl.int64) * stride_se
        x_row = x_ptr + (pair // top_k).to(tl.int64) * hidden
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            mask = k_ok[:, None] & n_ok[None, :]
            wg = _weight_tile(w, s, offs_k, offs_n, mask, stride_k, stride_n, stride_sk, stride_sn, INT4, GROUP)
            wu = _weight_tile(w, s, offs_k, offs_n + inter, mask, stride_k, stride_n, stride_sk, stride_sn, INT4,
                              GROUP)
            gate += tl.sum(x[:, None] * wg, axis=0)
            up += tl.sum(x[:, None] * wu, axis=0)
    act = gate * tl.sigmoid(gate) * up  # silu(gate) * up
    tl.store(act_ptr + pair.to(tl.int64) * inter + offs_n, act, mask=n_ok)


@triton.jit
def _w2_sum_kernel(act_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, out_ptr, top_k, hidden, inter,
                   stride_e, stride_k, stride_n, stride_se, stride_sk, stride_sn,
                   INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, top_k):
        pair = t * top_k + j
        e = tl.load(ids_ptr + pair)
        if e >= 0:
            w = w_ptr + e.to(tl.int64) * stride_e
            s = s_ptr + e.to(tl.int64) * stride_se
            a_row = act_ptr + pair.to(tl.int64) * inter
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < inter
                a = tl.load(a_row + offs_k, mask=k_ok, other=0.0)
                wt = _weight_tile(w, s, offs_k, offs_n, k_ok[:, None] & n_ok[None, :], stride_k, stride_n,
                                  stride_sk, stride_sn, INT4, GROUP)
                y += tl.sum(a[:, None] * wt, axis=0)
            acc += tl.load(tw_ptr + pair) * y
    tl.store(out_ptr + t.to(tl.int64) * hidden + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def my_moe(hidden, weights, topk_weights, topk_ids, configs, out):
    tokens, top_k = topk_ids.shape
    h, inter = weights.hidden, weights.inter
    assert hidden.is_contiguous() and out.is_contiguous()
    ids, tw = topk_ids.contiguous(), topk_weights.contiguous()
    int4, group = weights.int4, max(weights.group_size, 1)
    act = torch.empty(tokens * top_k, inter, dtype=torch.float32, device=hidden.device)
    w13, s13, st13 = weights.gemm("w13")
    _w13_silu_kernel[(tokens * top_k, triton.cdiv(inter, 32))](
        hidden, ids, w13, s13, act, top_k, h, inter, *st13, INT4=int4, GROUP=group, BLOCK_N=32, BLOCK_K=64)
    w2, s2, st2 = weights.gemm("w2")
    _w2_sum_kernel[(tokens, triton.cdiv(h, 64))](
        act, ids, tw, w2, s2, out, top_k, h, inter, *st2, INT4=int4, GROUP=group, BLOCK_N=64, BLOCK_K=32)
