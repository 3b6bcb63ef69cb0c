"""The bridge's smoke kernel: out [n] f32 = x + y. Tests the build, codegen and loader end to end."""

from __future__ import annotations

import cutlass.cute as cute
import cuda.bindings.driver as cuda

THREADS = 128


@cute.kernel
def _add_kernel(x: cute.Tensor, y: cute.Tensor, out: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    if i < x.shape[0]:
        out[i] = x[i] + y[i]


@cute.jit
def add(x: cute.Tensor, y: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
    """x, y [n] f32 -> out [n] f32 (n dynamic)."""
    _add_kernel(x, y, out).launch(grid=((x.shape[0] + THREADS - 1) // THREADS, 1, 1),
                                  block=(THREADS, 1, 1), stream=stream)
