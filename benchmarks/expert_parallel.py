"""Expert-parallel scaling: per-layer dispatch + combine time per variant and EP size, the full EP
MoE layer, and the whole decode step of an expert-parallel preset (tokens/s, roofline fraction).

    python benchmarks/expert_parallel.py --out ep.json                      # every EP size the host allows
    python benchmarks/expert_parallel.py --ep 8,4,2 --step-mesh ep=8 --out ep8.json   # 8 GPUs
    python benchmarks/expert_parallel.py --cpu-smoke --out smoke.json       # tiny shapes on CPU devices
    python benchmarks/expert_parallel.py --ep '' --step-mesh ep=2 --batches 1,8 --step-variants packed \
        --step-backends xla,pallas --out step.json                          # the k3-h200x2 step only
    python benchmarks/expert_parallel.py --ep 2 --processes 2 --dispatch-only --step-mesh= --out p2.json
                                                          # one process per GPU (jax.distributed)

Phase 1 ("moe_layer" rows), for each EP size in `--ep` (a mesh ep=N over the first N devices),
batch B (tokens per step) and variant: "dispatch+combine" runs k3jax.moe_parallel with the
expert math replaced by the identity (routing bookkeeping, the collectives there and back, the
weighted combine); "EP MoE" runs the real MXFP4 experts (ops.moe_experts per rank). Both are
timed as a fori_loop over `--layers` chained layers inside one jit (no host dispatch between
layers; `--unroll`: the layers unrolled, as a decode step has them), median of `--repeats`, divided by the layer count; on GPU the CUPTI kernel sum per GPU
and the kernels that take the most time show where dispatch+combine time goes. Every variant's
output is first checked against ops.moe_experts on one device holding all experts
(`--dispatch-only`: against an id-dependent elementwise stand-in for the experts, and no MXFP4
experts are built, so the phase takes seconds).

Phase 2 ("rows", the k3jax.bench --model schema, so `python -m k3jax.bench --report` tables it):
the jitted decode step of `--preset` on `--step-mesh`: k3jax.bench.bench_model (state at
`--context` cached tokens), for each batch x `--step-variants` x `--step-backends`, batch-major.
"xla" runs XLA ops only (granularity xla-ops); a kernel backend runs its per-op KernelPlan (the
"moe_experts" kernel is each rank's local expert call inside the expert-parallel shard_map), and
its row lists the kernels and `fallbacks` (op/backend -> why a call ran the XLA reference,
pallas_kernels.registry.fallbacks()). tokens/s = batch / step time; roofline =
k3jax.costs.decode_step_bytes / step time / (copy bandwidth x devices).

`--processes N` runs both phases in N processes of one device each, joined by
jax.distributed.initialize (the multi-host launch, here on one host): one process driving several
GPUs makes their host threads meet at every collective, which shows as wall time above the GPUs'
kernel time (BENCHMARKS.md, session 7); one process per GPU does not. The first process writes
the JSON. `device` across processes needs NVSHMEM (pallas_kernels.ep_dispatch.unavailable).

The JSON is rewritten after every measured point, so a run killed at its time limit keeps what
it measured; `--budget-s` stops starting new points in time for the summary table.
"ragged" (ragged_all_to_all) does not run on XLA:CPU, nor "device" (the device-initiated Mosaic GPU
dispatch, pallas_kernels.ep_dispatch): they are skipped there with a line saying so
(k3jax.moe_parallel.unavailable). `--top-kernels N` prints each layer row's N costliest kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on the lent machines
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax import atomic, launch, moe_parallel, mxfp4, ops, sharding  # noqa: E402
from k3jax.backend import BACKENDS  # noqa: E402
from k3jax.cli import int_list  # noqa: E402
from k3jax.presets import get_preset  # noqa: E402

K3 = get_preset("k3-full")  # the layer phase's default shapes and the expert activation
ACT = K3.activation
PRESET_FOR_GPUS = {2: "k3-h200x2", 4: "k3-h200x4", 8: "k3-h200x8"}   # the step mesh's device count -> preset


def _launch(a, argv: list[str]) -> int:
    """Runs a.processes copies of this script as one jax.distributed job (k3jax.launch; the first
    writes --out); their exit code."""
    if a.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"     # the workers: one CPU device each, gloo collectives
    return launch.spawn([sys.executable, __file__, *argv], a.processes)


def _place(x, sharding_):
    """x (host or one local device, the same on every process) -> a global array with sharding_."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding_)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding_, lambda idx: host[idx])


def timed(fn, *args, repeats: int) -> float:
    # Not bench.time_rotating: wall time of one synced call of the whole chained-layer jit, host
    # dispatch and collective launch included on purpose (the "wall" column in BENCHMARKS.md).
    jax.block_until_ready(fn(*args))                 # compile + warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def chained(layer_fn, n_layers: int, unroll: bool = False):
    """n_layers calls of layer_fn(z) -> [N, M] inside one jit, each feeding the next: a fori_loop,
    or (unroll) n_layers copies in the program, as a decode step has its layers - XLA:GPU then
    launches every layer's kernels without a loop-predicate round trip to the host in between."""
    def run(z, *rest):
        def body(_, z):
            out = layer_fn(z, *rest)
            return (z.astype(jnp.float32) + 1e-3 * out.astype(jnp.float32)).astype(z.dtype)
        return jax.lax.fori_loop(0, n_layers, body, z, unroll=unroll or None)
    return jax.jit(run)


def routing(key, n, e, k):
    """Distinct top-k experts per token from random scores, renormalised weights."""
    scores = jax.random.uniform(key, (n, e))
    w, ids = jax.lax.top_k(scores, k)
    return ids.astype(jnp.int32), w / w.sum(-1, keepdims=True)


def moe_layer_bench(a, out: dict, deadline: float, save) -> None:
    """Phase 1: one row per (ep, batch, variant) into out["moe_layer"]."""
    e, m, i, k = a.experts, a.latent, a.intermediate, a.top_k
    key = jax.random.key(0)
    dev0 = jax.local_devices()[0]
    if a.dispatch_only:  # no expert math: placeholder weights that only carry E and the sharding
        experts = ops.ExpertWeights(*(jnp.zeros((e, 1, 1), jnp.bfloat16) for _ in range(3)))
    else:
        shapes = [(e, i, m), (e, i, m), (e, m, i)]
        make = jax.jit(lambda key: [mxfp4.random_packed(jax.random.fold_in(key, j), s)
                                    for j, s in enumerate(shapes)])
        with jax.default_device(dev0):
            packs = make(key)
        experts = ops.ExpertWeights(packs[0][0], packs[1][0], packs[2][0], packs[0][1], packs[1][1], packs[2][1])
        del packs
    batches = int_list(a.batches, "--batches")
    inputs, refs = {}, {}
    one_device = jax.jit(tagged_reference if a.dispatch_only else
                         (lambda z, i, w, ex: ops.moe_experts(z, i, w, ex, **ACT)))
    for b in batches:  # one-device references first, while all experts sit on device 0
        kz, kr = jax.random.split(jax.random.fold_in(key, b))
        with jax.default_device(dev0):
            z = jax.random.normal(kz, (b, m), jnp.bfloat16)
            ids, w = routing(kr, b, e, k)
        inputs[b] = (z, ids, w)
        refs[b] = np.asarray(one_device(z, ids, w, experts), np.float32)
    ident = lambda rows, local_ids, valid, ex: rows  # noqa: E731
    rows = out.setdefault("moe_layer", [])
    for ep in a.ep:
        if time.time() > deadline:
            print(f"layer phase: time budget reached before ep={ep}", flush=True)
            break
        if e % ep:
            print(f"layer phase: ep={ep} skipped: {e} experts do not split over {ep} ranks", flush=True)
            continue
        mesh = sharding.make_mesh(f"ep={ep}")
        sharded = jax.tree.map(lambda x: _place(x, jax.NamedSharding(mesh, jax.P("expert"))), experts)
        for b in batches:
            if time.time() > deadline:
                print(f"layer phase: time budget reached before ep={ep} batch {b}", flush=True)
                break
            z, ids, w = inputs[b]
            single_local = None
            if not (a.cpu_smoke or a.dispatch_only):  # one GPU, the same per-rank expert math over E/ep experts
                local = jax.tree.map(lambda x: x[: e // ep], experts)
                single_local = timed(chained(lambda z, i, w, ex: ops.moe_experts(z, i, w, ex, **ACT), a.layers, a.unroll),
                                     z, ids % (e // ep), w, local, repeats=a.repeats) / a.layers
                del local
            for variant in a.variants.split(","):
                head = {"ep": ep, "batch": b, "variant": variant}
                why = moe_parallel.unavailable(variant)
                if why:
                    print(f"ep={ep} batch {b}: {variant} skipped: {why}", flush=True)
                    rows.append({**head, "skipped": why})
                    continue
                if time.time() > deadline:
                    break
                try:
                    row = {**head, **variant_bench(a, mesh, variant, inputs[b], sharded, refs[b], ident)}
                except Exception as err:  # record and go on: one variant failing must not lose the others
                    row = {**head, "error": f"{type(err).__name__}: {str(err)[:500]}"}
                row["single_gpu_local_experts_us"] = None if single_local is None else single_local * 1e6
                rows.append(row)
                save()
                if jax.process_index() == 0:
                    print(json.dumps(row), flush=True)
        del sharded
    del experts


def tagged_expert(rows, local_ids, valid, ex):
    """A stand-in for the expert math that depends on the global expert id (so a wrong routing
    shows) and costs one elementwise op: row * (1 + id / 1024)."""
    gid = jax.lax.axis_index(moe_parallel.AXIS) * ex.num_experts + local_ids
    return (rows.astype(jnp.float32) * (1 + gid[:, None] / 1024)).astype(rows.dtype)


def tagged_reference(z, ids, w, ex):
    """One device: what `tagged_expert` through any variant must give (same roundings)."""
    per_slot = (z[:, None, :].astype(jnp.float32) * (1 + ids[..., None] / 1024)).astype(z.dtype)
    return ops.combine_slots(per_slot, w, z.dtype)


def variant_bench(a, mesh, variant, ziw, experts, ref, ident) -> dict:
    """One variant at one batch: error vs one device, dispatch+combine time (wall, and the CUPTI
    kernel breakdown on GPU) and, unless --dispatch-only, the full EP layer time."""
    from k3jax import bench

    def layer(expert_fn):
        return lambda z, i, w, ex: moe_parallel.moe_experts(z, i, w, ex, variant=variant, expert_fn=expert_fn, **ACT)
    out = {"unrolled": a.unroll}
    with jax.set_mesh(mesh):
        zb, ib, wb = (_place(x, sharding.batch_sharding(mesh, x.shape)) for x in ziw)
        got = sharding.to_host(jax.jit(layer(tagged_expert if a.dispatch_only else None))(zb, ib, wb, experts)).astype(np.float32)
        out["rel_err_vs_single_device"] = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
        run = chained(layer(ident), a.layers, a.unroll)
        out["dispatch_combine_us"] = timed(run, zb, ib, wb, experts, repeats=a.repeats) / a.layers * 1e6
        if jax.default_backend() == "gpu":
            kt = bench._kernel_times(lambda _: run(zb, ib, wb, experts), a.repeats)
            if kt is not None:  # CUPTI sums this process's GPUs' kernels: per GPU = / its devices
                per = a.layers * len(mesh.local_devices)    # kt is per launch of `run` (a.layers layers)
                out["kernel_us_per_gpu"] = kt[0] * 1e6 / per
                out["top_kernels_us_per_gpu"] = [[name, s * 1e6 / per] for name, s in kt[1]]
        if not a.dispatch_only:
            out["ep_moe_us"] = timed(chained(layer(None), a.layers, a.unroll), zb, ib, wb, experts,
                                     repeats=a.repeats) / a.layers * 1e6
    return out


def step_bench(a, out: dict, deadline: float, save) -> None:
    """Phase 2: decode-step rows (`k3jax.bench --model` on the step mesh, its schema) into out["rows"]:
    XLA ops and each kernel backend's per-op plan, batch-major, for each of --step-variants."""
    from k3jax import bench

    def on_row(result: dict) -> None:
        out["rows"][:] = result["rows"]
        out["meta"].update({k: result["meta"][k] for k in ("create_s", "copy_bandwidth", "n_devices", "config",
                                                            "param_bytes") if k in result["meta"]})
        save()

    bench.bench_model(a.preset, a.step_backends, ["xla-ops", "per-op"], int_list(a.batches, "--batches"),
                      [a.context], dtype=a.dtype, mesh=a.step_mesh,
                      ep_variants=[v for v in a.step_variants.split(",") if v], steps=a.step_steps,
                      warmup=a.warmup, deadline=deadline, on_row=on_row, progress=False,
                      log=print if jax.process_index() == 0 else (lambda *_: None))


def summary(out: dict, top: int = 0) -> str:
    lines = ["ep batch variant    dispatch+combine us (wall, kernels/GPU)   EP MoE layer us   1-GPU same experts us   "
             "rel err"]
    for r in out.get("moe_layer", []):
        if "error" in r or "skipped" in r:
            why = r.get("error") or "skipped: " + r["skipped"]
            lines.append(f"{r['ep']:2d} {r['batch']:5d} {r['variant']:10s} {why}")
            continue
        s, full, kern = r["single_gpu_local_experts_us"], r.get("ep_moe_us"), r.get("kernel_us_per_gpu")
        lines.append(f"{r['ep']:2d} {r['batch']:5d} {r['variant']:10s} {r['dispatch_combine_us']:9.1f} "
                     f"{'-' if kern is None else f'{kern:.1f}':>9s} {'-' if full is None else f'{full:.1f}':>17s} "
                     f"{'-' if s is None else f'{s:.1f}':>22s} {r['rel_err_vs_single_device']:9.2e}")
        if top and r.get("top_kernels_us_per_gpu"):
            lines.append("      " + "; ".join(f"{name[:48]} {us:.1f}" for name, us in r["top_kernels_us_per_gpu"][:top]))
    for r in out.get("rows", []):
        if r["status"] != "ok":
            lines.append(f"step {r['mesh']} {r['backend']} {r['ep_variant']} batch {r['batch']}: {r['status']}: "
                         f"{r['reason']}")
            continue
        fell = "; fell back (see JSON): " + ", ".join(f"{k} x{len(v)}" for k, v in r["fallbacks"].items()) \
            if r.get("fallbacks") else ""
        lines.append(f"step {r['preset']} {r['mesh']} {r['backend']} {r['ep_variant']} batch {r['batch']}: "
                     f"{r['step_s'] * 1e3:.2f} ms, {r['tokens_per_s']:.1f} tok/s, roofline "
                     f"{r['roofline_fraction']:.1%} (compile {r['compile_s']:.1f} s){fell}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", default=None, help="layer phase EP sizes, e.g. 8,4,2 (default: powers of two "
                   "from 2 to the device count; '' = no layer phase)")
    p.add_argument("--experts", type=int, default=K3.num_experts)
    p.add_argument("--latent", type=int, default=K3.moe_hidden_size)
    p.add_argument("--intermediate", type=int, default=K3.moe_intermediate_size)
    p.add_argument("--top-k", type=int, default=K3.num_experts_per_token)
    p.add_argument("--batches", default="1,8,64,256", help="tokens per step, both phases")
    p.add_argument("--variants", default=",".join(moe_parallel.VARIANTS), help="layer phase dispatch variants")
    p.add_argument("--layers", type=int, default=8, help="chained layers per timed call")
    p.add_argument("--unroll", action="store_true", help="chained layers unrolled (as in a decode step), not a fori_loop")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top-kernels", type=int, default=0, help="summary: the N costliest kernels of each layer row")
    p.add_argument("--step-mesh", default=None, help="step phase mesh (default: ep=<largest --ep>; '' = no step phase)")
    p.add_argument("--preset", default=None, help="step phase preset (default: k3-h200x<ep> for the step mesh)")
    p.add_argument("--step-variants", default="packed,allgather,ragged")
    p.add_argument("--step-backends", default=None,
                   help="step phase KernelPlan backends, e.g. xla,pallas (the default; --cpu-smoke: xla): "
                   "xla = XLA ops only, a kernel backend = its per-op plan")
    p.add_argument("--context", type=int, default=1024, help="step phase: cached tokens per sequence")
    p.add_argument("--step-steps", type=int, default=4, help="step phase: timed steps per point (k3jax.bench)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budget-s", type=float, default=540, help="start no new point after this long")
    p.add_argument("--layer-budget-s", type=float, default=None, help="end the layer phase after this long "
                   "(default: half of --budget-s when there is a step phase)")
    p.add_argument("--dispatch-only", action="store_true",
                   help="layer phase: dispatch+combine only (identity expert; exactness checked with an "
                   "id-dependent elementwise stand-in), no MXFP4 experts, no full EP layer")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes (16 experts, k3-tiny) on CPU devices: ragged skipped; step phase xla "
                   "unless --step-backends (Pallas kernels run in interpret mode: slow)")
    p.add_argument("--processes", type=int, default=1,
                   help="run in this many processes, one device each (jax.distributed, as a multi-host "
                   "launch; --cpu-smoke: gloo CPU collectives)")
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.processes > 1 and a.process_id is None:
        return a            # the launcher: no device is touched here, the workers parse the rest
    if a.process_id is not None:
        launch.join(a.coordinator, a.processes, a.process_id)
    a.step_backends = [b for b in (a.step_backends or ("xla" if a.cpu_smoke else "xla,pallas")).split(",") if b]
    unknown = set(a.step_backends) - set(BACKENDS)
    if unknown:
        p.error(f"--step-backends: unknown {', '.join(sorted(unknown))}; choose from {', '.join(BACKENDS)}")
    if a.cpu_smoke:  # tiny defaults; options given on the command line win
        tiny = dict(experts=16, latent=64, intermediate=64, top_k=4, layers=2, repeats=1, batches="1,8",
                    context=16, step_steps=2, preset="k3-tiny")
        for name, value in tiny.items():
            if getattr(a, name) == p.get_default(name):
                setattr(a, name, value)
    n = jax.device_count()
    a.ep = [int(x) for x in a.ep.split(",") if x] if a.ep is not None else [
        2 ** j for j in range(1, n.bit_length()) if 2 ** j <= n]
    if any(ep > n for ep in a.ep):
        p.error(f"--ep {a.ep} needs more than the {n} visible devices")
    if a.step_mesh is None:
        a.step_mesh = f"ep={max(a.ep)}" if a.ep else ""
    if a.step_mesh and a.preset is None:
        gpus = math.prod(sharding.parse_mesh(a.step_mesh).values())      # ep=2 and tp=2 both: 2 GPUs
        if gpus not in PRESET_FOR_GPUS:
            p.error(f"no preset sized for {a.step_mesh}; pass --preset")
        a.preset = PRESET_FOR_GPUS[gpus]
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.processes > 1 and a.process_id is None:
        return _launch(a, argv)
    start = time.time()
    deadline = start + a.budget_s
    layer_deadline = start + (a.layer_budget_s if a.layer_budget_s is not None
                              else a.budget_s / 2 if a.step_mesh else a.budget_s)
    dev = jax.devices()[0]
    out = {"meta": {"kind": "model", "preset": a.preset, "device": dev.device_kind, "platform": dev.platform,
                    "n_devices": jax.device_count(), "jax": jax.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    # a worker's argv is the launcher's + --process-id I --coordinator ADDR (_launch)
                    "command": " ".join(["python benchmarks/expert_parallel.py",
                                         *(argv[:-4] if a.process_id is not None else argv)]),
                    "processes": jax.process_count(),
                    "dtype": a.dtype, "steps": a.step_steps, "warmup": a.warmup,
                    "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                    "env": {v: os.environ[v] for v in ("XLA_FLAGS", "NCCL_PROTO", "NCCL_ALGO") if v in os.environ},
                    "state": "k3jax.bench: random decode state at lengths = context", "args": vars(a)},
           "moe_layer": [], "rows": []}
    lead = jax.process_index() == 0        # with --processes, the first worker writes and prints

    def save():     # after every point: survives a kill
        if lead:
            atomic.write_json(a.out, out)
    save()
    if a.ep:
        moe_layer_bench(a, out, min(layer_deadline, deadline), save)
    if a.step_mesh:
        try:
            step_bench(a, out, deadline, save)
        except Exception as e:  # e.g. out of memory creating the preset: keep the layer numbers
            out["meta"]["step_error"] = f"{type(e).__name__}: {str(e)[:1000]}"
            print(out["meta"]["step_error"], flush=True)
    save()
    if lead:
        print()
        print(summary(out, a.top_kernels))
    if a.process_id is not None:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
