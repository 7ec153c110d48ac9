"""MoE tile configurations: the per-device tuning table (save, load, lookup rules,
malformed files), the default rule (with its small-shared-memory variant), ``GemmConfig``
validation, and ``moe_cost`` against numbers worked by hand."""

from __future__ import annotations

import json
import re

import pytest

from microbench.kernels.moe_tuning import GemmConfig, TuningEntry, TuningTable, default_config
from microbench.kernels.moe_reference import moe_cost


# --------------------------------------------------------------------------------------
# Tuning table and GemmConfig
# --------------------------------------------------------------------------------------

CFG_A = GemmConfig(block_n=32, block_k=64, split_k=4, num_stages=4)
CFG_B = GemmConfig(block_n=128, block_k=128, block_m=32, group_m=8)
CFG_C = GemmConfig(block_n=64, block_k=64, split_k=2)


def _table() -> TuningTable:
    return TuningTable("test-gpu", [
        TuningEntry("few_token", "w13", "int4", 512, 7168, 8, CFG_A, 1.5e-5),
        TuningEntry("few_token", "w13", "int4", 512, 7168, 64, CFG_C, 3.0e-5),
        TuningEntry("fused", "w13+w2", "bf16", 512, 7168, 4, CFG_B, None),
        TuningEntry("fused", "w13+w2", "bf16", 512, 7168, 16, CFG_C, 2.0e-5),
    ])


def test_tuning_table_save_load_round_trip(tmp_path):
    path = tmp_path / "sub" / "h200.json"
    tab = _table()
    assert tab.save(str(path)) == str(path)
    doc = json.loads(path.read_text())
    assert doc["schema"] == "microbench.moe_tuning" and doc["version"] == 1 and doc["device"] == "test-gpu"
    again = TuningTable.load(str(path))
    assert again.device == "test-gpu" and again.path == str(path)
    key = lambda e: (*e.key(), e.tokens)  # noqa: E731
    assert sorted(again.entries, key=key) == sorted(tab.entries, key=key)
    # put replaces the entry of the same key and token count, adds a new one otherwise
    again.put(TuningEntry("few_token", "w13", "int4", 512, 7168, 8, CFG_B, 1.0e-5))
    again.put(TuningEntry("few_token", "w2", "int4", 7168, 256, 8, CFG_A, 1.0e-5))
    again.save()
    third = TuningTable.load(str(path))
    assert len(third.entries) == 5
    assert third.lookup("few_token", "w13", "int4", 512, 7168, 8) == (CFG_B, "tuned")
    assert third.lookup("few_token", "w2", "int4", 7168, 256, 8) == (CFG_A, "tuned")


def test_tuning_table_lookup_rules(tmp_path):
    tab = _table()
    assert tab.lookup("few_token", "w13", "int4", 512, 7168, 8) == (CFG_A, "tuned")
    assert tab.lookup("few_token", "w13", "int4", 512, 7168, 64) == (CFG_C, "tuned")
    # nearest token count by ratio: 10 is 1.25x from 8, 6.4x from 64
    assert tab.lookup("few_token", "w13", "int4", 512, 7168, 10) == (CFG_A, "tuned at T=8")
    assert tab.lookup("few_token", "w13", "int4", 512, 7168, 1) == (CFG_A, "tuned at T=8")
    assert tab.lookup("few_token", "w13", "int4", 512, 7168, 48) == (CFG_C, "tuned at T=64")
    # the few-token tile's rows follow T (16 up to T = 16, then 32, 64): T = 24 and 32 are
    # nearer 8 than 64 by ratio but a 32-row tile borrows from neither 16 nor 64 rows
    for t in (24, 32):
        assert tab.lookup("few_token", "w13", "int4", 512, 7168, t) == (
            default_config("few_token", "w13", "int4", 512, 7168, t), "default")
    assert tab.lookup("few_token", "w13", "int4", 512, 7168, 16) == (CFG_A, "tuned at T=8")
    assert tab.lookup("few_token", "w13", "int4", 512, 7168, 33) == (CFG_C, "tuned at T=64")
    # 8 is 2x from both 4 and 16: the tie goes to the larger T
    assert tab.lookup("fused", "w13+w2", "bf16", 512, 7168, 8) == (CFG_C, "tuned at T=16")
    # a key with no entry (other weights, other N): the fixed default rule
    for args in (("few_token", "w13", "bf16", 512, 7168, 8), ("few_token", "w13", "int4", 256, 7168, 8),
                 ("few_token", "w2", "int4", 7168, 256, 4), ("fused", "w13+w2", "int4", 512, 7168, 4)):
        assert tab.lookup(*args) == (default_config(*args), "default")
    # a missing file is an empty table, never an error
    empty = TuningTable.load(str(tmp_path / "none.json"), "dev")
    assert empty.entries == [] and empty.device == "dev"
    assert empty.lookup("fused", "w13+w2", "int4", 512, 7168, 4)[1] == "default"


def test_default_config_rule():
    assert default_config("fused", "w13+w2", "bf16", 512, 7168, 4) == GemmConfig(block_n=64, block_k=128)
    assert default_config("fused", "w13+w2", "int4", 512, 7168, 4) == GemmConfig(block_n=64, block_k=64)
    assert default_config("few_token", "w13", "int4", 512, 7168, 4).split_k == 4
    assert default_config("few_token", "w13", "int4", 512, 1024, 4).split_k == 1
    assert default_config("few_token", "w13", "int4", 512, 2048, 4).split_k == 4  # K >= 2048
    assert default_config("few_token", "w2", "bf16", 7168, 256, 4).split_k == 1
    assert default_config("few_token", "w13", "bf16", 48, 64, 4).block_n == 64  # narrower N: next power of two
    # bf16 K steps: 128 for 16-row tiles, 64 for 32 and 64 rows (where 128 spills)
    assert [default_config("few_token", g, "bf16", 512, 7168, t).block_k
            for g in ("w13", "w2") for t in (1, 16, 17, 32, 64)] == [128, 128, 64, 64, 64] * 2
    assert {default_config("few_token", "w13", "int4", 512, 7168, t).block_k for t in (1, 16, 32, 64)} == {64}
    assert {default_config("fused", "w13+w2", "bf16", 512, 7168, t).block_k for t in (4, 64)} == {128}
    assert default_config("few_token", "w13", "bf16", 20, 64, 4).block_n == 32
    with pytest.raises(ValueError, match="kernel/gemm"):
        default_config("few_token", "w13+w2", "bf16", 512, 7168, 4)


MINIMAL = {"kernel": "fused", "gemm": "w13+w2", "weights": "int4", "n": 512, "k": 7168, "tokens": 4,
           "config": {"block_n": 64, "block_k": 64}}


@pytest.mark.parametrize("doc", [
    pytest.param({"schema": "other", "version": 1, "entries": []}, id="wrong-schema"),
    pytest.param({"schema": "microbench.moe_tuning", "version": 2, "entries": []}, id="wrong-version"),
    pytest.param({"schema": "microbench.moe_tuning", "version": 1,
                  "entries": [{**MINIMAL, "config": {"block_n": 24, "block_k": 64}}]}, id="block_n-24"),
    pytest.param({"schema": "microbench.moe_tuning", "version": 1,
                  "entries": [MINIMAL, {**MINIMAL, "config": {"block_n": 64, "block_k": 8}}]}, id="block_k-8"),
    pytest.param({"schema": "microbench.moe_tuning", "version": 1,
                  "entries": [{**MINIMAL, "config": {"block_n": 64, "block_k": 64, "bogus": 1}}]},
                 id="unknown-field"),
    pytest.param({"schema": "microbench.moe_tuning", "version": 1,
                  "entries": [{k: v for k, v in MINIMAL.items() if k != "tokens"}]}, id="missing-tokens"),
    pytest.param({"schema": "microbench.moe_tuning", "version": 1,
                  "entries": [{**MINIMAL, "kernel": "few_token"}]}, id="unknown-gemm"),
])
def test_tuning_table_rejects_malformed_file(tmp_path, doc):
    path = tmp_path / "bad-table.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=re.escape(str(path))):
        TuningTable.load(str(path))


def test_tuning_table_names_the_bad_entry(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schema": "microbench.moe_tuning", "version": 1,
                                "entries": [MINIMAL, {**MINIMAL, "config": {"block_n": 24, "block_k": 64}}]}))
    with pytest.raises(ValueError, match=r"t\.json: entry 1: block_n"):
        TuningTable.load(str(path))


@pytest.mark.parametrize(("kwargs", "pattern"), [
    pytest.param(dict(block_n=24, block_k=32), r"^block_n: must be a power of two", id="block_n-24"),
    pytest.param(dict(block_n=32, block_k=48), r"^block_k: must be a power of two", id="block_k-48"),
    pytest.param(dict(block_n=32, block_k=32, block_m=12), r"^block_m: ", id="block_m-12"),
    pytest.param(dict(block_n=32, block_k=32, num_warps=3), r"^num_warps: ", id="warps-3"),
    pytest.param(dict(block_n=32, block_k=8), r"block_k and block_n must be >= 16", id="block_k-8"),
    pytest.param(dict(block_n=8, block_k=32), r"block_k and block_n must be >= 16", id="block_n-8"),
    pytest.param(dict(block_n=32, block_k=32, split_k=0), r"split_k", id="split_k-0"),
    pytest.param(dict(block_n=32, block_k=32, group_m=0), r"group_m", id="group_m-0"),
    pytest.param(dict(block_n=32.0, block_k=32), r"^block_n: expected an int", id="float"),
    pytest.param(dict(block_n=32, block_k=32, split_k=True), r"^split_k: expected an int", id="bool"),
])
def test_gemm_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        GemmConfig(**kwargs)


def test_gemm_config_to_dict_round_trip():
    assert GemmConfig(**CFG_B.to_dict()) == CFG_B
    assert CFG_B.to_dict()["group_m"] == 8


# --------------------------------------------------------------------------------------
# moe_cost
# --------------------------------------------------------------------------------------


def test_moe_cost_by_hand():
    # T=2 tokens, H=64, I=32, top_k=2, 3 distinct experts.  One expert holds
    # 2I*H + H*I = 4096 + 2048 = 6144 weights.
    # bf16: 3 * 6144 * 2 = 36864 weight bytes, + 2*T*H*2 = 512 (hidden in, out out),
    #       + 8*T*top_k = 32 (router weights and ids) = 37408 bytes;
    #       FLOPs 2 * T*top_k * 6144 = 49152.
    assert moe_cost(2, 64, 32, 2, 3, "bf16") == (37408, 49152)
    # int4: 6144 / 2 = 3072 bytes of nibbles + 6144 / 32 = 192 scales * 2 bytes = 384,
    #       3 * 3456 = 10368, + 512 + 32 = 10912 bytes; same FLOPs.
    assert moe_cost(2, 64, 32, 2, 3, "int4") == (10912, 49152)
    # group 16 with fp32 scales: 3072 + 384 * 4 = 4608 per expert; fp32 activations: 2*2*64*4 = 1024
    assert moe_cost(2, 64, 32, 2, 3, "int4", elem_bytes=4, group_size=16, scale_bytes=4) == \
        (3 * 4608 + 1024 + 32, 49152)
    # dense weights are in the activations' dtype: fp32 ones move 4 bytes each
    assert moe_cost(2, 64, 32, 2, 3, "bf16", elem_bytes=4) == (3 * 6144 * 4 + 1024 + 32, 49152)
    # no tokens, no experts touched: nothing moves
    assert moe_cost(0, 64, 32, 2, 0, "bf16") == (0, 0)
    with pytest.raises(ValueError, match="weights"):
        moe_cost(2, 64, 32, 2, 3, "fp8")
    with pytest.raises(ValueError, match="moe_cost"):
        moe_cost(2, 0, 32, 2, 3, "bf16")
