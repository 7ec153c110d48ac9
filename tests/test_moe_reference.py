"""The MoE references: the INT4 layout (``pack_int4`` / ``unpack_int4`` against words built
by hand from known nibbles, ``word = sum((q_j + 8) << 4j)`` with the top nibble in the
int32 sign bit, and against each other; ``check_int4_weight`` naming the argument), and
``fused_moe_ref`` against a per-token, per-choice loop in float64, its INT4 path against
its dense path on the unpacked weights. Inputs are seeded."""

from __future__ import annotations


import pytest
import torch

from microbench.kernels.moe_reference import check_int4_weight, fused_moe_ref, pack_int4, unpack_int4

from .moe_helpers import dense_weights, routing


# --------------------------------------------------------------------------------------
# INT4 layout
# --------------------------------------------------------------------------------------


def _word(nibbles: list[int]) -> int:
    """An int32 word (as a signed Python int) holding q_j + 8 at bits 4j."""
    w = sum((q + 8) << (4 * j) for j, q in enumerate(nibbles))
    return w - 2**32 if w >= 2**31 else w


def test_unpack_int4_reads_hand_built_nibbles():
    # Two rows of K = 32 inputs (4 words), group 16 (two scales per row), every nibble
    # value -8..7 present.
    q = torch.tensor([
        [-8, -1, 0, 1, 7, 3, -5, 6, 2, -2, 4, -4, 5, -6, -3, 7,
         -7, 0, 0, 0, 1, 1, 1, 7, 3, 2, 1, 0, -1, -2, -3, -8],
        [7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8,
         0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1],
    ])
    scales = torch.tensor([[0.5, 2.0], [0.125, 4.0]])  # powers of two: exact in bf16 and fp16
    words = torch.tensor([[_word(q[r, 8 * i:8 * i + 8].tolist()) for i in range(4)] for r in range(2)],
                         dtype=torch.int32).view(1, 2, 4)
    # the top nibble of word 0 of row 0 is 6 + 8 = 14: bit 31 set, a negative int32; that
    # of word 1 of row 1 is -8 + 8 = 0: a positive one
    assert int(words[0, 0, 0]) < 0 and int(words[0, 1, 1]) >= 0
    got = unpack_int4(words, scales.view(1, 2, 2))
    assert got.shape == (1, 2, 32) and got.dtype == torch.float32
    for r in range(2):
        for i in range(4):
            for j in range(8):
                k = 8 * i + j
                assert float(got[0, r, k]) == q[r, k].item() * float(scales[r, k // 16]), (r, k)
    # Packing writes the same layout. Its scale maps a group's largest magnitude to 7.5, as
    # compressed-tensors does: every group above holds a -8, so weights of q x scale with
    # each -8 at -7.5 x scale give back that scale, and -7.5 rounds (half to even) to -8.
    dense = (torch.where(q == -8, -7.5, q.float()) * scales.repeat_interleave(16, dim=1)).view(1, 2, 32)
    pq, ps = pack_int4(dense, group_size=16)
    assert torch.equal(pq, words)
    assert torch.equal(ps.float(), scales.view(1, 2, 2))


@pytest.mark.parametrize("group_size", [8, 32, 64])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_pack_unpack_round_trip(group_size, scale_dtype):
    w = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(group_size)) * 0.3
    q, s = pack_int4(w, group_size, scale_dtype)
    assert q.dtype == torch.int32 and q.shape == (3, 5, 16)
    assert s.dtype == scale_dtype and s.shape == (3, 5, 128 // group_size)
    d = unpack_int4(q, s)
    scale = s.float().repeat_interleave(group_size, dim=-1)
    # round to nearest: half a step off at most; a group's largest positive weight, at 7.5
    # steps (a little over, the scale being rounded to its dtype), is clipped to 7
    assert ((d - w).abs() <= scale * (0.5 + 7.5 * 2**-8)).all()
    # every nibble value is used, -8 (nibble 0) included, so a wrong shift or mask cannot hide
    nib = torch.stack([(q >> (4 * j)) & 0xF for j in range(8)]).unique()
    assert nib.numel() == 16


def _qs(e=2, n=4, kw=8, groups=2, qdtype=torch.int32, sdtype=torch.float16, sn=None):
    return torch.zeros(e, n, kw, dtype=qdtype), torch.ones(e, sn if sn is not None else n, groups, dtype=sdtype)


@pytest.mark.parametrize(("q_s", "k", "pattern"), [
    pytest.param(_qs(qdtype=torch.int64), None, r"^w13: packed INT4 expects", id="wrong-dtype"),
    pytest.param((torch.zeros(4, 8, dtype=torch.int32), torch.ones(2, 4, 2)), None, r"^w13: ", id="2-D"),
    pytest.param(_qs(), 32, r"^w13: packed shape", id="wrong-packed-K"),
    pytest.param(_qs(sn=5), None, r"^w13_scales: ", id="scales-shape"),
    pytest.param(_qs(sdtype=torch.int32), None, r"^w13_scales: ", id="int-scales"),
    pytest.param(_qs(groups=3), None, r"^w13_scales: 3 groups", id="group-not-dividing-K"),
    pytest.param(_qs(groups=16), None, r"^w13_scales: 16 groups", id="group-not-multiple-of-8"),
])
def test_check_int4_weight_names_the_argument(q_s, k, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_int4_weight("w13", *q_s, k=k)


def test_check_int4_weight_returns_group_size():
    assert check_int4_weight("w", *_qs(kw=8, groups=2), k=64) == 32
    assert check_int4_weight("w", *_qs(kw=8, groups=8)) == 8


# --------------------------------------------------------------------------------------
# fused_moe_ref
# --------------------------------------------------------------------------------------


def _moe_loop(x, w13, w2, tw, ids) -> torch.Tensor:
    """The reference's semantics written out per token and choice, in float64."""
    T, k = ids.shape
    I = w13.shape[1] // 2
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e < 0:
                continue
            gu = w13[e].double() @ x[t].double()
            g, u = gu[:I], gu[I:]
            act = g / (1 + torch.exp(-g)) * u
            out[t] += float(tw[t, j]) * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize(("T", "E", "k", "pattern"), [
    pytest.param(5, 6, 3, "distinct", id="distinct"),
    pytest.param(4, 8, 2, "sparse", id="empty-experts"),
    pytest.param(3, 5, 2, "all-same", id="duplicate-choices"),
    pytest.param(2, 4, 4, "distinct", id="topk-equals-E"),
])
def test_fused_moe_ref_matches_float64_loop(T, E, k, pattern):
    H, I = 24, 16
    w13, w2 = dense_weights(E, H, I, seed=T * 10 + E)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(E))
    tw, ids = routing(pattern, T, E, k, seed=T)
    tw, ids = tw.cpu(), ids.cpu()
    got = fused_moe_ref(x, w13, w2, tw, ids)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    want = _moe_loop(x, w13, w2, tw, ids)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_fused_moe_ref_other_ranks_ids_add_nothing():
    T, E, H, I, k = 4, 6, 24, 16, 3
    w13, w2 = dense_weights(E, H, I, seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    tw, ids = routing("distinct", T, E, k, seed=5)
    ids = ids.cpu().clone()
    ids[0, 1] = ids[2, 0] = -1
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, tw.cpu(), ids).double(),
                               _moe_loop(x, w13, w2, tw.cpu(), ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_size", [16, 32])
def test_fused_moe_ref_int4_equals_dense_on_unpacked(group_size):
    T, E, H, I, k = 6, 5, 64, 32, 2
    w13, w2 = dense_weights(E, H, I, seed=8)
    (q13, s13), (q2, s2) = pack_int4(w13, group_size), pack_int4(w2, group_size)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(9))
    tw, ids = routing("sparse", T, E, k, seed=10)
    tw, ids = tw.cpu(), ids.cpu()
    packed = fused_moe_ref(x, q13, q2, tw, ids, w13_scales=s13, w2_scales=s2)
    dense = fused_moe_ref(x, unpack_int4(q13, s13), unpack_int4(q2, s2), tw, ids)
    torch.testing.assert_close(packed, dense, rtol=1e-6, atol=1e-6)
    # and the dequantised layer is the loop's layer on the dequantised weights
    torch.testing.assert_close(packed.double(), _moe_loop(x, unpack_int4(q13, s13), unpack_int4(q2, s2), tw, ids),
                               rtol=1e-5, atol=1e-5)
