"""Shared plumbing for the Mosaic GPU (plgpu) kernels: interpret mode on CPU, race detection,
and the SM count that grid sizing targets.

Kernels decide at trace time: on a GPU they compile; elsewhere they run in Mosaic GPU
interpret mode (NaN-initialised memory, so an output element the kernel never writes reads as
NaN and fails validation). `compile_for_gpu()` forces the compiled path, for exporting CUDA
lowerings from a CPU machine. Trace a fresh function object under it (e.g. a lambda): jit's
trace cache does not see this setting.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

H200_SMS = 132
_state = {"force_compile": False, "detect_races": False, "races_seen": False}


@contextlib.contextmanager
def _set(flag: str):
    old = _state[flag]
    _state[flag] = True
    try:
        yield
    finally:
        _state[flag] = old


def compile_for_gpu():
    """Trace kernels for the real GPU even when no GPU is present (CUDA export on CPU)."""
    return _set("force_compile")


@contextlib.contextmanager
def race_detection():
    """Interpret-mode kernels traced inside run with the happens-before race detector;
    `races_found()` then reports on every kernel run inside the block, not only the last one."""
    _record_each_kernels_races()
    nested = _state["detect_races"]
    outer = nested and races_found()            # the enclosing block's finding so far
    reset_interpreter()
    _state["races_seen"] = False
    try:
        with _set("detect_races"):
            yield
    finally:
        # After the block, races_found() reports it (and an enclosing block adds it to its own).
        _state["races_seen"] = outer or races_found()


def _record_each_kernels_races() -> None:
    """The interpreter starts a new race-detection state with every kernel it runs (the last
    kernel's replaces the one before), so a race in the first of several kernels would go
    unreported: wrap its end-of-kernel clean-up to keep what each kernel found (idempotent)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    clear = gpu_callbacks._clear_shared_memory
    if getattr(clear, "records_races", False):
        return

    def clear_and_record():
        if gpu_callbacks._races is not None and gpu_callbacks._races.races_found:
            _state["races_seen"] = True
        clear()

    clear_and_record.records_races = True
    gpu_callbacks._clear_shared_memory = clear_and_record


def interpret_params() -> plgpu.InterpretGPUParams | None:
    """None (compile) on a GPU backend, else interpret-mode parameters."""
    if _state["force_compile"] or jax.default_backend() == "gpu":
        return None
    return plgpu.InterpretGPUParams(detect_races=_state["detect_races"], uninitialized_memory="nan")


def trace_mode() -> tuple[bool, bool, str]:
    """What a kernel traced now depends on (compile vs interpret, race detection, backend):
    part of the key of anything that caches traced kernels."""
    return _state["force_compile"], _state["detect_races"], jax.default_backend()


def races_found() -> bool:
    """Whether the race detector has flagged a race in any kernel run inside the current
    `race_detection()` block (a kernel that raised included)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    races = gpu_callbacks._races
    return _state["races_seen"] or bool(races is not None and races.races_found)


def reset_interpreter() -> None:
    """Clears the interpreter's shared state (needed after a kernel raised in interpret mode)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    gpu_callbacks.reset_gpu_interpret_mode_state()


def num_sms() -> int:
    """SMs of the first GPU (grid sizing); the H200's count when tracing without one."""
    for d in jax.devices():
        if d.platform == "gpu":
            return getattr(d, "core_count", H200_SMS) or H200_SMS
    return H200_SMS


def store_tile(value: jax.Array, dst) -> None:
    """Inside a kernel: writes the register tile `value` to the GMEM ref `dst` (same shape and
    dtype) through a scoped SMEM buffer and a TMA store, and waits until SMEM may be reused."""
    def scoped(smem):
        smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    pl.run_scoped(scoped, plgpu.SMEM(value.shape, value.dtype))


def store_transposed(value: jax.Array, dst) -> None:
    """Inside a kernel: writes the register tile `value` [R, N] (a swap-AB accumulator: output
    features x token rows), transposed and in dst's dtype, to the GMEM ref `dst` [n, R], n <= N:
    the first n token rows only (the padding rows a wgmma needs never leave the SM). Through a
    scoped SMEM buffer [N, R] written via its transposed view, then one TMA store. dst is 16-bit:
    Mosaic GPU (jax 0.11.2) finds no register layout for a transposed float32 store."""
    if jnp.dtype(dst.dtype).itemsize != 2:
        raise ValueError(f"store_transposed: dst is {dst.dtype}; a transposed store takes a 16-bit dtype")
    r, n_pad = value.shape
    n = dst.shape[0]

    def scoped(smem):
        smem.transpose((1, 0))[...] = value.astype(dst.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem if n == n_pad else smem.at[pl.ds(0, n)], dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    pl.run_scoped(scoped, plgpu.SMEM((n_pad, r), dst.dtype))


def warpgroup_params() -> plgpu.CompilerParams:
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def own_reduction_scratch(thread_axis: str, threads: int, body: Callable[[], None]) -> None:
    """Inside a kernel with Pallas threads (warpgroups) along `thread_axis`: runs body() in threads
    0 .. threads - 1, each with SMEM scratch for cross-warp reductions that no other thread uses.
    Every thread of the block must call this at the same point, before the threads' long work:
    it starts with block-wide barriers (thread-collective SMEM allocations synchronise the block).

    A reduction along a WGMMA array's M axis (its rows live in the warpgroup's four warps) goes
    through SMEM scratch that Mosaic GPU places at the first free SMEM byte: the same address in
    every warpgroup running the same code, so two warpgroups reducing at once overwrite each
    other's partials (wrong, run-to-run varying results on a GPU; the interpreter does not model
    the scratch). Thread i runs body inside i nested, unused SMEM pads of the scratch's size,
    which moves its scratch past the others'. The pads are entered by every thread (their
    barriers) before any body starts, and left without a barrier. Interpreted, body runs as is
    (no shared scratch to avoid)."""
    thread = jax.lax.axis_index(thread_axis)
    if interpret_params() is not None:
        pl.when(thread < threads)(body)
        return
    pad = plgpu.CompilerParams().reduction_scratch_bytes

    def nest(i: int):
        if i + 1 < threads:
            pl.run_scoped(lambda _pad: nest(i + 1), plgpu.SMEM((pad,), jnp.int8), collective_axes=thread_axis)
        pl.when(thread == i)(body)
    nest(0)


def cluster_barrier(axis: str) -> plgpu.ClusterBarrier:
    """Scratch for `cluster_sync` over the kernel's cluster axis `axis`."""
    return plgpu.ClusterBarrier(collective_axes=(axis,))


def cluster_sync(barrier) -> None:
    """Inside a kernel launched in clusters (one warpgroup a block): returns once every block of
    this block's cluster has reached the same call, with all their earlier writes (GMEM or SMEM)
    visible here. Call it once per kernel, from every thread.

    Compiled: the hardware cluster barrier, `barrier.cluster.arrive.release` then
    `barrier.cluster.wait.acquire` (PTX's pattern for data one block writes and another reads).
    Not plgpu's ClusterBarrier: it arrives on a peer's mbarrier with the default .cta-scope
    release, which orders nothing for a thread of another block. Interpret mode cannot run inline
    PTX: there `barrier` (from `cluster_barrier`) stands in, arrived at on every peer and waited
    for, and the race detector checks the exchange against it."""
    if interpret_params() is not None:
        plgpu.barrier_arrive(barrier)
        plgpu.barrier_wait(barrier)
        return

    @plgpu.inline_mgpu()
    def barrier_cluster(ctx):
        mgpu_utils.inline_ptx("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;",
                              has_side_effects=True, convergent=True)
    barrier_cluster()
