"""Config parsing, preset validation errors and parameter counts."""

import copy
import re

import pytest

from k3jax.config import ConfigError, K3Config
from k3jax.presets import PRESETS, get_preset


def k3_text():
    return copy.deepcopy(PRESETS["k3-full"]["text_config"])


def test_k3_full_param_counts():
    cfg = get_preset("k3-full")
    assert abs(cfg.param_count() / 2.78e12 - 1) < 0.01          # ~2.78T total
    assert abs(cfg.active_param_count() / 104e9 - 1) < 0.01      # ~104B active
    assert cfg.layer_kinds.count("mla") == 24 and cfg.layer_kinds.count("kda") == 69
    assert cfg.mla_layers[-2:] == (91, 92) and cfg.mla_layers[0] == 3
    assert cfg.expert_format == "mxfp4" and not cfg.is_moe_layer(0) and cfg.is_moe_layer(92)


def test_kimi_linear_48b_param_counts():
    cfg = get_preset("kimi-linear-48b")
    assert 48e9 <= cfg.param_count() <= 49.5e9                  # "48B" (49.1B with embeddings)
    assert 2.8e9 <= cfg.active_param_count() <= 3.4e9          # "A3B"
    assert cfg.expert_format == "bf16" and not cfg.uses_attn_res and cfg.hidden_act == "silu"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_parses(name):
    cfg = get_preset(name)
    assert cfg.name == name and len(cfg.layer_kinds) == cfg.num_hidden_layers


def test_tiny_k3_keeps_the_structural_features():
    cfg = get_preset("k3-tiny")
    assert not cfg.is_moe_layer(0) and cfg.layer_kinds[-1] == cfg.layer_kinds[-2] == "mla"
    assert cfg.num_hidden_layers % cfg.attn_res_block_size != 0          # partial final block
    assert cfg.num_shared_experts == 2 and cfg.moe_hidden_size < cfg.hidden_size
    assert cfg.kda_gate_lower_bound == -5.0 and cfg.kda_full_rank_gate


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="unknown preset 'k4'.*k3-tiny.*kimi-linear-tiny"):
        get_preset("k4")


def test_unknown_field_is_named():
    hf = copy.deepcopy(PRESETS["k3-full"])
    hf["text_config"]["rope_dims_of_doom"] = 3
    with pytest.raises(ConfigError, match="rope_dims_of_doom"):
        K3Config.from_hf(hf)
    hf = copy.deepcopy(PRESETS["k3-full"])
    hf["wrapper_thing"] = 1
    with pytest.raises(ConfigError, match="wrapper_thing"):
        K3Config.from_hf(hf)
    text = k3_text()
    text["linear_attn_config"]["chunk"] = 64
    with pytest.raises(ConfigError, match="linear_attn_config.*chunk"):
        K3Config.from_hf(text)


def test_linear_attn_layers_overlap():
    text = k3_text()
    text["linear_attn_config"]["kda_layers"].append(4)
    with pytest.raises(ConfigError, match=r"layers \[4\] are in both"):
        K3Config.from_hf(text)


def test_linear_attn_layer_missing():
    text = k3_text()
    text["linear_attn_config"]["kda_layers"].remove(5)
    with pytest.raises(ConfigError, match=r"missing \[5\]"):
        K3Config.from_hf(text)


def test_layer_lists_must_match_num_hidden_layers():
    text = k3_text()
    text["num_hidden_layers"] = 92
    with pytest.raises(ConfigError, match=r"linear_attn_config.*out of range \[93\]"):
        K3Config.from_hf(text)


def test_wrong_model_type():
    text = k3_text()
    text["model_type"] = "deepseek_v3"
    with pytest.raises(ConfigError, match="model_type.*'deepseek_v3'"):
        K3Config.from_hf(text)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "kv_lora_rank", "hidden_act"])
def test_missing_required_field(field):
    text = k3_text()
    del text[field]
    with pytest.raises(ConfigError, match=f"{field}: required"):
        K3Config.from_hf(text)


def test_missing_linear_attn_config():
    text = k3_text()
    del text["linear_attn_config"]
    with pytest.raises(ConfigError, match="linear_attn_config"):
        K3Config.from_hf(text)


def test_kimi_k3_wrapper_without_text_config():
    hf = copy.deepcopy(PRESETS["k3-full"])
    del hf["text_config"]
    with pytest.raises(ConfigError, match="kimi_k3.*text_config"):
        K3Config.from_hf(hf)


def test_too_many_experts_per_token():
    text = k3_text()
    text["num_experts_per_token"] = 897
    with pytest.raises(ConfigError, match="num_experts_per_token.*897"):
        K3Config.from_hf(text)
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        get_preset("k3-tiny", num_experts_per_token=17)


def test_mxfp4_needs_widths_multiple_of_32():
    text = k3_text()
    text["moe_intermediate_size"] = 3000
    with pytest.raises(ConfigError, match="moe_intermediate_size.*multiple of 32"):
        K3Config.from_hf(text)
    with pytest.raises(ConfigError, match="moe_hidden_size.*multiple of 32"):
        get_preset("k3-tiny", routed_expert_hidden_size=40)
    # bf16 experts have no such constraint
    assert get_preset("k3-tiny", expert_format="bf16", routed_expert_hidden_size=40).moe_hidden_size == 40


def test_expert_layout_auto_is_tiles_where_the_widths_allow():
    """"auto" (the default): tiles for MXFP4 experts whose widths are multiples of 128 (K3's), else rows."""
    assert get_preset("k3-h200").experts_in_tiles and get_preset("k3-full").experts_in_tiles
    assert get_preset("k3-small").experts_in_tiles                       # 512 x 512
    assert not get_preset("k3-tiny").experts_in_tiles                    # 32 x 32
    assert not get_preset("k3-tiny", moe_intermediate_size=128).experts_in_tiles      # latent 32
    assert not get_preset("kimi-linear-48b").experts_in_tiles            # bf16
    assert not get_preset("k3-h200", expert_format="bf16").experts_in_tiles
    assert not get_preset("k3-h200", expert_layout="rows").experts_in_tiles


def test_expert_layout_tiles_needs_mxfp4_and_128_multiples():
    assert get_preset("k3-tiny").expert_layout == "auto"
    cfg = get_preset("k3-tiny", expert_layout="tiles", moe_intermediate_size=128, routed_expert_hidden_size=256)
    assert cfg.expert_layout == "tiles"
    with pytest.raises(ConfigError, match="moe_hidden_size.*multiple of 128 for expert_layout='tiles'"):
        get_preset("k3-tiny", expert_layout="tiles")
    with pytest.raises(ConfigError, match="expert_layout.*MXFP4 experts; these are bf16"):
        get_preset("k3-tiny", expert_layout="tiles", expert_format="bf16")
    with pytest.raises(ConfigError, match="expert_layout.*unknown 'columns'"):
        get_preset("k3-tiny", expert_layout="columns")


def test_expert_choices_map_to_config_changes():
    from k3jax.config import expert_changes, expert_label
    assert expert_changes(None) == {} and expert_changes("bf16") == {"expert_format": "bf16", "expert_layout": "auto"}
    assert expert_changes("mxfp4") == {"expert_format": "mxfp4", "expert_layout": "auto"}
    assert expert_changes("mxfp4-rows") == {"expert_format": "mxfp4", "expert_layout": "rows"}
    changes = expert_changes("mxfp4-tiles")
    assert changes == {"expert_format": "mxfp4", "expert_layout": "tiles"}
    cfg = get_preset("k3-tiny", moe_intermediate_size=128, routed_expert_hidden_size=128, **changes)
    assert expert_label(cfg) == "mxfp4-tiles" and expert_label(get_preset("k3-tiny")) == "mxfp4-rows"
    # a label names its experts exactly: it maps back to the same config
    for preset in ("k3-small", "k3-tiny", "kimi-linear-tiny"):
        label = expert_label(get_preset(preset))
        assert expert_label(get_preset(preset, **expert_changes(label))) == label
    # the bf16 choice on a preset whose MXFP4 experts default to tiles
    assert expert_label(get_preset("k3-small", **expert_changes("bf16"))) == "bf16"
    with pytest.raises(ConfigError, match="unknown expert choice 'fp8'"):
        expert_changes("fp8")


def test_other_validation_errors():
    with pytest.raises(ConfigError, match="gate_lower_bound"):
        get_preset("k3-tiny", kda_gate_lower_bound=1.0)
    with pytest.raises(ConfigError, match="hidden_act"):
        get_preset("k3-tiny", hidden_act="gelu")
    text = k3_text()
    text["mla_use_nope"] = False
    with pytest.raises(ConfigError, match="mla_use_nope"):
        K3Config.from_hf(text)
    with pytest.raises(ConfigError, match="dict"):
        K3Config.from_hf("config.json")


@pytest.mark.parametrize("change,message", [
    ({"rms_norm_eps": -1.0}, "rms_norm_eps: must be positive, got -1.0"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps: must be positive"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor: must be a finite number, got nan"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor: must be a finite number"),
    ({"activation_situ_linear_beta": float("nan")}, "activation_situ_linear_beta: must be a finite number"),
    ({"activation_situ_beta": "1"}, "activation_situ_beta: must be a finite number, got '1'"),
])
def test_float_fields_that_would_only_show_as_nan_logits(change, message):
    """A non-positive eps or a non-finite factor ran to NaN logits, which greedy decoding turns
    into token 0 without a word: refused at the config."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        get_preset("k3-tiny", **change)


def test_plain_text_config_equals_wrapper():
    wrapped = K3Config.from_hf(PRESETS["k3-full"], name="x")
    text = k3_text()
    text.update(bos_token_id=163584, pad_token_id=163839)
    assert K3Config.from_hf(text, name="x") == wrapped


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 64.0}, "hidden_size: must be an integer, got 64.0"),
    ({"num_experts": 8.5}, "num_experts: must be an integer, got 8.5"),
    ({"q_lora_rank": -4}, "q_lora_rank: must be positive, got -4"),
    ({"num_shared_experts": -1}, "num_shared_experts: must be >= 0"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size: routed experts need a positive width"),
    ({"intermediate_size": 0}, "intermediate_size: dense MLP layers need a positive width"),
    ({"num_expert_group": 896, "topk_group": 448}, "num_expert_group: group-limited routing scores each group"),
    ({"num_expert_group": 8, "topk_group": 1}, "num_experts_per_token: 16 exceeds the 112 experts|"),
    ({"num_expert_group": 64, "topk_group": 1}, "num_experts_per_token: 16 exceeds the 14 experts"),
])
def test_inconsistent_sizes_are_named(change, message):
    """Sizes jax would only trip over later (floats, negatives, empty experts, routing groups that
    cannot supply k experts) fail at the config with the field's name."""
    text = {**k3_text(), **change}
    if message.endswith("|"):       # a consistent grouping: accepted
        assert K3Config.from_hf(text).num_expert_group == change["num_expert_group"]
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        K3Config.from_hf(text)


def test_layer_numbers_must_be_integers():
    text = k3_text()
    text["linear_attn_config"] = {**text["linear_attn_config"], "kda_layers": [1.5, 2]}
    with pytest.raises(ConfigError, match=r"linear_attn_config.kda_layers: must be a list of integer layer numbers"):
        K3Config.from_hf(text)
