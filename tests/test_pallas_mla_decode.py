"""The Pallas (Mosaic GPU) absorbed MLA decode attention against k3jax.ops.mla_decode: CPU
interpret mode (race detection, NaN-poisoned memory), CUDA lowering export of the K3 shapes on
CPU, and the real kernel on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import ops, validate
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
    assert r.races is not True


def test_kv_len_is_a_traced_value():
    """One compiled step serves every length: kv_len changes without retracing, and tokens past
    it do not leak into the result."""
    args = list(mla._make(2, 8, 32, 64, 128, 32, 128, lens=[64, 128])(jax.random.key(0)))
    run = jax.jit(lambda *a: mla.mla_decode(*a, 0.1))
    for lens in ([64, 128], [3, 100]):
        args[-1] = jnp.asarray(lens, jnp.int32)
        err = registry.relative_max_error(run(*args), ops.mla_decode(*args, 0.1))
        assert err <= SPEC.allowed(None, args, {}), (lens, err)
    assert run._cache_size() == 1


@pytest.mark.parametrize("length", [64, 192, 32768])
@pytest.mark.parametrize("batch", [1, 8, 128])
def test_plan_divides_the_sequence(batch, length):
    s = mla.plan(batch, 96, length, 512, mgpu.H200_SMS)
    assert (length // mla.BLOCK_L) % s == 0


@pytest.mark.parametrize("batch,length", [(1, 32768), (8, 4096), (128, 1024)])
def test_mla_decode_cuda_export(batch, length):
    """Lowers the real (compiled) kernel for CUDA at K3 shapes on this CPU machine."""
    avals = jax.eval_shape(mla._make(batch, *mla.K3.values(), length), jax.random.key(0))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(jax.jit(lambda *a: mla.mla_decode(*a, 192 ** -0.5)),
                                     platforms=["cuda"])(*avals)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("case", K3, ids=lambda c: c.name)
def test_mla_decode_k3_shapes_gpu(case):
    r = validate.check_case(SPEC, "pallas", mla.mla_decode, case, seed=5)
    assert r.passed, r
    assert np.isfinite(r.error)
