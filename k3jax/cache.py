"""Decode state: an explicit pytree, preallocated for a maximum length and donated between steps.

Per KDA layer: the last K-1 pre-conv inputs of q|k|v and the recurrent state S [B, H, K, V]
(float32; key channel before value channel, as in transformers — Moonshot's code stores it
transposed). Per MLA layer: the latent cache [B, L, kv_lora_rank + qk_rope_head_dim] (the
normalised latent, then the un-rotated shared key dims). `lengths` [B] counts cached tokens.
"""

from __future__ import annotations

import dataclasses

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


def init_state(cfg: K3Config, batch_size: int, max_len: int, dtype=jnp.bfloat16) -> DecodeState:
    """Zeroed state for `batch_size` sequences of up to `max_len` tokens (the MLA cache holds
    `cache_length(max_len)` positions)."""
    layers = []
    for kind in cfg.layer_kinds:
        if kind == "kda":
            h, hd = cfg.kda_num_heads, cfg.kda_head_dim
            layers.append(KDAState(conv=jnp.zeros((batch_size, cfg.kda_conv_size - 1, 3 * cfg.kda_dim), dtype),
                                   recurrent=jnp.zeros((batch_size, h, hd, hd), jnp.float32)))
        else:
            width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            layers.append(MLAState(latent=jnp.zeros((batch_size, cache_length(max_len), width), dtype)))
    return DecodeState(lengths=jnp.zeros((batch_size,), jnp.int32), layers=tuple(layers))


def state_bytes(cfg: K3Config, batch_size: int, max_len: int, dtype_bytes: int = 2) -> int:
    """Bytes `init_state` allocates."""
    kda = (cfg.kda_conv_size - 1) * 3 * cfg.kda_dim * dtype_bytes + cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4
    mla = cache_length(max_len) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return batch_size * (len(cfg.kda_layers) * kda + len(cfg.mla_layers) * mla)
