"""Prefill-then-decode equals one long prefill (float32 tiny models), and the op pairs behind it:
chunked vs recurrent KDA, absorbed vs expanded MLA.

A prefill of P tokens followed by one-token decode steps runs chunked KDA then recurrent KDA, and
expanded MLA then absorbed MLA over the latent cache; by causality its logits must equal the
logits of one prefill over all tokens. Tolerance 1e-5 of the logit scale: float32 through ~25
sub-layers measures 2-5e-7 (see test_layers); an actual mismatch between the forms (a lost
conv window, a wrong decay order, a misplaced cache entry) is orders of magnitude larger. The
op tests use 2e-5 (a single op, ~2e-7 measured).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import ops
from k3jax.cache import init_state

T = 37          # > 2 KDA chunks of 16 and not a multiple of 16
PREFILL = 29    # every prefill is this wide (right-padded), so the whole test compiles 3 programs
MAX_LEN = 40


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@nnx.jit
def _forward(model, tokens, state, num_new):
    return model.forward(tokens, state, num_new)


def prefill_then_decode(model, tokens, prefill_lens, stop):
    """Right-padded prefill of tokens[b, :prefill_lens[b]] (PREFILL wide; the padding holds real
    later tokens, which must be ignored), then teacher-forced decode steps until every row reached
    `stop` tokens. Returns logits [B, stop, V] at positions 0..stop-1."""
    b = tokens.shape[0]
    lens = jnp.asarray(prefill_lens, jnp.int32)
    logits, state = _forward(model, jnp.asarray(tokens[:, :PREFILL]), init_state(model.cfg, b, MAX_LEN, jnp.float32),
                             lens)
    out = np.full((b, stop, logits.shape[-1]), np.nan)
    for i, n in enumerate(prefill_lens):
        out[i, :n] = logits[i, :n]
    pos = np.asarray(prefill_lens)
    while (pos < stop).any():
        step = np.take_along_axis(tokens, np.minimum(pos, tokens.shape[1] - 1)[:, None], 1)
        logits, state = _forward(model, jnp.asarray(step), state, jnp.ones((b,), jnp.int32))
        for i in range(b):
            if pos[i] < stop:
                out[i, pos[i]] = logits[i, 0]
        pos = pos + 1
    return out


@pytest.fixture(scope="module", params=["k3-tiny", "kimi-linear-tiny"])
def model_and_reference(request, tiny_model):
    """The model, tokens [2, T] and the logits of one prefill over all T tokens (model(ids) is the
    same compiled program test_layers' whole-model test uses)."""
    model = tiny_model(request.param)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, T), 0, model.cfg.vocab_size))
    return model, tokens, np.asarray(model(tokens))


@pytest.mark.parametrize("prefill_lens,stop", [
    ((29, 29), T),             # 8 steps crossing the chunk boundary 32, T not a multiple of 16
    ((16, 16), 20),            # prefill exactly one chunk
    ((5, 13), 18),             # prompts of different lengths (right padding), prefill < one chunk
    ((28, 1), 30),             # a one-token prompt beside a long one
])
def test_prefill_then_decode_equals_prefill(model_and_reference, prefill_lens, stop):
    model, tokens, full = model_and_reference
    got = prefill_then_decode(model, tokens, prefill_lens, stop)
    assert rel_err(got, full[:, :stop]) < 1e-5


# ------------------------------------------------------------------ the op pairs
def kda_inputs(key, b, t, h, dk, dv):
    ks = jax.random.split(jax.random.key(key), 6)
    q = ops.l2_normalize(jax.random.normal(ks[0], (b, t, h, dk))) * dk ** -0.5
    k = ops.l2_normalize(jax.random.normal(ks[1], (b, t, h, dk)))
    v = jax.random.normal(ks[2], (b, t, h, dv))
    g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (b, t, h, dk)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    s0 = jax.random.normal(ks[5], (b, h, dk, dv))
    return q, k, v, g, beta, s0


@jax.jit
def recurrent_loop(s, q, k, v, g, beta):
    """T calls of ops.kda_recurrent_step (a scan over the token axis)."""
    def step(s, xs):
        o, s = ops.kda_recurrent_step(s, *xs)
        return s, o
    s, o = jax.lax.scan(step, s, [jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)])
    return jnp.moveaxis(o, 0, 1), s


kda_chunked = jax.jit(ops.kda_chunked, static_argnames="chunk")


@pytest.mark.parametrize("t", [1, 33])
def test_kda_chunked_equals_recurrent(t):
    q, k, v, g, beta, s0 = kda_inputs(t, 2, t, 3, 16, 8)
    o_c, s_c = kda_chunked(s0, q, k, v, g, beta)
    o_r, s_r = recurrent_loop(s0, q, k, v, g, beta)
    assert rel_err(o_c, o_r) < 2e-5
    assert rel_err(s_c, s_r) < 2e-5


def test_kda_padding_tokens_leave_state_unchanged():
    """beta = 0 and g = 0 (what the layer sets for padding) is an identity step for any q, k, v."""
    t, pad = 11, 6
    q, k, v, g, beta, s0 = kda_inputs(5, 2, t + pad, 2, 16, 16)
    valid = jnp.arange(t + pad) < t
    g_p = jnp.where(valid[None, :, None, None], g, 0.0)
    beta_p = jnp.where(valid[None, :, None], beta, 0.0)
    o_p, s_p = kda_chunked(s0, q, k, v, g_p, beta_p)
    o, s = kda_chunked(s0, q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t])
    assert rel_err(s_p, s) < 2e-5
    assert rel_err(o_p[:, :t], o) < 2e-5
    o1, s1 = ops.kda_recurrent_step(s0, q[:, 0], k[:, 0], v[:, 0], jnp.zeros_like(g[:, 0]), jnp.zeros_like(beta[:, 0]))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s0))


@pytest.mark.parametrize("t,length", [(1, 9), (5, 12)])
def test_mla_absorbed_equals_expanded(t, length):
    b, h, n, r, dv, c = 2, 3, 16, 8, 12, 24
    ks = jax.random.split(jax.random.key(t), 5)
    q_nope = jax.random.normal(ks[0], (b, t, h, n))
    q_rope = jax.random.normal(ks[1], (b, t, h, r))
    latent = jax.random.normal(ks[2], (b, length, c))
    k_rope = jax.random.normal(ks[3], (b, length, r))
    w = jax.random.normal(ks[4], (h * (n + dv), c)) * c ** -0.5
    # causal over the last t cache entries; row 1 has 3 fewer valid entries
    pos = jnp.array([length - t, length - t - 3])[:, None] + jnp.arange(t)[None]
    mask = jnp.arange(length)[None, None, :] <= pos[:, :, None]
    scale = (n + r) ** -0.5
    exp = ops.mla_attention_expanded(q_nope, q_rope, latent, k_rope, w, mask, scale)
    absb = ops.mla_attention_absorbed(q_nope, q_rope, latent, k_rope, w, mask, scale)
    assert rel_err(absb, exp) < 2e-5
    if t == 1:
        cache = jnp.concatenate([latent, k_rope], axis=-1)
        dec = ops.mla_decode(q_nope[:, 0], q_rope[:, 0], cache, w, pos[:, 0] + 1, scale)
        assert rel_err(dec, exp[:, 0]) < 2e-5
