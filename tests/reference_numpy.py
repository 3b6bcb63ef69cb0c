"""An independent float64 NumPy reference of the K3 / Kimi-Linear decoder, for tests only.

Written from the formulas in /work/shared/K3_ARCHITECTURE.md and the research notes (Moonshot's
modeling code, fla's naive KDA, compressed-tensors MXFP4); it deliberately does NOT import
`k3jax.ops` or `k3jax.mxfp4`, so a wrong formula there cannot hide in both. Everything is plain
loops / einsums in float64: attention is the expanded causal softmax, KDA is the token-by-token
delta rule, the MoE is a per-token loop over the selected experts.

Parameters are the nested dict `params_of(model)` (Hugging Face names, `[out, in]` weights).
"""

from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
LATENT_NORM_EPS = 1e-6   # MLA q_a_layernorm / kv_a_layernorm: RMSNorm built without an eps argument
L2NORM_EPS = 1e-6        # fla l2norm: eps added to the sum of squares


def params_of(model) -> dict:
    """The NNX model's parameters as a nested dict; float arrays become float64, uint8 stays."""
    from flax import nnx

    def conv(a):
        a = np.asarray(a)
        return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a

    def walk(d):
        return {k: walk(v) if isinstance(v, dict) else conv(v) for k, v in d.items()}
    return walk(nnx.to_pure_dict(nnx.state(model)))


# ------------------------------------------------------------------ elementwise
def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.logaddexp(0.0, x)


def softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def linear(x, w):
    """x [..., in] @ w[out, in].T"""
    return x @ w.T


# ------------------------------------------------------------------ norms
def rms_norm(x, w, eps, dtype=None):
    """RMSNorm. dtype=None: all float64. With a dtype (e.g. bfloat16), Hugging Face's cast order:
    normalise in float32, cast to `dtype`, then multiply by the weight in `dtype`."""
    if dtype is None:
        x = np.asarray(x, np.float64)
        return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))
    x32 = np.asarray(x).astype(np.float32)
    y = x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
    return np.asarray(w).astype(dtype) * y.astype(dtype)


def gated_rms_norm(x, gate, w, eps):
    """KDA o_norm: rms_norm(x) * sigmoid(gate)."""
    return rms_norm(x, w, eps) * sigmoid(gate)


def l2norm(x, eps=L2NORM_EPS):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


# ------------------------------------------------------------------ MLPs
def situ_glu(g, u, beta, linear_beta):
    """SiTU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)."""
    act = beta * np.tanh(g / beta) * sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * np.tanh(u / linear_beta)
    return act * u


def silu_glu(g, u):
    return silu(g) * u


def glu(cfg, g, u):
    return situ_glu(g, u, cfg.activation_situ_beta, cfg.activation_situ_linear_beta) \
        if cfg.hidden_act == "situ" else silu_glu(g, u)


def gated_mlp(cfg, p, x):
    """down(act(gate(x), up(x))) from {'gate_proj','up_proj','down_proj'}."""
    return linear(glu(cfg, linear(x, p["gate_proj"]["weight"]), linear(x, p["up_proj"]["weight"])),
                  p["down_proj"]["weight"])


# ------------------------------------------------------------------ MXFP4
def mxfp4_dequantize(packed, scale):
    """compressed-tensors MXFP4: packed uint8 [..., in/2] (low nibble = even column; bit 3 = sign,
    bits 0-2 index E2M1), scale uint8 [..., in/32] with value 2^(s - 127). -> float64 [..., in]."""
    packed = np.asarray(packed, np.uint8)
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    values = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    factor = np.exp2(np.asarray(scale, np.float64) - 127.0)
    return values * np.repeat(factor, 32, axis=-1)


# ------------------------------------------------------------------ KDA
def kda_gate(f, a_log, dt_bias, lower_bound):
    """f [..., H, K], a_log [H], dt_bias [H, K] -> log-decay g [..., H, K]."""
    a = np.exp(a_log)[:, None]
    if lower_bound is not None:
        return lower_bound * sigmoid(a * (f + dt_bias))
    return -a * softplus(f + dt_bias)


def causal_conv_silu(x, w, past=None):
    """Depthwise causal conv + SiLU. x [B, T, C], w [C, W] (w[:, W-1] hits the current token),
    past [B, W-1, C] earlier inputs (zeros if None)."""
    b, t, c = x.shape
    width = w.shape[1]
    past = np.zeros((b, width - 1, c)) if past is None else past
    xs = np.concatenate([past, x], axis=1)
    y = np.zeros((b, t, c))
    for s in range(t):
        for j in range(width):
            y[:, s] += w[:, j] * xs[:, s + j]
    return silu(y)


def kda_recurrence(q, k, v, g, beta, state=None):
    """Gated delta rule token by token. q, k [B, T, H, K] (q already scaled), v [B, T, H, V],
    g [B, T, H, K], beta [B, T, H], state [B, H, K, V]. Per token: S <- S * exp(g) (per key
    channel); u = beta * (v - S^T k); S <- S + k u^T; o = S^T q. Returns (o [B, T, H, V], S)."""
    b, t, h, dk = k.shape
    s = np.zeros((b, h, dk, v.shape[-1])) if state is None else np.array(state, np.float64)
    o = np.zeros(v.shape)
    for i in range(t):
        s = s * np.exp(g[:, i])[..., None]
        u = beta[:, i, :, None] * (v[:, i] - np.einsum("bhk,bhkv->bhv", k[:, i], s))
        s = s + k[:, i, :, :, None] * u[:, :, None, :]
        o[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i], s)
    return o, s


def kda_layer(cfg, p, x):
    """KDA mixer on a normalised input x [B, T, D] from an empty state -> [B, T, D]."""
    b, t, _ = x.shape
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim

    def heads(a):
        return a.reshape(b, t, h, dk)
    q = heads(causal_conv_silu(linear(x, p["q_proj"]["weight"]), p["q_conv1d"]))
    k = heads(causal_conv_silu(linear(x, p["k_proj"]["weight"]), p["k_conv1d"]))
    v = heads(causal_conv_silu(linear(x, p["v_proj"]["weight"]), p["v_conv1d"]))
    q = l2norm(q) / np.sqrt(dk)
    k = l2norm(k)
    f = heads(linear(linear(x, p["f_a_proj"]["weight"]), p["f_b_proj"]["weight"]))
    g = kda_gate(f, p["A_log"][:h], p["dt_bias"].reshape(h, dk), cfg.kda_gate_lower_bound)
    beta = sigmoid(linear(x, p["b_proj"]["weight"]))
    o, _ = kda_recurrence(q, k, v, g, beta)
    if cfg.kda_full_rank_gate:
        gate = linear(x, p["g_proj"]["weight"])
    else:
        gate = linear(linear(x, p["g_a_proj"]["weight"]), p["g_b_proj"]["weight"])
    o = gated_rms_norm(o, heads(gate), p["o_norm"], cfg.rms_norm_eps)
    return linear(o.reshape(b, t, h * dk), p["o_proj"]["weight"])


# ------------------------------------------------------------------ MLA
def mla_layer(cfg, p, x):
    """Gated NoPE MLA, expanded causal softmax attention, x [B, T, D] (normalised) -> [B, T, D]."""
    b, t, _ = x.shape
    h, n, r, dv, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                      cfg.v_head_dim, cfg.kv_lora_rank)
    if cfg.q_lora_rank:
        q = linear(rms_norm(linear(x, p["q_a_proj"]["weight"]), p["q_a_layernorm"]["weight"], LATENT_NORM_EPS),
                   p["q_b_proj"]["weight"])
    else:
        q = linear(x, p["q_proj"]["weight"])
    q = q.reshape(b, t, h, n + r)
    ckv = linear(x, p["kv_a_proj_with_mqa"]["weight"])
    latent = rms_norm(ckv[..., :c], p["kv_a_layernorm"]["weight"], LATENT_NORM_EPS)
    k_rope = ckv[..., c:]                                   # shared by all heads, never rotated
    kv = linear(latent, p["kv_b_proj"]["weight"]).reshape(b, t, h, n + dv)
    k_nope, value = kv[..., :n], kv[..., n:]
    scores = (np.einsum("bthn,bshn->bhts", q[..., :n], k_nope)
              + np.einsum("bthr,bsr->bhts", q[..., n:], k_rope)) * (n + r) ** -0.5
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    o = np.einsum("bhts,bshv->bthv", softmax(scores), value).reshape(b, t, h * dv)
    if cfg.mla_use_output_gate:
        o = o * sigmoid(linear(x, p["g_proj"]["weight"]))
    return linear(o, p["o_proj"]["weight"])


# ------------------------------------------------------------------ MoE
def route(x, w, bias, *, top_k, activation="sigmoid", renormalize=True, scaling=1.0, n_group=1, topk_group=1):
    """x [N, D], w [E, D], bias [E] -> (ids [N, k], weights [N, k]). Select by scores + bias (ties:
    lower id); weights are the plain scores, renormalised (+1e-20) and scaled."""
    logits = x @ w.T
    scores = sigmoid(logits) if activation == "sigmoid" else softmax(logits)
    choice = scores + bias
    n, e = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.reshape(n, n_group, e // n_group)
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)              # top-2 sum per group
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_group]
        mask = np.zeros((n, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, e // n_group, axis=1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids, weights * scaling


def expert_weights(cfg, p_experts):
    """(w1, w3, w2) float64 [E, out, in] from bf16/f32 or MXFP4 (`w*_packed`, `w*_scale`) params."""
    if cfg.expert_format == "mxfp4":
        return tuple(mxfp4_dequantize(p_experts[f"{n}_packed"], p_experts[f"{n}_scale"]) for n in ("w1", "w3", "w2"))
    return p_experts["w1"], p_experts["w3"], p_experts["w2"]


def experts_loop(cfg, z, ids, weights, w1, w3, w2):
    """sum_j weights[n, j] * expert_{ids[n, j]}(z[n]), one token and one expert at a time."""
    out = np.zeros(z.shape)
    for i in range(z.shape[0]):
        for e, wt in zip(ids[i], weights[i]):
            out[i] += wt * (w2[e] @ glu(cfg, w1[e] @ z[i], w3[e] @ z[i]))
    return out


def moe(cfg, p, x):
    """(Latent) MoE on x [N, D]: router on x; latent down-proj, experts, RMSNorm, up-proj; + shared."""
    ids, weights = route(x, p["gate"]["weight"], p["gate"]["e_score_correction_bias"],
                         top_k=cfg.num_experts_per_token, activation=cfg.moe_router_activation_func,
                         renormalize=cfg.moe_renormalize, scaling=cfg.routed_scaling_factor,
                         n_group=cfg.num_expert_group, topk_group=cfg.topk_group)
    latent = bool(cfg.routed_expert_hidden_size)
    z = linear(x, p["routed_expert_down_proj"]["weight"]) if latent else x
    u = experts_loop(cfg, z, ids, weights, *expert_weights(cfg, p["experts"]))
    if latent:
        if cfg.latent_moe_use_norm:
            u = rms_norm(u, p["routed_expert_norm"]["weight"], cfg.rms_norm_eps)
        u = linear(u, p["routed_expert_up_proj"]["weight"])
    if cfg.num_shared_experts:
        u = u + gated_mlp(cfg, p["shared_experts"], x)
    return u


# ------------------------------------------------------------------ Block AttnRes
def attn_res_mix(candidates, norm_w, proj, eps):
    """Softmax over depth: candidates list of [..., D]; each is RMS-normalised (no weight), scored
    against norm_w * proj; the probabilities weight the raw candidates."""
    v = np.stack(candidates)
    keys = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
    probs = softmax(np.sum(keys * (norm_w * proj), axis=-1), axis=0)
    return np.sum(probs[..., None] * v, axis=0)


# ------------------------------------------------------------------ whole model
def _ffn(cfg, layer, p, x):
    b, t, d = x.shape
    if cfg.is_moe_layer(layer):
        return moe(cfg, p["block_sparse_moe"], x.reshape(-1, d)).reshape(b, t, d)
    return gated_mlp(cfg, p["mlp"], x)


def _mixer(cfg, layer, p, x):
    x = rms_norm(x, p["input_layernorm"]["weight"], cfg.rms_norm_eps)
    return (kda_layer if cfg.layer_kinds[layer] == "kda" else mla_layer)(cfg, p["self_attn"], x)


def model_forward(cfg, params, tokens):
    """tokens [B, T] -> float64 logits [B, T, V], full sequence from an empty state."""
    h = params["embed_tokens"][np.asarray(tokens)]
    eps = cfg.rms_norm_eps
    if cfg.attn_res_block_size is None:
        for i in range(cfg.num_hidden_layers):
            p = params["layers"][i]
            h = h + _mixer(cfg, i, p, h)
            h = h + _ffn(cfg, i, p, rms_norm(h, p["post_attention_layernorm"]["weight"], eps))
    else:
        # Block AttnRes state machine: blocks start empty; layer 0 stores the embeddings as the
        # first block; a new block starts when i % block_size == 0; the mix before the mixer is
        # skipped while no block exists; every FFN input is a mix; a final mix precedes the norm.
        blocks, partial = [], h
        for i in range(cfg.num_hidden_layers):
            p = params["layers"][i]
            x = attn_res_mix(blocks + [partial], p["self_attention_res_norm"], p["self_attention_res_proj"],
                             eps) if blocks else partial
            if i % cfg.attn_res_block_size == 0:
                blocks.append(partial)
                partial = None
            a = _mixer(cfg, i, p, x)
            partial = a if partial is None else partial + a
            x = attn_res_mix(blocks + [partial], p["mlp_res_norm"], p["mlp_res_proj"], eps)
            partial = partial + _ffn(cfg, i, p, rms_norm(x, p["post_attention_layernorm"]["weight"], eps))
        h = attn_res_mix(blocks + [partial], params["output_attn_res_norm"], params["output_attn_res_proj"], eps)
    return linear(rms_norm(h, params["norm"]["weight"], eps), params["lm_head"]["weight"])
