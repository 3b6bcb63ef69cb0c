"""One registered op case, run a few times: the process to put under Nsight Compute.

    ncu --set full -k "regex:gate_up|down" -c 2 -o OUT python benchmarks/ncu_op.py \
        --op moe_experts --case k3_e448_b1 --impl cute [--calls 3]
    ncu --replay-mode application ...     # large inputs: no save/restore of device memory per pass

Builds the case's inputs (`pallas_kernels.registry`: the same random inputs as `k3jax.bench --ops`
and `k3jax.validate`), compiles the implementation, runs it `--calls` times and prints the
largest relative error against the reference (computed first), so a profile of wrong outputs does
not go unnoticed, then leaves without interpreter teardown: on the H200, `ncu --set full` of a Mosaic
GPU kernel profiled it, then the process segfaulted before ncu printed the report (session 24; a
runner ending in os._exit got its report).
Kernel replay saves and restores the memory a kernel can write before every pass (all of it for
custom calls): cases with GBs of weights (k3_e448) replay slowly; prefer application replay there.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run as a script

from k3jax.cli import at_least, known, run_cli  # noqa: E402
from pallas_kernels import registry  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True, help="a registered op, e.g. moe_experts")
    ap.add_argument("--case", required=True, help="a case name of that op's sweep, e.g. k3_e448_b1")
    ap.add_argument("--impl", default="pallas", help="implementation: pallas, cute or xla (the reference)")
    ap.add_argument("--calls", type=int, default=3, help="calls after the first (compiling) one")
    args = ap.parse_args()
    return run_cli("ncu_op", lambda: run(args.op, args.case, args.impl, args.calls))


def run(op: str, case_name: str, impl: str, calls: int) -> int:
    at_least("--calls", calls, 0)
    spec = registry.spec(known([op], registry.specs(), "op")[0])
    by_name = {c.name: c for c in spec.sweep("small", "k3")}
    case = by_name[known([case_name], by_name, "case")[0]]
    call = spec.runner(case, impl)
    if call is None:
        raise ValueError(f"{op} has no {impl!r} implementation; it has {', '.join(registry.implementations(op))}")
    inputs = case.make(jax.random.key(0))
    ref = jax.block_until_ready(jax.jit(lambda *a: spec.reference(*a, **case.kw))(*inputs))  # before profiling
    step = jax.jit(call)
    out = jax.block_until_ready(step(*inputs))
    for _ in range(calls):
        out = jax.block_until_ready(step(*inputs))
    print(f"{op} {case.name} {impl}: {calls + 1} calls, error {spec.error(out, ref, inputs, case.kw):.2e} "
          f"(tolerance {spec.allowed(ref, inputs, case.kw):.2e})")
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)    # no interpreter teardown: after ncu replays a Mosaic GPU kernel, that segfaulted (session 24)
