"""Multi-process expert-parallel decode on CPU (gloo collectives), checked against one process.

    python scripts/ep_multiprocess.py                       # 2 processes x 1 CPU device, mesh ep=2
    python scripts/ep_multiprocess.py --processes 2 --local-devices 2 --mesh ep=2,tp=2

Runs `python -m k3jax.decode --processes N --mesh M` (k3jax.launch: one jax.distributed job, the
same runtime a multi-host GPU launch uses) greedily with the tiny preset in float32, then the same
generation as one process without a mesh, and compares the tokens. Exit code 0 when they agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["JAX_PLATFORMS"] = "cpu"          # before k3jax.launch reads it; the children inherit it

from k3jax import launch  # noqa: E402

PROMPTS = ("5,6,7,8", "9,10,11")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--mesh", default="ep=2", help="mesh over all processes' devices (default ep=2)")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--local-devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--new-tokens", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        multi, single = os.path.join(tmp, "multi.json"), os.path.join(tmp, "single.json")
        decode = [sys.executable, "-m", "k3jax.decode", "--preset", args.preset, "--dtype", "float32", "--quiet",
                  "--max-new-tokens", str(args.new_tokens), *(a for ids in PROMPTS for a in ("--prompt-ids", ids))]
        status = launch.spawn([*decode, "--mesh", args.mesh, "--processes", str(args.processes), "--output", multi],
                              args.processes, cpu_devices=args.local_devices, timeout=args.timeout)
        if status:
            raise SystemExit(f"the {args.processes}-process decode exited with status {status}")
        subprocess.run([*decode, "--output", single], check=True, timeout=args.timeout, cwd=ROOT,
                       env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
        got, want = json.load(open(multi)), json.load(open(single))
    same = got["tokens"] == want["tokens"]
    print(f"{args.processes} processes x {args.local_devices} devices, mesh {args.mesh}: {got['tokens']}")
    print(f"1 process, 1 device:                  {want['tokens']}")
    print("same tokens" if same else "TOKENS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
