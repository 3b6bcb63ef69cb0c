"""`python -m k3jax.convert`: Hugging Face checkpoint <-> orbax, and synthetic checkpoints.

    python -m k3jax.convert hf-to-orbax  HF_DIR  ORBAX_DIR [--dtype bfloat16]
    python -m k3jax.convert orbax-to-hf  ORBAX_DIR  HF_DIR [--max-shard-gb 5]
    python -m k3jax.convert synthetic    HF_DIR --preset k3-tiny [--seed 0] [--max-shard-gb 5]

Every write is atomic (a temporary sibling directory renamed into place when complete), so an
interrupted run leaves no directory that loads. The orbax checkpoint stores the model state (MXFP4
experts stay packed) and the original config.json; `orbax-to-hf` writes the same Hugging Face
layout back (names, shapes, K3 `language_model.` prefix, per-expert tensors).
"""

from __future__ import annotations

import argparse
import sys

from k3jax.cli import Parser, run_cli


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m k3jax.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-orbax", help="Hugging Face directory -> orbax checkpoint")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    b = sub.add_parser("orbax-to-hf", help="orbax checkpoint -> Hugging Face directory")
    b.add_argument("src")
    b.add_argument("dst")
    s = sub.add_parser("synthetic", help="random HF checkpoint of a preset, deterministic from --seed")
    s.add_argument("dst")
    s.add_argument("--preset", default="k3-tiny")
    s.add_argument("--seed", type=int, default=0)
    for q in (a, b, s):
        q.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    for q in (b, s):
        q.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size (default 5 GB)")
    args = p.parse_args(argv)
    return run_cli("k3jax.convert", lambda: _convert(args))


def _convert(args: argparse.Namespace) -> int:
    import os

    from k3jax import checkpoint as ckpt
    from k3jax.cli import at_least, check_writable
    if os.path.exists(args.dst) and not args.overwrite:    # before a long load, and naming the flag
        raise FileExistsError(f"{args.dst} exists; pass --overwrite to replace it")
    check_writable(os.path.join(args.dst, "config.json"), "the destination")
    if args.cmd != "hf-to-orbax":
        at_least("--max-shard-gb", args.max_shard_gb, 1e-3)
    if args.cmd == "synthetic":
        at_least("--seed", args.seed, 0)
    if args.cmd == "hf-to-orbax":
        model = ckpt.load_hf_checkpoint(args.src, dtype=args.dtype)
        out = ckpt.save_orbax(model, args.dst, ckpt.read_hf_config(args.src), overwrite=args.overwrite)
    elif args.cmd == "orbax-to-hf":
        model, hf_config = ckpt.restore_orbax(args.src)
        out = ckpt.save_hf_checkpoint(model, args.dst, hf_config, overwrite=args.overwrite,
                                      max_shard_bytes=int(args.max_shard_gb * 1e9))
    else:
        out = ckpt.write_synthetic_checkpoint(args.dst, args.preset, args.seed, overwrite=args.overwrite,
                                              max_shard_bytes=int(args.max_shard_gb * 1e9))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
