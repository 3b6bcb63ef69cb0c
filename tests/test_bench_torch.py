"""benchmarks/torch_reference.py: a CPU smoke run (skipped where torch/transformers are not installed)."""

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers.models.kimi_linear")


def _module():
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "torch_reference.py"
    spec = importlib.util.spec_from_file_location("torch_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_torch_reference_smoke(tmp_path):
    ref = _module()
    out = tmp_path / "torch.json"
    assert ref.main(["--model", "--preset", "kimi-linear-tiny", "--batches", "2", "--contexts", "8",
                     "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    row = json.load(open(out))["rows"][0]
    assert (row["backend"], row["status"], row["expert_format"]) == ("torch", "ok", "bf16")
    assert row["roofline_fraction"] > 0 and row["latency_s_p90"] >= row["latency_s_median"]
    ops = tmp_path / "ops.json"
    assert ref.main(["--ops", "--sizes", "small", "--batches", "1", "--out", str(ops)]) == 0
    assert {r["op"] for r in json.load(open(ops))["rows"]} == {"linear", "moe_experts"}
