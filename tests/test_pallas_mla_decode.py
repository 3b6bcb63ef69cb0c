"""The Pallas (Mosaic GPU) absorbed MLA decode attention against k3jax.ops.mla_decode: CPU
interpret mode (race detection, NaN-poisoned memory; the three-warpgroup attention needs the 8
host devices conftest.py sets, see pallas_kernels/mla_decode.py) over the sweep's cases (several
tiles a split among them; both schedules, heads_m and heads_n), the absorption / expansion
kernels alone, CUDA lowering export of the K3 shapes on CPU, and the real kernels on a GPU."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import ops, validate
from k3jax.backend import KernelPlan
from pallas_kernels import mgpu, registry
from pallas_kernels import mla_decode as mla

SPEC = registry.spec("mla_decode")
SMALL = SPEC.sweep("small")
K3 = SPEC.sweep("k3")


# b2_h8_c128_l128 runs in test_kv_len_is_a_traced_value (twice, two lengths): kept out here for time.
@pytest.mark.parametrize("case", [c for c in SMALL if c.name != "b2_h8_c128_l128"], ids=lambda c: c.name)
def test_mla_decode_matches_reference_interpret(case):
    r = validate.check_case(SPEC, "pallas", mla.mla_decode, case, seed=3, repeats=1)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
    assert r.races is not True


def test_kv_len_is_a_traced_value():
    """One compiled step serves every length: kv_len changes without retracing, and tokens past
    it do not leak into the result."""
    args = list(mla._make(2, 8, 32, 64, 128, 32, 128, lens=[64, 128])(jax.random.key(0)))
    # The first interpreted call of a kernel loop with a traced trip count imports a Pallas module
    # that registers a jax config flag, which changes jit's tracing context once: run one first.
    jax.jit(lambda *a: mla.mla_decode(*a, 0.1))(*args)
    run = jax.jit(lambda *a: mla.mla_decode(*a, 0.1))
    for lens in ([64, 128], [3, 100], [128, 1]):
        args[-1] = jnp.asarray(lens, jnp.int32)
        err = registry.relative_max_error(run(*args), ops.mla_decode(*args, 0.1))
        assert err <= SPEC.allowed(None, args, {}), (lens, err)
    assert run._cache_size() == 1


@pytest.mark.parametrize("length", [64, 192, 32768])
@pytest.mark.parametrize("batch", [1, 8, 128])
def test_plan_divides_the_sequence(batch, length):
    s = mla.plan(batch, 96, length, 512, 64, mgpu.H200_SMS)
    assert (length // mla.BLOCK_L) % s == 0


@pytest.mark.parametrize("schedule", list(mla.SCHEDULES))
@pytest.mark.parametrize("batch,length", [(1, 32768), (8, 4096), (128, 1024), (256, 1024)])
def test_mla_decode_cuda_export(batch, length, schedule):
    """Lowers the real (compiled) kernels for CUDA at K3 shapes on this CPU machine."""
    avals = jax.eval_shape(mla._make(batch, *mla.K3.values(), length), jax.random.key(0))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(jax.jit(lambda *a: mla.mla_decode(*a, 192 ** -0.5, schedule=schedule)),
                                     platforms=["cuda"])(*avals)
    assert "mosaic_gpu" in exported.mlir_module()


def test_unknown_schedule_is_named():
    args = mla._make(1, 8, 32, 64, 128, 32, 128)(jax.random.key(0))
    with pytest.raises(ValueError, match="schedule='heads_k'; choose one of"):
        mla.mla_decode(*args, 0.1, schedule="heads_k")


def test_heads_n_is_a_whole_step_ablation():
    """KernelPlan / `bench --ablate` name the heads_n schedule as an implementation of its own,
    "pallas_heads_n", whose call lowers that schedule's kernel; a name the op lacks lists those it has."""
    plan = KernelPlan.for_backend("pallas", mla_decode="pallas_heads_n")
    assert plan.describe()["mla_decode"] == "pallas_heads_n"
    avals = jax.eval_shape(mla._make(1, *mla.K3.values(), 1024), jax.random.key(0))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(jax.jit(lambda *a: plan("mla_decode")(*a, 0.1)), platforms=["cuda"])(*avals)
    assert "mla_attend_heads_n" in exported.mlir_module()
    with pytest.raises(ValueError, match="no 'pallas_x' implementation; it has xla, pallas, pallas_heads_n"):
        KernelPlan.for_backend("pallas", mla_decode="pallas_x")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_cache_of_the_wrong_width_is_named(impl):
    """The cache holds C latent + R shared key columns a token (C from w_kv_b, R from q_rope)."""
    q_nope, q_rope, cache, w, kv_len = mla._make(1, 8, 32, 64, 128, 32, 128)(jax.random.key(0))
    fn = ops.mla_decode if impl == "xla" else mla.mla_decode
    with pytest.raises(ValueError, match=r"cache \[1, 128, 191\] has 191 columns a token, but w_kv_b \[512, 128\] "
                                         r"and q_rope \[1, 8, 64\] make 128 \+ 64"):
        fn(q_nope, q_rope, cache[..., :-1], w, kv_len, 0.1)


def test_splits_that_do_not_divide_the_tiles_are_named():
    args = mla._make(1, 8, 32, 64, 128, 32, 192)(jax.random.key(0))
    with pytest.raises(ValueError, match="splits=2 does not divide the cache's 3 tiles"):
        mla.mla_decode(*args, 0.1, splits=2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", K3, ids=lambda c: c.name)
def test_mla_decode_k3_shapes_gpu(case):
    r = validate.check_case(SPEC, "pallas", mla.mla_decode, case, seed=5)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
    assert np.isfinite(r.error)


@pytest.mark.parametrize("batch,c", [(3, 128), (72, 128), (256, 512)])
def test_absorb_and_expand_kernels_interpret(batch, c):
    """The absorption and expansion kernels alone against their k3jax.ops references, including
    more than 64 batch rows (two row blocks; K3 batch 128 takes this path), 256 rows at K3's C
    (the expansion's 2 stages) and H not a multiple of 64. Only real rows/heads are compared: the
    padding heads of q_lat are never written (NaN here); the expansion writes only the real rows."""
    b, h, n, r, v = batch, 5, 32, 64, 64
    q_nope, q_rope, _, w_kv_b, _ = mla._make(b, h, n, r, c, v, 64, lens=[64] * b)(jax.random.key(1))
    rows, blocks = mla._row_blocks(b)
    pad = ((0, rows * blocks - b), (0, 0), (0, 0))
    with mgpu.race_detection():
        q_lat, qr = mla._absorb(jnp.pad(q_nope, pad), jnp.pad(q_rope, pad), w_kv_b, 64)
        o_lat = jax.random.normal(jax.random.key(2), (b, h, c), jnp.float32)
        bn = -(-b // 8) * 8
        o_pad = jnp.pad(o_lat.astype(jnp.bfloat16), ((0, bn - b), (0, 3), (0, 0)))     # + 3 padding heads
        out = mla._expand(o_pad, w_kv_b, n, h, b)
        jax.block_until_ready((q_lat, qr, out))
        assert not mgpu.races_found()
    ref = ops.mla_absorb_query(q_nope, w_kv_b).astype(jnp.bfloat16)
    # Same float32 products, other summation order: at most one bf16 ulp apart.
    assert registry.relative_max_error(q_lat[:b, :h], ref) <= 2.0 ** -7
    np.testing.assert_array_equal(np.asarray(qr[:b, :h]), np.asarray(q_rope))
    ref_out = ops.mla_expand_output(o_pad[:b, :h].astype(jnp.float32), w_kv_b, n, jnp.float32)
    # float32 sums stored as bf16 [B, H, V], the real rows only: one rounding, half a bf16 ulp
    assert out.shape == (b, h, v) and out.dtype == jnp.bfloat16
    assert registry.relative_max_error(out, ref_out) <= 2.0 ** -8


def test_combine_weights_the_splits():
    """`_combine` is the log-sum-exp combine of the splits: here against a direct float32 softmax
    over two splits, one of them fully masked for the first sequence (weight 0)."""
    s, b, hp, c = 2, 3, 4, 8
    ks = jax.random.split(jax.random.key(7), 3)
    o = jax.random.normal(ks[0], (s, b, hp, c), jnp.float32).astype(jnp.bfloat16)
    m = jax.random.normal(ks[1], (s, b, hp), jnp.float32).at[1, 0].set(mla.MASKED)
    l = jax.random.uniform(ks[2], (s, b, hp), jnp.float32, 0.5, 2.0).at[1, 0].set(0.0)
    got = mla._combine(o, m, l)
    w = np.exp2(np.asarray(m) - np.asarray(m).max(0)) * np.asarray(l)
    want = (w[..., None] * np.asarray(o, np.float32)).sum(0) / w.sum(0)[..., None]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(o[0, 0], np.float32), rtol=1e-6)
