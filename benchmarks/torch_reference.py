"""PyTorch reference points in k3jax.bench's JSON schemas, so `python -m k3jax.bench --report` shows
them beside k3jax's backends: what a user gets without k3jax.

    python benchmarks/torch_reference.py --model --preset kimi-linear-48b-h200 --batches 1,8,64 --contexts 1024,32768
    python benchmarks/torch_reference.py --model --checkpoint checkpoints/fixtures/kimi_linear --batches 1 --contexts 16
    python benchmarks/torch_reference.py --ops [--sizes small] [--batches 1,8,32,128]

--model: Hugging Face transformers' KimiLinearForCausalLM decode step (one token per sequence,
greedy), measured as `python -m k3jax.bench --model` measures k3jax: a StaticCache advanced to
`context` cached tokens with random contents (no prefill), latency p50/p90 over synced steps,
back-to-back step time, bytes from k3jax.costs.decode_step_bytes. `--preset` builds the preset's
config.json (k3jax.presets: the same dict k3jax builds its model from) with random weights on
the device (timing does not depend on the values, and a 50 GB checkpoint need not be written);
`--checkpoint DIR` loads the very weights k3jax loads from DIR. Settings, fastest first, each
falling back to the next when it fails: "compile+cudagraphs" (torch.compile mode
reduce-overhead, the StaticCache's fixed addresses), "compile", "eager"; experts use
transformers' grouped_mm implementation where it runs. Kimi-Linear presets only (transformers
has no K3: AttnRes, latent MoE, SiTU).

--ops: torch at K3 shapes: dense GEMV (F.linear -> cuBLAS) over pallas_kernels.linear's "k3"
cases (same case names as `k3jax.bench --ops`), and the grouped expert GEMM of a K3 MoE layer
(bf16 experts: torch has no MXFP4 GEMM; torch._grouped_mm where available). CUDA-event timing,
inputs rotated beyond the L2, median of rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # jax only computes shapes and byte counts here
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

try:
    import torch  # noqa: E402
except ImportError:
    torch = None    # --help works without it; main() says how to install it
INSTALL_HINT = ("benchmarks/torch_reference.py needs PyTorch and transformers: bash scripts/setup.sh torch "
                "(or pip install -e .[torch])")

from k3jax import atomic  # noqa: E402
from k3jax.bench import default_out  # noqa: E402
from k3jax.cli import int_list  # noqa: E402
from k3jax.config import K3Config  # noqa: E402
from k3jax.costs import MEASURED_COPY_BANDWIDTH, decode_step_bytes  # noqa: E402
from k3jax.presets import get_preset  # noqa: E402

SETTINGS = ("compile+cudagraphs", "compile", "eager")
ROTATE_BYTES = 240 << 20


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device) -> float:
    """Bytes read + written per second of a device copy (the table's value for known GPUs)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if name in MEASURED_COPY_BANDWIDTH:
        return MEASURED_COPY_BANDWIDTH[name]
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    x = torch.ones(n // 4, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times)


# ------------------------------------------------------------------ whole model
def build_model(preset: str | None, checkpoint: str | None, device, dtype, experts: str):
    """(KimiLinearForCausalLM in eval mode on `device`, its config.json dict, row name)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from k3jax.presets import PRESETS
    if checkpoint:
        with open(os.path.join(checkpoint, "config.json")) as f:
            hf = json.load(f)
    else:
        if preset not in PRESETS:
            raise SystemExit(f"error: unknown preset {preset!r}")
        hf = PRESETS[preset]
    if hf.get("model_type") != "kimi_linear":
        raise SystemExit(f"error: transformers' kimi_linear runs Kimi-Linear configs only, not {hf.get('model_type')!r}")
    kw = {"experts_implementation": experts} if experts != "eager" else {}
    if checkpoint:
        model = KimiLinearForCausalLM.from_pretrained(checkpoint, dtype=dtype, **kw).to(device)
    else:
        with torch.device(device):
            model = KimiLinearForCausalLM._from_config(KimiLinearConfig.from_dict(hf), dtype=dtype, **kw)
    return model.eval(), hf, os.path.basename(checkpoint.rstrip("/")) if checkpoint else preset


def _advance_cache(cache, context: int) -> None:
    """Random cache contents at `context` cached tokens, in place (the StaticCache's tensors keep
    their addresses, as CUDA graphs need)."""
    for layer in cache.layers:
        for name, v in vars(layer).items():
            for t in (v.values() if isinstance(v, dict) else [v]):
                if not isinstance(t, torch.Tensor):
                    continue
                if name == "cumulative_length":
                    t.fill_(context)
                elif t.is_floating_point():
                    t.normal_(0.0, 0.05)


def time_step(model, batch: int, context: int, setting: str, steps: int, warmup: int, device) -> dict:
    from transformers import StaticCache
    total = warmup + 2 * steps
    cache = StaticCache(config=model.config, max_cache_len=context + total + 2)
    tok = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    with torch.inference_mode():
        model(input_ids=tok, past_key_values=cache, cache_position=torch.zeros(1, dtype=torch.long, device=device),
              use_cache=True)  # allocates the cache (lazily) and marks the KDA states as present
        _advance_cache(cache, context)
    pos = torch.full((1,), context, dtype=torch.long, device=device)

    def step(tok, pos):
        out = model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    fn = {"eager": step, "compile": torch.compile(step, fullgraph=True, mode="max-autotune-no-cudagraphs"),
          "compile+cudagraphs": torch.compile(step, fullgraph=True, mode="reduce-overhead")}[setting]

    def advance():
        nonlocal tok
        with torch.inference_mode():
            tok = fn(tok, pos).clone()
            pos.add_(1)

    t0 = time.perf_counter()
    advance()
    _sync(device)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        advance()
    _sync(device)
    lat = []
    for _ in range(steps):
        t0 = time.perf_counter()
        advance()
        _sync(device)
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        advance()
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    lat.sort()
    return {"compile_s": compile_s, "steps": steps, "latency_s_median": statistics.median(lat),
            "latency_s_p90": lat[min(len(lat) - 1, math.ceil(0.9 * len(lat)) - 1)], "step_s": step_s,
            "kernel_s": None}


def bench_model(a, device, dtype) -> dict:
    settings = a.settings.split(",") if a.settings else (SETTINGS if device.type == "cuda" else ("eager",))
    experts = "grouped_mm" if device.type == "cuda" else "eager"
    model, hf, name = build_model(a.preset, a.checkpoint, device, dtype, experts)
    cfg = K3Config.from_hf(hf, name=name)
    bw = copy_bandwidth(device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    meta = {"kind": "model", "preset": name, "device": dev_name, "platform": device.type, "n_devices": 1,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python benchmarks/torch_reference.py " + " ".join(sys.argv[1:]),
            "dtype": str(dtype).replace("torch.", ""), "steps": a.steps, "warmup": a.warmup, "copy_bandwidth": bw,
            "state": "StaticCache advanced to lengths = context with random contents (no prefill)",
            "timer": "wall", "experts_implementation": experts}
    for setting in settings:
        for context in int_list(a.contexts, "--contexts"):
            for batch in int_list(a.batches, "--batches"):
                row = {"preset": name, "device": dev_name, "expert_format": cfg.expert_format, "mesh": None,
                       "ep_variant": None, "backend": "torch", "granularity": setting,
                       "kernels": {"experts": experts}, "batch": batch, "context": context}
                try:
                    t = time_step(model, batch, context, setting, a.steps, a.warmup, device)
                except Exception as e:  # noqa: BLE001 - a failed point is a row, not the end of the sweep
                    oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
                    row.update(status="skipped" if oom else "error", reason=f"{type(e).__name__}: {str(e)[:300]}")
                    print(f"skip torch/{setting} batch {batch} context {context}: {row['reason']}", file=sys.stderr)
                    torch.compiler.reset()
                    rows.append(row)
                    continue
                moved = decode_step_bytes(cfg, batch, context, torch.tensor([], dtype=dtype).element_size())
                row.update(status="ok", **t, tokens_per_s=batch / t["step_s"], bytes_per_step=moved["total"],
                           bytes=moved, achieved_Bps=moved["total"] / t["step_s"],
                           roofline_fraction=moved["total"] / t["step_s"] / bw)
                print(f"torch/{setting:18s} batch {batch:4d} context {context:6d}: {t['step_s'] * 1e3:8.2f} ms/step "
                      f"{row['tokens_per_s']:9.1f} tok/s {row['roofline_fraction']:6.1%} roofline", flush=True)
                rows.append(row)
        torch.compiler.reset()
    return {"meta": meta, "rows": rows}


# ------------------------------------------------------------------ per op
def _time_rotating(fn, arg_sets, device, rounds: int = 5) -> float:
    """Median seconds per call of fn over rotating argument sets (CUDA events on GPU)."""
    for args in arg_sets:
        fn(*args)
    _sync(device)
    per = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for args in arg_sets:
                fn(*args)
            end.record()
            end.synchronize()
            per.append(start.elapsed_time(end) * 1e-3 / len(arg_sets))
        else:
            t0 = time.perf_counter()
            for args in arg_sets:
                fn(*args)
            per.append((time.perf_counter() - t0) / len(arg_sets))
    return statistics.median(per)


def _grouped_experts(x, ids, weights, w13, w2):
    """sum_k weights * expert_ids(x) for bf16 experts w13 [E, M, 2I], w2 [E, I, M]; x [N, M]."""
    n, k = ids.shape
    order = ids.reshape(-1).argsort()
    rows = x.repeat_interleave(k, dim=0)[order]
    counts = torch.bincount(ids.reshape(-1), minlength=w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    if hasattr(torch, "_grouped_mm") and x.is_cuda:
        h = torch._grouped_mm(rows, w13, offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2, offs=offs)
    else:  # per-expert loop (CPU)
        y = torch.empty_like(rows)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                gate, up = (rows[start:start + c] @ w13[e]).chunk(2, dim=-1)
                y[start:start + c] = (torch.nn.functional.silu(gate) * up) @ w2[e]
                start += c
    out = torch.empty_like(y)
    out[order] = y
    return (out.reshape(n, k, -1).float() * weights[..., None]).sum(1).to(x.dtype)


def bench_ops(a, device) -> dict:
    import jax
    from pallas_kernels import registry
    linear = registry.spec("linear")
    bw = copy_bandwidth(device)
    batches = set(int_list(a.batches, "--batches"))
    rows = []

    def add(op, case, batch, nbytes, flops, fn, arg_sets):
        s = _time_rotating(fn, arg_sets, device)
        rows.append({"op": op, "case": case, "batch": batch, "backend": "torch", "bytes": nbytes, "flops": flops,
                     "copies": len(arg_sets), "device_s": s, "wall_s": s,
                     "timer": "cuda-events" if device.type == "cuda" else "wall", "tb_per_s": nbytes / s / 1e12,
                     "frac_copy_bw": nbytes / s / bw, "correct": True})
        print(f"{op:12s} {case:24s} torch {s * 1e6:9.1f} us {nbytes / s / 1e12:5.2f} TB/s {nbytes / s / bw:6.1%}")

    for case in linear.sweep(a.sizes):
        if case.batch not in batches:
            continue
        x, w = jax.eval_shape(case.make, jax.random.key(0))
        nbytes, flops = linear.cost((x, w), {})
        copies = max(1, min(48 if device.type == "cuda" else 2, math.ceil(ROTATE_BYTES / nbytes)))
        sets = [(torch.randn(x.shape, device=device, dtype=torch.bfloat16),
                 torch.randn(w.shape, device=device, dtype=torch.bfloat16) * w.shape[1] ** -0.5)
                for _ in range(copies)]
        add("linear", case.name, case.batch, nbytes, flops, torch.nn.functional.linear, sets)
        del sets
    # K3 MoE layer at k3-h200 (448 local experts of 896, top-16, latent 3584, intermediate 3072).
    k3 = get_preset("k3-h200")
    e, k, m, inter = ((k3.num_experts, k3.num_experts_per_token, k3.moe_hidden_size, k3.moe_intermediate_size)
                      if a.sizes == "k3" else (8, 2, 64, 32))
    w13 = torch.randn(e, m, 2 * inter, device=device, dtype=torch.bfloat16) * m ** -0.5
    w2 = torch.randn(e, inter, m, device=device, dtype=torch.bfloat16) * inter ** -0.5
    for b in sorted(batches):
        ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(b)])
        weights = torch.rand(b, k, device=device)
        x = torch.randn(b, m, device=device, dtype=torch.bfloat16)
        unique = int(ids.unique().numel())
        nbytes = unique * 3 * m * inter * 2 + 2 * b * m * 2
        add("moe_experts", f"k3_bf16_e{e}_top{k}_b{b}", b, float(nbytes), 2.0 * b * k * 3 * m * inter,
            _grouped_experts, [(x, ids, weights, w13, w2)])
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"meta": {"kind": "ops", "device": dev_name, "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S"), "copy_bandwidth": bw}, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model", action="store_true", help="transformers' decode step per batch and context")
    mode.add_argument("--ops", action="store_true", help="cuBLAS GEMV / grouped-GEMM experts at K3 shapes")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="kimi-linear-tiny")
    src.add_argument("--checkpoint", default=None, help="a kimi_linear HF checkpoint directory")
    p.add_argument("--batches", default="1,8,32,128", help="batch sizes (default 1,8,32,128)")
    p.add_argument("--contexts", default="1024,8192,32768", help="--model: cached tokens per sequence")
    p.add_argument("--settings", default=None, help=f"subset of {','.join(SETTINGS)} (default: all on GPU, eager on CPU)")
    p.add_argument("--steps", type=int, default=32, help="--model: timed steps per point (default 32)")
    p.add_argument("--warmup", type=int, default=3, help="--model: untimed steps first (default 3)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--sizes", default="k3", choices=["k3", "small"], help="--ops: small is a CPU smoke run")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/torch-<mode>-<date>.json; on CPU benchmarks/results/cpu/...)")
    a = p.parse_args(argv)
    if torch is None:
        sys.exit(INSTALL_HINT)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if a.model:
        result = bench_model(a, device, dtype)
        name = f"torch-model-{result['meta']['preset']}-{stamp}.json"
    else:
        result = bench_ops(a, device)
        name = f"torch-ops-{stamp}.json"
    out = a.out or default_out(name, on_gpu=device.type == "cuda")
    atomic.write_json(out, result)
    print(f"results: {out}")
    return 1 if any(r.get("status") == "error" for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
