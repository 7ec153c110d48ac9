"""Model configs and per-rank shapes: shipped configs parse to the published shapes, and
every malformed config is refused with a message naming the key."""

from __future__ import annotations

import copy
import json
import math

import pytest

from microbench.layout import ParallelLayout, rank_shapes
from microbench.models import ConfigError, ModelConfig, list_models, load_model

from .helpers import shipped_json


@pytest.fixture(scope="module")
def kimi() -> ModelConfig:
    return load_model("kimi-k2.5")


@pytest.fixture(scope="module")
def deepseek() -> ModelConfig:
    return load_model("deepseek-v3")


# --------------------------------------------------------------------------------------
# Shipped model configs
# --------------------------------------------------------------------------------------

_COMMON = dict(hidden_size=7168, num_hidden_layers=61, q_lora_rank=1536, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts_per_tok=8,
               moe_intermediate_size=2048, intermediate_size=18432, n_shared_experts=1,
               scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, moe_layer_freq=1)
_KIMI = dict(_COMMON, name="kimi-k2.5", num_attention_heads=64, n_routed_experts=384,
             first_k_dense_replace=1, vocab_size=163840, n_group=1, topk_group=1,
             routed_scaling_factor=2.827, rms_norm_eps=1e-5)
_DEEPSEEK = dict(_COMMON, name="deepseek-v3", num_attention_heads=128, n_routed_experts=256,
                 first_k_dense_replace=3, vocab_size=129280, n_group=8, topk_group=4,
                 routed_scaling_factor=2.5, rms_norm_eps=1e-6)


@pytest.mark.parametrize("name, expected", [("kimi-k2.5", _KIMI), ("deepseek-v3", _DEEPSEEK)])
def test_shipped_config_fields(name: str, expected: dict) -> None:
    model = load_model(name)
    for key, value in expected.items():
        assert getattr(model, key) == value, key
    assert model.qk_head_dim == 192
    assert model.kv_cache_dim == 576
    assert model.n_dense_layers == expected["first_k_dense_replace"]
    assert model.n_moe_layers == 61 - expected["first_k_dense_replace"]


def test_moe_layer_freq_follows_the_hf_rule() -> None:
    # HF DeepseekV3: layer i routes when i >= first_k_dense_replace and i % moe_layer_freq == 0
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"].update(num_hidden_layers=62, first_k_dense_replace=1, moe_layer_freq=2)
    model = ModelConfig.from_hf(raw, name="k")
    assert model.moe_layer_freq == 2
    assert (model.n_moe_layers, model.n_dense_layers) == (30, 32)  # layers 2, 4, ..., 60 route; the rest are dense


def test_no_shared_experts_and_no_dense_layers() -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"].update(n_shared_experts=0, first_k_dense_replace=0)
    model = ModelConfig.from_hf(raw, name="k")
    assert (model.n_shared_experts, model.n_dense_layers, model.n_moe_layers) == (0, 0, 61)
    s = rank_shapes(model, ParallelLayout(tp=8))
    assert (s.shared_intermediate_per_rank, s.dense_intermediate_per_rank) == (0, 0)


def test_list_models() -> None:
    assert list_models() == ["deepseek-v3", "kimi-k2.5"]


def test_kimi_quantization_is_int4_group32(kimi: ModelConfig) -> None:
    q = kimi.quant
    assert (q.routed_experts, q.group_size, q.symmetric, q.scale_dtype, q.other) == ("int4", 32, True, "bf16", "bf16")
    assert q.routed_bits == 4 and "compressed-tensors" in q.source


def test_deepseek_quantization_is_fp8_block(deepseek: ModelConfig) -> None:
    q = deepseek.quant
    assert (q.routed_experts, q.other, q.weight_block) == ("fp8", "fp8", (128, 128))
    assert q.group_size is None and q.scale_dtype == "fp32"


def test_no_quantization_config_means_bf16() -> None:
    raw = shipped_json("models", "deepseek-v3")
    del raw["quantization_config"]
    q = ModelConfig.from_hf(raw, name="plain").quant
    assert (q.routed_experts, q.other, q.group_size) == ("bf16", "bf16", None)


def test_ignored_experts_stay_bf16() -> None:
    # The ignore list decides: ignoring every MLP makes the routed experts unquantised.
    raw = shipped_json("models", "kimi-k2.5")
    raw["quantization_config"]["ignore"].append("re:.*mlp.*")
    assert ModelConfig.from_hf(raw, name="k").quant.routed_experts == "bf16"


@pytest.mark.parametrize("entry, routed", [
    ("down_proj", "bf16"),  # a trailing component of every expert's down projection
    ("proj", "int4"),  # a plain entry is a whole dotted component, not any suffix of the name
    (r"re:.*layers\.0\..*", "int4"),  # the dense layer 0 left unquantised says nothing of the experts
])
def test_ignore_entries_match_whole_components_of_the_first_moe_layer(entry: str, routed: str) -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["quantization_config"]["ignore"].append(entry)
    assert ModelConfig.from_hf(raw, name="k").quant.routed_experts == routed


def test_compressed_tensors_fp8_blocks_and_quantised_attention() -> None:
    # every Linear but lm_head in FP8 128x128 blocks: experts and attention alike; the
    # group_size a block scheme carries along is not a scale group
    raw = shipped_json("models", "kimi-k2.5")
    qc = raw["quantization_config"]
    qc["config_groups"]["group_0"]["weights"].update(num_bits=8, type="float", strategy="block",
                                                     block_structure=[128, 128])
    qc["ignore"] = ["lm_head"]
    q = ModelConfig.from_hf(raw, name="k").quant
    assert (q.routed_experts, q.other, q.weight_block, q.group_size) == ("fp8", "fp8", (128, 128), None)


def test_flat_form_and_nested_quantization_config() -> None:
    raw = shipped_json("models", "kimi-k2.5")
    flat = dict(raw["text_config"], quantization_config=raw["quantization_config"])
    model = ModelConfig.from_hf(flat, name="flat")
    assert model.num_attention_heads == 64 and model.quant.routed_experts == "int4"
    # quantization_config inside text_config, none at top level
    nested = copy.deepcopy(raw)
    nested["text_config"]["quantization_config"] = nested.pop("quantization_config")
    assert ModelConfig.from_hf(nested, name="n").quant.group_size == 32


def test_q_lora_rank_null_accepted() -> None:
    raw = shipped_json("models", "deepseek-v3")
    raw["q_lora_rank"] = None
    model = ModelConfig.from_hf(raw, name="no-q-lora")
    assert model.q_lora_rank is None
    assert rank_shapes(model, ParallelLayout(tp=8)).q_lora_rank is None


def test_from_path_names_by_stem(tmp_path) -> None:
    path = tmp_path / "my-model.json"
    path.write_text(json.dumps(shipped_json("models", "deepseek-v3")))
    assert ModelConfig.from_hf(path).name == "my-model"
    assert load_model(str(path)).num_attention_heads == 128
    folder = tmp_path / "SomeModel"
    folder.mkdir()
    (folder / "config.json").write_text(path.read_text())
    assert ModelConfig.from_hf(folder).name == "SomeModel"


# --------------------------------------------------------------------------------------
# Bad model configs: each message names the key (and the file)
# --------------------------------------------------------------------------------------

def test_missing_key_named() -> None:
    raw = shipped_json("models", "kimi-k2.5")
    del raw["text_config"]["kv_lora_rank"]
    with pytest.raises(ConfigError, match=r"^kimi-k2\.5\.json: missing key 'kv_lora_rank'$"):
        ModelConfig.from_hf(raw, name="kimi-k2.5.json")


def test_missing_key_in_file_names_file(tmp_path) -> None:
    raw = shipped_json("models", "deepseek-v3")
    del raw["moe_intermediate_size"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"broken\.json: missing key 'moe_intermediate_size'"):
        load_model(str(path))


def test_q_lora_rank_may_be_null_but_not_missing() -> None:
    # null: a direct query projection; absent: a key the config lost, named like any other
    raw = shipped_json("models", "deepseek-v3")
    del raw["q_lora_rank"]
    with pytest.raises(ConfigError, match=r"^d: missing key 'q_lora_rank'$"):
        ModelConfig.from_hf(raw, name="d")


def test_text_config_must_be_an_object() -> None:
    with pytest.raises(ConfigError, match=r"^k: key 'text_config' must be an object$"):
        ModelConfig.from_hf({"text_config": ["hidden_size"]}, name="k")


@pytest.mark.parametrize("key, value, pattern", [
    ("hidden_size", 0, r"'hidden_size' must be positive, got 0"),
    ("num_attention_heads", -64, r"'num_attention_heads' must be positive"),
    ("rms_norm_eps", 0.0, r"'rms_norm_eps' must be positive"),
    ("n_shared_experts", -1, r"'n_shared_experts' must be >= 0"),
    ("hidden_size", "7168", r"'hidden_size' must be an integer, got str"),
    ("vocab_size", 163840.0, r"'vocab_size' must be an integer, got float"),
    ("n_routed_experts", True, r"'n_routed_experts' must be an integer, got bool"),
    ("norm_topk_prob", 1, r"'norm_topk_prob' must be true or false"),
    ("scoring_func", 3, r"'scoring_func' must be a non-empty string"),
    ("routed_scaling_factor", "2.8", r"'routed_scaling_factor' must be a number"),
    ("num_experts_per_tok", 500, r"num_experts_per_tok=500 exceeds n_routed_experts=384"),
    ("first_k_dense_replace", 62, r"first_k_dense_replace=62 exceeds num_hidden_layers=61"),
    ("n_group", 5, r"n_group=5 does not divide n_routed_experts=384"),
])
def test_bad_values_named(key: str, value, pattern: str) -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"][key] = value
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_hf(raw, name="kimi-k2.5.json")


def test_unsupported_quantization_named() -> None:
    raw = shipped_json("models", "deepseek-v3")
    raw["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(ConfigError, match=r"quant_method 'awq' is not supported"):
        ModelConfig.from_hf(raw, name="d")
    raw = shipped_json("models", "kimi-k2.5")
    raw["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 3
    with pytest.raises(ConfigError, match=r"num_bits=3"):
        ModelConfig.from_hf(raw, name="k")


@pytest.mark.parametrize("where, value, pattern", [
    ("ignore", [1, 2], r"ignore a list of strings, got ignore=\[1, 2\]"),
    ("ignore", "lm_head", r"ignore a list of strings"),
    ("targets", "Linear", r"config_groups\.group_0\.targets must be a list of strings, got 'Linear'"),
    ("targets", [None], r"targets must be a list of strings"),
    ("scale_dtype", "int8", r"key 'scale_dtype' has unsupported dtype 'int8'"),
])
def test_malformed_compressed_tensors_fields_are_named(where: str, value, pattern: str) -> None:
    # a bare string would be matched character by character; a number has no name to match
    raw = shipped_json("models", "kimi-k2.5")
    qc = raw["quantization_config"]
    group = qc["config_groups"]["group_0"]
    {"ignore": qc, "targets": group, "scale_dtype": group["weights"]}[where][where] = value
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_hf(raw, name="k")


@pytest.mark.parametrize("weights, expected", [
    # INT4 group 32, bf16 scales: [2048, 7168] is 2048 x 224 scales of 2 bytes
    (dict(strategy="group", group_size=32), 2048 * 7168 / 2 + 2048 * 224 * 2),
    # fp32 scales are counted at their own size
    (dict(strategy="group", group_size=32, scale_dtype="float32"), 2048 * 7168 / 2 + 2048 * 224 * 4),
    # per channel: one scale per output row
    (dict(strategy="channel", group_size=None), 2048 * 7168 / 2 + 2048 * 2),
])
def test_matrix_bytes_count_each_schemes_scales(weights: dict, expected: float) -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    q = ModelConfig.from_hf(raw, name="k").quant
    assert q.matrix_bytes(2048, 7168) == expected
    # unquantised storage: elements only; attention in FP8 beside INT4 experts: a scale per row
    assert q.matrix_bytes(2048, 7168, "bf16") == 2048 * 7168 * 2
    assert q.matrix_bytes(2048, 7168, "fp8") == 2048 * 7168 + 2048 * (4 if "scale_dtype" in weights else 2)


def test_fp8_blocks_count_partial_blocks_and_fp16_models_are_priced(deepseek: ModelConfig) -> None:
    # [576, 7168] in 128 x 128 blocks: 5 block rows (the last one partial) x 56, fp32 scales
    assert deepseek.quant.matrix_bytes(576, 7168) == 576 * 7168 + 5 * 56 * 4
    raw = shipped_json("models", "deepseek-v3")
    del raw["quantization_config"]
    raw["torch_dtype"] = "float16"
    q = ModelConfig.from_hf(raw, name="half").quant
    assert (q.routed_experts, q.routed_bits, q.matrix_bytes(4, 8)) == ("fp16", 16, 64)


@pytest.mark.parametrize("name, factor", [("kimi-k2.5", 64), ("deepseek-v3", 40)])
def test_softmax_scale_carries_yarns_attention_factor(name: str, factor: int) -> None:
    # HF DeepseekV3Attention: 192^-0.5 x mscale^2, mscale = 0.1 x mscale_all_dim x ln(factor) + 1
    m = load_model(name)
    assert m.softmax_scale == pytest.approx((0.1 * math.log(factor) + 1) ** 2 / math.sqrt(192))


@pytest.mark.parametrize("rope_scaling, expected", [
    (None, 1.0),
    ({"type": "linear", "factor": 4.0}, 1.0),  # only YaRN sharpens the softmax
    ({"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0}, 1.0),  # mscale_all_dim 0: no factor
    ({"rope_type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0}, 1.0),  # no extension, no factor
    ({"type": "yarn", "factor": math.e, "mscale_all_dim": 0.5}, 1.05 ** 2),
])
def test_attention_mscale_cases(rope_scaling, expected: float) -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"]["rope_scaling"] = rope_scaling
    assert ModelConfig.from_hf(raw, name="k").attention_mscale == pytest.approx(expected)


@pytest.mark.parametrize("rope_scaling, pattern", [
    ("yarn", r"key 'rope_scaling' must be an object or null"),
    ({"type": "yarn", "mscale_all_dim": 1.0}, r"rope_scaling: missing key 'factor'|key 'factor'"),
    ({"type": "yarn", "factor": 64, "mscale_all_dim": "one"}, r"'mscale_all_dim' must be a number >= 0"),
])
def test_bad_rope_scaling_is_named(rope_scaling, pattern: str) -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"]["rope_scaling"] = rope_scaling
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_hf(raw, name="k")


def test_invalid_json_file(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"hidden_size": 7168,,}')
    with pytest.raises(ConfigError, match=r"bad\.json: invalid JSON at line 1"):
        load_model(str(path))
    with pytest.raises(ConfigError, match=r"no such file"):
        load_model(str(tmp_path / "absent.json"))


def test_unknown_model_lists_shipped_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'llama-9'.*deepseek-v3, kimi-k2\.5"):
        load_model("llama-9")


# --------------------------------------------------------------------------------------
# Per-rank shapes
# --------------------------------------------------------------------------------------

def test_kimi_tp8_shapes(kimi: ModelConfig) -> None:
    s = rank_shapes(kimi, ParallelLayout(tp=8))
    assert ((s.heads_per_rank, s.q_head_dim, s.kv_cache_dim, s.kv_lora_rank, s.qk_rope_head_dim)
            == (8, 192, 576, 512, 64))
    assert (s.v_head_dim, s.hidden, s.q_lora_rank, s.top_k) == (128, 7168, 1536, 8)
    assert s.experts_per_rank == 384 and s.moe_intermediate_per_rank == 256
    assert s.shared_intermediate_per_rank == 256 and s.dense_intermediate_per_rank == 2304
    assert s.vocab_per_rank == 20480 and s.allreduce_bytes_per_token == 14336
    assert s.as_dict()["model"] == "kimi-k2.5" and s.as_dict()["tp"] == 8


def test_kimi_ep8_owns_whole_experts(kimi: ModelConfig) -> None:
    s = rank_shapes(kimi, ParallelLayout(tp=8, ep=8))
    assert s.experts_per_rank == 48 and s.moe_intermediate_per_rank == 2048
    assert s.heads_per_rank == 8 and s.shared_intermediate_per_rank == 256


def test_deepseek_tp8_shapes(deepseek: ModelConfig) -> None:
    s = rank_shapes(deepseek, ParallelLayout(tp=8))
    assert (s.heads_per_rank, s.experts_per_rank, s.vocab_per_rank) == (16, 256, 16160)
    assert rank_shapes(deepseek, ParallelLayout()).heads_per_rank == 128


def test_tp_not_dividing_heads(kimi: ModelConfig) -> None:
    with pytest.raises(ConfigError, match=r"^tp=7 does not divide num_attention_heads=64$"):
        rank_shapes(kimi, ParallelLayout(tp=7))


def test_tp_not_dividing_vocab() -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"]["vocab_size"] = 163841
    with pytest.raises(ConfigError, match=r"^tp=8 does not divide vocab_size=163841$"):
        rank_shapes(ModelConfig.from_hf(raw, name="k"), ParallelLayout(tp=8))


def test_shared_experts_are_tp_sharded_together() -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"]["n_shared_experts"] = 2
    model = ModelConfig.from_hf(raw, name="k")
    for ep in (1, 8):  # 2 x 2048 / 8, whether the routed experts are TP-sharded or EP-distributed
        assert rank_shapes(model, ParallelLayout(tp=8, ep=ep)).shared_intermediate_per_rank == 512


def test_ep_not_dividing_experts(kimi: ModelConfig) -> None:
    with pytest.raises(ConfigError, match=r"ep=5 does not divide n_routed_experts=384"):
        rank_shapes(kimi, ParallelLayout(tp=5, ep=5))


def test_ep_must_be_one_or_tp(kimi: ModelConfig) -> None:
    with pytest.raises(ConfigError, match=r"ep=4 must be 1 .* or equal tp=8"):
        rank_shapes(kimi, ParallelLayout(tp=8, ep=4))


def test_tp_must_keep_whole_scale_groups(kimi: ModelConfig) -> None:
    # 2048 / 128 = 16 rows per rank: half an INT4 group of 32 per rank.
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"].update(num_attention_heads=128, vocab_size=163840)
    wide = ModelConfig.from_hf(raw, name="wide")
    with pytest.raises(ConfigError,
                       match=r"moe_intermediate_per_rank=16 is not a multiple of the int4 scale group of 32"):
        rank_shapes(wide, ParallelLayout(tp=128))


def test_tp_must_keep_whole_fp8_blocks_along_k() -> None:
    # weight_block_size is [N, K]: the down projection's K, 2048 / 32 = 64 per rank, is half a block
    raw = shipped_json("models", "deepseek-v3")
    raw["quantization_config"]["weight_block_size"] = [64, 128]
    model = ModelConfig.from_hf(raw, name="d")
    assert model.quant.weight_block == (64, 128)
    with pytest.raises(ConfigError, match=r"^moe_intermediate_per_rank=64 is not a multiple of the fp8 scale group "
                                          r"of 128 \(tp=32\)$"):
        rank_shapes(model, ParallelLayout(tp=32))


def test_fp8_blocks_are_whole_along_n_too_and_in_the_shared_expert_and_dense_mlp() -> None:
    deepseek = load_model("deepseek-v3")
    # EP keeps each routed expert whole, but the TP-sharded shared expert (2048 / 32) and
    # dense MLP (18432 / 32 = 576) would split 128-wide blocks
    with pytest.raises(ConfigError, match=r"^shared_intermediate_per_rank=64 is not a multiple of the fp8 "
                                          r"scale group of 128 \(tp=32\)$"):
        rank_shapes(deepseek, ParallelLayout(tp=32, ep=32))
    raw = shipped_json("models", "deepseek-v3")
    raw["n_shared_experts"] = 2  # 4096 / 32: whole blocks; the dense MLP's 576 is not
    with pytest.raises(ConfigError, match=r"^dense_intermediate_per_rank=576 is not a multiple"):
        rank_shapes(ModelConfig.from_hf(raw, name="d"), ParallelLayout(tp=32, ep=32))
    # the gate/up projection's N is the per-rank intermediate as well: 2048 / 8 = 256 is
    # whole 128-wide K blocks but not whole 512-tall N blocks
    raw = shipped_json("models", "deepseek-v3")
    raw["quantization_config"]["weight_block_size"] = [512, 128]
    with pytest.raises(ConfigError, match=r"^moe_intermediate_per_rank=256 is not a multiple of the fp8 scale "
                                          r"group of 512 \(tp=8\)$"):
        rank_shapes(ModelConfig.from_hf(raw, name="d"), ParallelLayout(tp=8))
    assert rank_shapes(deepseek, ParallelLayout(tp=16)).shared_intermediate_per_rank == 128


@pytest.mark.parametrize("block", [[128], ["a", "b"], [128, 0], "128x128"])
def test_a_bad_block_structure_is_named(block) -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        num_bits=8, type="float", strategy="block", block_structure=block)
    with pytest.raises(ConfigError, match=r"^k: key 'block_structure' must be two positive integers"):
        ModelConfig.from_hf(raw, name="k")


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_an_unsupported_dtype_names_the_key_the_config_uses(key: str) -> None:
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"].pop("torch_dtype", None)
    raw["text_config"].pop("dtype", None)
    raw["text_config"][key] = "int8"
    with pytest.raises(ConfigError, match=rf"^k: key '{key}' has unsupported dtype 'int8'$"):
        ModelConfig.from_hf(raw, name="k")


@pytest.mark.parametrize("top, text, expected", [
    ({"torch_dtype": "float16"}, {"dtype": "bfloat16"}, "bf16"),         # text model's key wins
    ({"dtype": "float16"}, {}, "fp16"),                                  # top level when text names none
    ({}, {"torch_dtype": "float16", "dtype": "bfloat16"}, "fp16"),       # torch_dtype wins within one object
    ({}, {}, "bf16"),                                                    # neither: bfloat16
])
def test_dtype_precedence(top: dict, text: dict, expected: str) -> None:
    raw = shipped_json("models", "kimi-k2.5")
    del raw["quantization_config"]
    for d in (raw, raw["text_config"]):
        d.pop("torch_dtype", None)
        d.pop("dtype", None)
    raw.update(top)
    raw["text_config"].update(text)
    q = ModelConfig.from_hf(raw, name="k").quant
    assert (q.routed_experts, q.other) == (expected, expected)


@pytest.mark.parametrize("ignored, routed", [(1, "int4"), (2, "bf16")])
def test_the_experts_scheme_is_read_at_the_first_routed_layer(ignored: int, routed: str) -> None:
    # first_k_dense_replace 1 and moe_layer_freq 2: layer 1 is dense, layer 2 the first routed one
    raw = shipped_json("models", "kimi-k2.5")
    raw["text_config"].update(moe_layer_freq=2)
    raw["quantization_config"]["ignore"].append(rf"re:.*layers\.{ignored}\.mlp\..*")
    assert ModelConfig.from_hf(raw, name="k").quant.routed_experts == routed


@pytest.mark.parametrize("tp, ep", [(0, 1), (1, 0), (-8, 1), (2.0, 1), (True, 1)])
def test_layout_rejects_non_positive(tp, ep) -> None:
    with pytest.raises(ConfigError, match=r"ParallelLayout: (tp|ep) must be a positive integer"):
        ParallelLayout(tp=tp, ep=ep)
