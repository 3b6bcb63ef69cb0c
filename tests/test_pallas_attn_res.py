"""The Pallas (Mosaic GPU) AttnRes mix against k3jax.ops.attn_res_mix: CPU interpret mode (race
detection, NaN-poisoned memory), CUDA lowering export of the K3 shapes on CPU, the real kernel on
a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import ops, validate
from pallas_kernels import attn_res_mix as arm
from pallas_kernels import mgpu, registry

SPEC = registry.spec("attn_res_mix")
SMALL = SPEC.sweep("small")
K3 = SPEC.sweep("k3")


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_attn_res_mix_matches_reference_interpret(case):
    r = validate.check_case(SPEC, "pallas", arm.attn_res_mix, case, seed=3, repeats=1)
    assert r.passed, r
    assert r.races is not True


def test_dominant_candidate_wins():
    """A candidate aligned with the query takes (almost) all the weight: the kernel's softmax runs
    over the candidate axis, not over D."""
    d = 256
    q = jnp.ones((d,), jnp.bfloat16)
    cand = jax.random.normal(jax.random.key(0), (4, 2, d), jnp.float32).at[2].set(1.0).astype(jnp.bfloat16)
    out = arm.attn_res_mix(cand, jnp.ones((d,), jnp.bfloat16), q, 1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0, atol=2e-2)
    assert registry.relative_max_error(out, ops.attn_res_mix(cand, jnp.ones((d,), jnp.bfloat16), q, 1e-6)) \
        <= registry.TOLERANCE["bfloat16"]


@pytest.mark.parametrize("n,rows", [(9, 1), (2, 8), (9, 128)])
def test_attn_res_mix_cuda_export(n, rows):
    avals = (jax.ShapeDtypeStruct((n, rows, 1, arm.K3_D), jnp.bfloat16),
             jax.ShapeDtypeStruct((arm.K3_D,), jnp.bfloat16), jax.ShapeDtypeStruct((arm.K3_D,), jnp.bfloat16))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(jax.jit(lambda c, w, q: arm.attn_res_mix(c, w, q, 1e-6)),
                                     platforms=["cuda"])(*avals)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("case", K3, ids=lambda c: c.name)
def test_attn_res_mix_k3_shapes_gpu(case):
    r = validate.check_case(SPEC, "pallas", arm.attn_res_mix, case, seed=5)
    assert r.passed, r
