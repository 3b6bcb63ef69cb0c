"""XLA MoE schedules at K3 shapes: dense-over-distinct-experts vs sorted ragged_dot, per batch.

Usage: python benchmarks/moe_xla_schedules.py --out FILE.json  (GPU; K3 shapes: E=448 MXFP4)
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax import mxfp4, ops  # noqa: E402
from k3jax import atomic  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=448)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    e, m, i, k = a.experts, 3584, 3072, 16
    key = jax.random.key(0)
    packs = [mxfp4.random_packed(jax.random.fold_in(key, j), s) for j, s in enumerate([(e, i, m), (e, i, m), (e, m, i)])]
    experts = ops.ExpertWeights(packs[0][0], packs[1][0], packs[2][0], packs[0][1], packs[1][1], packs[2][1])
    rows = []
    for n in [int(b) for b in a.batches.split(",")]:
        z = jax.random.normal(jax.random.key(n), (n, m), jnp.bfloat16)
        scores = jax.random.uniform(jax.random.key(n + 1), (n, e))
        w, ids = jax.lax.top_k(scores, k)
        w = w / w.sum(-1, keepdims=True)
        uniq = len(np.unique(np.asarray(ids)))
        moved = uniq * 3 * m * i * 17 // 32 + 2 * n * m * 2
        res = {}
        for name, limit in (("dense", 1 << 30), ("ragged", 0)):
            ops.DENSE_DISPATCH_MAX_TOKENS = limit
            f = jax.jit(lambda z, ids, w, ex: ops.moe_experts(z, ids.astype(jnp.int32), w, ex, act="situ",
                                                              beta=4.0, linear_beta=25.0))
            out = f(z, ids, w, experts).block_until_ready()
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                f(z, ids, w, experts).block_until_ready()
                times.append(time.perf_counter() - t0)
            res[name] = (float(np.median(times)), np.asarray(out.astype(jnp.float32)))
        err = float(np.abs(res["dense"][1] - res["ragged"][1]).max() / np.abs(res["ragged"][1]).max())
        row = {"batch": n, "distinct_experts": uniq, "min_bytes": moved,
               "dense_ms": res["dense"][0] * 1e3, "ragged_ms": res["ragged"][0] * 1e3, "rel_diff": err,
               "dense_TBps": moved / res["dense"][0] / 1e12, "ragged_TBps": moved / res["ragged"][0] / 1e12}
        rows.append(row)
        print(f"N={n:3d} U={uniq:3d} dense {row['dense_ms']:8.3f} ms ({row['dense_TBps']:.2f} TB/s)  "
              f"ragged {row['ragged_ms']:8.3f} ms ({row['ragged_TBps']:.2f} TB/s)  diff {err:.1e}", flush=True)
    atomic.write_json(a.out, {"device": jax.devices()[0].device_kind, "experts": e, "rows": rows})


if __name__ == "__main__":
    main()
