#!/usr/bin/env bash
# The GPU evidence for the kernel paths: per-op validation at K3 shapes, per-op timings,
# whole-model backend parity, whole-step timings.
#
#   OUT=results_dir bash scripts/gpu_evidence.sh [PHASE ...]
#   phases: validate ops parity model large bisect | torch kimi contexts | tiles | ncu-mla ncu-moe | floors
#
# One 10-minute device call fits `validate bisect`, `parity model`, `validate ops` or
# `torch kimi`, `contexts`, `tiles`, `ncu-mla` or `ncu-moe floors` (the phase limits below add up to under 600 s). `tiles`: the
# MXFP4 expert kernels in row order and in tiles (expert_layout "rows" / "tiles") - their GPU tests (both
# orders: session 21 changed the decode factor of both), the MoE op in row vs tile order, and the step at BATCHES with --expert-formats mxfp4-rows,mxfp4-tiles. `torch` times the PyTorch
# reference (transformers' Kimi-Linear decode step, cuBLAS GEMV, grouped expert GEMM) on
# TORCH_PRESET (default kimi-linear-48b-h200), `kimi` times k3jax on that same preset, `contexts`
# times PRESET at batch 1 with 8k and 32k cached tokens, `large` at batch 128 and 256 (Pallas first). `bisect` runs the parity per op, to attribute a parity
# failure. Parity is judged against the router-ulp noise floor (k3jax.validate.router_nudged_plan).
# Each phase has a time limit and writes its JSON / log under $OUT even when the limit cuts it
# short (the tools save partial results); the model phases also pass bench's --budget-s, so they
# end on their own with the points left recorded as skipped. PRESET (default k3-h200), BATCHES (default 1,8) and
# GRANULARITIES (default xla-ops,per-op) select the model points; OPS (default: every op, e.g.
# OPS="moe_experts kda_decode") the ops of `validate` and `ops`; EXPERTS (e.g. mxfp4-rows) the
# routed-expert storage of `parity` and `model` (default: the preset's). `ncu-mla`: Nsight Compute
# (speed of light, compute / memory workload, occupancy, warp states, the SM-throughput breakdown,
# DRAM and L2 bytes) of the Pallas mla_decode attention kernel at a short and a long context (the
# report is the log; session 24: at ctx 32768 b8 the tensor pipe is the busiest unit, 74.5%); `ncu-moe` the
# same sections plus launch and instruction statistics of the Pallas and CuTe MXFP4 expert kernels at batch 1
# (experts in tiles). ncu locks the SM clock at its base (1.28 GHz); NCU_CLOCK=none profiles at the clocks
# the benchmarks run at. `floors` runs benchmarks/floors.py: the same bytes as the unmet targets moved without
# their math (KDA state in place by XLA and by kda_decode's TMA slabs, weight reads, the smallest kernel).
# Build the CuTe library first (python -m cute_bridge.build) and take
# cute_bridge/_build along, or the cute backend falls back to Pallas/XLA (and says so).
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}
OUT=${OUT:-gpu_evidence}
PRESET=${PRESET:-k3-h200}
EXPERTS=${EXPERTS:-}
BATCHES=${BATCHES:-1,8}
GRANULARITIES=${GRANULARITIES:-xla-ops,per-op}
TORCH_PRESET=${TORCH_PRESET:-kimi-linear-48b-h200}
OPS=${OPS:-}
op_flags=(); for op in $OPS; do op_flags+=(--op "$op"); done
ncu_clock=(); [ -n "${NCU_CLOCK:-}" ] && ncu_clock=(--clock-control "$NCU_CLOCK")
# The Nsight Compute sections both ncu phases collect (they profiled on the H200 in session 24).
ncu_sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
              --section Occupancy --section WarpStateStats)
mkdir -p "$OUT"
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(parity model)

run_phase() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "top kernels" "$OUT/$name.log" | grep -v "^\s*$" | tail -n 30 | cut -c1-240
  echo "== $name: exit $rc after $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo ' (time limit)')"
}

for phase in "${phases[@]}"; do
  case $phase in
    validate) run_phase validate 150 python -m k3jax.validate --sizes k3 --repeats 1 "${op_flags[@]}" --budget-s 110 \
                --out "$OUT/validate" ;;
    ops)      run_phase ops 120 python -m k3jax.bench --ops $OPS --batches "$BATCHES" --no-progress --out "$OUT/ops.json" ;;
    parity)   run_phase parity 210 python -m k3jax.validate --model --preset "$PRESET" --backends pallas,cute \
                --steps 64 ${EXPERTS:+--experts "$EXPERTS"} --out "$OUT/parity" ;;
    bisect)   run_phase bisect 400 python -m k3jax.validate --model --per-op --preset "$PRESET" --backends pallas \
                --steps 64 --out "$OUT/bisect" ;;
    model)    run_phase model 330 python -m k3jax.bench --model --preset "$PRESET" --batches "$BATCHES" \
                --contexts 1024 --backends xla,pallas,cute --granularities "$GRANULARITIES" --steps 16 \
                ${EXPERTS:+--expert-formats "$EXPERTS"} --budget-s 270 --no-progress --out "$OUT/model.json" ;;
    large)    run_phase large 330 python -m k3jax.bench --model --preset "$PRESET" --batches 128,256 \
                --contexts 1024 --backends pallas,xla --granularities xla-ops,per-op --steps 8 \
                --budget-s 270 --no-progress --out "$OUT/large.json" ;;
    torch)    run_phase torch-ops 60 python benchmarks/torch_reference.py --ops --batches "$BATCHES" \
                --out "$OUT/torch-ops.json"
              run_phase torch-model 180 python benchmarks/torch_reference.py --model --preset "$TORCH_PRESET" \
                --batches "$BATCHES" --contexts 1024 --settings compile+cudagraphs,eager --steps 16 \
                --out "$OUT/torch-model.json" ;;
    kimi)     run_phase kimi 110 python -m k3jax.bench --model --preset "$TORCH_PRESET" --batches "$BATCHES" \
                --contexts 1024 --backends xla,pallas --granularities xla-ops,per-op --steps 16 \
                --budget-s 80 --no-progress --out "$OUT/kimi.json" ;;
    contexts) run_phase contexts 200 python -m k3jax.bench --model --preset "$PRESET" --batches 1 \
                --contexts 8192,32768 --backends xla,pallas,cute --granularities xla-ops,per-op --steps 16 \
                --budget-s 170 --no-progress --out "$OUT/contexts.json" ;;
    tiles)    run_phase tiles-tests 180 env K3JAX_GPU_TESTS=1 python -m pytest -q -m gpu \
                -k "moe and not bf16 and not e896 and not b32 and not b64 and not b128 and not fallback" \
                tests/test_cute_kernels.py tests/test_pallas_moe_experts.py
              run_phase tiles-ops 120 python -m k3jax.bench --ops moe_experts --backends pallas,cute --batches 1,8 \
                --cases 'k3_e448_(tiles_)?b[18]$' --no-progress --out "$OUT/tiles-ops.json"
              run_phase tiles-model 280 python -m k3jax.bench --model --preset "$PRESET" --batches "$BATCHES" \
                --contexts 1024 --backends pallas,cute --granularities per-op --expert-formats mxfp4-rows,mxfp4-tiles \
                --steps 16 --budget-s 230 --no-progress --out "$OUT/tiles-model.json" ;;
    ncu-mla)  # ncu locks the SM clock at its base, 1.28 GHz, unless NCU_CLOCK=none.
              for case in ctx1024_b1 ctx32768_b8; do
                run_phase "ncu-mla-$case" 150 env XLA_PYTHON_CLIENT_PREALLOCATE=false \
                  ncu "${ncu_clock[@]}" "${ncu_sections[@]}" \
                  --metrics breakdown:sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_bytes.sum \
                  -k "regex:mla_attend" -c 1 python benchmarks/ncu_op.py --op mla_decode --case "$case" --impl pallas --calls 0
              done ;;
    ncu-moe)  # The MXFP4 expert kernels at batch 1, experts in tiles: Pallas (65% of the copy rate) vs CuTe (77%).
              for impl in pallas cute; do
                run_phase "ncu-moe-$impl" 150 env XLA_PYTHON_CLIENT_PREALLOCATE=false \
                  ncu "${ncu_clock[@]}" "${ncu_sections[@]}" --section LaunchStats --section InstructionStats \
                  -k "regex:gate_up|down" -c 2 python benchmarks/ncu_op.py --op moe_experts --case k3_e448_tiles_b1 \
                  --impl "$impl" --calls 0
              done ;;
    floors)   run_phase floors 150 python benchmarks/floors.py --preset "$PRESET" --out "$OUT/floors.json" ;;
    *) echo "unknown phase $phase (validate ops parity model large bisect torch kimi contexts tiles ncu-mla ncu-moe floors)"; exit 2 ;;
  esac
done

# The device tool returns at most 8 files from $OUT: past that, everything travels as one archive.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf gpu_evidence.tar.gz --remove-files -- *) && echo "results packed: $OUT/gpu_evidence.tar.gz"
fi
