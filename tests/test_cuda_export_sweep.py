"""Every small case of every op's sweep lowers for CUDA with its Pallas kernels (on CPU, no GPU):
a kernel that claims a shape (its `covers`) must compile for it, not only run in interpret mode;
and so does the whole K3 decode step of each kernel backend at the decode batches.
(Session 23: the MLA absorption kernel's N = 16 / 32 ran interpreted but failed Mosaic GPU's
layout inference when compiled.)"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from k3jax.backend import KernelPlan
from k3jax.cache import init_state
from k3jax.presets import get_preset
from k3jax.weights import abstract_model
from pallas_kernels import mgpu, registry

CASES = [(op, case) for op, spec in sorted(registry.specs().items())
         if "pallas" in registry.implementations(op) for case in spec.sweep("small")]


@pytest.mark.parametrize("op,case", CASES, ids=lambda x: getattr(x, "name", x))
def test_small_case_exports_for_cuda(op, case):
    run = registry.spec(op).runner(case, "pallas")
    avals = jax.eval_shape(case.make, jax.random.key(0))
    with mgpu.compile_for_gpu():
        jax.export.export(jax.jit(run), platforms=["cuda"])(*avals)


def _k3_step(backend: str, batch: int):
    """The k3-h200 decode step with `backend`'s kernels -> (step(params, tokens, state), abstract
    arguments at `batch` rows and a 1088-token cache)."""
    cfg = get_preset("k3-h200")
    model = abstract_model(cfg)
    model.plan = KernelPlan.for_backend(backend)
    graphdef, params = nnx.split(model)
    state = jax.eval_shape(lambda: init_state(cfg, batch, 1088))

    def step(params, tokens, state):
        return nnx.merge(graphdef, params).forward(tokens, state)
    return step, (params, jax.ShapeDtypeStruct((batch, 1), jnp.int32), state)


@pytest.mark.parametrize("backend", ["pallas", "cute"])
@pytest.mark.parametrize("batch", [1, 8, 32, 128, 256])
def test_decode_step_exports_for_cuda(backend, batch):
    """The k3-h200 decode step with every kernel of the backend lowers for CUDA at the decode
    batches the README reports (session 28: batch 256 had stopped compiling on the H200 - MLA's
    expansion asked for 240 KB of SMEM - and no op sweep reached 256 rows)."""
    step, args = _k3_step(backend, batch)
    with mgpu.compile_for_gpu():
        exported = jax.export.export(jax.jit(step), platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()


def _source(var, producers):
    """The equation that computes `var`, looking through the shape-only squeeze / reshape (no
    copy in XLA); None for an input of the step."""
    eqn = producers.get(var)
    while eqn is not None and eqn.primitive.name in ("squeeze", "reshape"):
        eqn = producers.get(eqn.invars[0])
    return eqn


def test_decode_step_hands_kernels_their_inputs_in_place():
    """The kernels' operands in the k3-h200 Pallas step are never a concatenation (a copy of its
    parts every step: session 32 removed KDA's q|k|v and conv-filter stacks) nor a slice of more
    than 1 MB (MLA's cache had been passed as two sliced views, each copied out every step)."""
    step, args = _k3_step("pallas", 1)
    with mgpu.compile_for_gpu():
        jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    kernel_calls = [eqn for eqn in jaxpr.eqns if eqn.primitive.name in ("pjit", "jit") and eqn.params["name"] == "run"]
    assert len(kernel_calls) > 100          # registry.shared_lowering's jit around each kernel call
    copies = []
    for call in kernel_calls:
        for var in call.invars:
            src = _source(var, producers)
            if src is not None and (src.primitive.name == "concatenate" or (
                    src.primitive.name == "slice" and src.invars[0].aval.size * src.invars[0].aval.dtype.itemsize > 2 ** 20)):
                copies.append((src.primitive.name, src.invars[0].aval.str_short()))
    assert not copies, copies
