"""Loads the built kernel library into JAX and calls its kernels as plain JAX functions.

    from cute_bridge import loader
    (y,) = loader.call("gemv_r1", x, w)         # jax.ffi.ffi_call on XLA's CUDA stream

The library is found at $K3JAX_CUTE_LIB or cute_bridge/_build/libk3cute.so. `call` checks every
argument against the kernel's spec (dtype, rank, static sizes, consistent symbolic sizes,
divisibility) before tracing the custom call, and fails with a named problem when the library
is missing, was built from other kernel sources, or there is no GPU. Under `exporting()` the
library and GPU checks are skipped, so a CPU machine can lower and export for CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import threading

import jax
import numpy as np

from cute_bridge.kernel_set import BY_NAME, KernelSpec, kernel_set_hash

DEFAULT_LIBRARY = pathlib.Path(__file__).parent / "_build" / "libk3cute.so"
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_export_only = threading.local()


class CuteBridgeError(RuntimeError):
    """The CuTe kernel library cannot serve a call (missing, stale, no GPU, bad arguments)."""


def library_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("K3JAX_CUTE_LIB", DEFAULT_LIBRARY))


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@contextlib.contextmanager
def exporting():
    """Trace CuTe calls without loading the library or needing a GPU (for jax.export to CUDA)."""
    prev = getattr(_export_only, "on", False)
    _export_only.on = True
    try:
        yield
    finally:
        _export_only.on = prev


def load() -> ctypes.CDLL:
    """Loads the library once and registers every kernel's FFI target for CUDA."""
    global _library
    with _lock:
        if _library is not None:
            return _library
        path = library_path()
        if not path.exists():
            raise CuteBridgeError(
                f"CuTe kernel library not found at {path}. Build it with `python -m cute_bridge.build` "
                "(needs the `cute` extra; no GPU needed) and copy cute_bridge/_build/libk3cute.so to the "
                "GPU machine, or point K3JAX_CUTE_LIB at it.")
        lib = ctypes.CDLL(str(path))
        try:
            get_set = lib.k3cute_kernel_set
        except AttributeError:
            raise CuteBridgeError(f"{path} is not a cute_bridge kernel library (no k3cute_kernel_set)") from None
        get_set.restype = ctypes.c_char_p
        built, wanted = get_set().decode(), kernel_set_hash()
        if built != wanted:
            raise CuteBridgeError(
                f"{path} was built for kernel set {built}, but the kernel sources here are kernel set "
                f"{wanted}: rebuild with `python -m cute_bridge.build` and copy the new library.")
        for spec in BY_NAME.values():
            jax.ffi.register_ffi_target(
                spec.target,
                {"instantiate": jax.ffi.pycapsule(getattr(lib, f"{spec.target}_instantiate")),
                 "execute": jax.ffi.pycapsule(getattr(lib, f"{spec.target}_execute"))},
                platform="CUDA")
        _library = lib
        return lib


def bind(spec: KernelSpec, args, dims: dict[str, int] | None = None) -> dict[str, int]:
    """Checks `args` against `spec.inputs`; returns every symbol's size (`dims` gives those that
    appear only in outputs). Raises ValueError naming the kernel, argument and problem."""
    if len(args) != len(spec.inputs):
        raise ValueError(f"{spec.name}: expected {len(spec.inputs)} arrays "
                         f"({', '.join(a.name for a in spec.inputs)}), got {len(args)}")
    sizes = dict(dims or {})
    for a, x in zip(spec.inputs, args):
        if np.dtype(x.dtype) != np.dtype(a.dtype):
            raise ValueError(f"{spec.name}: argument '{a.name}' must be {a.dtype}, got {x.dtype}")
        if len(x.shape) != len(a.shape):
            raise ValueError(f"{spec.name}: argument '{a.name}' must have shape {a.shape}, got {x.shape}")
        for d, n in zip(a.shape, x.shape):
            if isinstance(d, int):
                if n != d:
                    raise ValueError(f"{spec.name}: argument '{a.name}' must have shape {a.shape}, got {x.shape}")
            elif sizes.setdefault(d, n) != n:
                raise ValueError(f"{spec.name}: argument '{a.name}' has {d}={n}, but another argument has "
                                 f"{d}={sizes[d]} (shape {x.shape} vs spec {a.shape})")
    for sym, div in spec.symbols.items():
        if sym not in sizes:
            raise ValueError(f"{spec.name}: size {sym} appears only in outputs; pass dims={{'{sym}': ...}}")
        if sizes[sym] % div or sizes[sym] <= 0:
            raise ValueError(f"{spec.name}: size {sym}={sizes[sym]} must be a positive multiple of {div}")
    return sizes


def call(name: str, *args: jax.Array, dims: dict[str, int] | None = None) -> tuple[jax.Array, ...]:
    """Runs kernel `name` on `args` (its spec's inputs, in order); returns its outputs."""
    spec = BY_NAME.get(name)
    if spec is None:
        raise CuteBridgeError(f"no CuTe kernel {name!r}; kernels are {', '.join(BY_NAME)}")
    sizes = bind(spec, args, dims)
    if not getattr(_export_only, "on", False):
        if not has_gpu():
            raise CuteBridgeError(f"CuTe kernel {name!r} needs an NVIDIA GPU (sm_90a); JAX sees none")
        load()
    outs = [jax.ShapeDtypeStruct(tuple(sizes[d] if isinstance(d, str) else d for d in a.shape), np.dtype(a.dtype))
            for a in spec.outputs]
    return tuple(jax.ffi.ffi_call(spec.target, outs)(*args))


def export_checks() -> list:
    """`disabled_checks` for jax.export: our FFI targets are built and shipped with the code."""
    return [jax.export.DisabledSafetyCheck.custom_call(s.target) for s in BY_NAME.values()]
