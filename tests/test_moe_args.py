"""The MoE launchers' and ``prepare_weights``' argument checks: bad input to either kernel
is a ``ValueError`` naming the argument, raised before anything is launched; the INT4
layout ``prepare_weights`` hands the kernels."""

from __future__ import annotations

import pytest
import torch

from microbench.kernels import moe_few_token, moe_fused
from microbench.kernels.moe_common import ExpertWeights, prepare_weights
from microbench.kernels.moe_few_token import few_token_moe
from microbench.kernels.moe_fused import fused_moe
from microbench.kernels.moe_reference import check_int4_weight, pack_int4

from .moe_helpers import DEVICE, dense_weights, hidden_states, moe_checkpoint, routing


def _bad_call_cases():
    T, E, H, k = 3, 4, 64, 2
    x = hidden_states(T, H, seed=0)
    tw, ids = routing("distinct", T, E, k, seed=0)
    cases = [
        ("hidden-H", dict(hidden=hidden_states(T, H - 16, seed=0)), r"^hidden: "),
        ("hidden-3d", dict(hidden=x.view(1, T, H)), r"^hidden: "),
        ("hidden-strided", dict(hidden=x.t().contiguous().t()), r"^hidden: must be contiguous"),
        ("ids-strided", dict(topk_ids=ids.t().contiguous().t()), r"^topk_ids: must be contiguous"),
        ("dtype-mismatch", dict(hidden=x.float()), r"^weights: dense dtype"),
        ("ids-int64", dict(topk_ids=ids.long()), r"^topk_ids: "),
        ("ids-rows", dict(topk_ids=ids[:2].contiguous()), r"^topk_ids: "),
        ("weights-shape", dict(topk_weights=tw[:, :1].contiguous()), r"^topk_weights: "),
        ("weights-fp16", dict(topk_weights=tw.half()), r"^topk_weights: "),
        ("topk0", dict(topk_ids=torch.zeros(T, 0, dtype=torch.int32, device=DEVICE),
                       topk_weights=torch.ones(T, 0, device=DEVICE)), r"^topk_ids: top_k = 0 must be at least 1$"),
        ("id-too-large", dict(topk_ids=torch.where(ids == ids[1, 0], E, ids), check_ids=True),
         r"^topk_ids: expert ids must lie in 0\.\.3"),
        ("id-negative", dict(topk_ids=torch.full_like(ids, -2), check_ids=True), r"^topk_ids: expert ids"),
        ("out-dtype", dict(out=torch.empty(T, H, device=DEVICE)), r"^out: "),
        ("out-shape", dict(out=torch.empty(T + 1, H, dtype=torch.float16, device=DEVICE)), r"^out: "),
    ]
    # every case against dense and INT4 weights, except the dense-dtype rule (INT4 weights
    # take any activation dtype)
    return [pytest.param({"hidden": x, "topk_weights": tw, "topk_ids": ids, **over}, pat, kind, id=f"{name}-{kind}")
            for name, over, pat in cases for kind in ("dense", "int4")
            if not (kind == "int4" and name == "dtype-mismatch")]


@pytest.mark.parametrize("kernel", ["fused", "few_token"])
@pytest.mark.parametrize(("args", "pattern", "kind"), _bad_call_cases())
def test_launchers_reject_bad_input(args, pattern, kind, kernel, monkeypatch):
    _, W = moe_checkpoint(kind, 4, 64, 32, seed=0)

    def no_launch(*_a, **_k):
        raise AssertionError("launched before validating")

    monkeypatch.setattr(moe_fused, "align", no_launch)
    monkeypatch.setattr(moe_few_token, "expert_segments", no_launch)
    args = dict(args)
    x, tw, ids = args.pop("hidden"), args.pop("topk_weights"), args.pop("topk_ids")
    launcher = fused_moe if kernel == "fused" else few_token_moe
    with pytest.raises(ValueError, match=pattern):
        launcher(x, W, tw, ids, **args)


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_the_fused_launcher_refuses_a_remote_id_it_was_not_told_of(kind, monkeypatch):
    # a -1 pair is dropped by the alignment; without remote_ids its row of the sum is never
    # written, so with check_ids the call is refused (the few-token kernel skips them itself)
    _, W = moe_checkpoint(kind, 4, 64, 32, seed=0)
    x = hidden_states(3, 64, seed=0)
    tw, ids = routing("distinct", 3, 4, 2, seed=0)
    ids = ids.clone()
    ids[1, 0] = -1
    monkeypatch.setattr(moe_fused, "align", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))
    with pytest.raises(ValueError, match=r"^topk_ids: -1 \(another rank's expert\) needs remote_ids=True"):
        fused_moe(x, W, tw, ids, check_ids=True)


def test_launchers_reject_a_non_weights_object():
    x = hidden_states(2, 64, seed=0)
    tw, ids = routing("distinct", 2, 4, 2, seed=0)
    for launcher in (fused_moe, few_token_moe):
        with pytest.raises(TypeError, match="weights"):
            launcher(x, {"w13": None}, tw, ids)


def _bad_prepare_cases():
    E, H, I = 4, 64, 32
    w13, w2 = dense_weights(E, H, I, seed=1)
    w13, w2 = w13.half(), w2.half()
    (q13, s13), (q2, s2) = pack_int4(w13.float()), pack_int4(w2.float())
    q2_g16, s2_g16 = pack_int4(w2.float(), group_size=16)
    cases = [
        ("w2-I", (w13, w2[:, :, :16].contiguous()), {}, r"^w2: shape"),
        ("w2-H", (w13, w2[:, :32].contiguous()), {}, r"^w2: shape"),
        ("w2-experts", (w13, w2[:3].contiguous()), {}, r"^w2: 3 experts"),
        ("w2-dtype", (w13, w2.float()), {}, r"^w2: dtype"),
        ("w13-odd-rows", (w13[:, :63].contiguous(), w2), {}, r"^w13: 63 output rows"),
        ("w13-2d", (w13[0], w2), {}, r"^w13: "),
        ("w13-int-dense", (w13.to(torch.int16), w2), {}, r"^w13: dtype"),
        ("only-w13-scales", (q13, q2), dict(w13_scales=s13), r"^w13_scales / w2_scales"),
        ("only-w2-scales", (q13, q2), dict(w2_scales=s2), r"^w13_scales / w2_scales"),
        ("int4-w13-scales", (q13, q2), dict(w13_scales=s13[:, :32].contiguous(), w2_scales=s2), r"^w13_scales: "),
        ("int4-w2-packed-K", (q13, q2[:, :, :2].contiguous()), dict(w13_scales=s13, w2_scales=s2),
         r"^w2: packed shape"),  # 2 words per row hold K = 16, but w13 says I = 32
        ("int4-w2-H", (q13, q2[:, :56].contiguous()), dict(w13_scales=s13, w2_scales=s2[:, :56].contiguous()),
         r"^w2: expected \[4, 64, I/8\]"),
        ("int4-w13-float", (w13, q2), dict(w13_scales=s13, w2_scales=s2), r"^w13: packed INT4"),
        ("group-mismatch", (q13, q2_g16), dict(w13_scales=s13, w2_scales=s2_g16), r"^w2_scales: group size 16"),
        # another device than the words' (a CPU-only stand-in for a GPU / CPU mix)
        ("scales-device", (q13, q2), dict(w13_scales=s13, w2_scales=s2.to("meta")), r"^w2_scales: on meta"),
    ]
    return [pytest.param(a, kw, pat, id=name) for name, a, kw, pat in cases]


@pytest.mark.parametrize(("args", "kwargs", "pattern"), _bad_prepare_cases())
def test_prepare_weights_rejects(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        prepare_weights(*args, **kwargs)


def test_int4_scales_that_are_not_a_tensor_are_named():
    w13, w2 = dense_weights(4, 64, 32, seed=1)
    (q13, s13), (q2, s2) = pack_int4(w13.float()), pack_int4(w2.float())
    with pytest.raises(TypeError, match=r"^w13_scales: expected a torch.Tensor, got list"):
        prepare_weights(q13, q2, w13_scales=s13.tolist(), w2_scales=s2)
    with pytest.raises(TypeError, match=r"^w2_scales: expected a torch.Tensor, got list"):
        check_int4_weight("w2", q2, s2.tolist())


def test_prepare_weights_layout():
    """Dense weights pass through; INT4 words and scales are transposed, bits unchanged."""
    E, H, I = 3, 64, 32
    w13, w2 = dense_weights(E, H, I, seed=2)
    W = prepare_weights(w13.half(), w2.half())
    assert isinstance(W, ExpertWeights) and W.kind == "bf16" and not W.int4
    assert (W.num_experts, W.hidden, W.inter) == (E, H, I)
    (q13, s13), (q2, s2) = pack_int4(w13, 16), pack_int4(w2, 16)
    W4 = prepare_weights(q13, q2, w13_scales=s13, w2_scales=s2)
    assert W4.int4 and (W4.num_experts, W4.hidden, W4.inter, W4.group_size) == (E, H, I, 16)
    assert torch.equal(W4.w13, q13.transpose(1, 2)) and torch.equal(W4.w2, q2.transpose(1, 2))
    assert torch.equal(W4.s13, s13.transpose(1, 2)) and torch.equal(W4.s2, s2.transpose(1, 2))
    assert W4.w13.is_contiguous() and W4.s2.is_contiguous()
