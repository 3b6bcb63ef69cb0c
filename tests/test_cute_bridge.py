"""cute_bridge on CPU: the build runs without a GPU, the library links, the JAX binding checks
arguments, and every kernel (and the registered ops at K3 decode shapes) lowers and exports for CUDA."""

import ctypes
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cute_bridge import codegen, loader
from cute_bridge.kernel_set import BY_NAME, KERNELS, kernel_set_hash
from k3jax import ops

S = jax.ShapeDtypeStruct


@pytest.fixture(scope="module")
def library():
    pytest.importorskip("cutlass", reason="needs the `cute` extra (nvidia-cutlass-dsl) to build")
    from cute_bridge import build
    return build.build(verbose=False)


def test_build_is_cached_and_complete(library):
    from cute_bridge import build
    out_dir = library.parent / kernel_set_hash()
    assert (out_dir / "k3cute_ffi.cc").exists() and library.exists()
    mtime = (out_dir / build.LIBRARY).stat().st_mtime_ns
    build.build(verbose=False)                     # same sources: reused, not rebuilt
    assert (out_dir / build.LIBRARY).stat().st_mtime_ns == mtime
    for spec in KERNELS:                           # every header still matches its spec
        codegen.check_matches(spec, codegen.parse_header((out_dir / f"{spec.name}.h").read_text(), spec.name))


def test_library_links_and_names_its_kernel_set(library):
    lib = ctypes.CDLL(str(library))
    lib.k3cute_kernel_set.restype = ctypes.c_char_p
    assert lib.k3cute_kernel_set().decode() == kernel_set_hash()
    for spec in KERNELS:
        assert getattr(lib, f"{spec.target}_execute") and getattr(lib, f"{spec.target}_instantiate")


def _export(f, *avals):
    with loader.exporting():
        exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=loader.export_checks())(*avals)
    return exp.mlir_module()


@pytest.mark.parametrize("name,avals,dims", [
    ("add", (S((1000,), jnp.float32),) * 2, None),
    ("gemv_r1", (S((1, 7168), jnp.bfloat16), S((1536, 7168), jnp.bfloat16)), None),
    ("gemv_r8", (S((8, 64), jnp.bfloat16), S((24, 64), jnp.bfloat16)), None),
    ("moe_gate_up", (S((2, 64), jnp.bfloat16), S((8,), jnp.int32), S((16, 32, 8), jnp.int32),
                     S((16, 32, 2), jnp.uint8), S((16, 32, 8), jnp.int32), S((16, 32, 2), jnp.uint8)), None),
    ("moe_down_combine", (S((8, 32), jnp.bfloat16), S((8,), jnp.int32), S((8,), jnp.float32),
                          S((16, 64, 4), jnp.int32), S((16, 64, 1), jnp.uint8)), {"N": 2}),
])
def test_kernel_lowers_and_exports_for_cuda(name, avals, dims):
    text = _export(lambda *a: loader.call(name, *a, dims=dims), *avals)
    assert f"@{BY_NAME[name].target}(" in text


def test_registered_ops_export_at_k3_decode_shapes():
    from cute_bridge import ops as cute_ops
    from k3jax.presets import get_preset
    cfg = get_preset("k3-h200")
    d, m, inter, e, k = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, \
        cfg.num_experts, cfg.num_experts_per_token
    assert BY_NAME["gemv_r1"].target in _export(cute_ops.linear, S((1, 1, d), jnp.bfloat16), S((12288, d), jnp.bfloat16))

    def experts(z, ids, w, p13, q13, p2, q2):
        ew = ops.ExpertWeights(p13, p13, p2, q13, q13, q2)
        return cute_ops.moe_experts(z, ids, w, ew, act="situ", beta=4.0, linear_beta=25.0)
    text = _export(experts, S((1, m), jnp.bfloat16), S((1, k), jnp.int32), S((1, k), jnp.float32),
                   S((e, inter, m // 2), jnp.uint8), S((e, inter, m // 32), jnp.uint8),
                   S((e, m, inter // 2), jnp.uint8), S((e, m, inter // 32), jnp.uint8))
    assert BY_NAME["moe_gate_up"].target in text and BY_NAME["moe_down_combine"].target in text


@pytest.mark.parametrize("args,message", [
    ((S((1, 64), jnp.float32), S((8, 64), jnp.bfloat16)), "argument 'x' must be bfloat16"),
    ((S((2, 64), jnp.bfloat16), S((8, 64), jnp.bfloat16)), "must have shape (1, 'K')"),
    ((S((1, 64), jnp.bfloat16), S((8, 72), jnp.bfloat16)), "has K=72, but another argument has K=64"),
    ((S((1, 12), jnp.bfloat16), S((8, 12), jnp.bfloat16)), "K=12 must be a positive multiple of 8"),
])
def test_call_names_bad_arguments(args, message):
    with loader.exporting(), pytest.raises(ValueError) as err:
        jax.eval_shape(lambda *a: loader.call("gemv_r1", *a), *args)
    assert message in str(err.value)


def test_clear_errors_without_library_or_gpu(monkeypatch, tmp_path):
    with pytest.raises(loader.CuteBridgeError, match="no CuTe kernel"):
        loader.call("nope")
    x = jnp.ones((4,), jnp.float32)
    with pytest.raises(loader.CuteBridgeError, match="needs an NVIDIA GPU"):
        loader.call("add", x, x)
    monkeypatch.setattr(loader, "_library", None)
    monkeypatch.setenv("K3JAX_CUTE_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(loader.CuteBridgeError, match="python -m cute_bridge.build"):
        loader.load()


def test_stale_library_is_refused(library, monkeypatch):
    monkeypatch.setattr(loader, "_library", None)
    monkeypatch.setenv("K3JAX_CUTE_LIB", str(library))
    monkeypatch.setattr(loader, "kernel_set_hash", lambda: "0" * 16)
    with pytest.raises(loader.CuteBridgeError, match="was built for kernel set"):
        loader.load()


def test_ops_fall_back_to_the_reference_without_gpu(caplog):
    from cute_bridge import ops as cute_ops
    from pallas_kernels import registry
    x = jax.random.normal(jax.random.key(0), (2, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (24, 64), jnp.bfloat16)
    registry.clear_fallbacks()
    registry._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="k3jax.kernels"):
        y = cute_ops.linear(x, w)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ops.linear(x, w), np.float32))
    assert "cute linear: no GPU; using the XLA reference" in caplog.text
    assert registry.fallbacks()["linear/cute"] == ["no GPU"]


def test_registry_and_plan_pick_cute():
    from k3jax.backend import KernelPlan
    from pallas_kernels import registry
    import cute_bridge.ops  # noqa: F401  (registers even before the registry lists the module)
    assert registry.implementation("linear", "cute") is not None
    plan = KernelPlan.for_backend("cute")
    assert plan.describe()["linear"] == "cute" and plan.describe()["moe_experts"] == "cute"
