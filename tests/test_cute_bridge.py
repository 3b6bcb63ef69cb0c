"""cute_bridge on CPU: the build runs without a GPU, the library links, the JAX binding checks
arguments, and every kernel (and the registered ops at K3 decode shapes) lowers and exports for CUDA."""

import ctypes
import functools
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


def test_generated_glue_sets_each_specs_carveout(library):
    """A spec's shared-memory carveout is set when its module loads, and only for that spec: the
    64-row MoE kernels ask for the largest (a fifth block per SM), the others keep the default."""
    source = (library.parent / kernel_set_hash() / "k3cute_ffi.cc").read_text()
    wide = {s.name for s in KERNELS if s.smem_carveout is not None}
    assert wide == {f"moe_{op}_t{t}_rows64{tiles}" for op in ("gate_up", "down") for t in (1, 8) for tiles in ("", "_tiles")}
    for spec in KERNELS:
        call = f"k3cute_carveout({spec.name}_module.module, "
        assert (call in source) == (spec.name in wide), spec.name
        if spec.name in wide:
            assert f"{call}{spec.smem_carveout})" in source


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


def _calls(text: str, *names: str) -> bool:
    """Does the exported module call every named kernel? (the exact target: one name can prefix another)"""
    return all(f"@{BY_NAME[name].target}(" in text for name in names)


@pytest.mark.parametrize("name,avals,dims", [
    ("add", (S((1000,), jnp.float32),) * 2, None),
    ("gemv_r1", (S((1, 7168), jnp.bfloat16), S((1536, 7168), jnp.bfloat16)), None),
    ("gemv_r8", (S((8, 64), jnp.bfloat16), S((24, 64), jnp.bfloat16)), None),
    ("moe_gate_up_t8", (S((2, 64), jnp.bfloat16), S((6,), jnp.int32), S((6, 8), jnp.int32), S((16, 32, 8), jnp.int32),
                        S((16, 32, 2), jnp.uint8), S((16, 32, 8), jnp.int32), S((16, 32, 2), jnp.uint8)), {"S": 8}),
    ("gemv_split_r2", (S((2, 200), jnp.bfloat16), S((24, 200), jnp.bfloat16)), {"S": 3}),
    ("moe_down_t1", (S((4, 32), jnp.bfloat16), S((4,), jnp.int32), S((4, 1), jnp.int32), S((4,), jnp.float32),
                     S((16, 64, 4), jnp.int32), S((16, 64, 1), jnp.uint8)), None),
])
def test_kernel_lowers_and_exports_for_cuda(name, avals, dims):
    text = _export(lambda *a: loader.call(name, *a, dims=dims), *avals)
    assert _calls(text, name)


@pytest.mark.parametrize("rows,n,k", [(1, 1536, 7168), (1, 24, 64), (2, 200, 1024), (2, 7168, 1024),
                                      (3, 100, 1024), (4, 7168, 1024), (5, 4097, 1032), (8, 7168, 1024)])
def test_every_gemv_kernel_exports_through_linear(rows, n, k):
    """cute_bridge.ops.linear lowers every GEMV kernel it can pick (`gemv_kernel`) for CUDA."""
    from cute_bridge import ops as cute_ops
    name, _, _ = cute_ops.gemv_kernel(rows, n, k)
    assert _calls(_export(lambda x, w: cute_ops.linear(x, w, min_rows=1), S((rows, k), jnp.bfloat16),
                          S((n, k), jnp.bfloat16)), name)


def test_the_gemv_exports_cover_every_gemv_kernel():
    from cute_bridge import ops as cute_ops
    shapes = test_every_gemv_kernel_exports_through_linear.pytestmark[0].args[1]
    picked = {cute_ops.gemv_kernel(*shape)[0] for shape in shapes}
    assert picked == {name for name in BY_NAME if name.startswith("gemv_")}


def _packed_experts(e: int, m: int, inter: int) -> tuple:
    """Avals of MXFP4 expert weights: w1/w3 codes + scales [e, inter, m / 2 | m / 32], w2's [e, m, ...]."""
    return (S((e, inter, m // 2), jnp.uint8), S((e, inter, m // 32), jnp.uint8),
            S((e, m, inter // 2), jnp.uint8), S((e, m, inter // 32), jnp.uint8))


def _experts(z, ids, w, p13, q13, p2, q2, block_rows=64, tiled=False):
    """cute_bridge.ops.moe_experts with w1 = w3 (their codes play no part in which kernel runs)."""
    from cute_bridge import ops as cute_ops
    ew = ops.ExpertWeights(p13, p13, p2, q13, q13, q2, tiled=tiled)
    return cute_ops.moe_experts(z, ids, w, ew, act="situ", beta=4.0, linear_beta=25.0, block_rows=block_rows)


def test_registered_ops_export_at_k3_decode_shapes():
    from cute_bridge import ops as cute_ops
    from k3jax.presets import get_preset
    cfg = get_preset("k3-h200")
    d, m, inter, e, k = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, \
        cfg.num_experts, cfg.num_experts_per_token
    one_row = functools.partial(cute_ops.linear, min_rows=1)      # one row: the kernel, not XLA's GEMV
    assert _calls(_export(one_row, S((1, 1, d), jnp.bfloat16), S((12288, d), jnp.bfloat16)), "gemv_r1")
    assert "k3cute" not in _export(cute_ops.linear, S((1, 1, d), jnp.bfloat16), S((12288, d), jnp.bfloat16))

    packed = _packed_experts(e, m, inter)
    for n, tokens in ((1, 1), (8, 8), (20, 8), (256, 8)):   # one token; up to 8 token columns; grouped
        text = _export(_experts, S((n, m), jnp.bfloat16), S((n, k), jnp.int32), S((n, k), jnp.float32), *packed)
        rows64 = (f"moe_gate_up_t{tokens}_rows64", f"moe_down_t{tokens}_rows64")
        rows16 = (f"moe_gate_up_t{tokens}", f"moe_down_t{tokens}")
        assert _calls(text, *rows64) and not any(_calls(text, name) for name in rows16)
        one_tile = functools.partial(_experts, block_rows=16)    # one MMA row tile per block
        text = _export(one_tile, S((n, m), jnp.bfloat16), S((n, k), jnp.int32), S((n, k), jnp.float32), *packed)
        assert _calls(text, *rows16) and not any(_calls(text, name) for name in rows64)
        in_tiles = functools.partial(_experts, tiled=True)      # experts stored in tiles: the _tiles kernels
        text = _export(in_tiles, S((n, m), jnp.bfloat16), S((n, k), jnp.int32), S((n, k), jnp.float32), *packed)
        assert _calls(text, *(f"{name}_tiles" for name in rows64)) and not any(_calls(text, n) for n in rows64)
    with pytest.raises(ValueError, match="block_rows=16: experts stored in tiles run 64-row blocks"):
        _export(functools.partial(_experts, block_rows=16, tiled=True), S((1, m), jnp.bfloat16),
                S((1, k), jnp.int32), S((1, k), jnp.float32), *packed)
    # One row runs the SIMT kernel down to 1024 outputs; narrower matrices and more rows run the
    # MMA kernels, splitting K (float32 partials summed by XLA) when the row tiles cannot fill the GPU.
    assert _calls(_export(one_row, S((1, d), jnp.bfloat16), S((576, d), jnp.bfloat16)), "gemv_split_r1")
    assert _calls(_export(cute_ops.linear, S((8, d), jnp.bfloat16), S((1536, d), jnp.bfloat16)), "gemv_split_r8")
    assert _calls(_export(cute_ops.linear, S((5, d), jnp.bfloat16), S((12288, d), jnp.bfloat16)), "gemv_r8")


@pytest.mark.parametrize("m,inter", [(256, 96), (192, 128), (256, 192)])
def test_moe_block_rows_are_compiled_ones_and_fall_back_to_one_tile(m, inter):
    """block_rows must name compiled kernels; shapes the 64-row kernels do not take (M and I
    multiples of 128: 64 rows, and 4 scale groups per chunk) run 16-row blocks."""
    e, k = 8, 2
    args = (S((1, m), jnp.bfloat16), S((1, k), jnp.int32), S((1, k), jnp.float32), *_packed_experts(e, m, inter))
    text = _export(_experts, *args)
    assert _calls(text, "moe_gate_up_t1", "moe_down_t1")
    assert not _calls(text, "moe_gate_up_t1_rows64") and not _calls(text, "moe_down_t1_rows64")
    with pytest.raises(ValueError, match=r"block_rows=24: compiled MoE kernels take \(16, 64\)"):
        _export(functools.partial(_experts, block_rows=24), *args)


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


def test_build_without_the_cute_dsl_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    import sys

    from cute_bridge import build
    monkeypatch.setitem(sys.modules, "nvidia_cutlass_dsl", None)      # import fails as when not installed
    assert build.main(["--force", "--out", str(tmp_path)]) == 2
    assert "`bash scripts/setup.sh cute` installs it" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_stale_library_is_refused(library, monkeypatch):
    monkeypatch.setattr(loader, "_library", None)
    monkeypatch.setenv("K3JAX_CUTE_LIB", str(library))
    monkeypatch.setattr(loader, "kernel_set_hash", lambda: "0" * 16)
    with pytest.raises(loader.CuteBridgeError, match="was built for kernel set"):
        loader.load()


def test_kernel_set_hash_covers_the_inlined_decode(monkeypatch):
    """The kernels inline k3jax.mxfp4's decode PTX, which lives outside cute_bridge/: changing it
    changes the kernel-set hash, so a library built before is refused, not silently stale."""
    from k3jax import mxfp4
    before, emit = kernel_set_hash(), mxfp4.decode_word_ptx
    monkeypatch.setattr(mxfp4, "decode_word_ptx", lambda tiled: emit(tiled) + ("\n\t// changed" if tiled else ""))
    assert kernel_set_hash() != before


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


def _run_decode_ptx(ptx: str, regs: dict) -> dict:
    """A numpy model of the decode's PTX (the ops it uses), on uint32 arrays."""
    import ml_dtypes
    bf16x2 = lambda v: np.stack([v & 0xFFFF, v >> 16], -1).astype(np.uint16).view(ml_dtypes.bfloat16)
    for line in ptx.replace("\t", "").split("\n"):
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(" ", 1)
        dst, *src = [a.strip() for a in args.split(",")]
        val = [regs[a] if a in regs else np.uint32(int(a, 0)) for a in src]
        if op == "fma.rn.bf16x2":      # exact here: products of E2M1 values and powers of two
            f = (bf16x2(val[0]).astype(np.float64) * bf16x2(val[1]).astype(np.float64)
                 + bf16x2(val[2]).astype(np.float64)).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
            regs[dst] = f[..., 0] | (f[..., 1] << 16)
        else:
            regs[dst] = {"mov.b32": lambda: val[0] + np.zeros_like(regs["$4"]), "shr.u32": lambda: val[0] >> val[1],
                         "shl.b32": lambda: val[0] << val[1], "and.b32": lambda: val[0] & val[1],
                         "mul.lo.u32": lambda: (val[0].astype(np.uint64) * val[1]).astype(np.uint32)}[op]()
    return regs


def test_permute_x_is_the_decode_pair_order():
    """permute_x puts columns 8j + a and 8j + a + 4 side by side, in pair order a = 0..3."""
    from cute_bridge.ops import permute_x
    cols = np.asarray(permute_x(jnp.arange(24)[None]))[0]
    np.testing.assert_array_equal(cols.reshape(3, 4, 2), [[[8 * j + a, 8 * j + a + 4] for a in range(4)] for j in range(3)])


def test_k_splits():
    from cute_bridge.ops import GEMV_TILE, SPLIT_MAX_TILES, k_splits
    assert k_splits(GEMV_TILE * SPLIT_MAX_TILES, 7168) == 1 and k_splits(12288, 128) == 1
    assert k_splits(GEMV_TILE * (SPLIT_MAX_TILES - 1), 7168) == 3 and k_splits(3584, 7168) == 3
    assert k_splits(1536, 7168) == 6 and k_splits(128, 7168) == 7168 // 32 // 16    # capped: 16 chunks each


def _emulated_moe_kernel(name, *args, dims=None):
    """A jnp model of the MoE kernels' contract (kernels/mxfp4_moe.py): for every named slot of grid
    row u, the expert's product on that token column's activation row, each word's code pairs (row
    order: nibbles a, a + 4; tile words: columns 2a, 2a + 1) meeting consecutive activation
    columns; unnamed outputs stay NaN."""
    from cute_bridge.ops import permute_x
    from k3jax import mxfp4
    x, experts, slots, *rest = args
    weights, rest = (rest[0], rest[1:]) if name.startswith("moe_down") else (None, rest)
    pairs = [(jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(*w.shape[:2], -1), s) for w, s in zip(rest[::2], rest[1::2])]
    tiled = name.endswith("_tiles")   # tile words pair columns 2a, 2a + 1: x comes in column order
    if tiled:
        pairs = [(mxfp4.from_tiles(w), mxfp4.from_tiles(s, scales=True)) for w, s in pairs]
    mats = [mxfp4.dequantize(w, s, jnp.float32) for w, s in pairs]
    mats = mats if tiled else [permute_x(m) for m in mats]
    s_n = dims["S"] if dims else x.shape[0]
    per_token = s_n // x.shape[0]                              # gate_up: x rows are tokens; down: slots
    named = (slots >= 0) & (experts[:, None] < mats[0].shape[0])                         # [U, T]
    rows = x[jnp.maximum(slots, 0) // (1 if weights is not None else per_token)]         # [U, T, in]
    rows = rows.astype(jnp.float32)
    target = jnp.where(named, slots, s_n)                      # unnamed: out of range, dropped
    outs = []
    for m in mats:
        y = jnp.einsum("uoi,uti->uto", m[jnp.minimum(experts, m.shape[0] - 1)], rows)
        y = y.astype(x.dtype).astype(jnp.float32)
        if weights is not None:
            y = weights[jnp.maximum(slots, 0)][..., None] * y
        out = jnp.full((s_n, m.shape[1]), jnp.nan, jnp.float32).at[target].set(y, mode="drop")
        outs.append(out if weights is not None else out.astype(x.dtype))
    return tuple(outs)


@pytest.mark.parametrize("ids", [
    [[5, 1, 7, 2]],                                   # one token: the T = 1 kernels
    [[5, 1, 7, 2], [1, 5, 0, 3], [2, 2, 6, 5]],       # shared experts and a repeated id in one token
    [[4, 4, 4, 4]] * 3,                               # every token and slot on one expert
    [[(3 * n + j) % 8 for j in range(4)] for n in range(11)],   # 11 tokens: grouped (ops.expert_groups)
    [[4, n % 3, 5 + n % 3, 8 if n == 2 else 3] for n in range(12)],  # grouped: experts 3, 4 in 2 rows; an id E
])
@pytest.mark.parametrize("tiled", [False, True])
def test_moe_grouping_matches_the_reference(monkeypatch, ids, tiled):
    """expert_slots + the kernels' contract (emulated) + the XLA combine give ops.moe_experts,
    including repeated ids (up to 8 tokens combined once with their summed weight; past 8 each
    in its own column) and more than 8 tokens (grouped: an expert with more than 8 choices in
    several grid rows; also in calls of 5 tokens)."""
    from cute_bridge import ops as cute_ops
    from k3jax import mxfp4
    monkeypatch.setattr(cute_ops, "_runnable", lambda: None)
    monkeypatch.setattr(loader, "call", _emulated_moe_kernel)
    ids = jnp.asarray(ids, jnp.int32)
    n, e, m, inter = (ids.shape[0], 8, 128, 128) if tiled else (ids.shape[0], 8, 64, 32)
    ks = jax.random.split(jax.random.key(n), 6)
    (p1, s1), (p3, s3) = (mxfp4.random_packed(kk, (e, inter, m)) for kk in ks[:2])
    p2, s2 = mxfp4.random_packed(ks[2], (e, m, inter))
    experts = ops.ExpertWeights(p1, p3, p2, s1, s3, s2)
    w = jax.nn.softmax(jax.random.normal(ks[3], ids.shape), -1)
    z = jax.random.normal(ks[4], (n, m), jnp.bfloat16)
    kw = dict(act="situ", beta=4.0, linear_beta=25.0)
    out = np.asarray(cute_ops.moe_experts(z, ids, w, experts.in_tiles() if tiled else experts, **kw), np.float32)
    ref = np.asarray(ops.moe_experts(z, ids, w, experts, **kw), np.float32)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    if n > 8:
        monkeypatch.setattr(ops, "GROUPED_MAX_TOKENS", 5)
        calls = cute_ops.moe_experts(z, ids, w, experts.in_tiles() if tiled else experts, **kw)
        np.testing.assert_allclose(np.asarray(calls, np.float32), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def test_expert_slots_name_every_kept_slot_once():
    from cute_bridge.ops import expert_slots
    ids = jnp.asarray([[3, 1, 3, 7], [1, 2, 9, 0]], jnp.int32)        # a repeat, and an id past E = 8
    weights = jnp.asarray([[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.125, 0.125]], jnp.float32)
    experts, slots, kept, coef = expert_slots(ids, weights, 8, 8)
    np.testing.assert_array_equal(np.asarray(experts), [0, 1, 2, 3, 7, 8, 8, 8])
    np.testing.assert_array_equal(np.asarray(kept), [[False, True, True, True], [True, True, False, True]])
    np.testing.assert_allclose(np.asarray(coef), [[0, 0.2, 0.4, 0.4], [0.5, 0.25, 0, 0.125]])   # 3: 0.1 + 0.3
    one = expert_slots(ids[:1], weights[:1], 8, 1)      # one token: its k ids, each in its own slot, T = 1
    np.testing.assert_array_equal(np.asarray(one[0]), [3, 1, 3, 7])
    np.testing.assert_array_equal(np.asarray(one[1]), [[0], [1], [2], [3]])
    np.testing.assert_array_equal(np.asarray(one[2]), [[True, True, True, True]])
    assert np.asarray(expert_slots(ids[1:], weights[1:], 8, 1)[2]).tolist() == [[True, True, False, True]]   # 9 >= E
    with pytest.raises(ValueError, match="2 tokens do not fit the kernels' 1 token columns"):
        expert_slots(ids, weights, 8, 1)
    named = np.asarray(slots)[np.asarray(slots) >= 0]
    np.testing.assert_array_equal(np.sort(named), np.flatnonzero(np.asarray(kept).reshape(-1)))


def test_library_is_built_for_the_target_arch(library):
    """Every kernel image is for ARCH (sm_90a), even when cutlass was imported before the build (as
    here: the fixture imports it first), which once produced sm_100a images the H200 cannot load."""
    import re
    from cute_bridge.kernel_set import ARCH
    arches = set(re.findall(rb"sm_[0-9]+a?", library.read_bytes()))
    assert arches == {ARCH.encode()}, arches


def test_kernels_keep_their_occupancy(library):
    """No kernel spills to local memory, and the 64-row MoE kernels stay at <= 96 registers: five
    128-thread blocks per SM (104 leaves four; session 13 measured the step from 112 to 96 at
    batch 8: -4.5%). Read from the cubins the build records in manifest.json."""
    import json
    from cute_bridge import build
    out_dir = library.parent / kernel_set_hash()
    recorded = json.loads((out_dir / "manifest.json").read_text())["resources"]
    assert set(recorded) == {s.name for s in KERNELS}
    for spec in KERNELS:
        res = build.kernel_resources(out_dir / f"{spec.name}.o")
        assert res == recorded[spec.name] and res["frame_bytes"] == 0, (spec.name, res)
        if spec.smem_carveout is not None:
            assert res["registers"] <= 96, (spec.name, res)


def test_tiled_experts_are_read_into_the_row_order_slot_image():
    """The `_tiles` kernels' addressing (tile_code_offset / tile_scale_offset, what the kernels
    emit) reads from a 64-row tile in mxfp4.to_tiles' order exactly the bytes the row-order kernels
    stage in a ring slot from the same codes as tile words (mxfp4.tile_words): lane (g, q)'s 16
    code bytes of row g + 8 i in chunk c, and the chunk's scale image (row r's four groups at
    4 r .. 4 r + 3)."""
    from cute_bridge.kernels import mxfp4_moe as k
    from k3jax import mxfp4
    rng = np.random.default_rng(1)
    chunks = 3
    codes = rng.integers(0, 256, (64, chunks * 64), np.uint8)       # one 64-row tile, 3 chunks of 128 inputs
    scales = rng.integers(0, 256, (64, chunks * 4), np.uint8)
    tiled_codes = np.asarray(mxfp4.to_tiles(codes)).reshape(-1)
    tiled_scales = np.asarray(mxfp4.to_tiles(scales, scales=True)).reshape(-1)
    paired = mxfp4.tile_words(codes)
    for c in range(chunks):
        for lane in range(32):
            g, q = divmod(lane, 4)
            for i in range(8):
                at = k.tile_code_offset(lane, i, c)
                np.testing.assert_array_equal(tiled_codes[at:at + 16], paired[g + 8 * i, (4 * c + q) * 16:][:16])
            at = k.tile_scale_offset(lane, c)
            image = [scales[p // 4, 4 * c + p % 4] for p in range(lane * 8, lane * 8 + 8)]
            np.testing.assert_array_equal(tiled_scales[at:at + 8], image)
