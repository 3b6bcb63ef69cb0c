"""MXFP4 W4A16 routed experts for decode, in two launches around the (XLA) gated activation:

  gate_up:  gate, up [S, I] bf16 = z[s // k] @ dequant(w1|w3[ids[s]]).T          (S = N * k slots)
  down:     part [S, M] f32      = weights[s] * bf16(hid[s] @ dequant(w2[ids[s]]).T)
            (XLA sums each token's k partials and casts: the reference's float32 combine)

Both are the GEMV of kernels/gemv.py with a decode in front: a 128-thread block owns 16 output
rows of one slot's expert, its four warps split the input dimension in chunks of four 32-value
scale groups, and each warp multiplies with `mma.sync.m16n8k16` (bf16, fp32 accumulate): the
decoded weight rows are the A operand, the slot's activation row the B operand (all 8 columns
the same row; column 0 is stored). Lane (g = lane / 4, q = lane % 4) takes group q of a chunk in
rows g and g + 8: one 16-byte load of codes (4 words of 8 codes) and one scale byte per row.

Decode by bit placement, two codes per 32-bit op: the bf16 bits (sign << 15) | (e1 e0 m << 6) of
an E2M1 code are its value x 2^-126 exactly (a bf16 subnormal for e = 0, as E2M1's own). For the
code pair (a, a + 4) of a word (nibbles a and a + 4, a = 0..3; a = 2, 3 from the word shifted by
8): and isolates the two nibbles, one integer multiply by (2^(12-4a) + 2^(6-4a)) places the sign
and magnitude copies (they do not overlap, so the product is the or of two shifts), and the mask
0x81C081C0 keeps sign and magnitude: 3 integer ops per pair. Two exact `fma.rn.bf16x2`, by 2^126
and by the scale 2^(s-127), give the reference's dequantised bf16 pair for every scale byte. (One
fma by 2^(s-1), exact only up to s = 128, measured no faster: the kernels are not issue-bound.)

The decoded pairs hold input columns (8k + a, 8k + a + 4) of word k, so the activations come in
that order: `cute_bridge.ops.permute_x` regroups each 8 columns (0, 4, 1, 5, 2, 6, 3, 7) in XLA
(a few KB; for the down projection it fuses into the GLU), and one 16-byte load then gives a
word's four activation pairs (in-kernel `prmt` regrouping measured 3% slower at batch 1, 8% at
batch 8). The MMA sums over the same columns in another order; every product is exact in fp32
(as the reference's bf16 x bf16 products), only the summation order differs. Each warp has the
codes and activations of UNROLL chunks in flight before it decodes the first (measured on the
H200, session 6: loading the activations at the decode instead, with 3-4 chunks of codes in
flight, was 13% slower). Expert ids and routing weights are device
tensors: one compiled graph serves every step.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from cute_bridge.kernels.gemv import LANES, TILE, WARPS, mma_bf16_16816

GROUP = 32              # values per UE8M0 scale: one 16-byte load of codes
CHUNK_GROUPS = 4        # groups per chunk, one per lane q
PAIR_BITS = 0x81C081C0  # sign and magnitude bits of two bf16 codes
TWO_126 = 0x7E807E80    # bf16 2^126 in both halves
NEG_ZERO2 = 0x80008000  # fma addend: x * s + (-0) = x * s exactly, signed zeros kept
UNROLL = 2              # chunks per warp with their codes and activations in flight before the decode


def decode_word_ptx() -> str:
    """PTX: $0..$3 = the scaled bf16 pairs (codes a, a + 4), a = 0..3, of word $4 (codes c0..c7
    in nibbles 0..7); $5 = bf16x2 2^126, $6 = bf16x2 scale 2^(s-127) (0 for s = 0, as the
    reference). Per pair: and, mul, and (the bit placement), two exact fmas."""
    lines = ["{", ".reg .b32 t, n, u, nz;", f"mov.b32 nz, 0x{NEG_ZERO2:08X};", "shr.u32 t, $4, 8;"]
    for out, (src, a) in enumerate((("$4", 0), ("$4", 1), ("t", 0), ("t", 1))):
        lines += [f"and.b32 n, {src}, 0x{0x000F000F << 4 * a:08X};",
                  f"mul.lo.u32 n, n, 0x{(1 << 12 - 4 * a) + (1 << 6 - 4 * a):X};",
                  f"and.b32 n, n, 0x{PAIR_BITS:08X};",
                  "fma.rn.bf16x2 u, n, $5, nz;", f"fma.rn.bf16x2 ${out}, u, $6, nz;"]
    return "\n\t".join(lines + ["}"])


@dsl_user_op
def _decode_word(word, scale2, *, loc=None, ip=None):
    """8 codes (Int32) and the group's bf16x2 scale -> 4 Int32 bf16 pairs (see module doc)."""
    ins = [cutlass.Int32(v).ir_value(loc=loc, ip=ip) for v in (word, TWO_126, scale2)]
    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4), ins, decode_word_ptx(),
                          "=r,=r,=r,=r,r,r,r")
    return [cutlass.Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


def _load_chunk(w: cute.Tensor, s: cute.Tensor, x: cute.Tensor, e, r0, xrow, chunk, q):
    """Lane q's group of `chunk` in rows r0 and r0 + 8: (codes of row r0, codes of row r0 + 8 as
    4 Int32 words each, the bf16x2 scale 2^(s-127) of each row (0 for a group past the end), the
    group's activations as 4 x 4 Int32 pairs in decode order)."""
    groups = s.shape[2]
    grp = chunk * CHUNK_GROUPS + q
    valid = cutlass.Int32(grp < groups)
    grp = cutlass.min(grp, groups - 1)
    wv = cute.zipped_divide(w, (1, 1, 4))
    xv = cute.zipped_divide(x, (1, 8))
    # Words as scalars here, before any branch: a TensorSSA caches its layout on first indexing.
    codes = [wv[(None, (e, r, grp))].load() for r in (r0, r0 + 8)]
    codes = [[v[i] for i in range(4)] for v in codes]
    scales = [cutlass.Int32(s[e, r, grp]) * valid * 0x00800080 for r in (r0, r0 + 8)]
    xs = [xv[(None, (xrow, grp * (GROUP // 8) + k))].load().bitcast(cutlass.Int32) for k in range(4)]
    return codes, scales, [[v[i] for i in range(4)] for v in xs]


def _mma_chunk(loaded, acc: cute.Tensor):
    """acc += the chunk's 16 rows x 4 groups (2 MMAs per word)."""
    codes, scales, xs = loaded
    d = [acc[0], acc[1], acc[2], acc[3]]
    for k in range(4):
        top = _decode_word(codes[0][k], scales[0])          # row g
        bot = _decode_word(codes[1][k], scales[1])          # row g + 8
        xw = xs[k]
        d = mma_bf16_16816((top[0], bot[0], top[1], bot[1]), (xw[0], xw[1]), d)
        d = mma_bf16_16816((top[2], bot[2], top[3], bot[3]), (xw[2], xw[3]), d)
    for i in range(4):
        acc[i] = d[i]


@cute.jit
def _expert_tile(w: cute.Tensor, s: cute.Tensor, x: cute.Tensor, e, row0, xrow, acc: cute.Tensor):
    """acc (the MMA's C fragment) += this warp's chunks of dequant(w[e, row0:row0+16]) @ x[xrow]
    (x's columns in decode order)."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = tidx % LANES
    warp = tidx // LANES
    q = lane % 4
    r0 = row0 + lane // 4
    chunks = (s.shape[2] + CHUNK_GROUPS - 1) // CHUNK_GROUPS
    count = (chunks - warp + WARPS - 1) // WARPS            # this warp's chunks: warp + WARPS * j
    main = count - count % UNROLL
    for j0 in cutlass.range(0, main, UNROLL):
        loaded = [_load_chunk(w, s, x, e, r0, xrow, warp + (j0 + u) * WARPS, q) for u in range(UNROLL)]
        for u in cutlass.range_constexpr(UNROLL):
            _mma_chunk(loaded[u], acc)
    for j in cutlass.range(main, count):
        _mma_chunk(_load_chunk(w, s, x, e, r0, xrow, warp + j * WARPS, q), acc)


@cute.jit
def _block_sum(acc: cute.Tensor, i: cutlass.Constexpr):
    """Sum of element i of the four warps' C fragments (shared memory), valid in warp 0."""
    tidx, _, _ = cute.arch.thread_idx()
    smem = cutlass.memory.SmemAllocator()
    part = smem.allocate_tensor(cutlass.Float32, cute.make_layout((LANES, WARPS)), 16)
    part[tidx % LANES, tidx // LANES] = acc[i]
    cute.arch.sync_threads()
    lane = tidx % LANES
    return part[lane, 0] + part[lane, 1] + part[lane, 2] + part[lane, 3]


@cute.kernel
def _gate_up_kernel(z: cute.Tensor, ids: cute.Tensor, w1: cute.Tensor, s1: cute.Tensor,
                    w3: cute.Tensor, s3: cute.Tensor, gate: cute.Tensor, up: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, slot, _ = cute.arch.block_idx()
    tiles = w1.shape[1] // TILE
    e = ids[slot]
    xrow = slot // (ids.shape[0] // z.shape[0])
    is_up = bidx >= tiles
    row0 = (bidx - tiles * cutlass.Int32(is_up)) * TILE
    acc = cute.make_rmem_tensor((4,), cutlass.Float32)
    acc.fill(0.0)
    if is_up:
        _expert_tile(w3, s3, z, e, row0, xrow, acc)
    else:
        _expert_tile(w1, s1, z, e, row0, xrow, acc)
    # C fragment: lanes q = 0 hold column 0 of rows g (element 0) and g + 8 (element 2).
    top = _block_sum(acc, 0)
    bot = _block_sum(acc, 2)
    lane = tidx % LANES
    if tidx < LANES and lane % 4 == 0:
        row = row0 + lane // 4
        if is_up:
            up[slot, row] = top.to(up.element_type)
            up[slot, row + 8] = bot.to(up.element_type)
        else:
            gate[slot, row] = top.to(gate.element_type)
            gate[slot, row + 8] = bot.to(gate.element_type)


@cute.kernel
def _down_kernel(hid: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, w2: cute.Tensor,
                 s2: cute.Tensor, part: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, slot, _ = cute.arch.block_idx()
    row0 = bidx * TILE
    acc = cute.make_rmem_tensor((4,), cutlass.Float32)
    acc.fill(0.0)
    _expert_tile(w2, s2, hid, ids[slot], row0, slot, acc)
    top = _block_sum(acc, 0)
    bot = _block_sum(acc, 2)
    lane = tidx % LANES
    if tidx < LANES and lane % 4 == 0:
        row = row0 + lane // 4
        # The reference rounds each expert's output to the activation dtype before combining.
        part[slot, row] = weights[slot] * top.to(hid.element_type).to(cutlass.Float32)
        part[slot, row + 8] = weights[slot] * bot.to(hid.element_type).to(cutlass.Float32)


@cute.jit
def gate_up(z: cute.Tensor, ids: cute.Tensor, w1: cute.Tensor, s1: cute.Tensor, w3: cute.Tensor,
            s3: cute.Tensor, gate: cute.Tensor, up: cute.Tensor, stream: cuda.CUstream):
    """z [N, M] bf16 (columns in decode order), ids [S] int32, w1/w3 int32 [E, I, M/8], s1/s3
    uint8 [E, I, M/32] -> gate, up [S, I] bf16 (I % 16 == 0)."""
    grid = (2 * (w1.shape[1] // TILE), ids.shape[0], 1)
    _gate_up_kernel(z, ids, w1, s1, w3, s3, gate, up).launch(grid=grid, block=(WARPS * LANES, 1, 1), stream=stream)


@cute.jit
def down(hid: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, w2: cute.Tensor, s2: cute.Tensor,
         part: cute.Tensor, stream: cuda.CUstream):
    """hid [S, I] bf16 (columns in decode order), ids [S] int32, weights [S] f32, w2 int32
    [E, M, I/8], s2 uint8 [E, M, I/32] -> part [S, M] f32 (M % 16 == 0)."""
    grid = (w2.shape[1] // TILE, ids.shape[0], 1)
    _down_kernel(hid, ids, weights, w2, s2, part).launch(grid=grid, block=(WARPS * LANES, 1, 1), stream=stream)
