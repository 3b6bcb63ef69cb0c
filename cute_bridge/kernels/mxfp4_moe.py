"""MXFP4 W4A16 routed experts for decode, in two launches around the (XLA) gated activation:

  gate_up:      gate, up [S, I] bf16 = z[s // k] @ dequant(w1|w3[ids[s]]).T      (S = N * k slots)
  down_combine: out [N, M] bf16      = sum_j weights[n, j] * bf16(hid[n*k+j] @ dequant(w2[ids]).T)

A warp owns one (slot, output row) pair. Each lane takes whole 32-value scale groups: one 16-byte
load of codes (4 int32 words), one scale byte, and the 32 activations (four 16-byte loads, L1
resident). E2M1 is decoded two codes at a time into an f16x2 word: the 3 magnitude bits go to
f16 bits 9-11 and the sign to bit 15, which makes the f16 value code * 2^-14 exactly (e = 0 maps
onto f16 subnormals, which f16 -> f32 conversion keeps); the 2^14 is folded into the group's
power-of-two scale, so per value the work is a few integer ops, one convert and one FMA.
Every product is exact in float32 (as in the dequantise-to-bf16 reference); only the summation
order differs. Expert ids and routing weights are device tensors: one compiled graph serves
every step.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

GROUP = 32          # values per UE8M0 scale (one 16-byte load of codes)
WARPS = 4
LANES = 32
F16_PLACEMENT_EXP = 14   # f16 bit placement yields code * 2^-14


@cute.jit
def _group_scale(s):
    """UE8M0 byte -> float32 2^(s - 127 + 14) (the placement factor folded in)."""
    return cutlass.Int32((cutlass.Int32(s) + F16_PLACEMENT_EXP) << 23).bitcast(cutlass.Float32)


@cute.jit
def _row_dot(wv: cute.Tensor, sc: cute.Tensor, xv: cute.Tensor, e, row, xrow, lane):
    """Lane-partial dot of dequant(w[e, row, :]) with x[xrow, :] over this lane's groups.

    wv: codes as int32 [E, O, in/8] divided into ((1,1,4), ...); sc: scales uint8 [E, O, in/32];
    xv: activations bf16 [X, in] divided into ((1,8), ...).
    """
    acc = cutlass.Float32(0.0)
    for g in cutlass.range(lane, sc.shape[2], LANES):
        words = wv[(None, (e, row, g))].load()                  # int32 x4 = 32 codes
        xs = [xv[(None, (xrow, 4 * g + q))].load().to(cutlass.Float32) for q in range(4)]
        part = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(4):
            t = words >> (4 * j)                                  # codes j (low half), j+4 (high)
            h = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)
            f = h.bitcast(cutlass.Float16).to(cutlass.Float32)   # [2q] = col 8q+j, [2q+1] = col 8q+j+4
            for q in cutlass.range_constexpr(4):
                part = part + f[2 * q] * xs[q][j] + f[2 * q + 1] * xs[q][j + 4]
        acc = acc + part * _group_scale(sc[e, row, g])
    return acc


@cute.kernel
def _gate_up_kernel(z: cute.Tensor, ids: cute.Tensor, w1: cute.Tensor, s1: cute.Tensor,
                    w3: cute.Tensor, s3: cute.Tensor, gate: cute.Tensor, up: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, slot, _ = cute.arch.block_idx()
    lane = tidx % LANES
    row = bidx * WARPS + tidx // LANES
    if row < w1.shape[1]:
        top_k = ids.shape[0] // z.shape[0]
        e = ids[slot]
        zv = cute.zipped_divide(z, (1, 8))
        g = _row_dot(cute.zipped_divide(w1, (1, 1, 4)), s1, zv, e, row, slot // top_k, lane)
        u = _row_dot(cute.zipped_divide(w3, (1, 1, 4)), s3, zv, e, row, slot // top_k, lane)
        g = cute.arch.warp_reduction(g, operator.add)
        u = cute.arch.warp_reduction(u, operator.add)
        if lane == 0:
            gate[slot, row] = g.to(gate.element_type)
            up[slot, row] = u.to(up.element_type)


@cute.kernel
def _down_combine_kernel(hid: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor,
                         w2: cute.Tensor, s2: cute.Tensor, out: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, n, _ = cute.arch.block_idx()
    lane = tidx % LANES
    row = bidx * WARPS + tidx // LANES
    if row < w2.shape[1]:
        top_k = ids.shape[0] // out.shape[0]
        hv = cute.zipped_divide(hid, (1, 8))
        wv = cute.zipped_divide(w2, (1, 1, 4))
        acc = cutlass.Float32(0.0)
        for j in cutlass.range(top_k):
            slot = n * top_k + j
            y = cute.arch.warp_reduction(_row_dot(wv, s2, hv, ids[slot], row, slot, lane), operator.add)
            # The reference rounds each expert's output to the activation dtype before combining.
            acc = acc + weights[slot] * y.to(out.element_type).to(cutlass.Float32)
        if lane == 0:
            out[n, row] = acc.to(out.element_type)


@cute.jit
def gate_up(z: cute.Tensor, ids: cute.Tensor, w1: cute.Tensor, s1: cute.Tensor, w3: cute.Tensor,
            s3: cute.Tensor, gate: cute.Tensor, up: cute.Tensor, stream: cuda.CUstream):
    """z [N, M] bf16, ids [S] int32, w1/w3 int32 [E, I, M/8], s1/s3 uint8 [E, I, M/32]
    -> gate, up [S, I] bf16."""
    grid = ((w1.shape[1] + WARPS - 1) // WARPS, ids.shape[0], 1)
    _gate_up_kernel(z, ids, w1, s1, w3, s3, gate, up).launch(grid=grid, block=(WARPS * LANES, 1, 1), stream=stream)


@cute.jit
def down_combine(hid: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, w2: cute.Tensor,
                 s2: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
    """hid [S, I] bf16, ids [S] int32, weights [S] f32, w2 int32 [E, M, I/8], s2 uint8 [E, M, I/32]
    -> out [N, M] bf16."""
    grid = ((w2.shape[1] + WARPS - 1) // WARPS, out.shape[0], 1)
    _down_combine_kernel(hid, ids, weights, w2, s2, out).launch(grid=grid, block=(WARPS * LANES, 1, 1), stream=stream)
