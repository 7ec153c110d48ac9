"""The decoder layer: kernels path against the torch reference layer at reduced shapes
(interpreter on CPU), routing both paths agree on, a wrong layer rejected, the case
through the runner, and the model's measured-layer comparison."""

from __future__ import annotations

import pytest
import torch

from microbench.case import Variant
from microbench.cases.layer import DecoderLayerCase
from microbench.cases.layer_inputs import MINI, layer_batch, layer_inputs, layer_shape, layer_weights
from microbench.gate import compare
from microbench.kernels.decoder_layer import decoder_layer, decoder_layer_ref, rope
from microbench.planning import RunOptions, plan
from microbench.runner import Runner
from microbench.timing import TimingOptions

from .helpers import DEVICE

DT = torch.bfloat16 if DEVICE == "cuda" else torch.float16
TOL = 8e-2 if DT == torch.bfloat16 else 3e-2


def _setup(batch, q_len, context, seed=3):
    w = layer_weights(MINI, "int4", DT, DEVICE, seed)
    b = layer_batch(MINI, batch, q_len, context, DT, DEVICE, seed + 1)
    x, res, chosen = layer_inputs(w, batch * q_len, DT, DEVICE, seed + 2)
    return w, b, x, res, chosen


@pytest.mark.parametrize(("attention", "moe", "batch", "q_len"), [
    ("decode", "fused", 2, 1), ("extend", "fused", 2, 4), ("verify", "few_token", 2, 4), ("verify", "fused", 1, 3),
])
def test_layer_matches_the_reference_layer(attention, moe, batch, q_len):
    w, b, x, res, _ = _setup(batch, q_len, context=33)
    want, want_res = decoder_layer_ref(x, res, w, b)
    r = res.clone()
    got, got_res = decoder_layer(x, r, w, b, attention=attention, moe=moe)
    assert got_res is r  # the residual stream is updated in place, as fused norms do
    for name, g, ref in (("out", got, want), ("residual", got_res, want_res)):
        rep = compare(g, ref, atol=TOL, rtol=TOL, name=name)
        assert rep.passed, str(rep)
    assert float(want.abs().mean()) > 0.05  # a real signal, not zeros


def test_both_paths_route_every_token_to_its_chosen_experts():
    from microbench.kernels.moe_reference import router_ref
    from microbench.kernels.moe_routing import route

    w, b, x, res, chosen = _setup(2, 4, context=17)
    h = (x.float() + res.float())
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)  # the steer in x dominates
    for hidden in (h, h.to(DT)):
        _, ids = router_ref(hidden, w.gate, w.gate_bias, top_k=MINI.top_k, n_group=1, topk_group=1,
                            routed_scaling_factor=MINI.scaling)
        assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in chosen.tolist()]
    _, ids = route(h.to(DT), w.gate, w.gate_bias, top_k=MINI.top_k, n_group=1, topk_group=1,
                   routed_scaling_factor=MINI.scaling)
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in chosen.tolist()]


def test_grouped_routing_inputs_use_topk_group_groups():
    s = layer_shape("dsv3-tp8")
    assert (s.experts, s.n_group, s.topk_group, s.hidden, s.heads) == (256, 8, 4, 7168, 16)
    k = layer_shape("kimi-tp8")
    assert (k.experts, k.moe_inter, k.shared_inter, k.heads, k.q_lora, k.n_group) == (384, 256, 256, 8, 1536, 1)


def test_rope_rotates_pairs_and_keeps_norms():
    x = torch.randn(5, 3, 64)
    pos = torch.arange(5)
    y = rope(x, pos)
    assert torch.allclose(y[0], x[0])  # position 0: no rotation
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert not torch.allclose(y[3], x[3])


FAST = TimingOptions(budget_s=0.05, max_noise=0.5)


def test_the_case_gates_both_variants_and_rejects_a_layer_without_its_shared_expert():
    class Broken(DecoderLayerCase):
        def variants(self):
            def no_shared(xs, residuals, weights, batches, phase, capture="eager", moe_config=None):
                import microbench.kernels.decoder_layer as dl

                outs = []
                for x, r, w, b in zip(xs, residuals, weights, batches):
                    zero = torch.zeros_like(w.shared_w2)
                    w2 = dl.LayerWeights(**{**w.__dict__, "shared_w2": zero})
                    outs.append(dl.decoder_layer(x, r, w2, b, attention="decode" if phase == "decode" else "extend",
                                                 moe="fused", moe_config=moe_config)[0])
                return torch.stack(outs)

            return [*super().variants(), Variant("no_shared", no_shared)]

    opts = RunOptions(suite="smoke", device=DEVICE, timing=FAST, probe=False,
                      axis_picks={"capture": ["eager"]} if DEVICE == "cuda" else {})
    recs = Runner(opts, None, progress=lambda line: None).run(plan([Broken()], opts))
    by = {(r["axes"]["phase"], r["variant"]): r for r in recs}
    for phase in ("decode", "verify"):
        assert by[(phase, "server")]["status"] == "OK" and by[(phase, "microbench")]["status"] == "OK"
        bad = by[(phase, "no_shared")]
        assert bad["status"] == "FAILED" and "elements off" in bad["reason"] and bad["timing"] is None
        ok = by[(phase, "server")]
        assert ok["facts"]["layers"] >= 1 and "per layer" in ok["derived"]
        assert "stand-in" in ok["facts"]["allreduce"]
        # the bytes a step reads: the routed experts its tokens chose, not every expert
        from microbench.cases.layer_inputs import layer_shape, layer_weights

        shape = layer_shape(ok["axes"]["layer"])
        touched = ok["facts"]["experts_touched"]
        assert shape.top_k <= touched < shape.experts
        assert set(ok["facts"]["moe_tiles"]) == {"fused", "few_token"}  # tuned, or the defaults, and which
        w = layer_weights(shape, ok["axes"]["weights"], torch.float16, "cpu", 0)
        assert w.nbytes(shape.experts) == w.nbytes() > w.nbytes(touched) > w.nbytes(0)
        with pytest.raises(ValueError, match="touched"):
            w.nbytes(shape.experts + 1)


@pytest.mark.gpu
def test_kimi_layer_on_the_gpu_eager_and_graph_with_launch_counts():
    opts = RunOptions(suite="smoke", device="cuda", timing=FAST, probe=False)
    recs = Runner(opts, None, progress=lambda line: None).run(plan([DecoderLayerCase()], opts))
    assert len(recs) == 2 * 2 * 2  # phase x capture x variant
    for r in recs:
        assert r["status"] == "OK", (r["axes"], r["variant"], r["reason"])
        prof = r["profile"]
        assert "launches" in prof, prof.get("profile_error")  # the profiler's own error, not a KeyError
        assert prof["launches"] >= 20 and prof["host_s"] > 0


def test_the_model_sets_a_measured_layer_beside_its_prediction():
    from microbench.budget import Scenario, budget
    from microbench.budget_table import render
    from microbench.hardware import load_profile
    from microbench.measured import Measured
    from microbench.layout import ParallelLayout
    from microbench.models import load_model

    def rec(capture, phase, median):
        return {"case": "layer.decoder", "variant": "server", "status": "OK", "facts": {"layers": 2},
                "axes": {"layer": "kimi-tp8", "weights": "int4", "phase": phase, "batch": 1, "draft_tokens": 3,
                         "context": 4096, "capture": capture, "dtype": "bf16"},
                "timing": {"samples_s": [median], "summary": {"median": median, "count": 1, "rel_noise": 0.0}}}

    # a layer measured in another dtype, or with other expert weights, is not the model's
    other = [{**rec("graph", "verify", 10e-6), "axes": {**rec("graph", "verify", 0)["axes"], **change}}
             for change in ({"dtype": "fp16"}, {"weights": "bf16"})]
    doc = {"schema": "microbench.result", "schema_version": 1, "run": {"id": "g", "device": "cuda"},
           "fingerprint": {"device": {"name": "NVIDIA H200"}},
           "records": [*other, rec("graph", "verify", 200e-6), rec("eager", "verify", 400e-6)]}
    s = Scenario(model=load_model("kimi-k2.5"), layout=ParallelLayout(8, 1), hw=load_profile("h200"))
    b = budget(s, Measured([doc]))
    assert b.measured_layer[("verify", "graph")].seconds == pytest.approx(100e-6)  # per layer of 2
    # the model compared is the layer as measured: one rank, two stand-in kernels (read +
    # write [T, 7168] bf16: 4 x 4 x 7168 x 2 B = 229 KB, under the kernel floor on an H200)
    # where the modelled allreduces are
    ar = next(x for x in b.moe_layer if x.name.startswith("allreduce")).seconds("verify", "graph")
    stand_ins = 2 * load_profile("h200").kernel_floor.value
    as_measured = b.totals["moe layer"][("verify", "graph")] - ar + stand_ins
    assert b.model_as_measured[("verify", "graph")] == pytest.approx(as_measured)
    assert b.model_error("verify", "graph") == pytest.approx(as_measured / 100e-6 - 1)
    assert b.model_error("decode", "graph") is None
    # eager: the stand-ins launch as many kernels as the allreduces, and the launch-bound
    # layer's exposed launches absorb the difference in GPU time
    launches = sum(x.launches["verify"] for x in b.moe_layer[:-1])
    assert b.model_as_measured[("verify", "eager")] == pytest.approx(
        max(b.totals["moe layer"][("verify", "eager")] - ar + stand_ins, launches * b.launch_cost.seconds))
    d = b.to_dict()["measured_layer"]["verify/graph"]  # --json carries the comparison too
    assert d["seconds"] == pytest.approx(100e-6) and d["model_error"] == pytest.approx(as_measured / 100e-6 - 1)
    text = render(b)
    assert "measured layer (layer.decoder, one rank)" in text and "model / measured - 1" in text
    assert "model of it (allreduces as its stand-ins)" in text
    # the layer's speed target, read off the graph-mode comparison (decode has no measurement)
    ratio = 100e-6 / as_measured
    (line,) = [ln for ln in text.splitlines() if ln.startswith("layer under graph replay")]
    assert line.startswith(f"layer under graph replay, verify: measured 100.0 us = {ratio:.2f}x the sum of its kernels")
    assert ("within the 1.2x target" if ratio <= 1.2 else "over the 1.2x target") in line
    b.measured_layer[("verify", "graph")] = type(b.measured_layer[("verify", "graph")])(1.3 * as_measured, "m")
    assert "= 1.30x the sum of its kernels" in render(b) and "over the 1.2x target" in render(b)


def test_grouped_routing_inputs_pick_two_experts_in_each_of_topk_group_groups():
    from microbench.kernels.decoder_layer import LayerShape
    from microbench.kernels.moe_reference import router_ref

    s = LayerShape(hidden=256, heads=2, q_lora=64, nope=16, v_head=16, experts=64, top_k=8, moe_inter=32,
                   shared_inter=32, n_group=8, topk_group=4, scaling=2.5)
    w = layer_weights(s, "bf16", torch.float32, "cpu", 11)
    x, res, chosen = layer_inputs(w, 6, torch.float32, "cpu", 12)
    for row in chosen.tolist():
        groups = [e // 8 for e in row]
        assert len(set(groups)) == 4 and all(groups.count(g) == 2 for g in set(groups))
    h = x + res
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    _, ids = router_ref(h, w.gate, w.gate_bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in chosen.tolist()]


def test_any_batch_or_context_on_the_command_line_and_a_bad_one(capsys):
    from microbench.cli import main

    c = DecoderLayerCase()
    assert c.parse_axis_value("batch", "8") == 8
    with pytest.raises(ValueError, match="at most 16"):
        c.parse_axis_value("draft_tokens", "16")
    assert main(["run", "--case", "layer.decoder", "--axis", "batch=0", "--device", "cpu"]) == 2
    assert "'0' is not a positive integer" in capsys.readouterr().err


def test_routing_holds_over_the_timing_loops_repeated_calls():
    """The layer adds x and the attention output to the residual in place at every call,
    and a timing loop calls it thousands of times on the same inputs: the routing the case
    reports (its experts_touched, its bytes) must be the routing of every timed call, not
    of the first alone. The reference's residual is carried from call to call as the
    kernels' is; the router reads the post-attention residual's norm."""
    from microbench.kernels.moe_reference import router_ref
    from microbench.kernels.reference import rmsnorm_ref

    w = layer_weights(MINI, "int4", torch.float32, "cpu", 5)
    b = layer_batch(MINI, 2, 4, 17, torch.float32, "cpu", 6)
    x, res, chosen = layer_inputs(w, 8, torch.float32, "cpu", 7)
    want = [sorted(r) for r in chosen.tolist()]
    for call in range(1, 41):
        _, res = decoder_layer_ref(x, res, w, b)
        if call in (1, 2, 5, 10, 20, 40):
            h2 = rmsnorm_ref(res, w.post_norm, MINI.eps)[0]
            _, ids = router_ref(h2, w.gate, w.gate_bias, top_k=MINI.top_k, n_group=1, topk_group=1,
                                routed_scaling_factor=MINI.scaling)
            assert [sorted(r) for r in ids.tolist()] == want, f"call {call}"


def test_the_layer_count_is_decided_once_per_point_so_every_variant_times_the_same_work(monkeypatch):
    """The second variant's set-up runs while the first one's layers are held: reading free
    memory again would stack fewer layers, and its verdict would compare different work."""
    from microbench.cases import layer as layer_mod

    case = DecoderLayerCase()
    free = [30e9]
    monkeypatch.setattr(layer_mod, "on_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80e9))
    point = {"layer": "kimi-tp8", "phase": "verify", "capture": "eager"}
    assert case._layers(point, int(2.4e9), "cuda") == 3  # 0.3 x 30 GB / 2.4 GB
    free[0] = 10e9  # the first variant's layers now take memory
    assert case._layers(point, int(2.4e9), "cuda") == 3
    # the graph row of the point stacks what its eager row did: their difference is per layer
    assert case._layers({**point, "capture": "graph"}, int(2.4e9), "cuda") == 3
    assert case._layers({**point, "phase": "decode"}, int(2.4e9), "cuda") == 1  # a new point reads it afresh
    assert DecoderLayerCase()._layers(point, int(2.4e9), "cuda") == 1  # so does a new run's case


def test_rope_rotates_each_pair_by_its_position_times_its_frequency():
    """Rotate-half layout: channel i pairs with i + 32 as one complex number, turned by
    position x theta^(-i / 32), DeepSeek-V3's frequencies."""
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 9])
    freq = 10000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)
    turn = torch.polar(torch.ones(3, 32, dtype=torch.float64), pos[:, None] * freq)[:, None, :]
    z = torch.complex(x[..., :32].double(), x[..., 32:].double()) * turn
    torch.testing.assert_close(rope(x, pos), torch.cat([z.real, z.imag], dim=-1).float(), atol=1e-5, rtol=1e-5)


def test_the_layer_sums_its_attention_output_before_the_post_norm_and_its_output_last():
    """A stand-in allreduce that doubles its tensor (two ranks holding the same partial
    sum): the residual takes the summed attention output, the output is the summed MoE."""
    w, b, x, res, _ = _setup(1, 1, context=9)
    seen = []

    def doubling(t):
        seen.append(t.clone())
        t.mul_(2)

    r = res.clone()
    y, r = decoder_layer(x, r, w, b, attention="decode", moe="fused", allreduce=doubling)
    o, partial = seen
    assert o.shape == partial.shape == y.shape == x.shape
    want_res = ((x.float() + res.float()).to(DT).float() + 2 * o.float()).to(DT)
    torch.testing.assert_close(r, want_res, atol=1e-2, rtol=1e-3)
    assert torch.equal(y, 2 * partial)


def test_the_layer_writes_its_new_latents_to_their_cache_slots_alone():
    from microbench.kernels.mla_common import KV_LORA_RANK
    from microbench.kernels.reference import rmsnorm_ref

    w, b, x, res, _ = _setup(2, 2, context=5)
    before = b.kv_cache.clone().view(-1, b.kv_cache.shape[-1])
    decoder_layer(x, res.clone(), w, b, attention="extend", moe="fused")
    after = b.kv_cache.view(-1, b.kv_cache.shape[-1])
    others = torch.ones(after.shape[0], dtype=torch.bool, device=after.device)
    others[b.slots] = False
    assert torch.equal(after[others], before[others])
    h = rmsnorm_ref(x, w.input_norm, MINI.eps, res)[0]
    qkv = h @ w.qkv_a.float()
    c_kv = rmsnorm_ref(qkv[:, MINI.q_lora: MINI.q_lora + KV_LORA_RANK], w.kv_a_norm, MINI.eps)[0]
    k_pe = rope(qkv[:, MINI.q_lora + KV_LORA_RANK:], b.positions)
    rep = compare(after[b.slots], torch.cat([c_kv, k_pe], dim=-1), atol=TOL, rtol=TOL, name="cache")
    assert rep.passed, str(rep)


def test_each_variant_runs_its_kernels_and_decode_the_decode_kernel(monkeypatch):
    from microbench.cases import layer as layer_mod

    seen = []

    def layer(x, r, w, b, *, attention, moe, moe_config=None):
        seen.append((attention, moe, moe_config))
        return x + 1, r

    monkeypatch.setattr(layer_mod, "_layer_fn", lambda capture: layer)
    fns = {v.name: v.fn for v in DecoderLayerCase().variants()}
    xs = [torch.zeros(2, 3), torch.ones(2, 3)]
    for name in ("server", "microbench"):
        for phase in ("decode", "verify"):
            out = fns[name](xs, [None, None], [None, None], [None, None], phase, moe_config={"fused": 1})
            assert torch.equal(out, torch.stack(xs) + 1)
    assert [s[:2] for s in seen[::2]] == [("decode", "fused"), ("extend", "fused"), ("decode", "few_token"),
                                          ("verify", "few_token")]
    assert all(s[2] == {"fused": 1} for s in seen)


VERIFY_POINT = {"layer": "mini", "weights": "int4", "phase": "verify", "batch": 2, "draft_tokens": 2, "context": 5,
                "capture": "eager", "dtype": "fp32"}


def test_the_case_counts_the_tokens_and_bytes_of_a_verify_step():
    w = DecoderLayerCase().setup(VERIFY_POINT, "cpu", seed=1)
    t = 2 * (2 + 1)  # batch x (draft tokens + 1)
    assert w.facts["tokens"] == t and w.facts["layers"] == 1 and w.inputs["xs"][0].shape == (t, MINI.hidden)
    (lw,), (b,) = w.inputs["weights"], w.inputs["batches"]
    assert b.kv_cache.shape[0] == 2 * 5 + t
    # the weights a step reads (the routed experts its tokens touched) and the latent cache
    assert w.cost.bytes == lw.nbytes(w.facts["experts_touched"]) + b.kv_cache.numel() * b.kv_cache.element_size()


def test_each_stacked_layer_has_its_own_weights_and_cache_and_its_own_reference(monkeypatch):
    case = DecoderLayerCase()
    monkeypatch.setattr(case, "_layers", lambda point, held, device: 2)  # as on a GPU with room for two
    w = case.setup(VERIFY_POINT, "cpu", seed=1)
    weights, batches = w.inputs["weights"], w.inputs["batches"]
    assert len(weights) == len(batches) == len(w.inputs["xs"]) == 2
    assert not torch.equal(weights[0].qkv_a, weights[1].qkv_a)
    assert not torch.equal(batches[0].kv_cache, batches[1].kv_cache)
    out = case.reference(w)["out"]
    for i in range(2):
        want = decoder_layer_ref(w.inputs["xs"][i], w.inputs["residuals"][i], weights[i], batches[i])[0]
        torch.testing.assert_close(out[i], want)


def test_per_layer_times_and_the_launch_cost_are_derived_per_layer():
    from microbench.report import fmt_time

    def rec(capture, median):
        return {"status": "OK", "variant": "server", "facts": {"layers": 2},
                "axes": {"phase": "verify", "capture": capture}, "timing": {"summary": {"median": median}},
                "profile": {"launches": 60, "host_s": median / 2}}

    eager, graph = rec("eager", 6e-4), rec("graph", 2e-4)
    DecoderLayerCase().derive([eager, graph])
    assert eager["derived"] == {"per layer": fmt_time(3e-4), "launches/layer": "30", "host/layer": fmt_time(1.5e-4),
                                "eager - graph per layer": fmt_time(2e-4)}
    assert graph["derived"] == {"per layer": fmt_time(1e-4), "launches/layer": "30"}  # a replay has no host cost


def test_a_batch_puts_each_requests_new_tokens_after_its_context_in_fresh_pages():
    import math

    b = layer_batch(MINI, 2, 3, 5, torch.float32, "cpu", 0)
    assert b.positions.tolist() == [5, 6, 7, 5, 6, 7]
    assert b.slots.tolist() == list(range(10, 16)) and b.kv_cache.shape[:2] == (16, 1)
    pages = b.plan.kv_indices.tolist()
    assert sorted(pages) == list(range(10)) and pages != list(range(10))  # the prefix pages, shuffled
    assert b.plan.sm_scale == pytest.approx(2.0 / math.sqrt(MINI.q_head))  # YaRN-sharpened, as in Kimi-K2.5
    assert float(b.kv_cache.std()) > 0.5


def test_model_layers_take_head_sizes_and_eps_from_the_config():
    k, d = layer_shape("kimi-tp8"), layer_shape("dsv3-tp8")
    assert (k.nope, k.v_head, k.q_head, k.top_k, k.eps) == (128, 128, 192, 8, 1e-5)
    assert (d.nope, d.v_head, d.top_k, d.scaling, d.eps) == (128, 128, 8, 2.5, 1e-6)


def test_the_layer_holds_every_weight_it_reads_and_draws_none_degenerate():
    import dataclasses

    w = layer_weights(MINI, "int4", torch.float32, "cpu", 0)
    dense = [getattr(w, f.name) for f in dataclasses.fields(w) if isinstance(getattr(w, f.name), torch.Tensor)]
    experts = [t for t in (w.experts.w13, w.experts.w2, w.experts.s13, w.experts.s2) if t is not None]
    assert len(dense) == 13 and w.nbytes() == sum(t.numel() * t.element_size() for t in dense + experts)
    for norm in (w.input_norm, w.q_a_norm, w.kv_a_norm, w.post_norm):  # not ones: a norm's weight must show
        assert 0.05 < float(norm.std()) < 0.2 and abs(float(norm.mean()) - 1) < 0.05
    x, res, _ = layer_inputs(w, 4, torch.float32, "cpu", 1)
    assert 0.8 < float(res.std()) < 1.2 and float((x - res).abs().min()) > 0  # a residual of its own
