"""MoE router: x [N, D] (bf16) @ weight[E, D].T in float32 -> sigmoid -> + bias (selection only)
-> top-k (ties to the lower expert id) -> renormalised, scaled weights of the plain scores.
Returns (ids [N, k] int32, weights [N, k] float32), as k3jax.ops.route.

Two Mosaic GPU kernels. The logits are a GEMV over a 12.8 MB bf16 weight (K3: E = 896,
D = 7168): bf16 x bf16 products are exact in float32 and the wgmma accumulates in float32,
so `pallas_kernels.linear`'s split-K partial kernel computes them with the reference's float32
numerics (only the summation order differs) at GEMV bandwidth; the grid there must fill the
SMs, while top-k needs every expert's logit of a row, so the selection is a second kernel
(one warpgroup per row) over the tiny summed logits [N, E] float32: sigmoid, bias, k rounds of
(block max, lowest id holding it, its plain score), renormalise, scale. Taking the lowest id
among equal maxima reproduces jax.lax.top_k's tie order exactly.

Covered: sigmoid scores without group-limited routing, bf16 x and weight, E % 64 == 0,
D % 64 == 0, 1-256 rows, k <= min(E, 256). Anything else (softmax, n_group > 1, float32
models) runs the reference; `covers()` says which.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import ops
from pallas_kernels import linear as lin
from pallas_kernels import mgpu, registry

LANE = 256          # logits travel as [E_pad / 256, 256]: a TMA box spans <= 256 per dimension
VEC = 2             # the strided register layout's vector width for 32-bit values of >= 256 elements
f32 = jnp.float32


def covers(x_shape, w_shape, x_dtype, w_dtype, *, top_k, activation, n_group=1, topk_group=1) -> bool:
    """Whether the kernels handle this call (else `route` runs the reference)."""
    e = w_shape[0]
    return (activation == "sigmoid" and not (n_group > 1 and topk_group < n_group) and e % 64 == 0
            and lin.covers(x_shape, w_shape, x_dtype, w_dtype) and 1 <= top_k <= min(e, LANE))


def _select(logits: jax.Array, bias: jax.Array, top_k: int, renormalize: bool, scaling: float):
    """logits [N, E_pad / LANE, LANE] f32 (padding: -inf), bias [E] f32 -> (ids [N, LANE] int32,
    weights [N, LANE] f32); the first top_k slots of each row are the result. The bias is read as
    the model holds it (a padded copy would be an XLA launch every step): the padding experts are
    masked by their id instead."""
    rows, tiles, _ = logits.shape
    e = bias.shape[0]
    shape = (tiles, LANE)
    strided = plgpu.Layout.WG_STRIDED(shape, VEC)
    slots_layout = plgpu.Layout.WG_STRIDED((LANE,), VEC)

    def route_topk(l_gmem, b_gmem, ids_gmem, w_gmem):
        r = jax.lax.axis_index("r")

        @functools.partial(pl.run_scoped, l_smem=plgpu.SMEM(shape, f32), b_smem=plgpu.SMEM(shape, f32),
                           ids_smem=plgpu.SMEM((LANE,), jnp.int32), w_smem=plgpu.SMEM((LANE,), f32),
                           bar=plgpu.Barrier(num_barriers=1 + tiles))
        def _(l_smem, b_smem, ids_smem, w_smem, bar):
            plgpu.copy_gmem_to_smem(l_gmem.at[r], l_smem, bar.at[0])
            for t in range(tiles):          # the bias row by row; the padding's slots stay unwritten
                width = min(LANE, e - t * LANE)
                plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(t * LANE, width)], b_smem.at[t, pl.ds(0, width)],
                                        bar.at[1 + t])
            for i in range(1 + tiles):
                plgpu.barrier_wait(bar.at[i])
            scores = jax.nn.sigmoid(l_smem[...])
            expert = (plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=strided) * LANE
                      + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=strided))
            choice = jnp.where(expert < e, scores + b_smem[...], -jnp.inf)
            slot = plgpu.broadcasted_iota(jnp.int32, (LANE,), 0, layout=slots_layout)
            none = jnp.int32(tiles * LANE)

            def pick(j, carry):
                choice, ids, weights = carry
                best = jnp.max(choice)
                idx = jnp.min(jnp.where(choice == best, expert, none))   # lowest id among ties
                hit = expert == idx
                w = jax.nn.sigmoid(l_smem[idx // LANE, idx % LANE])   # its plain score: a load, no reduction
                return (jnp.where(hit, -jnp.inf, choice), jnp.where(slot == j, idx, ids),
                        jnp.where(slot == j, w, weights))

            ids0 = plgpu.layout_cast(jnp.zeros((LANE,), jnp.int32), slots_layout)
            w0 = plgpu.layout_cast(jnp.zeros((LANE,), f32), slots_layout)
            _, ids, weights = jax.lax.fori_loop(0, top_k, pick, (choice, ids0, w0))
            if renormalize and top_k > 1:
                weights = weights / (jnp.sum(weights) + 1e-20)
            ids_smem[...] = ids
            w_smem[...] = weights * scaling
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(ids_smem, ids_gmem.at[r])
            plgpu.copy_smem_to_gmem(w_smem, w_gmem.at[r])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        route_topk, out_type=(jax.ShapeDtypeStruct((rows, LANE), jnp.int32), jax.ShapeDtypeStruct((rows, LANE), f32)),
        grid=(rows,), grid_names=("r",), interpret=mgpu.interpret_params(),
    )(logits, bias)


def route(x, weight, bias, *, top_k: int, activation: str, renormalize: bool,
          scaling: float, n_group: int = 1, topk_group: int = 1):
    """Same contract as k3jax.ops.route: (ids [N, k] int32, weights [N, k] float32)."""
    if not covers(x.shape, weight.shape, x.dtype, weight.dtype, top_k=top_k, activation=activation,
                  n_group=n_group, topk_group=topk_group):
        why = (f"x {x.dtype}{list(x.shape)}, {weight.shape[0]} experts, top-{top_k}, {activation}, "
               f"groups {n_group}/{topk_group} not covered")
        return registry.fallback("route", "pallas", why)(x, weight, bias, top_k=top_k, activation=activation,
                                                         renormalize=renormalize, scaling=scaling, n_group=n_group,
                                                         topk_group=topk_group)
    rows, din = x.shape
    e = weight.shape[0]
    n = max(8, -(-rows // 8) * 8)
    xp = jnp.pad(x, ((0, n - rows), (0, 0)))
    part = lin._products(xp, weight, *lin.plan(n, e, din, mgpu.num_sms()))
    e_pad = -(-e // LANE) * LANE
    # Padding experts score sigmoid(-inf) = 0 and choose -inf: never picked while k <= E.
    logits = jnp.pad(part.sum(0).T[:rows], ((0, 0), (0, e_pad - e)), constant_values=-jnp.inf)
    ids, weights = _select(logits.reshape(rows, -1, LANE), bias.astype(f32), top_k, renormalize, scaling)
    return ids[:, :top_k], weights[:, :top_k]


registry.register("route", "pallas", route)

# ------------------------------------------------------------------ validation / benchmark spec
K3_KW = (("top_k", 16), ("activation", "sigmoid"), ("renormalize", True), ("scaling", 1.0))
K3_D = 7168
BENCH_BATCHES = (1, 8, 32, 128)


def _make(rows: int, e: int, d: int, dtype=jnp.bfloat16, ties: bool = False):
    def make(key):
        kx, kw, kb = jax.random.split(key, 3)
        x = jax.random.normal(kx, (rows, d), f32).astype(dtype)
        w = (jax.random.normal(kw, (e, d), f32) * d ** -0.5).astype(dtype)
        if ties:        # duplicated experts: equal scores, so selection rests on the tie rule
            w = w.at[1::2].set(w[0::2])
        bias = 0.01 * jax.random.normal(kb, (e,), f32)
        if ties:
            bias = bias.at[1::2].set(bias[0::2])
        return x, w, bias
    return make


def _kw(top_k, renormalize=True, scaling=1.0, activation="sigmoid", **extra):
    return (("top_k", top_k), ("activation", activation), ("renormalize", renormalize),
            ("scaling", scaling), *extra.items())


def cases() -> list[registry.Case]:
    small = [registry.Case(f"rows{r}_e{e}_d{d}_k{k}", _make(r, e, d), _kw(k, scaling=s), batch=r)
             for r, e, d, k, s in ((1, 128, 256, 4, 1.0), (5, 384, 128, 16, 2.5), (8, 64, 512, 64, 1.0),
                                   (17, 448, 256, 16, 1.0))]
    small.append(registry.Case("ties_rows3_e256_k8", _make(3, 256, 128, ties=True), _kw(8), batch=3))
    small.append(registry.Case("no_renorm_rows2_e128_k1", _make(2, 128, 128), _kw(1, renormalize=False), batch=2))
    # Outside the kernels' coverage: must still match (the reference runs).
    small.append(registry.Case("fallback_softmax", _make(2, 128, 128), _kw(4, activation="softmax"), batch=2))
    small.append(registry.Case("fallback_groups", _make(2, 128, 128), _kw(4, n_group=4, topk_group=2), batch=2))
    small.append(registry.Case("fallback_e96", _make(2, 96, 128), _kw(4), batch=2))     # E not a multiple of 64
    k3 = [registry.Case(f"e{e}_b{b}", _make(b, e, K3_D), K3_KW, batch=b, sizes=frozenset({"k3"}))
          for e in (896, 448) for b in BENCH_BATCHES]
    return small + k3


def compare(out, ref, args, kwargs) -> float:
    """Selected ids must equal the reference's, except where the reference's own choice values
    (scores + bias) of the differing experts lie within float32 summation-order noise (1e-5) of
    each other; weights compare as a relative max error. NaN if ids differ beyond that."""
    ids, w = (np.asarray(a) for a in out)
    rids, rw = (np.asarray(a) for a in ref)
    if ids.shape != rids.shape or not np.all(np.isfinite(w)):
        return float("nan")
    if not np.array_equal(ids, rids):
        if kwargs["activation"] != "sigmoid":       # only the reference runs there: must be equal
            return float("nan")
        x, weight, bias = args
        choice = np.asarray(ops.route_scores(x, weight, bias, "sigmoid")[1])
        rows = np.arange(ids.shape[0])[:, None]
        if np.max(np.abs(choice[rows, ids] - choice[rows, rids])) > 1e-5:
            return float("nan")
    return registry.relative_max_error(w, rw)


def cost(args, kwargs) -> tuple[float, float]:
    x, w, bias = args
    rows = x.shape[0]
    k = kwargs["top_k"]
    nbytes = w.size * w.dtype.itemsize + x.size * x.dtype.itemsize + bias.size * 4 + rows * k * 8
    return float(nbytes), 2.0 * rows * w.shape[0] * w.shape[1]


registry.register_spec(registry.OpSpec(
    name="route", reference=ops.route, cases=cases, cost=cost, compare=compare,
    tolerance=lambda args, kwargs: registry.TOLERANCE["float32"],
    notes="sigmoid, no group routing, bf16, E % 64 == 0, D % 64 == 0, <= 256 rows, k <= min(E, 256) "
          "in the kernels; anything else runs the reference",
))
