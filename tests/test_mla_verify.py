"""The split-KV verify kernel against the one MLA reference: mixed batches, both page sizes,
causal and tree masks, head grouping, forced (and empty) splits, the soft cap, NaN-poisoned
outputs; the tile and split rules; bad input named before any launch; bf16 at small shapes
(on CPU too) and at Kimi shapes on the GPU."""

from __future__ import annotations

import pytest
import torch

from microbench.cases.mla_inputs import make_mla_inputs
from microbench.gate import compare
from microbench.kernels.mla_common import KV_LORA_RANK, MAX_Q_LEN, plan_mla
from microbench.kernels.mla_verify import (MAX_BLOCK_M, MAX_SPLITS, MIN_SPLIT_KEYS, TILE_CONFIG, mla_verify,
                                           verify_num_splits, verify_tile)
from microbench.kernels.reference import mla_attention_ref

from .helpers import kimi_tree_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp16 operands (11-bit significand) and p rounded to fp16 before p @ v put ~1e-3 relative
# error on outputs of size ~0.1-1 against the fp32 reference (the CPU runs here stay under
# 2e-3 abs); 2e-2 leaves a 10x margin and still fails any wrong key, page, mask or merge,
# which moves outputs by O(0.1). bf16 (8-bit significand, the model's dtype): the bound the
# attention case's gate uses for bf16; its worst elements are an ulp of |out| ~ 2.5 (1.6e-2),
# on CPU (the interpreter's bf16 dot made to compute as a tensor core does) and on the GPU.
LOW = (torch.float16, 2e-2, 2e-2)
BF16 = (torch.bfloat16, 2e-2, 2e-2)


def _run(x, dtype, atol, rtol, **kw):
    """Run the kernel into a NaN-poisoned out and compare with the reference; returns out."""
    out = torch.full((x.plan.total_q, x.q.shape[1], KV_LORA_RANK), float("nan"), dtype=dtype, device=x.q.device)
    got = mla_verify(x.q, x.kv_new, x.kv_cache, x.plan, out=out, **kw)
    assert got is out
    rep = compare(out, mla_attention_ref(x.q, x.kv_new, x.kv_cache, x.plan), atol=atol, rtol=rtol)
    assert rep.passed, str(rep)
    return out


@pytest.mark.parametrize(("q_lens", "prefix_lens", "heads", "page_size", "tree", "dtype_tol"), [
    ([1, 3, 7], [1, 63, 65], 8, 1, False, LOW),
    ([3, 7, 1, 3], [0, 65, 63, 1000], 8, 64, True, LOW),  # default splits > 1 here: the merge runs
    ([7, 3], [63, 1], 1, 64, False, LOW),
    ([7, 3], [65, 0], 20, 1, True, LOW),  # 20 x 7 rows > MAX_BLOCK_M: three head groups
    pytest.param([1, 3, 7], [1, 63, 65], 8, 1, False, BF16, id="bf16-causal-page1"),
    pytest.param([3, 7, 1, 3], [0, 65, 63, 1000], 8, 64, True, BF16, id="bf16-tree-page64-merged"),
])
def test_matches_reference_on_mixed_batches(q_lens, prefix_lens, heads, page_size, tree, dtype_tol):
    dtype, atol, rtol = dtype_tol
    x = make_mla_inputs(q_lens, prefix_lens, heads=heads, page_size=page_size, dtype=dtype, device=DEVICE,
                        seed=11 + heads, tree=tree)
    _run(x, dtype, atol, rtol)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_forced_splits_including_empty_and_unseeing_ones(num_splits):
    # request 0: 66 keys in 32-key splits: split 2 holds only new tokens 1 and 2, which
    # token 0 cannot see (-inf LSE), splits 3.. are empty; request 1 (1 key) empties all
    # splits but the first; tree rows that see only themselves are in request 2
    dtype, atol, rtol = LOW
    x = make_mla_inputs([3, 1, 7], [63, 0, 65], heads=4, page_size=64, dtype=dtype, device=DEVICE, seed=5,
                        tree=True)
    _run(x, dtype, atol, rtol, num_splits=num_splits)


def test_longest_q_len_fills_the_new_token_block():
    # 16 tokens x 4 heads = 64 rows (the 16-key blocks): the new tokens fill a whole block,
    # which starts mid-split (split 1 = keys 32..48 = prefix key 32 + all 16 new ones)
    dtype, atol, rtol = LOW
    x = make_mla_inputs([MAX_Q_LEN, 2], [33, 0], heads=4, page_size=64, dtype=dtype, device=DEVICE, seed=8,
                        tree=True)
    assert verify_tile(MAX_Q_LEN, 4)[:4] == (64, 4, 1, 16)
    _run(x, dtype, atol, rtol, num_splits=3)


def test_logit_cap_is_applied():
    dtype, atol, rtol = LOW
    x = make_mla_inputs([3, 2], [65, 7], heads=4, page_size=1, dtype=dtype, device=DEVICE, seed=9, logit_cap=2.0)
    out = _run(x, dtype, atol, rtol, num_splits=2)
    # the cap changes the answer by more than the tolerance, so the check above can fail
    uncapped = plan_mla(x.plan.qo_indptr, x.plan.kv_indptr, x.plan.kv_indices, x.plan.prefix_lens,
                        page_size=x.plan.page_size, num_pages=x.plan.num_pages, sm_scale=x.plan.sm_scale)
    assert not compare(out, mla_attention_ref(x.q, x.kv_new, x.kv_cache, uncapped), atol=atol, rtol=rtol).passed


def test_decode_batch_of_single_tokens():
    # q_len 1 is decode: all 8 heads in one 16-row tile, split over the context
    dtype, atol, rtol = LOW
    x = make_mla_inputs([1, 1, 1], [64, 1, 129], heads=8, page_size=64, dtype=dtype, device=DEVICE, seed=3)
    assert verify_tile(1, 8)[:3] == (16, 8, 1)
    _run(x, dtype, atol, rtol, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_value_halves_match_the_reference_and_the_whole_tile(num_splits):
    # dv_split 2: each half's program computes the same logits; a half that wrote the other's
    # channels, or an LSE of its own, would move the merged output by O(0.1)
    dtype, atol, rtol = LOW
    x = make_mla_inputs([3, 1, 7], [63, 0, 65], heads=4, page_size=64, dtype=dtype, device=DEVICE, seed=6,
                        tree=True)
    halves = _run(x, dtype, atol, rtol, num_splits=num_splits, dv_split=2)
    whole = _run(x, dtype, atol, rtol, num_splits=num_splits)
    assert (halves.float() - whole.float()).abs().max().item() < 2e-3


@pytest.mark.parametrize("dtype_tol", [pytest.param(LOW, id="fp16"), pytest.param(BF16, id="bf16")])
def test_value_halves_with_head_groups_and_the_default_splits(dtype_tol):
    dtype, atol, rtol = dtype_tol
    x = make_mla_inputs([7, 3], [65, 1000], heads=20, page_size=1, dtype=dtype, device=DEVICE, seed=12)
    _run(x, dtype, atol, rtol, dv_split=2)


def test_tile_rule_packs_tokens_and_heads_and_groups_past_the_limit():
    assert verify_tile(4, 8)[:3] == (32, 8, 1)  # the Kimi verify tile: 4 tokens x 8 heads
    assert verify_tile(1, 1)[:3] == (16, 1, 1)  # tl.dot's minimum M
    assert verify_tile(8, 8)[:3] == (64, 8, 1)
    assert verify_tile(16, 8)[:3] == (64, 4, 2)
    assert verify_tile(7, 20)[:3] == (64, 7, 3)  # groups of 9 would fit; balanced 7 + 7 + 6
    assert verify_tile(1, 128)[:3] == (64, 64, 2)
    for q_len in range(1, MAX_Q_LEN + 1):
        for heads in (1, 3, 8, 20, 128):
            m, hpg, groups, block_n, warps = verify_tile(q_len, heads)
            assert q_len * hpg <= m <= max(16, MAX_BLOCK_M) and m & (m - 1) == 0
            assert hpg * groups >= heads > hpg * (groups - 1)
            assert (block_n, warps) == TILE_CONFIG[m] and block_n >= MAX_Q_LEN
    with pytest.raises(ValueError, match="max_q_len"):
        verify_tile(MAX_Q_LEN + 1, 8)  # the kernel's own limit: new-token keys fit one block


def _plan(q_lens, prefix_lens, page_size=64):
    """A host-side plan only (no tensors drawn): the split rule reads nothing else."""
    pages = [-(-p // page_size) for p in prefix_lens]
    indptr = lambda v: torch.tensor([0, *torch.tensor(v).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return plan_mla(indptr(q_lens), indptr(pages), torch.arange(sum(pages), dtype=torch.int32),
                    torch.tensor(prefix_lens, dtype=torch.int32), page_size=page_size, num_pages=max(1, sum(pages)),
                    sm_scale=0.1)


def test_split_rule_fills_the_gpu_without_short_splits():
    decode, verify = _plan([1], [16384]), _plan([4], [16384])
    # batch 1: as many splits as the minimum length allows (128 keys, and 8 keys per row)
    assert verify_num_splits(decode, 8, 132) == 128 == MAX_SPLITS
    assert verify_num_splits(verify, 8, 132) == (16384 + 4) // 256
    # batch 16: ~2 waves of 132 SMs, 17 splits of ~964 keys
    assert verify_num_splits(_plan([4] * 16, [16384] * 16), 8, 132) == 17
    # short contexts are not split below 4 blocks; a tiny one is one split
    assert verify_num_splits(_plan([1], [600]), 8, 132) == 601 // MIN_SPLIT_KEYS
    assert verify_num_splits(_plan([3, 1], [0, 5]), 8, 132) == 1
    # the length counts the new tokens too: 508 + 4 keys make two splits of 256
    assert verify_num_splits(_plan([4], [508]), 8, 132) == 2
    # the minimum length is per group's rows (7 tokens x 7 heads), not all 20 heads'
    assert verify_num_splits(_plan([7], [8192]), 20, 132) == 8199 // (8 * 7 * 7)
    # value halves double the programs: half the splits fill the GPU
    assert verify_num_splits(_plan([4] * 16, [16384] * 16), 8, 132, dv_split=2) == 9
    for plan in (decode, verify, _plan([7, 2], [1000, 131072])):
        for heads in (1, 8, 20):
            s = verify_num_splits(plan, heads, 132)
            hpg = verify_tile(plan.max_q_len, heads).heads_per_group
            assert 1 <= s <= MAX_SPLITS
            assert s == 1 or (plan.max_prefix + plan.max_q_len) / s >= max(MIN_SPLIT_KEYS, 8 * plan.max_q_len * hpg)


def test_bad_input_is_named():
    x = make_mla_inputs([2, 3], [3, 70], heads=4, page_size=64, dtype=torch.float16, device=DEVICE, seed=5)
    with pytest.raises(ValueError, match="q: expected"):
        mla_verify(x.q[:4], x.kv_new, x.kv_cache, x.plan)
    with pytest.raises(ValueError, match="out: expected"):
        mla_verify(x.q, x.kv_new, x.kv_cache, x.plan, out=torch.empty(5, 4, 576, dtype=torch.float16, device=DEVICE))
    for bad in (0, MAX_SPLITS + 1, 70000, 2.0, True):  # 70000: past a grid dimension's limit
        with pytest.raises(ValueError, match=r"num_splits: expected an int in 1\.\.128"):
            mla_verify(x.q, x.kv_new, x.kv_cache, x.plan, num_splits=bad)
    with pytest.raises(ValueError, match="dv_split"):
        mla_verify(x.q, x.kv_new, x.kv_cache, x.plan, dv_split=4)
    with pytest.raises(ValueError, match="q: dtype"):
        mla_verify(x.q.to(torch.int16), x.kv_new.to(torch.int16), x.kv_cache.to(torch.int16), x.plan)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_case_gate_fails_a_dropped_prefix_key_and_tf32_products(seed):
    # the attention case's smoke points in each of its dtypes: its reference is fp32, and its
    # gate at the point's tolerance tells a kernel that dropped the last prefix token from a right one
    from microbench.case import expand
    from microbench.cases.mla import MLAVerifyCase

    case = MLAVerifyCase()
    for point in expand({**case.axes("smoke", "cpu"), "dtype": list(case.tolerances)}):
        w = case.setup(point, "cpu", seed)
        want = case.reference(w)["out"]
        assert want.dtype == torch.float32
        q, kv_new, kv_cache, plan = (w.inputs[k] for k in ("q", "kv_new", "kv_cache", "plan"))
        assert plan.batch == 1 and plan.max_prefix > 1
        pages = -(-(plan.max_prefix - 1) // plan.page_size)
        short = plan_mla(plan.qo_indptr, torch.tensor([0, pages], dtype=torch.int32), plan.kv_indices[:pages],
                         plan.prefix_lens - 1, page_size=plan.page_size, num_pages=plan.num_pages,
                         sm_scale=plan.sm_scale)
        wrong = mla_attention_ref(q, kv_new, kv_cache, short).to(q.dtype)
        atol, rtol = case.tolerance(point)
        assert not compare(wrong, want, atol=atol, rtol=rtol).passed
        if point["dtype"] == "fp32":  # the precision check: products at TF32's 10-bit mantissa fail it
            tf32 = mla_attention_ref(q.half().float(), kv_new.half().float(), kv_cache.half().float(), plan)
            assert not compare(tf32, want, atol=atol, rtol=rtol).passed


def test_the_gpu_tests_tree_batch_tells_a_tree_from_causal():
    # the bf16 check below can fail a kernel that applied the causal mask in place of the
    # tree (kimi_tree_inputs asserts it; at a 16K context alone it could not)
    x = kimi_tree_inputs(BF16[0], seed=16, atol=BF16[1])
    assert x.plan.tree_mask is not None and x.plan.batch == 16


@pytest.mark.parametrize(("batch", "tree", "num_splits"), [
    pytest.param(1, False, None, marks=[pytest.mark.gpu]),
    pytest.param(16, False, None, marks=[pytest.mark.gpu]),
    pytest.param(16, True, None, marks=[pytest.mark.gpu]),
    pytest.param(16, True, 1, marks=[pytest.mark.gpu]),  # one split: no merge
])
def test_bf16_at_kimi_shapes(batch, tree, num_splits):
    # per rank at TP8: 8 heads, 3 draft tokens + 1, in 64-token pages; causal at a 16K
    # context, tree masks over contexts from 0 to 16K (where a mask shows: kimi_tree_inputs)
    dtype, atol, rtol = BF16
    x = (kimi_tree_inputs(dtype, seed=batch + (num_splits or 0), atol=atol) if tree else
         make_mla_inputs([4] * batch, [16384] * batch, heads=8, page_size=64, dtype=dtype, device=DEVICE, seed=batch))
    _run(x, dtype, atol, rtol, num_splits=num_splits)
