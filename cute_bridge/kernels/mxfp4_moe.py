"""MXFP4 W4A16 routed experts for decode, grouped by expert, in two launches around the (XLA)
gated activation. S = N * k slots (token n's j-th choice is slot n * k + j); each of U grid rows
runs one expert, `experts[u]` (the distinct selected experts, or past 8 tokens the slots of
k3jax.ops.expert_groups: an expert with more choices takes several rows), and `slots [U, T]` names
the slot of token column t (-1: no choice there):

  gate_up:  gate, up [S, I] bf16 = z[token] @ dequant(w1|w3[experts[u]]).T    for each named slot
  down:     part [S, M] f32      = weights[s] * bf16(hid[s] @ dequant(w2[experts[u]]).T)
            (XLA sums each token's k partials and casts: the reference's float32 combine)

Each grid row reads its expert's weights once, for up to T = 8 token columns (the MMA's N; past 8
tokens `cute_bridge.ops` gives an expert one row per 8 of its choices). T = 1 (one token) keeps
the lean single-row staging; T = 8 stages the named columns' activation rows (an unnamed
column's copy reads nothing and zero-fills: reading all 8 rows for every block moved 2x the
weights' bytes and ran 12x slower, session 9). Padding grid rows (experts[u] >= E) return at
once. H200, session 9, K3 E=448: batch 1 101.4 us, batch 8 640.2 us (70.8% of the copy rate;
per slot, before: 659 us est.), and the k3-h200 batch-8 step 13.40 -> 10.98 ms (the model's
routing shares experts more than the benchmark's random one). Session 11, 64 rows per block:
batch 1 94.1 us (69.4%), batch 8 551.7 us (82.1%); the batch-8 step 11.16 -> 10.27 ms.
Session 13 (ncu, batch 1): latency-bound at 25% occupancy (4 blocks per SM, capped by registers
and shared memory alike), issue slots 60% busy, DRAM 68%. Capping registers for 5 blocks spills
(122 us); one launch for gate/up, SiTU and down (per-expert counters; commit 79c928a) gained ~1%
at batch 1 and lost 10% at batch 8 (BENCHMARKS.md): neither was kept. The 64-row blocks' scale
bytes through the ring instead of registers (below): 112 / 116 -> 96 registers, no spills; batch 1
95.7 us (unchanged), batch 8 552.0 -> 527.4 us (85.9%).
Session 15, tried and not kept (commit 2f57d5e): the gated activation in gate_up's epilogue (each
block owning the same rows of w1 and w3) and down as a programmatic dependent launch of gate_up
(w2 chunks issued before griddepcontrol.wait): the XLA glue fell from ~7.4 to ~4.1 us at batch 1,
but gate_up ran 54.5 -> 56.4 us at batch 1 and 340 -> 381 us at batch 8, and PDL changed nothing
measurable (a chain of 64 calls: 106.5 vs 106.4 us). Session 16: with one cp.async group per
stage (its prologue had put both stages' weights in the first) gate_up still ran 381 us at batch
8 against 344 here, so the paired w1/w3 rows cost it; PDL with gate_up triggering its dependents
at block start gained ~1.3 us per call (chain of 64), less than that layout loses.
Session 19, not kept: one-token kernels decoding to e4m3 with fp8 `mma.sync` (docs/cute_bridge.md):
kernels 84.7 vs 87-90 us at batch 1, the XLA split of the activations +7 us of glue. Session 20
(timing only): the same kernels reading codes and scales from a tiled layout ([64-row tile,
128-column chunk, 64 rows, 64 B / 4 B], contiguous per chunk) ran batch 1 in 88 us (74.3%) and
batch 8 in 504 us (90%), against 93.5 / 529: DRAM locality. The `_tiles` entries read experts
stored that way (k3jax.mxfp4.to_tiles, K3Config.expert_layout "tiles", the default for K3 since
session 23; session 22 on the H200: batch 1 85.2 us = 76.7%, batch 8 507.8 us = 89.2%, GPU tests pass):
only the two global addresses and the word decode differ (`_issue`, `_expert_tile`, `_decode_word`):
their codes are tile words (k3jax.mxfp4.tile_words: pair a of a word is columns 2a, 2a + 1, its
bits already where the decode places them: 13 instructions a word instead of 17, session 40), so
the activations come in column order: no XLA permutation of z.

Both are the GEMV of kernels/gemv.py with a decode in front: a 128-thread block owns 16 R output
rows of expert experts[u] (grid row u; R = 1 for the plain entries, 4 for the `_rows64` ones),
its four warps split the input dimension in chunks of four 32-value scale groups, and each warp
multiplies with `mma.sync.m16n8k16` (bf16, fp32 accumulate) per 16-row tile: the decoded weight
rows are the A operand, the token columns' activation rows the B operand (T = 1: all 8 columns
the same row, column 0 stored; T = 8: column t = token t, each stored where its slot is named).
Lane (g = lane / 4, q = lane % 4) takes group q of a chunk in rows g + 8 i (i < 2R): 16 bytes
of codes (4 words of 8 codes) and one scale byte per row. The R tiles share the chunk's
activations: one staging and one shared-memory read feed R MMAs. At T = 8 the activations are
2 KB per 1 KB of one tile's codes, so sharing them pays most there (H200, K3 E=448, 16 / 32 /
64 / 128 rows: batch 8 640 / 554 / 552 / 643 us, batch 1 101 / 99 / 94 / 109 us; 128 rows:
registers and shared memory cost occupancy).

Streaming: each warp has a STAGES-deep ring of its own in shared memory. Per chunk every lane
issues `cp.async` of its 2R x 16 bytes of codes and its share of the chunk's activations (T = 1:
8 of one row's 256 bytes; T = 8: one 64-byte group of one row, as 4 x 16),
and loads its 2R scale bytes into registers (64-row blocks: copies 2 of the 8 rows' 4-byte
scale words into the slot, which the decode reads back per row), STAGES chunks ahead of the decode; the decode
waits for the chunk's group (`cp.async.wait_group`), reads the slot back (16-byte `ld.shared`,
the x groups 80 bytes apart and the rows 320, so the lanes of each 8-lane phase hit distinct
banks) and refills it. Warp syncs
order the lanes' copies and reads (no block barrier until the final sum). The gate and up blocks
run one copy of the loop on selected base addresses. Measured on the H200 (session 7, batch 1):
the ring alone gained ~1% over session 6's register loads, deeper rings lost (4 stages 7%,
8 stages 24%: occupancy and code size), a copy of the loop per matrix was 2.5% slower: bytes in
flight are not the limit, instructions (issue, fetch) are the suspects.

Decode by bit placement, two codes per 32-bit op: the bf16 bits (sign << 15) | (e1 e0 m << 6) of
an E2M1 code are its value x 2^-126 exactly (a bf16 subnormal for e = 0, as E2M1's own). For the
code pair (a, a + 4) of a word (nibbles a and a + 4, a = 0..3; a = 2, 3 from the word shifted by
8): and isolates the two nibbles, one integer multiply by (2^(12-4a) + 2^(6-4a)) places the sign
and magnitude copies (they do not overlap, so the product is the or of two shifts), and the mask
0x81C081C0 keeps sign and magnitude: 3 integer ops per pair. One exact `fma.rn.bf16x2` by the
group's factor 2^(s - 1) gives the weight, so every MMA product equals the reference's. Exact for
scale bytes EXACT_SCALES = [2, 128] (groups up to 12 in magnitude; random and real MXFP4 weights
sit near 2^-7), as the Pallas kernel (pallas_kernels/moe_experts.py); scale byte 0 gives 0, as the
reference. The programs (row order and tile words) are k3jax.mxfp4.DECODE_PROGRAMS, shared with the
Pallas kernels. Until session 21 the factor was 2^(s - 65) and the activations entered times 2^64
(bytes 59..192, and an XLA multiply of z). Versus
the exact-everywhere two-fma decode (by 2^126, then by 2^(s-127)),
3% faster at batch 1 and 4% at batch 8 (session 7). In gate_up's 16-row blocks, words alternate
between two C fragments (two independent MMA chains, summed at the end); more row tiles are
independent chains already.

The decoded pairs hold input columns (8k + a, 8k + a + 4) of word k in row order, so the
activations come in that order: `cute_bridge.ops.permute_x` regroups each 8 columns (0, 4, 1, 5,
2, 6, 3, 7) in XLA (a few KB, one launch for z; for the down projection it fuses into the GLU;
experts in tiles need neither: their pairs are columns 2a, 2a + 1), and one 16-byte read then gives a
word's four activation pairs (in-kernel `prmt` regrouping measured 3% slower at batch 1, 8% at
batch 8). The MMA sums over the same columns in another order; every product is exact in fp32
(as the reference's bf16 x bf16 products), only the summation order differs. Expert ids and
routing weights are device tensors: one compiled graph serves every step.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from k3jax import mxfp4
from cute_bridge.kernels.gemv import LANES, TILE, WARPS, mma_bf16_16816

GROUP = 32              # values per UE8M0 scale: 16 bytes of codes
CHUNK_GROUPS = 4        # groups per chunk, one per lane q
FACTOR_BIAS = mxfp4.DECODE_FACTOR_BIAS    # bf16 exponent field of the factor = scale byte + FACTOR_BIAS
EXACT_SCALES = mxfp4.DECODE_EXACT_SCALES  # the one-fma decode's exact range (k3jax.mxfp4)
STAGES = 2              # chunks per warp in flight ahead of the decode
CODE_ROW = 512          # per warp and stage: codes of rows g + 8 i (512 B each), then the activations:
X_ROW = 4 * 80          # per token column, 4 x groups of 64 B, 80 apart
SCALE_STAGE = 8 * 8 * 4  # then (eight code rows) the scale words: rows g + 8 i, 4 groups each
TILE_CHUNK = 8 * CODE_ROW  # experts in tiles: a 64-row block's chunk of codes, 4 KB (its scales: SCALE_STAGE)


def tile_code_offset(lane, i, c=0):
    """Experts in tiles (k3jax.mxfp4.to_tiles): the byte offset, from its 64-row tile, of this
    lane's 16 code bytes of row g + 8 i (g = lane // 4, group q = lane % 4) in chunk c - also where
    the rows path puts them in the ring slot (c = 0): the slot holds the chunk's tile image."""
    return c * TILE_CHUNK + i * CODE_ROW + lane * 16


def tile_scale_offset(lane, c=0):
    """Experts in tiles: the offset, from the tile's scales, of the 8 scale bytes this lane copies
    for chunk c (rows 2 lane, 2 lane + 1, four groups each: the slot's scale image)."""
    return c * SCALE_STAGE + lane * 8


# Independent MMA accumulator chains per warp and row tile (session 7, H200, 16-row blocks: two
# made gate_up 2.6% faster and down 9% slower at batch 1, 2.6% / 7% at batch 8). A 32-row block's
# two row tiles are two chains already.
GATE_UP_ACCS, DOWN_ACCS = 2, 1


@dsl_user_op
def _decode_word(word, factor, tiled: bool, *, loc=None, ip=None):
    """8 codes (Int32; tiled: a tile word) and the group's bf16x2 factor -> 4 Int32 bf16 pairs
    (k3jax.mxfp4.decode_word_ptx)."""
    ins = [cutlass.Int32(v).ir_value(loc=loc, ip=ip) for v in (word, factor)]
    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4), ins, mxfp4.decode_word_ptx(tiled),
                          "=r,=r,=r,=r,r,r")
    return [cutlass.Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


def _issue(slot, c, lane, q, groups, cols, code_rows, xsrc, named, tokens, scale_rows, scale_off=None, tiled=False):
    """Chunk c's codes (rows g + 8 i at addresses code_rows[i]) and activations (this lane's
    share; xsrc is its token row's address; T = 8: read only if `named`, else zeros are stored: an
    unnamed column is never stored, and skipping its row keeps the activation traffic to the named
    columns) into ring `slot` by cp.async; returns the rows' scale bytes (at scale_rows[i]), or,
    with scale_off (8 code rows), copies the chunk's scale words into the slot instead: this lane
    the 4 bytes (groups 4c .. 4c + 3, one per lane q) of rows g + 8 i, i = 2q, 2q + 1, at
    scale_rows[0], scale_rows[1] (returns []). Groups past the end are clamped (their factor is
    zeroed by the caller). tiled (8 code rows, k3jax.mxfp4.to_tiles' order): code_rows[i] and
    scale_rows[0] are this lane's bytes of the block's first chunk, chunk c lies c x 4 KB (c x
    256 B of scales, 8 a lane) further (`tile_code_offset`, `tile_scale_offset`): the slot's image is the same."""
    grp = cutlass.min(c * CHUNK_GROUPS + q, groups - 1)
    step = tile_code_offset(0, 0, c) if tiled else grp * 16
    for i, row in enumerate(code_rows):
        _cp_async(slot + i * CODE_ROW + lane * 16, row + cutlass.Int64(step), 16)
    x_off = len(code_rows) * CODE_ROW
    if cutlass.const_expr(tokens == 1):
        x_dst = x_off + (lane // 8) * 80 + (lane % 8) * 8
        _cp_async(slot + x_dst, xsrc + cutlass.Int64(cutlass.min(c * 128 + lane * 4, cols - 4) * 2), 8, cache="ca")
    else:
        src = xsrc + cutlass.Int64(grp * (GROUP * 2))
        read = cutlass.Int32(named) * 16
        for i in range(4):
            _cp_async(slot + x_off + (lane // 4) * X_ROW + q * 80 + i * 16, src + cutlass.Int64(i * 16), 16,
                      cache="ca", src_bytes=read)
    if scale_off is None:
        return [_ldg_u8(row + cutlass.Int64(grp)) for row in scale_rows]
    if tiled:
        _cp_async(slot + scale_off + tile_scale_offset(lane), scale_rows[0] + cutlass.Int64(tile_scale_offset(0, c)), 8,
                  cache="ca")
        return []
    g = lane // 4
    for m, row in enumerate(scale_rows):
        _cp_async(slot + scale_off + ((2 * q + m) * 8 + g) * 4, row + cutlass.Int64(c * CHUNK_GROUPS), 4, cache="ca")
    return []


def _mma_chunk(codes, factors, xs, acc: cute.Tensor, accs: int, tiled: bool):
    """acc += the chunk's 16-row tiles x 4 groups: row tile t = rows g + 16 t, g + 16 t + 8 (codes
    [2t], [2t + 1]; tiled: tile words); 2 MMAs per word, each reading the shared activations xs;
    tile t's words alternate between its accs C fragments acc[4 (t accs + a):][:4]."""
    tiles = len(codes) // 2
    d = [[[acc[4 * (t * accs + a) + i] for i in range(4)] for a in range(accs)] for t in range(tiles)]
    for k in range(4):
        xw = xs[k]
        a = k % accs
        for t in range(tiles):
            top = _decode_word(codes[2 * t][k], factors[2 * t], tiled)              # row g + 16 t
            bot = _decode_word(codes[2 * t + 1][k], factors[2 * t + 1], tiled)      # row g + 16 t + 8
            d[t][a] = mma_bf16_16816((top[0], bot[0], top[1], bot[1]), (xw[0], xw[1]), d[t][a])
            d[t][a] = mma_bf16_16816((top[2], bot[2], top[3], bot[3]), (xw[2], xw[3]), d[t][a])
    for t in range(tiles):
        for a in range(accs):
            for i in range(4):
                acc[4 * (t * accs + a) + i] = d[t][a][i]


@dsl_user_op
def _cp_async(dst, src, nbytes: int, cache: str = "cg", src_bytes=None, *, loc=None, ip=None):
    """cp.async of nbytes from global address src to shared address dst; cache "cg": L2 only (the
    streamed codes, 16 bytes), "ca": through L1 (activations, re-read by the blocks of an SM).
    src_bytes (Int32, optional): read only that many bytes, zero-filling the rest (0: no read)."""
    ops = [cutlass.Int32(dst).ir_value(loc=loc, ip=ip), cutlass.Int64(src).ir_value(loc=loc, ip=ip)]
    if src_bytes is None:
        llvm.inline_asm(None, ops, f"cp.async.{cache}.shared.global [$0], [$1], {nbytes};", "r,l",
                        has_side_effects=True)
    else:
        llvm.inline_asm(None, ops + [cutlass.Int32(src_bytes).ir_value(loc=loc, ip=ip)],
                        f"cp.async.{cache}.shared.global [$0], [$1], {nbytes}, $2;", "r,l,r", has_side_effects=True)


@dsl_user_op
def _lds128(addr, *, loc=None, ip=None):
    """16 bytes at shared address addr as 4 Int32."""
    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4), [cutlass.Int32(addr).ir_value(loc=loc, ip=ip)],
                          "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", has_side_effects=True)
    return [cutlass.Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def _lds_u8(addr, *, loc=None, ip=None):
    """The byte at shared address addr, zero-extended to Int32."""
    return cutlass.Int32(llvm.inline_asm(T.i32(), [cutlass.Int32(addr).ir_value(loc=loc, ip=ip)],
                                         "ld.shared.u8 $0, [$1];", "=r,r", has_side_effects=True))


@dsl_user_op
def _ldg_u8(addr, *, loc=None, ip=None):
    """The byte at global address addr, zero-extended to Int32."""
    return cutlass.Int32(llvm.inline_asm(T.i32(), [cutlass.Int64(addr).ir_value(loc=loc, ip=ip)],
                                         "ld.global.nc.u8 $0, [$1];", "=r,l", has_side_effects=True))


@cute.jit
def _expert_tile(wb, sb, rows, groups, x: cute.Tensor, e, row0, xrow, named, acc: cute.Tensor,
                 accs: cutlass.Constexpr, tokens: cutlass.Constexpr, row_tiles: cutlass.Constexpr,
                 tiled: cutlass.Constexpr):
    """acc (per row tile t, accs C fragments; summed into the tile's first at the end) += this
    warp's chunks of dequant(w[e, row0:row0 + 16 row_tiles]) @ x[rows of the token columns].T for
    int32 code words at global address wb ([E, rows, groups * 4]) with scale bytes at sb ([E,
    rows, groups]); x's columns in decode order. xrow: the x row this lane
    stages (tokens = 1: the one row; 8: token column lane // 4's row, copied if `named`). The row
    tiles share each chunk's activations: one staging and one shared-memory read per chunk.
    tiled (row_tiles = 4): codes and scales in k3jax.mxfp4.to_tiles' order, each chunk contiguous."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = tidx % LANES
    warp = tidx // LANES
    q = lane % 4
    r0 = row0 + lane // 4
    cols = x.shape[1]
    chunks = (groups + CHUNK_GROUPS - 1) // CHUNK_GROUPS
    count = (chunks - warp + WARPS - 1) // WARPS            # this warp's chunks: warp + WARPS * j
    code_rows = 2 * row_tiles                               # rows g + 8 i of this lane, i < code_rows
    x_off = code_rows * CODE_ROW
    # Eight code rows: the scale bytes travel through the ring (16 registers and 12 address
    # registers fewer per lane than holding them in flight: a fifth block per SM); needs groups % 4 == 0.
    smem_scales = code_rows == 2 * CHUNK_GROUPS
    scale_off = x_off + X_ROW * tokens
    smem = cutlass.memory.SmemAllocator()
    stage_bytes = scale_off + (SCALE_STAGE if smem_scales else 0)
    ring = smem.allocate_tensor(cutlass.Int32, cute.make_layout((WARPS * STAGES * stage_bytes // 4,)),
                                16).iterator.toint() + warp * (STAGES * stage_bytes)
    if cutlass.const_expr(tiled):     # this lane's bytes of chunk 0 of the block's tile
        tile = cutlass.Int64(e * rows + row0)
        w_rows = [wb + tile * cutlass.Int64(groups * 16) + cutlass.Int64(tile_code_offset(lane, i))
                  for i in range(code_rows)]
        s_rows = [sb + tile * cutlass.Int64(groups) + cutlass.Int64(tile_scale_offset(lane))]
    else:
        top = wb + cutlass.Int64(e * rows + r0) * cutlass.Int64(groups * 16)
        s_top = sb + cutlass.Int64(e * rows + r0) * cutlass.Int64(groups)
        w_rows = [top + cutlass.Int64(8 * i * groups * 16) for i in range(code_rows)]
        s_rows = ([s_top + cutlass.Int64(8 * (2 * q + m) * groups) for m in range(2)] if smem_scales
                  else [s_top + cutlass.Int64(8 * i * groups) for i in range(code_rows)])
    xsrc = x.iterator.toint() + cutlass.Int64(xrow) * cutlass.Int64(cols * 2)
    x_read = x_off + q * 80 + ((lane // 4) * X_ROW if tokens > 1 else 0)      # column g's activations
    if cutlass.const_expr(not smem_scales):
        raw = cute.make_rmem_tensor((code_rows * STAGES,), cutlass.Int32)   # scale bytes per row and slot

    src = (lane, q, groups, cols, w_rows, xsrc, named, tokens, s_rows, scale_off if smem_scales else None, tiled)
    for u in cutlass.range_constexpr(STAGES):
        if u < count:
            scales = _issue(ring + u * stage_bytes, warp + u * WARPS, *src)
            if cutlass.const_expr(not smem_scales):
                for h in cutlass.range_constexpr(code_rows):
                    raw[code_rows * u + h] = scales[h]
        cute.arch.cp_async_commit_group()
    for j0 in cutlass.range(0, count, STAGES):
        for u in cutlass.range_constexpr(STAGES):
            j = j0 + u
            if j < count:
                # Groups committed so far: STAGES + j; all but the newest STAGES - 1 done = chunk j.
                cute.arch.cp_async_wait_group(STAGES - 1)
                cute.arch.sync_warp()                      # every lane's copies of slot u visible
                slot = ring + u * stage_bytes
                codes = [_lds128(slot + i * CODE_ROW + lane * 16) for i in range(code_rows)]
                xs = [_lds128(slot + x_read + k * 16) for k in range(4)]
                c = warp + j * WARPS
                valid = cutlass.Int32(c * CHUNK_GROUPS + q < groups)
                if cutlass.const_expr(smem_scales):
                    bytes_ = [_lds_u8(slot + scale_off + (h * 8 + lane // 4) * 4 + q) for h in range(code_rows)]
                else:
                    bytes_ = [raw[code_rows * u + h] for h in range(code_rows)]
                factors = [(b + FACTOR_BIAS) * (valid * cutlass.Int32(b != 0)) * 0x00800080 for b in bytes_]
                cute.arch.sync_warp()                      # slot u read by every lane: refill it
                if j + STAGES < count:
                    scales = _issue(slot, c + STAGES * WARPS, *src)
                    if cutlass.const_expr(not smem_scales):
                        for h in cutlass.range_constexpr(code_rows):
                            raw[code_rows * u + h] = scales[h]
                cute.arch.cp_async_commit_group()
                _mma_chunk(codes, factors, xs, acc, accs, tiled)
    if cutlass.const_expr(accs == 2):
        for t in cutlass.range_constexpr(row_tiles):
            for i in cutlass.range_constexpr(4):
                acc[8 * t + i] = acc[8 * t + i] + acc[8 * t + 4 + i]


@cute.jit
def _column_sums(acc: cute.Tensor, tokens: cutlass.Constexpr, row_tiles: cutlass.Constexpr, accs: cutlass.Constexpr):
    """The four warps' C fragments summed through shared memory (one buffer, one barrier), valid in
    warp 0: element 4 t + i holds row g + 16 t + 8 (i // 2), token column 2q + i % 2 (T = 1: only
    the column-0 elements i = 0, 2)."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = tidx % LANES
    kept = [4 * t + i for t in range(row_tiles) for i in range(4) if tokens > 1 or i % 2 == 0]
    smem = cutlass.memory.SmemAllocator()
    part = smem.allocate_tensor(cutlass.Float32, cute.make_layout((len(kept) * WARPS * LANES,)), 16)
    for n, ti in enumerate(kept):
        part[(n * WARPS + tidx // LANES) * LANES + lane] = acc[accs * 4 * (ti // 4) + ti % 4]
    cute.arch.sync_threads()
    total = [None] * (4 * row_tiles)
    for n, ti in enumerate(kept):
        base = n * WARPS * LANES + lane
        total[ti] = part[base] + part[base + LANES] + part[base + 2 * LANES] + part[base + 3 * LANES]
    return total


@cute.jit
def _slot_of(slots: cute.Tensor, u, j: cutlass.Constexpr):
    """The slot of the token column this warp-0 lane stores with fragment column j (T = 1: column 0,
    lanes q = 0 only), or -1 (nothing to store)."""
    tidx, _, _ = cute.arch.thread_idx()
    q = tidx % 4
    s = cutlass.Int32(-1)
    if tidx < LANES:
        if cutlass.const_expr(slots.shape[1] > 1):
            s = slots[u, 2 * q + j]
        elif q == 0:
            s = slots[u, 0]
    return s


@cute.jit
def _token_row(slots: cute.Tensor, u, tokens: cutlass.Constexpr, div):
    """(The activation row this lane stages, whether its column is named): token column lane // 4
    (T = 1: column 0), read at slot // div."""
    tidx, _, _ = cute.arch.thread_idx()
    slot = slots[u, (tidx % LANES) // 4 if tokens > 1 else 0]
    return cutlass.max(slot, 0) // div, slot >= 0


@cute.kernel
def _gate_up_kernel(z: cute.Tensor, experts: cute.Tensor, slots: cute.Tensor, w1: cute.Tensor, s1: cute.Tensor,
                    w3: cute.Tensor, s3: cute.Tensor, gate: cute.Tensor, up: cute.Tensor,
                    row_tiles: cutlass.Constexpr, tiled: cutlass.Constexpr):
    bidx, u, _ = cute.arch.block_idx()
    e = experts[u]
    if e < w1.shape[0]:
        tokens = slots.shape[1]
        accs = GATE_UP_ACCS if cutlass.const_expr(row_tiles == 1) else 1
        tiles = w1.shape[1] // (TILE * row_tiles)
        is_up = bidx >= tiles
        row0 = (bidx - tiles * cutlass.Int32(is_up)) * (TILE * row_tiles)
        acc = cute.make_rmem_tensor((4 * accs * row_tiles,), cutlass.Float32)
        acc.fill(0.0)
        # One copy of the loop for both matrices (instruction cache): select the base addresses.
        up_i = cutlass.Int64(is_up)
        wb = w1.iterator.toint() + up_i * (w3.iterator.toint() - w1.iterator.toint())
        sb = s1.iterator.toint() + up_i * (s3.iterator.toint() - s1.iterator.toint())
        xrow, named = _token_row(slots, u, tokens, gate.shape[0] // z.shape[0])   # slot // k = token
        _expert_tile(wb, sb, w1.shape[1], s1.shape[2], z, e, row0, xrow, named, acc, accs, tokens, row_tiles, tiled)
        total = _column_sums(acc, tokens, row_tiles, accs)
        row = row0 + (cute.arch.thread_idx()[0] % LANES) // 4
        for j in cutlass.range_constexpr(2 if tokens > 1 else 1):
            slot = _slot_of(slots, u, j)
            if slot >= 0:
                for t in cutlass.range_constexpr(row_tiles):
                    for h in cutlass.range_constexpr(2):      # rows g + 16 t + 8 h
                        v = total[4 * t + 2 * h + j]
                        if is_up:
                            up[slot, row + 16 * t + 8 * h] = v.to(up.element_type)
                        else:
                            gate[slot, row + 16 * t + 8 * h] = v.to(gate.element_type)


@cute.kernel
def _down_kernel(hid: cute.Tensor, experts: cute.Tensor, slots: cute.Tensor, weights: cute.Tensor,
                 w2: cute.Tensor, s2: cute.Tensor, part: cute.Tensor, row_tiles: cutlass.Constexpr,
                 tiled: cutlass.Constexpr):
    bidx, u, _ = cute.arch.block_idx()
    e = experts[u]
    if e < w2.shape[0]:
        tokens = slots.shape[1]
        row0 = bidx * (TILE * row_tiles)
        acc = cute.make_rmem_tensor((4 * DOWN_ACCS * row_tiles,), cutlass.Float32)
        acc.fill(0.0)
        xrow, named = _token_row(slots, u, tokens, 1)
        _expert_tile(w2.iterator.toint(), s2.iterator.toint(), w2.shape[1], s2.shape[2], hid, e, row0, xrow, named,
                     acc, DOWN_ACCS, tokens, row_tiles, tiled)
        total = _column_sums(acc, tokens, row_tiles, DOWN_ACCS)
        row = row0 + (cute.arch.thread_idx()[0] % LANES) // 4
        for j in cutlass.range_constexpr(2 if tokens > 1 else 1):
            slot = _slot_of(slots, u, j)
            if slot >= 0:
                for t in cutlass.range_constexpr(row_tiles):
                    for h in cutlass.range_constexpr(2):      # rows g + 16 t + 8 h
                        # The reference rounds each expert's output to the activation dtype before combining.
                        v = total[4 * t + 2 * h + j].to(hid.element_type).to(cutlass.Float32)
                        part[slot, row + 16 * t + 8 * h] = weights[slot] * v


def _launch_gate_up(z, experts, slots, w1, s1, w3, s3, gate, up, stream, rows: int, tiled: bool = False):
    grid = (2 * (w1.shape[1] // rows), experts.shape[0], 1)
    _gate_up_kernel(z, experts, slots, w1, s1, w3, s3, gate, up, rows // TILE, tiled).launch(
        grid=grid, block=(WARPS * LANES, 1, 1), stream=stream)


def _launch_down(hid, experts, slots, weights, w2, s2, part, stream, rows: int, tiled: bool = False):
    grid = (w2.shape[1] // rows, experts.shape[0], 1)
    _down_kernel(hid, experts, slots, weights, w2, s2, part, rows // TILE, tiled).launch(
        grid=grid, block=(WARPS * LANES, 1, 1), stream=stream)


@cute.jit
def gate_up(z: cute.Tensor, experts: cute.Tensor, slots: cute.Tensor, w1: cute.Tensor, s1: cute.Tensor,
            w3: cute.Tensor, s3: cute.Tensor, gate: cute.Tensor, up: cute.Tensor, stream: cuda.CUstream):
    """z [N, M] bf16 (columns in decode order: cute_bridge.ops.permute_x), experts [U] int32, slots [U, T]
    int32 (T static, one of kernel_set.MOE_TOKENS), w1/w3 int32 [E, I, M/8], s1/s3 uint8 [E, I, M/32] -> gate, up
    [S, I] bf16 at the named slots (I % 16 == 0; S = N * k). 16 rows per block."""
    _launch_gate_up(z, experts, slots, w1, s1, w3, s3, gate, up, stream, TILE)


@cute.jit
def down(hid: cute.Tensor, experts: cute.Tensor, slots: cute.Tensor, weights: cute.Tensor, w2: cute.Tensor,
         s2: cute.Tensor, part: cute.Tensor, stream: cuda.CUstream):
    """hid [S, I] bf16 (columns in decode order), experts [U] int32, slots [U, T]
    int32, weights [S] f32, w2 int32 [E, M, I/8], s2 uint8 [E, M, I/32] -> part [S, M] f32 at the
    named slots (M % 16 == 0). 16 rows per block."""
    _launch_down(hid, experts, slots, weights, w2, s2, part, stream, TILE)


@cute.jit
def gate_up_rows64(z: cute.Tensor, experts: cute.Tensor, slots: cute.Tensor, w1: cute.Tensor, s1: cute.Tensor,
                   w3: cute.Tensor, s3: cute.Tensor, gate: cute.Tensor, up: cute.Tensor, stream: cuda.CUstream):
    """`gate_up` with 64 rows per block: four row tiles share each activation read (I % 64 == 0)."""
    _launch_gate_up(z, experts, slots, w1, s1, w3, s3, gate, up, stream, 4 * TILE)


@cute.jit
def down_rows64(hid: cute.Tensor, experts: cute.Tensor, slots: cute.Tensor, weights: cute.Tensor, w2: cute.Tensor,
                s2: cute.Tensor, part: cute.Tensor, stream: cuda.CUstream):
    """`down` with 64 rows per block (M % 64 == 0)."""
    _launch_down(hid, experts, slots, weights, w2, s2, part, stream, 4 * TILE)


@cute.jit
def gate_up_rows64_tiles(z: cute.Tensor, experts: cute.Tensor, slots: cute.Tensor, w1: cute.Tensor, s1: cute.Tensor,
                         w3: cute.Tensor, s3: cute.Tensor, gate: cute.Tensor, up: cute.Tensor, stream: cuda.CUstream):
    """`gate_up_rows64` over experts stored in tiles (k3jax.mxfp4.to_tiles; M % 128 == 0): z in
    column order (the tiles' codes are paired)."""
    _launch_gate_up(z, experts, slots, w1, s1, w3, s3, gate, up, stream, 4 * TILE, True)


@cute.jit
def down_rows64_tiles(hid: cute.Tensor, experts: cute.Tensor, slots: cute.Tensor, weights: cute.Tensor,
                      w2: cute.Tensor, s2: cute.Tensor, part: cute.Tensor, stream: cuda.CUstream):
    """`down_rows64` over experts stored in tiles (k3jax.mxfp4.to_tiles; I % 128 == 0): hid in
    column order."""
    _launch_down(hid, experts, slots, weights, w2, s2, part, stream, 4 * TILE, True)
