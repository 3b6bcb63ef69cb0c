"""Whole-model decode timing for one preset and backend over batch sizes (one model build).

Usage: python benchmarks/decode_sweep.py --preset k3-h200 --backend xla --batches 1,8 --new 32 --out FILE.json
Prints a table; writes the raw results as JSON (atomic).
"""

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from k3jax.backend import KernelPlan  # noqa: E402
from k3jax.costs import copy_bandwidth, decode_step_bytes  # noqa: E402
from k3jax.decode import write_json_atomic  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--backend", default="xla")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    t0 = time.perf_counter()
    model = k3jax.from_pretrained(a.preset)
    jax.block_until_ready(jax.tree.leaves(model))
    init_s = time.perf_counter() - t0
    model.plan = KernelPlan.for_backend(a.backend)
    dev = jax.devices()[0]
    bw = copy_bandwidth(dev)
    rows = []
    rng = np.random.default_rng(0)
    for b in [int(x) for x in a.batches.split(",")]:
        prompts = rng.integers(0, 256, (b, a.prompt_len))
        r = k3jax.generate_with_stats(model, prompts, a.new)
        moved = decode_step_bytes(model.cfg, b, a.prompt_len + a.new // 2)["total"]
        achieved = moved / (r.step_ms / 1e3)
        rows.append({"batch": b, "step_ms": r.step_ms, "tokens_per_s": r.decode_tokens_per_s,
                     "prefill_s": r.prefill_s, "compile_s": r.compile_s, "bytes_per_step": moved,
                     "achieved_Bps": achieved, "roofline_fraction": achieved / bw,
                     "tokens": r.tokens.tolist()})
        print(f"batch {b:4d}: {r.step_ms:8.2f} ms/step  {r.decode_tokens_per_s:9.1f} tok/s  "
              f"{moved / 1e9:7.2f} GB/step  {achieved / 1e12:5.2f} TB/s  {100 * achieved / bw:5.1f}% of {bw / 1e12:.2f} TB/s",
              flush=True)
    write_json_atomic(a.out, {"preset": a.preset, "backend": a.backend, "device": dev.device_kind,
                              "copy_bandwidth_Bps": bw, "init_s": init_s, "kernels": model.plan.describe(),
                              "rows": rows})


if __name__ == "__main__":
    main()
