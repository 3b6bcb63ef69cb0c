"""The Pallas (Mosaic GPU) MXFP4 routed-expert kernel against k3jax.ops.moe_experts: CPU interpret
mode with race detection and NaN-poisoned memory, CUDA lowering export of the K3 shapes on CPU,
and the real kernel on a GPU. Interpret mode is slow (~10 s per kernel call), so the CPU sweep
keeps the cheapest cases; `python -m k3jax.validate --op moe_experts` runs all of them."""

import jax
import jax.numpy as jnp
import pytest

from k3jax import ops, validate
from pallas_kernels import mgpu, registry
from pallas_kernels import moe_experts as me

SPEC = registry.spec("moe_experts")
SMALL = [c for c in SPEC.cases() if "small" in c.sizes]
K3 = [c for c in SPEC.cases() if "k3" in c.sizes]
CPU_CASES = [c for c in SMALL if c.name.startswith(("n1_", "n2_")) or c.name.startswith("fallback")]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_moe_experts_matches_reference_interpret(case):
    r = validate.check_case(SPEC, "pallas", me.moe_experts, case, seed=3, repeats=0)
    assert r.passed, r
    if not case.name.startswith("fallback"):
        assert r.races is False


def test_padded_expert_slots_are_skipped_and_zero():
    """Two tokens choosing the same experts: 2 distinct of 4 slots, the padded slots read nothing
    and contribute nothing (their h rows are written as zeros, not left poisoned)."""
    z, _, _, experts = me._make(2, 512, 512, 8, 2)(jax.random.key(1))
    ids = jnp.array([[5, 2], [2, 5]], jnp.int32)
    w = jnp.array([[0.7, 0.3], [0.4, 0.6]], jnp.float32)
    act = dict(me.ACT)
    with mgpu.race_detection():
        out = jax.jit(lambda *a: me.moe_experts(*a, **act))(z, ids, w, experts)
        assert not mgpu.races_found()
    ref = ops.moe_experts(z, ids, w, experts, **act)
    assert registry.relative_max_error(out, ref) <= registry.TOLERANCE["bfloat16"]


def test_coverage_and_split_plan():
    z, ids, w, experts = me._make(2, 512, 512, 4, 2)(jax.random.key(0))
    assert me.covers(z, ids, experts)
    assert "float32" in me.unsupported(z.astype(jnp.float32), ids, experts)
    assert "tokens" in me.unsupported(jnp.zeros((65, 512), jnp.bfloat16), ids, experts)
    for n in (1, 8, 32, 64):
        slots = min(448, n * 16)
        s = me.down_splits(3584 // 64, 3072, slots, max(8, n), mgpu.H200_SMS)
        assert slots % s == 0
        assert me._stages_and_buffers(max(8, -(-n // 8) * 8))[0] >= 1


@pytest.mark.parametrize("n,e", [(1, 448), (8, 896), (64, 448)])
def test_moe_experts_cuda_export(n, e):
    """Lowers the real (compiled) kernels for CUDA at K3 shapes on this CPU machine."""
    m, i, k = me.K3_M, me.K3_I, me.K3_K
    s = jax.ShapeDtypeStruct
    experts = ops.ExpertWeights(s((e, i, m // 2), jnp.uint8), s((e, i, m // 2), jnp.uint8), s((e, m, i // 2), jnp.uint8),
                                s((e, i, m // 32), jnp.uint8), s((e, i, m // 32), jnp.uint8), s((e, m, i // 32), jnp.uint8))
    fn = jax.jit(lambda z, ids, w, x: me.moe_experts(z, ids, w, x, **dict(me.ACT)))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            s((n, m), jnp.bfloat16), s((n, k), jnp.int32), s((n, k), jnp.float32), experts)
    assert exported.mlir_module().count("mosaic_gpu") >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("case", SMALL + K3, ids=lambda c: c.name)
def test_moe_experts_gpu(case):
    r = validate.check_case(SPEC, "pallas", me.moe_experts, case, seed=5)
    assert r.passed, r
