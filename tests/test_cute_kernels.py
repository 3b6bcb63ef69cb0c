"""Every CuTe kernel against its k3jax.ops reference on the GPU (run with K3JAX_GPU_TESTS=1 and the
library built: `python -m cute_bridge.build`, then carry cute_bridge/_build/libk3cute.so), and the
MoE kernels' decode program against mxfp4.dequantize on the CPU."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import mxfp4, ops
from pallas_kernels import registry

gpu = pytest.mark.gpu


def _error(op: str, out, ref) -> float:
    """The registry's measure, as `validate --backend cute` applies it: max |out - ref| / max |ref|
    (NaN for unwritten or non-finite outputs), to be within the op's dtype tolerance (bf16: 2^-7)."""
    err = registry.relative_max_error(out, ref)
    assert np.isfinite(err), "kernel left unwritten or non-finite outputs"
    return err / registry.spec(op).allowed(ref, (), {})


def _poison(shape, dtype):
    """A NaN buffer of the output's size, freed before the kernel runs so XLA likely hands its
    memory to the output: elements the kernel skips then show up as NaN."""
    jnp.full(shape, jnp.nan, dtype).block_until_ready().delete()


@gpu
def test_add():
    from cute_bridge import loader
    x, y = (jax.random.normal(jax.random.key(i), (1000,), jnp.float32) for i in range(2))
    _poison((1000,), jnp.float32)
    (out,) = jax.jit(lambda a, b: loader.call("add", a, b))(x, y)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x + y))


@gpu
@pytest.mark.parametrize("lead,n,k", [((1,), 24, 64), ((3,), 100, 200), ((1, 1), 1536, 7168),
                                      ((5,), 4097, 1032), ((2, 4), 7168, 12288), ((2,), 33, 8),
                                      ((7,), 700, 1000), ((1,), 28672, 136), ((2,), 200, 1024), ((3,), 100, 1024)])
def test_linear(lead, n, k):
    """Every GEMV kernel (gemv_r1/r2/r4/r8, gemv_split_r1/r2/r4/r8) through cute_bridge.ops.linear."""
    from cute_bridge import ops as cute_ops
    _, r, splits = cute_ops.gemv_kernel(math.prod(lead), n, k)
    for seed in range(2):
        x = jax.random.normal(jax.random.key(seed), (*lead, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(seed + 10), (n, k), jnp.bfloat16)
        _poison((r, n) if splits is None else (splits, r, n), jnp.bfloat16 if splits is None else jnp.float32)
        assert _error("linear", jax.jit(lambda a, b: cute_ops.linear(a, b, min_rows=1))(x, w), ops.linear(x, w)) <= 1


@gpu
@pytest.mark.parametrize("rows,n,k,splits", [(1, 40, 72, 5), (8, 1536, 7168, 6), (4, 100, 200, 1)])
def test_gemv_split_partials(rows, n, k, splits):
    """The K-split kernel writes every partial (slices past K's end are zeros) and they sum to y."""
    from cute_bridge import loader
    x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (n, k), jnp.bfloat16)
    _poison((splits, rows, n), jnp.float32)
    (part,) = jax.jit(lambda a, b: loader.call(f"gemv_split_r{rows}", a, b, dims={"S": splits}))(x, w)
    assert _error("linear", part.sum(0).astype(jnp.bfloat16), ops.linear(x, w)) <= 1


@gpu
@pytest.mark.parametrize("n,top_k,e,m,inter,scale_exp", [
    (1, 4, 16, 32, 32, -7), (3, 8, 32, 256, 96, -7), (1, 16, 448, 3584, 3072, -7),
    (5, 16, 64, 3584, 3072, -7), (8, 16, 448, 3584, 3072, -7), (13, 4, 16, 256, 96, -7),   # 13: grouped
    (64, 16, 448, 3584, 3072, -7),     # K3 at 64 tokens, grouped (ops.expert_groups)
    (3, 8, 32, 256, 128, -7),      # 64-row blocks with idle warps (8 scale groups: 2 chunks for 4 warps)
    (2, 4, 16, 512, 160, 0)])      # scale bytes 126..128: the top of EXACT_SCALES
@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("block_rows", [16, 64])
def test_moe_experts(n, top_k, e, m, inter, scale_exp, act, block_rows):
    from cute_bridge import ops as cute_ops
    z, ids, w, experts = _random_moe(n * 7 + e, n, top_k, e, m, inter, scale_exp)
    kw = dict(act=act, beta=4.0, linear_beta=25.0)
    _poison_moe(n, top_k, m, inter)
    out = jax.jit(lambda *a: cute_ops.moe_experts(*a, **kw, block_rows=block_rows))(z, ids, w, experts)
    assert _error("moe_experts", out, ops.moe_experts(z, ids, w, experts, **kw)) <= 1


@gpu
@pytest.mark.parametrize("n,top_k,e,m,inter", [(1, 16, 448, 3584, 3072), (8, 16, 448, 3584, 3072),
                                               (13, 4, 16, 256, 128), (3, 8, 32, 256, 128),
                                               (128, 16, 448, 3584, 3072)])
def test_moe_experts_tiled(n, top_k, e, m, inter):
    """Experts stored in tiles (mxfp4.to_tiles: the `_tiles` kernels) against the reference."""
    from cute_bridge import ops as cute_ops
    z, ids, w, experts = _random_moe(n * 5 + e, n, top_k, e, m, inter, -7)
    kw = dict(act="situ", beta=4.0, linear_beta=25.0)
    _poison_moe(n, top_k, m, inter)
    out = jax.jit(lambda *a: cute_ops.moe_experts(*a, **kw))(z, ids, w, experts.in_tiles())
    assert _error("moe_experts", out, ops.moe_experts(z, ids, w, experts, **kw)) <= 1


def _random_moe(seed, n, top_k, e, m, inter, scale_exp):
    """z [n, m] bf16, distinct ids [n, top_k] of e experts, softmax weights, MXFP4 experts."""
    ks = jax.random.split(jax.random.key(seed), 6)
    p1, s1 = mxfp4.random_packed(ks[0], (e, inter, m), scale_exp)
    p3, s3 = mxfp4.random_packed(ks[1], (e, inter, m), scale_exp)
    p2, s2 = mxfp4.random_packed(ks[2], (e, m, inter), scale_exp)
    ids = jax.vmap(lambda r: jax.random.permutation(r, e)[:top_k])(jax.random.split(ks[3], n)).astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[4], (n, top_k)), -1)
    z = jax.random.normal(ks[5], (n, m), jnp.bfloat16)
    return z, ids, w, ops.ExpertWeights(p1, p3, p2, s1, s3, s2)


def _poison_moe(n, top_k, m, inter):
    """NaN where the output and the gate / up / hid / part intermediates will likely live: an
    element a kernel leaves unwritten, or reads before it is written, shows up as NaN."""
    _poison((n, m), jnp.bfloat16)
    _poison((n * top_k, inter), jnp.bfloat16)
    _poison((n * top_k, m), jnp.float32)


@gpu
@pytest.mark.parametrize("ids", [[[4, 4, 4, 4]] * 6,                                  # every slot on one expert
                                 [[4, 4, 4, 4]] * 12,         # grouped: one expert's 48 choices in 6 grid rows
                                 [[5, 1, 7, 2], [1, 5, 0, 3], [2, 2, 6, 5], [9, 9, 9, 1]],   # repeats in a token
                                 [[3, 3, 6, 3]]])                  # one token (the T = 1 kernels) with repeats
@pytest.mark.parametrize("block_rows", [16, 64])
def test_moe_experts_shared_and_repeated_ids(ids, block_rows):
    """Grouping by expert: an expert chosen by many tokens, or twice by one token, matches the
    reference (a repeated id counts with its summed weight)."""
    from cute_bridge import ops as cute_ops
    ids = jnp.asarray(ids, jnp.int32)
    e, m, inter = 16, 256, 128          # 64 divides M and I: block_rows=64 runs the 64-row kernels
    ks = jax.random.split(jax.random.key(5), 6)
    (p1, s1), (p3, s3) = (mxfp4.random_packed(kk, (e, inter, m)) for kk in ks[:2])
    p2, s2 = mxfp4.random_packed(ks[2], (e, m, inter))
    experts = ops.ExpertWeights(p1, p3, p2, s1, s3, s2)
    w = jax.nn.softmax(jax.random.normal(ks[3], ids.shape), -1)
    z = jax.random.normal(ks[4], (ids.shape[0], m), jnp.bfloat16)
    kw = dict(act="situ", beta=4.0, linear_beta=25.0)
    _poison_moe(*ids.shape, m, inter)
    out = jax.jit(lambda *a: cute_ops.moe_experts(*a, **kw, block_rows=block_rows))(z, ids, w, experts)
    assert _error("moe_experts", out, ops.moe_experts(z, ids, w, experts, **kw)) <= 1


@gpu
@pytest.mark.parametrize("n", [1, 8, 32])
def test_moe_experts_are_deterministic(n):
    """Every output element comes from one block summing in a fixed order: bitwise repeatable."""
    from cute_bridge import ops as cute_ops
    z, ids, w, experts = _random_moe(11, n, 16, 64, 3584, 3072, -7)
    run = jax.jit(lambda *a: cute_ops.moe_experts(*a, act="situ", beta=4.0, linear_beta=25.0))
    outs = [np.asarray(run(z, ids, w, experts)) for _ in range(4)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@gpu
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
    # Each step's output feeds the next: six steps' roundings compound, so 5 tolerances.
    assert _error("moe_experts", run(cute_ops.moe_experts), run(ops.moe_experts)) <= 5


@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiles"])
def test_mxfp4_one_fma_decode_exact_range(tiled):
    """The kernels' decode PTX (mxfp4.decode_word_ptx: one fma by 2^(s - 1)) of every code in every
    word position equals mxfp4.dequantize's bf16 values for every scale byte in EXACT_SCALES and
    scale byte 0 (both 0; the CuTe kernels zero that factor), pair a being codes a, a + 4 in row
    order and columns 2a, 2a + 1 of tile words (mxfp4.tile_words); one byte past either end it
    does not (the range is tight). Runs the numpy PTX model of test_cute_bridge."""
    import ml_dtypes
    from test_cute_bridge import _run_decode_ptx
    lo, hi = mxfp4.DECODE_EXACT_SCALES
    scales = np.array([0, lo - 1, *range(lo, hi + 1), hi + 1], np.uint32)
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, (scales.size, 32), dtype=np.uint64).astype(np.uint32)
    words[:, :16] = np.arange(16, dtype=np.uint32) * 0x11111111     # every code everywhere
    if tiled:
        words = mxfp4.tile_words(words.view(np.uint8)).view(np.uint32)   # the same codes as tile words
    factor = np.where(scales > 0, (scales + mxfp4.DECODE_FACTOR_BIAS) * 0x00800080, 0).astype(np.uint32)
    with np.errstate(invalid="ignore"):         # past the top the factor is inf: inf x 0 codes
        out = _run_decode_ptx(mxfp4.decode_word_ptx(tiled), {"$4": words, "$5": np.broadcast_to(factor[:, None], words.shape)})
    got = np.stack([out[f"${a}"] for a in range(4)], -1)                     # [scale, word, pair]
    got = np.stack([got & 0xFFFF, got >> 16], -1).astype(np.uint16).view(ml_dtypes.bfloat16)
    packed = words.view(np.uint8).reshape(scales.size, 32 * 4)
    if tiled:
        packed = mxfp4.tile_words(packed, inverse=True)
    ref = np.asarray(mxfp4.dequantize(jnp.asarray(packed[:, None, :]), jnp.asarray(
        np.repeat(scales[:, None, None], 32 * 8 // 32, -1).astype(np.uint8)), jnp.bfloat16))[:, 0]
    ref = ref.reshape(scales.size, 32, 4, 2) if tiled else ref.reshape(scales.size, 32, 2, 4).transpose(0, 1, 3, 2)
    exact = np.all(got.astype(np.float64) == ref.astype(np.float64), axis=(1, 2, 3))
    assert exact[0] and exact[2:-1].all(), "decode not exact inside EXACT_SCALES"
    assert not exact[1] and not exact[-1], "EXACT_SCALES is not tight"
