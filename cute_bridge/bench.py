"""Check and time the CuTe kernels on a GPU next to the XLA reference: `python -m cute_bridge.bench`.

Every case is checked against its k3jax.ops reference (fresh random inputs, outputs fully finite
and within bf16 tolerance) before it is timed. Times (k3jax.bench.time_rotating): median over 7
rounds of 20 back-to-back calls (device work pipelined, host-dispatched wall time per call; the
CUPTI kernel time beside it on GPU), rotating inputs larger than L2. Roofline = bytes that must
move / wall time, over the measured device copy rate. Prints a table; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime

import jax
import jax.numpy as jnp
import numpy as np

from cute_bridge import ops as cute_ops
from k3jax import atomic, bench, costs, mxfp4, ops
from k3jax.presets import get_preset

# (rows, out, in): K3 decode projections at batch 1 and 8, and the GPU notes' 28672 x 8192.
GEMV_CASES = [(1, 28672, 8192), (1, 12288, 7168), (1, 7168, 12288), (1, 1536, 7168), (1, 18432, 1536),
              (1, 33792, 7168), (1, 163840, 7168), (8, 28672, 8192), (8, 12288, 7168)]
K3 = get_preset("k3-h200")
# (tokens, top_k, experts, hidden M, intermediate I): K3 routed experts (k3-h200) at batch 1 and 8.
MOE_CASES = [(n, K3.num_experts_per_token, K3.num_experts, K3.moe_hidden_size, K3.moe_intermediate_size)
             for n in (1, 8)]


def rel_err(out, ref) -> float:
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(o)):
        return float("inf")
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def timings(cute, ref, sets, nbytes: int, ceiling: float, calls: int = 20) -> dict:
    """us_<backend>: wall time per call (the quantity in BENCHMARKS.md), kernel_us_<backend>: CUPTI
    kernel time (GPU only), roofline_<backend>: bytes / wall time / ceiling; `calls` calls cycle
    through `sets` (distinct buffers beat the L2)."""
    rotated = [sets[i % len(sets)] for i in range(calls)]
    out = {"bytes": nbytes}
    for name, f in (("cute", cute), ("xla", ref)):
        t = bench.time_rotating(f, rotated, rounds=7)
        out[f"us_{name}"] = t["wall_s"] * 1e6
        if t["timer"] == "cupti":
            out[f"kernel_us_{name}"] = t["device_s"] * 1e6
        out[f"roofline_{name}"] = nbytes / t["wall_s"] / ceiling
    return out


def gemv_case(key, rows, n, k, ceiling):
    kx, kw = jax.random.split(key)
    sets = [(jax.random.normal(jax.random.fold_in(kx, i), (rows, k), jnp.bfloat16),
             jax.random.normal(jax.random.fold_in(kw, i), (n, k), jnp.bfloat16)) for i in range(2)]
    cute, ref = jax.jit(cute_ops.linear), jax.jit(ops.linear)
    err = max(rel_err(cute(*a), ref(*a)) for a in sets)
    nbytes = 2 * (n * k + rows * k + rows * n)
    return {"op": "linear", "shape": f"x[{rows},{k}] w[{n},{k}]", "rel_err": err,
            **timings(cute, ref, sets, nbytes, ceiling)}


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
    kw = K3.activation
    cute = jax.jit(lambda z, i, w, x: cute_ops.moe_experts(z, i, w, x, **kw))
    ref = jax.jit(lambda z, i, w, x: ops.moe_experts(z, i, w, x, **kw))
    err = max(rel_err(cute(*a), ref(*a)) for a in sets)
    distinct = np.mean([len(np.unique(np.asarray(a[1]))) for a in sets])
    per_expert = 3 * (inter * m // 2 + inter * m // 32)
    nbytes = int(distinct * per_expert + 4 * n * m)
    return {"op": "moe_experts", "shape": f"N={n} k={top_k} E={e} M={m} I={inter} mxfp4", "rel_err": err,
            **timings(cute, ref, sets, nbytes, ceiling)}


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
