"""The K3 / Kimi-Linear text decoder: one forward, readable top to bottom.

    tokens -> embed -> [layer 0 .. L-1: (AttnRes mix) -> norm -> KDA | MLA -> (AttnRes mix)
           -> norm -> dense MLP | LatentMoE] -> (final AttnRes mix) -> norm -> lm_head -> logits

The same `forward` serves prefill (T tokens, chunked KDA, expanded MLA) and decode (T = 1,
recurrent KDA, absorbed MLA over the latent cache). Sequences are right-padded: `num_new[b]`
of the T tokens are real; padding never touches the recurrent state and is overwritten in the
MLA cache by the next real token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.backend import XLA, KernelPlan
from k3jax.cache import DecodeState, KDAState, MLAState, init_state, state_mismatch
from k3jax.config import K3Config
from k3jax.layers import DecoderLayer, Linear, RMSNorm, norm_param, normal_param
from k3jax.sharding import constrain_state


class K3Model(nnx.Module):
    """K3 (or Kimi-Linear) text decoder with random or loaded weights.

    `model(input_ids)` -> float32 logits [B, T, V] (a full-sequence forward from an empty state).
    `model.forward(tokens, state, num_new)` -> (logits, state) extends the sequences in `state`.
    `model.plan` (a static KernelPlan) picks each decode op's implementation (k3jax.backend).
    """

    def __init__(self, cfg: K3Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs, plan: KernelPlan = XLA):
        self.cfg = cfg
        self.dtype = dtype
        self.plan = plan
        d = cfg.hidden_size
        self.embed_tokens = normal_param(rngs, (cfg.vocab_size, d), dtype, 1.0)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        if cfg.uses_attn_res:
            self.output_attn_res_norm = norm_param(rngs, d, dtype)
            self.output_attn_res_proj = normal_param(rngs, (d,), dtype, d ** -0.5)
        self.lm_head = Linear(d, cfg.vocab_size, dtype=dtype, rngs=rngs)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: jax.Array, state: DecodeState, num_new: jax.Array | None = None,
                *, last_only: bool = False) -> tuple[jax.Array, DecodeState]:
        """tokens [B, T] int32 -> (logits float32 [B, T, V] or, with last_only, [B, V] at each
        sequence's last real token; new state). num_new [B] real tokens per row (default T)."""
        cfg = self.cfg
        if not (callable(self.plan) and hasattr(self.plan, "runs_kernel")):    # a KernelPlan or a wrapper (k3jax.trace)
            raise TypeError(f"model.plan must be a KernelPlan, got {type(self.plan).__name__} {self.plan!r}; "
                            f"set it to k3jax.backend.KernelPlan.for_backend(...)")
        b, t = _check_forward_args(tokens, state, num_new, cfg, self.dtype)
        num_new = jnp.full((b,), t, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
        valid = jnp.arange(t)[None, :] < num_new[:, None]                            # [B, T]
        plan = self.plan
        h = self.embed_tokens[...][tokens]
        new_states = []

        def mixer(layer: DecoderLayer, x_normed: jax.Array, i: int) -> jax.Array:
            if layer.kind == "kda":
                y, s = layer.self_attn(x_normed, state.layers[i], valid, num_new, plan)
            else:
                y, s = layer.self_attn(x_normed, state.layers[i], state.lengths, plan)
            new_states.append(s)
            return y

        if cfg.uses_attn_res:
            h = self._attn_res_stack(h, mixer)                      # already through self.norm
        else:
            for i, layer in enumerate(self.layers):
                h = h + mixer(layer, layer.input_layernorm(h), i)
                h = h + layer.ffn(layer.post_attention_layernorm(h), plan)
        if last_only:
            h = jnp.take_along_axis(h, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
        logits = self.lm_head(h if cfg.uses_attn_res else self.norm(h), plan).astype(jnp.float32)
        # Pinned to sharding.state_specs under a mesh (the layout generate and bench give the input
        # state): kernels (custom calls) leave their outputs' sharding to XLA, and a donated step
        # must hand back the layout it was compiled for.
        return logits, constrain_state(DecodeState(lengths=state.lengths + num_new, layers=tuple(new_states)))

    def _attn_res_stack(self, h: jax.Array, mixer) -> jax.Array:
        """Block Attention Residuals. Sub-layer inputs are softmax mixes over depth of the stored
        block sums and the current block's running partial sum. Layer 0 stores the embeddings as
        the first block; a new block starts at every layer index divisible by the block size.
        Returns the final mix through self.norm (the lm_head's input)."""
        cfg, plan = self.cfg, self.plan

        def mix_norm(blocks, partial, norm, query, out_norm: RMSNorm) -> jax.Array:
            """The mix, then the reading sub-layer's RMSNorm: one kernel where the plan fuses them."""
            args = (jnp.stack(blocks + [partial]), norm[...], query[...])
            if plan.runs_kernel("attn_res_mix_norm"):
                return plan("attn_res_mix_norm")(*args, out_norm.weight[...], out_norm.eps)
            return out_norm(plan("attn_res_mix")(*args, cfg.rms_norm_eps))

        blocks: list[jax.Array] = []
        partial: jax.Array | None = h
        for i, layer in enumerate(self.layers):
            x = (mix_norm(blocks, partial, layer.self_attention_res_norm, layer.self_attention_res_proj,
                          layer.input_layernorm) if blocks else layer.input_layernorm(partial))
            if i % cfg.attn_res_block_size == 0:
                blocks.append(partial)
                partial = None
            y = mixer(layer, x, i)
            partial = y if partial is None else partial + y
            x = mix_norm(blocks, partial, layer.mlp_res_norm, layer.mlp_res_proj, layer.post_attention_layernorm)
            partial = partial + layer.ffn(x, plan)
        return mix_norm(blocks, partial, self.output_attn_res_norm, self.output_attn_res_proj, self.norm)

    def __call__(self, input_ids) -> jax.Array:
        """input_ids [B, T] -> float32 logits [B, T, V] (full-sequence forward, empty state)."""
        ids = check_token_ids(input_ids, self.cfg.vocab_size)
        if isinstance(ids, jax.core.Tracer):
            return _full_forward_logits(self, ids)
        return _full_forward_jit(self, ids)


def _full_forward_logits(model: K3Model, ids: jax.Array) -> jax.Array:
    logits, _ = model.forward(ids, init_state(model.cfg, ids.shape[0], ids.shape[1], model.dtype))
    return logits


_full_forward_jit = nnx.jit(_full_forward_logits)


def _check_forward_args(tokens, state, num_new, cfg: K3Config, dtype) -> tuple[int, int]:
    """K3Model.forward's arguments: shapes, dtypes and, where the values are concrete (not traced
    under jit), token ids within the vocabulary, 0 <= num_new <= T, and the cached plus new tokens
    within the state's MLA cache (traced: T alone). Returns (B, T)."""
    dt = getattr(tokens, "dtype", None)
    shape = () if dt is None else tokens.shape
    if len(shape) != 2 or not jnp.issubdtype(dt, jnp.integer):
        got = type(tokens).__name__ if dt is None else f"{dt}{list(shape)}"
        raise ValueError(f"tokens must be an integer array [batch, seq], got {got}")
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a k3jax.DecodeState (k3jax.init_state), got {type(state).__name__}")
    b, t = shape
    num_layers = cfg.num_hidden_layers
    if state.batch_size != b or len(state.layers) != num_layers:
        raise ValueError(f"state holds {state.batch_size} sequences x {len(state.layers)} layers but tokens has "
                         f"batch size {b} and the model {num_layers} layers; use init_state(model.cfg, {b}, max_len, model.dtype)")
    if num_new is not None:
        if jnp.shape(num_new) != (b,):
            raise ValueError(f"num_new must have shape [{b}] (one count per sequence), got {list(jnp.shape(num_new))}")
        count_dt = jnp.asarray(num_new).dtype
        if count_dt == jnp.bool_ or not jnp.issubdtype(count_dt, jnp.integer):
            raise ValueError(f"num_new must hold integer counts, got {count_dt}")
    mismatch = state_mismatch(cfg, state)
    if mismatch is not None:
        raise ValueError(f"state does not fit the model's config: {mismatch}; use init_state(model.cfg, {b}, max_len, model.dtype)")
    cached = {jnp.dtype(s.conv.dtype if isinstance(s, KDAState) else s.latent.dtype).name for s in state.layers}
    if cached != {jnp.dtype(dtype).name}:
        raise ValueError(f"state caches are {'/'.join(sorted(cached))} but the model computes in "
                         f"{jnp.dtype(dtype).name}; use init_state(model.cfg, {b}, max_len, model.dtype)")
    ids = _concrete(tokens)
    if ids is not None:
        _check_in_vocab(ids, cfg.vocab_size, "tokens")
    counts = _concrete(num_new)
    if counts is not None and ((counts < 0) | (counts > t)).any():
        raise ValueError(f"num_new must be within [0, {t}] (the tokens per row), got {counts.tolist()}")
    capacity = min((s.latent.shape[1] for s in state.layers if isinstance(s, MLAState)), default=None)
    lengths = _concrete(state.lengths)
    used = 0 if lengths is None else int(lengths.max())
    if capacity is not None and used + t > capacity:
        raise ValueError(f"{t} new token(s) after {used} cached exceed the state's MLA cache of {capacity} "
                         f"positions; use init_state(model.cfg, {b}, max_len, model.dtype) with max_len >= {used + t}")
    return b, t


def _concrete(x) -> np.ndarray | None:
    """x as a host array, or None when it is absent, traced (inside jit) or spans devices of other
    processes (a multi-process global array: no one process can read it)."""
    if x is None or isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return None
    return np.asarray(x)


def check_token_ids(input_ids, vocab_size: int) -> jax.Array:
    """Validates token ids (shape [B, T], integer, within the vocabulary) and returns int32 ids."""
    if isinstance(input_ids, jax.core.Tracer):
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be an integer array [batch, seq], got {input_ids.dtype}{list(input_ids.shape)}")
        return input_ids.astype(jnp.int32)
    return jnp.asarray(host_token_ids(input_ids, vocab_size))


def _check_in_vocab(ids: np.ndarray, vocab_size: int, name: str) -> None:
    """ValueError naming `name` when any of the integer ids lies outside [0, vocab_size)."""
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise ValueError(f"{name} has {int(bad.sum())} id(s) outside the vocabulary [0, {vocab_size}), "
                         f"e.g. {int(ids[bad][0])}")


def host_token_ids(input_ids, vocab_size: int) -> np.ndarray:
    """check_token_ids on the host: int32 numpy ids, and no jax call (a launcher validates prompts
    before jax.distributed may start the backend)."""
    arr = np.asarray(input_ids)
    if arr.ndim != 2:
        raise ValueError(f"input_ids must have shape [batch, seq], got shape {list(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"input_ids is empty (shape {list(arr.shape)})")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"input_ids must be integers, got dtype {arr.dtype}")
    _check_in_vocab(arr, vocab_size, "input_ids")
    return arr.astype(np.int32)
