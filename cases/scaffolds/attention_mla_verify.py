"""A starting point for attention.mla_verify: one Triton program per (new token, head).

Signature (microbench list --case attention.mla_verify): fn(q, kv_new, kv_cache, plan, out)
  q [T, heads, 576] (512 latent + 64 rope channels), kv_new [T, 576] (the new tokens' latents),
  kv_cache [num_pages, page_size, 576] (each request's prefix, pages in plan.kv_indices order),
  plan: microbench.kernels.mla_common.MLAPlan, out [T, heads, 512] written (values = keys[:, :512]).
  Every new token sees its request's whole prefix and the new tokens the mask allows (causal,
  or plan.tree_mask); logits = q.k * plan.sm_scale, soft-capped when plan.logit_cap > 0.

This is the simplest correct kernel: it reads the shared latent once per head (like the extend
kernel) with no tensor cores. Make it fast: pack heads (and draft tokens) into a tile so each
key block is read once per request, use tl.dot, split the context across programs.

Check and time it:   microbench try THIS_FILE::my_mla --case attention.mla_verify
Iterate on save:     microbench try THIS_FILE::my_mla --case attention.mla_verify --watch
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _attend(k, k_pe, keep, q_nope, q_pe, acc, l, m, sm_scale, cap, HAS_CAP: tl.constexpr):
    """One block of keys [BLOCK_N, 512 + 64] into the running softmax (online, fp32)."""
    s = (tl.sum(k * q_nope[None, :], axis=1) + tl.sum(k_pe * q_pe[None, :], axis=1)) * sm_scale
    if HAS_CAP:
        s = cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)  # cap * tanh(s / cap)
    s = tl.where(keep, s, -float("inf"))
    m_new = tl.maximum(m, tl.max(s, axis=0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    return acc * alpha + tl.sum(p[:, None] * k, axis=0), l * alpha + tl.sum(p, axis=0), m_new


@triton.jit
def _my_mla_kernel(q_ptr, kv_new_ptr, cache_ptr, out_ptr, req_ptr, qo_ptr, kv_indptr_ptr, kv_indices_ptr,
                   prefix_ptr, mask_ptr, mask_indptr_ptr, sm_scale, cap, heads,
                   PAGE: tl.constexpr, HAS_TREE: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(req_ptr + t)
    q0 = tl.load(qo_ptr + b)
    n_new = tl.load(qo_ptr + b + 1) - q0
    i = t - q0  # this token's place among its request's new tokens
    n_prefix = tl.load(prefix_ptr + b)
    kv0 = tl.load(kv_indptr_ptr + b)
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    q_row = q_ptr + (t * heads + h) * 576
    q_nope = tl.load(q_row + d).to(tl.float32)
    q_pe = tl.load(q_row + 512 + r).to(tl.float32)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([512], dtype=tl.float32)
    # the prefix, through the page table
    for start in range(0, n_prefix, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        valid = j < n_prefix
        page = tl.load(kv_indices_ptr + kv0 + j // PAGE, mask=valid, other=0)
        row = (page.to(tl.int64) * PAGE + j % PAGE) * 576
        k = tl.load(cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        k_pe = tl.load(cache_ptr + row[:, None] + 512 + r[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        acc, l, m = _attend(k, k_pe, valid, q_nope, q_pe, acc, l, m, sm_scale, cap, HAS_CAP)
    # the request's new tokens, under the causal or tree mask
    for start in range(0, n_new, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        valid = j < n_new
        if HAS_TREE:
            m0 = tl.load(mask_indptr_ptr + b)
            seen = tl.load(mask_ptr + m0 + i * n_new + j, mask=valid, other=0) != 0
        else:
            seen = j <= i
        seen = seen & valid
        row = (q0 + j).to(tl.int64) * 576
        k = tl.load(kv_new_ptr + row[:, None] + d[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
        k_pe = tl.load(kv_new_ptr + row[:, None] + 512 + r[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
        acc, l, m = _attend(k, k_pe, seen, q_nope, q_pe, acc, l, m, sm_scale, cap, HAS_CAP)
    tl.store(out_ptr + (t * heads + h) * 512 + d, (acc / l).to(out_ptr.dtype.element_ty))


def my_mla(q, kv_new, kv_cache, plan, out):
    tokens, heads, _ = q.shape
    lens = torch.tensor(plan.q_lens, device=q.device)
    req = torch.repeat_interleave(torch.arange(plan.batch, device=q.device, dtype=torch.int32), lens)
    tree = plan.tree_mask is not None
    mask = plan.tree_mask.to(torch.int8) if tree else req  # unread without a tree mask
    mask_indptr = plan.mask_indptr if tree else req
    _my_mla_kernel[(tokens, heads)](
        q, kv_new, kv_cache, out, req, plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.prefix_lens, mask,
        mask_indptr, plan.sm_scale, plan.logit_cap, heads, PAGE=plan.page_size, HAS_TREE=tree,
        HAS_CAP=plan.logit_cap > 0, BLOCK_N=16)
