"""The Pallas (Mosaic GPU) gated MLP against k3jax.ops.gated_mlp: CPU interpret mode with race
detection and NaN-poisoned memory, CUDA lowering export on CPU at K3 shapes, and the real
kernels on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import ops, validate
from pallas_kernels import gated_mlp as gm
from pallas_kernels import mgpu, registry

SPEC = registry.spec("gated_mlp")
SMALL = SPEC.sweep("small")
K3 = SPEC.sweep("k3")
TOL = registry.TOLERANCE["bfloat16"]


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_gated_mlp_matches_reference_interpret(case):
    args = case.make(jax.random.key(3))
    assert gm.covers(*args) == (not case.name.startswith("fallback"))
    r = validate.check_case(SPEC, "pallas", gm.gated_mlp, case, seed=3, repeats=1)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
    assert r.races is False


def test_gate_up_kernel_writes_every_element():
    """h, including padded rows, is fully written (interpret memory starts as NaN) and equals the
    reference's glu(gate(x), up(x)) for the real rows."""
    x, wg, wu, _ = gm._make(11, 128, 128)(jax.random.key(4))
    block_n, blocks = gm.row_blocks(11)
    xp = jnp.pad(x, ((0, block_n * blocks - 11), (0, 0)))
    act = dict(gm.K3_ACT)
    h = gm._gate_up(xp, wg, wu, block_n, **act)
    assert h.shape == (16, 128) and np.all(np.isfinite(np.asarray(h, np.float32)))      # token-major
    ref = ops.glu(ops.linear(x, wg), ops.linear(x, wu), act["act"], act["beta"], act["linear_beta"])
    assert registry.relative_max_error(h[:11], ref) <= TOL


def test_leading_axes_and_fallbacks():
    x, wg, wu, wd = gm._make(6, 128, 128)(jax.random.key(1))
    x3 = x.reshape(2, 3, 128)
    out = gm.gated_mlp(x3, wg, wu, wd, *dict(gm.K3_ACT).values())
    assert out.shape == (2, 3, 128) and out.dtype == jnp.bfloat16
    assert registry.relative_max_error(out, ops.gated_mlp(x3, wg, wu, wd, *dict(gm.K3_ACT).values())) <= TOL
    xf = x.astype(jnp.float32)      # float32 is not covered: the reference runs, exactly
    np.testing.assert_array_equal(gm.gated_mlp(xf, wg, wu, wd, "silu", 1.0, None),
                                  ops.gated_mlp(xf, wg, wu, wd, "silu", 1.0, None))
    assert "bfloat16" in gm.unsupported(xf, wg, wu, wd)
    assert "multiple of 64" in gm.unsupported(x[:, :96], wg[:, :96], wu[:, :96], wd[:96])
    assert "rows" in gm.unsupported(jnp.zeros((257, 128), jnp.bfloat16), wg, wu, wd)
    assert "chain" in gm.unsupported(x, wg, wu, wd[:, :64])


@pytest.mark.parametrize("rows", [1, 8, 9, 128, 129, 200, 256])
def test_row_blocks(rows):
    block_n, blocks = gm.row_blocks(rows)
    assert block_n % 8 == 0 and block_n <= gm.BLOCK_N and rows <= block_n * blocks < rows + 8 * blocks
    assert blocks == -(-rows // gm.BLOCK_N)


@pytest.mark.parametrize("rows,inter", [(1, gm.K3_INTER["dense"]), (8, gm.K3_INTER["shared"]),
                                        (128, gm.K3_INTER["dense"]), (256, gm.K3_INTER["shared"])])
def test_gated_mlp_cuda_export(rows, inter):
    """Lowers the real (compiled) kernels for CUDA at K3 shapes on this CPU machine."""
    s, d = jax.ShapeDtypeStruct, gm.K3_D
    fn = jax.jit(lambda x, a, b, c: gm.gated_mlp(x, a, b, c, **dict(gm.K3_ACT)))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            s((rows, d), jnp.bfloat16), s((inter, d), jnp.bfloat16), s((inter, d), jnp.bfloat16),
            s((d, inter), jnp.bfloat16))
    # The gate/up kernel, and the down projection's `linear` kernel from 2 rows (one row: XLA's GEMV).
    assert exported.mlir_module().count("custom_call @mosaic_gpu") == (1 if rows == 1 else 2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SMALL + K3, ids=lambda c: c.name)
def test_gated_mlp_gpu(case):
    r = validate.check_case(SPEC, "pallas", gm.gated_mlp, case, seed=5)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "composed"])
def test_layer_runs_the_kernel_or_composes_the_plans_linear(fused, counting_plan):
    """GatedMLP: with gated_mlp on its kernel one call; with it on XLA (the per-op granularity) the
    formula over the plan's "linear" (three projection kernels); the same output either way."""
    from flax import nnx

    from k3jax.backend import KernelPlan
    from k3jax.layers import GatedMLP
    from k3jax.presets import get_preset

    mlp = GatedMLP(get_preset("k3-small"), 128, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 512), jnp.bfloat16)
    plan, calls = counting_plan(KernelPlan.for_backend("xla", **({"gated_mlp": "pallas"} if fused else {"linear": "pallas"})))
    out = mlp(x, plan)
    assert calls == (["gated_mlp"] if fused else ["linear"]), calls
    ref = ops.gated_mlp(x, mlp.gate_proj.weight[...], mlp.up_proj.weight[...], mlp.down_proj.weight[...], *mlp.act)
    assert registry.relative_max_error(out, ref) <= 2 * TOL
