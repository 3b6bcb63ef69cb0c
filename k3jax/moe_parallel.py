"""Expert-parallel routed experts: the latent is dispatched to the ranks owning the selected
experts and combined back, with an explicit `jax.shard_map` over the mesh's "expert" axis. Where
the "tensor" axis divides E / ep the experts are split over it too (`expert_axes`): the tensor
ranks of an expert group share its tokens, each runs its own experts' rows, and a psum over
"tensor" completes them (`_tensor_split`; exact, one rank non-zero per row).

Contract (every variant): `moe_experts(z, ids, weights, experts, ...)` with z [N, M] (the
latent, M = moe_hidden_size, e.g. 3584), ids/weights [N, k] and the experts sharded
[E / ep per expert group, split E / (ep * tp) per rank where "tensor" divides them] returns the same [N, M] as `ops.moe_experts` on one device. Tokens are split
over ("data", "expert") (padded to a multiple with expert id E, which no rank owns; "ragged" and
"a2a" never send padding); the expert math on each rank IS `ops.moe_experts` (or the
KernelPlan's "moe_experts" kernel, same contract) over that rank's experts, one (token, slot) row
each with weight 1, so it returns the per-slot outputs; the weighted sum runs on the token's own
rank in float32 exactly as in `ops.moe_experts`. No variant drops a token: buffers are sized for
the worst case (every (token, slot) pair of every rank routed to one rank).

A rank runs only its own experts' rows (`_expert_rows`): the rows of a buffer that are not its
own (slots other ranks own, padding, unwritten buffer rows) get routing weight 0 and the id of an
expert a row of its own selects, so the local call gathers (and dequantises) only the experts the
rank's rows select. The gather variants leave out the gathered rows that are padding on every
rank (K3 batch 1 on ep = 2: 16 rows instead of 32, the single-device bound), and up to E/ep rows
run as ROW_CHUNK-row calls, the rank's own rows first: each call stays in ops.moe_experts' decode
schedule and is one Pallas kernel call (K3 batch 8 on ep = 2: 128 rows).

Variants (`variant=`):
- "ragged": `jax.lax.ragged_all_to_all` there and back; only the routed rows travel. GPU.
  (It lowers on XLA:CPU but does not run there.)
- "a2a": `jax.lax.all_to_all` of a dense [ep, n*k, M] buffer per rank (each destination's rows
  packed at the front). Same contract; runs everywhere (CPU tests).
- "allgather": all-gather the tokens over the expert axis, every rank runs its own experts on
  the slots routed to it, reduce-scatter the per-slot outputs back to the token owners (exact:
  each slot is non-zero on one rank only). No data-dependent communication; for tiny batches.
- "packed": "allgather" with the expert ids carried in the latent rows (`_pack`): one
  all-gather there, one reduce-scatter back, two collectives in all.
- "a2a_packed": "a2a" with the local expert ids carried in the rows: two all_to_alls.
- "allreduce": "packed" with both collectives as all-reduces (sums with zeros: exact), so XLA's
  own peer-to-peer collective kernels (`--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE`,
  one-shot up to 256 KB) can replace NCCL.
- "device": "packed" with both collectives replaced by device-initiated Mosaic GPU kernels
  (pallas_kernels.ep_dispatch: each rank writes its rows straight into the peers' receive
  buffers and signals a semaphore; no NCCL; one XLA device barrier per layer, before the
  dispatch). CUDA GPUs only; not chosen by "auto" (BENCHMARKS.md).
- "auto": on GPU "packed" up to ALLGATHER_MAX_TOKENS tokens per expert group, "ragged"
  above (BENCHMARKS.md); "a2a" elsewhere.

The ids travel inside the payload as base-2^p digits (p = the dtype's significand bits, at most
16), each an integer the payload dtype holds exactly: a copy and a sum with zeros keep them
(bit-casting them instead would make denormals a flush-to-zero reduction could erase).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax import ops

f32 = jnp.float32
VARIANTS = ("ragged", "a2a", "allgather", "packed", "a2a_packed", "allreduce", "device")
AXIS = "expert"
TENSOR_AXIS = "tensor"     # experts split over it too where it divides them (`expert_axes`)
TOKEN_AXES = ("data", "expert")
# Measured on 2x H200, ep=2, NCCL (BENCHMARKS.md, 2026-11-30 v2): dispatch+combine per layer at
# 1/8/64 tokens: packed 72/106/107 us (kernels 26/43/55 us per GPU), allreduce 84/94/134,
# allgather 104/114/114, a2a 103/124/805, a2a_packed 87/144/779, ragged 192/227/965. packed
# (2 collectives) beats allgather at every size and ragged/a2a by 1.4-9x; allreduce is within
# run-to-run noise (~20%) of it. The gathered traffic and wasted expert rows grow with ep:
# re-measure before trusting this threshold on larger meshes. "device" (session 6, Mosaic GPU
# peer writes): 41.6/49.5/53.9 us wall per layer at 1/8/64 tokens over 32 chained layers (packed
# 68/70/71 there), GPU time 19/20/36 us; not chosen by "auto" before a decode step confirms it.
ALLGATHER_MAX_TOKENS = 64
# Rows per local expert call: ops.moe_experts' decode schedule (each gathered expert on every
# row, no sort) takes up to 64 rows (the kernel backends group larger calls by expert since
# session 28; one call would do for them, not yet measured under expert parallelism).
ROW_CHUNK = ops.DENSE_DISPATCH_MAX_TOKENS


def active_mesh():
    """The mesh set by `jax.set_mesh` (or None) when its "expert" or "tensor" axis (the axes the
    routed experts are split over) is larger than 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or mesh.shape[AXIS] * mesh.shape.get(TENSOR_AXIS, 1) == 1:
        return None
    return mesh


def resolve_variant(variant: str, tokens_per_group: int, platform: str | None = None) -> str:
    if variant not in VARIANTS + ("auto",):
        raise ValueError(f"unknown expert-parallel variant {variant!r}; choose from auto, {', '.join(VARIANTS)}")
    if variant != "auto":
        return variant
    platform = platform or jax.default_backend()
    if platform not in ("gpu", "cuda", "rocm"):
        return "a2a"
    return "packed" if tokens_per_group <= ALLGATHER_MAX_TOKENS else "ragged"


def unavailable(variant: str, platform: str | None = None) -> str | None:
    """Why `variant` cannot run on `platform` (default: JAX's default backend); None if it can."""
    if variant == "ragged" and (platform or jax.default_backend()) == "cpu":
        return "ragged_all_to_all does not run on XLA:CPU"
    if variant == "device":
        from pallas_kernels import ep_dispatch
        return ep_dispatch.unavailable(platform)
    return None


def check_available(variant: str, name: str) -> None:
    """ValueError "{name} cannot run here: why" when `variant` cannot run on JAX's default backend."""
    why = unavailable(variant)
    if why is not None:
        raise ValueError(f"{name} cannot run here: {why}")


def _expert_rows(rows, local_ids, valid, experts: ops.ExpertWeights, impl, act_kw) -> jax.Array:
    """rows [R, M], local_ids [R], valid [R] bool -> per-row expert outputs [R, M], zero where not
    valid: `impl` (ops.moe_experts or a kernel with its contract) with k = 1, weight 1 on valid rows.

    Rows not valid get weight 0 and the id of a valid row of the same call (0 when there is
    none), so a call gathers only the experts of its valid rows. ROW_CHUNK < R <= E/ep: ceil(R /
    ROW_CHUNK) calls of ROW_CHUNK rows, the valid rows first, sorted by expert: each call stays in
    ops.moe_experts' decode schedule and the Pallas kernel's row limit, consecutive calls share at
    most one expert, and a call left with no valid row gathers one expert; ops.moe_experts' static
    gather bound stays R, as for one call. The calls are unrolled: a data-dependent trip count
    would make XLA:GPU read the loop predicate back to the host every iteration.
    """
    def run(x, ids, ok):
        ids = jnp.where(ok, ids, jnp.max(jnp.where(ok, ids, 0)))
        return impl(x, ids[:, None], ok[:, None].astype(f32), experts, **act_kw)

    r, e_local = rows.shape[0], experts.num_experts
    if r <= ROW_CHUNK or r > e_local:
        return run(rows, local_ids, valid)
    # Valid rows by expert, then the others; the index r past the end pads the last call.
    order = jnp.argsort(jnp.where(valid, local_ids, e_local), stable=True)
    order = jnp.pad(order, (0, -r % ROW_CHUNK), constant_values=r)
    out = jnp.zeros_like(rows)
    for c in range(order.shape[0] // ROW_CHUNK):
        idx = order[c * ROW_CHUNK:(c + 1) * ROW_CHUNK]
        src = jnp.minimum(idx, r - 1)
        out = out.at[idx].set(run(rows[src], local_ids[src], (idx < r) & valid[src]), mode="drop")
    return out


def _destinations(ids, e_local: int):
    """Per (token, slot) pair: owner rank (ep for padding, whose id is E) and local expert id."""
    return ids.reshape(-1) // e_local, ids.reshape(-1) % e_local


def _id_digits(dtype, num_ids: int) -> tuple[int, int]:
    """(base, digits): an id < num_ids as `digits` base-`base` digits, each exact in `dtype`."""
    base = 2 ** min(jnp.finfo(dtype).nmant + 1, 16)           # bf16: 256, float16: 2048, float32: 65536
    digits = 1
    while base ** digits < num_ids:
        digits += 1
    return base, digits


def _pack(z, ids, num_ids: int) -> jax.Array:
    """z [n, M], ids [n, k] (< num_ids) -> [n, M + k * digits] in z's dtype: the ids as digits."""
    base, d = _id_digits(z.dtype, num_ids)
    digits = jnp.stack([(ids // base ** j) % base for j in range(d)], -1).reshape(ids.shape[0], -1)
    return jnp.concatenate([z, digits.astype(z.dtype)], axis=1)


def _unpack(rows, m: int, k: int, num_ids: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of `_pack`: rows [n, M + k * digits] -> (z [n, M], ids [n, k] int32)."""
    base, d = _id_digits(rows.dtype, num_ids)
    digits = rows[:, m:].astype(jnp.int32).reshape(rows.shape[0], k, d)
    return rows[:, :m], sum(digits[..., j] * base ** j for j in range(d))


def _a2a(z, ids, weights, experts, *, expert_fn, e_local, packed=False):
    n, k = ids.shape
    m = z.shape[1]
    ep, pairs = jax.lax.axis_size(AXIS), n * k
    dest, local = _destinations(ids, e_local)
    onehot = dest[:, None] == jnp.arange(ep)[None]                              # [pairs, ep]
    pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, jnp.minimum(dest, ep - 1)[:, None], 1)[:, 0]
    rows = z[jnp.arange(pairs) // k]
    if packed:  # one all_to_all carries the local ids too, + 1: unwritten rows decode to -1
        rows = _pack(rows, local[:, None] + 1, e_local + 1)
    # Padding pairs have dest == ep: mode="drop" leaves them out of the buffers.
    send = jnp.zeros((ep, pairs, rows.shape[1]), z.dtype).at[dest, pos].set(rows, mode="drop")
    recv = jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True).reshape(ep * pairs, -1)
    if packed:
        recv, recv_ids = _unpack(recv, m, 1, e_local + 1)
        recv_ids = recv_ids - 1
    else:
        send_ids = jnp.full((ep, pairs), -1, jnp.int32).at[dest, pos].set(local, mode="drop")
        recv_ids = jax.lax.all_to_all(send_ids, AXIS, 0, 0, tiled=True)
    recv_ids = recv_ids.reshape(-1)
    y = expert_fn(recv, recv_ids, recv_ids >= 0, experts)
    back = jax.lax.all_to_all(y.reshape(ep, pairs, -1), AXIS, 0, 0, tiled=True)
    per_slot = back[jnp.minimum(dest, ep - 1), pos].reshape(n, k, -1)
    return ops.combine_slots(per_slot, weights, z.dtype)


def _exclusive_cumsum(x, axis=-1):
    return jnp.cumsum(x, axis=axis) - x


def _ragged(z, ids, weights, experts, *, expert_fn, e_local):
    n, k = ids.shape
    ep, pairs = jax.lax.axis_size(AXIS), n * k
    me = jax.lax.axis_index(AXIS)
    dest, local = _destinations(ids, e_local)
    order = jnp.argsort(dest, stable=True)                                      # by owner; padding last
    counts = jnp.sum(dest[:, None] == jnp.arange(ep)[None], axis=0).astype(jnp.int32)   # [ep] sent to each
    table = jax.lax.all_gather(counts, AXIS)                                    # [src, dst]
    send_off = _exclusive_cumsum(counts)
    recv_sizes = table[:, me]
    recv_off = _exclusive_cumsum(recv_sizes)
    # Where my rows land on each receiver: after the rows of the lower-ranked senders.
    out_off = _exclusive_cumsum(table, axis=0)[me]
    cap = ep * pairs                                                            # worst case: all to me
    recv = jax.lax.ragged_all_to_all(z[order // k], jnp.zeros((cap, z.shape[1]), z.dtype), send_off, counts,
                                     out_off, recv_sizes, axis_name=AXIS)
    recv_ids = jax.lax.ragged_all_to_all(local[order], jnp.zeros((cap,), jnp.int32), send_off, counts,
                                         out_off, recv_sizes, axis_name=AXIS)
    y = expert_fn(recv, recv_ids, jnp.arange(cap) < jnp.sum(recv_sizes), experts)
    # Back to each source, at the offset its rows for me started from.
    back_off = _exclusive_cumsum(table, axis=1)[:, me]
    back = jax.lax.ragged_all_to_all(y, jnp.zeros((pairs, z.shape[1]), z.dtype), recv_off, recv_sizes,
                                     back_off, counts, axis_name=AXIS)
    per_slot = jnp.zeros_like(back).at[order].set(back).reshape(n, k, -1)
    return ops.combine_slots(per_slot, weights, z.dtype)


def _gathered_experts(z_all, ids_all, experts, expert_fn, n_tokens: int, e_local: int) -> jax.Array:
    """Every token of the group [ep*n, M] / [ep*n, k] -> per-slot outputs [ep*n, k, M] of this
    rank's experts, zero on the slots other ranks own and on padding.

    Padding sits at the end of the N tokens, so the first group holds the most real tokens,
    min(ep*n, N): the tokens past that are padding in every group and are left out.
    """
    k = ids_all.shape[1]
    t = min(ids_all.shape[0], n_tokens)
    ids = ids_all[:t].reshape(-1)
    mine = ids // e_local == jax.lax.axis_index(AXIS)                          # padding (id E): nobody's
    y = expert_fn(z_all[jnp.arange(t * k) // k], ids % e_local, mine, experts)
    # Masked here too: an `expert_fn` need not zero the rows that are not its own.
    y = jnp.where(mine[:, None], y, jnp.zeros((), y.dtype)).reshape(t, k, -1)
    return jnp.pad(y, ((0, ids_all.shape[0] - t), (0, 0), (0, 0)))


def _allgather(z, ids, weights, experts, *, expert_fn, n_tokens, e_local):
    z_all = jax.lax.all_gather(z, AXIS, tiled=True)                             # [ep*n, M]
    ids_all = jax.lax.all_gather(ids, AXIS, tiled=True)                         # [ep*n, k]
    y = _gathered_experts(z_all, ids_all, experts, expert_fn, n_tokens, e_local)
    per_slot = jax.lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)  # [n, k, M]
    return ops.combine_slots(per_slot, weights, z.dtype)


def _packed(z, ids, weights, experts, *, expert_fn, n_tokens, e_local):
    k = ids.shape[1]
    num_ids = e_local * jax.lax.axis_size(AXIS) + 1                             # + the padding id E
    rows = jax.lax.all_gather(_pack(z, ids, num_ids), AXIS, tiled=True)        # [ep*n, M + c]
    y = _gathered_experts(*_unpack(rows, z.shape[1], k, num_ids), experts, expert_fn, n_tokens, e_local)
    per_slot = jax.lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)  # [n, k, M]
    return ops.combine_slots(per_slot, weights, z.dtype)


def _allreduce(z, ids, weights, experts, *, expert_fn, n_tokens, e_local):
    n, k = ids.shape
    ep, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    num_ids = e_local * ep + 1                                                  # + the padding id E
    mine = _pack(z, ids, num_ids)
    # My rows in my slot, zeros elsewhere: the sum over ranks is the all-gather, exactly.
    rows = jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((ep * n, mine.shape[1]), mine.dtype), mine, me * n, 0), AXIS)
    y = _gathered_experts(*_unpack(rows, z.shape[1], k, num_ids), experts, expert_fn, n_tokens, e_local)
    # One rank non-zero per slot: the sum is exact; keep my tokens' rows.
    per_slot = jax.lax.dynamic_slice_in_dim(jax.lax.psum(y, AXIS), me * n, n, 0)
    return ops.combine_slots(per_slot, weights, z.dtype)


def _device(z, ids, weights, experts, *, expert_fn, n_tokens, e_local):
    from pallas_kernels import ep_dispatch
    n, k = ids.shape
    m, ep = z.shape[1], jax.lax.axis_size(AXIS)
    num_ids = e_local * ep + 1                                                  # + the padding id E
    mine = _pack(z, ids, num_ids)
    c = mine.shape[1]
    # Columns padded to the kernel's tile width here, where XLA fuses the zeros into the packing.
    mine = jnp.pad(mine, ((0, 0), (0, -c % ep_dispatch.COL_TILE)))
    back_like = jax.ShapeDtypeStruct((ep, n * k, m), z.dtype)
    rows, pending = ep_dispatch.exchange(mine, AXIS, reply_like=back_like)
    y = _gathered_experts(*_unpack(rows.reshape(ep * n, -1)[:, :c], m, k, num_ids), experts, expert_fn, n_tokens,
                          e_local)
    # Rank q's rows for my tokens, zero on the slots q does not own: one rank non-zero per slot,
    # so the float32 sum over ranks is exact (psum_scatter's result, bit for bit). The reply
    # reuses the dispatch's synchronisation (no second device barrier).
    # (The reply buffer is made before y exists: y must have z's dtype, as ops.moe_experts' output.)
    back = ep_dispatch.reply(y.reshape(ep, n * k, -1), pending, AXIS)
    per_slot = jnp.sum(back.astype(f32), axis=0).astype(y.dtype).reshape(n, k, -1)
    return ops.combine_slots(per_slot, weights, z.dtype)


GATHERED = ("allgather", "packed", "allreduce", "device")  # every rank sees every token of its group
_IMPLS = {"ragged": _ragged, "a2a": _a2a, "allgather": _allgather, "packed": _packed,
          "a2a_packed": partial(_a2a, packed=True), "allreduce": _allreduce, "device": _device}


def _tensor_split(expert_fn):
    """expert_fn for experts split over "tensor" too (sharding.LOGICAL_AXES): the tokens of an
    expert group are on every tensor rank of it, each rank runs the rows of its own E / (ep * tp)
    experts, and a psum over "tensor" gives every rank all the rows (one rank non-zero per row:
    exact). `local_ids` arrive in [0, E / ep)."""
    def run(rows, local_ids, valid, experts):
        e_tp, me = experts.num_experts, jax.lax.axis_index(TENSOR_AXIS)
        mine = valid & (local_ids // e_tp == me)
        y = expert_fn(rows, local_ids % e_tp, mine, experts)
        return jax.lax.psum(jnp.where(mine[:, None], y, jnp.zeros((), y.dtype)), TENSOR_AXIS)
    return run


def expert_axes(num_experts: int, mesh) -> tuple[str, ...]:
    """The mesh axes the routed experts are split over (sharding.PARAM_RULES' "experts")."""
    from k3jax import sharding
    entry = sharding.logical_spec((num_experts,), ("experts",), mesh)[0]
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def moe_experts(z: jax.Array, ids: jax.Array, weights: jax.Array, experts: ops.ExpertWeights, *,
                act: str, beta: float, linear_beta: float | None, variant: str = "auto", mesh=None,
                local_impl=ops.moe_experts, expert_fn=None) -> jax.Array:
    """Expert-parallel ops.moe_experts: z [N, M], ids/weights [N, k] -> [N, M] in z's dtype.

    `experts` are the global stacked arrays, split over "expert" (and "tensor" where it divides
    them: `expert_axes`); `mesh` defaults to the active `jax.set_mesh` mesh, whose "expert" axis
    must divide the number of experts. `local_impl` runs each rank's experts (ops.moe_experts, or
    the KernelPlan's "moe_experts" kernel: same contract). `expert_fn(rows [R, M], local_ids [R],
    valid [R] bool, local experts) -> [R, M]` (only the valid rows are this rank's; the others'
    outputs are unused) replaces the whole per-rank step; benchmarks pass an identity to time
    dispatch + combine alone.
    """
    m = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if m.empty or AXIS not in m.axis_names:
        raise ValueError("expert-parallel moe_experts needs a mesh with an 'expert' axis (jax.set_mesh or mesh=)")
    ep, num = m.shape[AXIS], experts.num_experts
    if num % ep:
        raise ValueError(f"{num} experts do not split over expert axis of size {ep}")
    act_kw = dict(act=act, beta=beta, linear_beta=linear_beta)
    axes = expert_axes(num, m)
    if not axes:           # nothing split (tensor-only mesh that does not divide E): one local call
        resolve_variant(variant, z.shape[0])          # still reject an unknown variant name
        if expert_fn is not None:
            raise ValueError(f"expert_fn replaces the per-rank step of a dispatch, but mesh {dict(m.shape)} "
                             f"splits none of the {num} experts: nothing is dispatched")
        return local_impl(z, ids, weights, experts, **act_kw)
    token_axes = tuple(a for a in TOKEN_AXES if a in m.axis_names)
    shards = 1
    for a in token_axes:
        shards *= m.shape[a]
    n = z.shape[0]
    n_pad = -(-n // shards) * shards
    variant = resolve_variant(variant, n_pad // shards * ep)
    if n_pad != n:  # padding tokens select expert E, which no rank owns
        pad = ((0, n_pad - n), (0, 0))
        z, weights = jnp.pad(z, pad), jnp.pad(weights, pad)
        ids = jnp.pad(ids, pad, constant_values=num)
    tok = P(token_axes)
    if expert_fn is None:
        expert_fn = partial(_expert_rows, impl=local_impl, act_kw=act_kw)
    if TENSOR_AXIS in axes:                 # (sharding never names an axis of size 1)
        expert_fn = _tensor_split(expert_fn)
    per_rank = partial(_IMPLS[variant], expert_fn=expert_fn, e_local=num // ep)
    if variant in GATHERED:
        per_rank = partial(per_rank, n_tokens=n)
    fn = jax.shard_map(per_rank, mesh=mesh, in_specs=(tok, tok, tok, P(axes)), out_specs=tok, check_vma=False)
    return fn(z, ids, weights, experts)[:n]
