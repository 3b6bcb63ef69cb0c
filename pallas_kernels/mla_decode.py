"""Absorbed MLA decode attention over the latent cache, split over the sequence.

    q_nope [B, H, N], q_rope [B, H, R], latent [B, L, C], k_rope [B, L, R], w_kv_b [H*(N+V), C],
    kv_len [B] int32 (device value, per step), scale -> [B, H, V] in q's dtype (k3jax.ops.mla_decode)

The absorption q_lat = q_nope @ W_uk (-> [B, H, C]) and the output o_lat @ W_uv stay small XLA
einsums around the kernel (weights 24 MB, read once per step, like any projection); the kernel
is the attention over the cache, whose read is the op's cost (1152 B per token per sequence).

Kernel (Mosaic GPU, one warpgroup per block), flash-decoding style: grid (split, batch, head
group of 64, half of C). The cache rows of a split stream GMEM -> SMEM by TMA in a 2-stage
`emit_pipeline` (64 tokens a step: 64 KB latent + 8 KB k_rope). Per step: scores [64 heads, 64
tokens] = q_lat @ latent.T + q_rope @ k_rope.T by wgmma (float32 accumulator), masked by
position < kv_len, an online softmax in registers (base 2), then o[64, C/2] += p @ latent[:, half]
by wgmma with p from registers. Heads are wgmma's M side (64 rows), so H = 96 is two groups (the
second half padding); C = 512 of float32 output would need 256 registers a thread, hence the C
halves - the blocks of one split differ only in head group / half and run side by side, so the
second reads of a tile come from L2. Each block writes its unnormalised o and the running
(max, sum); XLA combines the splits (log-sum-exp) and applies W_uv.

Covered: bf16, C % 64 == 0 (C / 2 <= 256), R % 64 == 0, L % 64 == 0. Anything else runs the
reference; `covers()` says which. A float32 q_lat is rounded to bf16 for the wgmma (the
reference keeps float32): this costs ~2^-9 relative on the scores, inside bf16 output tolerance.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import ops
from pallas_kernels import mgpu, registry

BLOCK_H = 64        # wgmma M: heads per block
BLOCK_L = 64        # tokens per pipeline step
STAGES = 2          # 2 x 72 KB of cache tiles + 72 KB of q in SMEM
LOG2E = math.log2(math.e)
MASKED = -1e30      # finite: a fully masked tile must not make exp2(m_old - m_new) NaN
f32 = jnp.float32


def covers(q_shape, latent_shape, k_rope_shape, dtype) -> bool:
    """Whether the kernel handles these shapes/dtype (else `mla_decode` runs the reference)."""
    c, r, length = latent_shape[-1], k_rope_shape[-1], latent_shape[1]
    return (jnp.dtype(dtype) == jnp.bfloat16 and c % 128 == 0 and c // 2 <= 256 and r % 64 == 0
            and length % BLOCK_L == 0 and r <= 256)


def plan(batch: int, heads: int, length: int, c: int, sms: int) -> int:
    """Number of sequence splits: the one maximising (SM fill over whole waves) x (cache bytes /
    (cache + float32 partial bytes written and read back)); ties go to fewer splits."""
    groups = -(-heads // BLOCK_H) * 2
    tiles = length // BLOCK_L
    cache = batch * length * 1152.0
    best = (0.0, 1)
    for s in range(1, tiles + 1):
        if tiles % s:
            continue
        blocks = s * batch * groups
        fill = blocks / (math.ceil(blocks / sms) * sms)
        partial = 2 * s * batch * groups * BLOCK_H * (c // 2 + 2) * 4
        score = fill * cache / (cache + partial)
        if score > best[0] + 1e-9:
            best = (score, s)
    return best[1]


def _partials(q_lat, q_rope, latent, k_rope, kv_len, scale: float, splits: int):
    """q_lat [B, Hp, C], q_rope [B, Hp, R] bf16 (Hp % 64 == 0) -> o [S, B, Hp, C], m, l [S, B, Hp]
    float32: per split, sum_t 2^(s_t - m) latent_t, its max score m (base 2) and sum 2^(s_t - m)."""
    b, hp, c = q_lat.shape
    r = q_rope.shape[-1]
    length = latent.shape[1]
    per = length // splits
    half = c // 2
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    tf = (tiling, swizzle)

    def mla_decode_split(ql_gmem, qr_gmem, lat_gmem, kr_gmem, len_gmem, o_gmem, m_gmem, l_gmem):
        si, bi = jax.lax.axis_index("s"), jax.lax.axis_index("b")
        gi, ci = jax.lax.axis_index("g"), jax.lax.axis_index("c")
        heads = pl.ds(gi * BLOCK_H, BLOCK_H)
        valid = plgpu.load(len_gmem.at[bi]) - si * per      # tokens of this split below kv_len

        def attend(ql_smem, qr_smem, p_smem, bar):
            plgpu.copy_gmem_to_smem(ql_gmem.at[bi, heads], ql_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(qr_gmem.at[bi, heads], qr_smem, bar.at[1])
            plgpu.barrier_wait(bar.at[0])
            plgpu.barrier_wait(bar.at[1])

            def step(idx, lat_smem, kr_smem, carry):
                acc, m_i, l_i = carry

                def qk(s_ref):
                    plgpu.wgmma(s_ref, ql_smem, lat_smem.transpose((1, 0)))
                    plgpu.wgmma(s_ref, qr_smem, kr_smem.transpose((1, 0)))
                    return s_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_L), f32)) * (scale * LOG2E)
                pos = plgpu.broadcasted_iota(jnp.int32, (BLOCK_H, BLOCK_L), 1, layout=plgpu.Layout.WGMMA)
                s = jnp.where(pos + idx[0] * BLOCK_L < valid, s, MASKED)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])

                # p goes through SMEM: wgmma's A from registers does not interpret on CPU.
                p_smem[...] = p.astype(p_smem.dtype)
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, lat_smem.at[:, pl.ds(ci * half, half)])
                    return acc_ref[...]      # waits for the wgmma: p_smem is free for the next step
                acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK_H, half), f32))
                return acc, m_new, l_i

            init = (plgpu.layout_cast(jnp.zeros((BLOCK_H, half), f32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((BLOCK_H,), MASKED, f32), plgpu.Layout.WGMMA.reduce(1)),
                    plgpu.layout_cast(jnp.zeros((BLOCK_H,), f32), plgpu.Layout.WGMMA.reduce(1)))
            toks = pl.ds(si * per, per)
            return plgpu.emit_pipeline(
                step, grid=(per // BLOCK_L,),
                in_specs=[plgpu.BlockSpec((BLOCK_L, c), lambda t: (t, 0), transforms=tf),
                          plgpu.BlockSpec((BLOCK_L, r), lambda t: (t, 0), transforms=tf)],
                max_concurrent_steps=STAGES, init_carry=init,
            )(lat_gmem.at[bi, toks], kr_gmem.at[bi, toks])

        acc, m_i, l_i = pl.run_scoped(
            attend, plgpu.SMEM((BLOCK_H, c), q_lat.dtype, transforms=tf),
            plgpu.SMEM((BLOCK_H, r), q_rope.dtype, transforms=tf),
            plgpu.SMEM((BLOCK_H, BLOCK_L), latent.dtype, transforms=tf), plgpu.Barrier(num_barriers=2))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((BLOCK_H, half), f32),
                           m_smem=plgpu.SMEM((BLOCK_H,), f32), l_smem=plgpu.SMEM((BLOCK_H,), f32))
        def _store(o_smem, m_smem, l_smem):
            o_smem[...] = acc
            m_smem[...] = m_i
            l_smem[...] = l_i
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, bi, heads, pl.ds(ci * half, half)])

            @pl.when(ci == 0)       # both halves hold the same (m, l); one writes them
            def _():
                plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[si, bi, heads])
                plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[si, bi, heads])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        mla_decode_split,
        out_type=(jax.ShapeDtypeStruct((splits, b, hp, c), f32), jax.ShapeDtypeStruct((splits, b, hp), f32),
                  jax.ShapeDtypeStruct((splits, b, hp), f32)),
        grid=(2, hp // BLOCK_H, b, splits), grid_names=("c", "g", "b", "s"),
        interpret=mgpu.interpret_params(),
    )(q_lat, q_rope, latent, k_rope, kv_len)


def mla_decode(q_nope, q_rope, latent, k_rope, w_kv_b, kv_len, scale):
    """Same contract as k3jax.ops.mla_decode: -> [B, H, V] in q's dtype."""
    if not covers(q_nope.shape, latent.shape, k_rope.shape, q_nope.dtype) or latent.dtype != q_nope.dtype:
        why = f"latent {latent.dtype}{list(latent.shape)}, k_rope {list(k_rope.shape)}, q {q_nope.dtype} not covered"
        return registry.fallback("mla_decode", "pallas", why)(q_nope, q_rope, latent, k_rope, w_kv_b, kv_len, scale)
    b, h, n = q_nope.shape
    hp = -(-h // BLOCK_H) * BLOCK_H
    pad = ((0, 0), (0, hp - h), (0, 0))
    q_lat = jnp.pad(ops.mla_absorb_query(q_nope, w_kv_b).astype(latent.dtype), pad)
    splits = plan(b, h, latent.shape[1], latent.shape[-1], mgpu.num_sms())
    o, m, l = _partials(q_lat, jnp.pad(q_rope, pad), latent, k_rope, kv_len.astype(jnp.int32), scale, splits)
    # Log-sum-exp combine of the splits (base 2; a fully masked split has m = MASKED: weight 0).
    wgt = jnp.exp2(m - m.max(0))
    o_lat = (wgt[..., None] * o).sum(0) / (wgt * l).sum(0)[..., None]          # [B, Hp, C]
    return ops.mla_expand_output(o_lat[:, :h], w_kv_b, n, q_nope.dtype)


registry.register("mla_decode", "pallas", mla_decode)

# ------------------------------------------------------------------ validation / benchmark spec
K3 = {"h": 96, "n": 128, "r": 64, "c": 512, "v": 128}
K3_CONTEXTS = (1024, 4096, 32768)
BENCH_BATCHES = (1, 8, 32, 128)


def _make(b: int, h: int, n: int, r: int, c: int, v: int, length: int, lens=None, dtype=jnp.bfloat16):
    def make(key):
        ks = jax.random.split(key, 6)
        q_nope = jax.random.normal(ks[0], (b, h, n), f32).astype(dtype)
        q_rope = jax.random.normal(ks[1], (b, h, r), f32).astype(dtype)
        latent = jax.random.normal(ks[2], (b, length, c), f32).astype(dtype)
        k_rope = jax.random.normal(ks[3], (b, length, r), f32).astype(dtype)
        w_kv_b = (jax.random.normal(ks[4], (h * (n + v), c), f32) * c ** -0.5).astype(dtype)
        kv_len = (jnp.asarray(lens, jnp.int32) if lens is not None
                  else jax.random.randint(ks[5], (b,), 1, length + 1, jnp.int32))
        return q_nope, q_rope, latent, k_rope, w_kv_b, kv_len
    return make


def cases() -> list[registry.Case]:
    def case(name, b, h, n, r, c, v, length, lens=None, sizes=frozenset({"small"})):
        return registry.Case(name, _make(b, h, n, r, c, v, length, lens),
                             (("scale", (n + r) ** -0.5),), batch=b, sizes=sizes)
    small = [case("b2_h8_c128_l128", 2, 8, 32, 64, 128, 32, 128),
             case("b1_h96_c256_l256_full", 1, 96, 64, 64, 256, 64, 256, lens=[256]),
             case("b3_h70_c128_l192", 3, 70, 16, 64, 128, 16, 192, lens=[1, 65, 192]),
             case("fallback_l100", 2, 4, 16, 16, 128, 16, 100)]
    k3 = [case(f"ctx{ctx}_b{bb}", bb, *K3.values(), ctx, lens=[ctx] * bb, sizes=frozenset({"k3"}))
          for ctx in K3_CONTEXTS for bb in BENCH_BATCHES if bb * ctx <= 32 * 32768]
    return small + k3


def cost(args, kwargs) -> tuple[float, float]:
    """Bytes: the valid cache rows (latent + k_rope) - the roofline; q, w_kv_b and the output are
    counted too. FLOPs: scores and the latent-space weighted sum (absorption einsums included)."""
    q_nope, q_rope, latent, k_rope, w_kv_b, kv_len = args
    b, h, n = q_nope.shape
    c, r = latent.shape[-1], k_rope.shape[-1]
    v = w_kv_b.shape[0] // h - n
    tokens = float(jnp.sum(kv_len))
    item = latent.dtype.itemsize
    nbytes = (tokens * (c + r) * item + w_kv_b.size * w_kv_b.dtype.itemsize
              + (q_nope.size + q_rope.size) * q_nope.dtype.itemsize + b * h * v * q_nope.dtype.itemsize)
    flops = 2.0 * tokens * h * (c + r + c) + 2.0 * b * h * c * (n + v)
    return nbytes, flops


def tolerance(args, kwargs) -> float:
    """2^-6 of the output scale: besides the final bf16 rounding (2^-7 for two ulps), both wgmmas
    take bf16 operands the reference keeps in float32 - q_lat (score error ~2^-9 x |score|, which
    softmax turns into relative weight error) and the probabilities (2^-9 each)."""
    return 2.0 ** -6 if args[0].dtype == jnp.bfloat16 else registry.TOLERANCE["float32"]


registry.register_spec(registry.OpSpec(
    name="mla_decode", reference=ops.mla_decode, cases=cases, cost=cost, tolerance=tolerance,
    notes="bf16, C % 128 == 0, C <= 512, R % 64 == 0, L % 64 == 0 in the kernel; anything else runs the reference",
))
