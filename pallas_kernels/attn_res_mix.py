"""Block AttnRes mix in one pass: candidates [N, ..., D] (N <= 9 block checkpoints + the partial
sum), norm_weight [D], query [D] -> the softmax-over-depth weighted sum [..., D].

Kernel (Mosaic GPU, one warpgroup per token row): one TMA brings the row's N candidates
(N x D bf16, 129 KB at N = 9, D = 7168) into SMEM; from there each candidate yields its
sum of squares and its dot with norm_weight * query (two block reductions), the N scores go
through a scalar softmax, and the weighted sum is formed from the same SMEM copy. HBM traffic
is the minimum: candidates read once, output written once. The XLA reference makes several
passes (norm, score, softmax, weighted sum) over the same N x D values.

Covered: bf16 candidates, D % 128 == 0, N x D small enough for SMEM; anything else runs the
reference (k3jax.ops.attn_res_mix); `covers()` says which.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import ops
from pallas_kernels import mgpu, registry

SMEM_BUDGET = 200 * 1024
LANE = 128
f32 = jnp.float32


def covers(shape, dtype) -> bool:
    """Whether the kernel handles candidates of this shape/dtype (else the reference runs)."""
    n, d = shape[0], shape[-1]
    return (len(shape) >= 2 and jnp.dtype(dtype) == jnp.bfloat16 and d % LANE == 0 and d // LANE <= 256
            and (n + 3) * d * 2 <= SMEM_BUDGET)     # candidates + out row + two weight vectors


def _mix(cand: jax.Array, norm_weight: jax.Array, query: jax.Array, eps: float) -> jax.Array:
    """cand [N, R, D] bf16 -> [R, D] bf16, one block per row."""
    n, rows, d = cand.shape
    # A TMA box spans at most 256 elements per dimension: D travels as [D / 128, 128].
    shape = (d // LANE, LANE)

    def attn_res_mix_kernel(c_gmem, nw_gmem, q_gmem, o_gmem):
        r = jax.lax.axis_index("r")

        @functools.partial(pl.run_scoped, c_smem=plgpu.SMEM((n, *shape), cand.dtype),
                           nw_smem=plgpu.SMEM(shape, norm_weight.dtype), q_smem=plgpu.SMEM(shape, query.dtype),
                           o_smem=plgpu.SMEM(shape, cand.dtype), bar=plgpu.Barrier(num_barriers=3))
        def _(c_smem, nw_smem, q_smem, o_smem, bar):
            plgpu.copy_gmem_to_smem(c_gmem.at[:, r], c_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(nw_gmem, nw_smem, bar.at[1])
            plgpu.copy_gmem_to_smem(q_gmem, q_smem, bar.at[2])
            for i in range(3):
                plgpu.barrier_wait(bar.at[i])
            wq = nw_smem[...].astype(f32) * q_smem[...].astype(f32)
            scores = []
            for i in range(n):
                v = c_smem[i].astype(f32)
                # = sum(v * rsqrt(mean(v^2) + eps) * wq): the norm factor is a per-row scalar.
                scores.append(jnp.sum(v * wq) * jax.lax.rsqrt(jnp.sum(v * v) / d + eps))
            top = functools.reduce(jnp.maximum, scores)
            e = [jnp.exp(s - top) for s in scores]
            inv = 1.0 / functools.reduce(jnp.add, e)
            acc = c_smem[0].astype(f32) * (e[0] * inv)
            for i in range(1, n):
                acc = acc + c_smem[i].astype(f32) * (e[i] * inv)
            o_smem[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[r])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        attn_res_mix_kernel, out_type=jax.ShapeDtypeStruct((rows, *shape), cand.dtype), grid=(rows,), grid_names=("r",),
        interpret=mgpu.interpret_params(),
    )(cand.reshape(n, rows, *shape), norm_weight.reshape(shape), query.reshape(shape)).reshape(rows, d)


def attn_res_mix(candidates: jax.Array, norm_weight: jax.Array, query: jax.Array, eps: float) -> jax.Array:
    """Same contract as k3jax.ops.attn_res_mix: candidates [N, ..., D] -> [..., D] in their dtype."""
    if not covers(candidates.shape, candidates.dtype):
        why = f"candidates {candidates.dtype}{list(candidates.shape)} not covered"
        return registry.fallback("attn_res_mix", "pallas", why)(candidates, norm_weight, query, eps)
    n, lead, d = candidates.shape[0], candidates.shape[1:-1], candidates.shape[-1]
    rows = math.prod(lead)
    out = _mix(candidates.reshape(n, rows, d), norm_weight, query, eps)
    return out.reshape(*lead, d)


registry.register("attn_res_mix", "pallas", attn_res_mix)

# ------------------------------------------------------------------ validation / benchmark spec
K3_D = 7168
BENCH_BATCHES = (1, 8, 32, 128)
EPS = 1e-6


def _make(n: int, lead: tuple[int, ...], d: int, dtype=jnp.bfloat16):
    def make(key):
        kc, kw, kq, ks = jax.random.split(key, 4)
        # Candidates of different scales, as block sums grow with depth.
        scale = jnp.exp(jax.random.normal(ks, (n,) + (1,) * (len(lead) + 1)))
        cand = (jax.random.normal(kc, (n, *lead, d), f32) * scale).astype(dtype)
        nw = (1.0 + 0.1 * jax.random.normal(kw, (d,), f32)).astype(dtype)
        q = (jax.random.normal(kq, (d,), f32) * d ** -0.5 * 4).astype(dtype)
        return cand, nw, q
    return make


def cases() -> list[registry.Case]:
    kw = (("eps", EPS),)
    small = [registry.Case(f"n{n}_lead{'x'.join(map(str, lead))}_d{d}", _make(n, lead, d), kw,
                           batch=math.prod(lead))
             for n, lead, d in ((2, (1,), 256), (9, (3,), 512), (5, (2, 2), 128), (1, (4,), 384), (9, (1, 1), 1024))]
    small.append(registry.Case("fallback_d96", _make(3, (2,), 96), kw, batch=2))
    small.append(registry.Case("fallback_f32", _make(3, (2,), 256, f32), kw, batch=2))
    k3 = [registry.Case(f"n{n}_b{b}", _make(n, (b, 1), K3_D), kw, batch=b, sizes=frozenset({"k3"}))
          for n in (2, 9) for b in BENCH_BATCHES]
    return small + k3


def cost(args, kwargs) -> tuple[float, float]:
    cand, nw, q = args
    item = cand.dtype.itemsize
    nbytes = cand.size * item + nw.size * nw.dtype.itemsize + q.size * q.dtype.itemsize + cand[0].size * item
    return float(nbytes), 6.0 * cand.size      # squares, dot, weighted sum: ~2 FLOPs each per element


registry.register_spec(registry.OpSpec(
    name="attn_res_mix", reference=ops.attn_res_mix, cases=cases, cost=cost,
    notes="bf16, D % 128 == 0, (N + 3) * D * 2 bytes <= 200 KB in the kernel; anything else runs the reference",
))
