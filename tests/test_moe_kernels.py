"""The fused-experts kernels: INT4 layout, reference, both kernels against the reference.

``unpack_int4`` is checked against nibbles written by hand, ``fused_moe_ref`` against a
per-token loop in float64, and ``fused_moe`` (the server-style baseline) and
``few_token_moe`` against ``fused_moe_ref`` — dense fp16 and INT4 weights, odd token
counts, experts with no tokens, every token on one expert, a segment longer than one tile,
top_k == E, -1 ids (another rank's experts), K splits.  Bad input raises ValueError naming
the argument.  On CPU the kernels run under Triton's interpreter; the bf16 checks at
Kimi-K2.5 TP8 shapes run on a CUDA device only.
"""

from __future__ import annotations

import math

import pytest
import torch

from microbench.kernels.moe_common import GemmConfig, TuningEntry, TuningTable, default_config, prepare_weights
from microbench.kernels.moe_few_token import few_token_moe
from microbench.kernels.moe_fused import fused_moe
from microbench.kernels.moe_reference import align_ref, fused_moe_ref, moe_cost, pack_int4, unpack_int4
from microbench.kernels.moe_routing import expert_segments, route

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SMALL = dict(block_n=16, block_k=32)


def _weights(E, H, I, dtype, seed, int4=False):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)
    w2 = torch.randn(E, H, I, generator=g) / math.sqrt(I)
    if not int4:
        w13, w2 = w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)
        return {"w13": w13, "w2": w2}, prepare_weights(w13, w2)
    (q13, s13), (q2, s2) = pack_int4(w13), pack_int4(w2)
    ck = {"w13": q13.to(DEVICE), "w2": q2.to(DEVICE), "w13_scales": s13.to(DEVICE, dtype),
          "w2_scales": s2.to(DEVICE, dtype)}
    return ck, prepare_weights(ck["w13"], ck["w2"], w13_scales=ck["w13_scales"], w2_scales=ck["w2_scales"])


def _routing(T, E, k, seed, how="distinct"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if how == "one-expert":  # every token's first choice is expert 2
        others = torch.tensor([e for e in range(E) if e != 2])
        ids = torch.stack([torch.cat([torch.tensor([2]), others[torch.randperm(E - 1, generator=g)[: k - 1]]])
                           for _ in range(T)])
    elif how == "all-same":
        ids = torch.full((T, k), 1)
    elif how == "few":  # only experts 0..2 get tokens: the rest stay empty
        ids = torch.stack([torch.randperm(3, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g) + 0.1
    return w.to(DEVICE), ids.to(torch.int32).to(DEVICE)


def _run(kernel, x, W, tw, ids, split=(3, 2)):
    if kernel == "fused":
        return fused_moe(x, W, tw, ids, config=GemmConfig(block_m=16, **SMALL), remote_ids=True)
    return few_token_moe(x, W, tw, ids, config_w13=GemmConfig(split_k=split[0], **SMALL),
                         config_w2=GemmConfig(split_k=split[1], **SMALL))


# --------------------------------------------------------------------------- INT4 layout


def test_unpack_reads_nibbles_where_the_layout_puts_them():
    q = torch.tensor([-8, -1, 0, 1, 7, 3, -5, 6] * 2)  # 16 inputs: two words, top nibble 6+8 = 14 (sign bit set)
    word = lambda vals: sum(int(v + 8) << (4 * j) for j, v in enumerate(vals))  # noqa: E731
    words = [word(q[:8].tolist()), word(q[8:].tolist())]
    words = torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32).view(1, 1, 2)
    scales = torch.tensor([[[0.5, 2.0]]])  # group 8: one scale per word
    assert torch.equal(unpack_int4(words, scales), (q.float() * torch.tensor([0.5] * 8 + [2.0] * 8)).view(1, 1, 16))


def test_pack_unpack_round_trip():
    w = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    q, s = pack_int4(w)
    assert q.shape == (3, 5, 8) and s.shape == (3, 5, 2) and s.dtype == torch.bfloat16
    d = unpack_int4(q, s)
    assert ((d - w).abs() <= s.float().repeat_interleave(32, -1) / 2 + 1e-6).all()
    q2, s2 = pack_int4(d)
    assert torch.equal(q, q2) and torch.equal(s, s2)


@pytest.mark.parametrize(("q", "s", "match"), [
    (torch.zeros(2, 4, 8), torch.ones(2, 4, 2), "qweight"),  # float, not int32
    (torch.zeros(2, 4, 8, dtype=torch.int32), torch.ones(2, 3, 2), "qweight_scales"),
    (torch.zeros(2, 4, 8, dtype=torch.int32), torch.ones(2, 4, 3), "qweight_scales"),  # 64 / 3
])
def test_bad_packed_weights_are_named(q, s, match):
    with pytest.raises(ValueError, match=match):
        unpack_int4(q, s)


# --------------------------------------------------------------------------- reference


def test_reference_matches_a_float64_loop_and_int4_matches_dequantised():
    T, E, H, I, k = 5, 6, 64, 32, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    tw, ids = torch.rand(T, k, generator=g), torch.randint(0, E, (T, k), generator=g)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            gu = w13[e].double() @ x[t].double()
            want[t] += float(tw[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gu[:I]) * gu[I:]))
    assert torch.allclose(fused_moe_ref(x, w13, w2, tw, ids), want.float(), atol=1e-4, rtol=1e-4)
    (q13, s13), (q2, s2) = pack_int4(w13), pack_int4(w2)
    dense = fused_moe_ref(x, unpack_int4(q13, s13), unpack_int4(q2, s2), tw, ids)
    assert torch.allclose(fused_moe_ref(x, q13, q2, tw, ids, w13_scales=s13, w2_scales=s2), dense, atol=1e-5)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe_ref(x, w13, w2, tw, torch.full((T, k), E))


def test_moe_cost_counts_touched_weights_once():
    # 2 experts touched, H 64, I 32: 3*32*64 = 6144 weights each
    assert moe_cost(3, 64, 32, 2, 2, "bf16") == (2 * 6144 * 2 + 2 * 3 * 64 * 2 + 8 * 3 * 2, 2 * 6 * 6144)
    assert moe_cost(3, 64, 32, 2, 2, "int4")[0] == 2 * (6144 // 2 + 6144 // 32 * 2) + 2 * 3 * 64 * 2 + 48
    with pytest.raises(ValueError, match="weights"):
        moe_cost(3, 64, 32, 2, 2, "fp8")


# --------------------------------------------------------------------------- kernels


CASES = [  # (T, E, top_k, routing)
    pytest.param(1, 8, 4, "distinct", id="T1"),
    pytest.param(3, 8, 3, "few", id="T3-empty-experts"),
    pytest.param(7, 6, 2, "one-expert", id="T7-one-expert-for-all"),
    pytest.param(9, 4, 2, "all-same", id="T9-segment-longer-than-a-tile"),
    pytest.param(5, 4, 4, "distinct", id="topk-equals-E"),
    pytest.param(20, 8, 2, "distinct", id="T20-several-row-blocks"),
]


@pytest.mark.parametrize("kernel", ["fused", "few_token"])
@pytest.mark.parametrize("int4", [False, True], ids=["fp16", "int4"])
@pytest.mark.parametrize(("T", "E", "k", "how"), CASES)
def test_kernels_match_the_reference(kernel, int4, T, E, k, how):
    H, I = 64, 32
    ck, W = _weights(E, H, I, torch.float16, seed=T + E, int4=int4)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(DEVICE, torch.float16)
    tw, ids = _routing(T, E, k, seed=E, how=how)
    want = fused_moe_ref(x, ck["w13"], ck["w2"], tw, ids, w13_scales=ck.get("w13_scales"),
                         w2_scales=ck.get("w2_scales"))
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, W, tw, ids, out=out, config=GemmConfig(block_m=16, **SMALL)) if kernel == "fused" else \
        few_token_moe(x, W, tw, ids, out=out, config_w13=GemmConfig(split_k=3, **SMALL),
                      config_w2=GemmConfig(split_k=2, **SMALL))
    assert got is out
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kernel", ["fused", "few_token"])
def test_router_routing_other_ranks_ids_and_default_configs(kernel):
    """Routing from the real router; ids of experts on another rank (-1) add nothing."""
    T, E, H, I = 6, 8, 64, 32
    ck, W = _weights(E, H, I, torch.float16, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g).to(DEVICE, torch.float16)
    gate = (torch.randn(E, H, generator=g) / 8).to(DEVICE, torch.float16)
    tw, ids = route(x, gate, None, top_k=4, n_group=1, topk_group=1, routed_scaling_factor=2.5)
    ids = torch.where(ids >= 6, torch.full_like(ids, -1), ids)  # experts 6, 7 live elsewhere
    want = fused_moe_ref(x, ck["w13"], ck["w2"], tw, ids)
    torch.testing.assert_close(_run(kernel, x, W, tw, ids).float(), want, atol=1e-2, rtol=1e-2)
    if kernel == "fused":
        torch.testing.assert_close(fused_moe(x, W, tw, ids, remote_ids=True).float(), want, atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(few_token_moe(x, W, tw, ids).float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("launcher", [fused_moe, few_token_moe], ids=["fused", "few_token"])
def test_bad_input_names_the_argument(launcher):
    T, E, H, I = 3, 4, 32, 16
    _, W = _weights(E, H, I, torch.float16, seed=0)
    x = torch.randn(T, H).to(DEVICE, torch.float16)
    tw, ids = _routing(T, E, 2, seed=0)
    bad = [
        (dict(hidden=torch.randn(T, H + 8).to(DEVICE, torch.float16)), "hidden"),
        (dict(hidden=x.float()), "weights"),
        (dict(topk_ids=ids.long()), "topk_ids"),
        (dict(topk_weights=tw[:, :1].contiguous()), "topk_weights"),
        (dict(topk_ids=torch.zeros(T, E + 1, dtype=torch.int32, device=DEVICE),
              topk_weights=torch.ones(T, E + 1, device=DEVICE)), "top_k"),
        (dict(topk_ids=torch.full_like(ids, E), check_ids=True), "topk_ids"),
        (dict(out=torch.empty(T, H, device=DEVICE)), "out"),
    ]
    for over, name in bad:
        args = {"hidden": x, "weights": W, "topk_weights": tw, "topk_ids": ids, **over}
        with pytest.raises(ValueError, match=name):
            launcher(args.pop("hidden"), args.pop("weights"), args.pop("topk_weights"), args.pop("topk_ids"),
                     **args)


def test_prepare_weights_rejects_mismatches():
    w13, w2 = torch.randn(4, 32, 64), torch.randn(4, 64, 16)
    q13, s13 = pack_int4(w13)
    q2, s2 = pack_int4(w2, group_size=8)
    for args, kw, name in [
        ((w13, torch.randn(4, 64, 8)), {}, "w2"),
        ((torch.randn(4, 31, 64), w2), {}, "w13"),
        ((q13, q2), {"w13_scales": s13}, "w2_scales"),
        ((q13[:, :, :4].contiguous(), q2), {"w13_scales": s13, "w2_scales": s2}, "w13"),
        ((q13, q2), {"w13_scales": s13, "w2_scales": s2}, "group size"),
    ]:
        with pytest.raises(ValueError, match=name):
            prepare_weights(*args, **kw)


@pytest.mark.parametrize(("T", "E", "k", "how"), [(5, 7, 3, "distinct"), (4, 9, 2, "few"), (6, 5, 2, "all-same")])
def test_expert_segments_match_the_unpadded_alignment(T, E, k, how):
    _, ids = _routing(T, E, k, seed=T, how=how)
    sorted_ids, seg_e, seg_start, seg_cnt, nseg = expert_segments(ids, E)
    want_sorted, _, _ = align_ref(ids.cpu(), E, 1)
    assert torch.equal(sorted_ids.cpu(), want_sorted)
    experts, counts = torch.unique(ids.cpu().long(), return_counts=True)
    n = int(nseg)
    assert n == experts.numel()
    assert seg_e[:n].tolist() == experts.tolist() and seg_cnt[:n].tolist() == counts.tolist()
    assert seg_start[:n].tolist() == [0, *counts.cumsum(0)[:-1].tolist()]


# --------------------------------------------------------------------------- tuning table


def test_tuning_table_round_trip_lookup_and_validation(tmp_path):
    path = str(tmp_path / "dev.json")
    tab = TuningTable.load(path, "dev")
    assert tab.lookup("fused", "w13+w2", "int4", 512, 7168, 4) == (default_config("fused", "w13+w2", "int4", 512,
                                                                                  7168, 4), "default")
    cfg = GemmConfig(block_n=32, block_k=64, split_k=4)
    tab.put(TuningEntry("few_token", "w13", "int4", 512, 7168, 8, cfg, 1e-5))
    tab.save()
    again = TuningTable.load(path)
    assert again.lookup("few_token", "w13", "int4", 512, 7168, 8) == (cfg, "tuned")
    assert again.lookup("few_token", "w13", "int4", 512, 7168, 32) == (cfg, "tuned at T=8")
    assert again.lookup("few_token", "w13", "bf16", 512, 7168, 8)[1] == "default"
    (tmp_path / "bad.json").write_text('{"schema": "other", "version": 1}')
    with pytest.raises(ValueError, match="bad.json"):
        TuningTable.load(str(tmp_path / "bad.json"))
    (tmp_path / "bad2.json").write_text('{"schema": "microbench.moe_tuning", "version": 1, "entries": [{"kernel": '
                                       '"fused", "gemm": "w13+w2", "weights": "int4", "n": 1, "k": 1, "tokens": 1, '
                                       '"config": {"block_n": 24, "block_k": 64}}]}')
    with pytest.raises(ValueError, match="entry 0.*block_n"):
        TuningTable.load(str(tmp_path / "bad2.json"))
    with pytest.raises(ValueError, match="block_k"):
        GemmConfig(block_n=32, block_k=8)


# --------------------------------------------------------------------------- GPU, bf16, Kimi-K2.5 TP8


@pytest.mark.gpu
@pytest.mark.parametrize("int4", [False, True], ids=["bf16", "int4"])
@pytest.mark.parametrize("T", [1, 4, 64])
def test_kimi_tp8_shapes_in_bf16(int4, T):
    from microbench.cases.moe_inputs import expert_weights, moe_shape, routing

    s = moe_shape("kimi-tp8")
    ck = expert_weights(s, "int4" if int4 else "bf16", torch.bfloat16, "cuda", 11)
    W = prepare_weights(ck["w13"], ck["w2"], w13_scales=ck.get("w13_scales"), w2_scales=ck.get("w2_scales"))
    x, tw, ids = routing(s, T, "distinct", torch.bfloat16, "cuda", T)
    want = fused_moe_ref(x, ck["w13"], ck["w2"], tw, ids, w13_scales=ck.get("w13_scales"),
                         w2_scales=ck.get("w2_scales"))
    for got in (fused_moe(x, W, tw, ids), few_token_moe(x, W, tw, ids)):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
