"""The Pallas (Mosaic GPU) KDA decode-step kernels against k3jax.ops.kda_decode, for every
value-column split, every place the inputs are prepared (`prep`: in the fused kernel, by the
prep kernel, by XLA) and both places of the gated norm with splits (`norm`: in the kernel, the
head's splits exchanging their sums of squares as one cluster; by XLA after it), and the prep
kernel alone against k3jax.ops.kda_step_inputs: CPU interpret mode with race detection and
NaN-poisoned memory (every output checked; both gate forms), CUDA lowering export of the K3 and
Kimi-Linear-48B shapes on CPU, and the real kernels on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import ops, validate
from pallas_kernels import kda_decode as kd
from pallas_kernels import mgpu, registry

SPEC = registry.spec("kda_decode")
SMALL = [c for c in SPEC.sweep("small") if not c.kernel_kwargs]   # the tests below pick the kernel
K3 = [c for c in SPEC.sweep("k3") if not c.kernel_kwargs]       # the ablation cases pin a prep
PREPPED = [c for c in SMALL if not c.name.startswith("fallback")]
# (case, splits, prep, norm): the fused kernel at every split; the delta-rule-only kernel after
# XLA's prep at every split for the lower-bound gate (d 64 and 128), at one split for the softplus
# gate (the gate is XLA's formula before the kernel: the kernel is the same, the data differ);
# after the prep kernel at one split per case (the delta-rule kernel is the same, so the splits
# rotate over the cases); all with the norm in the kernel, and the XLA norm after each kernel at
# 2 and 4 splits for one case; the fallback case ignores all three (None: the defaults).
def _rotated(cases, prep):
    return [(c, kd.SPLITS[i % len(kd.SPLITS)], prep, "cluster") for i, c in enumerate(cases)]


SOFTPLUS = [c for c in PREPPED if c.kw["lower_bound"] is None]
SMALL_SPLITS = ([(c, s, "fused", "cluster") for c in PREPPED for s in kd.SPLITS]
                + [(c, s, "xla", "cluster") for c in PREPPED if c not in SOFTPLUS for s in kd.SPLITS]
                + _rotated(SOFTPLUS, "xla") + _rotated(PREPPED, "kernel")
                + [(PREPPED[i], s, prep, "xla") for i, prep in enumerate(kd.PREPS) for s in (2, 4)]
                + [(c, None, "fused", None) for c in SMALL if c.name.startswith("fallback")])


def _ids(param):
    case, splits, prep, norm = param
    return f"{case.name}-s{splits}-{prep}" + ("-xla_norm" if norm == "xla" else "")


def _kernel(param):
    """(case, the kernel's kda_decode) of a test parameter."""
    case, splits, prep, norm = param
    return case, functools.partial(kd.kda_decode, splits=splits, prep=prep, norm=norm)


@pytest.mark.parametrize("param", SMALL_SPLITS, ids=_ids)
def test_kda_decode_matches_reference_interpret(param):
    case, fn = _kernel(param)
    r = validate.check_case(SPEC, "pallas", fn, case, seed=3, repeats=1)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
    if not case.name.startswith("fallback"):
        assert r.races is False
    # o, conv window, state: each output's own error is in the report (validate's log and .md)
    assert len(r.output_errors) == 3 and np.max(r.output_errors) <= 2 * r.tolerance    # NaN fails
    assert "(outputs " in validate._per_output(r)


def test_kda_decode_outputs_and_coverage():
    args = kd._make(1, 2, 64)(jax.random.key(2))
    o, conv, s = kd.kda_decode(*args, num_heads=2, lower_bound=-5.0, eps=1e-5)
    assert o.shape == (1, 128) and o.dtype == jnp.bfloat16
    # The new window is the old one shifted by one with the new input last: exactly.
    np.testing.assert_array_equal(np.asarray(conv[:, :-1], np.float32), np.asarray(args[0][:, 1:], np.float32))
    np.testing.assert_array_equal(np.asarray(conv[:, -1], np.float32), np.asarray(jnp.concatenate(args[1], -1), np.float32))
    assert s.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(s)))
    assert "head dim" in kd.unsupported(args[0], args[1], jnp.zeros((1, 96)), 1)
    assert kd.unsupported(args[0], args[1], args[3], 2) is None
    with pytest.raises(ValueError, match="splits=3"):
        kd.kda_decode(*args, num_heads=2, lower_bound=-5.0, eps=1e-5, splits=3)
    with pytest.raises(ValueError, match="prep='triton'"):
        kd.kda_decode(*args, num_heads=2, lower_bound=-5.0, eps=1e-5, prep="triton")
    with pytest.raises(ValueError, match="prep_group=2 groups the prep kernel's heads, but prep is 'xla'"):
        kd.kda_decode(*args, num_heads=2, lower_bound=-5.0, eps=1e-5, prep="xla", prep_group=2)
    with pytest.raises(ValueError, match="norm='block'; choose one of"):
        kd.kda_decode(*args, num_heads=2, lower_bound=-5.0, eps=1e-5, norm="block")


@pytest.mark.parametrize("prep", ["fused", "xla"])
def test_split_norm_exchange_needs_the_cluster_sync(prep, monkeypatch):
    """The evidence that the race detector sees the splits' exchange of sums of squares: without
    the cluster sync between writing and reading them it flags a race (and with it, none: the
    interpret test above)."""
    case = next(c for c in PREPPED if c.name == "b2_h3_d128")
    monkeypatch.setattr(mgpu, "cluster_sync", lambda barrier: None)
    fn = functools.partial(kd.kda_decode, splits=4, prep=prep)
    with mgpu.race_detection():
        validate.check_case(SPEC, "pallas", fn, case, seed=3, repeats=1)
        assert mgpu.races_found()


def _check_prep_kernel(case, seed, group=1):
    """_prep_kernel (`group` heads per program) against ops.kda_step_inputs
    (decay against exp(g)): q, k, v, decay and beta are float32 math on the same bf16 inputs (ops'
    formulas, other summation order): float32's tolerance; the conv window is a copy: exact. NaN
    (an unwritten element) fails."""
    args = case.make(jax.random.key(seed))
    conv_state, qkv, conv_w, f, beta_logit, _, a_log, dt_bias, *_ = args
    h, lb = case.kw["num_heads"], case.kw["lower_bound"]
    with mgpu.race_detection():
        out = jax.block_until_ready(jax.jit(lambda *a: kd._prep_kernel(*a, num_heads=h, lower_bound=lb, group=group))(
            conv_state, qkv, conv_w, f, beta_logit, a_log, dt_bias))
        races = mgpu.races_found() if mgpu.interpret_params() is not None else None
    (q, k, v, g, beta), conv = ops.kda_step_inputs(conv_state, qkv, conv_w, f, beta_logit, a_log, dt_bias, h, lb)
    ref = (q, k, v, jnp.exp(g), beta), conv
    assert jax.tree.map(lambda x: (x.shape, x.dtype), out) == jax.tree.map(lambda x: (x.shape, x.dtype), ref)
    errors = [registry.relative_max_error(o, r) for o, r in zip(out[0], ref[0], strict=True)]
    assert np.max(errors) <= registry.TOLERANCE["float32"], errors     # NaN fails
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), np.asarray(conv, np.float32))
    return races


# Every small case with one head per program (the default) and with all its heads in one program
# (the ablation's head loop, its prefetch and the double-buffered SMEM; races detected).
PREP_GROUPS = [(c, g) for c in PREPPED for g in sorted({1, c.kw["num_heads"]})]


def _prep_ids(param):
    return f"{param[0].name}-g{param[1]}"


@pytest.mark.parametrize("param", PREP_GROUPS, ids=_prep_ids)
def test_prep_kernel_matches_kda_step_inputs_interpret(param):
    case, group = param
    assert _check_prep_kernel(case, seed=4, group=group) is False


def test_prep_kernel_group_must_divide_heads():
    args = jax.eval_shape(lambda: kd._make(1, 3, 64)(jax.random.key(0)))
    with pytest.raises(ValueError, match="group=2 does not divide num_heads=3"):
        kd._prep_kernel(*args[:5], *args[6:8], num_heads=3, lower_bound=-5.0, group=2)


def test_kda_decode_plan():
    # The H200 measurements (module doc): 4 below one (sequence, head) pair per SM; from one, 2 in
    # the fused kernel (session 18: it beats 1 below two pairs per SM and the prep kernel above)
    # and after XLA's prep, 4 after the prep kernel.
    assert [kd.plan(b, kd.K3_HEADS, 132) for b in (1, 2, 3, 8, 128)] == [4, 2, 2, 2, 2]
    assert [kd.plan(b, kd.KL_HEADS, 132) for b in (1, 4, 5, 8, 67)] == [4, 4, 2, 2, 2]
    assert [kd.plan(8, kd.K3_HEADS, 132, prep) for prep in kd.PREPS] == [2, 2, 4]
    assert kd.plan(1, kd.K3_HEADS, 132, "xla") == 4             # fewer pairs than SMs: whatever the prep
    # Session 35 (H100): the norm in the kernel (a cluster per head) below one pair per SM only.
    assert [kd.plan_norm(b, kd.K3_HEADS, 132) for b in (1, 2, 8)] == ["cluster", "xla", "xla"]


# K3 (lower-bound gate, 96 heads) and Kimi-Linear-48B (softplus decay, 32 heads), every split;
# d = 64 at 4 splits is the one 64-byte (not 128-byte) swizzled slab.
@pytest.mark.parametrize("prep", kd.PREPS)
@pytest.mark.parametrize("splits", kd.SPLITS)
@pytest.mark.parametrize("b,heads,d,lower_bound", [(1, kd.K3_HEADS, kd.K3_D, -5.0), (8, kd.K3_HEADS, kd.K3_D, -5.0),
                                                   (128, kd.K3_HEADS, kd.K3_D, -5.0), (1, kd.KL_HEADS, kd.K3_D, None),
                                                   (32, kd.KL_HEADS, kd.K3_D, None), (2, 4, 64, -5.0)])
def test_kda_decode_cuda_export(b, heads, d, lower_bound, splits, prep):
    args = jax.eval_shape(lambda: kd._make(b, heads, d, kd.K3_CONV)(jax.random.key(0)))
    fn = jax.jit(lambda *a: kd.kda_decode(*a, num_heads=heads, lower_bound=lower_bound, eps=1e-5, splits=splits,
                                          prep=prep))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("norm", kd.NORMS)
@pytest.mark.parametrize("splits", kd.SPLITS)
def test_kda_decode_cuda_export_cluster_sync(splits, norm):
    """The compiled exchange syncs with the hardware cluster barrier's release / acquire form
    (mgpu.cluster_sync), exactly when a head's splits norm in the kernel."""
    args = jax.eval_shape(lambda: kd._make(1, kd.K3_HEADS, kd.K3_D, kd.K3_CONV)(jax.random.key(0)))
    fn = jax.jit(lambda *a: kd.kda_decode(*a, num_heads=kd.K3_HEADS, lower_bound=-5.0, eps=1e-5, splits=splits,
                                          norm=norm))
    with mgpu.compile_for_gpu():
        module = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    synced = "barrier.cluster.arrive.release.aligned" in module and "barrier.cluster.wait.acquire.aligned" in module
    assert synced == (splits > 1 and norm == "cluster")


# The real kernels: fused and XLA-prep at every split and both norms, the prep kernel at the
# default split and norm (the delta-rule kernel after it is the XLA-prep one).
@pytest.mark.gpu
@pytest.mark.parametrize("param", SMALL_SPLITS + [(c, s, x, n) for c in K3 for s in kd.SPLITS for x in ("fused", "xla")
                                                  for n in kd.NORMS if s > 1 or n == "cluster"]
                         + [(c, None, "kernel", None) for c in K3], ids=_ids)
def test_kda_decode_gpu(param):
    case, fn = _kernel(param)
    r = validate.check_case(SPEC, "pallas", fn, case, seed=5)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks


@pytest.mark.gpu
@pytest.mark.parametrize("param", PREP_GROUPS + [(c, 1) for c in K3], ids=_prep_ids)
def test_prep_kernel_gpu(param):
    case, group = param
    _check_prep_kernel(case, seed=6, group=group)


def test_cpu_judge_script(capsys):
    """benchmarks/cpu_judge.py (the kernel and the reference against the reference on XLA:CPU)
    prints one line per output and rejects an unknown case with exit status 2."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "cpu_judge.py"
    spec = importlib.util.spec_from_file_location("cpu_judge", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.judge("kda_decode", ["softplus_b1_h2_d128"], "pallas") == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("pallas-vs-cpu" in line for line in lines)
    assert mod.run_cli("cpu_judge", lambda: mod.judge("kda_decode", ["nope"], "pallas")) == 2
