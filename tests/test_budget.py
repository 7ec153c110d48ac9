"""The step-time model: its arithmetic on hand-computed inputs, result files replacing
estimates, the launch model, the throughput summary, profiles and every bad input."""

from __future__ import annotations

import json
import math

import pytest

from microbench.budget import Scenario, budget
from microbench.budget_table import render
from microbench.cli import main
from microbench.hardware import load_profile
from microbench.layout import ParallelLayout
from microbench.measured import Measured
from microbench.models import ConfigError, ModelConfig, load_model

from .helpers import shipped_json

#: round numbers, so every expected value below is worked out by hand
PROFILE = {
    "name": "round", "description": "round figures for hand-checked budgets",
    "figures": {
        "memory_bandwidth": {"value": 1e12, "unit": "B/s", "source": "test"},
        "bf16_dense_flops": {"value": 1e15, "unit": "FLOP/s", "source": "test"},
        "l2_bytes": {"value": 1e6, "unit": "B", "source": "test"},
        "sm_count": {"value": 100, "unit": "count", "source": "test"},
        "memory_bytes": {"value": 1e11, "unit": "B", "source": "test"},
        "launch_overhead": {"value": 5e-6, "unit": "s", "source": "test"},
        "kernel_floor": {"value": 1e-6, "unit": "s", "source": "test"},
    },
    "interconnect": {"kind": "nvlink", "bandwidth_per_direction": {"value": 1e11, "unit": "B/s", "source": "test"},
                     "latency": {"value": 1e-5, "unit": "s", "source": "test"}},
    "match": ["ROUND"],
}


@pytest.fixture
def round_hw(tmp_path):
    p = tmp_path / "round.json"
    p.write_text(json.dumps(PROFILE))
    return load_profile(str(p))


def _scenario(hw, **kw):
    return Scenario(model=load_model("kimi-k2.5"), layout=ParallelLayout(8, 1), hw=hw, **kw)


def _hw(tmp_path, **figures):
    """The round profile with some figures' values changed."""
    prof = json.loads(json.dumps(PROFILE))
    for k, v in figures.items():
        prof["figures"][k]["value"] = v
    p = tmp_path / "edited.json"
    p.write_text(json.dumps(prof))
    return load_profile(str(p))


def _model(name, **text):
    """A shipped model config with some of its keys changed."""
    raw = shipped_json("models", name)
    (raw.get("text_config") or raw).update(text)
    return ModelConfig.from_hf(raw, name=name)


def _line(lines, prefix):
    return next(x for x in lines if x.name.startswith(prefix))


def test_hand_computed_lines(round_hw):
    b = budget(_scenario(round_hw, batch=1, context=4096, draft_tokens=3))
    moe = b.moe_layer
    # allreduce of one token (14,336 B) at 8 ranks: alpha + 2*7/8 * bytes / beta, twice per layer
    one = 1e-5 + 2 * 7 / 8 * 14336 / 1e11
    assert _line(moe, "allreduce").seconds("decode", "graph") == pytest.approx(2 * one)
    # T = 1 touches exactly 8 experts; INT4: 3*7168*256 weights at 1/2 byte + a bf16 scale per 32
    per_expert = 3 * 7168 * 256 / 2 + 3 * 7168 * 256 / 32 * 2
    assert _line(moe, "routed experts").seconds("decode", "graph") == pytest.approx(
        (8 * per_expert + 2 * 7168 * 2) / 1e12)
    # verify scores 4 tokens: 384 * (1 - (376/384)^4) experts
    touched = 384 * (1 - (376 / 384) ** 4)
    assert _line(moe, "routed experts").seconds("verify", "graph") == pytest.approx(
        (touched * per_expert + 2 * 4 * 7168 * 2) / 1e12)
    # lm_head: [1, 7168] x [7168, 163840/8] bf16 + the final norm, memory-bound
    head = _line(b.step, "final norm + lm_head").seconds("decode", "graph")
    assert head == pytest.approx(((7168 * 20480 + 7168 + 20480) * 2 + 2 * 7168 * 2) / 1e12)
    # the extend kernel streams the 576-wide latent of 4096 tokens once per head (8 heads)
    att = _line(moe, "attention core").seconds("verify", "graph")
    assert att == pytest.approx((4096 * 576 * 8 + 4 * 8 * (576 + 512)) * 2 / 1e12)
    att_v = _line(budget(_scenario(round_hw, attention="verify")).moe_layer, "attention core")
    assert att_v.seconds("verify", "graph") == pytest.approx((4096 * 576 + 4 * 8 * (576 + 512)) * 2 / 1e12)


def test_layers_steps_launches_and_throughput_compose(round_hw):
    b = budget(_scenario(round_hw, batch=2, accept_len=2.5, draft_s=1e-3))
    for p in ("decode", "verify"):
        gpu = sum(x.seconds(p, "graph") for x in b.moe_layer[:-1])
        assert b.totals["moe layer"][(p, "graph")] == pytest.approx(gpu)
        launches = sum(x.launches[p] for x in b.moe_layer[:-1])
        assert b.totals["moe layer"][(p, "eager")] == pytest.approx(max(gpu, launches * 5e-6))
        assert b.moe_layer[-1].seconds(p, "eager") == pytest.approx(max(0.0, launches * 5e-6 - gpu))
        step = (60 * b.totals["moe layer"][(p, "graph")] + 1 * b.totals["dense layer"][(p, "graph")]
                + sum(x.seconds(p, "graph") for x in b.step))
        assert b.totals["step"][(p, "graph")] == pytest.approx(step)
    assert _line(b.moe_layer, "attention core").launches == {"decode": 2, "verify": 1}
    s = b.summary("graph")
    dec, ver = b.totals["step"][("decode", "graph")], b.totals["step"][("verify", "graph")]
    assert s["decode_tok_s"] == pytest.approx(2 / dec)
    assert s["spec_tok_s"] == pytest.approx(2 * 2.5 / (1e-3 + ver))
    assert s["break_even_accept_len"] == pytest.approx((1e-3 + ver) / dec)
    # the estimated draft phase: 3 x (a dense layer + lm_head at the decode batch)
    est = budget(_scenario(round_hw, batch=2))
    d = est.totals["draft"][("decode", "graph")]
    assert d == pytest.approx(3 * (est.totals["dense layer"][("decode", "graph")]
                                   + sum(x.seconds("decode", "graph") for x in est.step)))


def test_more_hand_computed_lines(round_hw):
    b = budget(_scenario(round_hw, batch=1, context=4096, draft_tokens=3))
    # the decode kernel reads the 576-wide latent of 4096 tokens once, not once per head
    att = _line(b.moe_layer, "attention core").seconds("decode", "graph")
    assert att == pytest.approx((4096 * 576 + 1 * 8 * (576 + 512)) * 2 / 1e12)
    # seven tiny kernels at one token: each costs the kernel floor (1 us), not its few KB
    small = _line(b.moe_layer, "norms").cells[("decode", "graph")]
    assert small.seconds == pytest.approx(7e-6) and "floor-bound" in small.source
    # the dense MLP: [1, 7168] x [7168, 2 x 2304], [1, 2304] x [2304, 7168] and the SiLU-and-mul
    dense = (7168 * 4608 + 7168 + 4608 + 2304 * 7168 + 2304 + 7168 + 3 * 2304) * 2 / 1e12
    assert _line(b.dense_layer, "dense MLP").seconds("decode", "graph") == pytest.approx(dense)
    # 2048 tokens (batch 512 x 4) make the lm_head GEMM compute-bound at 1 PFLOP/s
    head = _line(budget(_scenario(round_hw, batch=512)).step, "final norm + lm_head").cells[("verify", "graph")]
    assert head.seconds == pytest.approx(2 * 2048 * 7168 * 20480 / 1e15) and "compute-bound" in head.source


def test_fp8_experts_and_a_direct_query_projection(round_hw):
    b = budget(Scenario(model=_model("deepseek-v3", q_lora_rank=None), layout=ParallelLayout(8, 1), hw=round_hw))
    # T = 1 touches 8 of 256 experts of 3 x 7168 x 256 FP8 weights: one byte each, and one
    # fp32 scale per 128 x 128 block: w13 [512, 7168] has 4 x 56, w2 [7168, 256] 56 x 2
    experts = _line(b.moe_layer, "routed experts").seconds("decode", "graph")
    assert experts == pytest.approx((8 * (3 * 7168 * 256 + (4 * 56 + 56 * 2) * 4) + 2 * 7168 * 2) / 1e12)

    def fp8(k, n):  # an FP8 [n, k] weight: a byte each, an fp32 scale per (partial) 128 x 128 block
        return k * n + -(-n // 128) * -(-k // 128) * 4

    # q_lora_rank null: no q_a in the fused projection, and q_b reads the hidden state itself;
    # the per-head w_kc / w_vc are bf16 (dequantised from kv_b_proj), the others FP8
    shapes = [(7168, 512 + 64, fp8), (7168, 16 * 192, fp8), (128, 512 * 16, None), (512, 128 * 16, None),
              (16 * 128, 7168, fp8)]
    proj = _line(b.moe_layer, "attention projections").seconds("decode", "graph")
    assert proj == pytest.approx(sum((w(k, n) if w else 2 * k * n) + (k + n) * 2 for k, n, w in shapes) / 1e12)
    # the shared expert and the dense MLP are FP8 too; lm_head stays bf16
    shared = _line(b.moe_layer, "shared expert").seconds("decode", "graph")
    assert shared == pytest.approx((fp8(7168, 512) + fp8(256, 7168) + (7168 + 512 + 256 + 7168) * 2
                                    + 3 * 256 * 2) / 1e12)
    head = _line(b.step, "final norm + lm_head").seconds("decode", "graph")
    assert head == pytest.approx(((7168 * 16160 + 7168 + 16160) + 2 * 7168) * 2 / 1e12)


def test_expert_parallel_ranks_own_whole_experts(round_hw):
    ep = Scenario(model=load_model("kimi-k2.5"), layout=ParallelLayout(8, 8), hw=round_hw)
    # T = 1 touches 8 of 384 experts; a rank owns 48, so it expects one whole 2048-wide expert
    per_expert = 3 * 7168 * 2048 / 2 + 3 * 7168 * 2048 / 32 * 2
    experts = _line(budget(ep).moe_layer, "routed experts").seconds("decode", "graph")
    assert experts == pytest.approx((1 * per_expert + 2 * 7168 * 2) / 1e12)
    # what moe.experts measured on the EP layout replaces it; the TP layout's record does not
    recs = [_rec("moe.experts", "fused", {"layout": layout, "weights": "int4", "tokens": 1, "routing": "router",
                                          "dtype": "bf16"}, t)
            for layout, t in (("kimi-tp8", 30e-6), ("kimi-ep8", 40e-6))]
    assert _line(budget(ep, Measured([_gpu_doc(recs)])).moe_layer, "routed experts").seconds("decode", "eager") == 40e-6


def test_expert_parallel_flops_are_the_ranks_share(round_hw):
    # 512 tokens x top-8 pairs over 384 experts: a TP rank computes every pair on a 256-wide
    # slice, an EP rank the 48/384 of the pairs its experts hold on the full 2048: same FLOPs
    def experts(ep):
        s = Scenario(model=load_model("kimi-k2.5"), layout=ParallelLayout(8, ep), hw=round_hw, batch=128)
        return _line(budget(s).moe_layer, "routed experts").cells[("verify", "graph")].source

    flops = 2 * 512 * 8 * 3 * 7168 * 256 / 1e9
    for ep in (1, 8):
        assert f"{flops:.2f} GFLOP, memory-bound" in experts(ep)


def test_a_model_without_dense_layers(round_hw):
    # every layer routed: no dense line, row or layer in the step; the draft estimate still
    # prices an EAGLE-3 head's dense MLP of intermediate_size (18432 / 8 per rank)
    b = budget(Scenario(model=_model("kimi-k2.5", first_k_dense_replace=0), layout=ParallelLayout(8, 1),
                        hw=round_hw))
    assert b.dense_layer == [] and set(b.totals["dense layer"].values()) == {0.0}
    ref = budget(_scenario(round_hw))
    for k in b.totals["draft"]:
        assert b.totals["draft"][k] == pytest.approx(ref.totals["draft"][k])
    text = render(b, "text")
    assert "dense layer" not in text and "x 61 MoE layers" in text


def test_the_draft_head_is_bf16_whatever_the_target_weights(round_hw):
    # DeepSeek-V3's dense layers are FP8, the estimated EAGLE-3 head is not: it costs what
    # the same model in bf16 would
    fp8 = budget(Scenario(model=load_model("deepseek-v3"), layout=ParallelLayout(8, 1), hw=round_hw))
    bf16 = budget(Scenario(model=_model("deepseek-v3", quantization_config=None), layout=ParallelLayout(8, 1),
                           hw=round_hw))
    assert fp8.totals["draft"] == pytest.approx(bf16.totals["draft"])
    dense = [x.totals["dense layer"][("decode", "graph")] for x in (fp8, bf16)]
    assert dense[0] < 0.6 * dense[1]


def test_one_rank_has_no_allreduce(round_hw):
    b = budget(Scenario(model=load_model("kimi-k2.5"), layout=ParallelLayout(1, 1), hw=round_hw))
    ar = _line(b.moe_layer, "allreduce").cells[("decode", "eager")]
    assert (ar.seconds, ar.source) == (0.0, "no allreduce at tp 1")


def test_eager_layers_pay_their_launches_when_the_host_is_slower(tmp_path):
    # 1 ms a launch: every layer is launch-bound in eager mode, and graph replay hides it all
    b = budget(_scenario(_hw(tmp_path, launch_overhead=1e-3)))
    # 7 small kernels + 5 GEMMs + attention (2 decode; 1 extend) + 2 allreduces + router 2 + experts 5 + shared 3
    assert b.moe_layer[-1].launches == {"decode": 26, "verify": 25}
    for p, n in (("decode", 26), ("verify", 25)):
        gpu = sum(x.seconds(p, "graph") for x in b.moe_layer[:-1])
        assert b.totals["moe layer"][(p, "eager")] == pytest.approx(n * 1e-3)
        assert b.moe_layer[-1].seconds(p, "eager") == pytest.approx(n * 1e-3 - gpu) and n * 1e-3 > gpu
        assert b.moe_layer[-1].seconds(p, "graph") == 0.0 and b.totals["moe layer"][(p, "graph")] == pytest.approx(gpu)
    assert b.totals["dense layer"][("decode", "eager")] == pytest.approx((7 + 5 + 2 + 2 + 3) * 1e-3)


def test_the_step_counts_layers_as_the_model_does(round_hw):
    # every other layer routed (30 MoE, 32 dense of 62) and no shared expert in the MoE layer
    model = _model("kimi-k2.5", num_hidden_layers=62, moe_layer_freq=2, n_shared_experts=0)
    b = budget(Scenario(model=model, layout=ParallelLayout(8, 1), hw=round_hw))
    assert not any(x.name.startswith("shared expert") for x in b.moe_layer)
    assert b.moe_layer[-1].launches == {"decode": 23, "verify": 22}
    for key in (("decode", "graph"), ("verify", "eager")):
        step = (30 * b.totals["moe layer"][key] + 32 * b.totals["dense layer"][key]
                + sum(x.seconds(*key) for x in b.step))
        assert b.totals["step"][key] == pytest.approx(step)


def test_the_summary_speedup_and_a_fully_accepted_draft(round_hw):
    # accept_len may reach draft_tokens + 1: every draft accepted, plus the verify step's own token
    b = budget(_scenario(round_hw, batch=2, draft_tokens=3, accept_len=4.0))
    for mode in ("eager", "graph"):
        s = b.summary(mode)
        assert s["spec_tok_s"] == pytest.approx(2 * 4.0 / s["spec_step_s"])
        assert s["speedup"] == pytest.approx(s["spec_tok_s"] / s["decode_tok_s"])
        # the draft phase is one thing, whichever step it is set beside
        assert b.totals["draft"][("verify", mode)] == b.totals["draft"][("decode", mode)]


def _gpu_doc(records, device="cuda"):
    return {"schema": "microbench.result", "schema_version": 1, "run": {"id": "gpu-run", "device": device},
            "fingerprint": {"device": {"name": "NVIDIA H200"}}, "records": records}


def _rec(case, variant, axes, median, facts=None, mode="cold"):
    if case == "attention.mla_verify" and facts is None:
        facts = {"heads": 8}  # what the case measures: Kimi-K2.5 TP8's heads per rank
    return {"case": case, "variant": variant, "axes": axes, "status": "OK", "facts": facts,
            "timing": {"samples_s": [median], "summary": {"median": median, "rel_noise": 0.01, "count": 10},
                       "stop_reason": "noise", "mode": mode}}


def test_result_records_replace_estimates_and_say_so(round_hw):
    recs = [
        _rec("attention.mla_verify", "extend", {"batch": 1, "draft_tokens": 4, "context": 4096, "page": 1,
                                                 "dtype": "bf16"}, 50e-6),
        _rec("moe.experts", "fused", {"layout": "kimi-tp8", "weights": "int4", "tokens": 1, "routing": "router",
                                      "dtype": "bf16"}, 30e-6),
        _rec("calibration.launch", "torch_tiny_op", {"grid": 1, "capture": "eager"}, 7e-6),
        _rec("calibration.launch", "torch_tiny_op", {"grid": 1, "capture": "graph"}, 1.5e-6),
    ]
    for nbytes, t in ((8192, 10e-6), (32768, 20e-6)):
        recs.append(_rec("comm.allreduce_sweep", "torch-ip", {"bytes": nbytes, "dtype": "bf16", "capture": "graph"}, t,
                         facts={"collective": "allreduce", "bytes": nbytes, "world_size": 8}))
    b = budget(_scenario(round_hw), Measured([_gpu_doc(recs)]))
    att = _line(b.moe_layer, "attention core").cells[("verify", "graph")]
    assert att.seconds == 50e-6 and att.source.startswith("measured: attention.mla_verify extend")
    assert "on NVIDIA H200" in att.source
    assert _line(b.moe_layer, "routed experts").cells[("decode", "eager")].seconds == 30e-6
    assert _line(b.moe_layer, "routed experts").cells[("verify", "eager")].source.startswith("roofline")
    ar = _line(b.moe_layer, "allreduce").cells[("decode", "graph")]
    # 14,336 B lies between 8 KiB and 32 KiB: log-log interpolation, twice per layer
    w = (math.log(14336) - math.log(8192)) / math.log(4)
    assert ar.seconds == pytest.approx(2 * 10e-6 * 2 ** w) and "interpolated" in ar.source
    assert _line(b.moe_layer, "allreduce").cells[("decode", "eager")].source.startswith("2 x alpha-beta")
    assert b.launch_cost.seconds == 7e-6 and b.moe_layer[-1].cells[("decode", "eager")].source.count("7.00 us")
    assert any("1.50 us per kernel from measured" in n for n in b.notes)
    text = render(b)
    assert "measured: attention.mla_verify extend" in text and "roofline on round" in text


def test_a_cpu_result_file_is_not_used(round_hw):
    doc = _gpu_doc([_rec("moe.experts", "fused", {"layout": "kimi-tp8", "weights": "int4", "tokens": 1,
                                                  "routing": "router", "dtype": "bf16"}, 1.0)], device="cpu")
    m = Measured([doc])
    assert not m.records and "not a GPU: not used" in m.notes[0]
    b = budget(_scenario(round_hw), m)
    assert _line(b.moe_layer, "routed experts").cells[("decode", "graph")].source.startswith("roofline")


@pytest.mark.parametrize("hw", ["h200", "rtx-pro-6000"])
def test_the_cli_prints_decode_and_verify_eager_and_graph_with_sources(capsys, hw):
    assert main(["model", "--model", "kimi-k2.5", "--tp", "8", "--hardware", hw]) == 0
    out = capsys.readouterr().out
    for col in ("decode eager (us)", "decode graph (us)", "verify eager (us)", "verify graph (us)", "source"):
        assert col in out
    assert "= step" in out and "break-even accept len" in out and "[1] roofline on" in out
    assert ("nvlink" if hw == "h200" else "pcie") in out


def test_the_cli_json_and_one_mode(capsys):
    assert main(["model", "--hardware", "h200", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["scenario"]["hardware"] == "h200-sxm" and set(d["summary"]) == {"eager", "graph"}
    assert main(["model", "--hardware", "h200", "--graph"]) == 0
    out = capsys.readouterr().out
    assert "graph (us)" in out and "eager (us)" not in out


def _write_doc(tmp_path, name, gpu):
    doc = _gpu_doc([_rec("calibration.launch", "torch_tiny_op", {"grid": 1, "capture": "eager"}, 7e-6)])
    doc["fingerprint"]["device"]["name"] = gpu
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize(("gpus", "profile", "why"), [
    ([], "h200-sxm", "no GPU result among the --results files"),
    (["NVIDIA H100 80GB HBM3"], "h100-sxm", "the GPU of the results, NVIDIA H100 80GB HBM3"),
    (["NVIDIA H200"], "h200-sxm", "the GPU of the results"),
    (["NVIDIA A100-SXM4-80GB"], "h200-sxm", "no shipped profile matches NVIDIA A100-SXM4-80GB"),
    (["NVIDIA H100 80GB HBM3", "NVIDIA H200"], "h100-sxm", "ran on 2 GPUs (NVIDIA H100 80GB HBM3, NVIDIA H200), "
                                                           "the first decides"),
])
def test_the_hardware_follows_the_results_gpu(capsys, tmp_path, gpus, profile, why):
    """--hardware auto (the default): the roofline lines use the ceilings of the GPU the
    measured lines ran on, and the table says which profile and why."""
    files = [a for i, g in enumerate(gpus) for a in ("--results", _write_doc(tmp_path, f"r{i}.json", g))]
    assert main(["model", *files, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["scenario"]["hardware"] == profile
    note = next(n for n in d["notes"] if n.startswith("hardware profile"))
    assert note.startswith(f"hardware profile {profile} (--hardware auto: ") and why in note
    assert main(["model", *files, "--hardware", "rtx-pro-6000", "--json"]) == 0  # named: no note
    d = json.loads(capsys.readouterr().out)
    assert d["scenario"]["hardware"] == "rtx-pro-6000-blackwell"
    assert not any(n.startswith("hardware profile") for n in d["notes"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--accept-len", "0.5"], "--accept-len 0.5: must lie in [1, draft tokens + 1] = [1, 4]"),
    (["--accept-len", "5"], "must lie in [1, draft tokens + 1]"),
    (["--hardware", "tpu-v9"], "unknown hardware profile 'tpu-v9'"),
    (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--attention", "flash"], "--attention 'flash'"),
    (["--draft-ms", "-1"], "--draft-ms must be a finite time of at least 0, got -1"),
    (["--draft-ms", "nan"], "--draft-ms must be a finite time of at least 0, got nan"),
    (["--draft-ms", "inf"], "--draft-ms must be a finite time of at least 0, got inf"),
    (["--results", "/nonexistent.json"], "no such file"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(["model", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_profile_without_a_figure_the_budget_needs(capsys, tmp_path):
    prof = json.loads(json.dumps(PROFILE))
    del prof["figures"]["kernel_floor"]
    p = tmp_path / "nofloor.json"
    p.write_text(json.dumps(prof))
    assert main(["model", "--hardware", str(p)]) == 2
    assert "missing figure 'kernel_floor', which the budget needs" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="kernel_floor"):
        budget(_scenario(load_profile(str(p))))


# --------------------------------------------------------------------------- pictures


def _png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_budget_bars_and_component_sums(round_hw, tmp_path):
    pytest.importorskip("matplotlib")
    from microbench.plots import budget_components, plot_budget

    b = budget(_scenario(round_hw))
    comps = budget_components(b)
    for key in (("decode", "graph"), ("verify", "eager")):  # the stacks add up to the step
        assert sum(c.get(key, 0.0) for c in comps.values()) == pytest.approx(b.totals["step"][key])
    assert _png(plot_budget(b, str(tmp_path / "budget.png")))


def test_the_cli_draws_a_budget_and_a_result_file(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["model", "--hardware", "h200", "--plot", str(tmp_path / "b.png")]) == 0
    assert _png(tmp_path / "b.png")
    doc = _gpu_doc([_rec("attention.mla_verify", v, {"batch": 1, "draft_tokens": q, "context": 4096, "page": 1,
                                                      "dtype": "bf16"}, t * q)
                    for v, t in (("extend", 3e-5), ("verify", 1e-5)) for q in (1, 2, 4, 8)])
    doc["run"].update(complete=True)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert main(["report", str(path), "--plot", str(tmp_path / "plots")]) == 0
    assert _png(tmp_path / "plots" / "attention_mla_verify.png")
    assert "plot:" in capsys.readouterr().err


def test_a_measured_component_is_used_only_at_its_own_shapes_and_as_gpu_time(round_hw):
    """attention.mla_verify measures 8 heads per rank and norm.rmsnorm Kimi-K2.5's widths:
    another TP or model takes its roofline; a record timed back to back (hot: host launch
    cost inside) is not a kernel's GPU time, and is not used either."""
    att = {"batch": 1, "draft_tokens": 4, "context": 4096, "page": 1, "dtype": "bf16"}
    norms = [_rec("norm.rmsnorm", "triton", {"tokens": 1, "norm": n, "dtype": "bf16"}, 3e-6, {"width": w})
             for n, w in (("input", 7168), ("q_a", 1536), ("kv_a", 512))]
    doc = _gpu_doc([_rec("attention.mla_verify", "extend", att, 50e-6), *norms])
    tp8 = Scenario(model=load_model("kimi-k2.5"), layout=ParallelLayout(8), hw=round_hw, batch=1, draft_tokens=3,
                   context=4096, attention="extend")
    tp4 = Scenario(model=load_model("kimi-k2.5"), layout=ParallelLayout(4), hw=round_hw, batch=1, draft_tokens=3,
                   context=4096, attention="extend")
    at8 = _line(budget(tp8, Measured([doc])).moe_layer, "attention core").cells[("verify", "graph")]
    at4 = _line(budget(tp4, Measured([doc])).moe_layer, "attention core").cells[("verify", "graph")]
    assert at8.seconds == 50e-6 and ", cold (" in at8.source
    assert at4.source.startswith("roofline") and at4.seconds != 50e-6
    small = _line(budget(tp8, Measured([doc])).moe_layer, "norms").cells[("decode", "graph")]
    assert small.source.startswith("measured: norm.rmsnorm triton tokens=1 (2 x input, q_a, kv_a)")
    # the same norms measured at other widths: not this model's
    other = _gpu_doc([_rec("norm.rmsnorm", "triton", r["axes"], 3e-6, {"width": r["facts"]["width"] * 2})
                      for r in norms])
    assert _line(budget(tp8, Measured([other])).moe_layer, "norms").cells[("decode", "graph")].source.startswith(
        "roofline")
    hot = _gpu_doc([_rec("attention.mla_verify", "extend", att, 30e-6, mode="hot")])
    cell = _line(budget(tp8, Measured([hot])).moe_layer, "attention core").cells[("verify", "graph")]
    assert cell.source.startswith("roofline")
