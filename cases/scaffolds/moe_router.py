"""A starting point for moe.router: the gate GEMM in torch (fp32), then one Triton program per token.

Signature (microbench list --case moe.router): fn(hidden, gate, bias, shape, weights, ids) -> (weights, ids)
  hidden [T, H], gate [E, H] (all the model's experts), bias [E] fp32 (the correction bias),
  shape: cases.moe_inputs.MoEShape (top_k, n_group, topk_group, scaling, renorm);
  weights [T, top_k] fp32 and ids [T, top_k] int32 written (and returned).
  DeepSeek-V3 noaux_tc: scores = sigmoid(hidden @ gate.T); biased = scores + bias (chooses,
  never weighs); a group's score = the sum of its 2 best biased scores; keep the topk_group
  best groups; ids = the top_k best biased experts among them, best first (ties to the lower
  id); weights = scores[ids], / (sum + 1e-20) if renorm, * scaling.

This is the simplest correct kernel: it upcasts the gate to fp32 for the GEMM (an extra copy
of the weight per call) and scans the token's E scores top_k times. Make it fast: fp32 logits
from bf16 operands without the copy (or fuse the GEMM: a T x E tile of a weight-streaming
GEMM), several tokens per program, fewer passes over the scores.

Check and time it:   microbench try THIS_FILE::my_router --case moe.router
Iterate on save:     microbench try THIS_FILE::my_router --case moe.router --watch
"""

import triton
import triton.language as tl


@triton.jit
def _my_router_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, scale, GS: tl.constexpr, N_GROUP: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    scores = tl.sigmoid(tl.load(logits_ptr + t * E + e, mask=valid, other=0.0))
    biased = tl.where(valid, scores + tl.load(bias_ptr + e, mask=valid, other=0.0), -float("inf"))
    if TOPK_GROUP < N_GROUP:
        # group scores: the best biased score of each group plus its second best
        grp = e // GS
        gi = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], -float("inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            v = tl.where(grp == g, biased, -float("inf"))
            m1 = tl.max(v, axis=0)
            if GS > 1:
                first = tl.min(tl.where(v == m1, e, BLOCK_E), axis=0)
                m1 = m1 + tl.max(tl.where(e == first, -float("inf"), v), axis=0)
            gscore = tl.where(gi == g, m1, gscore)
        # keep the TOPK_GROUP best groups (ties to the lower group), mask out the rest
        keep = e < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gscore, axis=0)
            pick = tl.min(tl.where(gscore == best, gi, BLOCK_G), axis=0)
            keep = keep | (grp == pick)
            gscore = tl.where(gi == pick, -float("inf"), gscore)
        biased = tl.where(keep, biased, -float("inf"))
    # top_k by repeated argmax: best first, ties to the lower expert id
    k = tl.arange(0, BLOCK_K)
    out_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    out_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(biased, axis=0)
        pick = tl.min(tl.where(biased == best, e, BLOCK_E), axis=0)
        out_ids = tl.where(k == i, pick, out_ids)
        out_w = tl.where(k == i, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), out_w)
        biased = tl.where(e == pick, -float("inf"), biased)
    if RENORM:
        out_w = out_w / (tl.sum(out_w, axis=0) + 1e-20)
    tl.store(w_ptr + t * TOP_K + k, out_w * scale, mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, out_ids, mask=k < TOP_K)


def my_router(hidden, gate, bias, shape, weights, ids):
    tokens = hidden.shape[0]
    experts = gate.shape[0]
    logits = (hidden.float() @ gate.float().t()).contiguous()  # [T, E] fp32, like the reference
    _my_router_kernel[(tokens,)](logits, bias, weights, ids, experts, float(shape.scaling),
                                 GS=experts // shape.n_group, N_GROUP=shape.n_group, TOPK_GROUP=shape.topk_group,
                                 TOP_K=shape.top_k, RENORM=bool(shape.renorm),
                                 BLOCK_E=triton.next_power_of_2(experts),
                                 BLOCK_G=triton.next_power_of_2(shape.n_group),
                                 BLOCK_K=triton.next_power_of_2(shape.top_k))
    return weights, ids
