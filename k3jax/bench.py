"""Benchmarks on the GPU.

    python -m k3jax.bench --ops [NAME ...] [--batches 1,8,32,128] [--backends xla,pallas] [--out PATH]

`--ops`: per-op device time at real K3 shapes (each op's "k3" cases in pallas_kernels; `--sizes
small` runs the small CI shapes instead, for a smoke run anywhere), for
each backend, with achieved bytes/s (the op's minimum bytes, OpSpec.cost) and its fraction of
the device-to-device copy bandwidth measured in the same run. Every implementation is checked
against the reference before it is timed. Times are the sum of the op's GPU kernel durations
(CUPTI, as jax.experimental.mosaic.gpu.profiler does), median over rounds; inputs rotate over
enough copies that they do not fit in the 60 MB L2. Wall-clock per call (launch gaps
included) is recorded too. Results go to a JSON file (default benchmarks/results/ops-<date>.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from k3jax.backend import REFERENCES

L2_BYTES = 60 << 20
ROTATE_BYTES = 4 * L2_BYTES     # the rotation's working set: several times the L2
MAX_COPIES = 48


def _kernel_ms(launch, n: int) -> float | None:
    """Sum of GPU kernel durations (ms) of `launch(0..n-1)`, via CUPTI; None if unavailable."""
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
        ext = mosaic_gpu_lib._mosaic_gpu_ext
        ext._cupti_init()
    except Exception:  # noqa: BLE001 - no CUPTI: the caller falls back to wall clock
        return None
    try:
        jax.block_until_ready([launch(i) for i in range(n)])
    finally:
        timings = ext._cupti_get_timings(True)
    return sum(t for _, t in timings) if timings else None


def time_rotating(fn, arg_sets: list[tuple], rounds: int = 5) -> dict[str, float]:
    """Median per-call device time and wall time (seconds) of jitted `fn` over rotating inputs."""
    run = jax.jit(fn)
    jax.block_until_ready([run(*a) for a in arg_sets])      # compile + warm up
    n = len(arg_sets)
    dev, wall = [], []
    for _ in range(rounds):
        ms = _kernel_ms(lambda i: run(*arg_sets[i]), n)
        if ms is not None:
            dev.append(ms * 1e-3 / n)
        t0 = time.perf_counter()
        jax.block_until_ready([run(*a) for a in arg_sets])
        wall.append((time.perf_counter() - t0) / n)
    out = {"wall_s": statistics.median(wall)}
    out["device_s"] = statistics.median(dev) if dev else out["wall_s"]
    out["timer"] = "cupti" if dev else "wall"
    return out


def measure_copy_bandwidth(nbytes: int | None = None) -> float:
    """Device-to-device copy rate, bytes read + written per second (rotating over 2 buffers)."""
    nbytes = nbytes or (2 << 30 if jax.default_backend() == "gpu" else 1 << 24)
    xs = [jnp.full((nbytes // 4,), float(i + 1), jnp.float32) for i in range(2)]
    t = time_rotating(lambda a: a * 1.0000001, [(x,) for x in xs], rounds=7)
    return 2 * nbytes / t["device_s"]


def bench_ops(ops: list[str], backends: list[str], batches: set[int], sizes: str = "k3", log=print) -> dict:
    from pallas_kernels import registry

    copy_bw = measure_copy_bandwidth()
    log(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s")
    rows = []
    for op in ops:
        spec = registry.specs().get(op)
        if spec is None:
            log(f"{op}: no OpSpec (no kernel registered); skipped")
            continue
        for case in spec.cases():
            if sizes not in case.sizes or case.batch not in batches:
                continue
            kw = case.kw
            first = case.make(jax.random.key(0))
            nbytes, flops = spec.cost(first, kw)
            on_gpu = jax.default_backend() == "gpu"
            copies = max(1, min(MAX_COPIES if on_gpu else 2, math.ceil(ROTATE_BYTES / nbytes)))
            arg_sets = [first] + [case.make(jax.random.key(i)) for i in range(1, copies)]
            ref = jax.jit(lambda *a: spec.reference(*a, **kw))(*first)
            for backend in backends:
                fn = spec.reference if backend == "xla" else registry.implementation(op, backend)
                if fn is None:
                    continue
                call = lambda *a, fn=fn: fn(*a, **kw)  # noqa: E731
                try:
                    err = spec.error(jax.jit(call)(*first), ref, first, kw)
                    t = time_rotating(call, arg_sets)
                except Exception as e:  # noqa: BLE001 - record the failure, go on with the sweep
                    rows.append({"op": op, "case": case.name, "batch": case.batch, "backend": backend,
                                 "error_message": f"{type(e).__name__}: {str(e)[:300]}", "correct": False})
                    log(f"{op:12s} {case.name:24s} {backend:7s} FAILED {type(e).__name__}: {str(e)[:200]}")
                    continue
                row = {"op": op, "case": case.name, "batch": case.batch, "backend": backend,
                       "bytes": nbytes, "flops": flops, "copies": copies, **t,
                       "tb_per_s": nbytes / t["device_s"] / 1e12,
                       "frac_copy_bw": nbytes / t["device_s"] / copy_bw,
                       "error": err, "tolerance": spec.allowed(ref, first, kw),
                       "correct": bool(err <= spec.allowed(ref, first, kw))}
                rows.append(row)
                log(f"{op:12s} {case.name:24s} {backend:7s} {t['device_s'] * 1e6:9.1f} us "
                    f"{row['tb_per_s']:5.2f} TB/s {row['frac_copy_bw']:6.1%}  err {err:.1e}"
                    f"{'' if row['correct'] else '  WRONG'}")
            del arg_sets, first, ref
    dev = jax.devices()[0]
    return {"meta": {"kind": "ops", "device": dev.device_kind, "jax": jax.__version__,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S"), "copy_bandwidth": copy_bw},
            "rows": rows}


def _atomic_write(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def summary_table(result: dict) -> str:
    """Markdown rows: op/case, batch, then time and fraction of copy bandwidth per backend."""
    by_case: dict[tuple, dict] = {}
    for r in result["rows"]:
        if "device_s" not in r:
            continue
        by_case.setdefault((r["op"], r["case"], r["batch"]), {})[r["backend"]] = r
    lines = ["| op | case | batch | MB | xla us | xla TB/s (% copy) | pallas us | pallas TB/s (% copy) | speedup |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (op, case, b), rs in by_case.items():
        x, p = rs.get("xla"), rs.get("pallas")
        cell = lambda r: (f"{r['device_s'] * 1e6:.1f}", f"{r['tb_per_s']:.2f} ({r['frac_copy_bw']:.0%})") if r else ("-", "-")  # noqa: E731
        sp = f"{x['device_s'] / p['device_s']:.2f}x" if x and p else "-"
        lines.append(f"| {op} | {case} | {b} | {(x or p)['bytes'] / 1e6:.1f} | {' | '.join(cell(x))} | "
                     f"{' | '.join(cell(p))} | {sp} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--ops", nargs="*", metavar="NAME", help="per-op benchmark (default: every op with a kernel)")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--backends", default="xla,pallas")
    p.add_argument("--sizes", default="k3", choices=["k3", "small"], help="small: a CPU smoke run")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ops-<date>.json)")
    a = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("warning: no GPU; timings measure the interpreter, not kernels", file=sys.stderr)
    ops = a.ops or list(REFERENCES)
    result = bench_ops(ops, a.backends.split(","), {int(b) for b in a.batches.split(",")}, a.sizes)
    out = a.out or f"benchmarks/results/ops-{time.strftime('%Y%m%d-%H%M%S')}.json"
    _atomic_write(out, json.dumps(result, indent=1))
    print(summary_table(result))
    print(f"copy bandwidth {result['meta']['copy_bandwidth'] / 1e12:.2f} TB/s; results: {out}")
    return 0 if all(r["correct"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
