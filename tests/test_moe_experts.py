"""Fused MoE experts: both kernels against the reference, and segments.

What is checked against what:

- ``fused_moe`` (server-style baseline) and ``few_token_moe`` against ``fused_moe_ref``
  fed the very same fp16 weights (or INT4 words with the same fp16 scales): odd token
  counts, experts with no tokens, one expert chosen by every token, all choices of every
  token on one expert (a segment longer than the few-token tile), top_k == E, more than
  16 tokens (several row blocks), routing from the real router, ``out=`` in place.
- ``expert_segments`` against ``align_ref`` at block size 1.

The INT4 layout and the reference itself are checked in tests/test_moe_reference.py, the
tuning table, configurations and cost in tests/test_moe_tuning.py, bad input to both
launchers and to ``prepare_weights`` in tests/test_moe_args.py.

Inputs are seeded.  On CPU the kernels run under Triton's interpreter (tests/conftest.py)
in fp16, and in bf16 (the model's dtype) with the interpreter's bf16 ``tl.dot`` made to
compute as a tensor core does (tests/interp_bf16.py); the bf16 checks at Kimi-K2.5 TP8
shapes run on a CUDA device only.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import pytest
import torch

from microbench.kernels.moe_common import prepare_weights
from microbench.kernels.moe_tuning import GemmConfig, default_config
from microbench.kernels.moe_few_token import few_token_moe
from microbench.kernels.moe_fused import fused_moe
from microbench.kernels.moe_reference import align_ref, fused_moe_ref, pack_int4
from microbench.kernels.moe_routing import expert_segments, route

from .moe_helpers import DEVICE, hidden_states, moe_checkpoint, routing

CUDA = torch.cuda.is_available()
FP16_TOL = 1e-2  # relative to the output's magnitude (~1): fp16 intermediates round at ~5e-4


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------


def _reference(x, ck, tw, ids):
    return fused_moe_ref(x, ck["w13"], ck["w2"], tw, ids, w13_scales=ck.get("w13_scales"),
                         w2_scales=ck.get("w2_scales"))


def _assert_matches_ref(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, tol: float) -> None:
    assert got.shape == x.shape and got.dtype == x.dtype and got.device == x.device
    scale = want.abs().max().item()
    assert scale > 0.1, "the reference output is too small for the comparison to mean anything"
    torch.testing.assert_close(got.float(), want.float(), atol=tol * max(scale, 1.0), rtol=tol)


# Tile configurations: small enough for the interpreter, and exercising several tiles.
FUSED_CONFIGS = [
    pytest.param(GemmConfig(block_n=16, block_k=32, block_m=16), id="bm16"),
    pytest.param(GemmConfig(block_n=32, block_k=32, block_m=32, group_m=2), id="bm32-gm2"),
]
FEW_CONFIGS = [
    pytest.param((GemmConfig(block_n=16, block_k=16, split_k=3), GemmConfig(block_n=16, block_k=16, split_k=2)),
                 id="split3-2"),
    pytest.param((GemmConfig(block_n=32, block_k=32, split_k=1), GemmConfig(block_n=32, block_k=32, split_k=1)),
                 id="split1"),
]


def _launch(kernel: str, cfg, x, W, tw, ids, **kw):
    if kernel == "fused":
        return fused_moe(x, W, tw, ids, config=cfg, **kw)
    return few_token_moe(x, W, tw, ids, config_w13=cfg[0], config_w2=cfg[1], **kw)


KERNEL_CONFIGS = ([pytest.param("fused", p.values[0], id="fused-" + p.id) for p in FUSED_CONFIGS]
                  + [pytest.param("few_token", p.values[0], id="few-" + p.id) for p in FEW_CONFIGS])
KINDS = [pytest.param("dense", FP16_TOL, id="fp16"), pytest.param("int4", FP16_TOL, id="int4")]


# --------------------------------------------------------------------------------------
# Both kernels against fused_moe_ref
# --------------------------------------------------------------------------------------

CASES = [  # (T, E, top_k, routing pattern, H, I)
    # one pair per touched expert: every aligned block is used, 3 of them, so group_m = 2
    # leaves a last group of one row block
    pytest.param(1, 8, 3, "distinct", 64, 32, id="T1"),
    pytest.param(3, 12, 2, "sparse", 64, 32, id="T3-empty-experts"),
    pytest.param(7, 6, 3, "expert2-everyone", 64, 32, id="T7-expert2-for-all"),
    pytest.param(9, 4, 2, "all-same", 64, 32, id="T9-all-choices-one-expert"),  # 18 pairs > 16 tile rows
    pytest.param(5, 4, 4, "distinct", 64, 32, id="T5-topk-equals-E"),
    pytest.param(20, 8, 2, "expert2-everyone", 64, 32, id="T20-several-row-blocks"),  # 20 pairs on expert 2
    pytest.param(3, 6, 2, "distinct", 96, 48, id="T3-partial-tiles"),  # N, K not multiples of 32
]


def _group_for(I: int) -> int:
    return 32 if I % 32 == 0 else 16


# The first configuration of each kernel on every case; the second (block_m 32 with the
# group_m swizzle / no K split, 32-wide tiles) on the cases where tiling matters most.
SECOND_CONFIG_CASES = {"T1", "T9-all-choices-one-expert", "T20-several-row-blocks", "T3-partial-tiles"}
KERNEL_CASES = [
    pytest.param(*case.values, *kc.values, id=f"{case.id}-{kc.id}")
    for case in CASES for kc in KERNEL_CONFIGS
    if kc.id in ("fused-bm16", "few-split3-2") or case.id in SECOND_CONFIG_CASES
]


@pytest.mark.parametrize(("kind", "tol"), KINDS)
@pytest.mark.parametrize(("T", "E", "k", "pattern", "H", "I", "kernel", "cfg"), KERNEL_CASES)
def test_kernel_matches_reference(T, E, k, pattern, H, I, kernel, cfg, kind, tol):
    ck, W = moe_checkpoint(kind, E, H, I, seed=T + 100 * E, group_size=_group_for(I))
    x = hidden_states(T, H, seed=T)
    tw, ids = routing(pattern, T, E, k, seed=7 * T + E)
    want = _reference(x, ck, tw, ids)
    got = _launch(kernel, cfg, x, W, tw, ids)
    _assert_matches_ref(got, want, x, tol)


BF16_TOL = 2e-2  # as on the GPU at Kimi shapes: bf16 intermediates round at ~4e-3
BF16_CASES = [  # each kernel's first configuration (the few-token INT4 one unpacks once too)
    pytest.param(*case.values, kernel, cfg, id=f"{case.id}-{kernel}")
    for case in CASES
    for kernel, cfg in (("fused", FUSED_CONFIGS[0].values[0]), ("few_token", FEW_CONFIGS[0].values[0]))
]


@pytest.mark.parametrize("kind", ["dense", "int4"], ids=["bf16", "int4"])
@pytest.mark.parametrize(("T", "E", "k", "pattern", "H", "I", "kernel", "cfg"), BF16_CASES)
def test_kernel_matches_reference_in_bf16(T, E, k, pattern, H, I, kernel, cfg, kind):
    """The model's dtype: bf16 activations with bf16 weights, or with INT4 words and bf16
    scales (on CPU, the interpreter's bf16 dot computes as a tensor core does)."""
    ck, W = moe_checkpoint(kind, E, H, I, seed=T + 100 * E + 2, dtype=torch.bfloat16, group_size=_group_for(I))
    x = hidden_states(T, H, seed=T + 2, dtype=torch.bfloat16)
    tw, ids = routing(pattern, T, E, k, seed=7 * T + E + 2)
    want = _reference(x, ck, tw, ids)
    if kind == "int4" and kernel == "few_token":
        w13, w2 = cfg
        cfg = (dataclasses.replace(w13, unpack=1), dataclasses.replace(w2, unpack=1))
    _assert_matches_ref(_launch(kernel, cfg, x, W, tw, ids), want, x, BF16_TOL)


UNPACK_CONFIGS = [  # the few-token kernel reading each INT4 word once (GemmConfig.unpack)
    # K steps of 16: inside one group of 32 (I = 32) or one tile per group of 16 (I = 48)
    pytest.param((GemmConfig(block_n=16, block_k=16, split_k=3, unpack=1),
                  GemmConfig(block_n=16, block_k=16, split_k=2, unpack=1)), id="bk16-unpack"),
    # K steps of 32 and 64: one and two groups per tile; w2's 64-step tile past K (I = 32)
    pytest.param((GemmConfig(block_n=32, block_k=32, split_k=1, unpack=1),
                  GemmConfig(block_n=32, block_k=64, split_k=1, unpack=1)), id="bk32-64-unpack"),
]


@pytest.mark.parametrize("cfg", UNPACK_CONFIGS)
@pytest.mark.parametrize(("T", "E", "k", "pattern", "H", "I"), CASES)
def test_few_token_int4_unpacked_once_matches_reference(T, E, k, pattern, H, I, cfg):
    ck, W = moe_checkpoint("int4", E, H, I, seed=T + 100 * E + 1, group_size=_group_for(I))
    x = hidden_states(T, H, seed=T + 1)
    tw, ids = routing(pattern, T, E, k, seed=7 * T + E + 1)
    _assert_matches_ref(_launch("few_token", cfg, x, W, tw, ids), _reference(x, ck, tw, ids), x, FP16_TOL)


@pytest.mark.parametrize("kind", ["dense", "int4"])
@pytest.mark.parametrize("kernel", ["fused", "few_token"])
def test_kernels_mask_a_partial_last_n_tile(kernel, kind):
    """H = 40 and I = 24 with 16-wide N tiles: the last tile of w2's output (both kernels)
    and of the few-token kernel's w13 half is partial; nothing may spill past a row."""
    T, E, H, I, k = 5, 6, 40, 24, 2
    ck, W = moe_checkpoint(kind, E, H, I, seed=51, group_size=8)
    x = hidden_states(T, H, seed=52)
    tw, ids = routing("distinct", T, E, k, seed=53)
    cfg = FUSED_CONFIGS[0].values[0] if kernel == "fused" else FEW_CONFIGS[0].values[0]
    _assert_matches_ref(_launch(kernel, cfg, x, W, tw, ids), _reference(x, ck, tw, ids), x, FP16_TOL)


@pytest.mark.parametrize(("kernel", "cfg"), [
    pytest.param("fused", GemmConfig(block_n=16, block_k=32, block_m=16), id="fused-bk32"),
    pytest.param("few_token", (GemmConfig(block_n=16, block_k=16, split_k=2, unpack=1),
                               GemmConfig(block_n=16, block_k=32, unpack=1)), id="few-unpack-bk16-32"),
])
def test_int4_groups_longer_than_the_k_step(kernel, cfg):
    """Group size 64 over K steps of 16 and 32: several tiles read one row of scales."""
    T, E, H, I, k = 3, 4, 128, 64, 2
    ck, W = moe_checkpoint("int4", E, H, I, seed=61, group_size=64)
    x = hidden_states(T, H, seed=62)
    tw, ids = routing("distinct", T, E, k, seed=63)
    _assert_matches_ref(_launch(kernel, cfg, x, W, tw, ids), _reference(x, ck, tw, ids), x, FP16_TOL)


@pytest.mark.parametrize("weights", ["int4", "bf16"])
def test_a_short_fused_search_varies_its_n_tile_and_stages_first(weights):
    """At few tokens each expert has one row block: group_m only reorders tiles and a larger
    block_m only pads, so a capped search (the GPU check's: 6) tries N tiles and stages."""
    from microbench.kernels.moe_tuning import default_config, search_space

    space = search_space("fused", "w13+w2", weights, 512, 7168, 4)
    first = default_config("fused", "w13+w2", weights, 512, 7168, 4)
    assert len(space) == len(set(space)) == 72 and space[0] == first
    assert {(c.block_n, c.num_stages) for c in space[:6]} == {(bn, st) for bn in (64, 128, 32) for st in (3, 4)}
    assert all((c.block_m, c.block_k, c.group_m) == (16, first.block_k, 1) for c in space[:6])
    assert {c.block_k for c in space[6:12]} == {192 - first.block_k}  # then the other K step
    assert all(c.group_m == 1 for c in space[:36]) and all(c.group_m == 8 for c in space[36:])


def test_unpack_once_is_searched_for_int4_and_refused_for_odd_groups():
    from microbench.kernels.moe_tuning import search_space

    space = search_space("few_token", "w13", "int4", 512, 7168, 4)
    assert space[0].unpack == 1 and space[1] == dataclasses.replace(space[0], unpack=0)
    assert space[2:4] == [dataclasses.replace(space[0], num_warps=8, unpack=u) for u in (1, 0)]
    assert [c.num_warps for c in space].count(8) == 2 and len(set(space)) == len(space)
    assert sum(c.unpack for c in space) == len(space) // 2
    assert not any(c.unpack for c in search_space("few_token", "w13", "bf16", 512, 7168, 4))
    assert not any(c.unpack for c in search_space("fused", "w13+w2", "int4", 512, 7168, 4))
    with pytest.raises(ValueError, match="unpack"):
        GemmConfig(block_n=16, block_k=16, unpack=2)
    ck, W = moe_checkpoint("int4", 4, 48, 48, seed=3, group_size=24)
    tw, ids = routing("distinct", 1, 4, 2, seed=3)
    cfg = GemmConfig(block_n=16, block_k=16, unpack=1)
    with pytest.raises(ValueError, match="config_w13: unpack=1 needs a power-of-two INT4 group"):
        few_token_moe(hidden_states(1, 48, 3), W, tw, ids, config_w13=cfg, config_w2=cfg)
    # given no configuration, such a group takes the default that reads a word per row
    x = hidden_states(1, 48, 3)
    _assert_matches_ref(few_token_moe(x, W, tw, ids), _reference(x, ck, tw, ids), x, FP16_TOL)
    assert default_config("few_token", "w13", "int4", 96, 48, 1, whole_words=False).unpack == 0


@pytest.mark.parametrize(("kind", "tol"), KINDS)
@pytest.mark.parametrize("kernel", ["fused", "few_token"])
def test_kernel_with_real_router(kernel, kind, tol):
    """Routing from moe_routing.route (grouped top-k with a correction bias)."""
    T, E, H, I, k = 7, 8, 64, 32, 3
    ck, W = moe_checkpoint(kind, E, H, I, seed=21)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(T, H, generator=g).to(DEVICE, torch.float16)
    gate = (torch.randn(E, H, generator=g) / math.sqrt(H)).to(DEVICE, torch.float16)
    bias = (0.1 * torch.randn(E, generator=g)).to(DEVICE)
    tw, ids = route(x, gate, bias, top_k=k, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert ids.dtype == torch.int32 and tw.dtype == torch.float32 and ids.shape == (T, k)
    want = _reference(x, ck, tw, ids)
    cfg = FUSED_CONFIGS[0].values[0] if kernel == "fused" else FEW_CONFIGS[0].values[0]
    _assert_matches_ref(_launch(kernel, cfg, x, W, tw, ids), want, x, tol)


@pytest.mark.parametrize(("kernel", "cfg"), [KERNEL_CONFIGS[0], KERNEL_CONFIGS[2]])
def test_kernel_writes_out_in_place(kernel, cfg):
    T, E, H, I, k = 5, 6, 64, 32, 2
    ck, W = moe_checkpoint("dense", E, H, I, seed=31)
    x = hidden_states(T, H, seed=32)
    tw, ids = routing("distinct", T, E, k, seed=33)
    out = torch.full_like(x, float("nan"))
    ptr = out.data_ptr()
    got = _launch(kernel, cfg, x, W, tw, ids, out=out)
    assert got is out and out.data_ptr() == ptr
    assert not torch.isnan(out).any()
    _assert_matches_ref(out, _reference(x, ck, tw, ids), x, FP16_TOL)


@pytest.mark.parametrize("kernel", ["fused", "few_token"])
def test_kernel_no_tokens(kernel):
    _, W = moe_checkpoint("dense", 4, 64, 32, seed=0)
    x = torch.empty(0, 64, dtype=torch.float16, device=DEVICE)
    tw, ids = torch.empty(0, 2, device=DEVICE), torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    got = fused_moe(x, W, tw, ids) if kernel == "fused" else few_token_moe(x, W, tw, ids)
    assert got.shape == (0, 64) and got.dtype == torch.float16


@pytest.mark.parametrize("kernel", ["fused", "few_token"])
def test_kernel_default_config(kernel):
    """config=None takes default_config (block_k 128/64 > H here: masked K tiles)."""
    T, E, H, I, k = 3, 6, 64, 32, 2
    for kind in ("dense", "int4"):
        ck, W = moe_checkpoint(kind, E, H, I, seed=41)
        x = hidden_states(T, H, seed=42)
        tw, ids = routing("distinct", T, E, k, seed=43)
        got = fused_moe(x, W, tw, ids) if kernel == "fused" else few_token_moe(x, W, tw, ids)
        _assert_matches_ref(got, _reference(x, ck, tw, ids), x, FP16_TOL)


# --------------------------------------------------------------------------------------
# expert_segments against align_ref at block size 1
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("T", "E", "k", "pattern"), [
    pytest.param(1, 8, 3, "distinct", id="T1"),
    pytest.param(5, 7, 3, "distinct", id="T5-odd-E"),
    pytest.param(7, 16, 2, "sparse", id="T7-empty-experts"),
    pytest.param(9, 4, 2, "all-same", id="T9-all-on-one"),
    pytest.param(3, 6, 6, "distinct", id="topk-equals-E"),
    pytest.param(13, 48, 8, "expert2-everyone", id="T13-several-chunks"),
])
def test_expert_segments_match_align_ref(T, E, k, pattern):
    _, ids = routing(pattern, T, E, k, seed=T + E)
    sorted_ids, seg_e, seg_start, seg_cnt, nseg = expert_segments(ids, E)
    S = min(E, T * k)
    assert sorted_ids.dtype == seg_e.dtype == seg_start.dtype == seg_cnt.dtype == nseg.dtype == torch.int32
    assert sorted_ids.shape == (T * k,) and seg_e.shape == seg_start.shape == seg_cnt.shape == (S,)
    ref_sorted, ref_blocks, ref_p = align_ref(ids.cpu(), E, 1)
    assert ref_p == T * k and torch.equal(sorted_ids.cpu(), ref_sorted)
    counts = torch.bincount(ids.cpu().reshape(-1).long(), minlength=E).tolist()
    touched = [e for e in range(E) if counts[e]]
    starts = [sum(counts[:e]) for e in touched]
    n = int(nseg)
    assert n == len(touched) == len(set(ref_blocks.tolist()))
    assert seg_e[:n].tolist() == touched
    assert seg_start[:n].tolist() == starts
    assert seg_cnt[:n].tolist() == [counts[e] for e in touched]


# --------------------------------------------------------------------------------------
# GPU: bf16 at Kimi-K2.5 TP8 shapes per rank (E 384, H 7168, I 256, top-8)
# --------------------------------------------------------------------------------------

KIMI_E, KIMI_H, KIMI_I, KIMI_K = 384, 7168, 256, 8


@lru_cache(maxsize=None)
def _kimi_weights(kind: str):
    """The layer's weights on the GPU (generated there; INT4 packed there, in chunks of
    experts to bound the fp32 temporaries)."""
    g = torch.Generator(device="cuda").manual_seed(2025)
    w13 = (torch.randn(KIMI_E, 2 * KIMI_I, KIMI_H, device="cuda", generator=g) / math.sqrt(KIMI_H)).bfloat16()
    w2 = (torch.randn(KIMI_E, KIMI_H, KIMI_I, device="cuda", generator=g) / math.sqrt(KIMI_I)).bfloat16()
    if kind == "dense":
        ck = {"w13": w13, "w2": w2}
    else:
        p13 = [pack_int4(w13[i:i + 64]) for i in range(0, KIMI_E, 64)]
        p2 = [pack_int4(w2[i:i + 64]) for i in range(0, KIMI_E, 64)]
        del w13, w2
        ck = {"w13": torch.cat([q for q, _ in p13]), "w13_scales": torch.cat([s for _, s in p13]),
              "w2": torch.cat([q for q, _ in p2]), "w2_scales": torch.cat([s for _, s in p2])}
        assert ck["w13_scales"].dtype == torch.bfloat16
    W = prepare_weights(ck["w13"], ck["w2"], w13_scales=ck.get("w13_scales"), w2_scales=ck.get("w2_scales"))
    return ck, W


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "int4"], ids=["bf16", "int4"])
@pytest.mark.parametrize("T", [1, 4, 64])
@pytest.mark.parametrize("kernel", ["fused", "few_token"])
def test_kimi_tp8_bf16_gpu(kernel, T, kind):
    ck, W = _kimi_weights(kind)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, KIMI_H, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(KIMI_E, generator=g)[:KIMI_K] for _ in range(T)]).to("cuda", torch.int32)
    tw = (torch.rand(T, KIMI_K, generator=g) + 0.1).cuda()
    want = _reference(x, ck, tw, ids)
    got = fused_moe(x, W, tw, ids) if kernel == "fused" else few_token_moe(x, W, tw, ids)
    torch.cuda.synchronize()
    assert not torch.isnan(got).any()
    _assert_matches_ref(got, want, x, 2e-2)


def _assert_remote_ids_match(kernel, x, ck, W, tw, ids):
    """One configuration of ``kernel`` against the reference, with ``-1`` ids (experts on
    another rank) allowed and checked on the host."""
    kw = {"remote_ids": True, "check_ids": True} if kernel == "fused" else {"check_ids": True}
    _assert_matches_ref(_launch(kernel, KERNEL_CONFIGS[0 if kernel == "fused" else 2].values[1], x, W, tw, ids, **kw),
                        _reference(x, ck, tw, ids), x, FP16_TOL)


# The baseline's activation runs over every pair's row, and the rows of pairs whose expert
# is elsewhere were never written (no block holds them; their down rows are zeroed): the
# interpreter's numpy then warns about arithmetic on whatever the memory held. Those rows are read
# by nothing; the test checks the output.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kernel", ["fused", "few_token"])
def test_other_ranks_ids_add_nothing_in_both_kernels(kernel):
    """Expert parallelism: ids of experts held by another rank are -1 and contribute nothing
    (the baseline zeroes their rows with ``remote_ids``; the few-token kernel drops them),
    and pass the host-side id check."""
    T, E, H, I, k = 6, 8, 64, 32, 4
    ck, W = moe_checkpoint("dense", E, H, I, seed=3)
    x = hidden_states(T, H, seed=4)
    g = torch.Generator().manual_seed(5)
    gate = (torch.randn(E, H, generator=g) / 8).to(DEVICE, torch.float16)
    tw, ids = route(x, gate, None, top_k=k, n_group=1, topk_group=1, routed_scaling_factor=2.5)
    ids = torch.where(ids >= 6, torch.full_like(ids, -1), ids)  # experts 6, 7 live elsewhere
    assert (ids == -1).any()
    _assert_remote_ids_match(kernel, x, ck, W, tw, ids)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kind", ["dense", "int4"])
@pytest.mark.parametrize("kernel", ["fused", "few_token"])
def test_a_rank_with_fewer_experts_than_top_k(kernel, kind):
    """Expert parallelism over many ranks: 8 experts on 4 ranks leave this one 2 (global 2
    and 3), fewer than the 4 each token picks; the rest of a token's choices are -1, and a
    token may have none here at all."""
    T, H, I, k = 7, 64, 32, 4
    g = torch.Generator().manual_seed(11)
    picks = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(T)])
    ids = torch.where((picks >= 2) & (picks < 4), picks - 2, -1).to(DEVICE, torch.int32)
    assert (ids == -1).all(dim=1).any() and ((ids >= 0).sum(dim=1) == 2).any()
    tw = (torch.rand(T, k, generator=g) + 0.1).to(DEVICE)
    ck, W = moe_checkpoint(kind, 2, H, I, seed=3)
    x = hidden_states(T, H, seed=4)
    _assert_remote_ids_match(kernel, x, ck, W, tw, ids)
