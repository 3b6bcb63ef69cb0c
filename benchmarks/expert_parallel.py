"""Expert-parallel MoE on several GPUs: per-layer dispatch + combine time per variant, the full
EP MoE layer, and the decode step of an expert-parallel preset, next to one GPU.

    python benchmarks/expert_parallel.py --out ep.json                  # 2 GPUs: mesh ep=2
    python benchmarks/expert_parallel.py --out ep.json --cpu-smoke      # tiny shapes, CPU, a2a/allgather

Per batch B (tokens per step) and variant: "dispatch+combine" runs k3jax.moe_parallel with the
expert math replaced by the identity (routing bookkeeping, the collectives there and back, the
weighted combine); "EP MoE" runs the real MXFP4 experts (ops.moe_experts per rank). Both are
timed as a fori_loop over `--layers` chained layers inside one jit (no host dispatch between
layers), median of `--repeats`, divided by the layer count. Every variant's output is first
checked against ops.moe_experts on one device holding all experts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on the lent machines
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax import moe_parallel, mxfp4, ops, sharding  # noqa: E402

ACT = dict(act="situ", beta=4.0, linear_beta=25.0)


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))                 # compile + warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def chained(layer_fn, n_layers: int):
    """n_layers calls of layer_fn(z) -> [N, M] inside one jit, each feeding the next."""
    def run(z, *rest):
        def body(_, z):
            out = layer_fn(z, *rest)
            return (z.astype(jnp.float32) + 1e-3 * out.astype(jnp.float32)).astype(z.dtype)
        return jax.lax.fori_loop(0, n_layers, body, z)
    return jax.jit(run)


def routing(key, n, e, k):
    """Distinct top-k experts per token from random scores, renormalised weights."""
    scores = jax.random.uniform(key, (n, e))
    w, ids = jax.lax.top_k(scores, k)
    return ids.astype(jnp.int32), w / w.sum(-1, keepdims=True)


def moe_layer_bench(a, mesh, out: dict, deadline: float):
    e, m, i, k = a.experts, a.latent, a.intermediate, a.top_k
    key = jax.random.key(0)
    shard = jax.NamedSharding(mesh, jax.P("expert"))
    shapes = [(e, i, m), (e, i, m), (e, m, i)]
    make = jax.jit(lambda key: [mxfp4.random_packed(jax.random.fold_in(key, j), s) for j, s in enumerate(shapes)],
                   out_shardings=[(shard, shard)] * 3)
    packs = make(key)
    experts = ops.ExpertWeights(packs[0][0], packs[1][0], packs[2][0], packs[0][1], packs[1][1], packs[2][1])
    ident = lambda rows, local_ids, ex: rows  # noqa: E731
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        if time.time() > deadline:
            print(f"time budget reached before batch {b}")
            break
        kz, kr = jax.random.split(jax.random.fold_in(key, b))
        z = jax.random.normal(kz, (b, m), jnp.bfloat16)
        ids, w = routing(kr, b, e, k)
        with jax.default_device(jax.devices()[0]):
            ref = np.asarray(jax.jit(lambda z, i, w, ex: ops.moe_experts(z, i, w, ex, **ACT))(
                z, ids, w, jax.device_put(experts, jax.devices()[0])), np.float32)
        single_local = None
        if not a.cpu_smoke:  # one GPU running the same per-rank expert math over E/ep experts
            local = jax.device_put(jax.tree.map(lambda x: x[: e // mesh.shape["expert"]], experts), jax.devices()[0])
            lids = ids % (e // mesh.shape["expert"])
            single_local = timed(chained(lambda z, i, w, ex: ops.moe_experts(z, i, w, ex, **ACT), a.layers),
                                 z, lids, w, local, repeats=a.repeats) / a.layers
            del local
        for variant in a.variants.split(","):
            if time.time() > deadline:
                break
            try:
                row = variant_bench(a, mesh, variant, b, z, ids, w, experts, ref, ident)
            except Exception as e:  # record and go on: one variant failing must not lose the others
                row = {"batch": b, "variant": variant, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            row["single_gpu_local_experts_us"] = None if single_local is None else single_local * 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
    out["moe_layer"] = rows
    del experts, packs


def variant_bench(a, mesh, variant, b, z, ids, w, experts, ref, ident) -> dict:
    """One variant at one batch: error vs one device, dispatch+combine and full EP layer times."""
    def layer(expert_fn):
        return lambda z, i, w, ex: moe_parallel.moe_experts(z, i, w, ex, variant=variant, expert_fn=expert_fn, **ACT)
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(layer(None))(z, ids, w, experts), np.float32)
        err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
        comm = timed(chained(layer(ident), a.layers), z, ids, w, experts, repeats=a.repeats) / a.layers
        full = timed(chained(layer(None), a.layers), z, ids, w, experts, repeats=a.repeats) / a.layers
    return {"batch": b, "variant": variant, "dispatch_combine_us": comm * 1e6, "ep_moe_us": full * 1e6,
            "rel_err_vs_single_device": err}


def save(out: dict, path: str) -> None:
    """Written after every phase and step, so a run cut off by its time limit keeps its numbers."""
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)


def step_bench(a, mesh, out: dict, deadline: float):
    import k3jax
    steps = []
    t = time.time()
    model = k3jax.from_pretrained(a.preset, mesh=mesh)
    out["create_s"] = time.time() - t
    print(f"created {a.preset} on {sharding.format_mesh(mesh)} in {out['create_s']:.1f} s", flush=True)
    for spec in a.steps.split(","):
        variant, b = spec.split(":")
        if time.time() > deadline:
            print(f"time budget reached before step {spec}")
            break
        sharding.set_ep_variant(model, variant)
        try:
            r = k3jax.generate_with_stats(model, [[1, 2, 3, 4]] * int(b), a.new_tokens)
        except Exception as e:  # keep what was measured so far
            print(f"step {spec} failed: {type(e).__name__}: {str(e)[:500]}", flush=True)
            steps.append({"variant": variant, "batch": int(b), "error": f"{type(e).__name__}: {str(e)[:500]}"})
            continue
        row = {"preset": a.preset, "mesh": sharding.format_mesh(mesh), "variant": variant, "batch": int(b),
               "step_ms": r.step_ms, "compile_s": r.compile_s, "prefill_s": r.prefill_s,
               "tokens": r.tokens[0].tolist()}
        steps.append(row)
        out["steps"] = steps
        save(out, a.out)
        print(json.dumps(row), flush=True)
    out["steps"] = steps
    del model


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="ep=2")
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--latent", type=int, default=3584)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--variants", default="ragged,a2a,allgather")
    p.add_argument("--layers", type=int, default=16, help="chained layers per timed call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--preset", default="k3-h200x2")
    p.add_argument("--steps", default="auto:1,auto:8", help="variant:batch decode runs ('' = none)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=270, help="skip remaining phases after this long")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU devices (a2a, allgather)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.cpu_smoke:
        a.experts, a.latent, a.intermediate, a.top_k, a.layers, a.repeats = 16, 64, 64, 4, 2, 1
        a.variants, a.preset, a.batches = "a2a,allgather", "k3-tiny", "1,8"
    deadline = time.time() + a.budget_s
    mesh = sharding.make_mesh(a.mesh)
    dev = jax.devices()[0]
    out = {"device": f"{jax.device_count()}x {dev.device_kind}", "mesh": sharding.format_mesh(mesh),
           "args": vars(a), "jax": jax.__version__}
    moe_layer_bench(a, mesh, out, deadline)
    save(out, a.out)
    if a.steps:
        try:
            step_bench(a, mesh, out, deadline)
        except Exception as e:  # e.g. out of memory creating the preset: keep the layer numbers
            out["step_error"] = f"{type(e).__name__}: {str(e)[:1000]}"
            print(out["step_error"], flush=True)
    save(out, a.out)
    print("\nbatch variant   dispatch+combine us   EP MoE layer us   1-GPU same experts us   rel err")
    for r in out["moe_layer"]:
        if "error" in r:
            print(f"{r['batch']:5d} {r['variant']:9s} ERROR {r['error'][:200]}")
            continue
        s = r["single_gpu_local_experts_us"]
        print(f"{r['batch']:5d} {r['variant']:9s} {r['dispatch_combine_us']:18.1f} {r['ep_moe_us']:17.1f} "
              f"{'-' if s is None else f'{s:.1f}':>22s} {r['rel_err_vs_single_device']:9.2e}")
    for r in out.get("steps", []):
        if "error" in r:
            continue
        print(f"step {r['preset']} {r['mesh']} {r['variant']} batch {r['batch']}: {r['step_ms']:.2f} ms "
              f"(compile {r['compile_s']:.1f} s)")


if __name__ == "__main__":
    main()
