"""The MoE cases: shapes from the model files, routings, the gated smoke run, tuning.

Shapes are checked against the per-rank sizes the issue states (Kimi-K2.5 TP8 w13
[384, 512, 7168], w2 [384, 7168, 256]; EP8 [48, 4096, 7168] / [48, 7168, 2048]); the smoke
points run through the real runner (gate, then timer) under the interpreter on CPU; the
tuner is driven through the command line on the scaled-down layout.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from microbench import cli
from microbench.cases import moe as moe_cases
from microbench.cases.moe_inputs import moe_shape, routing
from microbench.planning import RunOptions, plan
from microbench.runner import Runner
from microbench.timing import TimingOptions

from .helpers import DEVICE

FAST = TimingOptions(budget_s=0.05, max_noise=0.05)


@pytest.mark.parametrize(("layout", "experts", "global_experts", "hidden", "inter"), [
    ("kimi-tp8", 384, 384, 7168, 256),
    ("kimi-ep8", 48, 384, 7168, 2048),
    ("dsv3-tp8", 256, 256, 7168, 256),
])
def test_layouts_come_from_the_model_files(layout, experts, global_experts, hidden, inter):
    s = moe_shape(layout)
    assert (s.experts, s.global_experts, s.hidden, s.inter, s.top_k) == (experts, global_experts, hidden, inter, 8)
    with pytest.raises(ValueError, match="layout"):
        moe_shape("kimi-tp16")


def test_distinct_routing_touches_every_choice_once_and_router_routing_respects_ep():
    s = moe_shape("mini")  # 16 experts, top-8
    _, w, ids = routing(s, 2, "distinct", torch.float32, "cpu", 0)
    assert ids.unique().numel() == 16 and ids.dtype == torch.int32  # 2 x 8 = all 16, none twice
    _, w, ids = routing(s, 5, "distinct", torch.float32, "cpu", 1)
    assert all(row.unique().numel() == 8 for row in ids)  # wraps round, rows stay distinct
    assert torch.allclose(w.sum(dim=1), torch.full((5,), s.scaling))
    ep = moe_shape("kimi-ep8")
    small = type(ep)(**{**ep.__dict__, "hidden": 64})  # the EP mapping, at a CPU-sized hidden
    _, _, ids = routing(small, 6, "router", torch.float32, "cpu", 2)
    assert int(ids.min()) >= -1 and int(ids.max()) < 48 and (ids == -1).any()
    with pytest.raises(ValueError, match="routing"):
        routing(s, 2, "uniform", torch.float32, "cpu", 0)


def test_int4_expert_weights_use_every_nibble_and_varied_group_scales():
    """The drawn INT4 checkpoint is not degenerate: every nibble position (the sign bit's
    too) holds all 16 values, one positive scale per 32 inputs that differs between groups,
    and the dequantised weights give unit-variance GEMM outputs."""
    from microbench.cases.moe_inputs import expert_weights
    from microbench.kernels.moe_reference import unpack_int4

    s = moe_shape("mini")  # 16 experts, H = 128, I = 32
    ck = expert_weights(s, "int4", torch.float16, "cpu", 5)
    for name, n, k in (("w13", 2 * s.inter, s.hidden), ("w2", s.hidden, s.inter)):
        q, sc = ck[name], ck[f"{name}_scales"]
        assert q.shape == (16, n, k // 8) and sc.shape == (16, n, k // 32) and sc.dtype == torch.float16
        for j in range(8):
            assert ((q >> (4 * j)) & 0xF).unique().numel() == 16, (name, j)
        assert (sc > 0).all() and float(sc.float().std() / sc.float().mean()) > 0.1
        assert 0.8 < float(unpack_int4(q, sc).std()) * k ** 0.5 < 1.25


def test_the_weight_kinds_and_dtypes_of_a_point_route_alike():
    # the inputs' seed leaves out the weights and the dtype: an INT4 row and a bf16 row of
    # one layout and token count time the same routing (under EP, the same local pairs)
    case = moe_cases.MoEExpertsCase()
    point = {"layout": "kimi-ep8", "weights": "int4", "tokens": 8, "routing": "router", "dtype": "bf16"}
    seeds = {case.input_seed(0, {**point, "weights": w, "dtype": d}) for w in ("int4", "bf16") for d in ("bf16", "fp16")}
    assert len(seeds) == 1
    assert case.input_seed(0, {**point, "tokens": 4}) not in seeds and case.input_seed(1, point) not in seeds


def test_routings_are_seeded_draws_not_fixed_patterns():
    s = moe_shape("mini")
    a = routing(s, 2, "distinct", torch.float32, "cpu", 0)[2]
    assert torch.equal(a, routing(s, 2, "distinct", torch.float32, "cpu", 0)[2])
    assert not torch.equal(a, routing(s, 2, "distinct", torch.float32, "cpu", 1)[2])
    # the router's: logits of unit scale (saturated sigmoids, all 1.0, would weigh some of
    # a token's choices exactly alike), from gate rows drawn apart from the hidden states
    # (else token t would pick expert t first)
    _, w, ids = routing(s, 16, "router", torch.float32, "cpu", 0)
    assert all(row.unique().numel() == s.top_k for row in w)
    assert int((ids[:, 0] == torch.arange(16)).sum()) <= 4


# The baseline's activation runs over the rows of pairs whose expert is elsewhere, never
# written: the interpreter's numpy may warn about what the memory held (the rows are unread).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_an_expert_parallel_point_counts_and_runs_only_this_ranks_pairs(monkeypatch, tmp_path):
    """Under EP the router picks among all the model's experts and the rest are -1: the
    point's facts, bytes and FLOPs count this rank's pairs, and the baseline is told to
    zero the others' rows (it then matches the reference)."""
    from microbench.cases import moe_inputs
    from microbench.kernels.moe_reference import moe_cost

    monkeypatch.setattr(moe_cases, "TUNING_DIR", str(tmp_path))
    ep = dataclasses.replace(moe_shape("mini"), name="mini-ep2", experts=8, hidden=64)  # 8 of 16 here
    real = moe_inputs.moe_shape
    monkeypatch.setattr(moe_inputs, "moe_shape", lambda layout: ep if layout == ep.name else real(layout))
    case = moe_cases.MoEExpertsCase()
    point = {"layout": ep.name, "weights": "bf16", "tokens": 6, "routing": "router", "dtype": "fp16"}
    w = case.setup(point, DEVICE, 3)
    ids = w.inputs["topk_ids"]
    local = ids[ids >= 0]
    assert (ids == -1).any() and int(local.max()) < ep.experts
    distinct = int(local.unique().numel())
    assert w.facts["experts"] == distinct and w.facts["pairs"] == local.numel()
    assert w.cost.flops == 2 * local.numel() * 3 * ep.inter * ep.hidden
    assert w.cost.bytes == moe_cost(6, ep.hidden, ep.inter, ep.top_k, distinct, "bf16", elem_bytes=2)[0]
    assert w.inputs["configs"]["remote"]
    assert not case.configs({**point, "layout": "mini"}, DEVICE)[0]["remote"]
    moe_cases._fused(**w.kwargs())
    torch.testing.assert_close(w.outputs["out"].float(), case.reference(w)["out"], rtol=1e-2, atol=1e-2)


def test_verify_axes_are_the_issue_sweep():
    ax = moe_cases.MoEExpertsCase().axes("verify", "cuda")
    assert ax["layout"] == ["kimi-tp8", "kimi-ep8", "dsv3-tp8"] and ax["tokens"] == [1, 4, 8, 16, 32, 64]
    assert set(ax["routing"]) == {"router", "distinct"} and set(ax["weights"]) == {"int4", "bf16"}
    assert moe_cases.MoEExpertsCase().skip({"dtype": "bf16"}, "cpu")


def _smoke(cases, **kw):
    opts = RunOptions(suite="smoke", device=DEVICE, timing=FAST, probe=False, **kw)
    return Runner(opts, None, progress=lambda _: None).run(plan(cases, opts))


def test_smoke_points_pass_the_gate_and_carry_their_facts(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_cases, "TUNING_DIR", str(tmp_path))  # no table: the defaults
    recs = _smoke([moe_cases.MoERouterCase(), moe_cases.MoEAlignCase(), moe_cases.MoEExpertsCase()])
    assert {r["status"] for r in recs} == {"OK"}, [(r["case"], r["variant"], r["reason"]) for r in recs]
    experts = [r for r in recs if r["case"] == "moe.experts"]
    assert {r["variant"] for r in experts} == {"fused", "few_token"} and len(experts) == 4
    for r in experts:
        assert r["derived"]["experts"] == str(r["facts"]["experts"]) and r["derived"]["config"] == "default"
        assert 1 <= r["facts"]["experts"] <= 16 and r["bytes"] > 0
    assert all("speed-up vs fused" in r["derived"] for r in experts if r["variant"] == "few_token")


def test_a_wrong_variant_is_failed_not_timed(monkeypatch, tmp_path):
    monkeypatch.setattr(moe_cases, "TUNING_DIR", str(tmp_path))
    case = moe_cases.MoEExpertsCase()
    right = case.variants()

    def half(hidden, weights, topk_weights, topk_ids, configs, out):
        right[1].fn(hidden, weights, topk_weights, topk_ids, configs, out)
        out[:, : out.shape[1] // 2] *= 1.05  # 5% off on half the channels

    case.variants = lambda: [right[0], type(right[0])("wrong", half)]
    recs = _smoke([case], axis_picks={"weights": ["bf16"]})
    wrong = [r for r in recs if r["variant"] == "wrong"]
    assert wrong and all(r["status"] == "FAILED" and r["timing"] is None for r in wrong)


@pytest.mark.skipif(DEVICE != "cpu", reason="drives the CPU interpreter's smoke layout")
def test_tune_writes_a_table_that_run_then_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(moe_cases, "TUNING_DIR", str(tmp_path))
    rc = cli.main(["tune", "--device", "cpu", "--axis", "weights=bf16", "--max-trials", "2", "--budget-s", "0.02"])
    assert rc == 0
    table = json.loads((tmp_path / "cpu.json").read_text())
    assert table["schema"] == "microbench.moe_tuning"
    got = {(e["kernel"], e["gemm"]) for e in table["entries"]}
    assert got == {("fused", "w13+w2"), ("few_token", "w13"), ("few_token", "w2")}
    assert all(e["tokens"] == 4 and e["weights"] == "bf16" for e in table["entries"])
    out, err = capsys.readouterr()
    assert "few_token" in out and "vs default" in out
    assert err.count(f"\ntuning table: {tmp_path / 'cpu.json'}\n") == 1  # once per table
    case = moe_cases.MoEExpertsCase()
    point = {"layout": "mini", "weights": "bf16", "tokens": 4, "routing": "router", "dtype": "fp16"}
    _, source = case.configs(point, "cpu")
    assert source == {"fused": "tuned", "few_token": "tuned"}
    _, source = case.configs({**point, "tokens": 16}, "cpu")
    assert source["fused"] == "tuned at T=4"
    _, source = case.configs({**point, "weights": "int4"}, "cpu")
    assert source == {"fused": "default", "few_token": "default"}


def test_an_interrupted_tune_keeps_the_searches_it_finished(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or the GPU check's step limit) in the middle of a point's second search: the
    first search's winner is in the table, and the command exits 130."""
    from microbench import tune as tune_mod

    monkeypatch.setattr(moe_cases, "TUNING_DIR", str(tmp_path))
    real, calls = tune_mod.Trial.__call__, []

    def interrupting(self, fn, w, expected, label=""):
        calls.append(label)
        if label.startswith("few_token/"):
            raise KeyboardInterrupt
        return real(self, fn, w, expected, label)

    monkeypatch.setattr(tune_mod.Trial, "__call__", interrupting)
    rc = cli.main(["tune", "--device", "cpu", "--axis", "weights=bf16", "--max-trials", "2", "--budget-s", "0.02"])
    assert rc == cli.EXIT_INTERRUPTED
    assert [c.split()[0] for c in calls] == ["fused/w13+w2", "fused/w13+w2", "few_token/w13"]
    table = json.loads((tmp_path / "cpu.json").read_text())
    assert [(e["kernel"], e["gemm"]) for e in table["entries"]] == [("fused", "w13+w2")]
    err = capsys.readouterr().err
    assert "winners found so far" in err and "interrupted" in err
    # the line scripts/gpu-check copies the table by, on an interrupted search too
    assert f"\ntuning table: {tmp_path / 'cpu.json'}\n" in err


def test_tune_rejects_bad_input(capsys):
    assert cli.main(["tune", "--device", "cpu", "--case", "norm.rmsnorm"]) == 2
    assert "no tunable case" in capsys.readouterr().err
    assert cli.main(["tune", "--device", "cpu", "--max-trials", "0"]) == 2


def test_trial_rejects_an_incorrect_candidate(monkeypatch, tmp_path):
    from microbench.tune import Trial

    monkeypatch.setattr(moe_cases, "TUNING_DIR", str(tmp_path))
    case = moe_cases.MoEExpertsCase()
    point = {"layout": "mini", "weights": "bf16", "tokens": 3, "routing": "distinct", "dtype": "fp16"}
    w = case.setup(point, "cpu", 5)
    logs = []
    trial = Trial(case, point, "cpu", 5, FAST, log=logs.append)
    assert trial(lambda **kw: kw["out"].zero_(), w, case.reference(w), "zeros") is None
    assert trial.rejected == 1 and "incorrect" in logs[-1]
    assert trial(moe_cases._few_token, w, case.reference(w), "few") > 0

    def untimeable(*a, **kw):  # correct at the gate, then fails in the timing loop
        if untimeable.calls:
            raise RuntimeError("CUDA error: out of memory\nmore")
        untimeable.calls += 1
        moe_cases._few_token(*a, **kw)

    untimeable.calls = 0
    assert trial(untimeable, w, case.reference(w), "late") is None
    assert trial.rejected == 2 and logs[-1] == "    late: failed: RuntimeError: CUDA error: out of memory"


@pytest.mark.parametrize("stop_at", [1, 2])
def test_a_tune_stopped_inside_its_first_search_keeps_its_best_so_far_or_writes_nothing(
        tmp_path, monkeypatch, capsys, stop_at):
    """The GPU check's step limit can land in the first search: after one timed candidate
    the table holds it; before any, no table is written and no 'tuning table:' line printed
    (an empty table copied back would be committed as the device's)."""
    from microbench import tune as tune_mod

    monkeypatch.setattr(moe_cases, "TUNING_DIR", str(tmp_path))
    real, calls = tune_mod.Trial.__call__, []

    def stopping(self, fn, w, expected, label=""):
        calls.append(label)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return real(self, fn, w, expected, label)

    monkeypatch.setattr(tune_mod.Trial, "__call__", stopping)
    rc = cli.main(["tune", "--device", "cpu", "--axis", "weights=bf16", "--max-trials", "3", "--budget-s", "0.02"])
    assert rc == cli.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    if stop_at == 1:
        assert not (tmp_path / "cpu.json").exists() and "tuning table:" not in err
        assert "nothing found yet, no table written" in err and "best so far" in err
    else:
        table = json.loads((tmp_path / "cpu.json").read_text())
        assert [(e["kernel"], e["gemm"]) for e in table["entries"]] == [("fused", "w13+w2")]
        assert table["entries"][0]["config"]["num_stages"] == 3  # the default, the one candidate timed
        assert "winners found so far" in err and f"\ntuning table: {tmp_path / 'cpu.json'}\n" in err


def _vb(label: str, ratio: float) -> dict:
    return {"label": label, "ratio": ratio, "lo": ratio * 0.98, "hi": ratio * 1.02}


def _exp(variant: str, tokens: int, weights: str = "int4", vb: dict | None = None, status: str = "OK") -> dict:
    return {"case": "moe.experts", "variant": variant, "status": status, "vs_baseline": vb,
            "axes": {"layout": "kimi-tp8", "weights": weights, "tokens": tokens, "routing": "router", "dtype": "bf16"}}


def test_the_moe_summary_names_the_token_count_at_which_fused_overtakes():
    recs = [_exp("fused", t) for t in (1, 4, 8, 16, 32)]
    recs += [_exp("few_token", 1, vb=_vb("FASTER", 0.31)), _exp("few_token", 4, vb=_vb("FASTER", 0.45)),
             _exp("few_token", 8, vb=_vb("UNSURE", 0.97)), _exp("few_token", 16, vb=_vb("SLOWER", 1.12)),
             _exp("few_token", 32, vb=_vb("SLOWER", 1.6))]
    # bf16: faster everywhere; its T = 8 point failed its gate and says nothing
    recs += [_exp("few_token", t, "bf16", _vb("FASTER", 0.5)) for t in (1, 4)]
    recs += [_exp("few_token", 8, "bf16", None, status="FAILED")]
    lines = moe_cases.MoEExpertsCase().summarize(recs)
    assert [x["axes"]["weights"] for x in lines] == ["int4", "bf16"]
    assert all(x["variants"] == ["few_token", "fused"] and "tokens" not in x["axes"] for x in lines)
    assert [x["text"] for x in lines] == [
        "few_token / fused time by tokens (layout=kimi-tp8 weights=int4 routing=router dtype=bf16): 1 ×0.31, "
        "4 ×0.45, 8 ×0.97 (UNSURE), 16 ×1.12, 32 ×1.60; fused overtakes at tokens = 16",
        "few_token / fused time by tokens (layout=kimi-tp8 weights=bf16 routing=router dtype=bf16): 1 ×0.50, "
        "4 ×0.50; few_token faster at every tokens measured (up to 4)"]
    # points in any order (run --axis tokens=16,1,4) read as the axis grows; a variant that
    # wins again after the baseline overtook it says so
    shuffled = [_exp("few_token", 16, vb=_vb("FASTER", 0.7)), _exp("few_token", 1, vb=_vb("FASTER", 0.3)),
                _exp("few_token", 4, vb=_vb("SLOWER", 1.1))]
    (line,) = moe_cases.MoEExpertsCase().summarize(shuffled)
    assert line["text"].endswith(": 1 ×0.30, 4 ×1.10, 16 ×0.70; fused overtakes at tokens = 4 "
                                 "(few_token faster again at tokens = 16)")
    # level to the end (SAME), never slower: the baseline is faster nowhere
    same = [_exp("few_token", 1, vb=_vb("FASTER", 0.5)), _exp("few_token", 4, vb=_vb("SAME", 1.0))]
    assert moe_cases.MoEExpertsCase().summarize(same)[0]["text"].endswith("fused faster at no tokens measured (up to 4)")
    # one token count: the table's ratio column says it all
    assert moe_cases.MoEExpertsCase().summarize([_exp("few_token", 4, vb=_vb("FASTER", 0.5))]) == []
