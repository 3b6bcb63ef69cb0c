"""Every CuTe kernel against its k3jax.ops reference on the GPU (run with K3JAX_GPU_TESTS=1 and the
library built: `python -m cute_bridge.build`, then carry cute_bridge/_build/libk3cute.so)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import mxfp4, ops

pytestmark = pytest.mark.gpu
# bf16 outputs of float32 sums in another order: ~2^-9 per element after rounding; the MoE path
# rounds twice (expert outputs, then the combine) and runs the GLU on rounded inputs.
TOL = {"linear": 1e-2, "moe_experts": 2e-2}


def _rel(out, ref):
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(o)), "kernel left unwritten or non-finite outputs"
    return np.linalg.norm(o - r) / np.linalg.norm(r)


def _poison(shape, dtype):
    """A NaN buffer of the output's size, freed before the kernel runs so XLA likely hands its
    memory to the output: elements the kernel skips then show up as NaN."""
    jnp.full(shape, jnp.nan, dtype).block_until_ready().delete()


def test_add():
    from cute_bridge import loader
    x, y = (jax.random.normal(jax.random.key(i), (1000,), jnp.float32) for i in range(2))
    _poison((1000,), jnp.float32)
    (out,) = jax.jit(lambda a, b: loader.call("add", a, b))(x, y)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x + y))


@pytest.mark.parametrize("lead,n,k", [((1,), 24, 64), ((3,), 100, 200), ((1, 1), 1536, 7168),
                                      ((5,), 4097, 1032), ((2, 4), 7168, 12288), ((2,), 33, 8),
                                      ((7,), 700, 1000), ((1,), 28672, 136)])
def test_linear(lead, n, k):
    from cute_bridge import ops as cute_ops
    for seed in range(2):
        x = jax.random.normal(jax.random.key(seed), (*lead, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(seed + 10), (n, k), jnp.bfloat16)
        _poison((8, n), jnp.bfloat16)
        assert _rel(jax.jit(cute_ops.linear)(x, w), ops.linear(x, w)) < TOL["linear"]


@pytest.mark.parametrize("rows,n,k,splits", [(1, 40, 72, 5), (8, 1536, 7168, 6), (4, 100, 200, 1)])
def test_gemv_split_partials(rows, n, k, splits):
    """The K-split kernel writes every partial (slices past K's end are zeros) and they sum to y."""
    from cute_bridge import loader
    x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (n, k), jnp.bfloat16)
    _poison((splits, rows, n), jnp.float32)
    (part,) = jax.jit(lambda a, b: loader.call(f"gemv_split_r{rows}", a, b, dims={"S": splits}))(x, w)
    assert _rel(part.sum(0), ops.linear(x, w).astype(jnp.float32)) < TOL["linear"]


@pytest.mark.parametrize("n,top_k,e,m,inter,scale_exp", [
    (1, 4, 16, 32, 32, -7), (3, 8, 32, 256, 96, -7), (1, 16, 448, 3584, 3072, -7),
    (5, 16, 64, 3584, 3072, -7), (2, 4, 16, 512, 160, 2)])      # scale bytes 128..130: 2^(s-1) overflows bf16
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts(n, top_k, e, m, inter, scale_exp, act):
    from cute_bridge import ops as cute_ops
    ks = jax.random.split(jax.random.key(n * 7 + e), 6)
    p1, s1 = mxfp4.random_packed(ks[0], (e, inter, m), scale_exp)
    p3, s3 = mxfp4.random_packed(ks[1], (e, inter, m), scale_exp)
    p2, s2 = mxfp4.random_packed(ks[2], (e, m, inter), scale_exp)
    experts = ops.ExpertWeights(p1, p3, p2, s1, s3, s2)
    ids = jax.vmap(lambda r: jax.random.permutation(r, e)[:top_k])(jax.random.split(ks[3], n)).astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[4], (n, top_k)), -1)
    z = jax.random.normal(ks[5], (n, m), jnp.bfloat16)
    kw = dict(act=act, beta=4.0, linear_beta=25.0)
    _poison((n, m), jnp.bfloat16)
    out = jax.jit(lambda *a: cute_ops.moe_experts(*a, **kw))(z, ids, w, experts)
    assert _rel(out, ops.moe_experts(z, ids, w, experts, **kw)) < TOL["moe_experts"]


def test_per_step_ids_in_one_compiled_loop():
    """Expert ids change per step as device values inside one jitted scan (graph-safe contract)."""
    from cute_bridge import ops as cute_ops
    e, m, inter, top_k = 32, 256, 96, 4
    ks = jax.random.split(jax.random.key(3), 4)
    p1, s1 = mxfp4.random_packed(ks[0], (e, inter, m))
    p2, s2 = mxfp4.random_packed(ks[1], (e, m, inter))
    experts = ops.ExpertWeights(p1, p1, p2, s1, s1, s2)
    steps_ids = jax.random.randint(ks[2], (6, 1, top_k), 0, e, jnp.int32)
    w = jnp.full((1, top_k), 1.0 / top_k)
    z0 = jax.random.normal(ks[3], (1, m), jnp.bfloat16)
    kw = dict(act="situ", beta=4.0, linear_beta=25.0)

    def run(f):
        def step(z, ids):
            y = f(z, ids, w, experts, **kw)
            return (y / (jnp.abs(y).max() + 1e-3)).astype(z.dtype), y
        return jax.jit(lambda z: jax.lax.scan(step, z, steps_ids)[1])(z0)
    assert _rel(run(cute_ops.moe_experts), run(ops.moe_experts)) < 5 * TOL["moe_experts"]
