"""Router (ops.route) and the routed-expert combine (ops.moe_experts) against the NumPy reference.

Router outputs are float32 sigmoid/softmax scores: compared at 1e-6 absolute. The expert combine
in float32 (MXFP4 dequantised exactly) uses 2e-5 of the output scale (width <= 64 dot products);
in bfloat16 (weights, z and the hidden activations rounded to 8 bits) 3e-2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_numpy as ref
from k3jax import mxfp4, ops


def rand(key, *shape, scale=1.0):
    return np.asarray(jax.random.normal(jax.random.key(key), shape, jnp.float32)) * scale


def route(x, w, bias, **kw):
    kw = {"activation": "sigmoid", "renormalize": True, "scaling": 1.0, **kw}
    ids, weights = ops.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), **kw)
    return np.asarray(ids), np.asarray(weights)


def check_against_reference(x, w, bias, **kw):
    ids, weights = route(x, w, bias, **kw)
    want_ids, want_w = ref.route(x.astype(np.float64), w, bias, **{"activation": "sigmoid", **kw})
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, atol=1e-6)
    return ids, weights


@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
@pytest.mark.parametrize("scaling", [1.0, 2.446])
def test_route_matches_reference(activation, scaling):
    x, w, bias = rand(0, 12, 32), rand(1, 16, 32, scale=0.3), rand(2, 16, scale=0.05)
    ids, weights = check_against_reference(x, w, bias, top_k=4, activation=activation, renormalize=True,
                                           scaling=scaling)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_allclose(weights.sum(-1), scaling, rtol=1e-6)        # renormalised, then scaled
    assert all(len(set(r)) == 4 for r in ids)


def test_route_without_renormalisation_keeps_plain_scores():
    x, w, bias = rand(3, 6, 32), rand(4, 8, 32), np.zeros(8, np.float32)
    ids, weights = check_against_reference(x, w, bias, top_k=3, renormalize=False, scaling=1.5)
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ w.T.astype(np.float64))))
    np.testing.assert_allclose(weights, 1.5 * np.take_along_axis(scores, ids, 1), atol=1e-6)


def test_ties_go_to_the_lower_id_deterministically():
    w = rand(5, 8, 16)
    w[5] = w[2] = 3.0 * np.abs(w[2])         # experts 2 and 5 tie, with the best score
    w[6] = w[1]                              # 1 and 6 tie too
    x = np.abs(rand(6, 4, 16))
    bias = np.zeros(8, np.float32)
    first, _ = route(x, w, bias, top_k=1)
    assert (first[:, 0] == 2).all()
    for _ in range(3):
        again, _ = route(x, w, bias, top_k=8)
        np.testing.assert_array_equal(again, route(x, w, bias, top_k=8)[0])
        row = list(again[0])
        assert row.index(2) < row.index(5) and row.index(1) < row.index(6)
    check_against_reference(x, w, bias, top_k=8)


def test_bias_changes_selection_not_weights():
    x, w = rand(7, 5, 16), rand(8, 8, 16)
    none = np.zeros(8, np.float32)
    bias = none.copy()
    bias[7] = 10.0                          # expert 7 is always selected, whatever its score
    ids0, w0 = route(x, w, none, top_k=2)
    ids1, w1 = check_against_reference(x, w, bias, top_k=2)
    assert (ids1[:, 0] == 7).all() and not (ids0 == 7).all()
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ w.T.astype(np.float64))))
    plain = np.take_along_axis(scores, ids1, 1)
    np.testing.assert_allclose(w1, plain / plain.sum(-1, keepdims=True), atol=1e-6)


def test_group_limited_routing():
    e, groups, keep = 16, 4, 2
    x, w, bias = rand(9, 20, 32), rand(10, e, 32), rand(11, e, scale=0.05)
    ids, _ = check_against_reference(x, w, bias, top_k=4, n_group=groups, topk_group=keep)
    assert all(len(set(r // (e // groups))) <= keep for r in ids)
    ungrouped, _ = route(x, w, bias, top_k=4)
    assert (ids != ungrouped).any()            # the group limit did change some choices


# ------------------------------------------------------------------ routed-expert combine
ACT = dict(act="situ", beta=4.0, linear_beta=25.0)
moe_experts = jax.jit(ops.moe_experts, static_argnames=("act", "beta", "linear_beta", "expert_chunk"))


def experts(fmt, key, e=16, i=32, m=64, dtype=jnp.float32):
    if fmt == "mxfp4":
        ks = jax.random.split(jax.random.key(key), 3)
        (p1, s1), (p3, s3) = mxfp4.random_packed(ks[0], (e, i, m), -4), mxfp4.random_packed(ks[1], (e, i, m), -4)
        p2, s2 = mxfp4.random_packed(ks[2], (e, m, i), -4)
        ew = ops.ExpertWeights(p1, p3, p2, s1, s3, s2)
        dense = [ref.mxfp4_dequantize(p, s) for p, s in ((p1, s1), (p3, s3), (p2, s2))]
    else:
        ws = [jnp.asarray(rand(key + j, *shape, scale=0.15), dtype) for j, shape in
              enumerate([(e, i, m), (e, i, m), (e, m, i)])]
        ew = ops.ExpertWeights(*ws)
        dense = [np.asarray(a, np.float64) for a in ws]
    return ew, dense


class _Cfg:
    hidden_act, activation_situ_beta, activation_situ_linear_beta = "situ", 4.0, 25.0


def random_routing(key, n, k, e):
    ids = np.stack([np.random.default_rng(key + r).permutation(e)[:k] for r in range(n)]).astype(np.int32)
    weights = np.abs(rand(key, n, k)) + 0.1
    return ids, weights


@pytest.mark.parametrize("fmt,n,chunk,dtype", [
    ("mxfp4", 5, 64, jnp.float32),      # few tokens, one chunk
    ("mxfp4", 40, 3, jnp.float32),      # all 16 experts touched, 6 chunks of 3 (last partial)
    ("bf16", 40, 4, jnp.float32),
    ("bf16", 24, 5, jnp.bfloat16),
    ("mxfp4", 24, 64, jnp.bfloat16),
    ("mxfp4", 150, 7, jnp.float32),     # 3 token chunks of 50 (DENSE_DISPATCH_MAX_TOKENS = 64)
    ("bf16", 129, 64, jnp.float32),     # 3 token chunks of 43
])
def test_moe_experts_matches_per_token_loop(fmt, n, chunk, dtype):
    ew, dense = experts(fmt, 20, dtype=dtype)
    ids, weights = random_routing(21, n, 4, 16)
    z = jnp.asarray(rand(22, n, 64), dtype)
    got = moe_experts(z, jnp.asarray(ids), jnp.asarray(weights), ew, expert_chunk=chunk, **ACT)
    assert got.dtype == dtype and got.shape == (n, 64)
    want = ref.experts_loop(_Cfg, np.asarray(z, np.float64), ids, weights, *dense)
    got = np.asarray(got, np.float64)
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < (2e-5 if dtype == jnp.float32 else 3e-2)


@pytest.mark.parametrize("chunk,n", [(1, 9), (64, 9), (64, 130)])
def test_moe_experts_all_tokens_on_one_expert(chunk, n):
    ew, dense = experts("mxfp4", 30)
    other = np.arange(n) % 15
    other += other >= 11                                                   # any expert but 11
    ids = np.stack([np.full(n, 11), other], 1).astype(np.int32)          # slot 0 always expert 11
    weights = np.abs(rand(31, n, 2)) + 0.1
    z = rand(32, n, 64)
    got = moe_experts(jnp.asarray(z), jnp.asarray(ids), jnp.asarray(weights), ew, expert_chunk=chunk, **ACT)
    want = ref.experts_loop(_Cfg, z.astype(np.float64), ids, weights, *dense)
    assert np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)) < 2e-5
    only = np.full((n, 1), 11, np.int32)
    got1 = moe_experts(jnp.asarray(z), jnp.asarray(only), jnp.ones((n, 1)), ew, expert_chunk=chunk, **ACT)
    want1 = ref.experts_loop(_Cfg, z.astype(np.float64), only, np.ones((n, 1)), *dense)
    assert np.max(np.abs(np.asarray(got1) - want1)) / np.max(np.abs(want1)) < 2e-5


def test_map_token_chunks_pads_with_the_last_token():
    """Equal chunks of at most max_rows; padding repeats the last token's experts (in the last
    chunk already), so no chunk gathers an expert none of its tokens chose."""
    n, k = 70, 2
    ids = np.tile(np.array([[1, 2]], np.int32), (n, 1))
    ids[0] = (98, 99)                                  # only token 0 (first chunk) chose 98/99
    z = jnp.asarray(rand(40, n, 8), jnp.float32)
    seen = ops.map_token_chunks(lambda zc, ic, wc: jnp.broadcast_to(ic.max().astype(zc.dtype), zc.shape),
                                z, jnp.asarray(ids), jnp.ones((n, k)), max_rows=32)   # 3 chunks of 24
    seen = np.asarray(seen)[:, 0]
    assert (seen[:24] == 99).all() and (seen[24:] == 2).all()


@pytest.mark.parametrize("n,k,e,extra", [(1, 4, 16, 1), (5, 3, 8, 0), (8, 8, 256, 0), (3, 2, 4, 0), (3, 2, 4, 5)])
def test_expert_dispatch_is_unique_and_coefficients(n, k, e, extra):
    """uniq = the sorted distinct ids padded with E (what jnp.unique(size=...) gives, also when ids
    hold the padding id E or repeat across tokens); coef[u, n] = token n's weight for uniq[u], 0 on
    the padding rows (a token's id E adds nothing: the kernels skip those rows).
    One token runs with one slot more than k here (size == k: the next test)."""
    rng = np.random.default_rng(n * 100 + e)
    ids = np.stack([rng.choice(e + 1, size=k, replace=False) for _ in range(n)]).astype(np.int32)
    ids[-1] = ids[0]                                            # a token repeating another's experts
    weights = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    size = min(e, n * k) + extra          # callers may ask for more slots than experts
    uniq, coef = ops.expert_dispatch(jnp.asarray(ids), jnp.asarray(weights), e, size)
    want = np.unique(ids[ids < e])
    np.testing.assert_array_equal(uniq, np.concatenate([want, np.full(size - len(want), e)]))
    want_coef = np.array([[weights[t][ids[t] == x].sum() * (x < e) for t in range(n)] for x in np.asarray(uniq)])
    np.testing.assert_array_equal(coef, want_coef)


def test_expert_dispatch_one_token_keeps_its_ids():
    """One token with size == k: uniq is its ids in their order (the padding id E stays, with
    coefficient 0) and coef its weights, the same combine as the sorted form."""
    ids = jnp.asarray([[5, 2, 8, 0]], jnp.int32)                       # 8 = E: a padding id
    weights = jnp.asarray([[0.4, 0.3, 0.2, 0.1]], jnp.float32)
    uniq, coef = ops.expert_dispatch(ids, weights, 8, 4)
    np.testing.assert_array_equal(uniq, [5, 2, 8, 0])
    np.testing.assert_array_equal(coef, np.float32([[0.4], [0.3], [0.0], [0.1]]))
    sorted_uniq, sorted_coef = ops.expert_dispatch(ids, weights, 8, 5)   # size > k: the general form
    np.testing.assert_array_equal(sorted_uniq, [0, 2, 5, 8, 8])
    np.testing.assert_array_equal(sorted_coef[:, 0], np.float32([0.1, 0.3, 0.4, 0.0, 0.0]))


@pytest.mark.parametrize("n,k,e,group,multiple", [(1, 4, 16, 8, 1), (40, 2, 8, 8, 1), (33, 16, 448, 8, 1),
                                                  (9, 4, 4, 3, 1), (64, 8, 16, 16, 1), (33, 16, 448, 8, 8),
                                                  (9, 4, 4, 3, 5)])
def test_expert_groups_cover_every_choice_once(n, k, e, group, multiple):
    """Every valid choice sits in exactly one column of one slot of its own expert (choices and
    `where` agree); a choice of another shard's expert (id E) in none; an expert with c choices
    fills ceil(c / group) slots, its choices in token order; slots run in expert order, unused
    ones (uniq = E) at the end; the static bound is tight (then rounded up to `multiple`)."""
    rng = np.random.default_rng(n * 7 + e)
    ids = np.stack([rng.choice(e + 1, size=k, replace=False) for _ in range(n)]).astype(np.int32)
    uniq, choices, where = map(np.asarray, ops.expert_groups(jnp.asarray(ids), e, group, multiple))
    bound = ops.expert_groups_bound(n, k, e, group)
    size = -(-bound // multiple) * multiple
    assert uniq.shape == (size,) and choices.shape == (size, group) and where.shape == (n, k)
    counts = np.bincount(ids[ids < e], minlength=e)
    used = int(sum(-(-c // group) for c in counts))
    np.testing.assert_array_equal(uniq, np.concatenate([np.repeat(np.arange(e), -(-counts // group)),
                                                        np.full(size - used, e)]))
    flat = choices.reshape(-1)
    for t in range(n):
        for j in range(k):
            if ids[t, j] >= e:
                assert where[t, j] == size * group
                continue
            assert flat[where[t, j]] == t * k + j and uniq[where[t, j] // group] == ids[t, j]
    assert (flat < n * k).sum() == (ids < e).sum()
    for x in range(e):      # token order within an expert
        positions = np.sort(where[ids == x])
        assert list(flat[positions]) == sorted(flat[positions])
    # The bound is tight: u experts chosen once each and the other choices in full slots.
    assert bound == max(u + (n * k - u) // group for u in range(1, min(e, n * k) + 1))
