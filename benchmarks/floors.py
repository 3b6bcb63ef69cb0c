"""Ceilings for the kernel targets not met: their bytes moved with no math, and MLA's tensor-core caps.

At the sizes of the Pallas targets still open (KDA decode below batch 8, MLA decode attention), a
kernel's shortfall splits into what its launches and data movement cost and what its math costs.

    python benchmarks/floors.py [--preset k3-h200] [--batches 1,3,8] [--out floors.json]

Rows (device time per call: CUPTI kernel sums on a GPU via k3jax.bench.time_rotating, inputs
rotated past L2; fraction of the measured copy rate, k3jax.costs.copy_bandwidth):
  state_update_b{B}       XLA: the KDA recurrent state [B, H, d, d] float32 scaled in place (donated):
                          kda_decode's state bytes, read and written once, in one fusion;
  state_slabs_b{B}_s{S}   Pallas (Mosaic GPU): one program per (sequence, head, split), as kda_decode's
                          grid, with S its `plan`'s splits and 4, each TMA-loading its [d, d/S] column
                          slab to SMEM and storing it back in place: the kernel's data movement without
                          its math;
  state_slabs_persistent_b{B}_s{S}
                          the same slabs moved by one program per SM (at most), each streaming its
                          share through 4 SMEM slots: what a persistent kda_decode would move;
  weight_read_{N}MiB      XLA: a bf16 matrix read once (row sums) at the sizes of MLA's absorption /
                          expansion weights (12 MiB each at K3), the whole w_kv_b and larger;
  smallest_kernel         XLA: 8 floats, the time any one kernel takes.
and, computed rather than timed (`mla_tensor_ceilings`, printed first on any device), the share of
the byte roofline the tensor cores, and the SMEM its matrix products read, allow MLA decode
attention per schedule.
Every output is checked (the slab copy must return its input bit for bit). On a CPU the Pallas rows
run in interpret mode and the times are wall clock: only the GPU's numbers are ceilings.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run as a script

from k3jax import atomic, costs  # noqa: E402
from k3jax.bench import time_rotating  # noqa: E402
from k3jax.cli import at_least, check_writable, int_list, run_cli  # noqa: E402
from k3jax.presets import get_preset  # noqa: E402
from pallas_kernels import kda_decode, mgpu, mla_decode  # noqa: E402

WEIGHT_MIB = (12, 24, 48, 96, 280)
ROTATIONS = 4


# A Hopper SM moves 128 bytes of shared memory per clock and does 4096 dense bf16 FLOP per clock,
# so wgmma operands read from SMEM stream at most at PEAK_BF16_FLOPS * this many bytes per second.
SMEM_BYTES_PER_PEAK_FLOP = 128 / 4096


def mla_tensor_ceilings(heads: int, latent: int, rope: int, device: str = "NVIDIA H200") -> list[dict]:
    """Per schedule of MLA's absorbed decode attention (pallas_kernels.mla_decode), over one cached
    tile of BLOCK_L tokens: the matrix-product FLOPs it executes and the SMEM bytes its wgmma
    operands take, and, with the tensor cores (or SMEM) at their spec peak and perfectly
    overlapped with the tile's read at the measured copy rate, the largest share of the byte
    roofline each allows (`max_frac_roofline`: tensor cores; `_smem`: SMEM; `_both`: the lower),
    and the tensor-core efficiency 70% needs. Scores take 2 L (C + R) FLOPs per head, the
    weighted sum 2 L C. Schedules: "heads_m" (heads are wgmma's M side in padded groups of BLOCK_H,
    both consumers score every head, p from registers), the seesaw (session 22's patch: scored
    once), "heads_n" (the scores with groups of HEADS_N heads on the N side, HEADS_N / 2 scored
    per consumer; p [heads padded to BLOCK_H, tokens] read back from SMEM into registers for the
    PV of each C half), and heads_n's first form (`benchmarks/results/ab/mla-heads-n-pT-operand-
    20261205-s31.patch`: the PV on the N side too, p^T the B operand of each C half's M groups)."""
    tile, md = mla_decode.BLOCK_L, mla_decode
    padded = -(-heads // md.BLOCK_H) * md.BLOCK_H
    scores, weighted_sum = 2 * tile * (latent + rope), 2 * tile * latent
    k_bytes, v_half_bytes = tile * (latent + rope) * 2, tile * latent // 2 * 2
    q_block = md.BLOCK_H * (latent + rope) * 2
    groups_m, groups_n = padded // md.BLOCK_H, -(-heads // md.HEADS_N)
    scores_n = k_bytes + md.HEADS_N // 2 * (latent + rope) * 2         # latent tile + a consumer's q rows
    schedules = {
        "padded heads, scores in both consumers (heads_m)":
            (padded * (2 * scores + weighted_sum), groups_m * 2 * (q_block + k_bytes + v_half_bytes)),
        "padded heads, scores once (seesaw)":
            (padded * (scores + weighted_sum), groups_m * (q_block + k_bytes + 2 * v_half_bytes)),
        "unpadded scores once, padded PV from registers (heads_n)":
            (heads * scores + groups_n * md.BLOCK_H * weighted_sum,
             groups_n * 2 * (scores_n + md.BLOCK_H * tile * 2 + v_half_bytes)),
        "unpadded heads, scores once, PV on N (heads_n's p^T patch)":
            (heads * (scores + weighted_sum),
             groups_n * 2 * (scores_n + v_half_bytes + (latent // 2 // 64) * tile * md.HEADS_N * 2)),
    }
    read_s = tile * (latent + rope) * 2 / costs.MEASURED_COPY_BANDWIDTH[device]
    rows = []
    for name, (flops, smem) in schedules.items():
        tensor_s = flops / costs.PEAK_BF16_FLOPS[device]
        smem_s = smem / (costs.PEAK_BF16_FLOPS[device] * SMEM_BYTES_PER_PEAK_FLOP)
        rows.append({"name": f"mla_tensor_ceiling: {name}", "mma_flops_per_tile": flops,
                     "smem_operand_bytes_per_tile": smem,
                     "max_frac_roofline": min(1.0, read_s / tensor_s),
                     "max_frac_roofline_smem": min(1.0, read_s / smem_s),
                     "max_frac_roofline_both": min(1.0, read_s / max(tensor_s, smem_s)),
                     "efficiency_for_70pct": tensor_s / (read_s / 0.7)})
    return rows


def slab_copy(state: jax.Array, splits: int) -> jax.Array:
    """state [B, H, d, d] float32 -> the same values, moved as kda_decode moves its state: one
    program per (sequence, head, split) item, its [d, d / splits] column slab GMEM -> SMEM -> GMEM
    by TMA, in place (`persistent_slab_copy` with a program, and a slot, per item)."""
    b, h, _, _ = state.shape
    return persistent_slab_copy(state, splits, programs=b * h * splits, slots=1)


def persistent_slab_copy(state: jax.Array, splits: int, programs: int, slots: int = 4) -> jax.Array:
    """state [B, H, d, d] float32 -> the same values, its (sequence, head, split) items' [d, d / splits]
    column slabs moved GMEM -> SMEM -> GMEM by TMA, in place, by `programs` programs, program p taking
    items p, p + programs, ...: its first `slots` slab loads issued at once, each slab stored back as
    soon as it arrives and its slot refilled with the program's next item once that store has read
    it - with fewer programs than items, the data movement of a persistent kda_decode."""
    b, h, d, _ = state.shape
    cols = d // splits
    items = b * h * splits

    def program(state_g, slab_s, bar):
        p = jax.lax.axis_index("p")
        mine = (items - p + programs - 1) // programs

        def slab(j):
            i = p + j * programs
            return state_g.at[i // (h * splits), (i // splits) % h, :, pl.ds((i % splits) * cols, cols)]

        for j in range(slots):
            @pl.when(j < mine)
            def _(j=j):
                plgpu.copy_gmem_to_smem(slab(j), slab_s.at[j], bar.at[j])

        @pl.loop(0, mine)
        def _(j):
            slot = j % slots
            plgpu.barrier_wait(bar.at[slot])
            # kda_decode fences here too (it writes the slab from registers first); without it the
            # race detector does not order this store after the load of the same bytes.
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(slab_s.at[slot], slab(j))

            @pl.when(j + slots < mine)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the slot's store has read it
                plgpu.copy_gmem_to_smem(slab(j + slots), slab_s.at[slot], bar.at[slot])

        plgpu.wait_smem_to_gmem(0)

    ref = jax.new_ref(state)
    plgpu.kernel(lambda s: pl.run_scoped(lambda slab_s, bar: program(s, slab_s, bar),
                                         plgpu.SMEM((slots, d, cols), jnp.float32),
                                         plgpu.Barrier(num_barriers=slots)),
                 out_type=(), grid=(programs,), grid_names=("p",), interpret=mgpu.interpret_params())(ref)
    return jax.freeze(ref)


def _row(name: str, nbytes: float, timed: dict, copy_bw: float, log) -> dict:
    row = {"name": name, "bytes": nbytes, "device_s": timed["device_s"], "wall_s": timed["wall_s"],
           "timer": timed["timer"], "frac_copy_bw": nbytes / timed["device_s"] / copy_bw,
           "top_kernels": timed.get("top_kernels", [])}
    log(f"{name:26s} {nbytes / 2 ** 20:9.2f} MiB {timed['device_s'] * 1e6:9.2f} us "
        f"{row['frac_copy_bw']:7.1%} of the copy rate ({timed['timer']})")
    return row


def _check(name: str, got: jax.Array, want: jax.Array) -> None:
    if not np.array_equal(np.asarray(got), np.asarray(want)):
        raise AssertionError(f"{name}: output differs from the expected values")


def measure(batches: list[int], heads: int, head_dim: int, weight_mib: tuple[int, ...], rounds: int = 5,
            log=print) -> list[dict]:
    """The rows described in the module doc, for a KDA state of `heads` x [head_dim, head_dim]."""
    copy_bw = costs.copy_bandwidth()
    key = jax.random.key(0)
    rows = []
    for b in batches:
        shape = (b, heads, head_dim, head_dim)
        nbytes = 2.0 * 4 * np.prod(shape)
        states = [(jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32),) for i in range(ROTATIONS)]
        _check(f"state_update_b{b}", jax.jit(lambda s: s * 0.5)(states[0][0]), states[0][0] * 0.5)
        rows.append(_row(f"state_update_b{b}", nbytes, time_rotating(lambda s: s * 0.5, states, rounds, donate=(0,)),
                         copy_bw, log))
        for splits in sorted({kda_decode.plan(b, heads, mgpu.num_sms()), 4}):
            programs = min(b * heads * splits, mgpu.num_sms())
            for name, run in ((f"state_slabs_b{b}_s{splits}", functools.partial(slab_copy, splits=splits)),
                              (f"state_slabs_persistent_b{b}_s{splits}",
                               functools.partial(persistent_slab_copy, splits=splits, programs=programs))):
                _check(name, jax.jit(run)(jnp.copy(states[0][0])), states[0][0])
                rows.append(_row(name, nbytes, time_rotating(run, states, rounds, donate=(0,)), copy_bw, log))
    for mib in weight_mib:
        n = mib * 2 ** 20 // 2
        mats = [(jax.random.normal(jax.random.fold_in(key, 100 + i), (n // 1024, 1024), jnp.bfloat16),)
                for i in range(ROTATIONS)]
        read = lambda w: w.astype(jnp.float32).sum(-1)      # noqa: E731
        rows.append(_row(f"weight_read_{mib}MiB", 2.0 * n, time_rotating(read, mats, rounds), copy_bw, log))
    tiny = [(jnp.full((8,), i, jnp.float32),) for i in range(ROTATIONS)]
    rows.append(_row("smallest_kernel", 64.0, time_rotating(lambda x: x * 2 + 1, tiny, rounds), copy_bw, log))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-h200", help="model preset whose KDA state sizes to use")
    ap.add_argument("--batches", default="1,3,8", help="comma-separated batch sizes of the KDA state rows")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (median)")
    ap.add_argument("--out", help="JSON path for the rows (written atomically)")
    args = ap.parse_args(argv)

    def work() -> int:
        batches = int_list(args.batches, "--batches")
        at_least("--rounds", args.rounds, 1)
        if args.out:
            check_writable(args.out, "--out")
        cfg = get_preset(args.preset)
        ceilings = mla_tensor_ceilings(cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        for c in ceilings:
            print(f"{c['name']:60s} {c['mma_flops_per_tile'] / 1e6:6.2f} MFLOP, "
                  f"{c['smem_operand_bytes_per_tile'] / 1024:4.0f} KB of SMEM operands a tile: at most "
                  f"{c['max_frac_roofline']:4.0%} (tensor) / {c['max_frac_roofline_smem']:4.0%} (SMEM) of the byte "
                  f"roofline; 70% needs {c['efficiency_for_70pct']:4.0%} of the tensor peak")
        rows = ceilings + measure(batches, cfg.kda_num_heads, cfg.kda_head_dim, WEIGHT_MIB, args.rounds)
        if args.out:
            atomic.write_json(args.out, {"meta": {"kind": "floors", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                  "device": jax.devices()[0].device_kind, "preset": args.preset,
                                                  "copy_bandwidth": costs.copy_bandwidth(),
                                                  "command": " ".join(sys.argv)}, "rows": rows})
        return 0
    return run_cli("floors", work)


if __name__ == "__main__":
    raise SystemExit(main())
