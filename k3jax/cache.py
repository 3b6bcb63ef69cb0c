"""Decode state: an explicit pytree, preallocated for a maximum length and donated between steps.

Per KDA layer: the last K-1 pre-conv inputs of q|k|v and the recurrent state S [B, H, K, V]
(float32; key channel before value channel, as in transformers — Moonshot's code stores it
transposed). Per MLA layer: the latent cache [B, L, kv_lora_rank + qk_rope_head_dim] (the
normalised latent, then the un-rotated shared key dims). `lengths` [B] counts cached tokens.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from k3jax.config import K3Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDAState:
    """One KDA layer's state: the short-conv window and the recurrent state S."""

    conv: jax.Array       # [B, K-1, 3 * kda_dim], model dtype
    recurrent: jax.Array  # [B, H, K, V], float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLAState:
    """One MLA layer's compressed cache; positions at or past `lengths` are unfilled (masked)."""

    latent: jax.Array     # [B, L, kv_lora_rank + qk_rope_head_dim], model dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The whole decode state: per-sequence lengths and one KDAState / MLAState per decoder layer."""

    lengths: jax.Array                          # [B] int32, tokens cached per sequence
    layers: tuple[KDAState | MLAState, ...]     # one entry per decoder layer

    @property
    def batch_size(self) -> int:
        """B, the number of sequences."""
        return self.lengths.shape[0]


# The MLA cache holds a whole number of CACHE_BLOCK-token blocks: decode-attention kernels tile
# the sequence by 64 tokens (pallas_kernels.mla_decode.BLOCK_L), so a cache of any other length
# would send them to the reference. The extra positions are masked like any unfilled one.
CACHE_BLOCK = 64


def cache_length(max_len: int) -> int:
    """Allocated MLA cache positions for sequences of up to `max_len` tokens."""
    return -(-max_len // CACHE_BLOCK) * CACHE_BLOCK


RECURRENT_DTYPE = jnp.float32     # the KDA recurrent state's, whatever the model's dtype


def _layer_shapes(cfg: K3Config, kind: str, batch_size: int, positions: int) -> dict[str, tuple[int, ...]]:
    """The array shapes of one layer's state (`kind` "kda" or "mla"; MLA caches of `positions`)."""
    if kind == "kda":
        return {"conv": (batch_size, cfg.kda_conv_size - 1, 3 * cfg.kda_dim),
                "recurrent": (batch_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)}
    return {"latent": (batch_size, positions, cfg.kv_lora_rank + cfg.qk_rope_head_dim)}


def init_state(cfg: K3Config, batch_size: int, max_len: int, dtype=jnp.bfloat16) -> DecodeState:
    """Zeroed state for `batch_size` sequences of up to `max_len` tokens (the MLA cache holds
    `cache_length(max_len)` positions); dtype as `from_pretrained` takes it ("bf16", jnp.float32, ...)."""
    from k3jax.weights import parse_dtype     # (weights imports the model, which imports this module)
    if not isinstance(cfg, K3Config):
        raise TypeError(f"init_state takes a K3Config (model.cfg), got {type(cfg).__name__}")
    for name, value in (("batch_size", batch_size), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"init_state: {name} must be an integer >= 1, got {value!r}")
    dtype = parse_dtype(dtype)
    layers = []
    for kind in cfg.layer_kinds:
        shapes = _layer_shapes(cfg, kind, batch_size, cache_length(max_len))
        if kind == "kda":
            layers.append(KDAState(conv=jnp.zeros(shapes["conv"], dtype), recurrent=jnp.zeros(shapes["recurrent"], RECURRENT_DTYPE)))
        else:
            layers.append(MLAState(latent=jnp.zeros(shapes["latent"], dtype)))
    return DecodeState(lengths=jnp.zeros((batch_size,), jnp.int32), layers=tuple(layers))


def state_mismatch(cfg: K3Config, state: DecodeState) -> str | None:
    """Why `state` is not one `init_state(cfg, ...)` makes (any MLA cache length), or None: the
    first layer whose kind, shapes or recurrent dtype differ. The layer count is the caller's check."""
    for i, (kind, layer) in enumerate(zip(cfg.layer_kinds, state.layers)):
        cls = KDAState if kind == "kda" else MLAState
        if not isinstance(layer, cls):
            return f"layer {i} is {kind.upper()} in the config but the state holds a {type(layer).__name__}"
        positions = layer.latent.shape[1] if cls is MLAState and layer.latent.ndim == 3 else 0
        for name, shape in _layer_shapes(cfg, kind, state.batch_size, positions).items():
            got = tuple(getattr(layer, name).shape)
            if got != shape:
                return f"layer {i} ({kind.upper()}) {name} is {list(got)}, the config needs {list(shape)}"
        if cls is KDAState and layer.recurrent.dtype != RECURRENT_DTYPE:
            return f"layer {i} (KDA) recurrent is {layer.recurrent.dtype}, the config needs {jnp.dtype(RECURRENT_DTYPE)}"
    return None


def state_bytes(cfg: K3Config, batch_size: int, max_len: int, dtype_bytes: int = 2) -> int:
    """Bytes `init_state` allocates."""
    return sum(math.prod(shape) * (jnp.dtype(RECURRENT_DTYPE).itemsize if name == "recurrent" else dtype_bytes)
               for kind in cfg.layer_kinds
               for name, shape in _layer_shapes(cfg, kind, batch_size, cache_length(max_len)).items())
