"""Model presets: each one is a Hugging Face `config.json` dict (the real one, or the real one with
fields overridden), turned into a `K3Config` by `get_preset`.

| preset               | what                                                                  |
| -------------------- | --------------------------------------------------------------------- |
| k3-full              | Kimi K3's published text config (2.78T params; planning, multi-host)  |
| k3-tiny              | every K3 structural feature, seconds on 2 CPU cores                   |
| k3-small             | smallest K3 every Pallas kernel takes (CPU interpret-mode parity)     |
| k3-h200              | 12 layers at K3's real per-layer shapes, 448 MXFP4 experts (~106 GB)  |
| k3-h200x2            | as k3-h200 with all 896 experts, for 2 GPUs expert-parallel           |
| k3-h200x4            | 20 layers, all 896 experts, for 4 GPUs ep=4 (~104 GB per GPU)         |
| k3-h200x8            | 30 layers, all 896 experts, for 8 GPUs ep=8 (~97 GB per GPU)          |
| kimi-linear-48b      | Kimi-Linear-48B-A3B's published config                                |
| kimi-linear-48b-h200 | Kimi-Linear-48B-A3B at its real widths, layers cut to fit one H200    |
| kimi-linear-tiny     | Kimi-Linear structure (no latent MoE, SiLU, no AttnRes), CPU-sized    |
"""

from __future__ import annotations

import copy
from typing import Any

from k3jax.config import ConfigError, K3Config


def _layers(n: int, mla_every: int = 4) -> dict[str, list[int]]:
    """K3's 1-indexed layer split: MLA on every `mla_every`-th layer and on the last one."""
    full = sorted({i for i in range(mla_every, n + 1, mla_every)} | {n})
    return {"full_attn_layers": full, "kda_layers": [i for i in range(1, n + 1) if i not in full]}


# Kimi K3 (moonshotai/Kimi-K3 config.json; the fields the text decoder reads).
K3_FULL: dict[str, Any] = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "kimi_linear",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12,
        "eos_token_id": 163586,
        "first_k_dense_replace": 1,
        "hidden_act": "situ",
        "hidden_size": 7168,
        "intermediate_size": 33792,
        "kv_lora_rank": 512,
        "latent_moe_use_norm": True,
        "linear_attn_config": {
            **_layers(93),
            "gate_lower_bound": -5.0,
            "head_dim": 128,
            "num_heads": 96,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
        "max_position_embeddings": 1048576,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "moe_intermediate_size": 3072,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 96,
        "num_expert_group": 1,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_hidden_layers": 93,
        "num_key_value_heads": 96,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": 2,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "quantization_config": {"format": "mxfp4-pack-quantized", "quant_method": "compressed-tensors"},
        "rms_norm_eps": 1e-05,
        "routed_expert_hidden_size": 3584,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "use_grouped_topk": True,
        "v_head_dim": 128,
        "vocab_size": 163840,
    },
    "vision_config": {"patch_size": 14, "vt_hidden_size": 1152},
}

# Kimi-Linear-48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct config.json, decoder fields).
KIMI_LINEAR_48B: dict[str, Any] = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    "max_position_embeddings": 1048576,
    "mla_use_nope": True,
    "moe_intermediate_size": 1024,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32,
    "num_expert_group": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_hidden_layers": 27,
    "num_key_value_heads": 32,
    "num_shared_experts": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_grouped_topk": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}


def _k3(**text_overrides: Any) -> dict[str, Any]:
    """The K3 wrapper config with `text_config` fields overridden (linear_attn_config merged)."""
    cfg = copy.deepcopy(K3_FULL)
    text = cfg["text_config"]
    la = text_overrides.pop("linear_attn_config", {})
    text.update(text_overrides)
    text["linear_attn_config"].update(la)
    return cfg


def _kimi_linear(**overrides: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(KIMI_LINEAR_48B)
    la = overrides.pop("linear_attn_config", {})
    cfg.update(overrides)
    cfg["linear_attn_config"].update(la)
    return cfg


_TINY_K3 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=9,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    num_experts=16, num_experts_per_token=4, moe_intermediate_size=32, routed_expert_hidden_size=32,
    attn_res_block_size=4, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    linear_attn_config={**_layers(9), "num_heads": 4, "head_dim": 16},
)

PRESETS: dict[str, dict[str, Any]] = {
    "k3-full": K3_FULL,
    # 9 layers: dense layer 0, MLA at 1-indexed 4, 8 and the extra final 9; AttnRes blocks of 4
    # leave a partial final block (layer 8 alone); 2 shared experts; latent 32 < hidden 64.
    "k3-tiny": _k3(**_TINY_K3),
    # The smallest K3 whose every decode op has a shape the Pallas kernels take (widths multiples
    # of 512 / 128 / 64, KDA head dim 64, MLA latent 128 + rope 64): whole-model kernel parity on
    # CPU in interpret mode.
    "k3-small": _k3(
        vocab_size=512, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
        num_experts=64, num_experts_per_token=4, moe_intermediate_size=512, routed_expert_hidden_size=512,
        attn_res_block_size=2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        linear_attn_config={**_layers(4), "num_heads": 2, "head_dim": 64}),
    # One full AttnRes block of real-shape layers: 9 KDA + 3 MLA, half the experts.
    "k3-h200": _k3(num_hidden_layers=12, num_experts=448, linear_attn_config=_layers(12)),
    "k3-h200x2": _k3(num_hidden_layers=12, linear_attn_config=_layers(12)),
    # Sized so one GPU's share under pure expert parallelism (experts split, the rest replicated:
    # k3jax.sharding.per_device_param_bytes) is ~97-104 GB of the H200's ~143 GB, leaving room for
    # the decode state at batch 256 and the dequantized-expert temporaries of the MoE layer.
    "k3-h200x4": _k3(num_hidden_layers=20, linear_attn_config=_layers(20)),
    "k3-h200x8": _k3(num_hidden_layers=30, linear_attn_config=_layers(30)),
    "kimi-linear-48b": KIMI_LINEAR_48B,
    "kimi-linear-48b-h200": _kimi_linear(num_hidden_layers=16, linear_attn_config=_layers(16)),
    "kimi-linear-tiny": _kimi_linear(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=32, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        linear_attn_config={**_layers(5), "num_heads": 4, "head_dim": 16}),
}


def get_preset(name: str, **config_changes: Any) -> K3Config:
    """The named preset as a K3Config; `config_changes` override K3Config fields (e.g. expert_format)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    cfg = K3Config.from_hf(PRESETS[name], name=name)
    return cfg.replace(**config_changes) if config_changes else cfg
