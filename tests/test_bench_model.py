"""`python -m k3jax.bench --model` (whole-model decode sweep) and `--report` on the tiny preset."""

import json

import pytest

from k3jax import bench

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.slow
def test_model_sweep_and_report(tmp_path):
    out = tmp_path / "model.json"
    rc = bench.main(["--model", "--preset", "k3-tiny", "--backends", "xla,pallas", "--granularities",
                     "xla-ops,layer-megakernel,step-megakernel", "--batches", "2", "--contexts", f"8,{2**40}",
                     "--steps", "2", "--warmup", "1", "--no-progress", "--out", str(out)])
    assert rc == 0
    res = json.load(open(out))
    assert res["meta"]["kind"] == "model" and res["meta"]["copy_bandwidth"] > 0
    ok = [r for r in res["rows"] if r["status"] == "ok"]
    assert len(ok) == 1
    r = ok[0]
    assert (r["backend"], r["granularity"], r["batch"], r["context"]) == ("xla", "xla-ops", 2, 8)
    assert r["latency_s_p90"] >= r["latency_s_median"] > 0 and r["step_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(2 / r["step_s"])
    assert r["roofline_fraction"] == pytest.approx(r["bytes_per_step"] / r["step_s"] / res["meta"]["copy_bandwidth"])
    assert r["speedup_vs_xla"] == pytest.approx(1.0)
    # Too long a context is skipped with its reason; granularities without kernels are listed.
    reasons = {(r["granularity"], r["status"]): r["reason"] for r in res["rows"] if r["status"] != "ok"}
    assert "max_position_embeddings" in reasons[("xla-ops", "skipped")]
    assert "no layer megakernel" in reasons[("layer-megakernel", "unavailable")]
    assert "no step megakernel" in reasons[("step-megakernel", "unavailable")]
    md = open(str(out)[:-5] + ".md").read()
    assert "xla / xla-ops" in md and "Not run:" in md
    assert (tmp_path / "model-k3-tiny.png").stat().st_size > 1000

    # The report merges files of every kind into a Markdown block and rewrites a doc's block.
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps({"preset": "k3-tiny", "backend": "pallas", "device": "cpu", "rows": [
        {"batch": 2, "step_ms": 4.0, "tokens_per_s": 500.0, "bytes_per_step": 1e6, "roofline_fraction": 0.1}]}))
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps({"meta": {"kind": "ops", "device": "cpu", "date": "d", "copy_bandwidth": 1e12},
                               "rows": [{"op": "linear", "case": "c", "batch": 1, "backend": b, "bytes": 1e6,
                                         "device_s": t, "tb_per_s": 1e-6 / t, "frac_copy_bw": 0.5}
                                        for b, t in (("xla", 2e-6), ("pallas", 1e-6), ("torch", 0.5e-6))]}))
    newer = tmp_path / "ops_newer.json"   # a later run of the same device and case: its xla row wins
    newer.write_text(json.dumps({"meta": {"kind": "ops", "device": "cpu", "date": "e", "copy_bandwidth": 2e12},
                                 "rows": [{"op": "linear", "case": "c", "batch": 1, "backend": "xla", "bytes": 1e6,
                                           "device_s": 4e-6, "tb_per_s": 0.25, "frac_copy_bw": 0.25}]}))
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Results\n{bench.REPORT_BEGIN}\nold\n{bench.REPORT_END}\ntail\n")
    assert bench.main(["--report", str(out), str(out), str(legacy), str(ops), str(newer), "--update", str(doc),
                       "--plots", str(tmp_path / "img" / "r")]) == 0
    text = doc.read_text()
    assert "old" not in text and text.endswith("tail\n") and "pallas / per-op" in text
    assert text.count("| k3-tiny | cpu | ") == 1            # the same point given twice: one row
    # one ops table per device; speedup = the best k3jax kernel (not torch) vs the newest xla row
    assert text.count("### Per-op kernels") == 1 and "torch us" in text and "4.00x" in text
    assert "copy bandwidth 1.00-2.00 TB/s: each row's % against its own run's" in text
    assert "![r-k3-tiny.png](img/r-k3-tiny.png)" in text
    assert bench.main(["--report", str(tmp_path / "missing.json")]) == 2
    # Files none of which is a bench result (e.g. a profile) must not empty the block.
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"meta": {"kind": "profile"}, "rows": []}))
    before = doc.read_text()
    assert bench.main(["--report", str(profile), "--update", str(doc)]) == 2
    assert doc.read_text() == before


def test_failures_become_rows(monkeypatch, tmp_path):
    """A point that runs out of memory (or fails) is a row with its reason; the sweep goes on."""
    def boom(model, batch, context, **kw):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate" if batch == 1 else "bad")
    monkeypatch.setattr(bench, "time_decode_step", boom)
    res = bench.bench_model("k3-tiny", ["xla"], ["xla-ops"], [1, 2], [8], progress=False, log=lambda s: None)
    st = [(r["batch"], r["status"]) for r in res["rows"]]
    assert st == [(1, "skipped"), (2, "error")]
    assert res["rows"][0]["reason"].startswith("out of memory")
    # A model that cannot be built is one row per configuration, not a crash: an error for bad
    # input (the CLI's exit status 1), skipped when it is too big to hold.
    res = bench.bench_model("k3-tiny", ["xla"], ["xla-ops"], [1], [8], expert_formats=["fp8"],
                            progress=False, log=lambda s: None)
    assert res["rows"][0]["status"] == "error" and "model not built" in res["rows"][0]["reason"]
    res = bench.bench_model("k3-full", ["xla"], ["xla-ops"], [1], [8], progress=False, log=lambda s: None)
    assert res["rows"][0]["status"] == "skipped" and "needs ~" in res["rows"][0]["reason"]


def test_batch_major_order_and_time_budget(monkeypatch):
    """Every backend at a batch before the next batch; past the deadline, skipped rows (no crash, no
    silent gap); rows carry their fallbacks."""
    import time
    calls = []

    def fake(model, batch, context, **kw):
        calls.append((model.plan.describe()["linear"], batch))
        if len(calls) == 3:
            monkeypatch.setattr(time, "time", lambda: 1e12)        # the budget runs out here
        return {"compile_s": 0.0, "steps": 1, "latency_s_median": 1.0, "latency_s_p90": 1.0, "step_s": 1.0,
                "kernel_s": None, "top_kernels": []}
    monkeypatch.setattr(bench, "time_decode_step", fake)
    res = bench.bench_model("k3-tiny", ["xla", "pallas"], ["xla-ops", "per-op"], [1, 2, 4], [8],
                            deadline=1e11, progress=False, log=lambda s: None)
    assert calls == [("xla", 1), ("pallas", 1), ("xla", 2)]
    st = [(r["backend"], r["batch"], r["status"]) for r in res["rows"]]
    assert st == [("xla", 1, "ok"), ("pallas", 1, "ok"), ("xla", 2, "ok"), ("pallas", 2, "skipped"),
                  ("xla", 4, "skipped"), ("pallas", 4, "skipped")]
    assert res["rows"][-1]["reason"] == "time budget reached before this point"
    assert all(isinstance(r["fallbacks"], dict) for r in res["rows"] if r["status"] == "ok")


def test_granularity_plans():
    assert isinstance(bench.granularity_plan("xla", "per-op"), str)
    assert bench.granularity_plan("xla", "xla-ops").describe()["linear"] == "xla"
    plan = bench.granularity_plan("pallas", "per-op").describe()
    assert plan["linear"] == plan["attn_res_mix"] == "pallas"
    assert plan["gated_mlp"] == plan["attn_res_mix_norm"] == "xla"        # ops fused across boundaries: off
    # pallas_kernels.gated_mlp and attn_res_mix_norm make the fused granularity available.
    fused = bench.granularity_plan("pallas", "fused-sublayer").describe()
    assert fused["gated_mlp"] == fused["attn_res_mix_norm"] == "pallas"
    assert bench.sweep_configs(["xla", "cute"], ["xla-ops", "per-op"]) == [("xla", "xla-ops"), ("cute", "per-op")]
    assert bench.sweep_configs(["pallas", "xla"], ["xla-ops", "per-op"]) == [("pallas", "per-op"), ("xla", "xla-ops")]
    with pytest.raises(ValueError, match="unknown granularity"):
        bench.granularity_plan("xla", "warp")


def test_report_drops_failed_attempts_of_measured_points(tmp_path):
    """An error row and a later ok row of the same point: the table has the ok row and no 'Not run'
    line for it; a reason over several lines is cut to its first line."""
    head = {"preset": "p", "expert_format": "mxfp4", "mesh": None, "ep_variant": None, "backend": "pallas",
            "granularity": "per-op", "batch": 8, "context": 1024}
    ok = {**head, "status": "ok", "step_s": 0.01, "tokens_per_s": 800.0, "bytes_per_step": 1e9,
          "roofline_fraction": 0.5, "latency_s_median": 0.011, "latency_s_p90": 0.012}
    files = []
    for i, rows in enumerate(([{**head, "status": "error", "reason": "ValueError: bad\nsecond line"},
                               {**head, "batch": 1, "status": "error", "reason": "ValueError: x\ny"}], [ok])):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps({"meta": {"kind": "model", "device": "d", "date": f"2026-11-30 0{i}"},
                                    "rows": rows}))
        files.append(str(path))
    merged, _ = bench.load_results(files, log=lambda s: None)
    assert sorted((r["batch"], r["status"]) for r in merged["rows"]) == [(1, "error"), (8, "ok")]
    table = bench.model_table(merged["rows"])
    assert "ValueError: x" in table and "second line" not in table and "\ny" not in table


def test_ops_table_marks_wrong_outputs_and_reference_runs():
    """A timing whose outputs failed the reference check is marked "wrong" with its error and
    tolerance; a backend whose reference ran shows "ref"; neither enters the speedup."""
    row = {"op": "o", "batch": 1, "bytes": 1e6, "tb_per_s": 1.0, "frac_copy_bw": 0.5, "fallbacks": {}}
    rows = [{**row, "case": "a", "backend": "xla", "device_s": 4e-6, "correct": True},
            {**row, "case": "a", "backend": "pallas", "device_s": 1e-6, "correct": False, "error": 0.5,
             "tolerance": 2 ** -6},
            {**row, "case": "a", "backend": "cute", "device_s": 2e-6, "correct": True},
            {**row, "case": "b", "backend": "xla", "device_s": 4e-6, "correct": True},
            {**row, "case": "b", "backend": "pallas", "device_s": 1e-6, "correct": True, "fallbacks": {"o/pallas": 1}}]
    lines = bench.summary_table({"rows": rows}).splitlines()
    assert lines[2] == "| o | a | 1 | 1.0 | 4.0 (1.00, 50%) | 2.0 (1.00, 50%) | 1.0 (1.00, 50%) wrong: err 5.0e-01 > 1.6e-02 | 2.00x |"
    assert lines[3] == "| o | b | 1 | 1.0 | 4.0 (1.00, 50%) | - | ref | - |"


def test_model_sweep_ablation_rows(tmp_path):
    """--ablate OP=IMPL adds each configuration again with those ops replaced, labelled."""
    out = tmp_path / "model.json"
    assert bench.main(["--model", "--preset", "k3-tiny", "--backends", "xla", "--granularities", "xla-ops",
                       "--ablate", "attn_res_mix_norm=pallas", "--batches", "1", "--contexts", "8", "--steps", "1",
                       "--warmup", "0", "--no-progress", "--out", str(out)]) == 0
    rows = {r["granularity"]: r for r in json.load(open(out))["rows"]}
    assert set(rows) == {"xla-ops", "xla-ops+attn_res_mix_norm=pallas"}
    assert rows["xla-ops"]["kernels"] == {}
    ablated = rows["xla-ops+attn_res_mix_norm=pallas"]
    assert ablated["status"] == "ok" and ablated["kernels"] == {"attn_res_mix_norm": "pallas"}
    assert "attn_res_mix_norm/pallas" in ablated["fallbacks"]        # D = 64: not a kernel shape
    for bad in ("attn_res_mix_norm", "warp=pallas", "linear=triton"):
        assert bench.main(["--model", "--preset", "k3-tiny", "--ablate", bad, "--out", str(out)]) == 2


def test_default_out_keeps_cpu_runs_out_of_the_published_results():
    """Without a GPU the default result path is under benchmarks/results/cpu/ (git-ignored), outside
    the `benchmarks/results/*.json` that `--report --update README.md` reads."""
    assert bench.default_out("ops-x.json") == "benchmarks/results/cpu/ops-x.json"
    assert bench.default_out("torch-ops-x.json", on_gpu=True) == "benchmarks/results/torch-ops-x.json"

