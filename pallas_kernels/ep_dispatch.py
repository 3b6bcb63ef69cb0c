"""Device-initiated expert dispatch / combine: one Mosaic GPU kernel per direction that writes
straight into the peer GPUs' memory and synchronises with semaphores (no NCCL).

Inside a `jax.shard_map` over mesh axis `axis` (size ep):
- `exchange(x, axis)`: broadcast (x [R, W]): out [ep, R, W] with out[q] = rank q's x (an
  all-gather, stacked); all-to-all (x [ep, R, W], `all_to_all=True`): out[q] = rank q's x[me].
- `exchange(..., reply_like=)` also returns a `Pending` (the receive buffer and arrival counters
  of one later all-to-all), and `reply(y, pending, axis)` is that all-to-all without XLA's device
  barrier (below).
Copies only, so exact for any dtype. k3jax.moe_parallel's "device" variant is the "packed"
contract with `exchange` as the all-gather and `reply` in place of the reduce-scatter.

How one kernel runs (per rank, grid of G <= #SM blocks, one warpgroup each): block b takes the
tiles b, b + G, ... of [R, W] (tiles of up to 256 rows x 128 columns: the TMA box limits); per
tile it loads the rank's source tile(s) to SMEM with TMA and stores them with TMA into every
peer's output buffer at row block `me` (`plgpu.remote_ref`: the peer's address of the same
kernel argument). When all its stores have completed (`wait_smem_to_gmem`, not read-only) it adds
1 to block b's counter on every peer and waits until its own reaches ep - 1: then every peer's
block b has landed its tiles here, and once all blocks return the whole output is written. The
grid is at most the SM count, so every block is resident: a waiting block never keeps a peer's
block from being scheduled.

Peer addresses and safety: jax 0.11.2 lowers a kernel with remote refs in a single process that
drives all GPUs (`jax.device_count() == jax.local_device_count()`) through XLA's collective
metadata (each kernel argument's address on every peer) and, by default, a device barrier kernel
before it, so that no peer writes into a buffer still in use or signals a semaphore before XLA
zeroed it (XLA zeroes a kernel's semaphore scratch right before the kernel). `exchange` keeps that
barrier. `reply` skips it: its buffer and counters are outputs of the `exchange` (block 0 zeroes
the counters, with a release fence, before signalling), updated in place (`jax.new_ref`
operands), so a peer reaches them only after that peer's exchange ended, which needed this rank's
signal, sent after the zeroing. One process per GPU would need NVSHMEM
(XLA_FLAGS=--xla_gpu_experimental_enable_nvshmem; not tried). The mesh's device ids must be 0..N-1
in row-major order (Mosaic GPU checks). NVLink multicast is not used.

The Pallas Mosaic GPU interpreter (CPU) in jax 0.11.2 implements neither semaphores nor peer
refs, so off a GPU both raise `DeviceDispatchUnavailable` unless `mgpu.compile_for_gpu()` is
active (CUDA export/lowering checks on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import memref
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu

ROW_TILE_MAX = 256   # TMA box: at most 256 elements per dimension
COL_TILE = 128       # columns per tile; W is padded to a multiple of it
FLAGS = 128          # arrival counters of a reply: one per block, so a reply runs at most 128 blocks


class DeviceDispatchUnavailable(RuntimeError):
    """The device-initiated dispatch cannot run here (no GPU backend, or a multi-process run
    without NVSHMEM)."""


def unavailable(platform: str | None = None) -> str | None:
    """Why `exchange` cannot run on `platform` (default: JAX's default backend); None if it can."""
    if mgpu.trace_mode()[0]:                  # compile_for_gpu(): CUDA lowering on any host
        return None
    platform = platform or jax.default_backend()
    if platform not in ("gpu", "cuda"):
        return (f"device-initiated dispatch needs a CUDA GPU (backend is {platform!r}): jax 0.11.2's "
                "Mosaic GPU interpreter implements neither semaphores nor peer (remote) refs")
    if jax.process_count() > 1:
        from jax.experimental.mosaic.gpu import core as mgpu_core
        if not mgpu_core.is_nvshmem_available():
            return ("device-initiated dispatch across processes needs NVSHMEM: set "
                    "XLA_FLAGS=--xla_gpu_experimental_enable_nvshmem and install nvidia-nvshmem")
    return None


def _row_tile(rows: int) -> int:
    """The largest divisor of `rows` that is at most ROW_TILE_MAX."""
    return max(d for d in range(1, min(rows, ROW_TILE_MAX) + 1) if rows % d == 0)


class Pending(NamedTuple):
    """What `exchange(..., reply_like=)` leaves for `reply`: the reply's receive buffer
    [ep, R, W] and its per-block arrival counters [FLAGS] int32 (zeroed by the exchange before
    any peer can reach them)."""
    buf: jax.Array
    flags: jax.Array


def _check(x, ep: int, all_to_all: bool, what: str) -> None:
    if all_to_all:
        if x.ndim != 3 or x.shape[0] != ep:
            raise ValueError(f"all_to_all {what} takes x [ep={ep}, R, W], got {x.shape}")
    elif x.ndim != 2:
        raise ValueError(f"broadcast {what} takes x [R, W], got {x.shape}")
    if 0 in x.shape:
        raise ValueError(f"{what} of an empty array {x.shape}")


def _axis_size(x, axis: str, all_to_all: bool, what: str) -> int:
    """ep = the size of `axis`, once the dispatch can run here and x has `what`'s shape."""
    why = unavailable()
    if why:
        raise DeviceDispatchUnavailable(why)
    ep = jax.lax.axis_size(axis)
    _check(x, ep, all_to_all, what)
    return ep


def _padded(w: int) -> int:
    """w rounded up to a multiple of COL_TILE."""
    return -(-w // COL_TILE) * COL_TILE


def _pad_cols(x):
    w = x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, _padded(w) - w)]) if w % COL_TILE else x


def exchange(x: jax.Array, axis: str, *, all_to_all: bool = False, reply_like: jax.ShapeDtypeStruct | None = None,
             num_blocks: int | None = None):
    """Inside a shard_map over `axis`: x [R, W] (or [ep, R, W] with all_to_all) -> [ep, R, W].

    broadcast: out[q] = rank q's x; all_to_all: out[q] = rank q's x[me]. Any dtype; W is
    padded to a multiple of COL_TILE (and cut back) when it is not one. XLA runs its device
    barrier before the kernel. With `reply_like` ([ep, R2, W2]: the shape of a later `reply`)
    it returns (out, Pending): the reply's buffers, allocated and zeroed here, so that the
    reply needs no barrier of its own.
    """
    ep = _axis_size(x, axis, all_to_all, "exchange")
    w = x.shape[-1]
    if reply_like is not None:
        _check(reply_like, ep, True, "reply")
        reply_like = jax.ShapeDtypeStruct((*reply_like.shape[:-1], _padded(reply_like.shape[-1])), reply_like.dtype)
    outs = _exchange_kernel(_pad_cols(x), axis, ep, all_to_all, num_blocks, reply_like)
    out = outs[0][..., :w]
    return out if reply_like is None else (out, Pending(*outs[1:]))


def reply(y: jax.Array, pending: Pending, axis: str, *, num_blocks: int | None = None) -> jax.Array:
    """The all_to_all `exchange` of y [ep, R, W] into `pending`'s buffer, without XLA's device
    barrier: every peer reached the exchange that made `pending` (it zeroed the counters first),
    so no peer's signal can be lost and its buffer is allocated. -> [ep, R, W]."""
    ep = _axis_size(y, axis, True, "reply")
    w = y.shape[-1]
    y = _pad_cols(y)
    if y.shape != pending.buf.shape or y.dtype != pending.buf.dtype:
        raise ValueError(f"reply of {y.shape} {y.dtype} (columns padded) into a buffer made for "
                         f"{pending.buf.shape} {pending.buf.dtype}")
    return _reply_kernel(y, pending, axis, ep, num_blocks)[..., :w]


def _plan(rows: int, w: int, num_blocks: int | None, cap: int):
    """(row tile, column tiles, tiles, grid): tiles of [tr, COL_TILE], at most `cap` blocks."""
    tr = _row_tile(rows)
    tiles = rows // tr * (w // COL_TILE)
    return tr, w // COL_TILE, tiles, min(tiles, num_blocks or mgpu.num_sms(), cap)


def _peers(axis: str, ep: int):
    """me, me + 1, ... (mod ep): each rank starts with its own (local) copy."""
    me = jax.lax.axis_index(axis)
    return [me] + [jax.lax.rem(me + j, ep) for j in range(1, ep)]


def _send_tiles(x_gmem, out_gmem, b, axis: str, ep: int, all_to_all: bool, plan) -> None:
    """Block b's share of the tiles of [R, W]: each tile of my source to every rank's out[me]
    (TMA load to SMEM, TMA store to the peer's memory). Returns with the stores in flight."""
    tr, col_tiles, tiles, grid = plan
    peers = _peers(axis, ep)
    me = peers[0]
    n_src = ep if all_to_all else 1

    @pl.loop(0, -(-tiles // grid))
    def _tile(i):
        t = b + i * grid

        @pl.when(t < tiles)
        def _():
            blk = (pl.ds(pl.multiple_of((t // col_tiles) * tr, tr), tr),
                   pl.ds(pl.multiple_of((t % col_tiles) * COL_TILE, COL_TILE), COL_TILE))

            def scoped(smem, bars):
                for s in range(n_src):
                    src = x_gmem.at[peers[s]] if all_to_all else x_gmem
                    plgpu.copy_gmem_to_smem(src.at[blk], smem.at[s], bars.at[s])
                for j, peer in enumerate(peers):
                    s = j if all_to_all else 0
                    if j < n_src:
                        plgpu.barrier_wait(bars.at[s])
                    dst = out_gmem if j == 0 else plgpu.remote_ref(out_gmem, {axis: peer})
                    plgpu.copy_smem_to_gmem(smem.at[s], dst.at[me].at[blk])
                # SMEM is released at the end of the scope: the stores must have read it.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            pl.run_scoped(scoped, plgpu.SMEM((n_src, tr, COL_TILE), x_gmem.dtype), plgpu.Barrier(num_barriers=n_src))


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def _zero_and_release(ctx, flags):
    """One thread zeroes `flags` (int32 GMEM) and fences, so its next signal releases the zeros."""
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    with mgpu_utils.single_thread(mgpu_utils.ThreadSubset.WARPGROUP):
        for i in range(FLAGS):
            memref.store(mgpu_utils.c(0, i32), flags, [mgpu_utils.c(i, index)])
        mgpu_utils.fence_release_sys()


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def _release_add(ctx, counter):
    """counter += 1 (int32 GMEM, may be a peer's) with release semantics, after the whole
    warpgroup's work (the TMA stores were awaited by the thread that signals)."""
    mgpu_utils.warpgroup_barrier()
    mgpu_utils.SemaphoreRef(mgpu_utils.memref_ptr(counter)).signal(1)


def _acquire_wait(counter, value: int) -> None:
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def wait(ctx, ref):
        mgpu_utils.SemaphoreRef(mgpu_utils.memref_ptr(ref)).wait(value, decrement=False)
    wait(counter)


def _exchange_kernel(x, axis, ep, all_to_all, num_blocks, reply_like):
    rows, w = x.shape[-2:]
    plan = _plan(rows, w, num_blocks, mgpu.num_sms())
    out_type = [jax.ShapeDtypeStruct((ep, rows, w), x.dtype)]
    if reply_like is not None:
        out_type += [reply_like, jax.ShapeDtypeStruct((FLAGS,), jnp.int32)]

    def body(x_gmem, out_gmem, *rest):
        *reply_refs, sem = rest
        b = jax.lax.axis_index("blocks")
        if reply_refs:
            # Zeroed before this block signals: a peer reaches `reply` only after that signal.
            @pl.when(b == 0)
            def _():
                _zero_and_release(reply_refs[1])
        _send_tiles(x_gmem, out_gmem, b, axis, ep, all_to_all, plan)
        # Every store of this block has landed (not only read SMEM) before the peers hear of it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        for peer in _peers(axis, ep)[1:]:
            pl.semaphore_signal(sem, 1, device_id={axis: peer})
        pl.semaphore_wait(sem, ep - 1)

    outs = plgpu.kernel(body, out_type=out_type, grid=(plan[3],), grid_names=("blocks",),
                        scratch_types=[plgpu.SemaphoreType.REGULAR])(x)
    return tuple(outs)


def _reply_kernel(y, pending, axis, ep, num_blocks):
    rows, w = y.shape[-2:]
    plan = _plan(rows, w, num_blocks, FLAGS)
    # Refs: the kernel writes into `pending`'s buffers in place (input/output aliases), the
    # memory every peer's exchange already knows is allocated and zeroed.
    buf, flags = jax.new_ref(pending.buf), jax.new_ref(pending.flags)

    def body(y_gmem, buf_gmem, flags_gmem):
        b = jax.lax.axis_index("blocks")
        _send_tiles(y_gmem, buf_gmem, b, axis, ep, True, plan)
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        for peer in _peers(axis, ep)[1:]:
            _release_add(plgpu.remote_ref(flags_gmem, {axis: peer}).at[pl.ds(b, 1)])
        _acquire_wait(flags_gmem.at[pl.ds(b, 1)], ep - 1)

    pl.kernel(body, out_type=(), mesh=plgpu.Mesh(grid=(plan[3],), grid_names=("blocks",)),
              compiler_params=plgpu.CompilerParams(skip_device_barrier=True))(y, buf, flags)
    return buf[...]
