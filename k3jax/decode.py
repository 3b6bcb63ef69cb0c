"""`python -m k3jax.decode`: generate with a preset (random weights) or a checkpoint and report timings.

With no arguments it runs the tiny preset with a fixed seed on the default device (GPU if present,
else CPU), prints the generated ids and text, prefill and decode times, tokens/s, and the bytes a
decode step moves against the device's bandwidth. `--processes N` runs the same generation as N
processes of one jax.distributed job, one GPU each (k3jax.launch); the first one reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from k3jax import atomic, launch
from k3jax.backend import BACKENDS
from k3jax.cli import Parser, at_least, check_ep_variant, check_writable, int_list, run_cli
from k3jax.config import EXPERT_CHOICES, expert_changes, expert_label
from k3jax.moe_parallel import VARIANTS

DEFAULT_PROMPT = "The Kimi K3 decoder"


def build_parser() -> argparse.ArgumentParser:
    from k3jax.presets import PRESETS
    p = Parser(prog="python -m k3jax.decode", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model")
    src.add_argument("--preset", default="k3-tiny", choices=sorted(PRESETS), metavar="NAME",
                     help=f"model preset with random weights (default k3-tiny); one of: {', '.join(sorted(PRESETS))}")
    src.add_argument("--checkpoint", metavar="DIR", help="Hugging Face checkpoint directory (overrides --preset)")
    src.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation/weight dtype")
    src.add_argument("--experts", choices=EXPERT_CHOICES,
                     help="routed-expert storage; mxfp4-rows / mxfp4-tiles: MXFP4 in row / kernel tile order "
                          "(default: the preset's; MXFP4 in tiles where the widths allow)")
    src.add_argument("--seed", type=int, default=0, help="seed for random weights and sampling (default 0)")
    src.add_argument("--mesh", metavar="SPEC",
                     help="device mesh, e.g. ep=8 or ep=2,tp=2 or dp=2,ep=4 (dp/ep/tp = data/expert/tensor "
                          "parallel; default: one device); see docs/expert_parallel.md")
    src.add_argument("--ep-variant", default="auto", choices=["auto", *VARIANTS],
                     help="expert-parallel dispatch/combine (default auto: on GPU packed for small batches, "
                          "ragged above; a2a on CPU)")
    src.add_argument("--processes", type=int, default=1, metavar="N",
                     help="run as N local processes of one jax.distributed job, one GPU each (with --mesh "
                          "spanning all their devices; default 1: one process drives every device)")
    src.add_argument("--process-id", type=int, help=argparse.SUPPRESS)     # set by k3jax.launch.spawn
    src.add_argument("--coordinator", help=argparse.SUPPRESS)
    src.add_argument("--backend", default="xla", choices=BACKENDS,
                     help="decode-op implementations (default xla); ops without a kernel fall back, see the report")
    inp = p.add_argument_group("prompt")
    inp.add_argument("--prompt", action="append", metavar="TEXT",
                     help=f"prompt text (repeat for a batch of different prompts; default {DEFAULT_PROMPT!r})")
    inp.add_argument("--prompt-ids", action="append", metavar="IDS",
                     help="prompt as comma-separated token ids, e.g. 1,2,3 (repeatable; overrides --prompt)")
    inp.add_argument("--batch-size", type=int, default=1, help="copies of each prompt in the batch (default 1)")
    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per prompt (default 16)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample from the k most likely tokens (0 = off; needs --temperature > 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off; needs --temperature > 0)")
    gen.add_argument("--stop-token", type=int, action="append", default=[], metavar="ID",
                     help="also stop a sequence after this id (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at the model's eos_token_id (stopping there is the default)")
    out = p.add_argument_group("output")
    out.add_argument("--output", metavar="FILE.json", help="write prompts, generated ids, timings and settings")
    out.add_argument("--quiet", action="store_true", help="print only the summary table")
    return p


def stop_tokens(args: argparse.Namespace, cfg) -> list[int]:
    """--stop-token ids, then the model's eos id(s) unless --ignore-eos."""
    return list(dict.fromkeys(args.stop_token + ([] if args.ignore_eos else list(cfg.eos_token_ids))))


def pad_id(cfg) -> int:
    """What fills a sequence after it stops: the model's pad_token_id, else 0."""
    return cfg.pad_token_id if cfg.pad_token_id is not None else 0


@dataclasses.dataclass(frozen=True)
class Request:
    """A run's checked inputs: the K3Config and its changes, tokenizer, the distinct prompts' ids
    and how many sequences start from each (--batch-size), k3jax.SamplingParams, stop ids, pad id."""

    cfg: object
    changes: dict
    tokenizer: object
    distinct_prompts: list
    copies: int
    sampling: object
    stops: list
    pad: int

    @property
    def prompts(self) -> list:
        """One id list per sequence: each distinct prompt `copies` times."""
        return [p for p in self.distinct_prompts for _ in range(self.copies)]


def model_source(args: argparse.Namespace) -> tuple[str, str]:
    """(path or preset, from_pretrained's `source`): --checkpoint is a directory, --preset a preset,
    even where a folder of that name exists."""
    return (args.checkpoint, "checkpoint") if args.checkpoint else (args.preset, "preset")


def prepare(args: argparse.Namespace) -> Request:
    """Everything about the run that can be checked before the weights exist: flag combinations,
    the model config, tokenizer, prompts, sampling, stop ids (generation.check_request), the
    output path. ValueError/ConfigError naming the problem."""
    from k3jax.generation import SamplingParams, check_request
    from k3jax.tokenizer import tokenizer_for
    from k3jax.weights import check_seed, config_of

    at_least("--batch-size", args.batch_size, 1)
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_seed(args.seed, "--seed")
    check_ep_variant(args.ep_variant, args.mesh)
    if args.output:
        check_writable(args.output, "--output")
    changes = expert_changes(args.experts)
    path_or_preset, source = model_source(args)
    cfg = config_of(path_or_preset, source=source, **changes)
    tokenizer = tokenizer_for(args.checkpoint, cfg.vocab_size)
    if args.prompt_ids:
        prompts = [int_list(t, "--prompt-ids", minimum=0) for t in args.prompt_ids]
    else:
        prompts = [tokenizer.encode(t) for t in (args.prompt or [DEFAULT_PROMPT])]
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    stops, pad = stop_tokens(args, cfg), pad_id(cfg)
    check_request(cfg, prompts, args.max_new_tokens, sampling, stops, pad)
    if args.coordinator is None and args.temperature == 0 and (args.top_k or args.top_p < 1):   # once a job
        print("k3jax.decode: note: --top-k / --top-p have no effect at --temperature 0 (greedy decoding)",
              file=sys.stderr)
    return Request(cfg, changes, tokenizer, prompts, args.batch_size, sampling, stops, pad)


def run(args: argparse.Namespace, request: Request) -> dict:
    """Builds the model and generates `prepare(args)`'s request -> the report."""
    import jax

    import k3jax
    from k3jax.backend import KernelPlan
    from k3jax.costs import copy_bandwidth, decode_step_bytes

    if args.mesh and args.ep_variant != "auto":     # needs the backend, so not in prepare()
        from k3jax.moe_parallel import check_available
        check_available(args.ep_variant, f"--ep-variant {args.ep_variant}")
    # The weights, the decode state and the logits of every sequence fit, before anything is
    # built (the sequences are expanded only then: a huge --batch-size ends here, in one line).
    from k3jax.sharding import as_mesh
    from k3jax.weights import check_fits
    mesh = as_mesh(args.mesh) if args.mesh else None
    check_fits(request.cfg, args.dtype, mesh=mesh,
               batch=len(request.distinct_prompts) * request.copies,
               max_len=max(map(len, request.distinct_prompts)) + args.max_new_tokens)
    if args.backend != "xla" and jax.default_backend() != "gpu":
        print(f"k3jax.decode: note: no GPU, so --backend {args.backend}'s kernels run in interpret mode or fall "
              "back to XLA: slow, for checking, not timing", file=sys.stderr)
    path_or_preset, source = model_source(args)
    model = k3jax.from_pretrained(path_or_preset, source=source, dtype=args.dtype, seed=args.seed,
                                  mesh=mesh, **request.changes)
    if args.mesh:
        from k3jax.sharding import set_ep_variant
        set_ep_variant(model, args.ep_variant)
    model.plan = KernelPlan.for_backend(args.backend)
    if args.backend != "xla":
        from pallas_kernels.registry import clear_fallbacks
        clear_fallbacks()
    cfg = model.cfg
    tokenizer, prompts, stops, pad = request.tokenizer, request.prompts, request.stops, request.pad
    result = k3jax.generate_with_stats(model, prompts, args.max_new_tokens, sampling=request.sampling, seed=args.seed,
                                       stop_tokens=stops, pad_id=pad, progress=args.max_new_tokens > 32 and not args.quiet)
    device = jax.devices()[0]
    context = int(result.prompt_lengths.max()) + args.max_new_tokens // 2
    moved = decode_step_bytes(cfg, len(prompts), context, 2 if args.dtype == "bfloat16" else 4)["total"]
    bandwidth = copy_bandwidth(device)
    achieved = moved / (result.step_ms / 1e3) if result.decode_steps else float("nan")
    report = {
        "settings": {k: v for k, v in vars(args).items()},
        "stop_tokens": stops,
        "pad_id": pad,
        "kernels": model.plan.describe(),
        "fallbacks": _fallbacks(args.backend),
        "mesh": args.mesh or "single",
        "model": {"name": cfg.name, "params": cfg.param_count(), "active_params": cfg.active_param_count(),
                  "expert_format": expert_label(cfg)},
        "device": {"platform": device.platform, "kind": device.device_kind, "copy_bandwidth_Bps": bandwidth},
        "prompts": prompts,
        "prompt_text": [tokenizer.decode(p) for p in prompts],
        "weights": f"checkpoint {args.checkpoint}" if args.checkpoint else f"random (preset {args.preset}, seed {args.seed})",
        "tokenizer": tokenizer.name,
        "generated_text": [tokenizer.decode(t[:n]) for t, n in zip(result.tokens, result.num_generated)],
        "bytes_per_decode_step": moved,
        "achieved_Bps": achieved,
        "roofline_fraction": achieved / bandwidth,
        **result.as_dict(),
    }
    return report


def _fallbacks(backend: str) -> dict[str, list[str]]:
    """Kernels of this run that ran their XLA reference for some call, and why."""
    if backend == "xla":
        return {}
    from pallas_kernels.registry import fallbacks
    return fallbacks()


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def _num(x: float | None, spec: str, scale: float = 1.0) -> str:
    """x * scale formatted, or "-" where there is no value (no decode step ran: NaN / None)."""
    return "-" if x is None or math.isnan(x) else format(x * scale, spec)


def print_report(r: dict, quiet: bool) -> None:
    if not quiet:
        for i, (prompt, ids, text) in enumerate(zip(r["prompt_text"], r["tokens"], r["generated_text"])):
            print(f"[{i}] prompt: {prompt!r}")
            print(f"[{i}] ids: {ids}")
            print(f"[{i}] text: {text!r}")
    rows = [
        ("model", f"{r['model']['name']} ({_count(r['model']['params'])} params, "
                  f"{_count(r['model']['active_params'])} active, experts {r['model']['expert_format']})"),
        ("weights", r["weights"] + (": the text is noise" if r["weights"].startswith("random") else "")),
        ("device", f"{r['device']['kind']} ({r['device']['platform']}), mesh {r['mesh']}"),
        ("kernels", ", ".join(f"{op}={impl}" for op, impl in r["kernels"].items())),
        *[(f"  {op_impl} fell back", whys[0] + (f" (+{len(whys) - 1} more: all in --output's JSON)" if len(whys) > 1 else ""))
          for op_impl, whys in r["fallbacks"].items()],
        ("batch x new tokens", f"{len(r['tokens'])} x {len(r['tokens'][0])}"),
        ("compile", f"{r['compile_s']:.2f} s"),
        ("prefill", f"{r['prefill_s'] * 1e3:.1f} ms"),
        ("decode", f"{r['decode_s'] * 1e3:.1f} ms over {r['decode_steps']} steps ({_num(r['step_ms'], '.2f')} ms/step)"),
        ("decode tokens/s", _num(r["decode_tokens_per_s"], ".1f")),
        ("bytes / decode step", f"{r['bytes_per_decode_step'] / 1e6:.3f} MB"),
        ("achieved bandwidth", f"{_num(r['achieved_Bps'], '.2f', 1e-9)} GB/s of {r['device']['copy_bandwidth_Bps'] / 1e9:.1f} "
                               f"GB/s measured copy ({_num(r['roofline_fraction'], '.1f', 100)}% of roofline)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)

    def work() -> int:
        if args.processes < 1:
            raise ValueError(f"--processes must be >= 1, got {args.processes}")
        if args.processes > 1 and not args.mesh:
            raise ValueError("--processes needs --mesh (a mesh over every process's devices, e.g. ep=2)")
        if args.coordinator is not None:    # a process of the job: join before anything touches jax
            launch.join(args.coordinator, args.processes, args.process_id)
        request = prepare(args)             # bad input ends here, before any process or weight (no jax call)
        if args.processes > 1 and args.coordinator is None:     # the launcher: the job's processes do the work
            return launch.spawn([sys.executable, "-m", "k3jax.decode", *argv], args.processes)
        report = run(args, request)
        if args.process_id:          # one report per job: the first process's
            return 0
        print_report(report, args.quiet)
        if args.output:
            atomic.write_json(args.output, report)
            print(f"wrote {args.output}")
        return 0

    return run_cli("k3jax.decode", work)


if __name__ == "__main__":
    sys.exit(main())
