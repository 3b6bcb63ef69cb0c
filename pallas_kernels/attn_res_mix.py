"""Block AttnRes mix in one pass: candidates [N, ..., D] (N <= 9 block checkpoints + the partial
sum), norm_weight [D], query [D] -> the softmax-over-depth weighted sum [..., D]; and the same
followed by the sub-layer's RMSNorm (`attn_res_mix_norm`, what every K3 sub-layer reads).

Kernel (Mosaic GPU, one warpgroup per token row): one TMA brings the row's N candidates
(N x D bf16, 129 KB at N = 9, D = 7168) into SMEM; from there each candidate yields its
sum of squares and its dot with norm_weight * query (two block reductions), the N scores go
through a scalar softmax, and the weighted sum is formed from the same SMEM copy. HBM traffic
is the minimum: candidates read once, output written once. The XLA reference makes several
passes (norm, score, softmax, weighted sum) over the same N x D values.

`attn_res_mix_norm` adds the RMSNorm to the kernel's end: the mix, rounded to bf16 as the
reference rounds it, is still in registers, so its sum of squares is one more block reduction and
the normalised row is what gets written: no second launch, no write and re-read of the mix.
`fused=False` (an ablation) runs this module's mix kernel, then the norm as an XLA op.

One block per row leaves most SMs idle below ~128 rows, where XLA's fusions (spread over many
blocks) are faster: K3 N = 9 on the H200, mix + norm, 5.9 / 7.9 us at 1 / 8 rows against the
kernel's 11.5 / 12.0 us; 17.5 against 16.8 us at 128 rows (session 10). Below KERNEL_MIN_ROWS rows
both ops therefore run the reference; `min_rows=1` forces the kernel (validation, benchmarks).

Covered: bf16 candidates, D % 128 == 0, N x D small enough for SMEM; anything else runs the
reference (k3jax.ops.attn_res_mix / attn_res_mix_norm); `covers()` says which.
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
KERNEL_MIN_ROWS = 128      # fewer rows run XLA's fusions, faster there (module doc)
LANE = 128
f32 = jnp.float32


def covers(shape, dtype, with_norm: bool = False) -> bool:
    """Whether the kernel handles candidates of this shape/dtype (else the reference runs);
    with_norm: the attn_res_mix_norm kernel (one more [D] vector in SMEM)."""
    n, d = shape[0], shape[-1]
    vectors = 4 if with_norm else 3           # out row + two (three) weight vectors
    return (len(shape) >= 2 and jnp.dtype(dtype) == jnp.bfloat16 and d % LANE == 0 and d // LANE <= 256
            and (n + vectors) * d * 2 <= SMEM_BUDGET)


def _mix(cand: jax.Array, norm_weight: jax.Array, query: jax.Array, eps: float,
         out_norm: jax.Array | None = None) -> jax.Array:
    """cand [N, R, D] bf16 -> [R, D] bf16, one block per row; with out_norm [D], RMSNorm-ed."""
    n, rows, d = cand.shape
    # A TMA box spans at most 256 elements per dimension: D travels as [D / 128, 128].
    shape = (d // LANE, LANE)
    vectors = (norm_weight, query) + ((out_norm,) if out_norm is not None else ())

    def attn_res_mix_kernel(c_gmem, *refs):
        *v_gmem, o_gmem = refs
        r = jax.lax.axis_index("r")

        @functools.partial(pl.run_scoped, c_smem=plgpu.SMEM((n, *shape), cand.dtype),
                           v_smem=[plgpu.SMEM(shape, v.dtype) for v in vectors],
                           o_smem=plgpu.SMEM(shape, cand.dtype), bar=plgpu.Barrier(num_barriers=1 + len(vectors)))
        def _(c_smem, v_smem, o_smem, bar):
            plgpu.copy_gmem_to_smem(c_gmem.at[:, r], c_smem, bar.at[0])
            for i, (src, dst) in enumerate(zip(v_gmem, v_smem)):
                plgpu.copy_gmem_to_smem(src, dst, bar.at[1 + i])
            for i in range(1 + len(vectors)):
                plgpu.barrier_wait(bar.at[i])
            nw_smem, q_smem = v_smem[:2]
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
            mixed = acc.astype(o_smem.dtype)
            if out_norm is not None:       # ops.rms_norm of the bf16 mix
                mf = mixed.astype(f32)
                normed = (mf * jax.lax.rsqrt(jnp.sum(mf * mf) / d + eps)).astype(mixed.dtype)
                mixed = v_smem[2][...].astype(mixed.dtype) * normed
            o_smem[...] = mixed
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[r])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        attn_res_mix_kernel, out_type=jax.ShapeDtypeStruct((rows, *shape), cand.dtype), grid=(rows,), grid_names=("r",),
        interpret=mgpu.interpret_params(),
    )(cand.reshape(n, rows, *shape), *(v.reshape(shape) for v in vectors)).reshape(rows, d)


def _run(op: str, candidates: jax.Array, norm_weight: jax.Array, query: jax.Array, eps: float,
         out_norm: jax.Array | None, min_rows: int) -> jax.Array:
    """Either op on candidates [N, ..., D]: the reference where the kernel does not cover them or
    below `min_rows` rows, else the kernel; -> [..., D] in the candidates' dtype."""
    norm = () if out_norm is None else (out_norm,)
    reference = ops.attn_res_mix if out_norm is None else ops.attn_res_mix_norm
    if not covers(candidates.shape, candidates.dtype, with_norm=out_norm is not None):
        why = f"candidates {candidates.dtype}{list(candidates.shape)} not covered"
        return registry.fallback(op, "pallas", why)(candidates, norm_weight, query, *norm, eps)
    n, lead, d = candidates.shape[0], candidates.shape[1:-1], candidates.shape[-1]
    rows = math.prod(lead)
    if rows < min_rows:
        return reference(candidates, norm_weight, query, *norm, eps)
    return _mix(candidates.reshape(n, rows, d), norm_weight, query, eps, out_norm).reshape(*lead, d)


def attn_res_mix(candidates: jax.Array, norm_weight: jax.Array, query: jax.Array, eps: float, *,
                 min_rows: int = KERNEL_MIN_ROWS) -> jax.Array:
    """Same contract as k3jax.ops.attn_res_mix: candidates [N, ..., D] -> [..., D] in their dtype.
    Fewer than `min_rows` rows run the reference (faster there, module doc)."""
    return _run("attn_res_mix", candidates, norm_weight, query, eps, None, min_rows)


def attn_res_mix_norm(candidates: jax.Array, norm_weight: jax.Array, query: jax.Array, out_norm: jax.Array,
                      eps: float, *, fused: bool = True, min_rows: int = KERNEL_MIN_ROWS) -> jax.Array:
    """Same contract as k3jax.ops.attn_res_mix_norm: candidates [N, ..., D] -> the RMSNorm-ed mix
    [..., D] in their dtype. fused=False: the mix kernel, then the norm as an XLA op (ablation).
    Fewer than `min_rows` rows run the reference (faster there, module doc)."""
    if not fused:
        return ops.rms_norm(attn_res_mix(candidates, norm_weight, query, eps, min_rows=min_rows), out_norm, eps)
    return _run("attn_res_mix_norm", candidates, norm_weight, query, eps, out_norm, min_rows)


registry.register("attn_res_mix", "pallas", attn_res_mix)
registry.register("attn_res_mix_norm", "pallas", attn_res_mix_norm)

# ------------------------------------------------------------------ validation / benchmark spec
K3_D = 7168
BENCH_BATCHES = (1, 8, 32, 128)
EPS = 1e-6


def _make(n: int, lead: tuple[int, ...], d: int, dtype=jnp.bfloat16, with_norm: bool = False):
    def make(key):
        kc, kw, kq, ks, ko = jax.random.split(key, 5)
        # Candidates of different scales, as block sums grow with depth.
        scale = jnp.exp(jax.random.normal(ks, (n,) + (1,) * (len(lead) + 1)))
        cand = (jax.random.normal(kc, (n, *lead, d), f32) * scale).astype(dtype)
        nw = (1.0 + 0.1 * jax.random.normal(kw, (d,), f32)).astype(dtype)
        q = (jax.random.normal(kq, (d,), f32) * d ** -0.5 * 4).astype(dtype)
        out_norm = (1.0 + 0.1 * jax.random.normal(ko, (d,), f32)).astype(dtype)
        return (cand, nw, q, out_norm) if with_norm else (cand, nw, q)
    return make


def _cases(with_norm: bool) -> list[registry.Case]:
    kw = (("eps", EPS),)

    def case(name, n, lead, d, dtype=jnp.bfloat16, sizes=frozenset({"small"}), fused=True):
        kernel = (("min_rows", 1),) + (() if fused else (("fused", False),))     # the kernel at every size
        return registry.Case(name, _make(n, lead, d, dtype, with_norm), kw, batch=math.prod(lead), sizes=sizes,
                             kernel_kwargs=kernel)

    small = [case(f"n{n}_lead{'x'.join(map(str, lead))}_d{d}", n, lead, d)
             for n, lead, d in ((2, (1,), 256), (9, (3,), 512), (5, (2, 2), 128), (1, (4,), 384), (9, (1, 1), 1024))]
    small += [case("fallback_d96", 3, (2,), 96), case("fallback_f32", 3, (2,), 256, f32)]
    k3 = [case(f"n{n}_b{b}", n, (b, 1), K3_D, sizes=frozenset({"k3"})) for n in (2, 9) for b in BENCH_BATCHES]
    if with_norm:       # the fusion's ablation: the mix kernel, then an XLA norm
        small.append(case("n9_lead3_d512_unfused", 9, (3,), 512, fused=False))
        k3 += [case(f"n9_b{b}_unfused", 9, (b, 1), K3_D, sizes=frozenset({"k3"}), fused=False) for b in BENCH_BATCHES]
    return small + k3


def cost(args, kwargs) -> tuple[float, float]:
    """Candidates and the [D] vectors read, one row written; ~2 FLOPs per candidate element for each
    of squares, score dot and weighted sum."""
    cand, *vectors = args
    nbytes = cand.size * cand.dtype.itemsize + sum(v.size * v.dtype.itemsize for v in vectors) \
        + cand[0].size * cand.dtype.itemsize
    return float(nbytes), 6.0 * cand.size


def _norm_tolerance(args, kwargs) -> float:
    """Two bf16 roundings in series: the mix (kernel and reference may land one ulp apart, a shift
    the norm carries through), then the normalised, weighted output; 2 x the one-rounding bound
    (K3 N = 9 on the H200: up to 1.15e-2, kernel and mix-kernel + XLA norm alike)."""
    return 2 * registry.TOLERANCE[jnp.dtype(args[0].dtype).name]


registry.register_spec(registry.OpSpec(
    name="attn_res_mix", reference=ops.attn_res_mix, cases=lambda: _cases(False), cost=cost,
    notes=f"bf16, D % 128 == 0, (N + 3) * D * 2 bytes <= {SMEM_BUDGET // 1024} KB, >= {KERNEL_MIN_ROWS} rows in "
          "the kernel; anything else runs the reference (cases force the kernel: min_rows=1)",
))

registry.register_spec(registry.OpSpec(
    name="attn_res_mix_norm", reference=ops.attn_res_mix_norm, cases=lambda: _cases(True), cost=cost,
    tolerance=_norm_tolerance,
    notes=f"attn_res_mix + the sub-layer RMSNorm in one kernel; (N + 4) * D * 2 bytes <= {SMEM_BUDGET // 1024} KB, "
          f">= {KERNEL_MIN_ROWS} rows; `_unfused` cases: the mix kernel then an XLA norm (the fusion's ablation)",
))
