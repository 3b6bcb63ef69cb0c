"""bf16 skinny GEMM (GEMV at batch 1): y [R, N] = x [R, K] @ w [N, K].T, float32 accumulation.

Decode is bandwidth-bound on w: each warp owns one output row n and streams w[n, :] once in
16-byte vectors (8 bf16 per lane per load, four loads in flight per lane before any math), while x
(R*K*2 bytes, a few KB) is re-read from L1. The R rows of x share every weight load, so the cost
is one pass over w for any R <= 8. Lanes reduce with butterfly shuffles; lane 0 stores.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

VEC = 8            # bf16 per 16-byte load
UNROLL = 4         # independent 16-byte loads per lane in flight
WARPS = 4          # rows per 128-thread block
LANES = 32


@cute.kernel
def _gemv_kernel(x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, rows: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = tidx % LANES
    n = bidx * WARPS + tidx // LANES
    xv = cute.zipped_divide(x, (1, VEC))        # ((1, VEC), (R, K / VEC))
    wv = cute.zipped_divide(w, (1, VEC))        # ((1, VEC), (N, K / VEC))
    k_vec = w.shape[1] // VEC
    step = LANES * UNROLL
    k_main = (k_vec // step) * step
    acc = cute.make_rmem_tensor((rows,), cutlass.Float32)
    acc.fill(0.0)
    if n < w.shape[0]:
        for j0 in cutlass.range(0, k_main, step):
            wf = [wv[(None, (n, j0 + u * LANES + lane))].load().to(cutlass.Float32)
                  for u in range(UNROLL)]
            for u in cutlass.range_constexpr(UNROLL):
                for r in cutlass.range_constexpr(rows):
                    xf = xv[(None, (r, j0 + u * LANES + lane))].load().to(cutlass.Float32)
                    acc[r] = acc[r] + (wf[u] * xf).reduce(cute.ReductionOp.ADD, 0.0, 0)
        for j in cutlass.range(k_main + lane, k_vec, LANES):
            wt = wv[(None, (n, j))].load().to(cutlass.Float32)
            for r in cutlass.range_constexpr(rows):
                xf = xv[(None, (r, j))].load().to(cutlass.Float32)
                acc[r] = acc[r] + (wt * xf).reduce(cute.ReductionOp.ADD, 0.0, 0)
        for r in cutlass.range_constexpr(rows):
            total = cute.arch.warp_reduction(acc[r], operator.add)
            if lane == 0:
                y[r, n] = total.to(y.element_type)


@cute.jit
def gemv(x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream):
    """x [R, K] bf16, w [N, K] bf16 -> y [R, N] bf16 (R static, N and K dynamic, K % 8 == 0)."""
    grid = (w.shape[0] + WARPS - 1) // WARPS
    _gemv_kernel(x, w, y, x.shape[0]).launch(grid=(grid, 1, 1), block=(WARPS * LANES, 1, 1), stream=stream)
