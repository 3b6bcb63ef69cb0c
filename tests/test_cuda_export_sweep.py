"""Every small case of every op's sweep lowers for CUDA with its Pallas kernels (on CPU, no GPU):
a kernel that claims a shape (its `covers`) must compile for it, not only run in interpret mode.
(Session 23: the MLA absorption kernel's N = 16 / 32 ran interpreted but failed Mosaic GPU's
layout inference when compiled.)"""

import jax
import pytest

from pallas_kernels import mgpu, registry

CASES = [(op, case) for op, spec in sorted(registry.specs().items())
         if "pallas" in registry.implementations(op) for case in spec.sweep("small")]


@pytest.mark.parametrize("op,case", CASES, ids=lambda x: getattr(x, "name", x))
def test_small_case_exports_for_cuda(op, case):
    run = registry.spec(op).runner(case, "pallas")
    avals = jax.eval_shape(case.make, jax.random.key(0))
    with mgpu.compile_for_gpu():
        jax.export.export(jax.jit(run), platforms=["cuda"])(*avals)
