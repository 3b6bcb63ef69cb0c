"""The model's numerics as pure functions: one formula, one place.

The NNX layers in `k3jax.layers` call these; the Pallas and CuTe kernels use them as their
references. Weights use the Hugging Face layout `[out, in]`. Unless stated otherwise, activations
come in the model dtype and leave in it; reductions and nonlinearities run in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from k3jax import mxfp4

f32 = jnp.float32
# Every dot that can see float32 operands asks for full float32 precision: on Ampere and later
# GPUs JAX's default precision rounds them to TF32 (10-bit mantissa), which would quantise the KDA
# state, the router logits and the MoE combine that these functions define (jax.lax.Precision's
# documentation). No effect on bf16 x bf16 dots or on CPU; the XLA decode step's time on the H200
# did not change (16.18 ms at batch 1 vs 16.57 before).
EXACT = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------ dense basics
def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., in] @ weight[out, in].T -> [..., out], accumulated in float32, in x's dtype."""
    return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype), precision=EXACT,
                      preferred_element_type=f32).astype(x.dtype)


def sum_squares(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """sum(x^2) over the last axis in float32: x [..., D] -> [...] (keepdims: [..., 1])."""
    xf = x.astype(f32)
    return jnp.sum(xf * xf, axis=-1, keepdims=keepdims)


def rms_normalize(x: jax.Array, eps: float, mean_sq: jax.Array | None = None) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) over the last axis: x [..., D] -> [..., D] float32, no weight.
    mean_sq (float32, broadcastable to x): mean(x^2) over the whole normalised axis, for a kernel
    holding a slice of it (the slices' `sum_squares` summed / the axis length); default from x."""
    if mean_sq is None:
        mean_sq = sum_squares(x, keepdims=True) / x.shape[-1]
    return x.astype(f32) * jax.lax.rsqrt(mean_sq + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, mean_sq: jax.Array | None = None) -> jax.Array:
    """Hugging Face RMSNorm: x [..., D], weight [D] -> [..., D] in x's dtype (normalise in
    float32, cast back, then scale by the weight cast to x's dtype). mean_sq: `rms_normalize`."""
    return weight.astype(x.dtype) * rms_normalize(x, eps, mean_sq).astype(x.dtype)


def sigmoid_gate(o: jax.Array, gate: jax.Array) -> jax.Array:
    """o * sigmoid(gate), same shapes; the sigmoid in float32, cast to o's dtype before the product."""
    return o * jax.nn.sigmoid(gate.astype(f32)).astype(o.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float,
                   mean_sq: jax.Array | None = None) -> jax.Array:
    """KDA output norm: x, gate [..., D], weight [D] -> sigmoid_gate(rms_norm(x), gate) [..., D] in
    x's dtype. mean_sq: `rms_normalize`."""
    return sigmoid_gate(rms_norm(x, weight, eps, mean_sq), gate)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (fla's l2norm)."""
    xf = x.astype(f32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


# ------------------------------------------------------------------ activations
def situ(gate: jax.Array, up: jax.Array, beta: float, linear_beta: float | None) -> jax.Array:
    """SiTU GLU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta). Elementwise over
    gate, up (same shape); computed in float32, returned in gate's dtype."""
    g, u = gate.astype(f32), up.astype(f32)
    act = beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * jnp.tanh(u / linear_beta)
    return (act * u).astype(gate.dtype)


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU: silu(g) * u (Kimi-Linear's experts). Elementwise; float32 inside, gate's dtype out."""
    return (jax.nn.silu(gate.astype(f32)) * up.astype(f32)).astype(gate.dtype)


def glu(gate: jax.Array, up: jax.Array, act: str, beta: float, linear_beta: float | None) -> jax.Array:
    """The configured gated activation: 'situ' (K3) or 'silu' (Kimi-Linear). Elementwise, gate's dtype."""
    return situ(gate, up, beta, linear_beta) if act == "situ" else silu_glu(gate, up)


def gated_mlp(x, w_gate, w_up, w_down, act: str, beta: float, linear_beta: float | None, *, proj=linear):
    """down(glu(gate(x), up(x))): x [..., D] -> [..., D] in x's dtype; weights [I, D], [I, D], [D, I].
    proj: the projection to use (the model passes its plan's "linear" kernel)."""
    return proj(glu(proj(x, w_gate), proj(x, w_up), act, beta, linear_beta), w_down)


# ------------------------------------------------------------------ KDA
def kda_decay(f: jax.Array, a_log: jax.Array, dt_bias: jax.Array, lower_bound: float | None) -> jax.Array:
    """Per-channel log-decay g <= 0 from the low-rank gate output f [..., H, K].

    With a lower bound (K3): g = lb * sigmoid(exp(A_log) * (f + dt_bias)), so g in (lb, 0).
    Without (Kimi-Linear):   g = -exp(A_log) * softplus(f + dt_bias).
    a_log [H] and dt_bias [H, K] are float32. Returns g [..., H, K] float32.
    """
    return log_decay(f.astype(f32) + dt_bias.astype(f32), jnp.exp(a_log.astype(f32))[:, None], lower_bound)


def log_decay(x: jax.Array, a: jax.Array, lower_bound: float | None) -> jax.Array:
    """kda_decay's formula from x = f + dt_bias and a = exp(A_log) (float32, broadcastable),
    shared with the KDA decode kernel (which holds one head's x as a vector and a as a scalar)."""
    if lower_bound is not None:
        return lower_bound * jax.nn.sigmoid(a * x)
    # softplus(x) from primitives Mosaic GPU lowers (jax.nn.softplus needs log1p). log(1 + e) for
    # log1p(e) costs at most ~6e-8 absolute in softplus, so at most a * 6e-8 relative in the decay
    # exp(g) (1e-6 at a = 16): float32 rounding level, far below the state's 1e-4 tolerance.
    return -a * (jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x))))


def short_conv(window: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise causal conv + SiLU over a window that already holds the K-1 past inputs.

    window [B, K-1+T, C] (model dtype), weight [C, K] float32 (column K-1 hits the newest input).
    Returns [B, T, C] in float32.
    """
    k = weight.shape[-1]
    t = window.shape[1] - (k - 1)
    return conv_taps(tuple(window[:, j:j + t, :] for j in range(k)), tuple(weight[:, j] for j in range(k)))


def kda_window(conv_state: jax.Array, qkv) -> jax.Array:
    """The short conv's window: conv_state [B, K-1, 3P] (the past inputs) then the new tokens'
    q|k|v from qkv = (q, k, v) [B, T, P] each -> [B, K-1+T, 3P] in conv_state's dtype."""
    return jnp.concatenate([conv_state, jnp.concatenate(qkv, axis=-1).astype(conv_state.dtype)], axis=1)


def conv_taps(taps, weights) -> jax.Array:
    """silu(sum_j taps[j] * weights[j]) in float32: the short conv's formula, shared by `short_conv`
    and the KDA decode kernel (which holds the window as separate vectors)."""
    return jax.nn.silu(sum(t.astype(f32) * w.astype(f32) for t, w in zip(taps, weights, strict=True)))


def kda_recurrent_step(state, q, k, v, g, beta):
    """One token of the gated delta rule. State layout [B, H, K, V] (float32, transformers' layout).

    q, k [B, H, K] (l2-normalised; q already scaled), v [B, H, V], g [B, H, K] log-decay,
    beta [B, H]. Decay first, then the delta-rule rank-1 update, then read out with q.
    Returns (o [B, H, V] float32, new_state).
    """
    s = state * jnp.exp(g)[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", k, s, precision=EXACT)
    u = beta[..., None] * (v - pred)
    s = s + k[..., :, None] * u[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q, s, precision=EXACT), s


def kda_chunked(state, q, k, v, g, beta, chunk: int = 16):
    """The gated delta rule over T tokens in chunks (WY form); same math as T recurrent steps.

    state [B, H, K, V] f32; q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K]; beta [B, T, H]
    (all float32). A token with beta = 0 and g = 0 leaves the state untouched (used for padding).
    Within a chunk with cumulative log-decay c_t (per key channel), and u_t the delta-rule update:
        (I + diag(beta) L) U = diag(beta) (V - (K * e^c) S0),  L_ts = sum_c k_t k_s e^(c_t - c_s), s < t
        O = (Q * e^c) S0 + M U,                                M_ts = sum_c q_t k_s e^(c_t - c_s), s <= t
        S_end = e^(c_end) * S0 + (K * e^(c_end - c))^T U
    Pairwise exponents c_t - c_s (s <= t) are <= 0, so nothing overflows for any gate.
    Returns (o [B, T, H, V] float32, final state).
    """
    b, t, h, _ = k.shape
    n = -(-t // chunk)
    pad = n * chunk - t

    def prep(x):  # [B, T, H, ...] -> [n, B, H, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, chunk, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    qc, kc, vc, gc, bc = map(prep, (q, k, v, g, beta))
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    eye = jnp.eye(chunk, dtype=f32)

    def step(s0, xs):
        qi, ki, vi, gi, bi = xs                      # [B, H, C, K|V], bi [B, H, C]
        c = jnp.cumsum(gi, axis=-2)                  # [B, H, C, K]
        diff = c[..., :, None, :] - c[..., None, :, :]                     # [B, H, Ct, Cs, K]
        decay = jnp.exp(jnp.where(causal[..., None], diff, -jnp.inf))
        lmat = jnp.einsum("bhtk,bhsk,bhtsk->bhts", ki, ki, decay, precision=EXACT) * strict
        mmat = jnp.einsum("bhtk,bhsk,bhtsk->bhts", qi, ki, decay, precision=EXACT)
        rhs = bi[..., None] * (vi - jnp.einsum("bhck,bhkv->bhcv", ki * jnp.exp(c), s0, precision=EXACT))
        a = eye + bi[..., None] * lmat
        u = jax.scipy.linalg.solve_triangular(a, rhs, lower=True, unit_diagonal=True)
        o = (jnp.einsum("bhck,bhkv->bhcv", qi * jnp.exp(c), s0, precision=EXACT)
             + jnp.einsum("bhts,bhsv->bhtv", mmat, u, precision=EXACT))
        c_end = c[..., -1:, :]
        s1 = jnp.exp(c_end[..., 0, :])[..., None] * s0 + jnp.einsum(
            "bhck,bhcv->bhkv", ki * jnp.exp(c_end - c), u, precision=EXACT)
        return s1, o

    s, o = jax.lax.scan(step, state, (qc, kc, vc, gc, bc))
    o = jnp.moveaxis(o, 0, 1)                        # [B, n, H, C, V]
    o = jnp.moveaxis(o, 3, 2).reshape(b, n * chunk, h, -1)[:, :t]
    return o, s


def kda_inputs(window, conv_w, f, beta_logit, a_log, dt_bias, num_heads: int, lower_bound: float | None):
    """Everything the delta rule consumes, from the projections of T new tokens.

    window [B, K-1+T, 3P] (past K-1 then new pre-conv q|k|v, model dtype); conv_w: the q, k and v
    short-conv filters, three [P, K] float32 (as the model holds them); f [B, T, P] gate low-rank
    output; beta_logit [B, T, H]; a_log [H]; dt_bias [P].
    Returns float32 q, k [B, T, H, d] (L2-normalised, q scaled by d^-0.5), v [B, T, H, d],
    g [B, T, H, d] log-decay and beta [B, T, H].
    """
    b, t = f.shape[:2]
    d = f.shape[-1] // num_heads
    q, k, v = jnp.split(short_conv(window, jnp.concatenate(conv_w)).reshape(b, t, 3, num_heads, d), 3, axis=2)
    q, k, beta = kda_qk_beta(q[:, :, 0], k[:, :, 0], beta_logit)
    g = kda_decay(f.reshape(b, t, num_heads, d), a_log, dt_bias.reshape(num_heads, d), lower_bound)
    return q, k, v[:, :, 0], g, beta


def kda_qk_beta(q, k, beta_logit):
    """The delta rule's query, key and write strength from the short conv's q, k [..., d] and
    beta_logit: L2-normalised q scaled by d^-0.5, L2-normalised k, sigmoid(beta_logit) in float32."""
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k), jax.nn.sigmoid(beta_logit.astype(f32))


def kda_decode(conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent,
               *, num_heads: int, lower_bound: float | None, eps: float):
    """One KDA decode step after the projections: conv update, gates, L2 norms, delta rule, gated norm.

    conv_state [B, K-1, 3P] (the q|k|v window); qkv: the new token's q, k, v projections, three
    [B, P]; conv_w: the three [P, K] float32 filters; f, gate [B, P]; beta_logit [B, H];
    recurrent [B, H, d, d] f32. Returns (o [B, P] in qkv's dtype, new conv_state, new recurrent).
    q, k, v and the filters come as separate arrays, as the model has them: a kernel reads each in
    place, where one stacked operand would cost an XLA concatenation a layer every step.
    """
    (q, k, v, g, beta), conv = kda_step_inputs(conv_state, qkv, conv_w, f, beta_logit, a_log, dt_bias,
                                               num_heads, lower_bound)
    o, s = kda_recurrent_step(recurrent, q, k, v, g, beta)
    b, h, d = o.shape
    o = gated_rms_norm(o.astype(qkv[0].dtype), gate.reshape(b, h, d), o_norm, eps)
    return o.reshape(b, h * d), conv, s


def kda_step_inputs(conv_state, qkv, conv_w, f, beta_logit, a_log, dt_bias, num_heads: int,
                    lower_bound: float | None):
    """`kda_inputs` for one new token per sequence: ((q, k, v, g [B, H, d], beta [B, H]) float32,
    the new conv_state [B, K-1, 3P]: the window shifted by the token)."""
    window = kda_window(conv_state, tuple(y[:, None] for y in qkv))
    inputs = kda_inputs(window, conv_w, f[:, None], beta_logit[:, None], a_log, dt_bias, num_heads, lower_bound)
    return tuple(x[:, 0] for x in inputs), window[:, 1:]


# ------------------------------------------------------------------ MLA
def mla_attention_expanded(q_nope, q_rope, latent, k_rope, w_kv_b, mask, scale):
    """Reference MLA: decompress the latent cache into per-head keys/values, then softmax attention.

    q_nope [B, T, H, N], q_rope [B, T, H, R]; latent [B, L, C] (normalised), k_rope [B, L, R];
    w_kv_b [H*(N+V), C]; mask [B, T, L] bool. Returns [B, T, H, V] in q's dtype.
    """
    h, n = q_nope.shape[2], q_nope.shape[3]
    kv = linear(latent, w_kv_b).reshape(*latent.shape[:2], h, -1)   # [B, L, H, N+V]
    k_nope, value = kv[..., :n], kv[..., n:]
    scores = (jnp.einsum("bthn,blhn->bhtl", q_nope, k_nope, preferred_element_type=f32, precision=EXACT)
              + jnp.einsum("bthr,blr->bhtl", q_rope, k_rope, preferred_element_type=f32, precision=EXACT)) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhtl,blhv->bthv", probs.astype(value.dtype), value,
                      preferred_element_type=f32, precision=EXACT).astype(q_nope.dtype)


def mla_absorb_query(q_nope, w_kv_b):
    """q_nope [..., H, N] -> q_lat [..., H, C] float32: q_nope @ W_uk per head, W_uk [N, C] being
    the key rows of w_kv_b [H*(N+V), C]. Float32 operands (exact for bf16 inputs; XLA:CPU has no
    batched bf16 x bf16 -> f32 dot)."""
    h, n = q_nope.shape[-2:]
    w_uk = w_kv_b.reshape(h, -1, w_kv_b.shape[-1])[:, :n]
    return jnp.einsum("...hn,hnc->...hc", q_nope.astype(f32), w_uk.astype(f32), precision=EXACT)


def mla_expand_output(o_lat, w_kv_b, n: int, dtype):
    """o_lat [..., H, C] (attended latent) -> [..., H, V] in dtype: o_lat @ W_uv.T per head, W_uv
    [V, C] being the value rows of w_kv_b [H*(N+V), C] after the first n (the key rows)."""
    h, c = o_lat.shape[-2:]
    w_uv = w_kv_b.reshape(h, -1, c)[:, n:]
    return jnp.einsum("...hc,hvc->...hv", o_lat, w_uv.astype(f32), precision=EXACT).astype(dtype)


def mla_attention_absorbed(q_nope, q_rope, latent, k_rope, w_kv_b, mask, scale):
    """MLA with kv_b folded into q and o: attends over the compressed cache, never expanding it.

    Same arguments and result as `mla_attention_expanded` (mla_absorb_query /
    mla_expand_output hold the folding).
    """
    q_lat = mla_absorb_query(q_nope, w_kv_b)                                  # [B, T, H, C]
    scores = (jnp.einsum("bthc,blc->bhtl", q_lat, latent.astype(f32), precision=EXACT)
              + jnp.einsum("bthr,blr->bhtl", q_rope, k_rope, preferred_element_type=f32, precision=EXACT)) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    o_lat = jnp.einsum("bhtl,blc->bthc", probs, latent.astype(f32), precision=EXACT)
    return mla_expand_output(o_lat, w_kv_b, q_nope.shape[-1], q_nope.dtype)


def mla_cache_columns(cache, w_kv_b, q_rope) -> tuple[int, int]:
    """(C, R): the latent and shared key widths of an MLA cache [B, L, C + R] read with w_kv_b
    [H*(N+V), C] and q_rope [B, H, R]; a ValueError naming the three shapes when they disagree."""
    c, r = w_kv_b.shape[-1], q_rope.shape[-1]
    if cache.shape[-1] != c + r:
        raise ValueError(f"mla_decode: cache {list(cache.shape)} has {cache.shape[-1]} columns a token, but "
                         f"w_kv_b {list(w_kv_b.shape)} and q_rope {list(q_rope.shape)} make {c} + {r}")
    return c, r


def mla_decode(q_nope, q_rope, cache, w_kv_b, kv_len, scale):
    """Absorbed MLA for one new token per sequence over the first kv_len[b] cache entries.

    q_nope [B, H, N], q_rope [B, H, R]; cache [B, L, C + R] as k3jax.cache holds it (the latent,
    then the shared key dims; C = w_kv_b's columns); w_kv_b [H*(N+V), C]; kv_len [B] int.
    Returns [B, H, V] in q's dtype. The cache is taken whole so that a kernel reads both parts in
    place: two sliced views passed to a custom call are two copies of the cache.
    """
    c, _ = mla_cache_columns(cache, w_kv_b, q_rope)
    mask = (jnp.arange(cache.shape[1])[None, :] < kv_len[:, None])[:, None, :]       # [B, 1, L]
    return mla_attention_absorbed(q_nope[:, None], q_rope[:, None], cache[..., :c], cache[..., c:], w_kv_b,
                                  mask, scale)[:, 0]


# ------------------------------------------------------------------ MoE routing
def route_scores(x, weight, bias, activation: str):
    """The router's float32 scores [N, E] (sigmoid or softmax of x [N, D] @ weight[E, D].T) and the
    values experts are selected by: scores + bias [E]."""
    logits = jnp.einsum("nd,ed->ne", x.astype(f32), weight.astype(f32), precision=EXACT)
    scores = jax.nn.sigmoid(logits) if activation == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    return scores, scores + bias.astype(f32)


def route(x, weight, bias, *, top_k: int, activation: str, renormalize: bool,
          scaling: float, n_group: int = 1, topk_group: int = 1):
    """Router: float32 logits -> scores; select top-k of (scores + bias); weight by the plain scores.

    x [N, D], weight [E, D], bias [E] (used for selection only). Ties go to the lower expert id.
    Returns (ids [N, k] int32, weights [N, k] float32).
    """
    scores, choice = route_scores(x, weight, bias, activation)
    if n_group > 1 and topk_group < n_group:
        grouped = choice.reshape(choice.shape[0], n_group, -1)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)                     # [N, G]
        keep_groups = jax.lax.top_k(group_score, topk_group)[1]
        keep = jnp.zeros_like(group_score, bool).at[
            jnp.arange(choice.shape[0])[:, None], keep_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, grouped.shape[-1], axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * scaling


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertWeights:
    """Stacked routed-expert weights: w1/w3 [E, I, M] (gate/up), w2 [E, M, I] (down).

    bf16 format: `w1`, `w3`, `w2` hold the matrices. MXFP4 format: they hold the packed codes
    (uint8 [E, out, in/2]) and `s1`, `s3`, `s2` the UE8M0 scales (uint8 [E, out, in/32]), in row
    order or, `tiled` (static), each expert's bytes in mxfp4.to_tiles' tile order.
    """

    w1: jax.Array
    w3: jax.Array
    w2: jax.Array
    s1: jax.Array | None = None
    s3: jax.Array | None = None
    s2: jax.Array | None = None
    tiled: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def is_mxfp4(self) -> bool:
        return self.s1 is not None

    def in_tiles(self) -> ExpertWeights:
        """These MXFP4 experts, stored in tiles (mxfp4.to_tiles; needs out % 64 and in % 128 == 0)."""
        if not self.is_mxfp4 or self.tiled:
            raise ValueError("in_tiles: needs MXFP4 experts in row order")
        return ExpertWeights(*(mxfp4.to_tiles(w) for w in (self.w1, self.w3, self.w2)),
                             *(mxfp4.to_tiles(s, scales=True) for s in (self.s1, self.s3, self.s2)), tiled=True)

    def _gathered(self, ids: jax.Array) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """MXFP4: the experts `ids` [U] as stored, (codes, scales) per matrix (w1, w3, w2)."""
        return tuple((w[ids], s[ids]) for w, s in ((self.w1, self.s1), (self.w3, self.s3), (self.w2, self.s2)))

    def gather(self, ids: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Only the experts `ids` [U], dequantised to `dtype` in row order: (w1, w3, w2)."""
        if not self.is_mxfp4:
            return tuple(w[ids].astype(dtype) for w in (self.w1, self.w3, self.w2))
        pairs = self._gathered(ids)
        if self.tiled:
            pairs = ((mxfp4.from_tiles(w), mxfp4.from_tiles(s, scales=True)) for w, s in pairs)
        return tuple(mxfp4.dequantize(w, s, dtype) for w, s in pairs)

    def gather_parts(self, ids: jax.Array, dtype) -> tuple[tuple[jax.Array, ...], ...]:
        """MXFP4 only: the experts `ids` [U] dequantised to `dtype`, each matrix (w1, w3, w2) as P
        parts, part j = its input columns j, j + P, ... [U, out, in/P]: row order P = 2 (the
        nibbles: mxfp4.dequantize_halves), tiles P = 8 (mxfp4.dequantize_tile_words, dequantised
        in place and written out in row order). Nothing interleaves, nothing is untiled: XLA
        fuses the gather and the dequantisation into `parts_matmul`."""
        def parts(w, s):
            if not self.tiled:
                return mxfp4.dequantize_halves(w, s, dtype)
            tiles = mxfp4.dequantize_tile_words(mxfp4.tile_view(w), mxfp4.tile_view(s, scales=True), dtype)
            return tuple(p.swapaxes(-3, -2).reshape(*w.shape[:-1], -1) for p in tiles)  # [U, T, C, r, b] -> [U, T, r, C, b]

        return tuple(parts(w, s) for w, s in self._gathered(ids))

    @staticmethod
    def parts_matmul(x: jax.Array, parts: tuple[jax.Array, ...]) -> jax.Array:
        """x [N, in] (every expert's input) or [U, N, in] (one per expert) times one matrix of the
        gathered experts, as `gather_parts` returns it: -> [U, N, out] float32."""
        spec = "uni,uoi->uno" if x.ndim == 3 else "ni,uoi->uno"
        return sum(jnp.einsum(spec, x[..., j::len(parts)], w, preferred_element_type=f32, precision=EXACT)
                   for j, w in enumerate(parts))


DENSE_DISPATCH_MAX_TOKENS = 64  # tokens per moe_experts chunk: each distinct expert runs on all of them


def dispatch_in_choice_order(ids: jax.Array, size: int) -> bool:
    """Whether expert_dispatch(ids, ..., size) keeps the ids as they are: one token, size == k.
    Its slot j is then choice j, whose coefficient is routing weight j."""
    return ids.shape[0] == 1 and size == ids.shape[1]


def expert_dispatch(ids: jax.Array, weights: jax.Array, num_experts: int, size: int):
    """The distinct selected experts and each token's coefficient for them.

    ids, weights [N, k]. Returns (uniq [size] int32: sorted distinct ids padded with `num_experts`,
    which sorts last; coef [size, N] float32: the routing weight where token n chose expert uniq[u],
    else 0, and 0 on every padding row, also for a token whose id is num_experts: the kernels skip
    padding rows, the reference gathers a real expert for them).

    One token with size == k takes no sort and no reductions: uniq is its ids as they are (an id
    >= num_experts stays, with coefficient 0; top-k never repeats an id, and a repeated one would
    run once per slot with its own weight: the same sum) and coef its weights (H200, session 16:
    the MXFP4 Pallas op at batch 1 105.3 -> 101.3 us without the dispatch's small fusions).
    """
    if dispatch_in_choice_order(ids, size):
        return ids[0].astype(jnp.int32), jnp.where(ids < num_experts, weights, 0.0).T.astype(f32)
    # Sort-free: the first occurrence of each valid id, its rank among the distinct ids (how many
    # distinct ids are smaller), and uniq[u] = the id of rank u. Three small reductions over the
    # N*k selections: at decode this glue runs once per MoE layer, and XLA:GPU's sort kernel for a
    # top_k over the experts alone cost more than the whole of it.
    flat = ids.reshape(-1)
    pos = jnp.arange(flat.shape[0])
    same = flat[None, :] == flat[:, None]                                  # [p, q]
    first = (flat < num_experts) & ~jnp.any(same & (pos[None, :] < pos[:, None]), axis=1)
    rank = jnp.sum(first[None, :] & (flat[None, :] < flat[:, None]), axis=1)
    slot = jnp.arange(size, dtype=rank.dtype)
    uniq = jnp.min(jnp.where(first[None, :] & (rank[None, :] == slot[:, None]), flat[None, :], num_experts),
                   axis=1, initial=num_experts).astype(jnp.int32)
    chosen = (ids[None] == uniq[:, None, None]) & (uniq < num_experts)[:, None, None]         # [U, N, k]
    coef = jnp.einsum("unk,nk->un", chosen.astype(f32), weights, precision=EXACT)
    return uniq, coef


def repeated_later(ids: jax.Array) -> jax.Array:
    """ids [N, k] -> [N, k] bool: True where a later choice of the same token names the same id
    (the kernels' dispatch lets a token's last choice of an id stand for all of them, with their
    summed weight; top-k never repeats an id)."""
    k = ids.shape[1]
    return jnp.any((ids[:, :, None] == ids[:, None, :]) & jnp.triu(jnp.ones((k, k), bool), 1), axis=2)


GROUPED_MAX_TOKENS = 256   # tokens per call of the kernels' grouped schedules: bounds their per-choice buffers


def expert_groups_bound(tokens: int, k: int, num_experts: int, group: int) -> int:
    """Static bound on expert_groups' slot count: each selected expert's choices fill
    ceil(count / group) slots, at most (N*k + (group - 1) * min(E, N*k)) / group in all (<= N*k)."""
    choices = tokens * k
    return (choices + (group - 1) * min(num_experts, choices)) // group


def expert_groups(ids: jax.Array, num_experts: int, group: int, slot_multiple: int = 1):
    """Each selected expert's own choices, in slots of at most `group` (the kernels' grouped dispatch).

    ids [N, k]. Every choice n*k + j with ids[n, j] < num_experts gets one column of one slot of
    its expert; slots run in expert order, an expert's choices in token order. With
    S = expert_groups_bound(N, k, E, group) rounded up to a multiple of `slot_multiple`, returns
      uniq [S] int32: each slot's expert, num_experts for the unused slots at the end;
      choices [S, group] int32: the choice n*k + j in each column, N*k where unused (so
        choices // k is its token, and N for an unused column);
      where [N, k] int32: slot * group + column of each choice, S * group for ids >= num_experts.
    One stable sort of the N*k ids; every write lands on its own position (deterministic).
    """
    n, k = ids.shape
    size = -(-expert_groups_bound(n, k, num_experts, group) // slot_multiple) * slot_multiple
    flat = jnp.minimum(ids.reshape(-1).astype(jnp.int32), num_experts)       # >= E: no expert here
    order = jnp.argsort(flat, stable=True)
    count = jnp.bincount(flat, length=num_experts + 1)
    start = jnp.cumsum(count) - count
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(n * k, dtype=jnp.int32) - start[flat[order]])
    end = jnp.cumsum(-(-count[:num_experts] // group))                       # [E]: each expert's last slot + 1
    first = jnp.concatenate([jnp.zeros((1,), end.dtype), end])[flat]         # its first slot (E: past the end)
    where = jnp.where(flat < num_experts, (first + rank // group) * group + rank % group, size * group)
    where = where.astype(jnp.int32)
    uniq = jnp.sum(end[None, :] <= jnp.arange(size)[:, None], axis=1).astype(jnp.int32)
    choices = jnp.full((size * group,), n * k, jnp.int32).at[where].set(jnp.arange(n * k, dtype=jnp.int32), mode="drop")
    return uniq, choices.reshape(size, group), where.reshape(n, k)


def map_token_chunks(fn, z: jax.Array, ids: jax.Array, weights: jax.Array, max_rows: int) -> jax.Array:
    """fn(z [R, M], ids [R, k], weights [R, k]) -> [R, M], over N tokens in equal chunks of at most
    `max_rows` rows (one `lax.map` step each). Padding rows (fewer than a chunk, all in the last
    one) repeat the last token's experts with weight 0: no extra expert, no contribution. Returns [N, M]."""
    n, k = ids.shape
    if n <= max_rows:
        return fn(z, ids, weights)
    calls = -(-n // max_rows)
    rows = -(-n // calls)
    pad = calls * rows - n
    zc = jnp.pad(z, ((0, pad), (0, 0))).reshape(calls, rows, -1)
    idc = jnp.concatenate([ids, jnp.broadcast_to(ids[-1:], (pad, k))]).reshape(calls, rows, k)
    wc = jnp.pad(weights, ((0, pad), (0, 0))).reshape(calls, rows, k)
    return jax.lax.map(lambda a: fn(*a), (zc, idc, wc)).reshape(calls * rows, -1)[:n]


def moe_experts(z: jax.Array, ids: jax.Array, weights: jax.Array, experts: ExpertWeights, *,
                act: str, beta: float, linear_beta: float | None, expert_chunk: int = 64) -> jax.Array:
    """sum_k weights[n, k] * expert_{ids[n, k]}(z[n]) for z [N, M], touching only selected experts.

    Tokens go in chunks of at most DENSE_DISPATCH_MAX_TOKENS (`map_token_chunks`). Within one,
    the distinct selected experts (at most min(E, N*k), a static bound) are gathered and
    dequantised `expert_chunk` at a time, which bounds the bf16 temporary; every gathered expert
    runs on all the chunk's tokens as one batched matmul, and a [U, N] coefficient matrix
    (`expert_dispatch`: routing weight where token n chose expert u, else 0) combines them - no
    sort, no scatter, and no `ragged_dot` (XLA:GPU lowers it densely over all groups: 1.08 s for a
    k3-h200 step at batch 128). The extra FLOPs are bounded by the chunk size and free at decode
    sizes. Combines in float32. Returns [N, M] in z's dtype.
    """
    act_kw = dict(act=act, beta=beta, linear_beta=linear_beta, expert_chunk=expert_chunk)
    return map_token_chunks(lambda zc, ic, wc: _moe_token_chunk(zc, ic, wc, experts, **act_kw),
                            z, ids, weights, DENSE_DISPATCH_MAX_TOKENS)


def _moe_token_chunk(z, ids, weights, experts: ExpertWeights, *, act: str, beta: float,
                     linear_beta: float | None, expert_chunk: int) -> jax.Array:
    """moe_experts for at most DENSE_DISPATCH_MAX_TOKENS tokens: z [N, M] -> [N, M] in z's dtype."""
    n, k = ids.shape
    n_exp = experts.num_experts
    bound = min(n_exp, n * k)
    n_chunks = -(-bound // expert_chunk)
    chunk = -(-bound // n_chunks)
    uniq, coef = expert_dispatch(ids, weights, n_exp, n_chunks * chunk)

    def expert_dot(spec, x, w):
        if experts.is_mxfp4:   # x @ w.T over the column parts: no interleave, no untiling
            out = experts.parts_matmul(x, w)
        else:
            out = jnp.einsum(spec, x, w, preferred_element_type=f32, precision=EXACT)
        return out.astype(z.dtype)

    def run_chunk(c):
        ids_c = jnp.minimum(jax.lax.dynamic_slice_in_dim(uniq, c * chunk, chunk), n_exp - 1)
        w1, w3, w2 = (experts.gather_parts if experts.is_mxfp4 else experts.gather)(ids_c, z.dtype)
        gate, up = expert_dot("nm,uim->uni", z, w1), expert_dot("nm,uim->uni", z, w3)
        y = expert_dot("uni,umi->unm", glu(gate, up, act, beta, linear_beta), w2)
        return jnp.einsum("un,unm->nm", jax.lax.dynamic_slice_in_dim(coef, c * chunk, chunk), y.astype(f32),
                          precision=EXACT)

    out = run_chunk(0) if n_chunks == 1 else jax.lax.fori_loop(
        0, n_chunks, lambda c, acc: acc + run_chunk(c), jnp.zeros(z.shape, f32))
    return out.astype(z.dtype)


def combine_slots(per_slot: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """per_slot [N, k, M] (each slot's expert output), weights [N, k] -> [N, M] in dtype: the
    routing-weighted sum, in float32."""
    return jnp.einsum("nkm,nk->nm", per_slot.astype(f32), weights, precision=EXACT).astype(dtype)


# ------------------------------------------------------------------ Block Attention Residuals
def attn_res_weights(candidates: jax.Array, norm_weight: jax.Array, query: jax.Array, eps: float) -> jax.Array:
    """Softmax weights over depth, float32 [N, ...], for candidates [N, ..., D] (block checkpoints,
    then the partial sum): each candidate is RMS-normalised and scored against the pseudo-query
    (norm weight * proj weight, [D])."""
    keys = rms_normalize(candidates, eps)
    scores = jnp.sum(keys * (norm_weight.astype(f32) * query.astype(f32)), axis=-1)  # [N, ...]
    return jax.nn.softmax(scores, axis=0)


def attn_res_mix(candidates: jax.Array, norm_weight: jax.Array, query: jax.Array, eps: float) -> jax.Array:
    """Block AttnRes: the `attn_res_weights`-weighted sum of the raw candidates, in their dtype."""
    probs = attn_res_weights(candidates, norm_weight, query, eps)
    return jnp.sum(probs[..., None] * candidates.astype(f32), axis=0).astype(candidates.dtype)


def attn_res_mix_norm(candidates: jax.Array, norm_weight: jax.Array, query: jax.Array, out_norm: jax.Array,
                      eps: float) -> jax.Array:
    """A sub-layer's input: `attn_res_mix`, then the sub-layer's RMSNorm (weight out_norm [D], same
    eps): candidates [N, ..., D] -> [..., D] in their dtype. One op so a kernel can fuse the two."""
    return rms_norm(attn_res_mix(candidates, norm_weight, query, eps), out_norm, eps)


# ------------------------------------------------------------------ sampling
def sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Next token ids [B] from logits [B, V]: greedy when temperature == 0, else temperature
    sampling restricted to the top-k (0 = all) and to the smallest set with mass >= top_p."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(f32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        sorted_logits = jnp.where(mass_before >= top_p, -jnp.inf, sorted_logits)
        logits = jnp.full_like(logits, -jnp.inf).at[
            jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
