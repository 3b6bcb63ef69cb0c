"""Every op and layer (float32) against the independent float64 NumPy reference in reference_numpy.

Tolerances: float32 has a unit roundoff of 6e-8. The ops below chain at most a few hundred
roundings with well-conditioned reductions (norms, softmax, width <= 128 dot products), so their
errors relative to the output's scale stay around 1e-6; 2e-5 leaves a 10x margin yet catches any
formula error (a wrong eps, scale, cast order or gate is >= 1e-3 here). The whole-model tests
chain 9 layers and an lm_head and use 1e-5 of the logit scale (see there).
Measured on the tiny presets: single ops and layers 2-5e-7, whole model 3-4e-7.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import reference_numpy as ref
from k3jax import ops
from k3jax.cache import init_state
from k3jax.config import K3Config

TOL = 2e-5


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (error relative to the output's scale)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all()
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def rand(key, *shape, scale=1.0):
    return np.asarray(jax.random.normal(jax.random.key(key), shape, jnp.float32)) * scale


# ------------------------------------------------------------------ norms and activations
@pytest.mark.parametrize("d", [16, 64, 96])
def test_rms_norm_float32(d):
    x, w = rand(0, 3, 5, d, scale=3.0), 1.0 + 0.1 * rand(1, d)
    assert rel_err(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x.astype(np.float64), w, 1e-5)) < TOL


def test_rms_norm_bf16_casts_before_the_weight():
    """HF order: normalise in f32, cast to bf16, then multiply by the bf16 weight (in bf16)."""
    bf16 = ml_dtypes.bfloat16
    x = rand(2, 64, 128, scale=5.0).astype(bf16)
    w = (1.0 + 0.3 * rand(3, 128)).astype(bf16)
    got = np.asarray(ops.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5))
    assert got.dtype == bf16
    want = ref.rms_norm(x, w, 1e-5, dtype=bf16)
    # f32 rsqrt vs 1/sqrt may differ in the last f32 bit, which can flip a bf16 rounding rarely.
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    ulp = np.abs(want.astype(np.float64)) * 2.0 ** -7
    assert (diff <= ulp).all()
    assert np.mean(diff == 0) > 0.99


def test_gated_rms_norm():
    x, gate, w = rand(4, 2, 3, 4, 16), rand(5, 2, 3, 4, 16, scale=2.0), 1.0 + 0.1 * rand(6, 16)
    got = ops.gated_rms_norm(x, gate, w, 1e-5)
    assert rel_err(got, ref.gated_rms_norm(x.astype(np.float64), gate, w, 1e-5)) < TOL


def test_l2_normalize_eps_inside_sum():
    # Small vectors, so the eps (added to the SUM of squares, not the mean) visibly matters.
    x = rand(7, 5, 16, scale=1e-3)
    got = ops.l2_normalize(x)
    assert rel_err(got, ref.l2norm(x.astype(np.float64), 1e-6)) < TOL
    assert rel_err(got, x / np.linalg.norm(x, axis=-1, keepdims=True)) > 1e-3


@pytest.mark.parametrize("beta,linear_beta", [(4.0, 25.0), (1.0, None)])
def test_situ(beta, linear_beta):
    g, u = rand(8, 4, 50, scale=8.0), rand(9, 4, 50, scale=40.0)   # reach both tanh saturations
    got = ops.situ(g, u, beta, linear_beta)
    assert rel_err(got, ref.situ_glu(g.astype(np.float64), u, beta, linear_beta)) < TOL


def test_silu_glu():
    g, u = rand(10, 4, 50, scale=4.0), rand(11, 4, 50)
    assert rel_err(ops.silu_glu(g, u), ref.silu_glu(g.astype(np.float64), u)) < TOL


# ------------------------------------------------------------------ KDA pieces
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_decay(lower_bound):
    f, a_log, dt = rand(12, 2, 7, 4, 16, scale=2.0), np.log(np.linspace(1, 16, 4)), rand(13, 4, 16)
    got = ops.kda_decay(f, a_log.astype(np.float32), dt, lower_bound)
    want = ref.kda_gate(f.astype(np.float64), a_log, dt, lower_bound)
    assert rel_err(got, want) < TOL
    assert (np.asarray(got) <= 0).all()
    if lower_bound is not None:
        assert (np.asarray(got) >= lower_bound).all()   # sigmoid saturates to 1 in float32


def test_short_conv_with_past_inputs():
    b, t, c, width = 2, 6, 24, 4
    past, x, w = rand(14, b, width - 1, c), rand(15, b, t, c), rand(16, c, width, scale=0.5)
    got = ops.short_conv(jnp.concatenate([past, x], axis=1), w)
    assert rel_err(got, ref.causal_conv_silu(x.astype(np.float64), w, past)) < TOL


def kda_inputs(key, b, t, h, dk, dv, lower_bound=-5.0):
    ks = jax.random.split(jax.random.key(key), 5)
    q = ops.l2_normalize(jax.random.normal(ks[0], (b, t, h, dk))) * dk ** -0.5
    k = ops.l2_normalize(jax.random.normal(ks[1], (b, t, h, dk)))
    v = jax.random.normal(ks[2], (b, t, h, dv))
    g = lower_bound * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (b, t, h, dk)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    return [np.asarray(a) for a in (q, k, v, g, beta)]


def test_kda_recurrent_step_matches_reference():
    b, t, h, dk, dv = 2, 5, 3, 16, 8
    q, k, v, g, beta = kda_inputs(17, b, t, h, dk, dv)
    s0 = rand(18, b, h, dk, dv)
    s, outs = jnp.asarray(s0), []
    for i in range(t):
        o, s = ops.kda_recurrent_step(s, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
        outs.append(o)
    want_o, want_s = ref.kda_recurrence(*(a.astype(np.float64) for a in (q, k, v, g, beta)), s0)
    assert rel_err(jnp.stack(outs, 1), want_o) < TOL
    assert rel_err(s, want_s) < TOL


def test_kda_chunked_matches_reference():
    b, t, h, dk, dv = 2, 37, 2, 16, 16        # 3 chunks of 16, the last partial
    q, k, v, g, beta = kda_inputs(19, b, t, h, dk, dv)
    s0 = rand(20, b, h, dk, dv)
    o, s = ops.kda_chunked(jnp.asarray(s0), q, k, v, g, beta)
    want_o, want_s = ref.kda_recurrence(*(a.astype(np.float64) for a in (q, k, v, g, beta)), s0)
    assert rel_err(o, want_o) < TOL
    assert rel_err(s, want_s) < TOL


# ------------------------------------------------------------------ attention-res and routing
def test_attn_res_mix():
    cands = rand(21, 4, 3, 5, 64, scale=2.0)
    cands[1] *= 10.0                          # candidates of different scales: the RMS norm matters
    norm_w, proj = 1.0 + 0.1 * rand(22, 64), rand(23, 64, scale=0.5)
    got = ops.attn_res_mix(cands, norm_w, proj, 1e-5)
    assert rel_err(got, ref.attn_res_mix(list(cands.astype(np.float64)), norm_w, proj, 1e-5)) < TOL


# ------------------------------------------------------------------ layers of the tiny models
def layer_input(cfg: K3Config, b=2, t=11):
    return rand(24, b, t, cfg.hidden_size)


def run_mixer(model, i, x, prefill: int):
    """Layer i's mixer over x [B, T, D]: one call on the first `prefill` tokens (chunked KDA /
    expanded MLA), then one-token calls (recurrent KDA / absorbed MLA). Returns [B, T, D]."""
    cfg, layer = model.cfg, model.layers[i].self_attn
    b, t, _ = x.shape
    state = init_state(cfg, b, t, jnp.float32).layers[i]
    lengths, outs = jnp.zeros((b,), jnp.int32), []
    for lo, hi in [(0, prefill)] + [(j, j + 1) for j in range(prefill, t)]:
        xs = jnp.asarray(x[:, lo:hi])
        if layer.__class__.__name__ == "KimiDeltaAttention":
            y, state = layer(xs, state, jnp.ones((b, hi - lo), bool), jnp.full((b,), hi - lo, jnp.int32))
        else:
            y, state = layer(xs, state, lengths)
        lengths = lengths + (hi - lo)
        outs.append(y)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_mixer_layer_prefill_and_decode(tiny_model, preset, kind):
    """KDA (chunked prefill, recurrent decode) and MLA (expanded prefill, absorbed decode) vs the
    NumPy token loop / expanded causal softmax."""
    model = tiny_model(preset)
    cfg, params = model.cfg, ref.params_of(model)
    i = (cfg.kda_layers[1] if kind == "kda" else cfg.mla_layers[0])
    x = layer_input(cfg, 2, 20)
    layer_ref = ref.kda_layer if kind == "kda" else ref.mla_layer
    want = layer_ref(cfg, params["layers"][i]["self_attn"], x.astype(np.float64))
    assert rel_err(run_mixer(model, i, x, prefill=17), want) < TOL


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny"])
def test_moe_layer(tiny_model, preset):
    """Router, (latent) routed experts (MXFP4 for k3-tiny, bf16-format f32 for Kimi-Linear), norm,
    up-projection and shared experts against the per-token loop."""
    model = tiny_model(preset)
    cfg, params = model.cfg, ref.params_of(model)
    x = layer_input(cfg, 3, 7)
    got = model.layers[2].block_sparse_moe(jnp.asarray(x))
    want = ref.moe(cfg, params["layers"][2]["block_sparse_moe"], x.reshape(-1, cfg.hidden_size).astype(np.float64))
    assert rel_err(got, want.reshape(x.shape)) < TOL


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny"])
def test_dense_mlp(tiny_model, preset):
    model = tiny_model(preset)
    x = layer_input(model.cfg)
    want = ref.gated_mlp(model.cfg, ref.params_of(model)["layers"][0]["mlp"], x.astype(np.float64))
    assert rel_err(model.layers[0].mlp(jnp.asarray(x)), want) < TOL


# ------------------------------------------------------------------ whole model
@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny"])
def test_whole_model_matches_numpy(tiny_model, preset):
    """float32 model vs float64 NumPy forward (KDA chunked in the model, token loop in NumPy).

    Tolerance 1e-5 of the logit scale. float32 through ~25 sub-layers and the lm_head measures
    3-4e-7 here (unit roundoff 6e-8 times a few per sub-layer), so 1e-5 is a 25x margin; wrong
    semantics move the logits by far more (measured: unnormalised AttnRes keys or block size
    off by one 0.6, l2norm eps on the mean instead of the sum 1e-4 to 5e-4, routed scaling off
    by 1% 6e-5 to 4e-4). The routing decisions must match exactly, which they do unless a
    score gap is below ~1e-6 (fixed seeds).
    """
    model = tiny_model(preset)
    # [2, 37]: the shape test_decode_consistency also runs, so the compiled forward is shared
    tokens = np.asarray(jax.random.randint(jax.random.key(25), (2, 37), 0, model.cfg.vocab_size))
    got = model(tokens)
    want = ref.model_forward(model.cfg, ref.params_of(model), tokens)
    assert rel_err(got, want) < 1e-5
