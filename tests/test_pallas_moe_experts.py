"""The Pallas (Mosaic GPU) routed-expert kernels (MXFP4 and bf16 experts) against
k3jax.ops.moe_experts: CPU interpret mode with race detection and NaN-poisoned memory, a bit-exact
numpy model of the compiled MXFP4 path's PTX word decode and register placement, CUDA lowering
export of the K3 and Kimi-Linear shapes on CPU, and the real kernel on a GPU. Interpret mode is
slow (~10 s per MXFP4 kernel call, ~2 s bf16), so the CPU sweep keeps the cheapest cases;
`python -m k3jax.validate --op moe_experts` runs all of them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import mxfp4, ops, validate
from pallas_kernels import mgpu, registry
from pallas_kernels import moe_experts as me

SPEC = registry.spec("moe_experts")
SMALL = SPEC.sweep("small")
K3 = SPEC.sweep("k3")
CPU_CASES = [c for c in SMALL if c.name.startswith(("n1_", "n2_", "grouped_", "bf16_grouped_", "fallback", "bf16_n1_", "bf16_n3_",
                                                    "bf16_silu", "tiles_", "mixed_"))]


def _fma_bf16x2(x, s):
    """fma.rn.bf16x2 x, s, -0: per 16-bit half, bf16 x * s (exact here: powers of two; subnormal
    x are kept, as PTX's bf16 fma has no flush-to-zero)."""
    halves = []
    for sh in (0, 16):
        f = lambda v: ((v >> np.uint64(sh)) & np.uint64(0xFFFF)).astype(np.uint32) << 16
        with np.errstate(over="ignore"):
            prod = f(x).view(np.float32) * f(s).view(np.float32)
        halves.append(prod.astype(jnp.bfloat16).view(np.uint16).astype(np.uint64) << np.uint64(sh))
    return halves[0] | halves[1]


def _run_program(word, scale, tiled: bool):
    """mxfp4.DECODE_PROGRAMS (tiled: "tiles", else "rows") interpreted on uint64-held 32-bit
    values -> p0..p3."""
    env = {"w": word.astype(np.uint64), "s": scale.astype(np.uint64)}
    val = lambda a: np.uint64(a) if isinstance(a, int) else env[a]
    for op, dst, *src in mxfp4.DECODE_PROGRAMS["tiles" if tiled else "rows"]:
        a = [val(x) for x in src]
        env[dst] = {"and": lambda: a[0] & a[1], "shr": lambda: a[0] >> a[1], "shl": lambda: a[0] << a[1],
                    "mul": lambda: a[0] * a[1], "fma": lambda: _fma_bf16x2(a[0], a[1])}[op]()
        env[dst] &= np.uint64(0xFFFFFFFF)
    return [env[f"p{i}"] for i in range(4)]


def _compiled_decode_model(packed, scale, tiled: bool):
    """One scale block as the compiled kernel decodes it: packed [64, 256] uint8 (tiled: tile
    words, mxfp4.tile_words, in row order), scales [64, 16]
    -> [64, 512] bf16 weights in wgmma K-tile order. The block is SCALE_STEPS pipeline steps; step t gets
    the codes [:, t * MX_STEP/2 ...] and the scales [:, t * MX_STEP/32 ...] (me._dequant_mma), decoded
    through the thread -> (row, group, register) map of me._decode_quad (WGMMA layout: register
    (j, r) of lane l holds columns 8j + 2(l%4) + {0,1})."""
    out = np.zeros((64, 512), np.uint16)
    rows = np.arange(64)
    for t in range(me.SCALE_STEPS):
        words = np.ascontiguousarray(packed[:, t * me.MX_STEP // 2:(t + 1) * me.MX_STEP // 2]).view("<u4")
        words = words.astype(np.uint64)
        step_scale = scale[:, t * me.MX_STEP // 32:(t + 1) * me.MX_STEP // 32]
        for quad in range(me.QUADS):
            for q in range(4):
                group = 4 * quad + q
                sc = (step_scale[:, group].astype(np.uint64) + np.uint64(me.SCALE_BIAS)) * np.uint64(0x00800080)
                for k in range(4):
                    pairs = _run_program(words[:, 4 * group + k], sc, tiled)
                    for a, p in enumerate(pairs):
                        col = t * me.MX_STEP + 64 * (2 * quad + k // 2) + 8 * (4 * (k % 2) + a) + 2 * q
                        out[rows, col] = p & 0xFFFF
                        out[rows, col + 1] = p >> np.uint64(16)
    return out.view(jnp.bfloat16)


def _decode_mismatches(scale_code: int, tiled: bool = False) -> int:
    """Elements where the compiled-decode model differs from permute_k(mxfp4.dequantize) (as
    numbers; zeros by sign bit too), over every code in every byte position at one scale code.
    tiled: the decode reads the codes as tile words (mxfp4.tile_words: experts in tiles; that the
    tile image puts those bytes where the row image has them: the next test)."""
    codes = np.arange(256, dtype=np.uint8)
    packed = np.stack([np.roll(codes, 7 * r) for r in range(64)])                 # [64, 256]
    scale = np.full((64, 16), scale_code, np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        got = _compiled_decode_model(mxfp4.tile_words(packed) if tiled else packed, scale, tiled).astype(np.float64)
    want = np.asarray(me.permute_k(mxfp4.dequantize(jnp.asarray(packed), jnp.asarray(scale)), tiled)).astype(np.float64)
    return int(((got != want) | (np.signbit(got) != np.signbit(want))).sum())


@pytest.mark.parametrize("tiled", [False, True])
def test_compiled_decode_model_is_exact(tiled):
    """Every code in every byte position, the scale codes the tests and K3 use and both ends of
    EXACT_SCALES: the PTX program + register placement equals mxfp4.dequantize followed by
    permute_k, bit for bit (signed zeros included), for codes in row order and as tile words."""
    lo, hi = me.EXACT_SCALES
    for code in [*range(100, hi + 1), lo, lo + 1, 64]:
        assert _decode_mismatches(code, tiled) == 0, code


def test_tiled_step_is_decoded_from_the_same_bytes():
    """The compiled decode's SMEM addressing (me.quad_addressing, the offsets _decode_quad emits)
    reads, from a step's image in tile order ([4 chunks, 64 rows, 64 B], scales [4, 256]), the
    bytes it reads from the row-order image ([64, 256], [64, 16]) of the same codes as tile words
    (mxfp4.tile_words) for every row, quad and group."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (64, me.MX_STEP // 2), np.uint8)
    scales = rng.integers(0, 256, (64, me.MX_STEP // 32), np.uint8)
    words = mxfp4.tile_words(codes)
    images = {"rows": (words.reshape(-1), scales.reshape(-1), (256, 1), (16, 1)),
              "tiles": (np.asarray(mxfp4.to_tiles(codes)).reshape(-1),
                        np.asarray(mxfp4.to_tiles(scales, scales=True)).reshape(-1), (4096, 64, 1), (256, 1))}
    for quad in range(me.QUADS):
        read = {}
        for name, (c, sc, w_strides, s_strides) in images.items():
            at = me.quad_addressing(w_strides, s_strides, quad)
            read[name] = [(c[at["code_base"] + r * at["code_row"] + (at["group0"] + q) * 16:][:16].tobytes(),
                           sc[at["scale_base"] + r * at["scale_row"] + at["group0"] + q])
                          for r in range(64) for q in range(4)]
        assert read["rows"] == read["tiles"]
        assert read["rows"][5 * 4 + 2] == (words[5, (4 * quad + 2) * 16:][:16].tobytes(),
                                           scales[5, 4 * quad + 2])


def test_exact_scale_range_is_tight():
    """Just outside EXACT_SCALES the decode is not exact (the range the docs state is the real one)."""
    lo, hi = me.EXACT_SCALES
    assert _decode_mismatches(lo - 1) > 0 and _decode_mismatches(hi + 1) > 0


def test_permute_k_is_a_permutation_per_128_columns():
    x = jnp.arange(2 * 256).reshape(2, 256)
    y = np.asarray(me.permute_k(x))
    assert sorted(y[0]) == list(range(256)) and (y[0, :128] < 128).all() and (y[1] - y[0] == 256).all()
    # Column 32q + 8k + a + 4n lands at 32k + 8a + 2q + n; in tiles column 32q + 8k + 2a + n does.
    assert y[0, 32 * 2 + 8 * 3 + 2 * 1 + 1] == 32 * 1 + 8 * 2 + 3 + 4 * 1
    t = np.asarray(me.permute_k(x, tiled=True))
    assert sorted(t[0]) == list(range(256)) and t[0, 32 * 2 + 8 * 3 + 2 * 1 + 1] == 32 * 1 + 8 * 2 + 2 * 3 + 1


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_moe_experts_matches_reference_interpret(case):
    r = validate.check_case(SPEC, "pallas", me.moe_experts, case, seed=3, repeats=1)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
    if r.kernel_ran:
        assert r.races is False


@pytest.mark.parametrize("fmt,d", [("mxfp4", 512), ("bf16", 128)])
def test_padded_expert_slots_are_skipped_and_zero(fmt, d):
    """Two tokens choosing the same experts: 2 distinct of 4 slots, the padded slots read nothing
    and contribute nothing (their h rows are written as zeros, not left poisoned)."""
    z, _, _, experts = me._make(2, d, d, 8, 2, fmt)(jax.random.key(1))
    ids = jnp.array([[5, 2], [2, 5]], jnp.int32)
    w = jnp.array([[0.7, 0.3], [0.4, 0.6]], jnp.float32)
    _assert_race_free_and_matches(z, ids, w, experts)


def _assert_race_free_and_matches(z, ids, w, experts):
    act = dict(me.ACT)
    with mgpu.race_detection():
        out = jax.jit(lambda *a: me.moe_experts(*a, **act))(z, ids, w, experts)
        assert not mgpu.races_found()
    ref = ops.moe_experts(z, ids, w, experts, **act)
    assert registry.relative_max_error(out, ref) <= registry.TOLERANCE["bfloat16"]


def test_grouped_schedule_in_calls_with_full_slots(monkeypatch):
    """The grouped schedule past ops.GROUPED_MAX_TOKENS (two calls of 35 rows here, one padding
    row), slots of 8 (me.SLOT_TOKENS) with ~9 choices per expert (experts in two slots) and a
    choice of another shard's expert (id E: no slot, no contribution); bf16 experts (cheaper in
    interpret mode, same dispatch)."""
    monkeypatch.setattr(ops, "GROUPED_MAX_TOKENS", 40)
    z, ids, w, experts = me._make(69, 128, 256, 8, 2, "bf16")(jax.random.key(4))
    _assert_race_free_and_matches(z, ids.at[5, 1].set(8), w, experts)


@pytest.mark.parametrize("fmt,d", [("mxfp4", 512), ("bf16", 128)])
def test_one_token_scalar_coefficients_and_foreign_id(fmt, d):
    """One token: each slot's coefficient is its routing weight, read by the kernel as a scalar
    (no padded coefficient matrix); a choice of another shard's expert (id E) is a skipped slot
    whose weight is never applied."""
    z, ids, w, experts = me._make(1, d, d, 8, 3, fmt)(jax.random.key(6))
    _assert_race_free_and_matches(z, ids.at[0, 1].set(8), w, experts)


def test_mixed_schedule_repeated_and_foreign_ids():
    """The row schedule with its down kernel grouped (GROUPED_DOWN_FROM): a token naming one expert
    twice (its summed coefficient counted once) and an id of another shard's expert (id E)."""
    n = me.GROUPED_DOWN_FROM[True]
    assert n < me.GROUPED_FROM[True]
    z, ids, w, experts = me._make(n, 512, 512, 8, 3)(jax.random.key(3))
    _assert_race_free_and_matches(z, ids.at[3, 2].set(ids[3, 0]).at[5, 1].set(8), w, experts)


def test_coverage_and_split_plan():
    z, ids, w, experts = me._make(2, 512, 512, 4, 2)(jax.random.key(0))
    assert me.covers(z, experts)
    assert "float32" in me.unsupported(z.astype(jnp.float32), experts)
    assert me.covers(jnp.zeros((300, 512), jnp.bfloat16), experts)     # grouped, as two calls
    assert "no tokens" in me.unsupported(jnp.zeros((0, 512), jnp.bfloat16), experts)
    for n in (1, 8, 32, 64):
        slots = min(448, n * 16)
        s = me.down_splits(3584 // 64, 3072, slots, max(8, n), mgpu.H200_SMS)
        assert slots % s == 0
        assert me._stages(max(8, -(-n // 8) * 8), 2) >= 1
    # Batch 1: three programs per SM (the measured optimum), gate/up 1 stage and down 2.
    assert me._stages(8, 2) == 1 and me._stages(8, 1) == 2


def test_bf16_coverage_and_stages():
    z, ids, w, experts = me._make(2, 128, 256, 4, 2, "bf16")(jax.random.key(0))
    assert me.covers(z, experts)
    f32 = ops.ExpertWeights(*(x.astype(jnp.float32) for x in (experts.w1, experts.w3, experts.w2)))
    assert "float32" in me.unsupported(z, f32)
    assert "multiple of 128" in me.unsupported(z[:, :96], experts)
    # >= 2 stages (TMA overlaps the wgmma) up to 64 tokens; 3 (gate/up) and 4 (down) at batch 1-8.
    for n in (8, 16, 32, 64):
        assert 2 <= me._stages(n, 2, False) and 3 <= me._stages(n, 1, False)
    assert me._stages(8, 2, False) == 3 and me._stages(8, 1, False) == 4


def _cuda_module(experts, n, m, k, act) -> str:
    """The CUDA export (lowered on this CPU machine) of moe_experts for n tokens: its MLIR text."""
    s = jax.ShapeDtypeStruct
    fn = jax.jit(lambda z, ids, w, x: me.moe_experts(z, ids, w, x, **dict(act)))
    with mgpu.compile_for_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            s((n, m), jnp.bfloat16), s((n, k), jnp.int32), s((n, k), jnp.float32), experts)
    return exported.mlir_module()


def _export_has_kernels(experts, n, m, k, act) -> bool:
    module = _cuda_module(experts, n, m, k, act)     # named kernels: profiles attribute time per kernel
    return "moe_gate_up_mosaic_gpu" in module and "moe_down_mosaic_gpu" in module


def _k3_mxfp4_shapes(e: int, tiled: bool) -> ops.ExpertWeights:
    """Shape-only MXFP4 experts at K3's M and I (E experts) for the CUDA exports."""
    m, i = me.K3_M, me.K3_I
    s = jax.ShapeDtypeStruct
    return ops.ExpertWeights(s((e, i, m // 2), jnp.uint8), s((e, i, m // 2), jnp.uint8), s((e, m, i // 2), jnp.uint8),
                             s((e, i, m // 32), jnp.uint8), s((e, i, m // 32), jnp.uint8), s((e, m, i // 32), jnp.uint8),
                             tiled=tiled)


@pytest.mark.parametrize("n,e,tiled", [(1, 448, False), (8, 896, False), (64, 448, False), (1, 448, True), (8, 448, True),
                                         (32, 448, True), (256, 448, True), (128, 896, False)])
def test_moe_experts_cuda_export(n, e, tiled):
    """Lowers the real (compiled) kernels for CUDA at K3 shapes on this CPU machine (experts in
    row order or in tiles)."""
    assert _export_has_kernels(_k3_mxfp4_shapes(e, tiled), n, me.K3_M, me.K3_K, me.ACT)


def test_mma_sync_is_what_runs_up_to_eight_tokens(monkeypatch):
    """The compiled kernels for MXFP4 experts in tiles multiply by mma.sync up to MMA_SYNC_MAX_TOKENS
    (batch 1 here) and by wgmma with it at 0 (the ablation) or for experts in row order: the
    exported kernels carry that instruction (and lowering checks the activations' SMEM tiling
    `_mma_sync_step` addresses). By mma.sync z goes in unpadded (the TMA zero-fills the rows to 8)."""
    experts = _k3_mxfp4_shapes(32, tiled=True)
    module = _cuda_module(experts, 1, me.K3_M, me.K3_K, me.ACT)
    assert "mma.sync.aligned.m16n8k16" in module and "wgmma.mma_async" not in module
    assert "stablehlo.pad" not in module
    module = _cuda_module(dataclasses.replace(experts, tiled=False), 1, me.K3_M, me.K3_K, me.ACT)
    assert "mma.sync.aligned.m16n8k16" not in module and "wgmma.mma_async" in module
    monkeypatch.setattr(me, "MMA_SYNC_MAX_TOKENS", 0)
    module = _cuda_module(experts, 1, me.K3_M, me.K3_K, me.ACT)
    assert "mma.sync.aligned.m16n8k16" not in module and "wgmma.mma_async" in module


@pytest.mark.parametrize("n,shape,act", [(1, me.KL_SHAPE, me.KL_ACT), (32, me.KL_SHAPE, me.KL_ACT),
                                         (8, (me.K3_M, me.K3_I, 448, me.K3_K), me.ACT)],
                         ids=["kimi_linear_b1", "kimi_linear_b32", "k3_bf16_b8"])
def test_moe_experts_bf16_cuda_export(n, shape, act):
    """bf16 experts: the compiled kernels (TMA of bf16 weight tiles, SMEM wgmma) lower for CUDA."""
    m, i, e, k = shape
    s = jax.ShapeDtypeStruct
    experts = ops.ExpertWeights(s((e, i, m), jnp.bfloat16), s((e, i, m), jnp.bfloat16), s((e, m, i), jnp.bfloat16))
    assert me.covers(s((n, m), jnp.bfloat16), experts)
    assert _export_has_kernels(experts, n, m, k, act)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SMALL + K3, ids=lambda c: c.name)
def test_moe_experts_gpu(case):
    if case.name == "fallback_m96":     # docs/pallas.md, Known issues
        pytest.skip("XLA:GPU (jax 0.11.2) aborts compiling the MXFP4 reference at M = 96 "
                    "(triton_tiling_propagation.cc:703 check failure)")
    r = validate.check_case(SPEC, "pallas", me.moe_experts, case, seed=5)
    assert r.passed, r
    assert r.kernel_ran != case.name.startswith("fallback"), r.fallbacks
