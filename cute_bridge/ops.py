"""CuTe implementations of the decode ops, registered as impl "cute" in pallas_kernels.registry.

Each takes exactly its reference's arguments (k3jax.ops). Shapes/dtypes a kernel does not cover,
or a process without a GPU, fall back to the reference with one log line per reason.

  linear:       bf16 x [..., K] @ w [N, K].T with at most 8 rows and K % 8 == 0 -> gemv_r{1,2,4,8}
                (rows padded up to the next compiled count).
  moe_experts:  MXFP4 experts, bf16 z [N, M], M and I multiples of 32 -> moe_gate_up, then
                k3jax.ops.glu in XLA (the one formula), then moe_down_combine.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from cute_bridge import loader
from cute_bridge.kernel_set import GEMV_ROWS
from k3jax import ops
from pallas_kernels.registry import fallback, register


def _runnable() -> str | None:
    if getattr(loader._export_only, "on", False):
        return None
    return None if loader.has_gpu() else "no GPU"


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., K] @ weight [N, K].T -> [..., N], float32 accumulation, x's dtype (ops.linear)."""
    rows = math.prod(x.shape[:-1])
    k = x.shape[-1]
    reason = _runnable() or (
        "needs bf16 x and weight" if (x.dtype, weight.dtype) != (jnp.bfloat16, jnp.bfloat16) else
        f"K={k} is not a multiple of 8" if k % 8 or weight.shape[-1] != k else
        f"{rows} rows > {GEMV_ROWS[-1]} (a GEMV covers decode batches)" if rows > GEMV_ROWS[-1] or rows == 0 else None)
    if reason:
        return fallback("linear", "cute", reason)(x, weight)
    r = next(r for r in GEMV_ROWS if r >= rows)
    x2 = jnp.pad(x.reshape(rows, k), ((0, r - rows), (0, 0)))
    (y,) = loader.call(f"gemv_r{r}", x2, weight)
    return y[:rows].reshape(*x.shape[:-1], weight.shape[0])


def _words(packed: jax.Array) -> jax.Array:
    """uint8 codes [E, O, in/2] viewed as int32 [E, O, in/8] (no copy: a bitcast)."""
    e, o, half = packed.shape
    return jax.lax.bitcast_convert_type(packed.reshape(e, o, half // 4, 4), jnp.int32)


def moe_experts(z: jax.Array, ids: jax.Array, weights: jax.Array, experts: ops.ExpertWeights, *,
                act: str, beta: float, linear_beta: float | None, expert_chunk: int = 64) -> jax.Array:
    """Routed experts (ops.moe_experts contract): z [N, M], ids/weights [N, k] -> [N, M]."""
    n, m = z.shape
    inter = experts.w1.shape[1]
    reason = _runnable() or (
        "bf16 experts have no CuTe kernel" if not experts.is_mxfp4 else
        "needs bf16 activations" if z.dtype != jnp.bfloat16 else
        f"hidden {m} and intermediate {inter} must be multiples of 32" if m % 32 or inter % 32 else None)
    if reason:
        return fallback("moe_experts", "cute", reason)(z, ids, weights, experts, act=act, beta=beta,
                                                linear_beta=linear_beta, expert_chunk=expert_chunk)
    flat_ids = ids.reshape(-1).astype(jnp.int32)
    gate, up = loader.call("moe_gate_up", z, flat_ids, _words(experts.w1), experts.s1,
                           _words(experts.w3), experts.s3)
    hid = ops.glu(gate, up, act, beta, linear_beta)
    (out,) = loader.call("moe_down_combine", hid, flat_ids, weights.reshape(-1).astype(jnp.float32),
                         _words(experts.w2), experts.s2, dims={"N": n})
    return out


register("linear", "cute", linear)
register("moe_experts", "cute", moe_experts)
