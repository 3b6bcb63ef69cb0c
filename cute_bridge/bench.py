"""Check and time the CuTe kernels on a GPU next to the XLA reference: `python -m cute_bridge.bench`.

Every case is checked against its k3jax.ops reference (fresh random inputs, outputs fully finite
and within bf16 tolerance) before it is timed. Times: median over repeats of back-to-back calls
(device work pipelined), inputs larger than L2. Roofline = bytes that must move / time, over the
measured device copy rate. Prints a table; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import jax.numpy as jnp
import numpy as np

from cute_bridge import ops as cute_ops
from k3jax import atomic, costs, mxfp4, ops

# (rows, out, in): K3 decode projections at batch 1 and 8, and the GPU notes' 28672 x 8192.
GEMV_CASES = [(1, 28672, 8192), (1, 12288, 7168), (1, 7168, 12288), (1, 1536, 7168), (1, 18432, 1536),
              (1, 33792, 7168), (1, 163840, 7168), (8, 28672, 8192), (8, 12288, 7168)]
# (tokens, top_k, experts, hidden M, intermediate I): K3 routed experts (k3-h200) at batch 1 and 8.
MOE_CASES = [(1, 16, 448, 3584, 3072), (8, 16, 448, 3584, 3072)]


def rel_err(out, ref) -> float:
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(o)):
        return float("inf")
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def timeit(f, args_list, reps: int = 7, calls: int = 20) -> float:
    """Median seconds per call; rotates through args_list (distinct buffers beat the L2)."""
    jax.block_until_ready(f(*args_list[0]))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = [f(*args_list[i % len(args_list)]) for i in range(calls)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / calls)
    return float(np.median(times))


def gemv_case(key, rows, n, k, ceiling):
    kx, kw = jax.random.split(key)
    sets = [(jax.random.normal(jax.random.fold_in(kx, i), (rows, k), jnp.bfloat16),
             jax.random.normal(jax.random.fold_in(kw, i), (n, k), jnp.bfloat16)) for i in range(2)]
    cute, ref = jax.jit(cute_ops.linear), jax.jit(ops.linear)
    err = max(rel_err(cute(*a), ref(*a)) for a in sets)
    t_cute, t_xla = timeit(cute, sets), timeit(ref, sets)
    nbytes = 2 * (n * k + rows * k + rows * n)
    return {"op": "linear", "shape": f"x[{rows},{k}] w[{n},{k}]", "rel_err": err, "us_cute": t_cute * 1e6,
            "us_xla": t_xla * 1e6, "bytes": nbytes, "roofline_cute": nbytes / t_cute / ceiling,
            "roofline_xla": nbytes / t_xla / ceiling}


def moe_case(key, n, top_k, e, m, inter, ceiling):
    ks = jax.random.split(key, 6)
    p1, s1 = mxfp4.random_packed(ks[0], (e, inter, m))
    p3, s3 = mxfp4.random_packed(ks[1], (e, inter, m))
    p2, s2 = mxfp4.random_packed(ks[2], (e, m, inter))
    experts = ops.ExpertWeights(p1, p3, p2, s1, s3, s2)
    sets = []
    for i in range(4):
        kk = jax.random.fold_in(ks[3], i)
        ids = jax.vmap(lambda r: jax.random.permutation(r, e)[:top_k])(jax.random.split(kk, n)).astype(jnp.int32)
        w = jax.nn.softmax(jax.random.normal(jax.random.fold_in(ks[4], i), (n, top_k)), -1)
        z = jax.random.normal(jax.random.fold_in(ks[5], i), (n, m), jnp.bfloat16)
        sets.append((z, ids, w, experts))
    kw = dict(act="situ", beta=4.0, linear_beta=25.0)
    cute = jax.jit(lambda z, i, w, x: cute_ops.moe_experts(z, i, w, x, **kw))
    ref = jax.jit(lambda z, i, w, x: ops.moe_experts(z, i, w, x, **kw))
    err = max(rel_err(cute(*a), ref(*a)) for a in sets)
    t_cute, t_xla = timeit(cute, sets), timeit(ref, sets)
    distinct = np.mean([len(np.unique(np.asarray(a[1]))) for a in sets])
    per_expert = 3 * (inter * m // 2 + inter * m // 32)
    nbytes = int(distinct * per_expert + 4 * n * m)
    return {"op": "moe_experts", "shape": f"N={n} k={top_k} E={e} M={m} I={inter} mxfp4", "rel_err": err,
            "us_cute": t_cute * 1e6, "us_xla": t_xla * 1e6, "bytes": nbytes,
            "roofline_cute": nbytes / t_cute / ceiling, "roofline_xla": nbytes / t_xla / ceiling}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="cute_bench.json")
    args = p.parse_args(argv)
    ceiling = costs.copy_bandwidth()
    key = jax.random.key(0)
    rows = [gemv_case(jax.random.fold_in(key, i), *c, ceiling) for i, c in enumerate(GEMV_CASES)]
    rows += [moe_case(jax.random.fold_in(key, 100 + i), *c, ceiling) for i, c in enumerate(MOE_CASES)]
    result = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
              "copy_rate_tb_s": ceiling / 1e12, "cases": rows}
    atomic.write_json(args.out, result)
    print(f"device {result['device']}, copy rate {ceiling / 1e12:.2f} TB/s")
    print(f"{'op':12} {'shape':42} {'rel_err':>8} {'cute us':>9} {'xla us':>9} {'cute roof':>9} {'xla roof':>9}")
    for r in rows:
        print(f"{r['op']:12} {r['shape']:42} {r['rel_err']:8.1e} {r['us_cute']:9.1f} {r['us_xla']:9.1f} "
              f"{r['roofline_cute']:9.1%} {r['roofline_xla']:9.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
