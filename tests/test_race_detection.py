"""The race detector the kernel tests and `validate` rely on (pallas_kernels.mgpu, interpret mode):
it must flag a racy kernel, also when a clean kernel runs after it in the same call (the
interpreter replaces its race state with every kernel), and a block must not inherit an earlier
block's race."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu", reason="interpret mode (CPU) only")


def _racy():
    """Two warpgroups write the same SMEM with no synchronisation, then one copies it out."""
    def body(o_ref, s_ref):
        s_ref[...] = jnp.full((128,), 1.0, jnp.float32)
        plgpu.commit_smem()

        @pl.when(jax.lax.axis_index("wg") == 0)
        def _():
            plgpu.copy_smem_to_gmem(s_ref, o_ref)
            plgpu.wait_smem_to_gmem(0)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                        scratch_types=[plgpu.SMEM((128,), jnp.float32)], num_threads=2, thread_name="wg",
                        compiler_params=mgpu.warpgroup_params(), interpret=mgpu.interpret_params())()


def _clean():
    def body(o_ref):
        o_ref[...] = jnp.full((128,), 2.0, jnp.float32)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                        compiler_params=mgpu.warpgroup_params(), interpret=mgpu.interpret_params())()


def test_a_race_in_an_earlier_kernel_of_the_call_is_reported():
    with mgpu.race_detection():
        jax.block_until_ready(jax.jit(lambda: (_racy(), _clean()))())
        assert mgpu.races_found()


def test_a_race_in_an_earlier_call_of_the_block_is_reported():
    with mgpu.race_detection():
        jax.block_until_ready(jax.jit(lambda: _racy())())
        jax.block_until_ready(jax.jit(lambda: _clean())())
        assert mgpu.races_found()


def test_a_block_reports_itself_after_it_ends_and_nested_blocks_add_to_the_outer():
    with mgpu.race_detection():
        jax.block_until_ready(jax.jit(lambda: _racy())())
    assert mgpu.races_found()
    with mgpu.race_detection():
        jax.block_until_ready(jax.jit(lambda: _clean())())
    assert not mgpu.races_found()           # the earlier block's race is not carried over
    with mgpu.race_detection():
        with mgpu.race_detection():
            jax.block_until_ready(jax.jit(lambda: _racy())())
        jax.block_until_ready(jax.jit(lambda: _clean())())
        assert mgpu.races_found()


def test_a_new_block_starts_clean():
    with mgpu.race_detection():
        jax.block_until_ready(jax.jit(lambda: _racy())())
    with mgpu.race_detection():
        jax.block_until_ready(jax.jit(lambda: _clean())())
        assert not mgpu.races_found()
