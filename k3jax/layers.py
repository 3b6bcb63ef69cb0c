"""Flax NNX layers of the K3 / Kimi-Linear decoder. Parameters only; the math is in `k3jax.ops`.

Parameter names mirror the Hugging Face checkpoint (`q_proj.weight`, `A_log`, `experts.w1` ...),
stored in the Hugging Face `[out, in]` layout. Random initialisation runs wherever the
constructor is traced (under `nnx.jit` it runs on the device, in the final dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import moe_parallel, mxfp4, ops
from k3jax.backend import XLA, KernelPlan
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

    def __call__(self, x: jax.Array, plan: KernelPlan = XLA) -> jax.Array:
        """x [..., in] -> [..., out] in x's dtype (float32 accumulation)."""
        return plan("linear")(x, self.weight[...])


class RMSNorm(nnx.Module):
    """Hugging Face RMSNorm (ops.rms_norm): x [..., dim] -> [..., dim] in x's dtype; weight [dim]."""

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

    def __call__(self, x: jax.Array, plan: KernelPlan = XLA) -> jax.Array:
        """x [..., D] -> [..., D] in x's dtype: the plan's gated_mlp kernel, or else the formula over
        the plan's "linear" (three projections, each its own kernel at the per-op granularity)."""
        weights = (self.gate_proj.weight[...], self.up_proj.weight[...], self.down_proj.weight[...])
        if plan.runs_kernel("gated_mlp"):
            return plan("gated_mlp")(x, *weights, *self.act)
        return ops.gated_mlp(x, *weights, *self.act, proj=plan("linear"))


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

    def output_gate(self, x: jax.Array, plan: KernelPlan) -> jax.Array:
        """Pre-sigmoid output-gate logits: x [B, T, D] -> [B, T, kda_dim] in x's dtype."""
        if self.cfg.kda_full_rank_gate:
            return self.g_proj(x, plan)
        return self.g_b_proj(self.g_a_proj(x, plan), plan)

    def conv_filters(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The q, k and v short-conv filters, [P, K] float32 each (the q|k|v window's three parts)."""
        return self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]

    def __call__(self, x: jax.Array, state: KDAState, valid: jax.Array, num_new: jax.Array,
                 plan: KernelPlan = XLA):
        """x [B, T, D] (normed), valid [B, T] bool (right padding), num_new [B] -> (y [B, T, D], state)."""
        cfg = self.cfg
        b, t, _ = x.shape
        h, hd = cfg.kda_num_heads, cfg.kda_head_dim
        qkv = (self.q_proj(x, plan), self.k_proj(x, plan), self.v_proj(x, plan))
        f = self.f_b_proj(self.f_a_proj(x, plan), plan)
        beta_logit = self.b_proj(x, plan)
        gate = self.output_gate(x, plan)
        if t == 1:  # decode: every row holds one real token
            o, conv, s = plan("kda_decode")(
                state.conv, tuple(y[:, 0] for y in qkv), self.conv_filters(), f[:, 0], beta_logit[:, 0], gate[:, 0],
                self.A_log[...], self.dt_bias[...], self.o_norm[...], state.recurrent,
                num_heads=h, lower_bound=cfg.kda_gate_lower_bound, eps=cfg.rms_norm_eps)
            return self.o_proj(o[:, None], plan), KDAState(conv=conv, recurrent=s)
        window = ops.kda_window(state.conv, qkv)
        q, k, v, g, beta = ops.kda_inputs(window, self.conv_filters(), f, beta_logit, self.A_log[...],
                                          self.dt_bias[...], h, cfg.kda_gate_lower_bound)
        # Padding tokens neither decay nor update the state.
        g = jnp.where(valid[..., None, None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
        o, s = ops.kda_chunked(state.recurrent, q, k, v, g, beta)
        # Keep the last K-1 real pre-conv inputs of every sequence.
        keep = cfg.kda_conv_size - 1
        conv = jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, keep, axis=0))(window, num_new)
        o = ops.gated_rms_norm(o.astype(x.dtype), gate.reshape(b, t, h, hd), self.o_norm[...], cfg.rms_norm_eps)
        return self.o_proj(o.reshape(b, t, h * hd), plan), KDAState(conv=conv, recurrent=s)


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

    def __call__(self, x: jax.Array, state: MLAState, lengths: jax.Array, plan: KernelPlan = XLA):
        """x [B, T, D] (normed), lengths [B] tokens already cached -> (y [B, T, D], state).

        T = 1 (decode) attends in the absorbed form over the compressed cache; longer inputs
        (prefill) decompress the cache (the expanded reference form).
        """
        cfg = self.cfg
        b, t, _ = x.shape
        h, n, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, plan)), plan)
        else:
            q = self.q_proj(x, plan)
        q = q.reshape(b, t, h, cfg.qk_head_dim)
        ckv = self.kv_a_proj_with_mqa(x, plan)
        entry = jnp.concatenate([self.kv_a_layernorm(ckv[..., :c]), ckv[..., c:]], axis=-1)
        pos = lengths[:, None] + jnp.arange(t, dtype=lengths.dtype)[None]            # [B, T]
        cache = state.latent.at[jnp.arange(b)[:, None], pos].set(entry.astype(state.latent.dtype), mode="drop")
        scale = cfg.qk_head_dim ** -0.5
        w_kv_b = self.kv_b_proj.weight[...]
        if t == 1:
            o = plan("mla_decode")(q[:, 0, :, :n], q[:, 0, :, n:], cache, w_kv_b, lengths + 1, scale)[:, None]
        else:
            mask = jnp.arange(cache.shape[1])[None, None, :] <= pos[:, :, None]      # [B, T, L]
            o = ops.mla_attention_expanded(q[..., :n], q[..., n:], cache[..., :c], cache[..., c:], w_kv_b,
                                           mask, scale)
        o = o.reshape(b, t, -1)
        if cfg.mla_use_output_gate:
            o = ops.sigmoid_gate(o, self.g_proj(x, plan))
        return self.o_proj(o, plan), MLAState(latent=cache)


class Router(nnx.Module):
    """Float32 router: scores over experts, correction bias for selection, renormalised top-k."""

    def __init__(self, cfg: K3Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.weight = normal_param(rngs, (cfg.num_experts, cfg.hidden_size), dtype)
        self.e_score_correction_bias = normal_param(rngs, (cfg.num_experts,), jnp.float32, 0.01)

    def __call__(self, x: jax.Array, plan: KernelPlan = XLA) -> tuple[jax.Array, jax.Array]:
        """x [N, D] -> (expert ids [N, k] int32, combine weights [N, k] float32), k = num_experts_per_token."""
        cfg = self.cfg
        return plan("route")(x, self.weight[...], self.e_score_correction_bias[...],
                         top_k=cfg.num_experts_per_token, activation=cfg.moe_router_activation_func,
                         renormalize=cfg.moe_renormalize, scaling=cfg.routed_scaling_factor,
                         n_group=cfg.num_expert_group, topk_group=cfg.topk_group)


class RoutedExperts(nnx.Module):
    """All routed experts stacked: w1/w3 [E, I, M] (gate/up), w2 [E, M, I] (down).

    bf16: `w1`, `w2`, `w3`. MXFP4: `w*_packed` uint8 [E, out, in/2] and `w*_scale` uint8
    [E, out, in/32] in the checkpoint's packed layout (see k3jax.mxfp4), in row order or, with
    cfg.experts_in_tiles (the default for K3's widths), in mxfp4.to_tiles' order (the same weights for the same seed).
    """

    def __init__(self, cfg: K3Config, *, dtype, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        e, m, i = cfg.num_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
        shapes = {"w1": (e, i, m), "w3": (e, i, m), "w2": (e, m, i)}
        for name, shape in shapes.items():
            if cfg.expert_format == "mxfp4":
                packed, scale = mxfp4.random_packed(rngs.params(), shape)
                if cfg.experts_in_tiles:
                    packed, scale = mxfp4.to_tiles(packed), mxfp4.to_tiles(scale, scales=True)
                setattr(self, f"{name}_packed", nnx.Param(packed))
                setattr(self, f"{name}_scale", nnx.Param(scale))
            else:
                setattr(self, name, normal_param(rngs, shape, dtype))

    def arrays(self) -> ops.ExpertWeights:
        """The expert tensors as ops.ExpertWeights (the packed and scale arrays for MXFP4)."""
        if self.cfg.expert_format == "mxfp4":
            return ops.ExpertWeights(self.w1_packed[...], self.w3_packed[...], self.w2_packed[...],
                                     self.w1_scale[...], self.w3_scale[...], self.w2_scale[...],
                                     tiled=self.cfg.experts_in_tiles)
        return ops.ExpertWeights(self.w1[...], self.w3[...], self.w2[...])


class LatentMoE(nnx.Module):
    """Stable LatentMoE (K3) / plain MoE (Kimi-Linear): router on the full hidden state; routed
    experts in the latent width (down-proj, experts, RMSNorm, up-proj); fused shared experts."""

    def __init__(self, cfg: K3Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.ep_variant = "auto"  # expert-parallel dispatch (k3jax.moe_parallel.VARIANTS); static
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

    def __call__(self, x: jax.Array, plan: KernelPlan = XLA) -> jax.Array:
        """x [B, T, D] (normed) -> [B, T, D] in x's dtype."""
        cfg = self.cfg
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.gate(flat, plan)
        z = self.routed_expert_down_proj(flat, plan) if cfg.routed_expert_hidden_size else flat
        act = cfg.activation
        if moe_parallel.active_mesh() is not None:  # experts split over the mesh's "expert" (+ "tensor") axes
            u = moe_parallel.moe_experts(z, ids, weights, self.experts.arrays(), variant=self.ep_variant,
                                         local_impl=plan("moe_experts"), **act)
        else:
            u = plan("moe_experts")(z, ids, weights, self.experts.arrays(), **act)
        if cfg.routed_expert_hidden_size:
            if cfg.latent_moe_use_norm:
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u, plan)
        if cfg.num_shared_experts:
            u = u + self.shared_experts(flat, plan)
        return u.reshape(x.shape)


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

    def ffn(self, x: jax.Array, plan: KernelPlan = XLA) -> jax.Array:
        """The layer's FFN (MoE or dense MLP): x [B, T, D] (normed) -> [B, T, D] in x's dtype."""
        return self.block_sparse_moe(x, plan) if self.is_moe else self.mlp(x, plan)
