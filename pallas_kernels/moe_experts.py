"""MXFP4 W4A16 routed experts at decode: y = sum_k w[n,k] * down(glu(gate(z), up(z))) of the selected experts.

z [N, M] bf16 (1-64 tokens), ids/weights [N, k], experts in the compressed-tensors MXFP4 layout
(packed uint8 [E, out, in/2], scales uint8 [E, out, in/32]; see k3jax.mxfp4). Same contract and
dispatch as k3jax.ops.moe_experts' decode schedule: the distinct selected experts (static bound
U = min(E, N*k), padded with E) run on every token, and a [U, N] coefficient matrix
(ops.expert_dispatch) combines them - no sort, no scatter.

Two Mosaic GPU kernels, both bandwidth-bound on the packed weights; every selected expert's
bytes are read exactly once per call, padded expert slots read nothing:
  * gate/up: grid (I/64, U). A program streams 64 rows of w1 and w3 of its expert (TMA,
    2-stage `emit_pipeline`, 512 input columns = 256 packed bytes + 16 scale bytes per row per
    step) and dequantises them in registers: each 16-byte group (one scale) is decoded with
    mxfp4.code_values (the reference's arithmetic, no table) into the low nibbles (even columns)
    and high nibbles (odd columns), staged as bf16 [64, 64] swizzled SMEM tiles and multiplied
    by wgmma (swap-AB: weights on the M side, tokens padded to 8 on N) against z's even and odd
    columns. The epilogue applies ops.glu (the same jnp formula, on registers, float32) and the
    token's routing coefficient, and writes h [U, I, Np] bf16.
  * down: grid (M/64, S). A program owns 64 output features and U/S experts; for each valid
    expert it streams w2 the same way against h (reordered to even/odd columns by a tiny XLA
    transpose) and accumulates sum_u coef * h_u @ w2_u.T in one float32 wgmma accumulator, so
    the combine is fused. S splits the experts so the grid fills the 132 SMs (as in linear.py);
    a small XLA epilogue sums the S float32 partials, transposes and casts.
Bytes at K3 shapes (M 3584, I 3072): 16.5 MB packed + 0.5 MB scales per expert; batch 1 reads
16 experts (~280 MB, ~65 us at 4.3 TB/s); h, partials and z are < 1% of that.

Anything else (bf16 experts, more than 64 tokens, M or I not a multiple of 512, non-bf16 z)
runs the reference; `covers()` says which, and the first fallback per reason is logged.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import mxfp4, ops
from pallas_kernels import mgpu, registry

log = logging.getLogger(__name__)

BLOCK = 64                 # weight rows per program (wgmma M) and bf16 columns per swizzled tile
BLOCK_IN = 512             # unpacked input columns per pipeline step: 256 packed bytes, 16 scale bytes
CHUNKS = BLOCK_IN // 128   # [64, 64] bf16 tiles per step and nibble half
MAX_TOKENS = 64
SMEM_BUDGET = 220 * 1024   # of the H200's 227 KB per block
TILED = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(128))
WGMMA = plgpu.Layout.WGMMA
ROW, COL = WGMMA.reduce(1), WGMMA.reduce(0)   # one value per accumulator row / column
_logged: set[str] = set()


def _lane_params() -> plgpu.CompilerParams:
    # Lane semantics: explicit register layouts for the in-register MXFP4 decode.
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def unsupported(z, ids, experts: ops.ExpertWeights) -> str | None:
    """Why the kernel does not cover this call (None: it does)."""
    n, m = z.shape
    inter = experts.w1.shape[1]
    if not experts.is_mxfp4:
        return "experts are not MXFP4"
    if z.dtype != jnp.bfloat16:
        return f"z is {z.dtype}, the kernel takes bfloat16"
    if not 1 <= n <= MAX_TOKENS:
        return f"{n} tokens (the kernel takes 1-{MAX_TOKENS})"
    if m % BLOCK_IN or inter % BLOCK_IN:
        return f"M={m} or I={inter} not a multiple of {BLOCK_IN}"
    return None


def covers(z, ids, experts) -> bool:
    return unsupported(z, ids, experts) is None


def _stages_and_buffers(n_pad: int) -> tuple[int, int]:
    """(pipeline stages, staging-tile sets) that fit SMEM: double-buffered staging lets the next
    chunk's decode overlap the previous chunk's wgmma."""
    step = 2 * BLOCK * BLOCK_IN // 2 + 2 * BLOCK * BLOCK_IN // 32 + 2 * n_pad * BLOCK_IN // 2 * 2
    tile = 2 * BLOCK * BLOCK * 2          # lo + hi bf16 staging tiles
    for stages, sets in ((2, 2), (2, 1), (1, 1)):
        if stages * step + sets * tile <= SMEM_BUDGET:
            return stages, sets
    raise AssertionError("unreachable: one stage of a 64-token step fits")


def _decode_group(packed, scale):
    """[64, 16] packed bytes, [64] scale codes -> (even, odd) columns [64, 16] bf16 (exact)."""
    p = packed.astype(jnp.int32)
    s = jax.lax.broadcast_in_dim(mxfp4._pow2(scale.astype(jnp.int32)), p.shape, (0,))
    return tuple((mxfp4.code_values(c) * s).astype(jnp.bfloat16) for c in (p & 15, p >> 4))


def _dequant_mma(acc, w_s, s_s, xe_s, xo_s, lo_s, hi_s, sets: int) -> None:
    """acc[64, Np] += dequant(w tile [64, 256 bytes]) @ [xe | xo] tile, staging through SMEM."""
    for c in range(CHUNKS):
        b = c % sets
        if sets == 1 or c >= 2:
            plgpu.wgmma_wait(0 if sets == 1 else 2)   # the staging set about to be rewritten is free
        parts = [_decode_group(plgpu.load(w_s.at[:, pl.ds(c * BLOCK + 16 * g, 16)], layout=WGMMA, optimized=False),
                               plgpu.load(s_s.at[:, c * 4 + g], layout=ROW, optimized=False))
                 for g in range(BLOCK // 16)]
        lo_s[b] = jnp.concatenate([p[0] for p in parts], axis=1)
        hi_s[b] = jnp.concatenate([p[1] for p in parts], axis=1)
        plgpu.commit_smem()
        plgpu.wgmma(acc, lo_s.at[b], xe_s.at[c].T)
        plgpu.wgmma(acc, hi_s.at[b], xo_s.at[c].T)
    plgpu.wgmma_wait(0)


def _half_specs():
    return [plgpu.BlockSpec((BLOCK, BLOCK_IN // 2), lambda k: (0, k)),
            plgpu.BlockSpec((BLOCK, BLOCK_IN // 32), lambda k: (0, k))]


def _x_specs(n_pad: int):
    return [plgpu.BlockSpec((CHUNKS, n_pad, BLOCK), lambda k: (k, 0, 0), transforms=TILED)] * 2


def _split_halves(x: jax.Array) -> jax.Array:
    """x [Np, D] -> [2, D/128, Np, 64]: even then odd columns, 64-column tiles outermost, so a
    pipeline step's tiles are contiguous (wgmma operands cannot be strided views)."""
    n, d = x.shape
    return x.reshape(n, d // 128, BLOCK, 2).transpose(3, 1, 0, 2)


def _gate_up(zs, uniq, coef, w1, s1, w3, s3, *, act, beta, linear_beta):
    """h [U, I, Np] bf16 = coef[u, n] * glu(z w1_u.T, z w3_u.T) for every slot u (0 for padding)."""
    _, _, n_pad, _ = zs.shape
    n_exp, inter, half = w1.shape
    u_n = uniq.shape[0]
    stages, sets = _stages_and_buffers(n_pad)

    def body(zs_g, uniq_g, coef_g, w1_g, s1_g, w3_g, s3_g, h_g):
        oi, ui = jax.lax.axis_index("o"), jax.lax.axis_index("u")
        eid = uniq_g[ui]
        rows = pl.ds(oi * BLOCK, BLOCK)

        def scoped(lo_s, hi_s, o_s):
            @pl.when(eid < n_exp)
            def _compute():
                def accumulate(acc_g, acc_u):
                    def step(_, w1_s, s1_s, w3_s, s3_s, xe_s, xo_s):
                        _dequant_mma(acc_g, w1_s, s1_s, xe_s, xo_s, lo_s, hi_s, sets)
                        _dequant_mma(acc_u, w3_s, s3_s, xe_s, xo_s, lo_s, hi_s, sets)
                    plgpu.emit_pipeline(
                        step, grid=(half * 2 // BLOCK_IN,),
                        in_specs=_half_specs() * 2 + _x_specs(n_pad), max_concurrent_steps=stages,
                    )(w1_g.at[eid, rows], s1_g.at[eid, rows], w3_g.at[eid, rows], s3_g.at[eid, rows],
                      zs_g.at[0], zs_g.at[1])
                    return acc_g[...], acc_u[...]
                gate, up = pl.run_scoped(accumulate, plgpu.ACC((BLOCK, n_pad)), plgpu.ACC((BLOCK, n_pad)))
                # The reference's formula on registers: bf16 projections, float32 activation.
                h = ops.glu(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16), act, beta, linear_beta)
                cf = plgpu.load(coef_g.at[ui], layout=COL, optimized=False)
                o_s[...] = (h.astype(jnp.float32) * jax.lax.broadcast_in_dim(cf, h.shape, (1,))).astype(jnp.bfloat16)

            @pl.when(eid >= n_exp)
            def _padding():
                o_s[...] = plgpu.layout_cast(jnp.zeros((BLOCK, n_pad), jnp.bfloat16), WGMMA)

            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, h_g.at[ui, rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(scoped, plgpu.SMEM((sets, BLOCK, BLOCK), jnp.bfloat16, transforms=TILED),
                      plgpu.SMEM((sets, BLOCK, BLOCK), jnp.bfloat16, transforms=TILED),
                      plgpu.SMEM((BLOCK, n_pad), jnp.bfloat16))

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((u_n, inter, n_pad), jnp.bfloat16),
        grid=(inter // BLOCK, u_n), grid_names=("o", "u"),
        compiler_params=_lane_params(), interpret=mgpu.interpret_params(),
    )(zs, uniq, coef, w1, s1, w3, s3)


def down_splits(out_tiles: int, inter: int, slots: int, n_pad: int, sms: int) -> int:
    """Expert splits S of the down kernel: the divisor of the slot count maximising whole-wave SM
    fill x (weight bytes / (weight + float32 partial bytes)); ties go to the smaller split."""
    weight = slots * out_tiles * BLOCK * inter / 2          # packed w2 bytes if every slot is used
    best = (0.0, 1)
    for s in range(1, slots + 1):
        if slots % s:
            continue
        blocks = out_tiles * s
        fill = blocks / (math.ceil(blocks / sms) * sms)
        useful = weight / (weight + 2 * s * out_tiles * BLOCK * n_pad * 4)   # partials: written + read
        if fill * useful > best[0] + 1e-9:
            best = (fill * useful, s)
    return best[1]


def _down(hs, uniq, w2, s2, splits: int):
    """float32 partials [S, M, Np] of sum_u w2_u @ h_u over each split's expert slots."""
    u_n, _, _, n_pad, _ = hs.shape
    n_exp, m, half = w2.shape
    per = u_n // splits
    stages, sets = _stages_and_buffers(n_pad)

    def body(hs_g, uniq_g, w2_g, s2_g, o_g):
        oi, si = jax.lax.axis_index("o"), jax.lax.axis_index("s")
        rows = pl.ds(oi * BLOCK, BLOCK)

        def scoped(lo_s, hi_s):
            def accumulate(acc):
                @pl.loop(si * per, (si + 1) * per)
                def _expert(u):
                    eid = uniq_g[u]

                    @pl.when(eid < n_exp)      # padded slots read no weights
                    def _():
                        plgpu.emit_pipeline(
                            lambda _, w_s, s_s, he_s, ho_s: _dequant_mma(acc, w_s, s_s, he_s, ho_s, lo_s, hi_s, sets),
                            grid=(half * 2 // BLOCK_IN,),
                            in_specs=_half_specs() + _x_specs(n_pad), max_concurrent_steps=stages,
                        )(w2_g.at[eid, rows], s2_g.at[eid, rows], hs_g.at[u, 0], hs_g.at[u, 1])
                return acc[...]
            return pl.run_scoped(accumulate, plgpu.ACC((BLOCK, n_pad)))

        acc = pl.run_scoped(scoped, plgpu.SMEM((sets, BLOCK, BLOCK), jnp.bfloat16, transforms=TILED),
                            plgpu.SMEM((sets, BLOCK, BLOCK), jnp.bfloat16, transforms=TILED))

        @functools.partial(pl.run_scoped, o_s=plgpu.SMEM((BLOCK, n_pad), jnp.float32))
        def _store(o_s):
            o_s[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_g.at[si, rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((splits, m, n_pad), jnp.float32),
        grid=(m // BLOCK, splits), grid_names=("o", "s"),
        compiler_params=_lane_params(), interpret=mgpu.interpret_params(),
    )(hs, uniq, w2, s2)


def moe_experts(z: jax.Array, ids: jax.Array, weights: jax.Array, experts: ops.ExpertWeights, *,
                act: str, beta: float, linear_beta: float | None, expert_chunk: int = 64) -> jax.Array:
    """Same contract as k3jax.ops.moe_experts: z [N, M], ids/weights [N, k] -> [N, M] in z's dtype."""
    why = unsupported(z, ids, experts)
    if why is not None:
        if why not in _logged:
            _logged.add(why)
            log.info("moe_experts: running the XLA reference (%s)", why)
        return ops.moe_experts(z, ids, weights, experts, act=act, beta=beta, linear_beta=linear_beta,
                               expert_chunk=expert_chunk)
    n, k = ids.shape
    n_exp, inter = experts.w1.shape[:2]
    m = z.shape[1]
    n_pad = max(8, -(-n // 8) * 8)
    slots = min(n_exp, n * k)
    uniq, coef = ops.expert_dispatch(ids, weights, n_exp, slots)
    coef = jnp.pad(coef, ((0, 0), (0, n_pad - n)))
    zs = _split_halves(jnp.pad(z, ((0, n_pad - n), (0, 0))))
    h = _gate_up(zs, uniq, coef, experts.w1, experts.s1, experts.w3, experts.s3,
                 act=act, beta=beta, linear_beta=linear_beta)
    hs = jax.vmap(lambda hu: _split_halves(hu.T))(h)                  # [U, 2, I/128, Np, 64]
    splits = down_splits(m // BLOCK, inter, slots, n_pad, mgpu.num_sms())
    part = _down(hs, uniq, experts.w2, experts.s2, splits)
    return part.sum(0).T[:n].astype(z.dtype)


registry.register("moe_experts", "pallas", moe_experts)

# ------------------------------------------------------------------ validation / benchmark spec
ACT = (("act", "situ"), ("beta", 4.0), ("linear_beta", 8.0))   # K3's SiTU (config activation_situ_*)
K3_M, K3_I, K3_K = 3584, 3072, 16
BENCH_BATCHES = (1, 8, 32, 64)


def _make(n: int, m: int, inter: int, n_exp: int, k: int, fmt: str = "mxfp4"):
    def make(key):
        kz, kr, kw, k1, k2, k3 = jax.random.split(key, 6)
        z = jax.random.normal(kz, (n, m), jnp.float32).astype(jnp.bfloat16)
        # Distinct experts per token, routing weights summing to 1 (as ops.route renormalises).
        ids = jax.vmap(lambda kk: jax.random.permutation(kk, n_exp)[:k])(jax.random.split(kr, n)).astype(jnp.int32)
        w = jax.random.uniform(kw, (n, k), jnp.float32, 0.1, 1.0)
        w = w / w.sum(-1, keepdims=True)
        # Scales ~ 1/sqrt(fan-in): hidden and output activations of order one.
        if fmt == "mxfp4":
            (p1, q1), (p3, q3), (p2, q2) = (
                mxfp4.random_packed(kk, shape, scale_exp=round(-0.5 * math.log2(shape[-1])) - 1)
                for kk, shape in ((k1, (n_exp, inter, m)), (k2, (n_exp, inter, m)), (k3, (n_exp, m, inter))))
            experts = ops.ExpertWeights(p1, p3, p2, q1, q3, q2)
        else:
            experts = ops.ExpertWeights(*(
                (jax.random.normal(kk, shape, jnp.float32) * shape[-1] ** -0.5).astype(jnp.bfloat16)
                for kk, shape in ((k1, (n_exp, inter, m)), (k2, (n_exp, inter, m)), (k3, (n_exp, m, inter)))))
        return z, ids, w, experts
    return make


def cases() -> list[registry.Case]:
    small = [registry.Case(f"n{n}_m{m}_i{i}_e{e}_k{k}", _make(n, m, i, e, k), ACT, batch=n)
             for n, m, i, e, k in ((1, 512, 512, 4, 1), (2, 512, 512, 8, 2), (3, 1024, 512, 6, 2),
                                   (9, 512, 1024, 16, 4))]
    small.append(registry.Case("silu_n1", _make(1, 512, 512, 4, 1), (("act", "silu"), ("beta", 1.0),
                                                                      ("linear_beta", None)), batch=1))
    # Outside the kernel's coverage: must still match (the reference runs).
    small.append(registry.Case("fallback_bf16_experts", _make(2, 256, 128, 4, 2, "bf16"), ACT, batch=2))
    small.append(registry.Case("fallback_m96", _make(2, 96, 64, 4, 2), ACT, batch=2))
    k3 = [registry.Case(f"k3_e{e}_b{b}", _make(b, K3_M, K3_I, e, K3_K), ACT, batch=b, sizes=frozenset({"k3"}))
          for e in (448, 896) for b in BENCH_BATCHES]
    return small + k3


def cost(args, kwargs) -> tuple[float, float]:
    """Packed weight + scale bytes of the distinct selected experts, plus z in and y out."""
    z, ids, _, experts = args
    n, m = z.shape
    distinct = len(set(map(int, jax.device_get(ids).reshape(-1))))
    per_expert = sum(w[0].size * w.dtype.itemsize for w in (experts.w1, experts.w3, experts.w2))
    if experts.is_mxfp4:
        per_expert += sum(s[0].size for s in (experts.s1, experts.s3, experts.s2))
    inter = experts.w1.shape[1]
    return float(distinct * per_expert + 2 * z.size * z.dtype.itemsize), 6.0 * n * ids.shape[1] * m * inter


registry.register_spec(registry.OpSpec(
    name="moe_experts", reference=ops.moe_experts, cases=cases, cost=cost,
    notes="MXFP4 experts, bf16 z, 1-64 tokens, M and I multiples of 512 in the kernel; else the reference",
))
