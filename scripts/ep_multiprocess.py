"""Multi-process expert-parallel decode on CPU (gloo collectives), checked against one process.

    python scripts/ep_multiprocess.py                       # 2 processes x 1 CPU device, mesh ep=2
    python scripts/ep_multiprocess.py --processes 2 --local-devices 2 --mesh ep=2,tp=2

Starts one coordinator-connected process per rank (jax.distributed.initialize, the same call a
multi-host GPU launch uses), each generating greedily with the tiny preset in float32 on the
global mesh, then runs the same generation in a single process without a mesh and compares the
tokens. Exit code 0 when they agree. `--worker` is the per-process entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def _env(local_devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    return env


def worker(args) -> None:
    import jax
    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    import k3jax
    from k3jax import atomic
    model = k3jax.from_pretrained(args.preset, dtype="float32", seed=0, mesh=args.mesh or None)
    tokens = k3jax.generate(model, PROMPTS, args.new_tokens)
    if jax.process_index() == 0:
        atomic.write_json(args.out, {"tokens": tokens.tolist(), "devices": jax.device_count(),
                                     "processes": jax.process_count()})
    if args.num_processes > 1:
        jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd_args: list[str], n: int, local_devices: int, timeout: float) -> None:
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", *cmd_args, "--process-id", str(i)],
                              env=_env(local_devices)) for i in range(n)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise SystemExit(f"worker exit codes {codes}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--mesh", default="ep=2", help="mesh over all processes' devices (default ep=2)")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--local-devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--new-tokens", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--preset", args.preset, "--new-tokens", str(args.new_tokens)]
        multi, single = os.path.join(tmp, "multi.json"), os.path.join(tmp, "single.json")
        _run(common + ["--mesh", args.mesh, "--num-processes", str(args.processes),
                       "--coordinator", f"127.0.0.1:{_free_port()}", "--out", multi],
             args.processes, args.local_devices, args.timeout)
        _run(common + ["--mesh", "", "--out", single], 1, 1, args.timeout)
        got, want = json.load(open(multi)), json.load(open(single))
    same = got["tokens"] == want["tokens"]
    print(f"{args.processes} processes x {args.local_devices} devices, mesh {args.mesh}: {got['tokens']}")
    print(f"1 process, 1 device:                  {want['tokens']}")
    print("same tokens" if same else "TOKENS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
