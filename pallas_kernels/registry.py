"""The kernel registry: op name -> implementations ("pallas", "cute"), shared by the model's
KernelPlan (k3jax.backend), `python -m k3jax.validate` and `python -m k3jax.bench --ops`.

The "xla" implementation of every op is its reference in k3jax.ops (k3jax.backend.REFERENCES);
it is never registered here, so there is one formula in one place. Each kernel module also
registers an `OpSpec`: what validation and benchmarks need to know about the op (shape sweep,
tolerance per dtype, byte/FLOP counts, how to compare outputs).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mgpu

# Modules that register kernels when imported (each holds one fused op's kernels).
KERNEL_MODULES: tuple[str, ...] = ("pallas_kernels.linear", "pallas_kernels.mla_decode", "pallas_kernels.route",
                                   "pallas_kernels.attn_res_mix", "pallas_kernels.moe_experts",
                                   "pallas_kernels.kda_decode", "pallas_kernels.gated_mlp", "cute_bridge.ops")

_IMPLEMENTATIONS: dict[tuple[str, str], Callable] = {}
_SPECS: dict[str, OpSpec] = {}
_loaded = False

# Output tolerance by dtype, as a fraction of the reference output's largest magnitude.
# bf16 keeps 8 significant bits: kernel and reference each round once to bf16 after float32
# work that differs only in summation order, so they may land on neighbouring values. One ulp of
# a bf16 value x is at most 2^-7 |x|, so 2^-7 of the largest magnitude admits a one-ulp
# difference anywhere (two ulps for elements at most half the largest). Kernels measured on the
# H200 reach 0.65-0.93 of it (kda_decode K3 batch 1: 7.3e-3). float32 outputs (states, router
# weights) allow float32 summation-order drift over reductions of up to ~10^4 terms. No kernel
# returns float16 (the models run bf16 or float32), so there is no entry for it.
TOLERANCE: dict[str, float] = {"bfloat16": 2.0 ** -7, "float32": 1e-4}


@dataclasses.dataclass(frozen=True)
class Case:
    """One point of an op's shape sweep.

    `make(key)` builds random (never zero) positional arguments; `kwargs` are the static
    keyword arguments of the reference; `kernel_kwargs` further ones only the kernel takes (which
    of an op's kernels runs, where the kernel would choose by size); `sizes` tags where the case
    runs: "small" (CPU interpret mode, CI), "k3" (real K3 shapes: GPU validation and benchmarks).
    """

    name: str
    make: Callable[[jax.Array], tuple]
    kwargs: tuple[tuple[str, Any], ...] = ()
    batch: int = 1
    sizes: frozenset[str] = frozenset({"small"})
    kernel_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def kw(self) -> dict[str, Any]:
        return dict(self.kwargs)

    @property
    def kernel_kw(self) -> dict[str, Any]:
        return dict(self.kwargs + self.kernel_kwargs)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """What the validator and benchmarks know about one op.

    reference: the k3jax.ops function (the XLA path). cases(): the shape sweep.
    cost(args, kwargs) -> (bytes moved at minimum, FLOPs): the roofline numerator.
    compare(out, ref, args, kwargs) -> error as a fraction of the output scale (default:
    max |out - ref| / max |ref| over every output leaf, in float32; NaN anywhere fails).
    tolerance(args, kwargs) -> the allowed error (default: TOLERANCE of the first output's dtype).
    donate: positions of the arguments a decode step donates (state the op updates in place):
    benchmarks donate fresh copies of them, so they time what the step runs. notes: what the
    kernel covers, printed in the validation report.
    """

    name: str
    reference: Callable
    cases: Callable[[], list[Case]]
    cost: Callable[[tuple, dict], tuple[float, float]]
    compare: Callable[[Any, Any, tuple, dict], float] | None = None
    tolerance: Callable[[tuple, dict], float] | None = None
    donate: tuple[int, ...] = ()
    notes: str = ""

    def sweep(self, *sizes: str) -> list[Case]:
        """The cases of this op's shape sweep: all, or those tagged with any of `sizes`."""
        return [c for c in self.cases() if not sizes or c.sizes & set(sizes)]

    def runner(self, case: Case, impl: str) -> Callable | None:
        """A fresh function of `case`'s inputs running `impl` on them: "xla" the reference with the
        case's kwargs, else the registered kernel with its kernel kwargs; None when `impl` has no
        kernel for this op."""
        fn = self.reference if impl == "xla" else implementation(self.name, impl)
        kw = case.kw if impl == "xla" else case.kernel_kw
        return None if fn is None else lambda *a: fn(*a, **kw)

    def error(self, out, ref, args, kwargs) -> float:
        if self.compare is not None:
            return self.compare(out, ref, args, kwargs)
        return relative_max_error(out, ref)

    def allowed(self, ref, args, kwargs) -> float:
        if self.tolerance is not None:
            return self.tolerance(args, kwargs)
        return TOLERANCE[jnp.dtype(jax.tree.leaves(ref)[0].dtype).name]


def relative_max_error(out, ref) -> float:
    """max |out - ref| / max |ref| over all leaves (NaN if any output is NaN or shapes differ)."""
    worst = 0.0
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        o, r = np.asarray(o, np.float32), np.asarray(r, np.float32)
        if o.shape != r.shape or not np.all(np.isfinite(o)):
            return float("nan")
        worst = max(worst, float(np.max(np.abs(o - r))) / max(float(np.max(np.abs(r))), 1e-30))
    return worst


_FALLBACKS: dict[tuple[str, str], set[str]] = {}   # reported since the last clear_fallbacks()
_WARNED: set[tuple[str, str, str]] = set()
_TRACING: list[set[tuple[str, str, str]]] = []     # reasons recorded while a shared lowering traces


def fallback(op: str, impl: str, why: str) -> Callable:
    """The reference of `op`, for a call the `impl` kernel does not cover: warns once per
    (op, impl, why) and records it for `fallbacks()`."""
    _report(op, impl, why)
    if _TRACING:
        _TRACING[-1].add((op, impl, why))
    from k3jax.backend import REFERENCES
    return REFERENCES[op]


def _report(op: str, impl: str, why: str) -> None:
    _FALLBACKS.setdefault((op, impl), set()).add(why)
    if (op, impl, why) not in _WARNED:
        _WARNED.add((op, impl, why))
        logging.getLogger("k3jax.kernels").warning("%s %s: %s; using the XLA reference", impl, op, why)


def fallbacks() -> dict[str, list[str]]:
    """Why implementations ran their reference, for calls made since `clear_fallbacks()` (a
    call whose lowering is reused still reports): {"op/impl": [why, ...]}."""
    return {f"{op}/{impl}": sorted(whys) for (op, impl), whys in _FALLBACKS.items()}


def clear_fallbacks() -> None:
    _FALLBACKS.clear()


def register(op: str, impl: str, fn: Callable) -> Callable:
    """Registers `fn` as the `impl` implementation of `op` (same signature as its reference).

    What is registered is `shared_lowering(fn)`: every call site with the same shapes and
    settings reuses one lowering, so a model whose layers call the same kernel compiles it once.
    """
    _IMPLEMENTATIONS[(op, impl)] = shared_lowering(fn)
    return fn


def shared_lowering(fn: Callable) -> Callable:
    """`fn` behind a `jax.jit` shared by all calls with the same argument structure, static values
    and kernel mode (compile / interpret / race detection).

    Why: Mosaic GPU names each lowered kernel uniquely (moe_down_0, moe_down_1, ...), so 12 layers calling
    the same kernel would otherwise compile 12 identical kernels; one jitted function per shape is
    lowered once and called from every site. Array arguments (and tracers) are traced; every other
    leaf (Python numbers, strings, None) is a static value, as the kernels need it.
    """
    @functools.wraps(fn)
    def call(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
        static = tuple((i, x) for i, (x, d) in enumerate(zip(leaves, dynamic)) if not d)
        arrays = [x for x, d in zip(leaves, dynamic) if d]
        avals = tuple((x.shape, jnp.dtype(x.dtype)) for x in arrays)
        jitted, reasons = _jitted(fn, treedef, static, avals, mgpu.trace_mode())
        out = jitted(*arrays)
        for reason in reasons:      # fallbacks taken when this lowering was traced
            _report(*reason)
        return out
    return call


@functools.cache
def _jitted(fn: Callable, treedef, static: tuple, avals: tuple, mode) -> tuple[Callable, set]:
    """One jitted `fn` per call signature (`avals` keys the fallbacks its trace took)."""
    fixed = dict(static)
    reasons: set[tuple[str, str, str]] = set()

    def run(*arrays):
        it = iter(arrays)
        leaves = [fixed[i] if i in fixed else next(it) for i in range(treedef.num_leaves)]
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        _TRACING.append(reasons)
        try:
            return fn(*args, **kwargs)
        finally:
            _TRACING.pop()
    return jax.jit(run), reasons


def register_spec(spec: OpSpec) -> OpSpec:
    _SPECS[spec.name] = spec
    return spec


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


def implementations(op: str) -> dict[str, Callable]:
    """Every registered non-XLA implementation of `op`, by name."""
    _load_all()
    return {impl: fn for (o, impl), fn in _IMPLEMENTATIONS.items() if o == op}


def spec(op: str) -> OpSpec:
    _load_all()
    if op not in _SPECS:
        raise KeyError(f"no OpSpec registered for op {op!r}; registered: {', '.join(sorted(_SPECS))}")
    return _SPECS[op]


def specs() -> dict[str, OpSpec]:
    _load_all()
    return dict(_SPECS)
