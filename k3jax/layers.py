"""Flax NNX layers of the K3 / Kimi-Linear decoder. Parameters only; the math is in `k3jax.ops`.

Parameter names mirror the Hugging Face checkpoint (`q_proj.weight`, `A_log`, `experts.w1` ...),
stored in the Hugging Face `[out, in]` layout. Random initialisation runs wherever the
constructor is traced (under `nnx.jit` it runs on the device, in the final dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import mxfp4, ops
from k3jax.cache import KDAState, MLAState
from k3jax.config import K3Config

INIT_STD = 0.02


def normal_param(rngs: nnx.Rngs, shape, dtype, std=INIT_STD) -> nnx.Param:
    """N(0, std) weights drawn directly in `dtype` (no float32 temporary of a large tensor)."""
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * jnp.asarray(std, dtype))


def norm_param(rngs: nnx.Rngs, dim: int, dtype) -> nnx.Param:
    """Norm weights near one; not exactly one, so a test notices a norm whose weight is ignored."""
    return nnx.Param((1.0 + 0.1 * jax.random.normal(rngs.params(), (dim,), jnp.float32)).astype(dtype))


class Linear(nnx.Module):
    """y = x @ weight.T, weight [out, in]."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs):
        self.weight = normal_param(rngs, (d_out, d_in), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.linear(x, self.weight[...])


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.weight = norm_param(rngs, dim, dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.rms_norm(x, self.weight[...], self.eps)


class GatedMLP(nnx.Module):
    """Dense layer-0 MLP and the fused shared experts: down(act(gate(x), up(x)))."""

    def __init__(self, cfg: K3Config, width: int, *, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.gate_proj = Linear(d, width, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, width, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(width, d, dtype=dtype, rngs=rngs)
        self.act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.gated_mlp(x, self.gate_proj.weight[...], self.up_proj.weight[...],
                             self.down_proj.weight[...], *self.act)


class KimiDeltaAttention(nnx.Module):
    """KDA: short convs, L2-normalised q/k, lower-bounded per-channel decay, gated delta rule,
    gated RMSNorm, o_proj. One-token calls take the recurrent form, longer ones the chunked form."""

    def __init__(self, cfg: K3Config, *, dtype, rngs: nnx.Rngs):
        d, p, h, hd, kc = cfg.hidden_size, cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        self.cfg = cfg
        self.q_proj = Linear(d, p, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, p, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, p, dtype=dtype, rngs=rngs)
        conv_std = 1.0 / kc
        self.q_conv1d = normal_param(rngs, (p, kc), jnp.float32, conv_std)
        self.k_conv1d = normal_param(rngs, (p, kc), jnp.float32, conv_std)
        self.v_conv1d = normal_param(rngs, (p, kc), jnp.float32, conv_std)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (h,), jnp.float32, 1.0, 16.0)))
        self.dt_bias = normal_param(rngs, (p,), jnp.float32, 1.0)
        self.f_a_proj = Linear(d, hd, dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(hd, p, dtype=dtype, rngs=rngs)
        self.b_proj = Linear(d, h, dtype=dtype, rngs=rngs)
        if cfg.kda_full_rank_gate:
            self.g_proj = Linear(d, p, dtype=dtype, rngs=rngs)
        else:
            self.g_a_proj = Linear(d, hd, dtype=dtype, rngs=rngs)
            self.g_b_proj = Linear(hd, p, dtype=dtype, rngs=rngs)
        self.o_norm = norm_param(rngs, hd, jnp.float32)
        self.o_proj = Linear(p, d, dtype=dtype, rngs=rngs)

    def output_gate(self, x: jax.Array) -> jax.Array:
        if self.cfg.kda_full_rank_gate:
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def __call__(self, x: jax.Array, state: KDAState, valid: jax.Array, num_new: jax.Array):
        """x [B, T, D] (normed), valid [B, T] bool (right padding), num_new [B] -> (y [B, T, D], state)."""
        cfg = self.cfg
        b, t, _ = x.shape
        h, hd = cfg.kda_num_heads, cfg.kda_head_dim
        qkv = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        window = jnp.concatenate([state.conv, qkv.astype(state.conv.dtype)], axis=1)
        conv_w = jnp.concatenate([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], axis=0)
        q, k, v = jnp.split(ops.short_conv(window, conv_w).reshape(b, t, 3, h, hd), 3, axis=2)
        q = ops.l2_normalize(q[:, :, 0]) * hd ** -0.5
        k = ops.l2_normalize(k[:, :, 0])
        v = v[:, :, 0]
        g = ops.kda_decay(self.f_b_proj(self.f_a_proj(x)).reshape(b, t, h, hd), self.A_log[...],
                          self.dt_bias[...].reshape(h, hd), cfg.kda_gate_lower_bound)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        # Padding tokens neither decay nor update the state.
        g = jnp.where(valid[..., None, None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
        if t == 1:
            o, s = ops.kda_recurrent_step(state.recurrent, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            o = o[:, None]
        else:
            o, s = ops.kda_chunked(state.recurrent, q, k, v, g, beta)
        # Keep the last K-1 valid pre-conv inputs of every sequence.
        keep = cfg.kda_conv_size - 1
        conv = jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, keep, axis=0))(window, num_new)
        o = ops.gated_rms_norm(o.astype(x.dtype), self.output_gate(x).reshape(b, t, h, hd),
                               self.o_norm[...], cfg.rms_norm_eps)
        return self.o_proj(o.reshape(b, t, h * hd)), KDAState(conv=conv, recurrent=s)


class MLAttention(nnx.Module):
    """Gated NoPE MLA. The cache holds the normalised 512-d latent and the 64 shared key dims."""

    LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps

    def __init__(self, cfg: K3Config, *, dtype, rngs: nnx.Rngs):
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, self.LATENT_NORM_EPS, dtype=dtype, rngs=rngs)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        else:
            self.q_proj = Linear(d, h * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, self.LATENT_NORM_EPS, dtype=dtype, rngs=rngs)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * cfg.v_head_dim, d, dtype=dtype, rngs=rngs)
        if cfg.mla_use_output_gate:
            self.g_proj = Linear(d, h * cfg.v_head_dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, state: MLAState, lengths: jax.Array, *, absorbed: bool):
        """x [B, T, D] (normed), lengths [B] tokens already cached -> (y [B, T, D], state)."""
        cfg = self.cfg
        b, t, _ = x.shape
        h, n, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q = q.reshape(b, t, h, cfg.qk_head_dim)
        ckv = self.kv_a_proj_with_mqa(x)
        entry = jnp.concatenate([self.kv_a_layernorm(ckv[..., :c]), ckv[..., c:]], axis=-1)
        pos = lengths[:, None] + jnp.arange(t, dtype=lengths.dtype)[None]            # [B, T]
        cache = state.latent.at[jnp.arange(b)[:, None], pos].set(entry.astype(state.latent.dtype), mode="drop")
        mask = jnp.arange(cache.shape[1])[None, None, :] <= pos[:, :, None]          # [B, T, L]
        attend = ops.mla_attention_absorbed if absorbed else ops.mla_attention_expanded
        o = attend(q[..., :n], q[..., n:], cache[..., :c], cache[..., c:], self.kv_b_proj.weight[...],
                   mask, cfg.qk_head_dim ** -0.5).reshape(b, t, -1)
        if cfg.mla_use_output_gate:
            o = o * jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32)).astype(o.dtype)
        return self.o_proj(o), MLAState(latent=cache)


class Router(nnx.Module):
    """Float32 router: scores over experts, correction bias for selection, renormalised top-k."""

    def __init__(self, cfg: K3Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.weight = normal_param(rngs, (cfg.num_experts, cfg.hidden_size), dtype)
        self.e_score_correction_bias = normal_param(rngs, (cfg.num_experts,), jnp.float32, 0.01)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        return ops.route(x, self.weight[...], self.e_score_correction_bias[...],
                         top_k=cfg.num_experts_per_token, activation=cfg.moe_router_activation_func,
                         renormalize=cfg.moe_renormalize, scaling=cfg.routed_scaling_factor,
                         n_group=cfg.num_expert_group, topk_group=cfg.topk_group)


class RoutedExperts(nnx.Module):
    """All routed experts stacked: w1/w3 [E, I, M] (gate/up), w2 [E, M, I] (down).

    bf16: `w1`, `w2`, `w3`. MXFP4: `w*_packed` uint8 [E, out, in/2] and `w*_scale` uint8
    [E, out, in/32] in the checkpoint's packed layout (see k3jax.mxfp4).
    """

    def __init__(self, cfg: K3Config, *, dtype, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        e, m, i = cfg.num_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
        shapes = {"w1": (e, i, m), "w3": (e, i, m), "w2": (e, m, i)}
        for name, shape in shapes.items():
            if cfg.expert_format == "mxfp4":
                packed, scale = mxfp4.random_packed(rngs.params(), shape)
                setattr(self, f"{name}_packed", nnx.Param(packed))
                setattr(self, f"{name}_scale", nnx.Param(scale))
            else:
                setattr(self, name, normal_param(rngs, shape, dtype))

    def weights(self, expert_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Gathers (and dequantises) only the given experts: ids [U] -> w1, w3 [U, I, M], w2 [U, M, I]."""
        def one(name: str) -> jax.Array:
            if self.cfg.expert_format == "mxfp4":
                packed = getattr(self, f"{name}_packed")[...][expert_ids]
                scale = getattr(self, f"{name}_scale")[...][expert_ids]
                return mxfp4.dequantize(packed, scale, self.dtype)
            return getattr(self, name)[...][expert_ids]
        return one("w1"), one("w3"), one("w2")


class LatentMoE(nnx.Module):
    """Stable LatentMoE (K3) / plain MoE (Kimi-Linear): router on the full hidden state; routed
    experts in the latent width (down-proj, experts, RMSNorm, up-proj); fused shared experts."""

    def __init__(self, cfg: K3Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate = Router(cfg, dtype=dtype, rngs=rngs)
        self.experts = RoutedExperts(cfg, dtype=dtype, rngs=rngs)
        if cfg.routed_expert_hidden_size:
            self.routed_expert_down_proj = Linear(cfg.hidden_size, cfg.moe_hidden_size, dtype=dtype, rngs=rngs)
            self.routed_expert_up_proj = Linear(cfg.moe_hidden_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(cfg.moe_hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts,
                                           dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.gate(flat)
        z = self.routed_expert_down_proj(flat) if cfg.routed_expert_hidden_size else flat
        u = routed_experts_forward(z, ids, weights, self.experts, cfg)
        if cfg.routed_expert_hidden_size:
            if cfg.latent_moe_use_norm:
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u)
        if cfg.num_shared_experts:
            u = u + self.shared_experts(flat)
        return u.reshape(x.shape)


EXPERT_CHUNK = 64  # distinct experts dequantised at once on the XLA path (bounds the bf16 temporary)


def routed_experts_forward(z: jax.Array, ids: jax.Array, weights: jax.Array, experts: RoutedExperts,
                           cfg: K3Config, expert_chunk: int = EXPERT_CHUNK) -> jax.Array:
    """sum_k weights[n, k] * expert_{ids[n, k]}(z[n]) for z [N, M], touching only selected experts.

    The N*k (token, slot) pairs are sorted by expert; the distinct experts (at most min(E, N*k),
    a static bound) are gathered and dequantised `expert_chunk` at a time, and each chunk is one
    grouped matmul (`ragged_dot`) over the rows of its experts. Returns [N, M] in z's dtype.
    """
    n, k = ids.shape
    slots = n * k
    bound = min(cfg.num_experts, slots)
    n_chunks = -(-bound // expert_chunk)
    chunk = -(-bound // n_chunks)
    flat = ids.reshape(-1)
    # Sorted distinct ids, padded with E (sorts last; the gather clamps it to a real expert).
    uniq = jnp.unique(flat, size=n_chunks * chunk, fill_value=cfg.num_experts)
    slot_group = jnp.searchsorted(uniq, flat)                                   # [N*k]
    order = jnp.argsort(slot_group, stable=True)
    group_sizes = jnp.bincount(slot_group, length=n_chunks * chunk).astype(jnp.int32)
    rows = z[order // k]                                                        # [N*k, M]
    act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

    def grouped(x, w, sizes):  # x [R, in] @ w[g].T per group -> [R, out]
        return jax.lax.ragged_dot_general(x, w, sizes, dims, preferred_element_type=jnp.float32).astype(x.dtype)

    def run_chunk(c: int | jax.Array) -> jax.Array:
        ids_c = jax.lax.dynamic_slice_in_dim(uniq, c * chunk, chunk)
        sizes = jax.lax.dynamic_slice_in_dim(group_sizes, c * chunk, chunk)
        start = jnp.sum(jnp.where(jnp.arange(group_sizes.shape[0]) < c * chunk, group_sizes, 0))
        w1, w3, w2 = experts.weights(jnp.minimum(ids_c, cfg.num_experts - 1))
        x = jnp.roll(rows, -start, axis=0)          # this chunk's rows first; later rows give zeros
        hid = ops.glu(grouped(x, w1, sizes), grouped(x, w3, sizes), *act)
        return jnp.roll(grouped(hid, w2, sizes), start, axis=0)

    if n_chunks == 1:
        out_sorted = run_chunk(0)
    else:
        out_sorted = jax.lax.fori_loop(0, n_chunks, lambda c, acc: acc + run_chunk(c), jnp.zeros_like(rows))
    per_slot = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(n, k, -1)
    return jnp.einsum("nkm,nk->nm", per_slot.astype(jnp.float32), weights).astype(z.dtype)


class DecoderLayer(nnx.Module):
    """One decoder layer's parameters: mixer (KDA or MLA), FFN (dense MLP or MoE), their input
    norms, and (K3) the AttnRes norm / pseudo-query pairs for the two sub-layers."""

    def __init__(self, cfg: K3Config, layer: int, *, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.kind = cfg.layer_kinds[layer]
        self.is_moe = cfg.is_moe_layer(layer)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = (KimiDeltaAttention(cfg, dtype=dtype, rngs=rngs) if self.kind == "kda"
                          else MLAttention(cfg, dtype=dtype, rngs=rngs))
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = GatedMLP(cfg, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        if cfg.uses_attn_res:
            self.self_attention_res_norm = norm_param(rngs, d, dtype)
            self.self_attention_res_proj = normal_param(rngs, (d,), dtype, d ** -0.5)
            self.mlp_res_norm = norm_param(rngs, d, dtype)
            self.mlp_res_proj = normal_param(rngs, (d,), dtype, d ** -0.5)

    def ffn(self, x: jax.Array) -> jax.Array:
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)
