"""The server-style extend kernel (the verify baseline) against the one MLA reference.

Mixed batches (q_len 1, 3, 7 with prefixes 0/1, 63, 65, 1000: empty, just under and over a
64-token page and many key blocks), page sizes 1 and 64 over shuffled pages with random
unused pages, causal and EAGLE-tree masks (incl. rows that see only themselves), the soft
cap, several query blocks per request, NaN-poisoned outputs; the tile choice and the byte
count of the repeated prefix reads; bad input named before any launch; bf16 at Kimi-K2.5
TP8 shapes on the GPU. On the CPU the kernel runs under Triton's interpreter in fp16, fp32
and bf16 (its bf16 tl.dot made to compute as a tensor core does: tests/interp_bf16.py).
"""

from __future__ import annotations

import pytest
import torch

import microbench.kernels.mla_common as mla_common
from microbench.cases.mla_inputs import make_mla_inputs
from microbench.gate import compare
from microbench.kernels.mla_common import HEAD_DIM, KV_LORA_RANK, mla_cost, plan_mla
from microbench.kernels.mla_extend import BLOCK_M, BLOCK_N, extend_kv_reads, extend_tile, mla_extend
from microbench.kernels.reference import mla_attention_ref

from .helpers import kimi_tree_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp16 operands (11-bit significand) and p rounded to fp16 before p @ v put ~1e-3 relative
# error on outputs of size ~0.1-1 against the fp32 reference; 2e-2 leaves a 10x margin and
# still fails a wrong page, key, mask entry or lost rescale (those move outputs by O(0.1)).
# fp32 ("ieee" dots): only the summation order differs. bf16: an 8-bit significand,
# half an ulp is 4e-3 relative, within the same 2e-2 bound at 16K keys.
FP16 = (torch.float16, 2e-2, 2e-2)
FP32 = (torch.float32, 1e-4, 1e-4)
BF16 = (torch.bfloat16, 2e-2, 2e-2)


def _run(x, dtype, atol, rtol):
    """Run into a NaN-poisoned out (an unwritten row fails), compare with the reference."""
    out = torch.full((x.plan.total_q, x.q.shape[1], KV_LORA_RANK), float("nan"), dtype=dtype, device=x.q.device)
    got = mla_extend(x.q, x.kv_new, x.kv_cache, x.plan, out=out)
    assert got is out
    rep = compare(out, mla_attention_ref(x.q, x.kv_new, x.kv_cache, x.plan), atol=atol, rtol=rtol)
    assert rep.passed, str(rep)
    return out


@pytest.mark.parametrize(("q_lens", "prefix_lens", "heads", "page_size", "tree", "dtype_tol"), [
    pytest.param([1, 3, 7, 3], [1, 63, 65, 1000], 2, 64, False, FP16, id="causal-page64"),
    pytest.param([7, 1, 3, 7], [0, 1000, 63, 65], 3, 1, True, FP16, id="tree-page1"),
    pytest.param([3, 7, 1], [65, 1, 0], 1, 64, True, FP16, id="tree-page64-one-head"),
    pytest.param([7, 3], [1000, 63], 2, 1, False, FP16, id="causal-page1"),
    pytest.param([1, 3, 7, 3], [1, 63, 65, 1000], 2, 64, False, BF16, id="bf16-causal-page64"),
    pytest.param([7, 1, 3, 7], [0, 1000, 63, 65], 3, 1, True, BF16, id="bf16-tree-page1"),
])
def test_matches_reference_on_mixed_batches(q_lens, prefix_lens, heads, page_size, tree, dtype_tol):
    dtype, atol, rtol = dtype_tol
    x = make_mla_inputs(q_lens, prefix_lens, heads=heads, page_size=page_size, dtype=dtype, device=DEVICE,
                        seed=7 + heads + page_size, tree=tree)
    _run(x, dtype, atol, rtol)


def test_fp32_takes_the_narrow_key_block():
    # fp32 keys come in blocks of 16: 65 and 63 tokens end mid-block, and mid-page
    dtype, atol, rtol = FP32
    assert extend_tile(dtype).block_n == 16
    x = make_mla_inputs([3, 1], [65, 63], heads=2, page_size=64, dtype=dtype, device=DEVICE, seed=13, tree=True)
    _run(x, dtype, atol, rtol)


def test_logit_cap_is_applied():
    dtype, atol, rtol = FP16
    x = make_mla_inputs([3, 1], [65, 7], heads=2, page_size=1, dtype=dtype, device=DEVICE, seed=9, logit_cap=1.5)
    out = _run(x, dtype, atol, rtol)
    # the cap changes the answer by more than the tolerance, so the check above can fail
    uncapped = plan_mla(x.plan.qo_indptr, x.plan.kv_indptr, x.plan.kv_indices, x.plan.prefix_lens,
                        page_size=x.plan.page_size, num_pages=x.plan.num_pages, sm_scale=x.plan.sm_scale)
    assert not compare(out, mla_attention_ref(x.q, x.kv_new, x.kv_cache, uncapped), atol=atol, rtol=rtol).passed


@pytest.mark.parametrize("tree", [False, True])
def test_several_query_blocks_per_request(tree, monkeypatch):
    # the kernel has no q_len limit of its own (it is the prefill kernel): with the plan's
    # verify limit lifted, q_len 40 takes two blocks of BLOCK_M rows; the causal bound of
    # block 0 stops at its last row, and the short request's second block stores nothing
    monkeypatch.setattr(mla_common, "MAX_Q_LEN", 64)
    dtype, atol, rtol = FP16
    x = make_mla_inputs([40, 3], [65, 1], heads=1, page_size=64, dtype=dtype, device=DEVICE, seed=21, tree=tree)
    assert -(-x.plan.max_q_len // BLOCK_M) == 2
    _run(x, dtype, atol, rtol)


def test_tree_row_that_sees_only_itself_after_a_block_it_cannot_see(monkeypatch):
    # fp32 takes 16 new-token keys a block: with no prefix, the last of 20 tokens (it sees
    # only itself) sees nothing in the first block, and its running max must stay finite
    monkeypatch.setattr(mla_common, "MAX_Q_LEN", 64)
    dtype, atol, rtol = FP32
    x = make_mla_inputs([20], [0], heads=1, page_size=64, dtype=dtype, device=DEVICE, seed=23, tree=True)
    assert x.plan.tree_mask[19 * 20:].tolist() == [False] * 19 + [True]
    _run(x, dtype, atol, rtol)


def test_tile_is_the_servers_hopper_choice():
    # SGLang, Lq = 576 on compute capability 9: BLOCK_M, BLOCK_N = 32, 64; 8 warps; 1 stage
    assert BLOCK_M >= 16 and BLOCK_N >= 16  # tl.dot minimum
    for dtype in (torch.bfloat16, torch.float16):
        assert tuple(extend_tile(dtype)) == (32, 64, 8, 1)
    assert tuple(extend_tile(torch.float32)) == (32, 16, 8, 1)
    with pytest.raises(ValueError, match="dtype"):
        extend_tile(torch.int8)


@pytest.mark.parametrize("tree", [False, True])
def test_small_shared_memory_tile_matches_reference(tree, monkeypatch):
    # on a GPU with under 128 KiB of shared memory per block (sm_86/89/120) the key block
    # halves (the 104 KiB Hopper tile cannot launch there); odd prefixes end mid-block
    import microbench.kernels.mla_extend as mla_extend_mod

    assert tuple(extend_tile(torch.bfloat16, small_smem=True)) == (32, 32, 8, 1)
    assert extend_tile(torch.float32, small_smem=True).block_n == 16
    seen = []
    monkeypatch.setattr(mla_extend_mod, "small_shared", lambda device: seen.append(device) or True)
    dtype, atol, rtol = FP16
    x = make_mla_inputs([7, 3, 1], [65, 1000, 31], heads=2, page_size=1, dtype=dtype, device=DEVICE, seed=31,
                        tree=tree)
    _run(x, dtype, atol, rtol)
    assert seen  # the launcher asked the device


def test_prefix_is_read_once_per_head(monkeypatch):
    # the reason verify is slow on this kernel: heads x the prefix, against a floor of once
    def plan(q_lens, prefix_lens):  # host fields only: the count reads nothing else
        pages = [-(-p // 64) for p in prefix_lens]
        ptr = lambda v: torch.tensor([0, *torch.tensor(v).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
        return plan_mla(ptr(q_lens), ptr(pages), torch.arange(sum(pages), dtype=torch.int32),
                        torch.tensor(prefix_lens, dtype=torch.int32), page_size=64, num_pages=max(1, sum(pages)),
                        sm_scale=0.1)

    kimi = plan([4] * 16, [16384] * 16)
    assert extend_kv_reads(kimi, 8, 2) == 8 * 16 * (16384 + 4) * HEAD_DIM * 2
    floor_bytes, _ = mla_cost(kimi, 8, 2)
    assert 7.5 < extend_kv_reads(kimi, 8, 2) / floor_bytes < 8.0
    # no prefix: only the new tokens' own rows; two requests, each its own pass per head
    assert extend_kv_reads(plan([3], [0]), 1, 1) == 3 * HEAD_DIM
    assert extend_kv_reads(plan([1, 7], [65, 0]), 3, 2) == 3 * (66 + 7) * HEAD_DIM * 2
    # past BLOCK_M tokens (the plan's limit lifted) a causal block reads up to its last row
    monkeypatch.setattr(mla_common, "MAX_Q_LEN", 64)
    assert extend_kv_reads(plan([40], [0]), 1, 1) == (32 + 40) * HEAD_DIM
    with pytest.raises(ValueError, match="heads"):
        extend_kv_reads(kimi, 0, 2)


def test_bad_input_is_named():
    x = make_mla_inputs([2, 3], [3, 70], heads=2, page_size=64, dtype=torch.float16, device=DEVICE, seed=5)
    with pytest.raises(ValueError, match="q: expected"):
        mla_extend(x.q[:4].contiguous(), x.kv_new, x.kv_cache, x.plan)
    with pytest.raises(ValueError, match="q: expected"):
        mla_extend(x.q[:, :, :KV_LORA_RANK].contiguous(), x.kv_new, x.kv_cache, x.plan)
    with pytest.raises(ValueError, match="out: expected"):
        mla_extend(x.q, x.kv_new, x.kv_cache, x.plan, out=torch.empty(5, 2, 576, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="q: needs at least one head"):
        mla_extend(x.q[:, :0].contiguous(), x.kv_new, x.kv_cache, x.plan)
    with pytest.raises(ValueError, match="q: dtype"):
        mla_extend(x.q.to(torch.int16), x.kv_new.to(torch.int16), x.kv_cache.to(torch.int16), x.plan)


@pytest.mark.parametrize(("batch", "tree"), [
    pytest.param(1, False, marks=[pytest.mark.gpu]),
    pytest.param(16, True, marks=[pytest.mark.gpu]),
])
def test_bf16_at_kimi_shapes(batch, tree):
    # per rank at TP8: 8 heads, 3 draft tokens + 1, in 64-token pages; causal at a 16K
    # context, tree masks over contexts from 0 to 16K (where a mask shows: kimi_tree_inputs)
    dtype, atol, rtol = BF16
    x = (kimi_tree_inputs(dtype, seed=batch, atol=atol) if tree else
         make_mla_inputs([4] * batch, [16384] * batch, heads=8, page_size=64, dtype=dtype, device=DEVICE, seed=batch))
    _run(x, dtype, atol, rtol)
