"""Who is right when a kernel and its reference disagree on the GPU: both against the same
reference run on XLA:CPU (exact float32, no excess precision), output by output.

    python benchmarks/cpu_judge.py --op kda_decode --case kimi_linear_b1 --case k3_b128 [--impl pallas]

Prints, per output leaf, max |a - b| / max |b| for kernel-vs-CPU, reference-vs-CPU and
kernel-vs-reference (b the second of each pair). Used for BENCHMARKS.md's kda_decode diagnosis (session 4).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run as a script

from k3jax.cli import known, run_cli  # noqa: E402
from pallas_kernels import registry  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True, help="a registered op, e.g. kda_decode")
    ap.add_argument("--case", action="append", required=True, help="a case name of that op's sweep (repeatable)")
    ap.add_argument("--impl", default="pallas", help="implementation to judge (default pallas)")
    args = ap.parse_args()
    return run_cli("cpu_judge", lambda: judge(args.op, args.case, args.impl))


def judge(op: str, cases: list[str], impl: str) -> int:
    spec = registry.spec(known([op], registry.specs(), "op")[0])
    impl = known([impl], registry.implementations(op), f"implementation of {op}")[0]
    by_name = {c.name: c for c in spec.cases()}
    known(cases, sorted(by_name), f"case of {op}")
    cpu = jax.devices("cpu")[0]
    for name in cases:
        case = by_name[name]
        inputs, kw = case.make(jax.random.key(0)), dict(case.kwargs)
        out = jax.jit(spec.runner(case, impl))(*inputs)
        ref = jax.jit(lambda *a: spec.reference(*a, **kw))(*inputs)
        with jax.default_device(cpu):
            on_cpu = jax.jit(lambda *a: spec.reference(*a, **kw))(*jax.device_put(inputs, cpu))
        for i, (o, r, j) in enumerate(zip(*(jax.tree.leaves(x) for x in (out, ref, on_cpu)), strict=True)):
            err = registry.relative_max_error
            print(f"{op} {name:20s} output {i}  {impl}-vs-cpu {err(o, j):.3e}  "
                  f"reference-vs-cpu {err(r, j):.3e}  {impl}-vs-reference {err(o, r):.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
