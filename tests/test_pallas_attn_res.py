"""The Pallas (Mosaic GPU) AttnRes mix against k3jax.ops.attn_res_mix, and with the sub-layer's
RMSNorm fused (attn_res_mix_norm): CPU interpret mode (race detection, NaN-poisoned memory), CUDA
lowering export of the K3 shapes on CPU, the real kernels on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import ops, validate
from pallas_kernels import attn_res_mix as arm
from pallas_kernels import mgpu, registry

SPEC = registry.spec("attn_res_mix")
NORM_SPEC = registry.spec("attn_res_mix_norm")
KERNELS = {"attn_res_mix": (SPEC, arm.attn_res_mix), "attn_res_mix_norm": (NORM_SPEC, arm.attn_res_mix_norm)}


def _sweep(size):
    return [(op, c) for op, (spec, _) in KERNELS.items() for c in spec.sweep(size)]


def _id(param):
    return f"{param[0]}-{param[1].name}" if isinstance(param, tuple) else str(param)


@pytest.mark.parametrize("op_case", _sweep("small"), ids=_id)
def test_attn_res_mix_matches_reference_interpret(op_case):
    op, case = op_case
    spec, kernel = KERNELS[op]
    r = validate.check_case(spec, "pallas", kernel, case, seed=3, repeats=1)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
    assert r.races is not True


def test_few_rows_run_xlas_fusions():
    """Below KERNEL_MIN_ROWS rows both ops run the reference (faster there on the H200); from it,
    or with min_rows=1, the kernel."""
    cand, nw, q, out_norm = NORM_SPEC.sweep("small")[0].make(jax.random.key(2))

    def hlo(c, **kw) -> str:
        with mgpu.compile_for_gpu():
            return jax.export.export(jax.jit(lambda c: arm.attn_res_mix_norm(c, nw, q, out_norm, 1e-6, **kw)),
                                     platforms=["cuda"])(c).mlir_module()
    assert "mosaic_gpu" not in hlo(cand)
    assert "mosaic_gpu" in hlo(cand, min_rows=1)
    assert "mosaic_gpu" in hlo(jnp.broadcast_to(cand[:, :1], (cand.shape[0], arm.KERNEL_MIN_ROWS, cand.shape[-1])))


def test_fused_norm_is_the_norm_of_the_mix():
    """The fused kernel's output is ops.rms_norm of the mix kernel's output: both round the mix to
    bf16 before the norm, so the two agree to the last bf16 ulp of the norm."""
    cand, nw, q, out_norm = NORM_SPEC.sweep("small")[1].make(jax.random.key(7))
    fused = arm.attn_res_mix_norm(cand, nw, q, out_norm, 1e-6, min_rows=1)
    composed = ops.rms_norm(arm.attn_res_mix(cand, nw, q, 1e-6, min_rows=1), out_norm, 1e-6)
    assert registry.relative_max_error(fused, composed) <= 2.0 ** -8


def test_dominant_candidate_wins():
    """A candidate aligned with the query takes (almost) all the weight: the kernel's softmax runs
    over the candidate axis, not over D."""
    d = 256
    q = jnp.ones((d,), jnp.bfloat16)
    cand = jax.random.normal(jax.random.key(0), (4, 2, d), jnp.float32).at[2].set(1.0).astype(jnp.bfloat16)
    out = arm.attn_res_mix(cand, jnp.ones((d,), jnp.bfloat16), q, 1e-6, min_rows=1)
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0, atol=2e-2)
    assert registry.relative_max_error(out, ops.attn_res_mix(cand, jnp.ones((d,), jnp.bfloat16), q, 1e-6)) \
        <= registry.TOLERANCE["bfloat16"]


@pytest.mark.parametrize("with_norm", [False, True], ids=["mix", "mix_norm"])
@pytest.mark.parametrize("n,rows", [(9, 1), (2, 8), (9, 128)])
def test_attn_res_mix_cuda_export(n, rows, with_norm):
    vector = jax.ShapeDtypeStruct((arm.K3_D,), jnp.bfloat16)
    avals = (jax.ShapeDtypeStruct((n, rows, 1, arm.K3_D), jnp.bfloat16), vector, vector) + ((vector,) if with_norm else ())
    fn = ((lambda c, w, q, o: arm.attn_res_mix_norm(c, w, q, o, 1e-6, min_rows=1)) if with_norm
          else (lambda c, w, q: arm.attn_res_mix(c, w, q, 1e-6, min_rows=1)))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*avals)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("op_case", _sweep("k3"), ids=_id)
def test_attn_res_mix_k3_shapes_gpu(op_case):
    op, case = op_case
    spec, kernel = KERNELS[op]
    r = validate.check_case(spec, "pallas", kernel, case, seed=5)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks


@pytest.fixture(scope="module")
def small_model_and_logits():
    import k3jax
    model = k3jax.from_pretrained("k3-small", dtype="bfloat16", seed=0)     # D = 512: the kernels' shapes
    ids = jnp.array([[5, 9, 2]], jnp.int32)
    return model, ids, model(ids)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_small_model_mix_norm_plans_match_xla(fused, small_model_and_logits, monkeypatch, counting_plan):
    """With attn_res_mix_norm on its kernel every sub-layer input (and the lm_head's) comes from the
    fused kernel; with it on XLA the model composes the plan's attn_res_mix with the XLA norm.
    Either way the logits are the XLA backend's within bf16 tolerance."""
    import k3jax
    from k3jax.backend import XLA, KernelPlan

    model, ids, ref = small_model_and_logits
    for kernel_fn in (arm.attn_res_mix, arm.attn_res_mix_norm):         # the kernels, not the few-row rule
        monkeypatch.setitem(kernel_fn.__kwdefaults__, "min_rows", 1)
    kernel = "attn_res_mix_norm" if fused else "attn_res_mix"
    plan, calls = counting_plan(KernelPlan.for_backend("xla", **{kernel: "pallas"}))
    model.plan = plan
    registry.clear_fallbacks()
    try:
        out, _ = jax.jit(model.forward)(ids, k3jax.init_state(model.cfg, 1, 3, model.dtype))
    finally:
        model.plan = XLA
    layers = model.cfg.num_hidden_layers
    assert calls.count(kernel) == 2 * layers, calls        # every mix but layer 0's first: 2L - 1 + final
    assert calls.count("attn_res_mix" if fused else "attn_res_mix_norm") == 0, calls
    assert not registry.fallbacks(), registry.fallbacks()
    assert registry.relative_max_error(out, ref) <= 4 * registry.TOLERANCE["bfloat16"]
