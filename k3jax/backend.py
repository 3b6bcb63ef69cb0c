"""Which implementation runs each decode op: a `KernelPlan`, chosen from one backend setting.

Backends: "xla" (the k3jax.ops references, plain jax.numpy), "pallas" (pallas_kernels), "cute"
(cute_bridge). An op without a kernel in the chosen backend falls back along cute -> pallas -> xla,
and `KernelPlan.describe()` says what runs where. Single ops can be overridden for ablations:

    plan = KernelPlan.for_backend("pallas", linear="xla")
    model.plan = plan            # static attribute: the next jit call retraces
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from k3jax import ops

BACKENDS = ("xla", "pallas", "cute")
_FALLBACK = {"xla": ("xla",), "pallas": ("pallas", "xla"), "cute": ("cute", "pallas", "xla")}

# The decode ops a backend may replace, with their reference (= XLA) implementation.
REFERENCES: dict[str, Callable] = {
    "linear": ops.linear,
    "gated_mlp": ops.gated_mlp,
    "route": ops.route,
    "moe_experts": ops.moe_experts,
    "kda_decode": ops.kda_decode,
    "mla_decode": ops.mla_decode,
    "attn_res_mix": ops.attn_res_mix,
    "attn_res_mix_norm": ops.attn_res_mix_norm,
}


def _available(op: str, impl: str) -> Callable | None:
    if impl == "xla":
        return REFERENCES[op]
    from pallas_kernels import registry  # imported lazily: kernels load only when asked for
    return registry.implementation(op, impl)


def implementations(op: str) -> list[str]:
    """The implementation names `op` has here: "xla", then each registered kernel (a backend's, or a
    named variant of one such as mla_decode's "pallas_heads_n", for ablations)."""
    from pallas_kernels import registry
    return ["xla", *registry.implementations(op)]


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """An implementation name per op; hashable, so it can be a static attribute under jit."""

    choices: tuple[tuple[str, str], ...]

    @classmethod
    def for_backend(cls, backend: str = "xla", **overrides: str) -> KernelPlan:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        chosen = {op: next(i for i in _FALLBACK[backend] if _available(op, i) is not None) for op in REFERENCES}
        return cls(tuple(chosen.items())).replace(**overrides)

    def replace(self, **overrides: str) -> KernelPlan:
        """This plan with some ops' implementations replaced (ablations), e.g. linear="xla"."""
        unknown = set(overrides) - set(REFERENCES)
        if unknown:
            raise ValueError(f"unknown op(s) {sorted(unknown)}; ops are {', '.join(REFERENCES)}")
        for op, wanted in overrides.items():
            if _available(op, wanted) is None:
                raise ValueError(f"op {op!r} has no {wanted!r} implementation; it has {', '.join(implementations(op))}")
        return dataclasses.replace(self, choices=tuple((op, overrides.get(op, impl)) for op, impl in self.choices))

    def __call__(self, op: str) -> Callable:
        return _available(op, dict(self.choices)[op])

    def runs_kernel(self, op: str) -> bool:
        """Whether `op` runs a backend's kernel. A fused op (gated_mlp, attn_res_mix_norm) that does
        not is composed by the model from its parts, each as the plan says."""
        return dict(self.choices)[op] != "xla"

    def describe(self) -> dict[str, str]:
        return dict(self.choices)


XLA = KernelPlan(tuple((op, "xla") for op in REFERENCES))
