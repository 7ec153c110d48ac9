"""The split-KV MLA decode kernel against the fp32 reference, plus its split rule and its
refusals.

Runs on CPU tensors under Triton's interpreter when there is no CUDA device (fp16, fp32
and bf16, the interpreter's bf16 tl.dot made to compute as a tensor core does:
tests/interp_bf16.py), bf16 at Kimi-K2.5 TP8 shapes on the GPU.
Inputs are seeded random values over shuffled pages with random unused pages
(``make_mla_inputs``); every output is pre-filled with NaN so an unwritten row fails.
Batches mix prefix lengths (0/1, 63, 65, 1000: empty, just under and over a 64-key page
and many tiles), so one launch holds requests whose later splits get no keys at all.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import microbench.kernels.mla_decode as mla_decode_module
from microbench.cases.mla_inputs import make_mla_inputs
from microbench.kernels.mla_common import CPU_SM_STAND_IN, plan_mla, sm_count
from microbench.kernels.mla_decode import BLOCK_H, MAX_SPLITS, MIN_SPLIT_KEYS, decode_num_splits, mla_decode
from microbench.kernels.reference import mla_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# fp16: exact operands, fp32 sums; the error is the fp16 rounding of p before p @ v
# (2**-11 relative per weight) and of the output (half an ulp is 1e-3 at |out| ~ 3), so
# 5e-3 leaves a 4x margin while a dropped key (e.g. the token's own row, weight ~1/L)
# at the short prefixes moves the output by far more. fp32: only summation order differs.
# bf16: 8 mantissa bits, half an ulp is 8e-3 at |out| ~ 3.
FP16 = (torch.float16, 5e-3, 5e-3)
FP32 = (torch.float32, 1e-4, 1e-4)
BF16 = (torch.bfloat16, 2e-2, 2e-2)


def _run(prefix_lens, *, heads, page_size, dtype, seed, num_splits=None, logit_cap=0.0):
    x = make_mla_inputs([1] * len(prefix_lens), prefix_lens, heads=heads, page_size=page_size, dtype=dtype,
                        device=DEVICE, seed=seed, logit_cap=logit_cap)
    out = torch.full((len(prefix_lens), heads, 512), float("nan"), dtype=dtype, device=DEVICE)
    got = mla_decode(x.q, x.kv_new, x.kv_cache, x.plan, out=out, num_splits=num_splits)
    assert got is out
    return x, out


def _assert_matches(x, out, atol, rtol):
    want = mla_attention_ref(x.q, x.kv_new, x.kv_cache, x.plan)
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements left unwritten (NaN)"
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("prefix_lens", "heads", "page_size", "dtype_tol"), [
    pytest.param([1, 63, 65, 1000], 8, 64, FP16, id="kimi-heads8-page64"),  # rule: 8 splits, short ones empty
    pytest.param([0, 65, 63], 20, 1, FP16, id="heads20-two-head-tiles-page1"),
    pytest.param([1000, 0], 1, 1, FP16, id="one-head-page1"),
    pytest.param([63, 1000], 2, 64, FP32, id="fp32"),
    pytest.param([1, 63, 65, 1000], 8, 64, BF16, id="bf16-kimi-heads8-page64"),
    pytest.param([0, 65, 63], 20, 1, BF16, id="bf16-heads20-page1"),
])
def test_matches_reference_with_the_default_split_rule(prefix_lens, heads, page_size, dtype_tol):
    dtype, atol, rtol = dtype_tol
    x, out = _run(prefix_lens, heads=heads, page_size=page_size, dtype=dtype, seed=11)
    _assert_matches(x, out, atol, rtol)


@pytest.mark.parametrize("num_splits", [1, 3, 7, MAX_SPLITS])  # MAX_SPLITS: the widest merge
def test_forced_splits_including_splits_with_no_keys(num_splits, monkeypatch):
    # 7 splits of a 2-key request: six get no keys; prefix 64 at 3 splits leaves the last
    # split only the new token's own row. The scratch is NaN-filled: the merge must never
    # read the partial of a split that had no keys.
    real_empty = torch.empty

    def nan_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(mla_decode_module.torch, "empty", nan_empty)
    x, out = _run([0, 1, 64, 65, 1000], heads=3, page_size=64, dtype=torch.float16, seed=20 + num_splits,
                  num_splits=num_splits)
    monkeypatch.undo()
    _assert_matches(x, out, *FP16[1:])


def test_matches_reference_when_every_logit_is_far_below_zero():
    # keys shifted by +3 against all-negative queries put every logit near -100: a key of
    # logit 0 that should not count (a masked or borrowed row, e.g. the new token in the
    # split that ends at it) then takes the weight from all real keys. At 3 splits the
    # prefix-64 request's split 1 ends exactly at its new token; prefix 63 ends mid-tile
    x = make_mla_inputs([1, 1, 1], [64, 63, 1], heads=3, page_size=64, dtype=torch.float16, device=DEVICE, seed=17)
    x = replace(x, q=-x.q.abs(), kv_new=x.kv_new + 3, kv_cache=x.kv_cache + 3)
    out = torch.full((3, 3, 512), float("nan"), dtype=torch.float16, device=DEVICE)
    mla_decode(x.q, x.kv_new, x.kv_cache, x.plan, out=out, num_splits=3)
    _assert_matches(x, out, *FP16[1:])


def test_logit_cap():
    # randn q.k over 576 channels at Kimi-K2.5's scale (0.145) has logits of std ~3.5: a cap of 1.5 bends most
    x, out = _run([65, 1, 1000], heads=4, page_size=64, dtype=torch.float16, seed=31, logit_cap=1.5)
    uncapped = mla_attention_ref(x.q, x.kv_new, x.kv_cache, plan_mla(
        x.plan.qo_indptr, x.plan.kv_indptr, x.plan.kv_indices, x.plan.prefix_lens, page_size=x.plan.page_size,
        num_pages=x.plan.num_pages, sm_scale=x.plan.sm_scale))
    assert (out.float() - uncapped).abs().max() > 0.1  # the cap matters at this scale
    _assert_matches(x, out, *FP16[1:])


def test_split_rule():
    def plan(batch, prefix):
        # the rule reads only the plan's host fields: one page per request, all the same page
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        pages = 1 if prefix else 0
        return plan_mla(i32(list(range(batch + 1))), i32([pages * b for b in range(batch + 1)]),
                        i32([0] * (pages * batch)), i32([prefix] * batch), page_size=1 << 15, num_pages=1,
                        sm_scale=0.1)

    # Kimi-K2.5 TP8 on an H200: batch 16 x 1 head tile -> cdiv(264, 16) = 17 splits, ~964 keys each
    assert decode_num_splits(plan(16, 16384), heads=8, sm_count=132) == 17
    assert decode_num_splits(plan(1, 16384), heads=8, sm_count=132) == MAX_SPLITS  # capped
    # a short context: no split shorter than MIN_SPLIT_KEYS keys
    assert decode_num_splits(plan(1, 1000), heads=8, sm_count=132) == -(-1001 // MIN_SPLIT_KEYS)
    assert decode_num_splits(plan(1, 1024), heads=8, sm_count=132) == 9  # the new token is key 1025
    assert decode_num_splits(plan(1, 0), heads=8, sm_count=132) == 1
    # more head tiles (20 heads -> 2 of BLOCK_H) or requests fill the GPU with fewer splits
    assert BLOCK_H == 16
    assert decode_num_splits(plan(16, 16384), heads=20, sm_count=132) == 9
    assert decode_num_splits(plan(300, 16384), heads=8, sm_count=132) == 1
    with pytest.raises(ValueError, match="heads and sm_count"):
        decode_num_splits(plan(1, 10), heads=0, sm_count=132)
    # off the GPU the rule runs as on an H200
    assert sm_count(torch.device("cpu")) == CPU_SM_STAND_IN == 132


def test_rejects_more_than_one_token_per_request():
    x = make_mla_inputs([1, 2], [5, 70], heads=2, page_size=64, dtype=torch.float16, device=DEVICE, seed=41)
    with pytest.raises(ValueError, match="qo_indptr.*max_q_len"):
        mla_decode(x.q, x.kv_new, x.kv_cache, x.plan)


def test_bad_inputs_name_the_argument():
    x = make_mla_inputs([1, 1], [5, 70], heads=2, page_size=64, dtype=torch.float16, device=DEVICE, seed=42)
    with pytest.raises(ValueError, match="q: expected"):
        mla_decode(x.q[:, :, :512].contiguous(), x.kv_new, x.kv_cache, x.plan)
    with pytest.raises(ValueError, match="out: expected"):
        mla_decode(x.q, x.kv_new, x.kv_cache, x.plan, out=torch.empty(2, 2, 576, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="q: dtype"):
        mla_decode(x.q.double(), x.kv_new.double(), x.kv_cache.double(), x.plan)
    for bad in (0, MAX_SPLITS + 1, 2.0, True):
        with pytest.raises(ValueError, match="num_splits"):
            mla_decode(x.q, x.kv_new, x.kv_cache, x.plan, num_splits=bad)


@pytest.mark.gpu
def test_kimi_shape_bf16_on_gpu():
    # Kimi-K2.5 at TP8: 8 heads per rank, batch 16 at a 16K context in 64-token pages
    dtype, atol, rtol = BF16
    x, out = _run([16384] * 16, heads=8, page_size=64, dtype=dtype, seed=51)
    _assert_matches(x, out, atol, rtol)
    # a forced split count gives the same answer within rounding
    again = mla_decode(x.q, x.kv_new, x.kv_cache, x.plan, num_splits=3)
    torch.testing.assert_close(again.float(), out.float(), atol=atol, rtol=rtol)
