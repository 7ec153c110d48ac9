"""Torch references for the project's Triton kernels, one function per op.

Each reference is the single source of truth for its op's semantics: the CPU tests and
the benchmark cases both import it, and no other copy exists.  References accumulate in
fp32 and return fp32 tensors, because the correctness gate compares in fp32: a reference
rounded to bf16 would hide exactly the rounding errors the gate is meant to bound.

Each op also has a ``<op>_cost`` function that counts the bytes a call must move and the
FLOPs it must do, so every case that reports GB/s or TFLOP/s uses the same formula as
the reference's docstring.

Contents
--------
- :func:`rmsnorm_ref`, :func:`rmsnorm_cost` — RMSNorm, optionally fused with the
  residual add (DeepSeek-V3 decoder layers run ``fused_add_rmsnorm`` twice per layer).
- :func:`mla_attention_ref` — absorbed-MLA attention over a paged latent cache with a
  causal or tree mask among the new tokens (its cost: ``mla_common.mla_cost``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rmsnorm_cost", "rmsnorm_ref"]


# --------------------------------------------------------------------------------------
# RMSNorm (optionally fused with the residual add)
# --------------------------------------------------------------------------------------


def rmsnorm_ref(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """RMSNorm over the last dimension, optionally after adding a residual, in fp32.

    Semantics as inference servers fuse it (``fused_add_rmsnorm``)::

        s = x + residual                      # the new residual stream
        y = s / sqrt(mean(s**2, -1) + eps) * weight

    and without a residual ``s = x`` and only ``y`` is returned.  All arithmetic is in
    fp32 on fp32 copies of the inputs, and the normalised value is multiplied by the
    weight before any rounding (the Triton kernel rounds once, at its store; Hugging
    Face's ``DeepseekV3RMSNorm`` rounds the normalised value to the input dtype before
    the weight product — a difference of one rounding, inside every test tolerance).

    Args:
        x: ``[T, H]`` hidden states, any float dtype.
        weight: ``[H]`` per-channel scale.
        eps: added to the mean square before the reciprocal square root (DeepSeek-V3:
            ``rms_norm_eps = 1e-6``).
        residual: optional ``[T, H]`` residual stream to add to ``x`` first.

    Returns:
        ``(y, s)``: ``y`` is ``[T, H]`` fp32; ``s`` is the ``[T, H]`` fp32 new residual
        ``x + residual``, or ``None`` when no residual was given.

    Cost per call (see :func:`rmsnorm_cost`; ``e`` = element size in bytes):
        bytes = T·H·e (read x) + H·e (read weight) + T·H·e (write y)
                + [fused] T·H·e (read residual) + T·H·e (write new residual)
        FLOPs ≈ 4·T·H (square, sum, scale by 1/rms, scale by weight)
                + [fused] T·H (the add);
        the T reciprocal square roots are not counted.
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, H] tensor, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(
            f"weight: expected shape ({x.shape[1]},) to match x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    s = x.float()
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"residual: expected shape {tuple(x.shape)} like x, got {tuple(residual.shape)}"
            )
        s = s + residual.float()
    rstd = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = s * rstd * weight.float()
    return y, (s if residual is not None else None)


def rmsnorm_cost(T: int, H: int, elem_bytes: int, fused_residual: bool) -> tuple[int, int]:
    """Bytes moved and FLOPs done by one RMSNorm call on ``[T, H]`` rows.

    Args:
        T: rows (tokens).
        H: row length (hidden size on this rank; RMSNorm is not sharded under TP).
        elem_bytes: size of one element of x, residual, weight and outputs (bf16: 2).
        fused_residual: whether the call also reads a residual and writes the new one.

    Returns:
        ``(bytes, flops)`` — the minimum traffic to and from memory (weight read once,
        every activation read or written once) and the arithmetic count stated in
        :func:`rmsnorm_ref`'s docstring.
    """
    if T < 0 or H < 1 or elem_bytes < 1:
        raise ValueError(
            f"rmsnorm_cost: need T >= 0, H >= 1, elem_bytes >= 1; got {T}, {H}, {elem_bytes}"
        )
    rows = T * H
    reads = rows + H  # x, weight
    writes = rows  # y
    flops = 4 * rows
    if fused_residual:
        reads += rows  # residual
        writes += rows  # new residual, written back in place
        flops += rows  # x + residual
    return (reads + writes) * elem_bytes, flops


# --------------------------------------------------------------------------- MLA attention


def mla_attention_ref(q: Tensor, kv_new: Tensor, kv_cache: Tensor, plan) -> Tensor:
    """Absorbed-MLA attention over a paged latent cache, in fp32 (the one reference of the
    extend, decode and verify kernels; layout and plan in ``microbench.kernels.mla_common``).

    q [T, H, 576], kv_new [T, 576], kv_cache [num_pages, page_size, 576] -> out [T, H, 512]
    fp32. Request b's keys are its prefix (the pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``
    in that order, the first ``prefix_lens[b]`` tokens of them) followed by its new tokens'
    latents; values are the keys' first 512 channels. Logits = q.k * sm_scale, soft-capped
    as cap * tanh(logits / cap) when ``logit_cap`` > 0; every new token sees the whole
    prefix and the new tokens its mask allows (causal, or the plan's tree mask).

    Bytes (the floor): prefix x 576 + T x 576 + T x H x (576 + 512) elements, plus the page
    indices; FLOPs: 2 x T x H x L x (576 + 512), L = prefix + q_len of each request (see
    ``mla_cost``).
    """
    from microbench.kernels.mla_common import KV_LORA_RANK

    qo = plan.qo_indptr.tolist()
    kv = plan.kv_indptr.tolist()
    pages = plan.kv_indices.to(torch.long)
    mask_flat = plan.tree_mask.cpu() if plan.tree_mask is not None else None
    out = torch.empty(q.shape[0], q.shape[1], KV_LORA_RANK, dtype=torch.float32, device=q.device)
    moff = 0
    for b, (n_q, n_p) in enumerate(zip(plan.q_lens, plan.prefix_lens_host)):
        prefix = kv_cache[pages[kv[b]:kv[b + 1]]].reshape(-1, kv_cache.shape[-1])[:n_p]
        keys = torch.cat([prefix, kv_new[qo[b]:qo[b + 1]]]).float()  # [L, 576]
        qb = q[qo[b]:qo[b + 1]].float()  # [q, H, 576]
        logits = torch.einsum("qhd,ld->qhl", qb, keys) * plan.sm_scale
        if plan.logit_cap > 0:
            logits = plan.logit_cap * torch.tanh(logits / plan.logit_cap)
        if mask_flat is not None:
            new_mask = mask_flat[moff:moff + n_q * n_q].view(n_q, n_q)
            moff += n_q * n_q
        else:
            new_mask = torch.ones(n_q, n_q, dtype=torch.bool).tril()
        visible = torch.cat([torch.ones(n_q, n_p, dtype=torch.bool), new_mask], dim=1).to(q.device)  # [q, L]
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        p = torch.softmax(logits, dim=-1)
        out[qo[b]:qo[b + 1]] = torch.einsum("qhl,ld->qhd", p, keys[:, :KV_LORA_RANK])
    return out
