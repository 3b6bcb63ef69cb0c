#!/usr/bin/env bash
# The 2x H200 expert-parallel evidence run in one device call (BENCHMARKS.md, docs/expert_parallel.md):
#   A. dispatch+combine per MoE layer, every variant, NCCL collectives (XLA's default);
#   B. the same for the all-gather / all-reduce variants with XLA's own peer-to-peer collective
#      kernels (--xla_gpu_experimental_use_collective_kernels; no NVLink multicast);
#   C. the k3-h200x2 decode step on ep=2 with the variant (and collectives) fastest at 1 token in A/B,
#      batch 1 then 8, each with the backends in STEP_BACKENDS (default xla,pallas: XLA ops, then
#      the Pallas per-op plan, whose moe_experts kernel runs inside the expert-parallel shard_map;
#      its rows list the kernels that fell back). The preset takes ~210 s to create, then ~25 s per
#      point (compile + steps): 4 points need BUDGET_S ~480.
#   D. (DEVICE_DISPATCH=1: D alone, then exit) the device-initiated dispatch ("device",
#      pallas_kernels.ep_dispatch) next to packed / allreduce, dispatch-only at 1, 8, 16, 64 tokens
#      (8 chained layers, then 32 to separate the per-call overhead), after its GPU tests; ~2-3 min.
#   P. (PER_GPU_PROCESSES=1: P alone, then exit) dispatch+combine per layer with one process per GPU
#      (--processes 2, jax.distributed), packed / allgather / allreduce at 1, 8, 16 tokens, fori and
#      unrolled: is the wall-over-GPU time of one process driving both GPUs gone? ~1-2 min. With
#      P_STEP=1 also the k3-h200x2 Pallas step at batch 1 and 8 that way (packed; ~5 min more).
# Writes $OUT/expert-parallel-h200x2.json (all rows) and per-phase logs; stops C in time for the merge.
#   OUT=/tmp/ep bash benchmarks/expert_parallel_h200x2.sh                    # A, B, C: BUDGET_S=540 by default
#   STEP_VARIANT=packed BUDGET_S=480 bash benchmarks/expert_parallel_h200x2.sh   # C alone, with that variant
#   STEP_VARIANT=packed STEP_BACKENDS=pallas bash benchmarks/expert_parallel_h200x2.sh
#   STEP_MESH=tp=2 (C and P_STEP): the step on vLLM's layout instead of ep=2 (dense TP, experts split)
# XLA aborts on XLA_FLAGS=" " (it takes it for a file name), hence the $(echo ...) below.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/ep}
BUDGET_S=${BUDGET_S:-540}
PY=${PY:-python3}
mkdir -p "$OUT"
END=$(( $(date +%s) + BUDGET_S ))
CK="--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE,ALL_GATHER"
BASE=${BASE_XLA_FLAGS:-}   # a CPU dry run: BASE_XLA_FLAGS=--xla_force_host_platform_device_count=2
LAYER=(benchmarks/expert_parallel.py --ep 2 --dispatch-only --batches 1,8,64 --layers 8 --repeats 5 --step-mesh '')

nvidia-smi topo -m 2>&1 | head -4 | tee "$OUT/topo.txt"
if [ -n "${PER_GPU_PROCESSES:-}" ]; then
    P=(benchmarks/expert_parallel.py --ep 2 --processes 2 --dispatch-only --repeats 5 --step-mesh= --top-kernels 4
       --batches 1,8,16 --variants packed,allgather,allreduce --layers 32)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout "${P_S:-90}" $PY "${P[@]}" --budget-s $(( ${P_S:-90} - 20 )) \
        --out "$OUT/layer_processes.json" 2>&1 | tee "$OUT/log_layer_processes.txt"
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout "${P_S:-90}" $PY "${P[@]}" --unroll --budget-s $(( ${P_S:-90} - 20 )) \
        --out "$OUT/layer_processes_unrolled.json" 2>&1 | tee "$OUT/log_layer_processes_unrolled.txt"
    if [ -n "${P_STEP:-}" ]; then
        timeout "${PS_S:-330}" $PY benchmarks/expert_parallel.py --ep '' --processes 2 --step-mesh "${STEP_MESH:-ep=2}" --batches 1,8 \
            --step-variants packed --step-backends pallas --step-steps 4 --budget-s $(( ${PS_S:-330} - 40 )) \
            --out "$OUT/step_processes.json" 2>&1 | tee "$OUT/log_step_processes.txt"
    fi
    exit 0
fi
if [ -n "${DEVICE_DISPATCH:-}" ]; then
    # The kernels against XLA's collectives first: a hang (a lost semaphore signal) stops here.
    K3JAX_GPU_TESTS=1 timeout "${T_S:-75}" $PY -m pytest -q -x -m gpu tests/test_ep_dispatch.py -k "exchange_on_gpus or reply_on_gpus" \
        2>&1 | tee "$OUT/log_gpu_tests.txt"
    [ "${PIPESTATUS[0]}" = 124 ] && { echo "exchange kernels hung: stopping"; exit 1; }
    D=(benchmarks/expert_parallel.py --ep 2 --dispatch-only --repeats 5 --step-mesh '' --top-kernels 4)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 XLA_FLAGS="$(echo $BASE)" timeout "${D_S:-120}" $PY "${D[@]}" \
        --batches 1,8,16,64 --variants device,packed,allreduce --layers 8 --budget-s $(( ${D_S:-120} - 25 )) \
        --out "$OUT/layer_device.json" 2>&1 | tee "$OUT/log_layer_device.txt"
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 XLA_FLAGS="$(echo $BASE)" timeout "${D32_S:-90}" $PY "${D[@]}" \
        --batches 1,8,16,64 --variants device,packed,allreduce --layers 32 --budget-s $(( ${D32_S:-90} - 20 )) \
        --out "$OUT/layer_device_l32.json" 2>&1 | tee "$OUT/log_layer_device_l32.txt"
    K3JAX_GPU_TESTS=1 timeout "${T_S:-75}" $PY -m pytest -q -x -m gpu tests/test_ep_dispatch.py -k variant_on_gpus \
        2>&1 | tee -a "$OUT/log_gpu_tests.txt"
    exit 0
fi
if [ -z "${STEP_VARIANT:-}" ]; then
XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 XLA_FLAGS="$(echo $BASE)" $PY "${LAYER[@]}" --budget-s "${A_S:-60}" \
    --out "$OUT/layer_nccl.json" 2>&1 | tee "$OUT/log_layer_nccl.txt"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 XLA_FLAGS="$(echo $BASE $CK)" $PY "${LAYER[@]}" --variants allgather,packed,allreduce \
    --budget-s "${B_S:-30}" --out "$OUT/layer_ck.json" 2>&1 | tee "$OUT/log_layer_ck.txt"
fi

# The fastest variant at 1 token; XLA's collective kernels only if they beat NCCL by > 25% (the
# whole step then runs under them: a bigger change than one layer).
read -r VARIANT FLAGS < <($PY - "$OUT" "$CK" <<'EOF'
import json, os, sys
out, ck = sys.argv[1], sys.argv[2]
best = {}
for name, flags in (("layer_nccl.json", ""), ("layer_ck.json", ck)):
    path = os.path.join(out, name)
    if os.path.exists(path):
        for r in json.load(open(path))["moe_layer"]:
            if r.get("batch") == 1 and "dispatch_combine_us" in r and r.get("rel_err_vs_single_device", 1) < 1e-2:
                best[flags] = min(best.get(flags, (float("inf"), "allgather")), (r["dispatch_combine_us"], r["variant"]))
nccl = best.get("", (float("inf"), "allgather"))
use_ck = ck in best and best[ck][0] < 0.75 * nccl[0]
print(best[ck][1] if use_ck else nccl[1], ck if use_ck else "-")
EOF
)
[ "$FLAGS" = "-" ] && FLAGS=""
[ -n "${STEP_VARIANT:-}" ] && VARIANT=$STEP_VARIANT FLAGS=${STEP_XLA_FLAGS:-}
LEFT=$(( END - $(date +%s) - 10 ))
echo "step phase: variant $VARIANT, backends ${STEP_BACKENDS:-xla,pallas}, XLA_FLAGS='$FLAGS', ${LEFT} s left"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 XLA_FLAGS="$(echo $BASE $FLAGS)" timeout "$LEFT" $PY benchmarks/expert_parallel.py --ep '' \
    --step-mesh "${STEP_MESH:-ep=2}" --batches 1,8 --step-variants "$VARIANT" --step-backends "${STEP_BACKENDS:-xla,pallas}" \
    --step-steps 4 --budget-s $(( LEFT - 60 )) \
    ${STEP_ARGS:-} --out "$OUT/step.json" 2>&1 | tee "$OUT/log_step.txt"

$PY - "$OUT" "$CK" "$FLAGS" <<'EOF'
import json, os, sys
out, ck, step_flags = sys.argv[1:4]
merged = {"meta": None, "moe_layer": [], "rows": [], "phases": {}}
for name, coll in (("layer_nccl.json", "nccl"), ("layer_ck.json", "xla-collective-kernels"),
                   ("step.json", "xla-collective-kernels" if step_flags else "nccl")):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        continue
    d = json.load(open(path))
    merged["phases"][name] = d["meta"]
    merged["meta"] = merged["meta"] or dict(d["meta"])
    merged["moe_layer"] += [{**r, "collectives": coll} for r in d.get("moe_layer", [])]
    merged["rows"] += [{**r, "collectives": coll} for r in d.get("rows", [])]
merged["meta"] = merged["meta"] or {}
merged["meta"]["note"] = f"merged phases; collective kernels = XLA_FLAGS={ck}"
json.dump(merged, open(os.path.join(out, "expert-parallel-h200x2.json"), "w"), indent=1)
print("merged:", len(merged["moe_layer"]), "layer rows,", len(merged["rows"]), "step rows")
EOF
