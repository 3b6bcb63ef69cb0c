"""Benchmarks: per-op kernels and whole-model decode steps, side by side; the report that tabulates them.

    python -m k3jax.bench --model --preset k3-h200 [--backends xla,pallas,cute] [--batches 1,8,64]
                          [--contexts 1024,8192,32768] [--expert-formats mxfp4-rows,mxfp4-tiles,bf16] [--mesh ep=2
                          --ep-variants allgather,ragged] [--out PATH]
    python -m k3jax.bench --ops [NAME ...] [--batches 1,8,32,128] [--backends xla,pallas] [--out PATH]
    python -m k3jax.bench --report benchmarks/results/*.json [--update docs/bench.md]

`--model`: the jitted decode step of `k3jax.generation` (one token per sequence, greedy) for
every backend x fusion granularity x batch x context. The decode state is built directly at
`lengths = context` with random contents (timing does not depend on the values; no prefill runs)
and preallocated for context + the timed steps, as `generate` would. Per point: compile time;
step latency median / p90 over steps each synced with block_until_ready; back-to-back step time
(what `generate` runs: no host sync), from which tokens/s and the bandwidth-roofline fraction
(k3jax.costs.decode_step_bytes / step time / measured copy bandwidth) follow; on a GPU the sum of
the step's kernel durations (CUPTI) too, so launch gaps show. Points the device cannot hold are
skipped with a line saying why, as are granularities that do not exist yet; nothing crashes the
sweep. Writes JSON (schema in docs/bench.md), a Markdown table and PNG plots beside it.

`--ops`: per-op device time at real K3 shapes (each op's "k3" cases in pallas_kernels; `--sizes
small` runs the small CI shapes instead, for a smoke run anywhere), for
each backend, with achieved bytes/s (the op's minimum bytes, OpSpec.cost) and its fraction of
the device's copy bandwidth (k3jax.costs.copy_bandwidth, the one denominator of every roofline in
k3jax: measured, BENCHMARKS.md, or measured on the spot for other devices). Every implementation is checked
against the reference before it is timed. Times are the sum of the op's GPU kernel durations
(CUPTI, as jax.experimental.mosaic.gpu.profiler does), median over rounds; inputs rotate over
enough copies that they do not fit in the 60 MB L2; state an op updates in place (OpSpec.donate:
kda_decode's recurrent state) is donated, a fresh copy per call made before the timing, as a
decode step donates it. Wall-clock per call (launch gaps included) is recorded too. Results go
to a JSON file (default benchmarks/results/ops-<date>.json; without a GPU under benchmarks/results/cpu/,
git-ignored and outside what `--report benchmarks/results/*.json` reads).

`--report`: one Markdown summary of any number of result files (model rows from --model and from
benchmarks/torch_reference.py, ops rows from --ops); `--update FILE` rewrites the block between
`<!-- bench-results:begin -->` and `<!-- bench-results:end -->` in FILE, plots beside the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from k3jax import atomic, costs, sharding
from k3jax.backend import BACKENDS, REFERENCES
from k3jax.cli import Parser, at_least, check_preset, check_writable, int_list, known, run_cli
from k3jax.config import EXPERT_CHOICES, expert_changes, expert_label
from k3jax.moe_parallel import VARIANTS
from k3jax.weights import parse_dtype

L2_BYTES = 60 << 20
ROTATE_BYTES = 4 * L2_BYTES     # the rotation's working set: several times the L2
MAX_COPIES = 48


TOP_KERNELS = 6


def kernel_records(launch, n: int) -> list[tuple[str, float]] | None:
    """Every GPU kernel launch that `launch(0..n-1)` causes, via CUPTI: [(kernel name, seconds), ...]
    in CUPTI's record order; None without CUPTI (not a GPU) or when no kernel ran."""
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
        ext = mosaic_gpu_lib._mosaic_gpu_ext
        ext._cupti_init()
    except Exception:  # noqa: BLE001 - no CUPTI: the caller falls back to wall clock
        return None
    try:
        outs = jax.tree.leaves([launch(i) for i in range(n)])
        # A decode step donates its input buffers: block on the outputs still alive.
        jax.block_until_ready([x for x in outs if not x.is_deleted()])
    finally:
        timings = ext._cupti_get_timings(True)
    return [(name, ms * 1e-3) for name, ms in timings] or None


def _kernel_times(launch, n: int) -> tuple[float, list[list]] | None:
    """GPU kernel time per launch of `launch(0..n-1)` via CUPTI, in seconds: (total, the
    TOP_KERNELS kernels with the most time as [[name, seconds], ...]); None without CUPTI."""
    records = kernel_records(launch, n)
    if records is None:
        return None
    by_name: dict[str, float] = {}
    for name, s in records:
        by_name[name] = by_name.get(name, 0.0) + s / n
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return sum(by_name.values()), [[name[:120], s] for name, s in top]


def time_rotating(fn, arg_sets: list[tuple], rounds: int = 5, donate: tuple[int, ...] = ()) -> dict:
    """Median per-call device time and wall time (seconds) of jitted `fn` over rotating inputs,
    and (GPU) the kernels that take the most device time per call: [[name, seconds], ...].
    donate: argument positions donated to `fn` (each call gets a copy made before the timing)."""
    run = jax.jit(fn, donate_argnums=donate)

    def fresh() -> list[tuple]:
        if not donate:
            return arg_sets
        sets = [tuple(jax.tree.map(jnp.copy, x) if j in donate else x for j, x in enumerate(a)) for a in arg_sets]
        return jax.block_until_ready(sets)

    jax.block_until_ready([run(*a) for a in fresh()])      # compile + warm up
    n = len(arg_sets)
    dev, wall, top = [], [], []
    for _ in range(rounds):
        sets = fresh()
        timed = _kernel_times(lambda i: run(*sets[i]), n)
        if timed is not None:
            dev.append(timed[0])
            top = timed[1]
        sets = fresh()
        t0 = time.perf_counter()
        jax.block_until_ready([run(*a) for a in sets])
        wall.append((time.perf_counter() - t0) / n)
    out = {"wall_s": statistics.median(wall)}
    out["device_s"] = statistics.median(dev) if dev else out["wall_s"]
    out["timer"] = "cupti" if dev else "wall"
    if top:
        out["top_kernels"] = top
    return out


def bench_ops(ops: list[str], backends: list[str], batches: set[int], sizes: str = "k3", log=print,
              on_row=None, cases: str | None = None) -> dict:
    """Per-op timings (see the module doc); `on_row(result)` after every row (partial results);
    `cases`: a regex, only the sweep cases whose name it matches (re.search)."""
    from pallas_kernels import registry

    copy_bw = costs.copy_bandwidth()
    log(f"copy bandwidth: {copy_bw / 1e9:.1f} GB/s")
    rows = []
    dev = jax.devices()[0]
    result = {"meta": {"kind": "ops", "device": dev.device_kind, "jax": jax.__version__,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"), "copy_bandwidth": copy_bw},
              "rows": rows}
    for op in ops:
        spec = registry.specs().get(op)
        if spec is None:
            log(f"{op}: no OpSpec (no kernel registered); skipped")
            continue
        for case in spec.sweep(sizes):
            if case.batch not in batches or (cases and not re.search(cases, case.name)):
                continue
            kw = case.kw
            first = case.make(jax.random.key(0))
            nbytes, flops = spec.cost(first, kw)
            on_gpu = jax.default_backend() == "gpu"
            copies = max(1, min(MAX_COPIES if on_gpu else 2, math.ceil(ROTATE_BYTES / nbytes)))
            arg_sets = [first] + [case.make(jax.random.key(i)) for i in range(1, copies)]
            ref = jax.jit(lambda *a: spec.reference(*a, **kw))(*first)
            for backend in backends:
                call = spec.runner(case, backend)
                if call is None:
                    continue
                registry.clear_fallbacks()
                try:
                    err = spec.error(jax.jit(call)(*first), ref, first, kw)
                    t = time_rotating(call, arg_sets, donate=spec.donate)
                except Exception as e:  # noqa: BLE001 - record the failure, go on with the sweep
                    rows.append({"op": op, "case": case.name, "batch": case.batch, "backend": backend,
                                 "error_message": f"{type(e).__name__}: {str(e)[:300]}", "correct": False})
                    log(f"{op:12s} {case.name:24s} {backend:7s} FAILED {type(e).__name__}: {str(e)[:200]}")
                    if on_row:
                        on_row(result)
                    continue
                row = {"op": op, "case": case.name, "batch": case.batch, "backend": backend,
                       "bytes": nbytes, "flops": flops, "copies": copies, **t,
                       "tb_per_s": nbytes / t["device_s"] / 1e12,
                       "frac_copy_bw": nbytes / t["device_s"] / copy_bw,
                       "error": err, "tolerance": spec.allowed(ref, first, kw),
                       "correct": bool(err <= spec.allowed(ref, first, kw)), "fallbacks": registry.fallbacks()}
                rows.append(row)
                fell_back = "; ".join(f"{k}: {', '.join(w)}" for k, w in row["fallbacks"].items())
                log(f"{op:12s} {case.name:24s} {backend:7s} {t['device_s'] * 1e6:9.1f} us "
                    f"{row['tb_per_s']:5.2f} TB/s {row['frac_copy_bw']:6.1%}  err {err:.1e}"
                    f"{'' if row['correct'] else '  WRONG'}{f'  (reference ran: {fell_back})' if fell_back else ''}")
                if "top_kernels" in t:
                    log("    top kernels: " + "; ".join(f"{n[:48]} {sec * 1e6:.1f} us" for n, sec in t["top_kernels"][:3]))
                if on_row:
                    on_row(result)
            del arg_sets, first, ref
    return result


def _time_cell(row: dict) -> str:
    """An ops row's time, TB/s and fraction of the copy rate; marked if its outputs were wrong."""
    cell = f"{row['device_s'] * 1e6:.1f} ({row['tb_per_s']:.2f}, {row['frac_copy_bw']:.0%})"
    if row.get("correct") is False:
        cell += f" wrong: err {row.get('error', float('nan')):.1e} > {row.get('tolerance', float('nan')):.1e}"
    return cell


def summary_table(result: dict) -> str:
    """Markdown rows: op/case, batch, then time and fraction of copy bandwidth per backend (every
    backend present, xla first; torch rows from benchmarks/torch_reference.py --ops included),
    and the best k3jax kernel's speedup over XLA. A backend whose kernel did not take the case
    (its reference ran: the row's `fallbacks`) shows "ref" instead; one whose outputs failed the
    reference check keeps its time, marked "wrong" with its error against the tolerance of its run
    (a later tolerance may differ: BENCHMARKS.md); both are left out of the speedup."""
    by_case: dict[tuple, dict] = {}
    for r in result["rows"]:
        if "device_s" not in r:
            continue
        by_case.setdefault((r["op"], r["case"], r["batch"]), {})[r["backend"]] = r
    backends = sorted({b for rs in by_case.values() for b in rs}, key=lambda b: (b != "xla", b))
    head = "| op | case | batch | MB | " + " | ".join(f"{b} us (TB/s, % copy)" for b in backends) + " | best vs xla |"
    lines = [head, "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in backends) + " | ---: |"]
    for (op, case, b), rs in by_case.items():
        timed = {k: r for k, r in rs.items() if f"{op}/{k}" not in r.get("fallbacks", {})}
        ran = {k: r for k, r in timed.items() if r.get("correct") is not False}
        cells = [_time_cell(timed[k]) if k in timed else "ref" if k in rs else "-" for k in backends]
        x = ran.get("xla")
        others = [r["device_s"] for k, r in ran.items() if k not in ("xla", "torch")]   # k3jax's kernels
        sp = f"{x['device_s'] / min(others):.2f}x" if x and others else "-"
        lines.append(f"| {op} | {case} | {b} | {next(iter(rs.values()))['bytes'] / 1e6:.1f} | "
                     f"{' | '.join(cells)} | {sp} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ whole-model decode
# Fusion granularities, finest first. A granularity is data: which decode ops may run a backend's
# kernels. A fused op spans op boundaries in one call (gated_mlp: the dense MLP and the shared
# experts; attn_res_mix_norm: the AttnRes mix and the sub-layer's RMSNorm); "per-op" runs every
# other kernel but not these: the model composes them from their parts (gated_mlp from three
# `linear` calls; the mix on its own kernel, the norm in XLA).
GRANULARITIES = ("xla-ops", "per-op", "fused-sublayer", "layer-megakernel", "step-megakernel")
FUSED_OPS = ("gated_mlp", "attn_res_mix_norm")
NOT_IMPLEMENTED = {
    "layer-megakernel": "no layer megakernel in k3jax yet (nor its grid-barrier vs counter ablation)",
    "step-megakernel": "no step megakernel in k3jax yet (nor its grid-barrier vs counter ablation)",
}
DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,256"
DEFAULT_CONTEXTS = "1024,8192,32768"
STATE_NOTE = ("decode state built at lengths = context with random contents (no prefill); preallocated for "
              "context + the timed steps, as generate would")


def granularity_plan(backend: str, granularity: str):
    """The KernelPlan running `backend` at `granularity`, or a string saying why there is none."""
    from k3jax.backend import XLA, KernelPlan
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose from {', '.join(GRANULARITIES)}")
    if granularity in NOT_IMPLEMENTED:
        return NOT_IMPLEMENTED[granularity]
    if backend == "xla":
        return XLA if granularity == "xla-ops" else "the xla backend runs XLA ops only"
    if granularity == "xla-ops":
        return f"xla-ops is the xla backend, not {backend}"
    full = KernelPlan.for_backend(backend)
    if granularity == "per-op":
        plan = KernelPlan.for_backend(backend, **{op: "xla" for op in FUSED_OPS})
        return plan if plan != XLA else f"{backend} has no kernel for any decode op in this install"
    if all(full.describe()[op] == "xla" for op in FUSED_OPS):
        return f"no fused sub-layer kernel ({', '.join(FUSED_OPS)}) in {backend} yet"
    return full


def ablated(granularity: str, overrides: dict[str, str]) -> str:
    """A row's granularity label with an ablation's op replacements, e.g. "per-op+linear=xla"."""
    return "+".join([granularity] + [f"{op}={impl}" for op, impl in overrides.items()])


def sweep_configs(backends: list[str], granularities: list[str]) -> list[tuple[str, str]]:
    """(backend, granularity) pairs that make sense, in the order of `backends`: xla at xla-ops,
    kernel backends at the rest."""
    return [(b, g) for b in backends for g in granularities if (b == "xla") == (g == "xla-ops")]


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "max_len", "context", "dtype"))
def _random_state(cfg, batch: int, max_len: int, context: int, key, dtype):
    """A DecodeState at lengths = context with random contents. Each leaf is drawn for one
    sequence and broadcast over the batch (timing does not depend on the values, and this keeps
    the float32 temporary to one sequence's share)."""
    from k3jax.cache import DecodeState, init_state
    shapes = jax.eval_shape(lambda: init_state(cfg, 1, max_len, dtype))
    leaves, treedef = jax.tree.flatten(shapes.layers)
    keys = jax.random.split(key, len(leaves))
    filled = [jnp.broadcast_to((0.05 * jax.random.normal(k, x.shape[1:], jnp.float32)).astype(x.dtype),
                               (batch,) + x.shape[1:]) for k, x in zip(keys, leaves)]
    state = DecodeState(lengths=jnp.full((batch,), context, jnp.int32), layers=treedef.unflatten(filled))
    return sharding.constrain_state(state)


def steps_needed(warmup: int, steps: int, timed_sets: int) -> int:
    """Decode steps a timing run advances one state by: warm-up, then `timed_sets` sets of `steps`
    (time_decode_step: latency, back to back and, on a GPU, CUPTI; k3jax.profile: the last two)."""
    return warmup + timed_sets * steps


def _max_len(context: int, steps: int) -> int:
    """Cache positions a state needs for `steps` decode steps past `context` tokens."""
    return context + steps + 1


def compile_decode_step(model, batch: int, context: int, steps: int, seed: int = 0):
    """`k3jax.generation._decode_step` (the step `generate` runs) compiled for `batch` sequences at
    `lengths = context`, on a random state preallocated for `steps` steps past `context`.

    Returns (compiled, advance, compile_s): `advance(_=None)` runs the next step (donating the
    state, as `generate` does) and returns the token buffer [batch, steps + 1] int32.
    Run it under the model's mesh when the model is sharded.
    """
    from flax import nnx

    from k3jax.generation import SamplingParams, _decode_step
    cfg = model.cfg
    graphdef, params = nnx.split(model)
    key = jax.random.key(seed)
    state = _random_state(cfg, batch, _max_len(context, steps), context, key, model.dtype)
    out = jax.random.randint(key, (batch, steps + 1), 0, cfg.vocab_size, jnp.int32)
    done = jnp.zeros((batch,), bool)
    mesh = sharding.model_mesh(model)
    if mesh is not None:
        out = jax.device_put(out, sharding.batch_sharding(mesh, out.shape))
        done = jax.device_put(done, sharding.batch_sharding(mesh, done.shape))
    stop_ids, pad_id = jnp.asarray([-1], jnp.int32), 0
    t0 = time.perf_counter()
    compiled = _decode_step.lower(graphdef, params, state, out, done, 0, key, stop_ids, pad_id,
                                  sampling=SamplingParams()).compile()
    compile_s = time.perf_counter() - t0
    i = 0

    def advance(_=None):
        nonlocal state, out, done, i
        state, out, done = compiled(params, state, out, done, i, key, stop_ids, pad_id)
        i += 1
        return out

    return compiled, advance, compile_s


def step_time(advance, steps: int) -> float:
    """Seconds per step of `steps` calls of `advance` issued back to back with one sync at the end
    (the rate `generate` decodes at)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        last = advance()
    jax.block_until_ready(last)
    return (time.perf_counter() - t0) / steps


def time_decode_step(model, batch: int, context: int, *, steps: int = 32, warmup: int = 3,
                     seed: int = 0) -> dict:
    """Times `k3jax.generation._decode_step` (the step `generate` runs) at `batch` x `context`.

    Returns compile_s; latency_s_median / latency_s_p90 (each step synced with
    block_until_ready); step_s (steps issued back to back, one sync at the end: the rate
    `generate` decodes at); kernel_s (GPU: CUPTI sum of the step's kernel durations, else None).
    Run it under the model's mesh when the model is sharded.
    """
    import numpy as np
    on_gpu = jax.default_backend() == "gpu"
    total = steps_needed(warmup, steps, 3 if on_gpu else 2)
    _, advance, compile_s = compile_decode_step(model, batch, context, total, seed)
    for _ in range(warmup):
        jax.block_until_ready(advance())
    lat = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(advance())
        lat.append(time.perf_counter() - t0)
    step_s = step_time(advance, steps)
    timed = _kernel_times(advance, steps) if on_gpu else None
    out = {"compile_s": compile_s, "steps": steps, "latency_s_median": float(np.median(lat)),
           "latency_s_p90": float(np.percentile(lat, 90)), "step_s": step_s,
           "kernel_s": timed[0] if timed else None}
    if timed:
        out["top_kernels"] = timed[1]
    return out


OVER_BUDGET = "time budget reached before this point"   # the reason of rows a --budget-s run skipped


def _is_oom(e: Exception) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or isinstance(e, MemoryError)


def bench_model(preset: str, backends: list[str], granularities: list[str], batches: list[int],
                contexts: list[int], *, expert_formats: list[str | None] = (None,), dtype: str = "bfloat16",
                mesh: str | None = None, ep_variants: list[str] = ("auto",), ablations: list[dict[str, str]] = (),
                steps: int = 32, warmup: int = 3,
                seed: int = 0, deadline: float | None = None, on_row=None, log=print, progress: bool = True,
                command: str = "") -> dict:
    """The whole-model sweep; returns {"meta": ..., "rows": [...]} (schema: docs/bench.md).

    Points run batch-major (every backend at the first context and batch, then the next), so a
    sweep cut short has compared the backends where it got. Past `deadline` (time.time() value)
    no point starts: the rest are rows with status "skipped". Each row lists the kernels its plan
    asked for and the calls that fell back to the reference (`fallbacks`: op/impl -> why).
    `on_row(result)` is called after every row (e.g. to save partial results). Each of
    `ablations` ({op: impl}) adds a copy of every configuration with those ops replaced
    (KernelPlan.replace), its granularity labelled e.g. "per-op+attn_res_mix_norm=pallas".
    """
    from tqdm.auto import tqdm

    import k3jax
    from k3jax import moe_parallel, sharding
    from pallas_kernels import registry
    configs = [(b, g, ab) for b, g in sweep_configs(backends, granularities) for ab in ({}, *ablations)]
    dev = jax.devices()[0]
    rows: list[dict] = []
    result = {"meta": {"kind": "model", "preset": preset, "device": dev.device_kind, "platform": dev.platform,
                       "n_devices": 1, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": command, "dtype": dtype, "steps": steps, "warmup": warmup,
                       "copy_bandwidth": None, "state": STATE_NOTE, "timer": "wall (CUPTI kernel sum on GPU)"},
              "rows": rows}
    bar = tqdm(total=len(expert_formats) * len(ep_variants) * len(configs) * len(batches) * len(contexts),
               desc="bench", unit="pt", disable=not progress, file=sys.stderr)
    say = (lambda s: tqdm.write(s, file=sys.stderr)) if progress else log

    def add(row: dict, points: int = 1) -> None:
        rows.append(row)
        bar.update(points)
        if row["status"] == "ok":
            say(f"{row['backend']}/{row['granularity']} batch {row['batch']} context {row['context']}: "
                f"{row['step_s'] * 1e3:.2f} ms/step, {row['tokens_per_s']:.1f} tok/s, "
                f"{row['roofline_fraction']:.1%} of roofline (compile {row['compile_s']:.0f} s)")
        else:
            where = f"batch {row['batch']} context {row['context']}: " if row.get("batch") else ""
            say(f"skip {row['backend']}/{row['granularity']} ({row['expert_format']}): {where}{row['reason']}")
        if on_row:
            on_row(finalize(result))

    def past_deadline() -> bool:
        return deadline is not None and time.time() > deadline

    def skip_format(base: dict, reason: str, status: str = "skipped") -> None:
        """One row (`status`: skipped or error) per variant and configuration of an expert format
        that does not run."""
        for variant in ep_variants:
            for backend, gran, ab in configs:
                add({**base, "ep_variant": variant, "backend": backend, "granularity": ablated(gran, ab), "batch": None,
                     "context": None, "status": status, "reason": reason}, len(batches) * len(contexts))

    for fmt in expert_formats:
        base = {"preset": os.path.basename(preset.rstrip("/")), "device": dev.device_kind, "expert_format": fmt,
                "mesh": mesh}
        if past_deadline():
            skip_format(base, OVER_BUDGET)
            continue
        t0 = time.time()
        try:
            model = k3jax.from_pretrained(preset, dtype=dtype, seed=seed, mesh=mesh, **expert_changes(fmt))
        except (MemoryError, ValueError) as e:      # too big to hold: skipped; bad input: an error
            skip_format(base, f"model not built: {e}", "skipped" if isinstance(e, MemoryError) else "error")
            continue
        cfg = model.cfg
        label = base["expert_format"] = expert_label(cfg)
        model_mesh = sharding.model_mesh(model)
        n_dev = model_mesh.size if model_mesh is not None else 1
        bw = costs.copy_bandwidth(dev)
        result["meta"].update(copy_bandwidth=bw, n_devices=n_dev, config=cfg.name)
        result["meta"].setdefault("create_s", {})[label] = time.time() - t0
        result["meta"].setdefault("param_bytes", {})[label] = sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(model))
        # Backends, granularities and dispatch variants that cannot run here: one row each, up front.
        points = []
        if model_mesh is None and len(ep_variants) > 1:   # without a mesh there is no dispatch to vary
            bar.update((len(ep_variants) - 1) * len(configs) * len(batches) * len(contexts))
        for variant in ep_variants if model_mesh is not None else ep_variants[:1]:
            head = {**base, "ep_variant": variant if model_mesh is not None else None}
            why = moe_parallel.unavailable(variant) if model_mesh is not None else None
            for backend, gran, ab in configs:
                plan = why or granularity_plan(backend, gran)
                plan = plan.replace(**ab) if ab and not isinstance(plan, str) else plan
                gran = ablated(gran, ab)
                if isinstance(plan, str):
                    add({**head, "backend": backend, "granularity": gran, "batch": None, "context": None,
                         "status": "unavailable", "reason": plan}, len(batches) * len(contexts))
                else:
                    points.append(({**head, "backend": backend, "granularity": gran,
                                    "kernels": {op: i for op, i in plan.describe().items() if i != "xla"}},
                                   variant, plan))
        ctx = jax.set_mesh(model_mesh) if model_mesh is not None else contextlib.nullcontext()
        with ctx:
            for context in contexts:
                for batch in batches:
                    for head, variant, plan in points:
                        if past_deadline():
                            add({**head, "batch": batch, "context": context, "status": "skipped",
                                 "reason": OVER_BUDGET})
                            continue
                        if model_mesh is not None:
                            sharding.set_ep_variant(model, variant)
                        model.plan = plan
                        bar.set_postfix_str(f"{head['backend']}/{head['granularity']} b{batch} c{context}")
                        registry.clear_fallbacks()
                        row = _bench_point(model, head, batch, context, steps, warmup, seed, bw * n_dev)
                        add({**row, "fallbacks": registry.fallbacks()})
        del model
    bar.close()
    return finalize(result)


def point_unfit(model, batch: int, context: int, steps: int) -> str | None:
    """Why `model` cannot run `steps` decode steps of `batch` sequences past `context` tokens (a
    context beyond max_position_embeddings, or a state that would not fit beside the weights), or None."""
    from k3jax.weights import OutOfMemoryError, check_fits
    cfg, max_len = model.cfg, _max_len(context, steps)
    if max_len > cfg.max_position_embeddings:
        return f"context {context} exceeds max_position_embeddings {cfg.max_position_embeddings}"
    try:
        check_fits(cfg, model.dtype, mesh=sharding.model_mesh(model), batch=batch, max_len=max_len, params=False)
    except OutOfMemoryError as e:
        return str(e)
    return None


def _bench_point(model, head: dict, batch: int, context: int, steps: int, warmup: int, seed: int,
                 bandwidth: float) -> dict:
    """One row: time the step, or say why not (never raises for a device limit)."""
    cfg = model.cfg
    row = {**head, "batch": batch, "context": context}
    why = point_unfit(model, batch, context, steps_needed(warmup, steps, 3))     # time_decode_step on a GPU
    if why:
        return {**row, "status": "skipped", "reason": why}
    try:
        t = time_decode_step(model, batch, context, steps=steps, warmup=warmup, seed=seed)
    except Exception as e:  # noqa: BLE001 - one failed point must not end the sweep
        status = "skipped" if _is_oom(e) else "error"
        return {**row, "status": status, "reason": f"{'out of memory: ' if status == 'skipped' else ''}"
                                                   f"{type(e).__name__}: {str(e)[:300]}"}
    moved = costs.decode_step_bytes(cfg, batch, context, jnp.dtype(model.dtype).itemsize)
    return {**row, "status": "ok", **t, "tokens_per_s": batch / t["step_s"], "bytes_per_step": moved["total"],
            "bytes": moved, "achieved_Bps": moved["total"] / t["step_s"],
            "roofline_fraction": moved["total"] / t["step_s"] / bandwidth}


def _match_key(r: dict) -> tuple:
    return (r.get("preset"), r.get("run"), r.get("expert_format"), r.get("mesh"), r.get("ep_variant"),
            r.get("batch"), r.get("context"))


def finalize(result: dict) -> dict:
    """Fills speedup_vs_xla of every ok row from the xla-ops row of the same point (None if absent)."""
    xla = {_match_key(r): r["step_s"] for r in result["rows"]
           if r.get("status") == "ok" and r.get("backend") == "xla" and r.get("granularity") == "xla-ops"}
    for r in result["rows"]:
        if r.get("status") == "ok":
            ref = xla.get(_match_key(r))
            r["speedup_vs_xla"] = ref / r["step_s"] if ref else None
    return result


# ------------------------------------------------------------------ report: tables and plots
REPORT_BEGIN, REPORT_END = "<!-- bench-results:begin -->", "<!-- bench-results:end -->"


def _from_decode_sweep(data: dict, run: str) -> list[dict]:
    """Rows of the retired benchmarks/decode_sweep.py format (wall-clock step_ms, no percentiles).
    `run` (the file name) tells apart versions of the same point; speedups compare within a run."""
    rows = []
    for r in data["rows"]:
        step_s = r["step_ms"] * 1e-3
        rows.append({"preset": data["preset"], "run": run, "expert_format": None, "mesh": None, "ep_variant": None,
                     "backend": data["backend"], "granularity": "xla-ops" if data["backend"] == "xla" else "per-op",
                     "batch": r["batch"], "context": None, "status": "ok", "step_s": step_s,
                     "latency_s_median": None, "latency_s_p90": None, "tokens_per_s": r["tokens_per_s"],
                     "bytes_per_step": r["bytes_per_step"], "roofline_fraction": r["roofline_fraction"],
                     "device": data.get("device")})
    return rows


def _newest(rows: list[dict], key) -> list[dict]:
    """One row per key(row): the one from the newest run (meta date; later files win ties)."""
    best: dict = {}
    for r in rows:
        k = key(r)
        if k not in best or r.get("date", "") >= best[k].get("date", ""):
            best[k] = r
    return list(best.values())


def load_results(paths: list[str], log=print) -> tuple[dict, list[dict]]:
    """Reads result files -> ({"rows": model rows, "devices": [...], "sources": the files read as results},
    [ops results, one per device]).

    A point measured more than once (same preset, formats, mesh, backend, granularity, batch,
    context, device; or for ops the same device, op, case, backend) keeps its newest measurement,
    and a point measured at all drops its failed attempts: the tables show the current code;
    BENCHMARKS.md keeps the history."""
    model_rows, ops_rows, devices, sources = [], {}, [], []
    for path in paths:
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                log(f"{path}: not JSON ({e}); skipped")
                continue
        meta = data.get("meta", {}) if isinstance(data, dict) else {}
        kind = meta.get("kind")
        if kind == "model":
            devices.append(meta.get("device"))
            model_rows += [{"device": meta.get("device"), "date": meta.get("date", ""), **r}
                           for r in data.get("rows", [])]      # a layer-only expert-parallel run has none
        elif kind == "ops":
            mine = ops_rows.setdefault(meta.get("device"), {"meta": meta, "rows": []})
            if meta.get("date", "") >= mine["meta"].get("date", ""):
                mine["meta"] = meta
            mine["rows"] += [{"date": meta.get("date", ""), "run_copy_bandwidth": meta.get("copy_bandwidth"), **r}
                             for r in data["rows"]]
        elif isinstance(data, dict) and {"preset", "backend", "rows"} <= set(data):
            devices.append(data.get("device"))
            model_rows += _from_decode_sweep(data, os.path.splitext(os.path.basename(path))[0])
        else:
            log(f"{path}: not a k3jax.bench result (kind {kind!r}); skipped")
            continue
        sources.append(path)
    point = lambda r: (_match_key(r), r.get("device"), r.get("backend"), r.get("granularity"))  # noqa: E731
    model_rows = _newest(model_rows, lambda r: (*point(r), r.get("status") == "ok"))
    measured = {point(r) for r in model_rows if r.get("status") == "ok"}
    model_rows = [r for r in model_rows if r.get("status") == "ok" or point(r) not in measured]
    ops_results = [{"meta": res["meta"], "rows": _newest(res["rows"], lambda r: (r["op"], r["case"], r["backend"]))}
                   for res in ops_rows.values()]
    merged = finalize({"rows": model_rows})
    return {"rows": merged["rows"], "devices": sorted({d for d in devices if d}), "sources": sources}, ops_results


def _fmt(x, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def model_table(rows: list[dict]) -> str:
    """Markdown: one line per measured point, then the points not run and why."""
    ok = [r for r in rows if r.get("status") == "ok"]
    ok.sort(key=lambda r: (r["preset"], str(r.get("run")), str(r.get("expert_format")), str(r.get("ep_variant")),
                           r.get("context") or 0, r["batch"], r["backend"] != "xla", r["backend"],
                           GRANULARITIES.index(r["granularity"]) if r["granularity"] in GRANULARITIES else 9))
    lines = ["| preset | device | experts | backend / granularity | batch | context | tok/s | step ms "
             "| latency ms p50 / p90 | GB/step | roofline | vs XLA |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in ok:
        variant = f" ({r['ep_variant']})" if r.get("ep_variant") else ""
        lat = (f"{_fmt(r.get('latency_s_median'), '.2f', 1e3)} / {_fmt(r.get('latency_s_p90'), '.2f', 1e3)}")
        sp = r.get("speedup_vs_xla")
        lines.append(
            f"| {r['preset']}{' (' + r['run'] + ')' if r.get('run') else ''} | {r.get('device') or '-'} | {r.get('expert_format') or '-'}{variant} | "
            f"{r['backend']} / {r['granularity']} | {r['batch']} | {r.get('context') or '-'} | "
            f"{r['tokens_per_s']:,.1f} | {r['step_s'] * 1e3:.2f} | {lat} | {r['bytes_per_step'] / 1e9:.3f} | "
            f"{r['roofline_fraction']:.1%} | {'-' if sp is None else f'{sp:.2f}x'} |")
    if not ok:
        lines.append("| (no measured points) | | | | | | | | | | | |")
    skipped: dict[str, int] = {}
    for r in rows:
        if r.get("status") != "ok":
            reason = str(r.get("reason")).splitlines()[0] if r.get("reason") else None
            key = f"{r['preset']} {r['backend']} / {r['granularity']}: {r['status']}: {reason}"
            skipped[key] = skipped.get(key, 0) + 1
    if skipped:
        lines += ["", "Not run:"] + [f"- {k}" + (f" ({n} points)" if n > 1 else "") for k, n in skipped.items()]
    return "\n".join(lines)


def write_plots(rows: list[dict], prefix: str, log=print) -> list[str]:
    """Per preset: fraction of the bandwidth roofline and tokens/s vs batch, one line per
    backend / granularity / context. PNGs `<prefix>-<preset>.png`, written atomically."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots skipped: matplotlib is not installed (pip install -e .[notebooks])")
        return []
    ok = [r for r in rows if r.get("status") == "ok"]
    paths = []
    for preset in sorted({r["preset"] for r in ok}):
        mine = [r for r in ok if r["preset"] == preset]
        fig, (ax_roof, ax_tok) = plt.subplots(1, 2, figsize=(12, 4.5))
        series: dict[tuple, list[dict]] = {}
        for r in mine:
            label = (r["backend"], r["granularity"], r.get("expert_format") or r.get("run"), r.get("ep_variant"),
                     r.get("context"))
            series.setdefault(label, []).append(r)
        styles = ["-", "--", ":", "-."]
        contexts = sorted({r.get("context") or 0 for r in mine})
        for (backend, gran, fmt, variant, context), rs in sorted(series.items(), key=lambda kv: str(kv[0])):
            rs.sort(key=lambda r: r["batch"])
            b = [r["batch"] for r in rs]
            name = f"{backend}/{gran}" + (f" {fmt}" if fmt else "") + (f" {variant}" if variant else "") + (
                f" ctx {context}" if context else "")
            ls = styles[contexts.index(context or 0) % len(styles)]
            ax_roof.plot(b, [100 * r["roofline_fraction"] for r in rs], ls, marker="o", label=name)
            ax_tok.plot(b, [r["tokens_per_s"] for r in rs], ls, marker="o", label=name)
        for ax, title in ((ax_roof, "% of bandwidth roofline"), (ax_tok, "tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_title(f"{preset}: {title}")
            ax.grid(True, alpha=0.3)
        ax_tok.set_yscale("log")
        ax_tok.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = f"{prefix}-{preset}.png"
        with atomic.atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def report_markdown(paths: list[str], plot_prefix: str | None, link_dir: str | None = None, log=print) -> str:
    """The Markdown block for a set of result files (model table, plots, ops tables). Raises
    ValueError when none of them is a k3jax.bench result (an --update would empty the block)."""
    model, ops_results = load_results(paths, log)
    if not model["sources"]:
        raise ValueError(f"none of the {len(paths)} file(s) is a k3jax.bench result: nothing to report")
    parts = [f"Generated by `python -m k3jax.bench --report` from: "
             f"{', '.join('`' + os.path.relpath(p) + '`' for p in model['sources'])}.", ""]
    if model["rows"]:
        parts += ["### Whole-model decode step", "", model_table(model["rows"]), ""]
        for png in write_plots(model["rows"], plot_prefix, log) if plot_prefix else []:
            rel = os.path.relpath(png, link_dir) if link_dir else png
            parts += [f"![{os.path.basename(png)}]({rel})", ""]
    for res in ops_results:
        m = res["meta"]
        rates = sorted({r.get("run_copy_bandwidth") or m.get("copy_bandwidth") or 0 for r in res["rows"]})
        rate = (f"copy bandwidth {rates[0] / 1e12:.2f} TB/s" if len(rates) == 1 else
                f"copy bandwidth {rates[0] / 1e12:.2f}-{rates[-1] / 1e12:.2f} TB/s: each row's % against its own run's")
        parts += [f"### Per-op kernels ({m.get('device')}; newest measurement of each case, latest run "
                  f"{m.get('date')}, {rate})", "", summary_table(res), ""]
    return "\n".join(parts).rstrip() + "\n"


def update_doc(doc: str, block: str) -> None:
    """Replaces the text between REPORT_BEGIN and REPORT_END in `doc` (atomically)."""
    with open(doc) as f:
        text = f.read()
    if REPORT_BEGIN not in text or REPORT_END not in text:
        raise ValueError(f"{doc} has no '{REPORT_BEGIN}' ... '{REPORT_END}' block to update")
    pre, rest = text.split(REPORT_BEGIN, 1)
    _, post = rest.split(REPORT_END, 1)
    atomic.write_text(doc, f"{pre}{REPORT_BEGIN}\n{block}{REPORT_END}{post}")


def main(argv=None) -> int:
    p = Parser(prog="python -m k3jax.bench", description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model", action="store_true", help="whole-model decode step sweep")
    mode.add_argument("--ops", nargs="*", metavar="NAME", help="per-op benchmark (default: every op with a kernel)")
    mode.add_argument("--report", nargs="+", metavar="JSON", help="Markdown table + plots from result files")
    p.add_argument("--preset", default="k3-tiny", help="--model: preset name or checkpoint directory")
    p.add_argument("--batches", default=None, help=f"default: --model {DEFAULT_BATCHES}; --ops 1,8,32,128")
    p.add_argument("--contexts", default=DEFAULT_CONTEXTS, help="--model: cached tokens per sequence")
    p.add_argument("--backends", default=None, help="default: --model xla,pallas,cute; --ops xla,pallas")
    p.add_argument("--granularities", default=",".join(GRANULARITIES),
                   help=f"--model: kernel fusion granularities per backend (default {','.join(GRANULARITIES)})")
    p.add_argument("--expert-formats", default=None,
                   help="--model ablation, e.g. mxfp4,bf16 or mxfp4-rows,mxfp4-tiles (MXFP4 in row / tile order; mxfp4: the "
                        "default layout, tiles where the widths allow; default: the preset's)")
    p.add_argument("--mesh", default=None, help="--model: device mesh, e.g. ep=2 (k3jax.sharding)")
    p.add_argument("--ep-variants", default="auto", help="--model with --mesh: expert dispatch variants to compare")
    p.add_argument("--ablate", action="append", default=[], metavar="OP=IMPL[,OP=IMPL]",
                   help="--model: also run every configuration with these ops replaced, e.g. "
                        "attn_res_mix_norm=pallas (repeatable; rows labelled granularity+OP=IMPL)")
    p.add_argument("--dtype", default="bfloat16", help="--model: activation / dense weight dtype (default bfloat16)")
    p.add_argument("--steps", type=int, default=32, help="--model: timed steps per point (default 32)")
    p.add_argument("--warmup", type=int, default=3, help="--model: untimed steps before timing (default 3)")
    p.add_argument("--sizes", default="k3", choices=["k3", "small"], help="--ops small: a CPU smoke run")
    p.add_argument("--cases", default=None, help="--ops: regex, only the cases whose name matches (re.search)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<mode>-<date>.json; without a GPU benchmarks/results/cpu/...)")
    p.add_argument("--update", default=None, help="--report: rewrite the results block of this Markdown file")
    p.add_argument("--plots", default=None, help="--report: plot path prefix (default: beside the first JSON)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="--model: start no new point after this many seconds (the rest: skipped rows)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs and CI)")
    a = p.parse_args(argv)
    command = "python -m k3jax.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    return run_cli("k3jax.bench", lambda: _main(a, command))


RESULTS_DIR = "benchmarks/results"


def default_out(name: str, on_gpu: bool | None = None) -> str:
    """Where a result goes without --out: RESULTS_DIR/name on a GPU; without one RESULTS_DIR/cpu/name
    (git-ignored, and outside the `benchmarks/results/*.json` that `--report --update` reads), so
    a CPU smoke run never lands among the published GPU results. on_gpu: whether the run timed a
    GPU (default: JAX's backend is one)."""
    gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    return os.path.join(RESULTS_DIR, *([] if gpu else ["cpu"]), name)


def _warn_without_gpu() -> None:
    """Once the arguments are checked: CPU timings are not the GPU kernels'."""
    if jax.default_backend() != "gpu":
        print("warning: no GPU; timings measure the CPU (and the Pallas interpreter), not GPU kernels",
              file=sys.stderr)


def parse_ablation(text: str) -> dict[str, str]:
    """"op=impl,op=impl" -> {op: impl}; ValueError unless each op has that implementation here."""
    from k3jax.backend import XLA
    pairs = [item.split("=") for item in text.split(",")]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"--ablate {text!r}: expected OP=IMPL[,OP=IMPL], e.g. attn_res_mix_norm=pallas")
    XLA.replace(**dict(pairs))          # names an unknown op or a missing implementation
    return dict(pairs)


def _main(a: argparse.Namespace, command: str) -> int:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if a.report:
        missing = [f for f in a.report if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"no such result file(s): {', '.join(missing)}")
        prefix = a.plots or os.path.join(os.path.dirname(a.report[0]) or ".", "plots", "report")
        link_dir = os.path.dirname(os.path.abspath(a.update)) if a.update else None
        block = report_markdown(a.report, prefix, link_dir, log=lambda s: print(s, file=sys.stderr))
        if a.update:
            update_doc(a.update, block)
            print(f"updated {a.update}", file=sys.stderr)
        print(block)
        return 0
    backends = known(a.backends.split(","), BACKENDS, "backend(s)") if a.backends else None
    at_least("--steps", a.steps, 1)
    at_least("--warmup", a.warmup, 0)
    if a.budget_s is not None:
        at_least("--budget-s", a.budget_s, 0)      # 0: every point a skipped row
    if a.out:
        check_writable(a.out, "--out")
    if a.model:
        grans = known(a.granularities.split(","), GRANULARITIES, "granularity")
        check_preset(a.preset)
        parse_dtype(a.dtype)
        formats = (known(a.expert_formats.split(","), EXPERT_CHOICES, "--expert-formats")
                   if a.expert_formats else [None])
        if a.mesh:
            sharding.make_mesh(a.mesh)          # a bad spec, or more devices than there are
        batches, contexts = int_list(a.batches or DEFAULT_BATCHES, "--batches"), int_list(a.contexts, "--contexts")
        out = a.out or default_out(f"model-{os.path.basename(a.preset.rstrip('/'))}-{stamp}.json")
        save = lambda res: atomic.write_json(out, res)  # noqa: E731 - partial results survive a kill
        ablations = [parse_ablation(x) for x in a.ablate]
        _warn_without_gpu()
        result = bench_model(a.preset, backends or list(BACKENDS), grans, batches, contexts,
                             expert_formats=formats,
                             dtype=a.dtype, mesh=a.mesh,
                             ep_variants=known(a.ep_variants.split(","), ("auto", *VARIANTS), "--ep-variants"),
                             ablations=ablations,
                             steps=a.steps, warmup=a.warmup, on_row=save, progress=not a.no_progress,
                             command=command, deadline=None if a.budget_s is None else time.time() + a.budget_s)
        save(result)
        stem = out[:-5] if out.endswith(".json") else out
        table = model_table(result["rows"])
        atomic.write_text(stem + ".md", table + "\n")
        plots = write_plots(result["rows"], stem)
        print(table)
        print(f"results: {out}, {stem}.md" + "".join(f", {q}" for q in plots))
        return 1 if any(r["status"] == "error" for r in result["rows"]) else 0
    ops = known(a.ops, REFERENCES, "op(s)") if a.ops else list(REFERENCES)
    batches = set(int_list(a.batches or "1,8,32,128", "--batches"))
    out = a.out or default_out(f"ops-{stamp}.json")
    save = lambda res: atomic.write_json(out, res)  # noqa: E731 - partial results survive a kill
    try:
        re.compile(a.cases or "")
    except re.error as e:
        raise ValueError(f"--cases {a.cases!r} is not a regular expression: {e}") from None
    _warn_without_gpu()
    result = bench_ops(ops, backends or ["xla", "pallas"], batches, a.sizes, on_row=save, cases=a.cases)
    save(result)
    print(summary_table(result))
    print(f"copy bandwidth {result['meta']['copy_bandwidth'] / 1e9:.1f} GB/s; results: {out}")
    return 0 if all(r["correct"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
