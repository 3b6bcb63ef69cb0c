"""Absorbed MLA decode attention over the latent cache, split over the sequence.

    q_nope [B, H, N], q_rope [B, H, R], cache [B, L, C + R] (the latent, then the shared key dims),
    w_kv_b [H*(N+V), C], kv_len [B] int32 (device value, per step), scale -> [B, H, V] in q's dtype
    (k3jax.ops.mla_decode). The attention kernel's TMA reads both parts of each cached row in
    place (before session 32 the op took two sliced views, which XLA copied out of the cache every
    step: 1.2 MB a layer read and written at 1k tokens, 38 MB at 32k, batch 1).

Three Mosaic GPU kernels and one small XLA fusion; the op reads w_kv_b (24 MB at K3) once and
the cache rows once, and those two reads are its cost (short contexts: the weights; long: the
cache, 1152 B per token per sequence).

1. `_absorb`: q_lat = q_nope @ W_uk per head (k3jax.ops.mla_absorb_query), grid (C / 128, head,
   row block). Batch rows are wgmma's M side (padded to 64 in SMEM only: only the real rows are
   loaded and stored), W_uk[h] [N, 128] its B side as laid out in w_kv_b, K = N in one wgmma.
   Writes bf16 q_lat [Bp, Hp, C] (heads padded to Hp = 128; the padding rows are never written:
   their attention rows are computed and dropped) and q_rope re-laid out as [Bp, Hp, R].
2. `_attend` (flash decoding): grid (head group of 64, batch, split), three warpgroups per block:
   a producer streams the split's cache tiles (64 tokens: 64 KB latent + 8 KB k_rope) GMEM -> SMEM
   by TMA into a 2-stage ring - only the tiles holding a token below kv_len (the cache is
   allocated for the longest sequence; a split wholly past kv_len reads nothing, and its l = 0
   gives it no weight); two consumers share every tile, each owning one C half of the
   output: scores [64 heads, 64 tokens] = q_lat @ latent.T + q_rope @ k_rope.T by wgmma (float32),
   masked by position < kv_len, online softmax in registers (base 2), then o[64, C/2] += p @
   latent[:, half] by wgmma. Heads are wgmma's M side, so H = 96 is two groups (the second half
   padding). A [64, 512] float32 o would need 256 registers a thread, hence the two consumers;
   each computes the full scores. Each block writes o / l rounded to bf16 and the running (max,
   sum). That schedule executes 2.04x the needed MMA work at K3 (27.3 MFLOP a tile), which caps
   it at 62% of the byte roofline at long context with the tensor cores at their peak
   (benchmarks/floors.py); it runs them at ~657 TFLOPS. Schedules measured and not kept - one
   consumer scoring for both (session 7), split scores (session 20), FlashAttention-3's
   ping-pong (session 19), FlashMLA's seesaw (session 22; patches in benchmarks/results/ab/) -
   and why: docs/pallas.md (mla_decode's design notes, "Not done yet") and BENCHMARKS.md.
   `schedule="heads_n"` (`_attend_heads_n`, session 31; an ablation: slower, see below) scores with the
   heads on the wgmma's N side instead: groups of HEADS_N = 48 (K3's 96 heads: no padding), each
   consumer scoring half of them once (S^T [64 tokens, 24 heads], softmax down the token axis),
   the two swapping their rows of p and the rescale factors through SMEM once a tile; then each
   loads the group's p into registers and accumulates its C half as heads_m does. 15.5 MFLOP a
   tile instead of 27.3, for more SMEM reads per MMA clock (N = 24): bound by SMEM, its ceiling
   is 93% of the byte roofline against heads_m's 62% (benchmarks/floors.py, `mla_tensor_ceilings`).
   Its softmax reduces down the token axis, across the consumer's four warps, through SMEM scratch
   that Mosaic GPU puts at one address for every warpgroup: on the H100 (session 33) the two
   consumers raced on it (wrong, varying outputs; interpret mode does not model the scratch).
   Each consumer now reduces in scratch of its own (`mgpu.own_reduction_scratch`, entered by all
   three warpgroups before they diverge; its first form, a pad entered by one consumer only, hung
   on a GPU). Correct on the H100 since (session 34), but 9-16% slower than heads_m at 4k / 32k
   tokens: its per-tile chain (small N = 24 wgmma, two cross-warp reductions, a two-consumer
   barrier, the PV, each waited for) costs more than the MMA work it saves.
3. XLA: log-sum-exp combine of the splits -> o_lat [B, Hp, C] bf16, padded to Bn rows where B is
   not a multiple of 8 (session 36: the expansion reads each head's rows strided, in place; before,
   a transpose to [H, Bn, C] was one more launch at every batch).
4. `_expand`: out = o_lat @ W_uv.T per head (k3jax.ops.mla_expand_output) by
   pallas_kernels.linear's swap-AB step (`accumulate_rows`): W_uv rows are the M side (64 a
   block), batch rows (padded to 8) the N side, C streamed by TMA in 128-column steps; grid
   (V / 64, head). Each block stores its tile transposed, the real batch rows only, into the
   op's bf16 output [B, H, V] (session 36: before, a float32 [H, V, Bn] went out and XLA
   transposed, sliced and cast it, one more launch).

Covered: bf16, C % 128 == 0 (C / 2 <= 256), R % 64 == 0, L % 64 == 0 (`covers()`; anything else
runs the reference). The absorption kernel needs N % 64 == 0 (N = 16 / 32 interpret but do not compile), the expansion
V % 64 == 0 and at most 256 batch rows; outside those the reference's einsum runs in XLA.
Interpret mode (CPU) runs the attention block's three warpgroups as concurrent host threads that
wait on each other: with too few XLA:CPU threads (a 2-core host with one CPU device) they can
starve and hang; tests/conftest.py's 8 host devices avoid it. Rounding beyond the reference's: q_lat, p, o / l
and o_lat are bf16 wgmma operands or partials (float32 in the reference): ~2^-9 relative each,
inside the 2^-6 tolerance (`tolerance`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import ops
from pallas_kernels import linear as lin
from pallas_kernels import mgpu, registry

BLOCK_H = 64        # wgmma M: heads per attention block ("heads_m")
HEADS_N = 48        # wgmma N: heads per attention block ("heads_n"), HEADS_N / 2 scored per consumer
BLOCK_L = 64        # tokens per attention pipeline step
BLOCK_C = 128       # absorption: latent columns per block
BLOCK_K = 128       # expansion: latent columns per pipeline step
ROWS = 64           # absorption: batch rows per block (wgmma M)
MAX_N = 256         # expansion: most batch rows (wgmma N)
STAGES = 2          # 2 x 72 KB of cache tiles + 72 KB of q: 216 of the 227 KB of SMEM
LOG2E = math.log2(math.e)
MASKED = -1e30      # finite: a fully masked tile must not make exp2(m_old - m_new) NaN
f32 = jnp.float32


def _tf(minor: int):
    """SMEM transforms for a wgmma operand whose minor dimension has `minor` bf16 elements."""
    swizzle = min(128, 2 * minor)
    return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)


def covers(c: int, r: int, length: int, dtype) -> bool:
    """Whether the attention kernel handles a cache of `length` tokens of C latent and R shared key
    columns in `dtype` (else `mla_decode` runs the reference). The absorption and expansion kernels
    have their own conditions (`_absorb_covers`, `_expand_covers`); outside them the reference's
    einsum runs."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and c % 128 == 0 and c // 2 <= 256 and r % 64 == 0
            and length % BLOCK_L == 0 and r <= 256)


def _absorb_covers(n: int, c: int) -> bool:
    # N = 16 / 32 (32- / 64-byte swizzles) run in interpret mode but fail Mosaic GPU's layout
    # inference when compiled (tests/test_cuda_export_sweep.py): the einsum runs there.
    return n % 64 == 0 and n <= 256 and c % BLOCK_C == 0


def _expand_covers(v: int, c: int, rows: int) -> bool:
    return v % 64 == 0 and c % BLOCK_K == 0 and rows <= MAX_N


def plan(batch: int, heads: int, length: int, c: int, r: int, sms: int, block_heads: int = BLOCK_H) -> int:
    """Number of sequence splits: the one maximising (SM fill over whole waves, one block an SM)
    x (cache bytes / (cache + partial bytes written and read back)); ties go to fewer splits.
    c, r: the latent and shared-key widths of a cached token (bf16); block_heads: heads a block."""
    groups = -(-heads // block_heads)
    tiles = length // BLOCK_L
    cache = batch * length * (c + r) * 2.0
    best = (0.0, 1)
    for s in range(1, tiles + 1):
        if tiles % s:
            continue
        blocks = s * batch * groups
        fill = blocks / (math.ceil(blocks / sms) * sms)
        partial = 2 * s * batch * groups * block_heads * (c * 2 + 8)
        score = fill * cache / (cache + partial)
        if score > best[0] + 1e-9:
            best = (score, s)
    return best[1]


def _row_blocks(b: int) -> tuple[int, int]:
    """(rows a block, blocks) covering b batch rows: one block of b rounded up to 8 up to 64 rows."""
    if b <= ROWS:
        return -(-b // 8) * 8, 1
    return ROWS, -(-b // ROWS)


def _absorb(q_nope, q_rope, w_kv_b, hp: int):
    """q_nope [Bp, H, N], q_rope [Bp, H, R] bf16 (Bp from `_row_blocks`), w_kv_b [H*(N+V), C] ->
    q_lat [Bp, Hp, C] bf16 (q_nope @ W_uk per head, float32 sums) and q_rope copied to [Bp, Hp, R].
    Heads H..Hp are never written: their attention rows are computed and dropped (a wgmma's rows
    do not mix)."""
    bp, h, n = q_nope.shape
    r = q_rope.shape[-1]
    c = w_kv_b.shape[-1]
    nv = w_kv_b.shape[0] // h
    rows, _ = _row_blocks(bp)

    def mla_absorb(q_gmem, qr_gmem, w_gmem, ql_gmem, qro_gmem):
        ci, hi, ri = jax.lax.axis_index("c"), jax.lax.axis_index("h"), jax.lax.axis_index("r")
        brows = pl.ds(ri * rows, rows)

        def scoped(q_smem, w_smem, o_smem, qr_smem, bar):
            plgpu.copy_gmem_to_smem(q_gmem.at[brows, hi], q_smem.at[pl.ds(0, rows)], bar.at[0])
            plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(hi * nv, n), pl.ds(ci * BLOCK_C, BLOCK_C)], w_smem, bar.at[1])

            @pl.when(ci == 0)       # one block per (head, rows) re-lays q_rope out with the heads padded
            def _():
                plgpu.copy_gmem_to_smem(qr_gmem.at[brows, hi], qr_smem, bar.at[2])
                plgpu.barrier_wait(bar.at[2])
                plgpu.copy_smem_to_gmem(qr_smem, qro_gmem.at[brows, hi])

            plgpu.barrier_wait(bar.at[0])
            plgpu.barrier_wait(bar.at[1])

            def mm(acc_ref):
                # Rows past `rows` of q_smem were not loaded: their acc rows are not stored.
                plgpu.wgmma(acc_ref, q_smem, w_smem)
                return acc_ref[...]
            o_smem[...] = pl.run_scoped(mm, plgpu.ACC((ROWS, BLOCK_C), f32)).astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], ql_gmem.at[brows, hi, pl.ds(ci * BLOCK_C, BLOCK_C)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(scoped, plgpu.SMEM((ROWS, n), q_nope.dtype, transforms=_tf(n)),
                      plgpu.SMEM((n, BLOCK_C), w_kv_b.dtype, transforms=_tf(BLOCK_C)),
                      plgpu.SMEM((ROWS, BLOCK_C), q_nope.dtype), plgpu.SMEM((rows, r), q_rope.dtype),
                      plgpu.Barrier(num_barriers=3))

    return plgpu.kernel(
        mla_absorb,
        out_type=(jax.ShapeDtypeStruct((bp, hp, c), q_nope.dtype), jax.ShapeDtypeStruct((bp, hp, r), q_rope.dtype)),
        grid=(c // BLOCK_C, h, bp // rows), grid_names=("c", "h", "r"),
        interpret=mgpu.interpret_params(),
    )(q_nope, q_rope, w_kv_b)


def _online_softmax(s, m_i, l_i, token_axis: int):
    """One tile of the online softmax (base 2): scores s (a 2-D WGMMA array, its tokens along
    `token_axis`, its heads along the other), the running maxima m_i and sums l_i (one per head)
    -> (p, m_new, alpha = the factor that rescales the old sums and outputs, l_new)."""
    head_axis = 1 - token_axis
    m_new = jnp.maximum(m_i, s.max(axis=token_axis))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_new, s.shape, [head_axis]))
    return p, m_new, alpha, l_i * alpha + p.sum(axis=token_axis)


def _accumulate(acc, a, b):
    """acc + a @ b by wgmma: in place when compiled; interpreted, into a fresh accumulator."""
    if mgpu.interpret_params() is None:
        return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(plgpu.ACC.init(acc))

    def scoped(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]             # waits: the operands are free for the next step
    return acc + pl.run_scoped(scoped, plgpu.ACC(acc.shape, f32))


def _stream_cache(cache_gmem, lat_smem, kr_smem, lat_bar, kr_bar, free_bar, toks, live, steps: int):
    """The attention block's producer loop: TMA of the split's `live` cache tiles of one sequence
    (cache_gmem [L, C + R]: its latent columns in two C halves, then its R shared key columns),
    tile t into ring slot t % STAGES once both consumers freed it."""
    half, r = lat_smem.shape[-1], kr_smem.shape[-1]

    def load(t, slot):
        for j in range(2):
            plgpu.copy_gmem_to_smem(cache_gmem.at[toks(t), pl.ds(j * half, half)], lat_smem.at[slot, j],
                                    lat_bar.at[2 * slot + j])
        plgpu.copy_gmem_to_smem(cache_gmem.at[toks(t), pl.ds(2 * half, r)], kr_smem.at[slot], kr_bar.at[slot])
    for t in range(min(STAGES, steps)):
        @pl.when(t < live)
        def _(t=t):
            load(t, t)

    @pl.loop(STAGES, jnp.maximum(live, STAGES))
    def _(t):
        slot = t % STAGES
        plgpu.barrier_wait(free_bar.at[slot])     # both consumers are done with step t - STAGES
        load(t, slot)

    # Observe the last tiles' releases too: the interpreter requires every waiter of a barrier to
    # have seen all its phases by the end (free on a GPU: the block ends here).
    @pl.loop(jnp.maximum(live - STAGES, 0), live)
    def _(t):
        plgpu.barrier_wait(free_bar.at[t % STAGES])


class _Block(NamedTuple):
    """What an attention block's consumer warpgroup works with (`_flash_decode`)."""
    wg: jax.Array               # 0 or 1: this consumer (its C half of o)
    valid: jax.Array            # tokens of the split below kv_len (negative: none)
    live: jax.Array             # the split's tiles holding one of them
    ql: Any                     # SMEM q_lat [2 (C halves), heads, C/2]
    qr: Any                     # SMEM q_rope [heads, R]
    lat: Any                    # SMEM ring [STAGES, 2 (C halves), BLOCK_L, C/2]
    kr: Any                     # SMEM ring [STAGES, BLOCK_L, R]
    wait_tile: Callable         # slot -> None: waits until the slot's tile is in SMEM
    free_tile: Callable         # slot -> None: this consumer is done with the slot
    o_out: Any                  # GMEM o [heads, C/2] of this consumer's half
    m_out: Any                  # GMEM m [heads]
    l_out: Any                  # GMEM l [heads]


def _store_split(blk: _Block, o_smem, ml_smem) -> None:
    """The consumer's split results to GMEM: its o half from o_smem [heads, C/2] and (consumer 0)
    m, l from ml_smem [2, heads]."""
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, blk.o_out)

    @pl.when(blk.wg == 0)
    def _():
        plgpu.copy_smem_to_gmem(ml_smem.at[0], blk.m_out)
        plgpu.copy_smem_to_gmem(ml_smem.at[1], blk.l_out)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _flash_decode(consumer, name: str, q_lat, q_rope, cache, kv_len, splits: int, block_heads: int,
                  scratch: list, own_reduction_scratch: bool = False):
    """The attention kernel of both schedules: grid (group of `block_heads` heads, batch, split),
    three warpgroups - `_stream_cache` as the producer, and consumer(blk: _Block, *scratch refs)
    in warpgroups 0 and 1 once the group's q is in SMEM. q_lat [Bq, Hq, C], q_rope [Bq, Hq, R]
    bf16 (Hq % block_heads == 0, Bq >= B), cache [B, L, C + R] -> o [S, B, Hq, C] bf16 (per split: sum_t 2^(s_t - m)
    latent_t / l), m, l [S, B, Hq] float32 (the split's max score, base 2, and sum_t 2^(s_t - m)).
    own_reduction_scratch: each consumer reduces across its warps in SMEM scratch of its own
    (`mgpu.own_reduction_scratch`), for a consumer that reduces down a WGMMA array's M axis."""
    hq, c = q_lat.shape[1:]
    r = q_rope.shape[-1]
    b, length = cache.shape[:2]
    per = length // splits
    steps = per // BLOCK_L
    half = c // 2
    tf = _tf(64)

    def body(ql_gmem, qr_gmem, cache_gmem, len_gmem, o_gmem, m_gmem, l_gmem,
             ql_smem, qr_smem, lat_smem, kr_smem, q_bar, lat_bar, kr_bar, free_bar, *extra):
        # C halves are separate SMEM arrays (index 0/1 = half): a TMA store needs a contiguous
        # source, and each consumer stages its o half in one.
        si, bi, gi = jax.lax.axis_index("s"), jax.lax.axis_index("b"), jax.lax.axis_index("g")
        wg = jax.lax.axis_index("wg")
        heads = pl.ds(gi * block_heads, block_heads)
        toks = lambda t: pl.ds(si * per + t * BLOCK_L, BLOCK_L)  # noqa: E731
        valid = plgpu.load(len_gmem.at[bi]) - si * per
        live = jnp.clip((valid + BLOCK_L - 1) // BLOCK_L, 0, steps)   # later tiles: neither read nor scored

        def consume():
            plgpu.set_max_registers(232, action="increase")
            for j in range(3):
                plgpu.barrier_wait(q_bar.at[j])

            def wait_tile(slot):
                for j in range(2):
                    plgpu.barrier_wait(lat_bar.at[2 * slot + j])
                plgpu.barrier_wait(kr_bar.at[slot])
            consumer(_Block(wg, valid, live, ql_smem, qr_smem, lat_smem, kr_smem, wait_tile,
                            lambda slot: plgpu.barrier_arrive(free_bar.at[slot]),
                            o_gmem.at[si, bi, heads, pl.ds(wg * half, half)], m_gmem.at[si, bi, heads],
                            l_gmem.at[si, bi, heads]), *extra)

        # With own_reduction_scratch every warpgroup passes block-wide barriers there: before the
        # producer's loop.
        if own_reduction_scratch:
            mgpu.own_reduction_scratch("wg", 2, consume)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            for j in range(2):
                plgpu.copy_gmem_to_smem(ql_gmem.at[bi, heads, pl.ds(j * half, half)], ql_smem.at[j], q_bar.at[j])
            plgpu.copy_gmem_to_smem(qr_gmem.at[bi, heads], qr_smem, q_bar.at[2])
            _stream_cache(cache_gmem.at[bi], lat_smem, kr_smem, lat_bar, kr_bar, free_bar, toks, live, steps)

        if not own_reduction_scratch:
            pl.when(wg < 2)(consume)

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((splits, b, hq, c), cache.dtype), jax.ShapeDtypeStruct((splits, b, hq), f32),
                  jax.ShapeDtypeStruct((splits, b, hq), f32)),
        scratch_types=[
            plgpu.SMEM((2, block_heads, half), q_lat.dtype, transforms=tf),
            plgpu.SMEM((block_heads, r), q_rope.dtype, transforms=tf),
            plgpu.SMEM((STAGES, 2, BLOCK_L, half), cache.dtype, transforms=tf),
            plgpu.SMEM((STAGES, BLOCK_L, r), cache.dtype, transforms=tf),
            plgpu.Barrier(num_barriers=3), plgpu.Barrier(num_barriers=2 * STAGES), plgpu.Barrier(num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
        ] + scratch,
        grid=(hq // block_heads, b, splits), grid_names=("g", "b", "s"),
        num_threads=3, thread_name="wg", kernel_name=name,
        interpret=mgpu.interpret_params(),
    )(q_lat, q_rope, cache, kv_len)


def _attend(q_lat, q_rope, cache, kv_len, scale: float, splits: int):
    """The "heads_m" schedule (`_flash_decode`'s contract, Hq % BLOCK_H == 0): heads are the wgmma's
    M side in groups of BLOCK_H; both consumers score the group's heads against every tile
    ([64 heads, 64 tokens]), each accumulating its C half of o (p from registers as the A operand)."""
    half = q_lat.shape[-1] // 2
    interpret = mgpu.interpret_params()

    def consumer(blk: _Block, ml_smem, p_smem, done_bar):
        def step(t, carry):
            acc, m_i, l_i = carry
            slot = t % STAGES
            blk.wait_tile(slot)

            def qk(s_ref):
                for j in range(2):
                    plgpu.wgmma(s_ref, blk.ql.at[j], blk.lat.at[slot, j].transpose((1, 0)))
                plgpu.wgmma(s_ref, blk.qr, blk.kr.at[slot].transpose((1, 0)))
                return s_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_L), f32)) * (scale * LOG2E)
            pos = plgpu.broadcasted_iota(jnp.int32, (BLOCK_H, BLOCK_L), 1, layout=plgpu.Layout.WGMMA)
            s = jnp.where(pos + t * BLOCK_L < blk.valid, s, MASKED)
            p, m_new, alpha, l_i = _online_softmax(s, m_i, l_i, token_axis=1)
            acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(blk.lat.dtype)
            if interpret is not None:       # the interpreter has no register A operand
                p_smem.at[blk.wg][...] = p
                plgpu.commit_smem()
                p = p_smem.at[blk.wg]
            acc = _accumulate(acc, p, blk.lat.at[slot, blk.wg])
            blk.free_tile(slot)
            return acc, m_new, l_i

        init = (plgpu.layout_cast(jnp.zeros((BLOCK_H, half), f32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((BLOCK_H,), MASKED, f32), plgpu.Layout.WGMMA.reduce(1)),
                plgpu.layout_cast(jnp.zeros((BLOCK_H,), f32), plgpu.Layout.WGMMA.reduce(1)))
        acc, m_i, l_i = jax.lax.fori_loop(0, blk.live, step, init)

        # Both consumers read every tile to the end: wait for both before staging o in one.
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)
        o_smem = blk.lat.at[0, blk.wg]
        # A split past kv_len scored nothing: l = 0, o = 0 (its m = MASKED gives it weight 0).
        l_pos = jnp.maximum(l_i, 1e-30)
        o_smem[...] = (acc / jax.lax.broadcast_in_dim(l_pos, acc.shape, [0])).astype(o_smem.dtype)

        @pl.when(blk.wg == 0)       # both consumers hold the same (m, l); one writes them
        def _():
            ml_smem.at[0][...] = m_i
            ml_smem.at[1][...] = l_i
        _store_split(blk, o_smem, ml_smem)

    scratch = [plgpu.SMEM((2, BLOCK_H), f32),
               # p in SMEM: staging in interpret mode only (compiled, p stays in registers).
               plgpu.SMEM((2, BLOCK_H, BLOCK_L) if interpret is not None else (2, 8, 64), cache.dtype,
                          transforms=_tf(64)),
               plgpu.Barrier(num_arrivals=2)]
    return _flash_decode(consumer, "mla_attend", q_lat, q_rope, cache, kv_len, splits, BLOCK_H, scratch)


def _attend_heads_n(q_lat, q_rope, cache, kv_len, scale: float, splits: int):
    """The "heads_n" schedule (`_flash_decode`'s contract, Hq % HEADS_N == 0): the scores with the
    heads on the wgmma's N side, so none is scored padded and each tile is scored once. Consumer w
    scores heads w * HEADS_N / 2 .. of its group (S^T [64 tokens, HEADS_N / 2] = latent tile @
    q.T + k_rope tile @ q_rope.T), runs their online softmax down the token axis and puts its
    rows of p [heads, tokens] and the rescale factors in SMEM; once both have (one two-way
    barrier a tile), each loads the group's p into registers and accumulates its C half of o as
    heads_m does (O [BLOCK_H, C/2] += p @ latent[:, half], the heads past HEADS_N padding rows
    that are never stored)."""
    half, scored = q_lat.shape[-1] // 2, HEADS_N // 2
    heads_col = plgpu.Layout.WGMMA.reduce(0)       # a vector along the heads (N) of the scores
    heads_row = plgpu.Layout.WGMMA.reduce(1)       # a vector along the heads (M) of o
    interpret = mgpu.interpret_params()

    def consumer(blk: _Block, p_smem, alpha_smem, ml_smem, swap_bar, done_bar):
        mine = pl.ds(blk.wg * scored, scored)       # the heads this consumer scores

        def step(t, carry):
            acc, m_i, l_i = carry               # O [BLOCK_H, C/2]; m, l of its scored heads
            slot, buf = t % STAGES, t % 2
            blk.wait_tile(slot)

            def qk(s_ref):
                for j in range(2):
                    plgpu.wgmma(s_ref, blk.lat.at[slot, j], blk.ql.at[j, mine].transpose((1, 0)))
                plgpu.wgmma(s_ref, blk.kr.at[slot], blk.qr.at[mine].transpose((1, 0)))
                return s_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_L, scored), f32)) * (scale * LOG2E)
            pos = plgpu.broadcasted_iota(jnp.int32, (BLOCK_L, scored), 0, layout=plgpu.Layout.WGMMA)
            s = jnp.where(pos + t * BLOCK_L < blk.valid, s, MASKED)
            p, m_new, alpha, l_i = _online_softmax(s, m_i, l_i, token_axis=0)
            # Hand p and alpha of its heads to both consumers' PV. Buffer t % 2: the other
            # consumer's PV of tile t - 2 finished before it arrived at tile t - 1's barrier.
            p_smem.at[buf, mine].transpose((1, 0))[...] = p.astype(p_smem.dtype)
            alpha_smem.at[buf, mine][...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(swap_bar.at[buf])
            plgpu.barrier_wait(swap_bar.at[buf])
            alpha_all = plgpu.load(alpha_smem.at[buf], layout=heads_row, optimized=False)
            acc = acc * jax.lax.broadcast_in_dim(alpha_all, acc.shape, [0])
            # p from registers, as heads_m's (the interpreter has no register A operand).
            p_all = p_smem.at[buf] if interpret is not None else plgpu.load(p_smem.at[buf], layout=plgpu.Layout.WGMMA)
            acc = _accumulate(acc, p_all, blk.lat.at[slot, blk.wg])
            blk.free_tile(slot)
            return acc, m_new, l_i

        init = (plgpu.layout_cast(jnp.zeros((BLOCK_H, half), f32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((scored,), MASKED, f32), heads_col),
                plgpu.layout_cast(jnp.zeros((scored,), f32), heads_col))
        acc, m_i, l_i = jax.lax.fori_loop(0, blk.live, step, init)

        # Each consumer knows (m, l) of its scored heads and needs l of all: swap them, then
        # stage o's half as heads_m does (both consumers are past every tile).
        ml_smem.at[0, mine][...] = m_i
        ml_smem.at[1, mine][...] = l_i
        plgpu.commit_smem()
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)
        # A split past kv_len scored nothing: l = 0, o = 0 (its m = MASKED gives it weight 0).
        l_pos = jnp.maximum(plgpu.load(ml_smem.at[1], layout=heads_row, optimized=False), 1e-30)
        o_smem = blk.lat.at[0, blk.wg]
        o_smem[...] = (acc / jax.lax.broadcast_in_dim(l_pos, acc.shape, [0])).astype(o_smem.dtype)
        _store_split(blk, o_smem.at[pl.ds(0, HEADS_N)], ml_smem.at[:, pl.ds(0, HEADS_N)])

    # Rows HEADS_N.. of p, alpha and (m, l) pad the PV's M side: never written, they only reach
    # o's padding rows, which are not stored.
    scratch = [plgpu.SMEM((2, BLOCK_H, BLOCK_L), cache.dtype, transforms=_tf(64)),     # p, two tiles
               plgpu.SMEM((2, BLOCK_H), f32),                                           # alpha, two tiles
               plgpu.SMEM((2, BLOCK_H), f32),                                           # final (m, l)
               plgpu.Barrier(num_arrivals=2, num_barriers=2), plgpu.Barrier(num_arrivals=2)]
    # The softmax reduces down the token (M) axis across warps: each consumer needs its own
    # reduction scratch, or the two race on Mosaic's shared one (wrong on a GPU, session 33).
    return _flash_decode(consumer, "mla_attend_heads_n", q_lat, q_rope, cache, kv_len, splits, HEADS_N,
                         scratch, own_reduction_scratch=True)


def _expand(o_lat, w_kv_b, n: int, heads: int, rows: int):
    """o_lat [Bn, Hq, C] bf16 (Bn % 8 == 0, <= 256; Hq >= heads, the padding heads unread), w_kv_b
    [heads*(N+V), C] -> out [rows, heads, V] in o_lat's dtype (rows <= Bn real batch rows): o_lat @
    W_uv.T per head, swap-AB (W_uv rows are the wgmma's M side; a head's o_lat rows, strided in
    GMEM, its N side), each [64, Bn] tile stored transposed into out (`mgpu.store_transposed`)."""
    bn, _, c = o_lat.shape
    nv = w_kv_b.shape[0] // heads
    v = nv - n
    stages = lin.stages_fitting(bn, BLOCK_K, min(3, c // BLOCK_K))     # 256 rows: 2 (3 took 240 KB)

    def mla_expand(o_gmem, w_gmem, out_gmem):
        vi, hi = jax.lax.axis_index("v"), jax.lax.axis_index("h")

        def acc_scope(acc_ref):
            lin.accumulate_rows(acc_ref, w_gmem.at[pl.ds(hi * nv + n + vi * 64, 64)], o_gmem.at[:, hi], BLOCK_K, stages)
            return acc_ref[...]

        mgpu.store_transposed(pl.run_scoped(acc_scope, plgpu.ACC((64, bn), f32)),
                              out_gmem.at[:, hi, pl.ds(vi * 64, 64)])

    return plgpu.kernel(
        mla_expand, out_type=jax.ShapeDtypeStruct((rows, heads, v), o_lat.dtype),
        grid=(v // 64, heads), grid_names=("v", "h"),
        compiler_params=mgpu.warpgroup_params(), interpret=mgpu.interpret_params(),
    )(o_lat, w_kv_b)


# schedule -> (attention kernel, heads a block)
SCHEDULES = {"heads_m": (_attend, BLOCK_H), "heads_n": (_attend_heads_n, HEADS_N)}


def _combine(o, m, l):
    """Log-sum-exp combine of the splits (base 2; a fully masked split has m = MASKED: weight 0):
    o [S, B, Hp, C] bf16 (normalised per split), m, l [S, B, Hp] float32 -> [B, Hp, C] float32."""
    wgt = jnp.exp2(m - m.max(0)) * l
    return (wgt[..., None] * o.astype(f32)).sum(0) / wgt.sum(0)[..., None]


def mla_decode(q_nope, q_rope, cache, w_kv_b, kv_len, scale, *, splits: int | None = None,
               schedule: str = "heads_m"):
    """Same contract as k3jax.ops.mla_decode: -> [B, H, V] in q's dtype. Ablation knobs: splits of
    the sequence in the attention kernel (default `plan`'s; must divide its 64-token tiles), and its
    schedule (one of SCHEDULES: `_attend`, `_attend_heads_n`)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"mla_decode: schedule={schedule!r}; choose one of {tuple(SCHEDULES)}")
    b, h, n = q_nope.shape
    c, r = ops.mla_cache_columns(cache, w_kv_b, q_rope)
    if not covers(c, r, cache.shape[1], q_nope.dtype) or cache.dtype != q_nope.dtype:
        why = f"cache {cache.dtype}{list(cache.shape)} (C = {c}, R = {r}), q {q_nope.dtype} not covered"
        return registry.fallback("mla_decode", "pallas", why)(q_nope, q_rope, cache, w_kv_b, kv_len, scale)
    v = w_kv_b.shape[0] // h - n
    attend, block_heads = SCHEDULES[schedule]
    hp = -(-h // block_heads) * block_heads
    bf16_w = w_kv_b.dtype == q_nope.dtype
    if bf16_w and _absorb_covers(n, c):
        rows, blocks = _row_blocks(b)
        pad = ((0, rows * blocks - b), (0, 0), (0, 0))
        q_lat, qr = _absorb(jnp.pad(q_nope, pad), jnp.pad(q_rope, pad), w_kv_b, hp)
    else:
        pad = ((0, 0), (0, hp - h), (0, 0))
        q_lat = jnp.pad(ops.mla_absorb_query(q_nope, w_kv_b).astype(cache.dtype), pad)
        qr = jnp.pad(q_rope, pad)
    tiles = cache.shape[1] // BLOCK_L
    if splits is None:
        splits = plan(b, h, cache.shape[1], c, r, mgpu.num_sms(), block_heads)
    elif splits < 1 or tiles % splits:
        raise ValueError(f"mla_decode: splits={splits} does not divide the cache's {tiles} tiles of {BLOCK_L} tokens")
    o, m, l = attend(q_lat, qr, cache, kv_len.astype(jnp.int32), scale, splits)
    bn = -(-b // 8) * 8         # the expansion's wgmma N: batch rows padded to 8
    if bf16_w and _expand_covers(v, c, bn):
        # Padding the inputs instead (zero rows) costs the combine 8x its work at one row (H100, session 36).
        o_lat = jnp.pad(_combine(o, m, l).astype(cache.dtype), ((0, bn - b), (0, 0), (0, 0)))
        return _expand(o_lat, w_kv_b, n, h, b)
    return ops.mla_expand_output(_combine(o, m, l)[:, :h], w_kv_b, n, q_nope.dtype)


registry.register("mla_decode", "pallas", mla_decode)
# The other schedule as an implementation of its own, so whole-step ablations can pick it
# (`KernelPlan.for_backend("pallas", mla_decode="pallas_heads_n")`, `bench --ablate`).
registry.register("mla_decode", "pallas_heads_n", functools.partial(mla_decode, schedule="heads_n"))

# ------------------------------------------------------------------ validation / benchmark spec
K3 = {"h": 96, "n": 128, "r": 64, "c": 512, "v": 128}
K3_CONTEXTS = (1024, 4096, 32768)
BENCH_BATCHES = (1, 8, 32, 128)


def _make(b: int, h: int, n: int, r: int, c: int, v: int, length: int, lens=None, dtype=jnp.bfloat16):
    def make(key):
        ks = jax.random.split(key, 5)
        q_nope = jax.random.normal(ks[0], (b, h, n), f32).astype(dtype)
        q_rope = jax.random.normal(ks[1], (b, h, r), f32).astype(dtype)
        cache = jax.random.normal(ks[2], (b, length, c + r), f32).astype(dtype)     # latent, then k_rope
        w_kv_b = (jax.random.normal(ks[3], (h * (n + v), c), f32) * c ** -0.5).astype(dtype)
        kv_len = (jnp.asarray(lens, jnp.int32) if lens is not None
                  else jax.random.randint(ks[4], (b,), 1, length + 1, jnp.int32))
        return q_nope, q_rope, cache, w_kv_b, kv_len
    return make


def cases() -> list[registry.Case]:
    """The plan's splits give small caches one tile a split: the `splits` 1 / 2 cases put several
    in one (and splits wholly past kv_len)."""
    def case(name, b, h, n, r, c, v, length, lens=None, sizes=frozenset({"small"}), **kernel):
        return registry.Case(name, _make(b, h, n, r, c, v, length, lens),
                             (("scale", (n + r) ** -0.5),), batch=b, sizes=sizes, kernel_kwargs=tuple(kernel.items()))
    lens = [384, 257, 130, 1]       # per split of 3 tiles: 3 + 3, 3 + 2, 3 + 0, 1 + 0 live tiles
    small = [case("b2_h8_c128_l128", 2, 8, 32, 64, 128, 32, 128),
             case("b1_h96_c256_l256_full", 1, 96, 64, 64, 256, 64, 256, lens=[256]),
             case("b3_h70_c128_l192_v64", 3, 70, 16, 64, 128, 64, 192, lens=[1, 65, 192]),
             case("b4_h8_c128_l384_one_split", 4, 8, 16, 64, 128, 32, 384, lens=lens, splits=1),
             case("b4_h8_c128_l384_two_splits", 4, 8, 16, 64, 128, 32, 384, lens=lens, splits=2),
             case("fallback_l100", 2, 4, 16, 16, 128, 16, 100)]
    # The "heads_n" schedule: one group with padding heads, two groups (V 64, three lengths), K3's
    # 96 heads exactly, several tiles a split.
    small += [case("b2_h8_c128_l128_heads_n", 2, 8, 32, 64, 128, 32, 128, schedule="heads_n"),
              case("b3_h70_c128_l192_v64_heads_n", 3, 70, 16, 64, 128, 64, 192, lens=[1, 65, 192], schedule="heads_n"),
              case("b1_h96_c256_l256_full_heads_n", 1, 96, 64, 64, 256, 64, 256, lens=[256], schedule="heads_n"),
              case("b4_h8_c128_l384_two_splits_heads_n", 4, 8, 16, 64, 128, 32, 384, lens=lens, splits=2,
                   schedule="heads_n")]
    k3 = [case(f"ctx{ctx}_b{bb}", bb, *K3.values(), ctx, lens=[ctx] * bb, sizes=frozenset({"k3"}))
          for ctx in K3_CONTEXTS for bb in BENCH_BATCHES if bb * ctx <= 32 * 32768]
    k3 += [case(f"ctx{ctx}_b{bb}_heads_n", bb, *K3.values(), ctx, lens=[ctx] * bb, sizes=frozenset({"k3"}),
                schedule="heads_n") for ctx in K3_CONTEXTS for bb in (1, 8, 32)]
    # Sequences of random lengths in one cache (the tiles past each kv_len are skipped).
    k3.append(case("ctx4096_b8_ragged", 8, *K3.values(), 4096, sizes=frozenset({"k3"})))
    return small + k3


def cost(args, kwargs) -> tuple[float, float]:
    """Bytes: the valid cache rows (latent + shared key dims) - the roofline; q, w_kv_b and the output are
    counted too. FLOPs: scores and the latent-space weighted sum (absorption einsums included)."""
    q_nope, q_rope, cache, w_kv_b, kv_len = args
    b, h, n = q_nope.shape
    c, r = w_kv_b.shape[-1], q_rope.shape[-1]
    v = w_kv_b.shape[0] // h - n
    tokens = float(jnp.sum(kv_len))
    item = cache.dtype.itemsize
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
