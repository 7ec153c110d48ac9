"""Seeded inputs for the MLA attention kernels: a shuffled paged latent cache and a plan.

Shared by the attention cases and the kernel tests, so both exercise the same layouts:
pages of each request scattered over a larger pool in random order, a pool whose unused
pages hold random values too (a kernel reading a wrong page reads garbage, not zeros), and
causal or EAGLE-tree masks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from microbench.kernels.mla_common import HEAD_DIM, MLAPlan, pack_tree_masks, plan_mla


@dataclass
class MLAInputs:
    q: torch.Tensor  # [T, H, 576]
    kv_new: torch.Tensor  # [T, 576]
    kv_cache: torch.Tensor  # [num_pages, page_size, 576]
    plan: MLAPlan


@functools.lru_cache(maxsize=None)
def model_sm_scale(name: str = "kimi-k2.5") -> float:
    """A shipped model's attention softmax scale (:attr:`ModelConfig.softmax_scale`)."""
    from microbench.cases.common import model

    return model(name).softmax_scale


def random_tree_mask(q_len: int, g: torch.Generator, self_only: Sequence[int] = ()) -> torch.Tensor:
    """An EAGLE-style tree over q_len tokens: token 0 is the root, every other token's
    parent is a random earlier token; a token sees itself and its ancestors. Tokens in
    ``self_only`` see only themselves (a tree row with no ancestor among the new tokens)."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, q_len)]
    m = torch.zeros(q_len, q_len, dtype=torch.bool)
    for i in range(q_len):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parent[j] if i not in self_only else -1
    return m


def make_mla_inputs(
    q_lens: Sequence[int],
    prefix_lens: Sequence[int],
    *,
    heads: int,
    page_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    tree: bool = False,
    logit_cap: float = 0.0,
    spare_pages: float = 0.25,
    sm_scale: float | None = None,
) -> MLAInputs:
    """Seeded random q, new latents, a shuffled paged cache and its plan.

    ``sm_scale`` defaults to Kimi-K2.5's softmax scale, 192^-0.5 (qk_nope 128 + rope 64
    before absorption) times YaRN's attention factor (2.005): the logits as sharp as the
    model's. The layout is drawn on the CPU, the values on ``device``.
    """
    if len(q_lens) != len(prefix_lens):
        raise ValueError("q_lens and prefix_lens must have one entry per request")
    g = torch.Generator().manual_seed(seed)
    pages_per = [math.ceil(p / page_size) for p in prefix_lens]
    used = sum(pages_per)
    num_pages = max(1, used + max(1, int(used * spare_pages)))
    order = torch.randperm(num_pages, generator=g)[:used]
    kv_indptr = torch.tensor([0, *torch.tensor(pages_per).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(list(q_lens)).cumsum(0).tolist()], dtype=torch.int32)
    t = sum(q_lens)
    # values on the device itself: a 16 x 64K-token cache is ~1e9 normals
    gd = g if torch.device(device).type == "cpu" else torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gd, device=device).to(dtype)  # noqa: E731
    q, kv_new = rnd(t, heads, HEAD_DIM), rnd(t, HEAD_DIM)
    kv_cache = rnd(num_pages, page_size, HEAD_DIM)
    mask = None
    if tree:
        masks = [random_tree_mask(n, g, self_only=(n - 1,) if n > 2 else ()) for n in q_lens]
        mask = pack_tree_masks(masks).to(device)
    plan = plan_mla(qo_indptr.to(device), kv_indptr.to(device), order.to(torch.int32).to(device),
                    torch.tensor(list(prefix_lens), dtype=torch.int32, device=device), page_size=page_size,
                    num_pages=num_pages, sm_scale=model_sm_scale() if sm_scale is None else sm_scale, tree_mask=mask, logit_cap=logit_cap)
    return MLAInputs(q, kv_new, kv_cache, plan)
