"""[ep-scaling]: the 4- and 8-GPU presets fit their meshes, and benchmarks/expert_parallel.py runs
end to end (layer phase + decode-step phase) at tiny sizes on 8 fake CPU devices."""

import importlib.util
import json
import os

import jax
import pytest
from flax import nnx

import k3jax
from k3jax import bench, sharding

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_from_pretrained = k3jax.from_pretrained


@pytest.mark.parametrize("name, ep, layers", [("k3-h200x4", 4, 20), ("k3-h200x8", 8, 30)])
def test_multi_gpu_presets_split_under_110_gb(name, ep, layers):
    cfg = k3jax.get_preset(name)
    assert cfg.num_experts == 896 and cfg.expert_format == "mxfp4"
    assert cfg.num_hidden_layers == layers > k3jax.get_preset("k3-h200x2").num_hidden_layers
    x2 = k3jax.get_preset("k3-h200x2")
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_attention_heads) == (
        x2.hidden_size, x2.moe_intermediate_size, x2.num_attention_heads)   # real per-layer shapes
    per_device = sharding.per_device_param_bytes(cfg, "bfloat16", sharding.make_mesh(f"ep={ep}"))
    assert 90e9 < per_device < 110e9   # leaves >= ~30 GB of an H200 for state and temporaries


def _sharded_from_pretrained(preset, *, mesh, dtype, seed=0):
    """Unsharded creation then a reshard: the same layout as from_pretrained(mesh=) in ~8 s instead
    of the ~40 s XLA:CPU takes to compile the sharded random constructor."""
    model = _from_pretrained(preset, dtype=dtype, seed=seed)
    graphdef, state = nnx.split(model)
    mesh = sharding.make_mesh(mesh)
    return nnx.merge(graphdef, jax.device_put(state, sharding.param_shardings(state, mesh)))


def test_ep_benchmark_tiny_cpu_ep4(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("ep_bench", os.path.join(ROOT, "benchmarks", "expert_parallel.py"))
    ep_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep_bench)
    monkeypatch.setattr(k3jax, "from_pretrained", _sharded_from_pretrained)
    out = tmp_path / "ep4.json"
    assert ep_bench.main(["--cpu-smoke", "--ep", "4", "--batches", "1", "--variants", "ragged,a2a",
                          "--step-variants", "a2a,ragged", "--out", str(out)]) == 0
    res = json.load(open(out))
    layer = {r["variant"]: r for r in res["moe_layer"]}
    assert layer["a2a"]["ep"] == 4 and layer["a2a"]["rel_err_vs_single_device"] < 1e-2
    assert layer["a2a"]["dispatch_combine_us"] > 0 and "XLA:CPU" in layer["ragged"]["skipped"]
    assert "ragged skipped" in capsys.readouterr().out
    # Batch 1 does not divide over ep=4: it runs replicated, not skipped.
    assert "step_error" not in res["meta"], res["meta"].get("step_error")
    steps = {r["ep_variant"]: r for r in res["rows"]}
    ok = steps["a2a"]
    assert (ok["status"], ok["mesh"], ok["batch"], ok["preset"]) == ("ok", "ep=4", 1, "k3-tiny")
    assert ok["tokens_per_s"] == pytest.approx(1 / ok["step_s"]) and ok["roofline_fraction"] > 0
    assert steps["ragged"]["status"] == "unavailable"
    # The file is a k3jax.bench model result: --report tables it.
    assert bench.main(["--report", str(out), "--plots", str(tmp_path / "p")]) == 0
    assert "xla / xla-ops" in capsys.readouterr().out


def test_ep_benchmark_dispatch_only_cpu(tmp_path):
    """--dispatch-only (identity experts against tagged_reference), no step phase."""
    spec = importlib.util.spec_from_file_location("ep_bench", os.path.join(ROOT, "benchmarks", "expert_parallel.py"))
    ep_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep_bench)
    out = tmp_path / "dispatch.json"
    assert ep_bench.main(["--cpu-smoke", "--dispatch-only", "--ep", "2", "--batches", "1,3", "--variants",
                          "a2a,allgather", "--step-mesh", "", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.load(open(out))["moe_layer"]
    assert len(rows) == 4 and all(r["rel_err_vs_single_device"] < 1e-2 and r["dispatch_combine_us"] > 0
                                  for r in rows), rows


@pytest.mark.slow
def test_ep_benchmark_one_process_per_device_cpu(tmp_path):
    """--processes 2: both phases in two jax.distributed processes of one CPU device each (gloo), the
    launch that keeps one host thread per GPU; the layer rows exact like one process, one file.
    The step phase on kimi-linear-tiny: each process compiles the sharded random constructor
    (from_pretrained(mesh=), not patchable in the workers), ~10 s for it against ~35 s for k3-tiny."""
    spec = importlib.util.spec_from_file_location("ep_bench", os.path.join(ROOT, "benchmarks", "expert_parallel.py"))
    ep_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep_bench)
    out = tmp_path / "two_processes.json"
    argv = ["--cpu-smoke", "--dispatch-only", "--processes", "2", "--ep", "2", "--batches", "3", "--variants",
            "packed,a2a", "--step-mesh", "ep=2", "--step-variants", "packed", "--preset", "kimi-linear-tiny",
            "--repeats", "1", "--out", str(out)]
    assert ep_bench.main(argv) == 0
    result = json.load(open(out))
    assert result["meta"]["processes"] == 2 and "--process-id" not in result["meta"]["command"]
    rows = result["moe_layer"]
    assert [r["variant"] for r in rows] == ["packed", "a2a"]
    assert all(r["rel_err_vs_single_device"] == 0.0 and r["dispatch_combine_us"] > 0 for r in rows), rows
    steps = result["rows"]
    assert [(r["ep_variant"], r["batch"], r["status"]) for r in steps] == [("packed", 3, "ok")], steps


def test_step_mesh_picks_the_preset_by_device_count(tmp_path):
    """ep=2 and tp=2 (vLLM's layout: dense TP, experts split over the same GPUs) both mean 2 GPUs."""
    spec = importlib.util.spec_from_file_location("ep_bench", os.path.join(ROOT, "benchmarks", "expert_parallel.py"))
    ep_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep_bench)

    def args(mesh):
        return ep_bench.parse_args(["--ep", "", "--step-mesh", mesh, "--out", str(tmp_path / "r.json")])

    assert {args(m).preset for m in ("ep=2", "tp=2")} == {"k3-h200x2"}
    assert args("ep=4,tp=2").preset == "k3-h200x8"
