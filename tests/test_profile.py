"""`python -m k3jax.profile`: the HLO metadata parser on fixed text, the CLI on the tiny preset (CPU:
HLO inventory; and with CUPTI records faked, the per-kernel table), and its input errors."""

import json

import pytest

from k3jax import bench, profile

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# A GPU-like compiled step: a reduction fusion with old-style source metadata, a Mosaic GPU custom
# call whose kernel module (a quoted string) holds braces, quotes and a fake metadata attribute, a
# Mosaic GPU call known only by its op_name scope, a kCustom fusion wrapping a Mosaic call and a sort
# (each launched under the inner instruction's name), a cuBLAS call, a while loop whose body launches
# a fusion, and a fusion body and reducer (no kernels).
HLO = r'''HloModule jit__decode_step, is_scheduled=true, entry_computation_layout={(bf16[64,32]{1,0})->f32[1,64]{1,0}}

FileNames
1 "/repo/k3jax/layers.py"
2 "/repo/k3jax/ops.py"

FunctionNames
1 "Linear.__call__"
2 "linear"

FileLocations
1 {file_name_id=1 function_name_id=1 line=40 end_line=40 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=123 end_line=123 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}


%add_region (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a.1, %b.1)
}

%fused_computation.56 (param_0.1: bf16[64,32], param_1.2: bf16[1,32]) -> (f32[1,64], f32[1]) {
  %param_0.1 = bf16[64,32]{1,0} parameter(0)
  %param_1.2 = bf16[1,32]{1,0} parameter(1)
  %dot.1 = f32[1,64]{1,0} dot(%param_1.2, %param_0.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(_decode_step)/dot_general" stack_frame_id=2}
  %constant.1 = f32[] constant(0)
  %reduce.2 = f32[1]{0} reduce(%dot.1, %constant.1), dimensions={1}, to_apply=%add_region
  ROOT %tuple.3 = (f32[1,64]{1,0}, f32[1]{0}) tuple(%dot.1, %reduce.2)
}

%fused_slice_call (param_0.5: bf16[64,32]) -> (bf16[64], s32[64]) {
  %param_0.5 = bf16[64,32]{1,0} parameter(0)
  %slice.5 = bf16[64]{0} slice(%param_0.5), slice={[0:64], [0:1]}
  %custom-call.12 = bf16[64]{0} custom-call(%slice.5), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(_decode_step)/jit(run)/kda_decode_step/pallas_call" stack_frame_id=1}, backend_config={kernel_hash="\004", module="kda_decode_step_mosaic_gpu"}
  %iota.5 = s32[64]{0} iota(), iota_dimension=0
  %sort.155 = s32[64]{0} sort(%iota.5), dimensions={0}, to_apply=%add_region
  ROOT %tuple.5 = (bf16[64]{0}, s32[64]{0}) tuple(%custom-call.12, %sort.155)
}

%fused_add (param_0.9: s32[]) -> s32[] {
  %param_0.9 = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %add.9 = s32[] add(%param_0.9, %one)
}

%body.1 (loop.1: s32[]) -> s32[] {
  %loop.1 = s32[] parameter(0)
  ROOT %loop_add_fusion = s32[] fusion(%loop.1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(_decode_step)/while/body/add"}
}

%cond.1 (loop.2: s32[]) -> pred[] {
  %loop.2 = s32[] parameter(0)
  %limit = s32[] constant(4)
  ROOT %lt = pred[] compare(%loop.2, %limit), direction=LT
}

ENTRY %main.9 (p0: bf16[64,32], p1: bf16[1,32]) -> f32[1,64] {
  %p0 = bf16[64,32]{1,0} parameter(0), metadata={op_name="params"}
  %p1 = bf16[1,32]{1,0} parameter(1)
  %input_reduce_fusion.56 = (f32[1,64]{1,0}, f32[1]{0}) fusion(bf16[64,32]{1,0} %p0, /*index=1*/bf16[1,32]{1,0} %p1), kind=kInput, calls=%fused_computation.56, metadata={op_name="jit(_decode_step)/jit(main)/dot_general" source_file="/repo/k3jax/ops.py" source_line=123}
  %custom-call.7 = bf16[1,64]{1,0} custom-call(%p1, %p0), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(_decode_step)/pallas_call" stack_frame_id=2}, backend_config={kernel_hash="\001\002", module="ML\357R\000linear_gemv_mosaic_gpu\000{x} \"q\" metadata={op_name=\"fake\"}"}
  %custom-call.8 = bf16[1,8]{1,0} custom-call(%p1), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(_decode_step)/jit(run)/route_topk/pallas_call"}, backend_config={kernel_hash="\003"}
  %dynamic_slice_fusion = (bf16[64]{0}, s32[64]{0}) fusion(%p0), kind=kCustom, calls=%fused_slice_call
  %cublas-gemm.1 = (bf16[1,64]{1,0}, s8[4]{0}) custom-call(%p1, %p0), custom_call_target="__cublas$gemm", metadata={op_name="jit(_decode_step)/dot_general"}
  %zero = s32[] constant(0)
  %while.1 = s32[] while(%zero), condition=%cond.1, body=%body.1
  ROOT %gte = f32[1,64]{1,0} get-tuple-element(%input_reduce_fusion.56), index=0
}
'''


def test_parse_and_match_fixed_hlo():
    parsed = profile.parse_hlo(HLO)
    assert {r["computation"] for r in parsed["kernel_level"]} == {"main.9", "body.1", "cond.1"}
    inv = {r["name"]: r for r in profile.inventory(parsed)}   # schedule order: the loop body at its while
    assert list(inv) == ["input_reduce_fusion.56", "custom-call.7", "custom-call.8", "dynamic_slice_fusion",
                         "cublas-gemm.1", "loop_add_fusion"]
    fusion = inv["input_reduce_fusion.56"]
    assert fusion["op_name"] == "jit(_decode_step)/jit(main)/dot_general"
    assert fusion["frames"] == ["/repo/k3jax/ops.py:123"]
    assert (fusion["kind"], fusion["root"], fusion["contains"]) == ("kInput", "tuple(dot, reduce)", ["dot", "reduce"])
    assert fusion["operands"] == ["bf16[64,32]", "bf16[1,32]"] and fusion["shape"] == "f32[1,64], f32[1]"
    mosaic = inv["custom-call.7"]   # the quoted module's fake metadata and braces do not leak in
    assert mosaic["op_name"] == "jit(_decode_step)/pallas_call" and mosaic["target"] == "mosaic_gpu_v2"
    assert mosaic["frames"] == ["/repo/k3jax/ops.py:123 linear", "/repo/k3jax/layers.py:40 Linear.__call__"]
    assert mosaic["operands"] == ["bf16[1,32]", "bf16[64,32]"]    # operand shapes from their definitions

    def match(name):
        how, sites = profile.match_kernel(parsed, name)
        return how, [s["name"] for s in sites]
    assert match("input_reduce_fusion_56") == ("exact", ["input_reduce_fusion.56"])
    assert match("input_reduce_fusion_56_1") == ("prefix", ["input_reduce_fusion.56"])
    assert match("linear_gemv_mosaic_gpu_kernel") == ("mosaic", ["custom-call.7"])
    assert match("route_topk_mosaic_gpu") == ("mosaic", ["custom-call.8"])      # by its op_name scope
    assert match("nvjet_tst_64x8_64x16") == ("library", ["cublas-gemm.1"])
    assert match("loop_add_fusion") == ("exact", ["loop_add_fusion"])
    assert match("dot_1") == ("unmatched", [])      # inside a fusion body: no kernel of its own
    # A kCustom fusion launches its inner Mosaic call / sort, named after the inner instruction.
    assert match("kda_decode_step_mosaic_gpu_kernel") == ("mosaic", ["custom-call.12"])
    assert match("sort_155_1") == ("prefix", ["sort.155"])
    assert profile.match_kernel(parsed, "kda_decode_step_mosaic_gpu_kernel")[1][0]["frames"] == [
        "/repo/k3jax/layers.py:40 Linear.__call__"]


def test_cli_cpu_inventory_and_faked_cupti(tmp_path, monkeypatch, capsys):
    out = tmp_path / "p.json"
    args = ["--preset", "k3-tiny", "--backend", "xla", "--batch", "2", "--context", "8", "--steps", "2",
            "--warmup", "1", "--out", str(out)]
    assert profile.main(args) == 0
    res = json.load(open(out))
    m, st = res["meta"], res["step"]
    assert (m["kind"], m["backend"], m["granularity"], m["batch"], m["context"]) == ("profile", "xla", "xla-ops", 2, 8)
    assert st["step_s"] > 0 and st["kernel_s"] is None and res["kernels"] == [] and m["timer"] == "wall"
    fusions = [r for r in res["hlo"] if r["opcode"] == "fusion"]
    assert fusions and any(f["op_name"] and any("k3jax/ops.py" in fr for fr in f["frames"]) for f in fusions)
    md = open(str(out)[:-5] + ".md").read()
    assert "| instruction | opcode |" in md and md.strip() in capsys.readouterr().out

    # With CUPTI records (faked from the step's own HLO names), the per-kernel table and step totals.
    name = profile.kernel_key(fusions[0]["name"])

    def fake_records(launch, n):
        for i in range(n):
            launch(i)
        return [r for _ in range(n) for r in ((name, 30e-6), ("nvjet_tst_fake", 10e-6), (name, 20e-6))]
    monkeypatch.setattr(bench, "kernel_records", fake_records)
    assert profile.main(args) == 0
    res = json.load(open(out))
    st, (k0, k1) = res["step"], res["kernels"]
    assert st["kernel_s"] == pytest.approx(60e-6) and st["gap_s"] == pytest.approx(st["step_s"] - 60e-6)
    assert (st["launches"], st["kernel_names"]) == (3, 2) and len(res["sequence"]) == 3
    assert (k0["name"], k0["launches_per_step"], k0["match"]) == (name, 2, "exact")
    assert k0["us_per_step"] == pytest.approx(50) and k0["us_per_launch"] == pytest.approx(25)
    assert k0["share"] == pytest.approx(50e-6 / st["step_s"]) and k0["hlo"][0]["name"] == fusions[0]["name"]
    assert k1["match"] == "unmatched"      # no cuBLAS call in a CPU step
    md = open(str(out)[:-5] + ".md").read()
    assert "| kernel | launches/step |" in md and "| op | us/step |" in md
    ops = profile.by_op(res)
    assert sum(o["us_per_step"] for o in ops) == pytest.approx(60) and ops[0]["op"] != name   # named by source
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--preset", "k3-nope"], "neither a preset"),
    (["--backend", "triton"], "unknown backend"),
    (["--granularity", "warp"], "unknown granularity"),
    (["--backend", "xla", "--granularity", "per-op"], "xla backend runs XLA ops only"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--context", str(2**40)], "exceeds max_position_embeddings"),
    (["--ep-variant", "carrier-pigeon"], "unknown --ep-variant"),
])
def test_bad_input(args, message, capsys, tmp_path):
    assert profile.main(["--preset", "k3-tiny", "--out", str(tmp_path / "x.json"), *args]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("k3jax.profile: error:") and message in last
    assert not (tmp_path / "x.json").exists()
