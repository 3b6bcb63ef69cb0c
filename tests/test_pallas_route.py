"""The Pallas (Mosaic GPU) router against k3jax.ops.route: CPU interpret mode (race detection,
NaN-poisoned memory), exact tie order, CUDA lowering export of the K3 shapes on CPU, and the real
kernels on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import ops, validate
from pallas_kernels import mgpu, registry
from pallas_kernels import route as rt

SPEC = registry.spec("route")
SMALL = SPEC.sweep("small")
K3 = SPEC.sweep("k3")


@pytest.mark.parametrize("case", [c for c in SMALL if not c.name.startswith("ties")], ids=lambda c: c.name)
def test_route_matches_reference_interpret(case):
    r = validate.check_case(SPEC, "pallas", rt.route, case, seed=3, repeats=1)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
    assert r.races is not True


def test_ties_go_to_the_lower_expert_id():
    """Pairs of identical experts score exactly equal: the ids must equal the reference's exactly
    (SPEC.compare tolerates swaps of near-equal choices; this does not)."""
    case = next(c for c in SMALL if c.name.startswith("ties"))
    args = case.make(jax.random.key(4))
    ids, w = jax.jit(lambda *a: rt.route(*a, **case.kw))(*args)
    rids, rw = ops.route(*args, **case.kw)
    np.testing.assert_array_equal(ids, rids)
    assert registry.relative_max_error(w, rw) <= registry.TOLERANCE["float32"]


@pytest.mark.gpu
def test_ties_go_to_the_lower_expert_id_gpu():
    """The same exact check on the compiled kernels (identical expert rows must still score
    bit-identically through the split-K logits)."""
    test_ties_go_to_the_lower_expert_id()


def test_unsupported_configs_fall_back_to_the_reference():
    x, w, b = rt._make(2, 128, 128)(jax.random.key(0))
    for kw in (dict(activation="softmax"), dict(n_group=4, topk_group=2)):
        kwargs = dict(top_k=4, activation="sigmoid", renormalize=True, scaling=1.0) | kw
        assert not rt.covers(x.shape, w.shape, x.dtype, w.dtype, top_k=4, activation=kwargs["activation"],
                             n_group=kwargs.get("n_group", 1), topk_group=kwargs.get("topk_group", 1))
        for got, want in zip(rt.route(x, w, b, **kwargs), ops.route(x, w, b, **kwargs), strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("experts,rows", [(896, 1), (448, 8), (896, 128)])
def test_route_cuda_export(experts, rows):
    """Lowers both real (compiled) kernels for CUDA at K3 shapes on this CPU machine."""
    avals = (jax.ShapeDtypeStruct((rows, rt.K3_D), jnp.bfloat16),
             jax.ShapeDtypeStruct((experts, rt.K3_D), jnp.bfloat16), jax.ShapeDtypeStruct((experts,), jnp.float32))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(jax.jit(lambda x, w, b: rt.route(x, w, b, **dict(rt.K3_KW))),
                                     platforms=["cuda"])(*avals)
    assert exported.mlir_module().count("custom_call @mosaic_gpu") == 2      # logits, then the selection


@pytest.mark.gpu
@pytest.mark.parametrize("case", K3, ids=lambda c: c.name)
def test_route_k3_shapes_gpu(case):
    r = validate.check_case(SPEC, "pallas", rt.route, case, seed=5)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
