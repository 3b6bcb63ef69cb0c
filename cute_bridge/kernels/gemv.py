"""bf16 skinny GEMM on the tensor cores: y [R, N] = x [R, K] @ w [N, K].T, R <= 8, float32 accumulation.

Decode is bandwidth-bound on w, so the kernel's job is to stream w once at the copy rate with as
little work per byte as possible. A 128-thread block owns a tile of 16 output rows; its four warps
split the tile's K range (32-column chunks, interleaved) and each warp multiplies with warp-level
`mma.sync.m16n8k16` (bf16 in, fp32 accumulate): w's 16 rows are the A operand, the <= 8 rows of x
the B operand (columns >= R are padding: they repeat x's last row and are never stored).

No shuffles and no shared-memory staging of w: every operand register comes from one 16-byte
load. Lane (g = lane / 4, q = lane % 4) loads columns 8q..8q+7 of a chunk from w rows g and g + 8
and from x row g: pairs 0/1 of those loads are the operands of the chunk's first MMA, pairs 2/3
of its second. The MMA's k index then visits the chunk's columns in another order than memory
(k = 2q + {0, 1, 8, 9} is column 8q + {0, 1, 2, 3}), the same order for w and x, so the dot
product is unchanged. Per 1 KB of w a warp issues two w loads, one x load (L1 resident) and two
MMAs; UNROLL chunks (8 w loads per lane) are in flight before the first MMA.

The four warps' accumulators are summed through shared memory. `gemv` stores bf16 y; `gemv_split`
additionally splits K over grid.y = S blocks per tile and stores float32 partials [S, R, N] that
XLA sums (for narrow matrices: N / 16 tiles alone cannot fill 132 SMs). Out-of-range rows are
clamped on load and not stored; columns >= K and chunks past a warp's range are zeroed by mask.

`gemv_simt` is the one-row kernel: a warp per output row streaming w[n, :] in 16-byte vectors
with SIMT fp32 FMAs. With one x row there is nothing to share, and its long contiguous row
reads measured faster than the MMA kernel's 16-row tiles on the H200 (session 6: 40.2 vs 45.0
us for 12288 x 7168, 504 vs 565 us for the lm_head); `cute_bridge.ops` routes one row there.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

VEC = 8            # bf16 per 16-byte load
CHUNK = 32         # K columns per chunk: 4 lanes x 8, two m16n8k16 MMAs
TILE = 16          # output rows per block (the MMA's M)
WARPS = 4          # warps per block, splitting the tile's chunks
UNROLL = 4         # chunks per warp with loads in flight before the MMAs
LANES = 32


@dsl_user_op
def mma_bf16_16816(a, b, c, *, loc=None, ip=None):
    """D = A @ B + C for one m16n8k16 bf16 MMA: a 4 x Int32 (bf16 pairs), b 2 x Int32, c 4 x
    Float32 in PTX's fragment order -> 4 x Float32."""
    operands = ([cutlass.Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, *b)]
                + [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in c])
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4), operands,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    return [cutlass.Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@cute.jit
def _chunk_words(t: cute.Tensor, row, col, mask):
    """The 16-byte vector t[row, col:col+8] as 4 Int32 words (bf16 pairs), and-ed with mask."""
    v = cute.zipped_divide(t, (1, VEC))[(None, (row, col // VEC))].load().bitcast(cutlass.Int32)
    return [v[i] & mask for i in range(4)]


@cute.jit
def _tile_dot(x: cute.Tensor, w: cute.Tensor, acc: cute.Tensor, rows: cutlass.Constexpr, c_lo, c_hi):
    """acc (4 x Float32, the MMA's C fragment) += this warp's chunks in [c_lo, c_hi) of the tile."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = tidx % LANES
    warp = tidx // LANES
    g = lane // 4
    q = lane % 4
    n_rows = w.shape[0]
    k = w.shape[1]
    r0 = cutlass.min(bidx * TILE + g, n_rows - 1)
    r1 = cutlass.min(bidx * TILE + g + 8, n_rows - 1)
    xr = cutlass.min(g, rows - 1)
    first = c_lo + warp
    count = (c_hi - first + WARPS - 1) // WARPS        # this warp's chunks: first + WARPS * j
    # Whole UNROLL groups: chunks past the warp's range are clamped and masked to zero, so the
    # last group keeps as many loads in flight as the others (no serial tail).
    for j0 in cutlass.range(0, count, UNROLL):
        loads = []
        for u in cutlass.range_constexpr(UNROLL):
            j = j0 + u
            col = (first + j * WARPS) * CHUNK + VEC * q
            mask = cutlass.Int32(0) - cutlass.Int32((col < k) & (j < count))
            col = cutlass.min(col, k - VEC)
            loads.append((_chunk_words(w, r0, col, mask), _chunk_words(w, r1, col, mask),
                          _chunk_words(x, xr, col, mask)))
        # First halves of every chunk, then second halves: the first MMAs use every chunk's loads,
        # so ptxas keeps them all in flight rather than sinking later loads to their use.
        d = [acc[0], acc[1], acc[2], acc[3]]
        for h in cutlass.range_constexpr(2):
            for p, s, b in loads:
                d = mma_bf16_16816((p[2 * h], s[2 * h], p[2 * h + 1], s[2 * h + 1]), (b[2 * h], b[2 * h + 1]), d)
        for i in cutlass.range_constexpr(4):
            acc[i] = d[i]


@cute.kernel
def _gemv_kernel(x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, rows: cutlass.Constexpr,
                 split: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, sidx, _ = cute.arch.block_idx()
    lane = tidx % LANES
    warp = tidx // LANES
    chunks = (w.shape[1] + CHUNK - 1) // CHUNK
    c_lo = 0
    c_hi = chunks
    if cutlass.const_expr(split):
        per = (chunks + y.shape[0] - 1) // y.shape[0]
        c_lo = cutlass.min(sidx * per, chunks)
        c_hi = cutlass.min(c_lo + per, chunks)
    acc = cute.make_rmem_tensor((4,), cutlass.Float32)
    acc.fill(0.0)
    _tile_dot(x, w, acc, rows, c_lo, c_hi)

    smem = cutlass.memory.SmemAllocator()
    part = smem.allocate_tensor(cutlass.Float32, cute.make_layout((4, LANES, WARPS)), 16)
    for i in cutlass.range_constexpr(4):
        part[i, lane, warp] = acc[i]
    cute.arch.sync_threads()
    if warp == 0:
        g = lane // 4
        q = lane % 4
        for i in cutlass.range_constexpr(4):
            total = part[i, lane, 0] + part[i, lane, 1] + part[i, lane, 2] + part[i, lane, 3]
            row = bidx * TILE + g + 8 * (i // 2)          # C fragment: c0, c1 row g; c2, c3 row g + 8
            tok = 2 * q + i % 2
            if tok < rows and row < w.shape[0]:
                if cutlass.const_expr(split):
                    y[sidx, tok, row] = total
                else:
                    y[tok, row] = total.to(y.element_type)


@cute.kernel
def _gemv_simt_kernel(x: cute.Tensor, w: cute.Tensor, y: cute.Tensor):
    """One x row: a warp per output row n streams w[n, :] in 16-byte vectors, UNROLL in flight per
    lane, x read from L1; butterfly-shuffle reduction, lane 0 stores."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = tidx % LANES
    n = bidx * WARPS + tidx // LANES
    xv = cute.zipped_divide(x, (1, VEC))        # ((1, VEC), (1, K / VEC))
    wv = cute.zipped_divide(w, (1, VEC))        # ((1, VEC), (N, K / VEC))
    k_vec = w.shape[1] // VEC
    step = LANES * UNROLL
    k_main = (k_vec // step) * step
    acc = cutlass.Float32(0.0)
    if n < w.shape[0]:
        for j0 in cutlass.range(0, k_main, step):
            wf = [wv[(None, (n, j0 + u * LANES + lane))].load().to(cutlass.Float32) for u in range(UNROLL)]
            for u in cutlass.range_constexpr(UNROLL):
                xf = xv[(None, (0, j0 + u * LANES + lane))].load().to(cutlass.Float32)
                acc = acc + (wf[u] * xf).reduce(cute.ReductionOp.ADD, 0.0, 0)
        for j in cutlass.range(k_main + lane, k_vec, LANES):
            xf = xv[(None, (0, j))].load().to(cutlass.Float32)
            acc = acc + (wv[(None, (n, j))].load().to(cutlass.Float32) * xf).reduce(cute.ReductionOp.ADD, 0.0, 0)
        total = cute.arch.warp_reduction(acc, operator.add)
        if lane == 0:
            y[0, n] = total.to(y.element_type)


@cute.jit
def gemv_simt(x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream):
    """x [1, K] bf16, w [N, K] bf16 -> y [1, N] bf16 (K % 8 == 0): the one-row kernel."""
    grid = ((w.shape[0] + WARPS - 1) // WARPS, 1, 1)
    _gemv_simt_kernel(x, w, y).launch(grid=grid, block=(WARPS * LANES, 1, 1), stream=stream)


@cute.jit
def gemv(x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream):
    """x [R, K] bf16, w [N, K] bf16 -> y [R, N] bf16 (R static <= 8, N and K dynamic, K % 8 == 0)."""
    grid = ((w.shape[0] + TILE - 1) // TILE, 1, 1)
    _gemv_kernel(x, w, y, x.shape[0], False).launch(grid=grid, block=(WARPS * LANES, 1, 1), stream=stream)


@cute.jit
def gemv_split(x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream):
    """x [R, K] bf16, w [N, K] bf16 -> y [S, R, N] float32 partial sums over S slices of K."""
    grid = ((w.shape[0] + TILE - 1) // TILE, y.shape[0], 1)
    _gemv_kernel(x, w, y, x.shape[0], True).launch(grid=grid, block=(WARPS * LANES, 1, 1), stream=stream)
