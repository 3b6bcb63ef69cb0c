"""Several JAX processes on one host, on JAX's multi-host runtime (`jax.distributed`).

`spawn(command, n)` starts n copies of `command` with `--process-id i --coordinator ADDR` appended
(ADDR: a free local port) and waits for them; each copy calls `join` before it touches a device.
On GPUs process i owns local GPU i (`local_device_ids=[i]`): every GPU gets its own process and
host thread, instead of one process driving them all (docs/expert_parallel.md says why that
matters). Under JAX_PLATFORMS=cpu each process gets `cpu_devices` CPU devices and gloo
collectives (tests, CI). Across hosts, start one process per host with the same arguments and
call `jax.distributed.initialize` instead (README, "Expert parallelism and multi-host").
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile

# Where a spawned process's run_cli writes its one-line error instead of stderr (`spawn` prints them).
ERROR_FILE_ENV = "K3JAX_ERROR_FILE"


def on_cpu() -> bool:
    """Whether this process runs JAX on CPU only (JAX_PLATFORMS=cpu)."""
    return os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"


def join(coordinator: str, processes: int, process_id: int) -> None:
    """Inside a spawned process, before any device use: joins the coordinator's global runtime."""
    import jax
    if on_cpu():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)
    else:
        jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id,
                                   local_device_ids=[process_id])


def _free_coordinator() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _env(cpu_devices: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if on_cpu():    # this many CPU devices per process, whatever the parent had
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
    return env


def spawn(command: list[str], processes: int, *, cpu_devices: int = 1, timeout: float | None = None) -> int:
    """Runs `processes` copies of `command` (argv, e.g. [sys.executable, "-m", "k3jax.decode", ...])
    as one distributed job and returns its exit status (the largest of the copies' in magnitude:
    0 when all succeeded); on a timeout or an interrupt the remaining copies are killed (and the
    error re-raised). The copies' one-line errors (k3jax.cli.run_cli) are printed after they end,
    each distinct line once: every process refusing the same input says so in one line."""
    if processes < 2:
        raise ValueError(f"spawn needs at least 2 processes, got {processes}")
    coordinator = _free_coordinator()
    with tempfile.TemporaryDirectory(prefix="k3jax-errors-") as errors:
        procs = [subprocess.Popen([*command, "--process-id", str(i), "--coordinator", coordinator],
                                  env={**_env(cpu_devices), ERROR_FILE_ENV: os.path.join(errors, str(i))})
                 for i in range(processes)]
        try:
            return max((p.wait(timeout=timeout) for p in procs), key=abs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            _print_errors(errors, processes)


def _print_errors(folder: str, processes: int) -> None:
    """Each distinct error line the processes left in `folder` once, on stderr (naming the
    processes when they differ)."""
    lines: dict[str, list[int]] = {}
    for i in range(processes):
        path = os.path.join(folder, str(i))
        if os.path.exists(path):
            with open(path) as f:
                lines.setdefault(f.read().rstrip("\n"), []).append(i)
    for line, ids in lines.items():
        sys.stderr.write(line + ("" if len(lines) == 1 else f" (process {', '.join(map(str, ids))})") + "\n")
