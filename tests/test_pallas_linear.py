"""The Pallas (Mosaic GPU) skinny GEMM against k3jax.ops.linear: CPU interpret mode with race
detection and NaN-poisoned memory, CUDA lowering export on CPU, and the real kernel on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import ops, validate
from pallas_kernels import linear as lin
from pallas_kernels import mgpu, registry

SPEC = registry.spec("linear")
SMALL = SPEC.sweep("small")
K3 = SPEC.sweep("k3")


def test_interpret_mode_poisons_unwritten_output():
    """The guarantee the per-case checks rely on: an output element a kernel never writes is NaN."""
    def body(o_ref):
        o_ref[0:64] = jnp.ones((64,), jnp.float32)
    out = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                       interpret=mgpu.interpret_params())()
    assert np.all(np.asarray(out[:64]) == 1) and np.all(np.isnan(np.asarray(out[64:])))


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_linear_matches_reference_interpret(case):
    r = validate.check_case(SPEC, "pallas", lin.linear, case, seed=3)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
    assert r.races is False


def test_linear_leading_axes_and_fallback_dtype():
    x = jax.random.normal(jax.random.key(1), (2, 3, 256), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (128, 256), jnp.bfloat16)
    out = lin.linear(x, w)
    assert out.shape == (2, 3, 128) and out.dtype == jnp.bfloat16
    assert registry.relative_max_error(out, ops.linear(x, w)) <= registry.TOLERANCE["bfloat16"]
    xf = x.astype(jnp.float32)      # float32 is not covered: the reference runs, exactly
    np.testing.assert_array_equal(lin.linear(xf, w), ops.linear(xf, w))


@pytest.mark.parametrize("rows,out,din", [(1, 12288, 7168), (8, 7168, 12288), (32, 576, 7168),
                                          (128, 12288, 128), (256, 18432, 1536), (5, 128, 256), (4, 64, 64),
                                          (1, 96, 7168), (3, 200, 1024)])
def test_linear_cuda_export(rows, out, din):
    """Lowers the real (compiled) kernel for CUDA on this CPU machine: catches lowering errors."""
    avals = (jax.ShapeDtypeStruct((rows, din), jnp.bfloat16), jax.ShapeDtypeStruct((out, din), jnp.bfloat16))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(jax.jit(lambda x, w: lin.linear(x, w, min_rows=1)), platforms=["cuda"])(*avals)
    assert "linear_gemv_mosaic_gpu" in exported.mlir_module()     # the kernel's name in profiles


@pytest.mark.parametrize("rows", [1, 8, 32, 128, 256])
@pytest.mark.parametrize("out,din", sorted(set(lin.K3_SHAPES.values())))
def test_plan_fits_and_divides(rows, out, din):
    n = max(8, -(-rows // 8) * 8)
    block_k, stages, splits = lin.plan(n, out, din, mgpu.H200_SMS)
    assert din % (block_k * splits) == 0 and stages >= min(2, din // block_k)
    assert (lin.BLOCK_OUT + n) * block_k * 2 * stages <= lin.SMEM_BUDGET


@pytest.mark.gpu
@pytest.mark.parametrize("case", K3, ids=lambda c: c.name)
def test_linear_k3_shapes_gpu(case):
    r = validate.check_case(SPEC, "pallas", lin.linear, case, seed=5)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks


@pytest.mark.slow
def test_tiny_model_pallas_plan_matches_xla():
    """The swap the issue asks for: model.plan = KernelPlan.for_backend("pallas") (kernels in
    interpret mode here) gives the XLA backend's logits within bf16 tolerance, same greedy ids."""
    import k3jax
    from k3jax.backend import XLA, KernelPlan

    model = k3jax.from_pretrained("k3-tiny", dtype="bfloat16", seed=0)
    ids = jnp.array([[1, 2, 3]], jnp.int32)
    ref = model(ids)
    model.plan = KernelPlan.for_backend("pallas")
    try:
        out = model(ids)
    finally:
        model.plan = XLA
    assert registry.relative_max_error(out, ref) <= 4 * registry.TOLERANCE["bfloat16"]
    np.testing.assert_array_equal(np.argmax(out, -1), np.argmax(ref, -1))


def test_one_row_runs_xlas_gemv():
    """One row runs the reference (XLA's GEMV, faster in the H200 decode step); more rows, or
    min_rows=1, run the kernel."""
    x = jax.random.normal(jax.random.key(1), (1, 256), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (128, 256), jnp.bfloat16)

    def hlo(*args, **kw) -> str:
        with mgpu.compile_for_gpu():
            return jax.export.export(jax.jit(lambda x, w: lin.linear(x, w, **kw)), platforms=["cuda"])(*args).mlir_module()
    assert "linear_gemv" not in hlo(x, w)
    assert "linear_gemv" in hlo(x, w, min_rows=1)
    assert "linear_gemv" in hlo(jnp.concatenate([x, x]), w)


def test_one_split_stores_the_result_itself():
    """With one K split of whole 64-row tiles the kernel writes the bf16 result [rows, out] itself,
    the real rows only (`mgpu.store_transposed`: no XLA epilogue); K splits, a partial last tile or
    float32 (the router's logits) give float32 partials [S, tiles * 64, N] to sum."""
    x, w = lin._make(5, 128, 512)(jax.random.key(3))
    xp = jnp.pad(x, ((0, 3), (0, 0)))
    block_k, stages, splits = lin.plan(8, 128, 512, mgpu.H200_SMS)
    assert splits == 1
    with mgpu.race_detection():
        y = lin._products(xp, w, block_k, stages, 1, rows=5, dtype=jnp.bfloat16)
        assert not mgpu.races_found()
    assert y.shape == (5, 128) and y.dtype == jnp.bfloat16
    assert registry.relative_max_error(y, ops.linear(x, w)) <= 2.0 ** -7
    assert lin._products(xp, w, block_k, stages, 1).shape == (1, 128, 8)                        # no dtype
    assert lin._products(xp, w, block_k, stages, 1, rows=5, dtype=jnp.float32).shape == (1, 128, 8)
    assert lin._products(xp, w, block_k, stages, 2, rows=5, dtype=jnp.bfloat16).shape == (2, 128, 8)


def test_store_transposed_takes_16_bit_only():
    """Mosaic GPU finds no layout for a transposed float32 store: refused with a clear error."""
    dst = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    with pytest.raises(ValueError, match="16-bit"):
        mgpu.store_transposed(jnp.zeros((64, 8), jnp.float32), dst)
