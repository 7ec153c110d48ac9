"""The MLA reference and plan: checked against plain attention, layout-independent, and
every bad input named before any launch."""

from __future__ import annotations

import math

import pytest
import torch

from microbench.cases.mla_inputs import make_mla_inputs, random_tree_mask
from microbench.kernels.mla_common import MAX_Q_LEN, check_mla_tensors, mla_cost, pack_tree_masks, plan_mla
from microbench.kernels.reference import mla_attention_ref


def _dense(q, keys, sm_scale, mask, cap=0.0):
    """Plain attention for one request: q [n, H, D], keys [L, D], mask [n, L]; logits soft-capped
    as cap * tanh(logit / cap) when cap > 0."""
    logits = torch.einsum("qhd,ld->qhl", q.double(), keys.double()) * sm_scale
    if cap > 0:
        logits = cap * torch.tanh(logits / cap)
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("qhl,ld->qhd", torch.softmax(logits, -1), keys[:, :512].double())


@pytest.mark.parametrize(("page_size", "logit_cap"), [(1, 0.0), (64, 0.0), (64, 1.5)])
@pytest.mark.parametrize("tree", [False, True])
def test_reference_matches_plain_attention_on_gathered_keys(page_size, logit_cap, tree):
    x = make_mla_inputs([1, 3, 7], [1, 63, 65], heads=2, page_size=page_size, dtype=torch.float32, device="cpu",
                        seed=3, tree=tree, logit_cap=logit_cap)
    out = mla_attention_ref(x.q, x.kv_new, x.kv_cache, x.plan)
    p, qo, kv = x.plan, x.plan.qo_indptr.tolist(), x.plan.kv_indptr.tolist()
    moff = 0
    for b, (n, pre) in enumerate(zip(p.q_lens, p.prefix_lens_host)):
        pages = p.kv_indices[kv[b]:kv[b + 1]].long()
        keys = torch.cat([x.kv_cache[pages].reshape(-1, 576)[:pre], x.kv_new[qo[b]:qo[b + 1]]])
        new = p.tree_mask[moff:moff + n * n].view(n, n) if tree else torch.ones(n, n, dtype=torch.bool).tril()
        moff += n * n
        mask = torch.cat([torch.ones(n, pre, dtype=torch.bool), new], 1)
        want = _dense(x.q[qo[b]:qo[b + 1]], keys, p.sm_scale, mask, cap=logit_cap)
        torch.testing.assert_close(out[qo[b]:qo[b + 1]].double(), want, atol=1e-5, rtol=1e-5)


def test_soft_cap_bounds_the_logits():
    x = make_mla_inputs([2], [5], heads=1, page_size=1, dtype=torch.float32, device="cpu", seed=4, logit_cap=0.5)
    capped = mla_attention_ref(x.q * 100, x.kv_new, x.kv_cache, x.plan)
    # with |logit| <= 0.5 the weights are within e^1 of uniform: the output is near the mean value
    assert capped.abs().max() < x.kv_cache.abs().max() * 1.01 + x.kv_new.abs().max()


def test_tree_rows_that_see_only_themselves():
    g = torch.Generator().manual_seed(0)
    m = random_tree_mask(5, g, self_only=(4,))
    assert m[4].tolist() == [False, False, False, False, True]
    assert m.diagonal().all() and m[1, 0]  # everyone sees itself; token 1's parent is 0


def _plan_args(**over):
    args = dict(qo_indptr=torch.tensor([0, 2, 5], dtype=torch.int32),
                kv_indptr=torch.tensor([0, 1, 3], dtype=torch.int32),
                kv_indices=torch.tensor([4, 0, 2], dtype=torch.int32),
                prefix_lens=torch.tensor([3, 70], dtype=torch.int32),
                page_size=64, num_pages=5, sm_scale=0.1)
    args.update(over)
    return args


@pytest.mark.parametrize(("over", "message"), [
    ({"kv_indices": torch.tensor([4, 0, 5], dtype=torch.int32)}, "kv_indices: page 5 out of range"),
    ({"kv_indptr": torch.tensor([0, 2, 1], dtype=torch.int32)}, "kv_indptr: not monotone"),
    ({"qo_indptr": torch.tensor([0, 2, 1], dtype=torch.int32)}, "qo_indptr: not monotone"),
    ({"qo_indptr": torch.tensor([0, 2, 2 + MAX_Q_LEN + 1], dtype=torch.int32)}, "over the supported maximum"),
    ({"prefix_lens": torch.tensor([3, 200], dtype=torch.int32)}, "prefix_lens: request 1"),
    ({"tree_mask": torch.ones(12, dtype=torch.bool)}, "tree_mask: 12 entries"),
    ({"tree_mask": torch.zeros(13, dtype=torch.bool)}, "does not see itself"),
    ({"kv_indices": torch.tensor([4.0, 0, 2])}, "kv_indices: expected a 1-D int32"),
    ({"qo_indptr": torch.tensor([1, 2, 5], dtype=torch.int32)}, "qo_indptr: must start at 0"),
    ({"qo_indptr": torch.tensor([0, 0, 5], dtype=torch.int32)}, "qo_indptr: request 0 has no new token"),
    ({"sm_scale": 0.0}, "sm_scale: expected a finite number > 0, got 0.0"),
    ({"sm_scale": float("inf")}, "sm_scale: expected a finite number > 0, got inf"),
    ({"sm_scale": "0.1"}, "sm_scale: expected a finite number > 0, got '0.1'"),
    ({"logit_cap": float("nan")}, "logit_cap: expected a finite number >= 0"),
    ({"logit_cap": float("inf")}, "logit_cap: expected a finite number >= 0"),
    ({"logit_cap": -1.0}, "logit_cap: expected a finite number >= 0"),
    # a fractional page size or pool would count pages one way and read them another
    ({"page_size": 1.5}, "page_size: expected an int >= 1, got 1.5"),
    ({"num_pages": 5.5}, "num_pages: expected an int >= 1, got 5.5"),
    ({"num_pages": 0}, "num_pages: expected an int >= 1, got 0"),
])
def test_bad_plans_name_the_argument(over, message):
    with pytest.raises(ValueError, match=message):
        plan_mla(**_plan_args(**over))


def test_bad_tensors_name_the_argument():
    x = make_mla_inputs([2, 3], [3, 70], heads=4, page_size=64, dtype=torch.float16, device="cpu", seed=5)
    with pytest.raises(ValueError, match="q: expected"):
        check_mla_tensors(x.q[:4], x.kv_new, x.kv_cache, x.plan, None)
    with pytest.raises(ValueError, match="kv_new: dtype"):
        check_mla_tensors(x.q, x.kv_new.float(), x.kv_cache, x.plan, None)
    with pytest.raises(ValueError, match="kv_cache: expected"):
        check_mla_tensors(x.q, x.kv_new, x.kv_cache[:1], x.plan, None)
    with pytest.raises(ValueError, match="out: expected"):
        check_mla_tensors(x.q, x.kv_new, x.kv_cache, x.plan, torch.empty(5, 4, 576, dtype=torch.float16))
    with pytest.raises(TypeError, match="out: expected a torch.Tensor or None, got list"):
        check_mla_tensors(x.q, x.kv_new, x.kv_cache, x.plan, [1])
    with pytest.raises(TypeError, match="plan: expected an MLAPlan"):
        check_mla_tensors(x.q, x.kv_new, x.kv_cache, None, None)
    strided_q = x.q.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="q: must be contiguous"):
        check_mla_tensors(strided_q, x.kv_new, x.kv_cache, x.plan, None)
    with pytest.raises(ValueError, match="kv_cache: must be contiguous"):
        check_mla_tensors(x.q, x.kv_new, x.kv_cache.transpose(0, 1).contiguous().transpose(0, 1), x.plan, None)
    with pytest.raises(ValueError, match="out: expected"):
        check_mla_tensors(x.q, x.kv_new, x.kv_cache, x.plan, torch.empty(5, 4, 512, dtype=torch.float32))
    strided_out = torch.empty(4, 5, 512, dtype=torch.float16).transpose(0, 1)
    with pytest.raises(ValueError, match="out: expected"):
        check_mla_tensors(x.q, x.kv_new, x.kv_cache, x.plan, strided_out)
    assert check_mla_tensors(x.q, x.kv_new, x.kv_cache, x.plan, None).shape == (5, 4, 512)


def test_cost_counts_the_cache_once_and_every_head_pair():
    x = make_mla_inputs([4], [1000], heads=8, page_size=64, dtype=torch.bfloat16, device="cpu", seed=6)
    nbytes, flops = mla_cost(x.plan, 8, 2)
    assert nbytes >= 2 * 1000 * 576 and nbytes < 2 * 1000 * 576 * 1.1
    # the prefix, the new latents, q and out; 16 page ids, two indptrs of 2 and one prefix length
    assert nbytes == 2 * (1000 * 576 + 4 * 576 + 4 * 8 * (576 + 512)) + 4 * (16 + 2 * 2 + 1)
    assert flops == 2 * 4 * 8 * 1004 * (576 + 512)
    assert pack_tree_masks([torch.ones(2, 2, dtype=torch.bool)]).shape == (4,)
    # Kimi-K2.5's: 192^-0.5 x (0.1 ln 64 + 1)^2, YaRN's factor for its 64x longer context
    assert math.isclose(x.plan.sm_scale, (0.1 * math.log(64) + 1) ** 2 / math.sqrt(192))


def test_plan_keeps_a_tree_mask_as_bool_with_offsets_per_request():
    p = plan_mla(**_plan_args(tree_mask=torch.ones(13, dtype=torch.int32)))
    assert p.tree_mask.dtype == torch.bool
    assert p.mask_indptr.tolist() == [0, 4, 13]


def test_the_plan_keeps_contiguous_copies_of_what_it_checked():
    # the kernels read the mask as flat bytes: a strided view (every other entry of a
    # longer mask) is kept as the values it shows; and the caller changing its own
    # tensors afterwards does not change what the plan validated
    wide = torch.zeros(26, dtype=torch.bool)
    wide[::2] = torch.tensor([1, 0, 1, 1] + [1, 0, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    args = _plan_args(tree_mask=wide[::2])
    p = plan_mla(**args)
    assert p.tree_mask.is_contiguous() and p.tree_mask.tolist() == wide[::2].tolist()
    args["kv_indices"][0] = 99
    wide[0] = False
    assert p.kv_indices.tolist() == [4, 0, 2] and bool(p.tree_mask[0])


def test_inputs_scatter_random_pages_and_draw_distinct_values_and_trees():
    # a kernel that ignored the page table, a head, the prefix or the new rows must be
    # able to fail on these inputs: nothing in them may be zero, ordered or repeated
    x = make_mla_inputs([8, 2], [130, 65], heads=4, page_size=64, dtype=torch.float32, device="cpu", seed=1, tree=True)
    pages = x.plan.kv_indices.tolist()
    assert len(pages) == 5 and pages != sorted(pages)
    unused = sorted(set(range(x.plan.num_pages)) - set(pages))
    assert unused and x.kv_cache[unused].std() > 0.5
    assert x.kv_cache[pages].std() > 0.5 and x.kv_new.std() > 0.5
    assert not torch.equal(x.q[:, 0], x.q[:, 1]) and not torch.equal(x.kv_new[0], x.kv_new[1])
    tree = x.plan.tree_mask[:64].view(8, 8)
    assert tree[7].tolist() == [False] * 7 + [True]  # the last token sees only itself
    assert not all(tree[i, i - 1] for i in range(1, 7))  # a tree, not a chain
