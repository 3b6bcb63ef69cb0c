"""CuTe implementations of the decode ops, registered as impl "cute" in pallas_kernels.registry.

Each takes exactly its reference's arguments (k3jax.ops). Shapes/dtypes a kernel does not cover,
or a process without a GPU, fall back to the reference with one log line per reason.

  linear:       bf16 x [..., K] @ w [N, K].T with 2-8 rows and K % 8 == 0 (rows padded up to the
                next compiled count; one row runs XLA's GEMV, GEMV_MIN_ROWS; min_rows=1 forces the
                kernel): one row -> gemv_r1 (SIMT) when N >= SIMT_MIN_ROWS; else
                the MMA kernels, gemv_r{2,4,8}, or for narrow w (N < 16 x SPLIT_MAX_TILES)
                gemv_split_r* over k_splits(N, K) slices of K with XLA summing the float32 partials.
  moe_experts:  MXFP4 experts, bf16 z [N, M], M and I multiples of 32, grouped by expert: the
                distinct selected experts (k3jax.ops.expert_dispatch) and each one's token slots
                (`expert_slots`), then moe_gate_up_t{T}, k3jax.ops.glu in XLA (the one formula),
                moe_down_t{T} (each slot's weighted output, float32), summed over each token's k
                slots in XLA. T = 1 for one token, else 8; more than 8 tokens run grouped
                (ops.expert_groups: each selected expert's choices in rows of at most 8, so an
                expert with more takes several rows), in calls of at most ops.GROUPED_MAX_TOKENS
                (until session 28: calls of 8 tokens, each reading its experts). The kernels take the
                activations in the decode's pair order (permute_x; experts in tiles store tile words,
                mxfp4.tile_words, whose pairs are consecutive columns, and take them as they are: no
                XLA pass over z);
                exact for scale bytes in kernels/mxfp4_moe.py's EXACT_SCALES (2..128). A block
                owns MOE_ROWS = 64 expert rows (four MMA row tiles sharing each activation read;
                the `_rows64` kernels) when M and I divide by 128, else 16 (`block_rows=16` forces
                it). H200, K3 E=448 (session 11): 16 / 32 / 64 / 128 rows per block 101.5 / 98.8 /
                94.1 / 109.4 us at batch 1, 639.6 / 553.7 / 551.7 / 643.3 us at batch 8.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from cute_bridge import loader
from cute_bridge.kernel_set import GEMV_ROWS, MOE_BLOCK_ROWS, MOE_TOKENS, MOE_WIDE_MULTIPLE
from k3jax import ops
from pallas_kernels.registry import fallback, register


GEMV_TILE = 16            # output rows per GEMV block (kernels/gemv.py TILE)
# K split: H200, session 6, batch 8: 3584 x 7168 18.1 us split in 3 vs 24.8 unsplit, but 7168 x
# 12288 59.1 us split in 2 vs 51.2 unsplit (the XLA sum and the extra partial traffic).
SPLIT_MAX_TILES = 2 * 132  # from this many 16-row tiles up, no split
SPLIT_BLOCKS = 4 * 132    # blocks a split aims at (four per H200 SM)
MIN_SPLIT_CHUNKS = 16     # 32-column chunks per K slice at least (four per warp)
SIMT_MIN_ROWS = 1024      # one x row and at least this many outputs: gemv_r1 (SIMT); fewer: split MMA
# One row runs XLA's GEMV: faster in the decode step (H200, k3-h200 batch 1, session 11: 5.87 ms
# with every projection on XLA's GEMV, 6.17 ms on these kernels; op for op the kernels match XLA's
# GEMV, but the step's XLA GEMVs need no separate launch for their input and output glue).
GEMV_MIN_ROWS = 2
MOE_ROWS = 64             # expert rows per MoE block where M and I divide (module doc)


def _runnable() -> str | None:
    if getattr(loader._export_only, "on", False):
        return None
    return None if loader.has_gpu() else "no GPU"


def linear(x: jax.Array, weight: jax.Array, *, min_rows: int = GEMV_MIN_ROWS) -> jax.Array:
    """x [..., K] @ weight [N, K].T -> [..., N], float32 accumulation, x's dtype (ops.linear).
    Fewer than `min_rows` rows run the reference (faster in the step; 1: always the kernel)."""
    rows = math.prod(x.shape[:-1])
    if rows < min_rows:
        return ops.linear(x, weight)
    k = x.shape[-1]
    reason = _runnable() or (
        "needs bf16 x and weight" if (x.dtype, weight.dtype) != (jnp.bfloat16, jnp.bfloat16) else
        f"K={k} is not a multiple of 8" if k % 8 or weight.shape[-1] != k else
        f"{rows} rows > {GEMV_ROWS[-1]} (a GEMV covers decode batches)" if rows > GEMV_ROWS[-1] or rows == 0 else None)
    if reason:
        return fallback("linear", "cute", reason)(x, weight)
    n = weight.shape[0]
    name, r, splits = gemv_kernel(rows, n, k)
    x2 = jnp.pad(x.reshape(rows, k), ((0, r - rows), (0, 0)))
    if splits is None:
        (y,) = loader.call(name, x2, weight)                     # [r, n] bf16
    else:
        (part,) = loader.call(name, x2, weight, dims={"S": splits})     # [S, r, n] float32 partials
        y = part.sum(0).astype(x.dtype)
    return y[:rows].reshape(*x.shape[:-1], n)


def gemv_kernel(rows: int, n: int, k: int) -> tuple[str, int, int | None]:
    """The kernel `linear` runs for `rows` (1-8) rows of x against w [n, k] -> (name, rows padded
    to r of GEMV_ROWS, K slices or None): one row and n >= SIMT_MIN_ROWS: gemv_r1 (SIMT); else
    k_splits(n, k) slices, one from r = 2 up: gemv_r{r}; otherwise gemv_split_r{r} (its float32
    partials are summed in XLA)."""
    r = next(r for r in GEMV_ROWS if r >= rows)
    splits = k_splits(n, k)
    if r == 1 and n >= SIMT_MIN_ROWS:
        return "gemv_r1", r, None
    if splits == 1 and r > 1:
        return f"gemv_r{r}", r, None
    return f"gemv_split_r{r}", r, splits


def k_splits(n: int, k: int) -> int:
    """K slices for an [n, k] MMA GEMV: 1 from SPLIT_MAX_TILES row tiles of 16 up, else enough for
    SPLIT_BLOCKS blocks, each slice keeping >= MIN_SPLIT_CHUNKS 32-column chunks."""
    tiles = -(-n // GEMV_TILE)
    if tiles >= SPLIT_MAX_TILES:
        return 1
    return max(1, min(-(-SPLIT_BLOCKS // tiles), -(-k // 32) // MIN_SPLIT_CHUNKS))


def _words(packed: jax.Array) -> jax.Array:
    """uint8 codes [E, O, in/2] viewed as int32 [E, O, in/8] (no copy: a bitcast)."""
    e, o, half = packed.shape
    return jax.lax.bitcast_convert_type(packed.reshape(e, o, half // 4, 4), jnp.int32)


def permute_x(x: jax.Array) -> jax.Array:
    """x [..., D] (D % 8 == 0) -> its columns in the MXFP4 decode's pair order, (0, 4, 1, 5, 2, 6, 3, 7)
    within every 8 (kernels/mxfp4_moe.py)."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 8, 2, 4).swapaxes(-1, -2).reshape(*lead, d)


def _pair_order(x: jax.Array, experts: ops.ExpertWeights) -> jax.Array:
    """x [..., D] with its columns where the MoE kernels' decoded code pairs meet them: permute_x for
    experts in row order; experts in tiles hold tile words (mxfp4.tile_words: pair a = columns 2a,
    2a + 1): x as it is."""
    return x if experts.tiled else permute_x(x)


def expert_slots(ids: jax.Array, weights: jax.Array, num_experts: int, tokens: int):
    """The MoE kernels' grouping of ids, weights [N, k] (N <= tokens) -> (experts, slots, kept, coef).

    experts [U] int32: for one token its k ids as they are (U = k), else the distinct selected
    experts (U = min(num_experts, N k), padded with num_experts, which the kernels skip).
    slots [U, tokens] int32: the slot n * k + j where token n chose experts[u] as its j-th and the
    kernels fill it, else -1. kept [N, k] bool: the slots the kernels fill (an id >= num_experts
    never; past one token a repeated id once, at its last slot). coef [N, k] float32: each kept
    slot's routing coefficient (a repeated id's summed weights), else 0. One token takes no XLA
    work (at batch 1 each small fusion costs ~1 us of a ~90 us op): a repeated id, which top-k
    routing never gives, runs once per slot (the same sum up to float32 rounding), and coef is
    the weights as they are (the combine drops the slots not kept).
    """
    n, k = ids.shape
    if n > tokens:
        raise ValueError(f"expert_slots: {n} tokens do not fit the kernels' {tokens} token columns")
    if n == 1:
        kept = ids < num_experts
        slots = jnp.asarray(np.arange(k, dtype=np.int32)[:, None])     # a constant: no iota launch
        experts, _ = ops.expert_dispatch(ids, weights, num_experts, k)      # one token: its ids as they are
        return experts, slots, kept, weights.astype(jnp.float32)
    same = ids[:, :, None] == ids[:, None, :]                                 # [N, j, j']
    kept = (ids < num_experts) & ~ops.repeated_later(ids)
    coef = jnp.where(kept, jnp.sum(jnp.where(same, weights[:, None, :], 0.0), axis=2), 0.0).astype(jnp.float32)
    slot = jnp.arange(n * k, dtype=jnp.int32).reshape(n, k)
    experts, _ = ops.expert_dispatch(ids, weights, num_experts, min(num_experts, n * k))
    match = (ids[None] == experts[:, None, None]) & kept[None]            # [U, N, k]
    slots = jnp.max(jnp.where(match, slot[None], -1), axis=2)
    return experts, jnp.pad(slots, ((0, 0), (0, tokens - slots.shape[1])), constant_values=-1), kept, coef


def moe_experts(z: jax.Array, ids: jax.Array, weights: jax.Array, experts: ops.ExpertWeights, *,
                act: str, beta: float, linear_beta: float | None, expert_chunk: int = 64,
                block_rows: int = MOE_ROWS) -> jax.Array:
    """Routed experts (ops.moe_experts contract): z [N, M], ids/weights [N, k] -> [N, M].
    block_rows: expert rows per block, one of kernel_set.MOE_BLOCK_ROWS (experts in tiles: 64)."""
    m = z.shape[1]
    inter = experts.w1.shape[1]
    if block_rows not in MOE_BLOCK_ROWS:
        raise ValueError(f"block_rows={block_rows}: compiled MoE kernels take {MOE_BLOCK_ROWS}")
    if experts.tiled and block_rows != MOE_BLOCK_ROWS[-1]:
        raise ValueError(f"block_rows={block_rows}: experts stored in tiles run {MOE_BLOCK_ROWS[-1]}-row blocks")
    reason = _runnable() or (
        "bf16 experts have no CuTe kernel" if not experts.is_mxfp4 else
        "needs bf16 activations" if z.dtype != jnp.bfloat16 else
        f"hidden {m} and intermediate {inter} must be multiples of 32" if m % 32 or inter % 32 else None)
    if reason:
        return fallback("moe_experts", "cute", reason)(z, ids, weights, experts, act=act, beta=beta,
                                                linear_beta=linear_beta, expert_chunk=expert_chunk)
    act_kw = dict(act=act, beta=beta, linear_beta=linear_beta, block_rows=block_rows)
    if z.shape[0] <= MOE_TOKENS[-1]:
        tokens = next(t for t in MOE_TOKENS if t >= z.shape[0])
        return _moe_kernels(z, *expert_slots(ids, weights, experts.w1.shape[0], tokens), experts, tokens, **act_kw)
    run = lambda zc, ic, wc: _moe_kernels(zc, *_expert_groups(ic, wc, experts.w1.shape[0]), experts,  # noqa: E731
                                          MOE_TOKENS[-1], **act_kw)
    return ops.map_token_chunks(run, z, ids, weights, ops.GROUPED_MAX_TOKENS)


def _expert_groups(ids: jax.Array, weights: jax.Array, num_experts: int):
    """expert_slots' outputs for the grouped schedule (more tokens than a kernel's columns): every
    slot of ops.expert_groups is a grid row naming up to MOE_TOKENS[-1] of its expert's choices, so
    an expert with more choices takes several rows (and reads its weights once per row)."""
    n, k = ids.shape
    uniq, choices, _ = ops.expert_groups(ids, num_experts, MOE_TOKENS[-1])
    kept = ids < num_experts
    return uniq, jnp.where(choices < n * k, choices, -1), kept, jnp.where(kept, weights, 0.0).astype(jnp.float32)


def _moe_kernels(z, uniq, slots, kept, coef, experts: ops.ExpertWeights, tokens: int, *, act, beta, linear_beta,
                 block_rows) -> jax.Array:
    """The two MoE kernels (T = tokens columns) over the grid rows uniq [U] / slots [U, T] naming
    the choices n*k + j they fill (kept [N, k], coef [N, k]: expert_slots):
    z [N, M] -> [N, M] in z's dtype."""
    n, m = z.shape
    k = kept.shape[1]
    if block_rows > MOE_BLOCK_ROWS[0] and (m % MOE_WIDE_MULTIPLE or experts.w1.shape[1] % MOE_WIDE_MULTIPLE):
        block_rows = MOE_BLOCK_ROWS[0]      # one row tile: every shape the kernels cover
    kernel = f"t{tokens}" + ("" if block_rows == MOE_BLOCK_ROWS[0] else f"_rows{block_rows}") + (
        "_tiles" if experts.tiled else "")      # tiled experts: M and I are multiples of 128 (K3Config)
    gate, up = loader.call(f"moe_gate_up_{kernel}", _pair_order(z, experts), uniq, slots, _words(experts.w1),
                           experts.s1, _words(experts.w3), experts.s3, dims={"S": n * k})
    hid = ops.glu(gate, up, act, beta, linear_beta)
    (part,) = loader.call(f"moe_down_{kernel}", _pair_order(hid, experts), uniq, slots, coef.reshape(-1),
                          _words(experts.w2), experts.s2)
    part = jnp.where(kept[..., None], part.reshape(n, k, m), 0.0)            # unfilled slots: no term
    return part.sum(1).astype(z.dtype)                                      # the reference's float32 combine


register("linear", "cute", linear)
register("moe_experts", "cute", moe_experts)
