"""MoE routing and alignment, bad inputs: a ValueError naming the argument, before any
launch (the router's gate GEMM included)."""

from __future__ import annotations

import pytest
import torch

from microbench.kernels import moe_routing
from microbench.kernels.moe_reference import router_ref
from microbench.kernels.moe_routing import align, route

from .moe_helpers import DEVICE, router_inputs as _router_inputs


def _bad_route_cases():
    h, gw, b = _router_inputs(3, 37, 32, torch.float32, seed=5, with_bias=True)
    base = dict(hidden=h, gate_weight=gw, correction_bias=b, top_k=4, n_group=8, topk_group=4,
                routed_scaling_factor=2.5)
    cases = {
        "top_k": dict(top_k=33),
        "n_group": dict(n_group=5),
        "topk_group": dict(topk_group=9),
        "top_k ": dict(topk_group=1, top_k=5),  # 5 > 1 group x 4 experts
        "gate_weight": dict(gate_weight=gw[:, :36].contiguous()),
        "gate_weight ": dict(gate_weight=gw.half()),
        "gate_weight  ": dict(gate_weight=torch.randn(513, 37, device=DEVICE)),
        "correction_bias": dict(correction_bias=b[:31].contiguous()),
        "correction_bias ": dict(correction_bias=b.half()),
        "hidden": dict(hidden=h[0]),
        "hidden ": dict(hidden=h.to(torch.int32)),
        "routed_scaling_factor": dict(routed_scaling_factor=float("nan")),
    }
    return [pytest.param({**base, **over}, name.strip(), id=name.strip() + str(i))
            for i, (name, over) in enumerate(cases.items())]


@pytest.mark.parametrize(("kwargs", "arg"), _bad_route_cases())
def test_route_rejects(kwargs, arg, monkeypatch):
    def no_gemm(*_a, **_k):
        raise AssertionError("launched before validating")

    monkeypatch.setattr(moe_routing, "_gate_logits", no_gemm)
    with pytest.raises(ValueError, match=arg):
        route(**kwargs)


@pytest.mark.parametrize(("over", "arg"), [
    (dict(top_k=33), "top_k"), (dict(n_group=5), "n_group"), (dict(topk_group=9), "topk_group"),
    (dict(topk_group=1, top_k=5), "top_k"),
])
def test_router_ref_rejects(over, arg):
    h, gw, b = _router_inputs(3, 37, 32, torch.float32, seed=5, with_bias=True)
    kw = dict(top_k=4, n_group=8, topk_group=4, routed_scaling_factor=2.5) | over
    with pytest.raises(ValueError, match=arg):
        router_ref(h, gw, b, **kw)


@pytest.mark.parametrize(("ids", "E", "bs", "arg"), [
    (torch.zeros(3, 2, dtype=torch.int64) + 1, 8, 16, "topk_ids"),
    (torch.ones(6, dtype=torch.int32), 8, 16, "topk_ids"),
    (torch.ones(3, 2, dtype=torch.int32), 0, 16, "num_experts"),
    (torch.ones(3, 2, dtype=torch.int32), 513, 16, "num_experts"),
    (torch.ones(3, 2, dtype=torch.int32), 8, 0, "block_size"),
])
def test_align_rejects(ids, E, bs, arg):
    with pytest.raises(ValueError, match=arg):
        align(ids.to(DEVICE), E, bs)
