"""The kernel registry, the backend plan and the validate / bench CLIs."""

import json

import jax

from k3jax import bench, validate
from k3jax.backend import REFERENCES, KernelPlan
from pallas_kernels import registry


def test_every_kernel_has_a_spec_with_the_one_reference():
    for op in REFERENCES:
        if registry.implementation(op, "pallas") is None:
            continue
        spec = registry.spec(op)
        assert spec.reference is REFERENCES[op], f"{op}: the spec must use the k3jax.ops reference"
        cases = spec.cases()
        assert {"small", "k3"} <= set().union(*(c.sizes for c in cases))
        args = cases[0].make(jax.random.key(0))
        nbytes, flops = spec.cost(args, cases[0].kw)
        assert nbytes > 0 and flops > 0


def test_pallas_plan_swaps_only_ops_with_kernels():
    plan = KernelPlan.for_backend("pallas")
    for op, impl in plan.describe().items():
        assert impl == ("pallas" if registry.implementation(op, "pallas") else "xla")
    assert plan("linear") is registry.implementation("linear", "pallas")
    assert KernelPlan.for_backend("pallas", linear="xla")("linear") is REFERENCES["linear"]


def test_validate_cli_writes_report(tmp_path):
    prefix = str(tmp_path / "report")
    assert validate.main(["--op", "linear", "--out", prefix, "--repeats", "1"]) == 0
    report = json.load(open(prefix + ".json"))
    assert report["results"] and all(r["passed"] for r in report["results"])
    assert all(r["races"] is False for r in report["results"])
    assert "PASS" in open(prefix + ".md").read()


def test_bench_ops_smoke(tmp_path):
    out = tmp_path / "ops.json"
    assert bench.main(["--ops", "linear", "--sizes", "small", "--batches", "1", "--out", str(out)]) == 0
    rows = json.load(open(out))["rows"]
    assert {r["backend"] for r in rows} == {"xla", "pallas"} and all(r["correct"] for r in rows)
