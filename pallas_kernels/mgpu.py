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

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

H200_SMS = 132
_state = {"force_compile": False, "detect_races": False}


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


def race_detection():
    """Interpret-mode kernels traced inside run with the happens-before race detector."""
    return _set("detect_races")


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
    """Whether the interpreter's race detector has flagged a race since the last reset."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    try:
        return bool(gpu_callbacks.get_races().races_found)
    except AssertionError:          # no interpret-mode kernel with race detection has run yet
        return False


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


def warpgroup_params() -> plgpu.CompilerParams:
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
