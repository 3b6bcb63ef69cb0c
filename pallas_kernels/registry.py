"""The kernel registry: op name -> implementations ("pallas", "cute"), shared by the model's
KernelPlan (k3jax.backend), `python -m k3jax.validate` and `python -m k3jax.bench --ops`.

The "xla" implementation of every op is its reference in k3jax.ops (k3jax.backend.REFERENCES);
it is never registered here, so there is one formula in one place.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# Modules that register kernels when imported (each holds one fused op's kernels).
KERNEL_MODULES: tuple[str, ...] = ()

_IMPLEMENTATIONS: dict[tuple[str, str], Callable] = {}
_loaded = False


def register(op: str, impl: str, fn: Callable) -> Callable:
    """Registers `fn` as the `impl` implementation of `op` (same signature as its reference)."""
    _IMPLEMENTATIONS[(op, impl)] = fn
    return fn


def _load_all() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for name in KERNEL_MODULES:
            importlib.import_module(name)


def implementation(op: str, impl: str) -> Callable | None:
    """The registered implementation, or None when `impl` has no kernel for `op`."""
    _load_all()
    return _IMPLEMENTATIONS.get((op, impl))
