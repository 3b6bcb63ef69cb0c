"""Run every registered kernel against its reference over its shape sweep; write a report.

    python -m k3jax.validate [--backend pallas] [--op NAME ...] [--sizes small,k3] [--out PREFIX]

On a GPU the kernels compile and the sweep defaults to small + real K3 shapes; elsewhere they
run in Mosaic GPU interpret mode (NaN-initialised memory, race detector on) over the small
shapes. Per op and case the report gives: shapes, max error vs tolerance (as a fraction of the
output scale), determinism over repeated runs (bitwise), races found, and pass/fail. It is
written as PREFIX.json and PREFIX.md. Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np

from k3jax import atomic
from k3jax.backend import BACKENDS, REFERENCES


@dataclasses.dataclass
class CaseResult:
    op: str
    impl: str
    case: str
    shapes: str
    error: float
    tolerance: float
    deterministic: bool
    races: bool | None          # None: not checked (compiled on a GPU)
    seconds: float
    note: str = ""

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.error) and self.error <= self.tolerance
                    and self.deterministic and not self.races and not self.note)


def _shapes(args) -> str:
    return ", ".join(f"{a.dtype}{list(a.shape)}" for a in jax.tree.leaves(args) if hasattr(a, "shape"))


def _bitwise_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def check_case(spec, impl: str, fn, case, *, seed: int = 0, repeats: int = 2) -> CaseResult:
    """One kernel on one case: error vs reference, bitwise determinism over `repeats` reruns,
    races (interpret mode). Kernels are traced fresh (a new lambda) so interpret/compile and
    race-detection settings apply."""
    from pallas_kernels import mgpu

    args = case.make(jax.random.key(seed))
    kw = case.kw
    t0 = time.perf_counter()
    ref = jax.jit(lambda *a: spec.reference(*a, **kw))(*args)
    interpreted = mgpu.interpret_params() is not None
    note = ""
    races = None
    try:
        with mgpu.race_detection():
            run = jax.jit(lambda *a: fn(*a, **kw))
            out = jax.block_until_ready(run(*args))
            races = mgpu.races_found() if interpreted else None
            again = [jax.block_until_ready(run(*args)) for _ in range(repeats)]
        deterministic = all(_bitwise_equal(out, o) for o in again)
        error = spec.error(out, ref, args, kw)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build/run is a failed case
        if interpreted:
            mgpu.reset_interpreter()
        note = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        deterministic, error = False, float("nan")
    return CaseResult(spec.name, impl, case.name, _shapes(args), float(error),
                      float(spec.allowed(ref, args, kw)), deterministic, races,
                      time.perf_counter() - t0, note)


def run(backend: str = "pallas", ops: list[str] | None = None, sizes: set[str] | None = None,
        repeats: int = 2, log=print) -> list[CaseResult]:
    from pallas_kernels import registry

    on_gpu = jax.default_backend() == "gpu"
    sizes = sizes or ({"small", "k3"} if on_gpu else {"small"})
    specs = registry.specs()
    results = []
    for op in ops or list(REFERENCES):
        if op not in REFERENCES:
            raise SystemExit(f"unknown op {op!r}; ops are {', '.join(REFERENCES)}")
        fn = registry.implementation(op, backend)
        if fn is None or op not in specs:
            log(f"{op:14s} no {backend} kernel (falls back to XLA)")
            continue
        spec = specs[op]
        for case in spec.cases():
            if not case.sizes & sizes:
                continue
            r = check_case(spec, backend, fn, case, repeats=repeats)
            results.append(r)
            log(f"{op:14s} {case.name:28s} err {r.error:.2e} / tol {r.tolerance:.1e}  "
                f"det {'yes' if r.deterministic else 'NO '}  races {r.races}  "
                f"{'PASS' if r.passed else 'FAIL'} {r.note}")
    return results


def write_report(results: list[CaseResult], prefix: str, backend: str) -> None:
    dev = jax.devices()[0]
    meta = {"backend": backend, "device": dev.device_kind, "platform": dev.platform,
            "mode": "compiled" if dev.platform == "gpu" else "Mosaic GPU interpret mode (race detection on)",
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows = [dict(dataclasses.asdict(r), passed=r.passed) for r in results]
    atomic.write_text(prefix + ".json", json.dumps({"meta": meta, "results": rows}, indent=1))
    lines = [f"# Kernel validation: backend {backend}", "",
             " | ".join(f"{k}: {v}" for k, v in meta.items()), "",
             "| op | case | shapes | max err (rel) | tol | deterministic | races | result |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.op} | {r.case} | {r.shapes} | {r.error:.2e} | {r.tolerance:.1e} | "
                     f"{r.deterministic} | {r.races} | {'PASS' if r.passed else 'FAIL ' + r.note} |")
    n_fail = sum(not r.passed for r in results)
    lines += ["", f"{len(results) - n_fail}/{len(results)} cases passed."]
    atomic.write_text(prefix + ".md", "\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="pallas", choices=[b for b in BACKENDS if b != "xla"])
    p.add_argument("--op", action="append", help="op name (repeatable); default: every op")
    p.add_argument("--sizes", default=None, help="comma list of small,k3 (default: small on CPU, both on GPU)")
    p.add_argument("--repeats", type=int, default=2, help="reruns for the determinism check")
    p.add_argument("--out", default="validate_report", help="report path prefix (.json and .md)")
    a = p.parse_args(argv)
    sizes = set(a.sizes.split(",")) if a.sizes else None
    results = run(a.backend, a.op, sizes, a.repeats)
    write_report(results, a.out, a.backend)
    n_fail = sum(not r.passed for r in results)
    print(f"{len(results) - n_fail}/{len(results)} passed; report: {a.out}.md")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
