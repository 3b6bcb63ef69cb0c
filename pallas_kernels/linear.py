"""Skinny bf16 GEMM/GEMV for decode projections: y = x @ W.T, x [..., in] (1-256 rows), W [out, in].

Kernel (Mosaic GPU, Hopper): "swap AB". Decode has few rows, so the weight plays the wgmma's
M side (64 output features per warpgroup) and the activations its N side (rows padded to a
multiple of 8, the smallest wgmma N): acc[64, N] += W[64, bk] @ x[N, bk].T, with W and x tiles
streamed GMEM -> SMEM by TMA in a multi-stage `emit_pipeline`. Every weight byte is read exactly
once per call; that read is the whole cost at decode, so the grid is sized for bandwidth:
out/64 tiles times a split of the input dimension chosen to fill every SM in whole waves. Each
split writes a float32 partial [S, tiles * 64, N]; a tiny XLA epilogue sums, transposes and casts.
With one split (and out a multiple of 64) there is no epilogue: each warpgroup stores its tile
transposed, the real rows only, in x's dtype, into the result [rows, out] (`mgpu.store_transposed`;
before session 36 a float32 [tiles * 64, N] went out and back through XLA: at 128 rows, lm_head's
84 MB written and read again).
When out is not a multiple of 64 (K3's 96-row KDA beta projection), the last tile reads the
weight's last 64 rows, overlapping the tile before it, and the epilogue keeps only its new rows.

Shapes the kernel does not cover (non-bf16, out below 64, in not a multiple of 64, more than 256
rows) run the reference (k3jax.ops.linear) instead; `covers()` says which. So does a single row
(below KERNEL_MIN_ROWS), where XLA's own GEMV is faster in the decode step: it needs no row pad
and no partial-sum epilogue, two launches per projection here. H200, k3-h200 batch-1 step: 5.93
ms with every one-row projection on XLA's GEMV, 6.23 ms with weights of 16 MB and more on the
kernel (the rule until session 10), 6.36 ms with all on the kernel (sessions 9, 11). From 8 rows
the two are within 1% in the step (10.28 vs 10.39 ms, session 11).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import ops
from pallas_kernels import mgpu, registry

BLOCK_OUT = 64            # one warpgroup's wgmma M
MAX_ROWS = 256            # largest wgmma N
SMEM_BUDGET = 180 * 1024  # of the H200's 227 KB per block; leaves room for the epilogue tile
KERNEL_MIN_ROWS = 2       # fewer rows run XLA's GEMV, faster in the step (module doc)


def covers(x_shape, w_shape, x_dtype, w_dtype) -> bool:
    """Whether the kernel handles these shapes/dtypes (else `linear` runs the reference)."""
    rows = math.prod(x_shape[:-1])
    out, din = w_shape
    return (jnp.dtype(x_dtype) == jnp.bfloat16 and jnp.dtype(w_dtype) == jnp.bfloat16
            and out >= BLOCK_OUT and din % 64 == 0 and 1 <= rows <= MAX_ROWS)


def stages_fitting(rows_padded: int, block_k: int, most: int, weight_rows: int = BLOCK_OUT) -> int:
    """The most pipeline stages (<= most) of `accumulate_rows` whose SMEM - weight_rows weight rows
    + rows_padded activation rows of block_k bf16 columns per stage - fits SMEM_BUDGET (0: none)."""
    return next((st for st in range(most, 0, -1) if (weight_rows + rows_padded) * block_k * 2 * st <= SMEM_BUDGET), 0)


def k_tiles(rows_padded: int, din: int, weight_rows: int = BLOCK_OUT) -> tuple[int, int]:
    """(block_k, stages): the largest k tile (leaving at least two k steps) with 2-4 stages that fit
    (`stages_fitting`), the most such stages."""
    return next(((bk, st) for bk in (256, 128, 64)
                 if din % bk == 0 and din // bk >= 2 and (st := stages_fitting(rows_padded, bk, 4, weight_rows)) >= 2),
                (64, 1))          # in == 64: a single k step


def plan(rows_padded: int, out: int, din: int, sms: int) -> tuple[int, int, int]:
    """(block_k, pipeline stages, K splits) for one call.

    The k tile and stage count of `k_tiles`; then the K split maximising (SM fill over whole
    waves: a tail wave idles SMs at a bandwidth-bound step) x (weight bytes / (weight +
    partial-sum bytes)), with at least two pipeline steps per block; ties go to the smaller split.
    """
    block_k, stages = k_tiles(rows_padded, din)
    k_steps = din // block_k
    tiles = -(-out // BLOCK_OUT)
    weight_bytes = out * din * 2
    best = (0.0, 1)
    for s in range(1, k_steps + 1):
        if k_steps % s or (s > 1 and k_steps // s < 2):
            continue
        blocks = tiles * s
        fill = blocks / (math.ceil(blocks / sms) * sms)
        # Each split's float32 partial is written and read back by the epilogue.
        useful = weight_bytes / (weight_bytes + 2 * s * out * rows_padded * 4)
        if fill * useful > best[0] + 1e-9:
            best = (fill * useful, s)
    # delay_release=1 (a wgmma may still read the previous stage) needs at least 2 stages.
    return block_k, max(min(2, k_steps), min(stages, k_steps // best[1])), best[1]


def accumulate_rows(acc_ref, w_rows, x_rows, block_k: int, stages: int) -> None:
    """Inside a warpgroup-semantics kernel: acc_ref [64, N] float32 += w_rows [64, K] @ x_rows
    [N, K].T (GMEM refs, bf16), K streamed GMEM -> SMEM in block_k steps by a `stages`-deep TMA
    pipeline: the swap-AB step of every skinny GEMM here (this module, mla_decode's expansion)."""
    # A stage is refilled only after the next step's wgmma was issued (the previous one may
    # still read it); with a single step nothing is refilled.
    delay = 1 if stages >= 2 else 0
    plgpu.emit_pipeline(
        lambda _, w_smem, x_smem: plgpu.wgmma(acc_ref, w_smem, x_smem.transpose((1, 0))),
        grid=(w_rows.shape[1] // block_k,),
        in_specs=[plgpu.BlockSpec((BLOCK_OUT, block_k), lambda k: (0, k), delay_release=delay),
                  plgpu.BlockSpec((x_rows.shape[0], block_k), lambda k: (0, k), delay_release=delay)],
        max_concurrent_steps=stages,
    )(w_rows, x_rows)


def _products(xp: jax.Array, w: jax.Array, block_k: int, stages: int, splits: int,
              rows: int | None = None, dtype=None) -> jax.Array:
    """W @ xp.T for xp [N, in] bf16 (N % 8 == 0). Given the real `rows` and a 16-bit `dtype`, one
    split of whole 64-row tiles (out % 64 == 0) gives the result itself, [rows, out] in `dtype`,
    each tile stored transposed (`mgpu.store_transposed`: no epilogue). Else float32 partials
    [splits, tiles * 64, N] for the caller to sum; tile t holds W rows min(64 t, out - 64) + 0..63."""
    n, din = xp.shape
    out = w.shape[0]
    tiles = -(-out // BLOCK_OUT)
    k_per = din // splits
    final = dtype is not None and jnp.dtype(dtype).itemsize == 2 and splits == 1 and out % BLOCK_OUT == 0

    def linear_gemv(x_gmem, w_gmem, o_gmem):
        oi, si = jax.lax.axis_index("o"), jax.lax.axis_index("s")
        k_slice = pl.ds(si * k_per, k_per)
        w_rows = pl.ds(jnp.minimum(oi * BLOCK_OUT, out - BLOCK_OUT), BLOCK_OUT)

        def acc_scope(acc_ref):
            accumulate_rows(acc_ref, w_gmem.at[w_rows, k_slice], x_gmem.at[:, k_slice], block_k, stages)
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_OUT, n)))
        if final:
            mgpu.store_transposed(acc, o_gmem.at[:, pl.ds(oi * BLOCK_OUT, BLOCK_OUT)])
        else:
            mgpu.store_tile(acc, o_gmem.at[si, pl.ds(oi * BLOCK_OUT, BLOCK_OUT)])

    out_type = (jax.ShapeDtypeStruct((rows, out), dtype) if final
                else jax.ShapeDtypeStruct((splits, tiles * BLOCK_OUT, n), jnp.float32))
    return plgpu.kernel(
        linear_gemv, out_type=out_type, grid=(tiles, splits), grid_names=("o", "s"),
        compiler_params=mgpu.warpgroup_params(), interpret=mgpu.interpret_params(),
    )(xp, w)


def linear(x: jax.Array, weight: jax.Array, *, min_rows: int = KERNEL_MIN_ROWS) -> jax.Array:
    """Same contract as k3jax.ops.linear: x [..., in] @ weight[out, in].T -> [..., out] in x's dtype.
    Fewer than `min_rows` rows run the reference (faster there, module doc; 1: always the kernel)."""
    lead, din = x.shape[:-1], x.shape[-1]
    out = weight.shape[0]
    rows = math.prod(lead)
    if not covers(x.shape, weight.shape, x.dtype, weight.dtype):
        why = f"x {x.dtype}{list(x.shape)}, weight {weight.dtype}{list(weight.shape)} not covered"
        return registry.fallback("linear", "pallas", why)(x, weight)
    if rows < min_rows:
        return ops.linear(x, weight)          # faster there (module doc), not a coverage gap
    n = max(8, -(-rows // 8) * 8)
    xp = jnp.pad(x.reshape(rows, din), ((0, n - rows), (0, 0)))
    block_k, stages, splits = plan(n, out, din, mgpu.num_sms())
    y = _products(xp, weight, block_k, stages, splits, rows, x.dtype)
    if y.ndim == 2:                                 # the result itself (one split)
        return y.reshape(*lead, out)
    part = y.sum(0)
    last = (out // BLOCK_OUT) * BLOCK_OUT          # the overlapping last tile's first new row
    if last < out:
        part = jnp.concatenate([part[:last], part[part.shape[0] - (out - last):]])
    return part.T[:rows].astype(x.dtype).reshape(*lead, out)


registry.register("linear", "pallas", linear)

# ------------------------------------------------------------------ validation / benchmark spec
# (out, in) of K3's dense decode projections (see K3_ARCHITECTURE.md).
K3_SHAPES = {
    "kda_qkvg_proj": (12288, 7168), "kda_o_proj": (7168, 12288), "kda_f_a": (128, 7168),
    "kda_f_b": (12288, 128), "mla_q_a": (1536, 7168), "mla_q_b": (18432, 1536),
    "mla_kv_a": (576, 7168), "kda_b_proj": (96, 7168), "latent_down": (3584, 7168), "latent_up": (7168, 3584),
    "shared_down": (7168, 6144), "lm_head": (163840, 7168),
}
BENCH_BATCHES = (1, 8, 32, 128)


def _make(rows: int, out: int, din: int, dtype=jnp.bfloat16):
    def make(key):
        kx, kw = jax.random.split(key)
        x = jax.random.normal(kx, (rows, din), jnp.float32).astype(dtype)
        w = (jax.random.normal(kw, (out, din), jnp.float32) * din ** -0.5).astype(dtype)
        return x, w
    return make


def cases() -> list[registry.Case]:
    kernel = (("min_rows", 1),)      # the kernel at one row too
    small = [registry.Case(f"rows{r}_out{o}_in{i}", _make(r, o, i), batch=r, kernel_kwargs=kernel)
             for r, o, i in ((1, 128, 256), (5, 64, 512), (8, 192, 128), (33, 128, 384), (256, 64, 256),
                             (4, 512, 64))]
    small.append(registry.Case("out96_overlapping_tile", _make(1, 96, 256), batch=1, kernel_kwargs=kernel))
    small.append(registry.Case("out200_k_split", _make(2, 200, 1024), batch=2, kernel_kwargs=kernel))
    # Outside the kernel's coverage: must still match (the reference runs).
    small.append(registry.Case("fallback_out32", _make(3, 32, 256), batch=3))
    k3 = [registry.Case(f"{name}_b{b}", _make(b, o, i), batch=b, sizes=frozenset({"k3"}), kernel_kwargs=kernel)
          for name, (o, i) in K3_SHAPES.items() for b in BENCH_BATCHES]
    k3.append(registry.Case("kda_qkvg_proj_b256", _make(256, 12288, 7168), batch=256, sizes=frozenset({"k3"})))
    return small + k3


def cost(args, kwargs) -> tuple[float, float]:
    x, w = args
    rows = math.prod(x.shape[:-1])
    out, din = w.shape
    nbytes = w.size * w.dtype.itemsize + x.size * x.dtype.itemsize + rows * out * x.dtype.itemsize
    return float(nbytes), 2.0 * rows * out * din


registry.register_spec(registry.OpSpec(
    name="linear", reference=ops.linear, cases=cases, cost=cost,
    notes=f"bf16, out >= 64, in % 64 == 0, {KERNEL_MIN_ROWS}-256 rows in the kernel; anything else runs the "
          "reference (cases force the kernel at one row: min_rows=1)",
))
