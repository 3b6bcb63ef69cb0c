"""Model configuration: a frozen dataclass built from a Hugging Face `config.json` dict.

Two source formats are accepted (see `K3Config.from_hf`):
  * the Kimi K3 wrapper, `{"model_type": "kimi_k3", "text_config": {...}, "vision_config": ...}`;
  * a plain `kimi_linear` text config (Kimi-Linear-48B-A3B: no latent MoE, SiLU, no AttnRes).

Field names are the Hugging Face ones, so a config reads the same here as in `config.json`.
Layer lists in `linear_attn_config` are 1-indexed in the file; `layer_kinds` is 0-indexed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, get_args

LayerKind = Literal["kda", "mla"]
ExpertFormat = Literal["bf16", "mxfp4"]
# MXFP4 experts' byte order in memory (k3jax.mxfp4.to_tiles); "auto": tiles where the widths allow.
ExpertLayout = Literal["auto", "rows", "tiles"]
# The CLIs' expert choice (--experts / --expert-format(s)): a format (MXFP4 in the "auto" layout),
# or MXFP4 in a given layout.
EXPERT_CHOICES = (*get_args(ExpertFormat), "mxfp4-rows", "mxfp4-tiles")
TILE_MULTIPLE = 128     # expert widths (in and out) that tiles need: mxfp4.TILE_COLS, and a multiple of TILE_ROWS

# Fields a Hugging Face config carries that do not change the text decoder's math.
_HF_BOILERPLATE = frozenset({
    "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
    "num_nextn_predict_layers", "topk_method", "use_grouped_topk", "return_dict", "output_attentions",
    "output_hidden_states", "tie_word_embeddings", "model_type", "quantization_config",
    "max_position_embeddings", "kda_implementation", "use_fused_situ_glu", "_attn_implementation",
    "rope_theta", "rope_scaling", "name_or_path", "_name_or_path", "chunk_size_feed_forward",
    "mla_use_nope", "num_key_value_heads", "media_placeholder_token_id",
})
# Wrapper-level keys of the K3 multimodal config that belong to the vision tower.
_WRAPPER_NON_TEXT = frozenset({"vision_config", "text_config", "media_placeholder_token_id",
                               "ignore_index", "image_token_index", "projector_hidden_act",
                               "projector_ln_eps", "mm_hidden_size", "mm_projector_type"})
_LINEAR_ATTN_KEYS = frozenset({"num_heads", "head_dim", "short_conv_kernel_size", "use_full_rank_gate",
                               "gate_lower_bound", "kda_layers", "full_attn_layers"})


class ConfigError(ValueError):
    """A config.json field is missing, unknown or inconsistent; the message names the field."""


@dataclasses.dataclass(frozen=True)
class K3Config:
    """The text decoder's hyper-parameters (Hugging Face names; see module docstring)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int               # dense (layer-0) MLP width
    rms_norm_eps: float
    hidden_act: Literal["situ", "silu"]
    # MLA (full-attention) layers
    num_attention_heads: int
    q_lora_rank: int | None              # None: a single q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int                # "rope" dims, never rotated (mla_use_nope)
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA (linear-attention) layers
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_size: int
    kda_full_rank_gate: bool
    kda_gate_lower_bound: float | None
    layer_kinds: tuple[LayerKind, ...]
    # MoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None  # latent width; None: experts run at hidden_size
    latent_moe_use_norm: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    moe_renormalize: bool
    moe_router_activation_func: Literal["sigmoid", "softmax"]
    num_expert_group: int
    topk_group: int
    routed_scaling_factor: float
    expert_format: ExpertFormat
    # SiTU and Block Attention Residuals
    activation_situ_beta: float
    activation_situ_linear_beta: float | None
    attn_res_block_size: int | None
    # Tokens
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None      # config.json may list several
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20
    name: str = "custom"
    # Not in config.json: how MXFP4 experts are stored in memory ("tiles": mxfp4.to_tiles' order,
    # what the CuTe / Pallas expert kernels stream best; "auto": tiles wherever the widths are
    # multiples of TILE_MULTIPLE, as K3's are; checkpoints keep row order on disk).
    expert_layout: ExpertLayout = "auto"

    # ----------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        """Width of the KDA q/k/v projections (heads x head_dim)."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def moe_hidden_size(self) -> int:
        """Width the routed experts run at: the latent for K3, the hidden size otherwise."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def experts_in_tiles(self) -> bool:
        """Whether the routed experts are held in tiles: expert_layout resolved ("auto": MXFP4
        experts whose widths are multiples of TILE_MULTIPLE)."""
        if self.expert_layout != "auto":
            return self.expert_layout == "tiles"
        return self.expert_format == "mxfp4" and all(
            w % TILE_MULTIPLE == 0 for w in (self.moe_hidden_size, self.moe_intermediate_size))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence id(s), () if the config has none."""
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "mla")

    # ------------------------------------------------------------ parameter counts
    def _layer_params(self, layer: int, *, active: bool) -> int:
        d, n = self.hidden_size, 0
        if self.layer_kinds[layer] == "kda":
            p, hd = self.kda_dim, self.kda_head_dim
            n += 3 * d * p + 3 * p * self.kda_conv_size        # q/k/v and their short convs
            n += d * hd + hd * p + p + self.kda_num_heads       # f_a, f_b, dt_bias, A_log
            n += d * self.kda_num_heads                          # b_proj
            n += d * p if self.kda_full_rank_gate else d * hd + hd * p
            n += hd + p * d                                      # o_norm, o_proj
        else:
            h = self.num_attention_heads
            if self.q_lora_rank:
                n += d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
            else:
                n += d * h * self.qk_head_dim
            n += d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            n += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
            n += h * self.v_head_dim * d
            if self.mla_use_output_gate:
                n += d * h * self.v_head_dim
        if self.is_moe_layer(layer):
            m, e = self.moe_hidden_size, self.num_experts
            n += e * d + e                                       # router + correction bias
            experts = self.num_experts_per_token if active else e
            n += experts * 3 * m * self.moe_intermediate_size
            n += 3 * d * self.moe_intermediate_size * self.num_shared_experts
            if self.routed_expert_hidden_size:
                n += 2 * d * m + (m if self.latent_moe_use_norm else 0)
        else:
            n += 3 * d * self.intermediate_size
        n += 2 * d                                               # input / post-attention norms
        if self.uses_attn_res:
            n += 4 * d                                           # two (norm, pseudo-query) pairs
        return n

    def param_count(self) -> int:
        """All parameters (embedding and lm_head included)."""
        extra = 2 * self.hidden_size if self.uses_attn_res else 0
        return (sum(self._layer_params(i, active=False) for i in range(self.num_hidden_layers))
                + 2 * self.vocab_size * self.hidden_size + self.hidden_size + extra)

    def active_param_count(self) -> int:
        """Parameters one token computes with: top-k experts only; the embedding table is a lookup
        and is not counted (the lm_head is)."""
        extra = 2 * self.hidden_size if self.uses_attn_res else 0
        return (sum(self._layer_params(i, active=True) for i in range(self.num_hidden_layers))
                + self.vocab_size * self.hidden_size + self.hidden_size + extra)

    def expert_bytes(self) -> int:
        """Bytes of one routed expert's three matrices in its storage format."""
        n = 3 * self.moe_hidden_size * self.moe_intermediate_size
        return n * 2 if self.expert_format == "bf16" else n // 2 + n // 32

    # --------------------------------------------------------------- construction
    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, name: str = "custom",
                expert_format: ExpertFormat | None = None) -> K3Config:
        """Builds a config from a parsed `config.json` (K3 wrapper or plain kimi_linear).

        `expert_format` overrides what `quantization_config` implies (MXFP4 when it is
        compressed-tensors `mxfp4-pack-quantized`, else bf16).
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"config must be a dict parsed from config.json, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type == "kimi_k3":
            if "text_config" not in hf:
                raise ConfigError("config has model_type 'kimi_k3' but no 'text_config'")
            unknown = set(hf) - _HF_BOILERPLATE - _WRAPPER_NON_TEXT
            if unknown:
                raise ConfigError(f"unknown field(s) in the kimi_k3 wrapper config: {sorted(unknown)}")
            text = dict(hf["text_config"])
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                text.setdefault(key, hf.get(key))
            if "quantization_config" in hf and "quantization_config" not in text:
                text["quantization_config"] = hf["quantization_config"]
            hf = text
            model_type = hf.get("model_type", "kimi_linear")
        if model_type != "kimi_linear":
            raise ConfigError(f"model_type must be 'kimi_k3' or 'kimi_linear', got {model_type!r}")
        return _from_text_config(hf, name=name, expert_format=expert_format)

    @property
    def activation(self) -> dict[str, Any]:
        """The expert / MLP activation as keyword arguments of k3jax.ops.glu (act, beta, linear_beta)."""
        return {"act": self.hidden_act, "beta": self.activation_situ_beta,
                "linear_beta": self.activation_situ_linear_beta}

    def replace(self, **changes: Any) -> K3Config:
        """A copy with some fields changed, re-validated; ConfigError for a field K3Config lacks."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown config field(s) {sorted(unknown)}; K3Config fields are "
                              f"{', '.join(f.name for f in dataclasses.fields(self))}")
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raises ConfigError naming the first inconsistent field."""
        def need(cond: bool, field: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"{field}: {why}")
        for f in _INT_FIELDS:                   # a float size (64.0) would only fail in jax's shape code
            v = getattr(self, f)
            need(v is None and f in _OPTIONAL_INT_FIELDS or isinstance(v, int) and not isinstance(v, bool),
                 f, f"must be an integer, got {v!r}")
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim",
                  "kda_conv_size", "moe_layer_freq", "max_position_embeddings", *_OPTIONAL_INT_FIELDS):
            v = getattr(self, f)
            need(v is None or v > 0, f, f"must be positive, got {v}")
        for f in ("qk_rope_head_dim", "num_experts", "num_shared_experts", "first_k_dense_replace"):
            need(getattr(self, f) >= 0, f, f"must be >= 0, got {getattr(self, f)}")
        for f in _FLOAT_FIELDS:                 # NaN or inf would only show as NaN logits (token 0)
            v = getattr(self, f)
            need(v is None and f in _OPTIONAL_FLOAT_FIELDS or isinstance(v, (int, float)) and not isinstance(v, bool)
                 and math.isfinite(v), f, f"must be a finite number, got {v!r}")
        for f in ("rms_norm_eps", "routed_scaling_factor"):
            need(getattr(self, f) > 0, f, f"must be positive, got {getattr(self, f)}")
        if not all(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            need(self.intermediate_size > 0, "intermediate_size", f"dense MLP layers need a positive width, "
                 f"got {self.intermediate_size}")
        need(len(self.layer_kinds) == self.num_hidden_layers, "linear_attn_config",
             f"kda_layers + full_attn_layers cover {len(self.layer_kinds)} layers, "
             f"num_hidden_layers is {self.num_hidden_layers}")
        need(self.hidden_act in ("situ", "silu"), "hidden_act", f"must be 'situ' or 'silu', got {self.hidden_act!r}")
        need(self.moe_router_activation_func in ("sigmoid", "softmax"), "moe_router_activation_func",
             f"must be 'sigmoid' or 'softmax', got {self.moe_router_activation_func!r}")
        need(self.expert_format in get_args(ExpertFormat), "expert_format", f"unknown {self.expert_format!r}")
        if self.num_experts:
            need(0 < self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                 f"must be in 1..num_experts ({self.num_experts}), got {self.num_experts_per_token}")
            need(self.num_experts % self.num_expert_group == 0, "num_expert_group",
                 f"{self.num_expert_group} does not divide num_experts {self.num_experts}")
            need(1 <= self.topk_group <= self.num_expert_group, "topk_group",
                 f"must be in 1..num_expert_group ({self.num_expert_group}), got {self.topk_group}")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size",
                 f"routed experts need a positive width, got {self.moe_intermediate_size}")
            if self.topk_group < self.num_expert_group:         # group-limited routing (ops.route)
                group = self.num_experts // self.num_expert_group
                need(group >= 2, "num_expert_group", f"group-limited routing scores each group by its top "
                     f"2 experts; {self.num_expert_group} groups of {self.num_experts} experts hold {group}")
                need(self.num_experts_per_token <= self.topk_group * group, "num_experts_per_token",
                     f"{self.num_experts_per_token} exceeds the {self.topk_group * group} experts of the "
                     f"topk_group={self.topk_group} groups a token may use")
        need(self.expert_layout in get_args(ExpertLayout), "expert_layout",
             f"unknown {self.expert_layout!r} ({' or '.join(get_args(ExpertLayout))})")
        if self.expert_format == "mxfp4":
            for f in ("moe_hidden_size", "moe_intermediate_size"):
                need(getattr(self, f) % 32 == 0, f, f"must be a multiple of 32 for MXFP4 experts, got {getattr(self, f)}")
        if self.expert_layout == "tiles":
            need(self.expert_format == "mxfp4", "expert_layout", "'tiles' is a layout of MXFP4 experts; these are "
                 f"{self.expert_format}")
            for f in ("moe_hidden_size", "moe_intermediate_size"):
                need(getattr(self, f) % TILE_MULTIPLE == 0, f, f"must be a multiple of {TILE_MULTIPLE} for expert_layout='tiles', "
                     f"got {getattr(self, f)}")
        if self.kda_gate_lower_bound is not None:
            need(self.kda_gate_lower_bound < 0, "linear_attn_config.gate_lower_bound", "must be negative")
        if self.attn_res_block_size is not None:
            need(self.attn_res_block_size > 0, "attn_res_block_size", "must be positive")
        if self.hidden_act == "situ":
            need(self.activation_situ_beta > 0, "activation_situ_beta", "must be positive")


_OPTIONAL_FLOAT_FIELDS = ("kda_gate_lower_bound", "activation_situ_linear_beta")
_FLOAT_FIELDS = ("rms_norm_eps", "routed_scaling_factor", "activation_situ_beta", *_OPTIONAL_FLOAT_FIELDS)
_OPTIONAL_INT_FIELDS = ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size")
_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kda_num_heads",
               "kda_head_dim", "kda_conv_size", "num_experts", "num_experts_per_token", "num_shared_experts",
               "moe_intermediate_size", "first_k_dense_replace", "moe_layer_freq", "num_expert_group",
               "topk_group", "max_position_embeddings", *_OPTIONAL_INT_FIELDS)


def _layer_numbers(la: dict, key: str) -> list[int]:
    """linear_attn_config[key]: a list of integer layer numbers (1-indexed); ConfigError otherwise."""
    values = la.get(key, [])
    if not isinstance(values, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
        raise ConfigError(f"linear_attn_config.{key}: must be a list of integer layer numbers, got {values!r}")
    return values


def _from_text_config(hf: dict[str, Any], *, name: str, expert_format: ExpertFormat | None) -> K3Config:
    fields = {f.name for f in dataclasses.fields(K3Config)}
    known = fields | _HF_BOILERPLATE | {
        "linear_attn_config", "num_experts_per_token", "activation_situ_beta",
        "activation_situ_linear_beta", "routed_expert_hidden_size", "latent_moe_use_norm",
        "moe_router_activation_func", "mla_use_output_gate", "moe_renormalize", "head_dim",
        "moe_layer_freq", "first_k_dense_replace", "num_shared_experts", "num_expert_group", "topk_group",
    }
    unknown = sorted(set(hf) - known)
    if unknown:
        raise ConfigError(f"unknown field(s) in the text config: {unknown}")

    def req(key: str) -> Any:
        if hf.get(key) is None:
            raise ConfigError(f"{key}: required field is missing from config.json")
        return hf[key]

    if hf.get("mla_use_nope", True) is not True:
        raise ConfigError("mla_use_nope: only NoPE MLA (mla_use_nope: true) is supported; "
                          "K3 and Kimi-Linear apply no rotary embedding")
    heads = req("num_attention_heads")
    if hf.get("num_key_value_heads", heads) != heads:
        raise ConfigError(f"num_key_value_heads: MLA needs num_key_value_heads == num_attention_heads "
                          f"({heads}), got {hf['num_key_value_heads']}")
    la = hf.get("linear_attn_config")
    if la is None:
        raise ConfigError("linear_attn_config: required (KDA layer layout) but missing")
    unknown = sorted(set(la) - _LINEAR_ATTN_KEYS)
    if unknown:
        raise ConfigError(f"linear_attn_config: unknown field(s) {unknown}")
    n_layers = req("num_hidden_layers")
    kda, full = _layer_numbers(la, "kda_layers"), _layer_numbers(la, "full_attn_layers")
    overlap = set(kda) & set(full)
    if overlap:
        raise ConfigError(f"linear_attn_config: layers {sorted(overlap)} are in both kda_layers and full_attn_layers")
    covered = sorted(kda + full)
    if covered != list(range(1, n_layers + 1)):
        missing = sorted(set(range(1, n_layers + 1)) - set(covered))
        extra = sorted(set(covered) - set(range(1, n_layers + 1)))
        raise ConfigError(f"linear_attn_config: kda_layers + full_attn_layers (1-indexed) must cover "
                          f"1..{n_layers} exactly; missing {missing}, out of range {extra}")
    kinds = tuple("kda" if i + 1 in set(kda) else "mla" for i in range(n_layers))

    act = req("hidden_act")
    if expert_format is None:
        q = hf.get("quantization_config") or {}
        expert_format = "mxfp4" if (q.get("quant_method") == "compressed-tensors"
                                    and "mxfp4" in str(q.get("format", ""))) else "bf16"
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):           # every id kept: a generation stops at any of them
        eos = eos[0] if len(eos) == 1 else tuple(eos) or None
    cfg = K3Config(
        vocab_size=req("vocab_size"), hidden_size=req("hidden_size"), num_hidden_layers=n_layers,
        intermediate_size=req("intermediate_size"), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        hidden_act=act, num_attention_heads=heads, q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=req("kv_lora_rank"), qk_nope_head_dim=req("qk_nope_head_dim"),
        qk_rope_head_dim=req("qk_rope_head_dim"), v_head_dim=req("v_head_dim"),
        mla_use_output_gate=bool(hf.get("mla_use_output_gate", False)),
        kda_num_heads=la.get("num_heads", heads), kda_head_dim=la.get("head_dim", 128),
        kda_conv_size=la.get("short_conv_kernel_size", 4),
        kda_full_rank_gate=bool(la.get("use_full_rank_gate", False)),
        kda_gate_lower_bound=(None if la.get("gate_lower_bound") is None else float(la["gate_lower_bound"])),
        layer_kinds=kinds,
        num_experts=hf.get("num_experts") or 0,
        num_experts_per_token=hf.get("num_experts_per_token") or 0,
        num_shared_experts=hf.get("num_shared_experts") or 0,
        moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
        routed_expert_hidden_size=hf.get("routed_expert_hidden_size"),
        latent_moe_use_norm=bool(hf.get("latent_moe_use_norm", False)),
        first_k_dense_replace=hf.get("first_k_dense_replace", 0),
        moe_layer_freq=hf.get("moe_layer_freq", 1),
        moe_renormalize=bool(hf.get("moe_renormalize", True)),
        moe_router_activation_func=hf.get("moe_router_activation_func", "sigmoid"),
        num_expert_group=hf.get("num_expert_group") or 1, topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        expert_format=expert_format,
        activation_situ_beta=float(hf.get("activation_situ_beta") or 1.0),
        activation_situ_linear_beta=(None if hf.get("activation_situ_linear_beta") is None
                                     else float(hf["activation_situ_linear_beta"])),
        attn_res_block_size=hf.get("attn_res_block_size"),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=eos, pad_token_id=hf.get("pad_token_id"),
        max_position_embeddings=hf.get("max_position_embeddings", 1 << 20), name=name,
    )
    cfg.validate()
    return cfg


def expected_unique_experts(cfg: K3Config, tokens: int) -> float:
    """Expected number of distinct experts `tokens` tokens touch under uniform routing."""
    if not cfg.num_experts:
        return 0.0
    e, k = cfg.num_experts, cfg.num_experts_per_token
    return e * (1.0 - math.pow(1.0 - k / e, tokens))


def expert_changes(choice: str | None) -> dict[str, str]:
    """The K3Config changes one of EXPERT_CHOICES asks for (None: the preset's own experts)."""
    if choice is None:
        return {}
    if choice not in EXPERT_CHOICES:
        raise ConfigError(f"unknown expert choice {choice!r}; one of {', '.join(EXPERT_CHOICES)}")
    fmt, _, layout = choice.partition("-")
    return {"expert_format": fmt, "expert_layout": layout or "auto"}


def expert_label(cfg: K3Config) -> str:
    """A config's experts as the one of EXPERT_CHOICES that names them exactly (MXFP4 with its layout)."""
    if cfg.expert_format != "mxfp4":
        return cfg.expert_format
    return "mxfp4-tiles" if cfg.experts_in_tiles else "mxfp4-rows"
