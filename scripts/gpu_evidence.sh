#!/usr/bin/env bash
# The GPU evidence for the kernel paths in one run (fits one 10-minute device call):
# per-op validation at K3 shapes, per-op timings, whole-model backend parity, whole-step timings.
#
#   OUT=results_dir bash scripts/gpu_evidence.sh [PHASE ...]    # phases: validate ops parity model bisect
#
# `bisect` (not in the default set) runs the parity per op, to attribute a parity failure, with
# the float32 noise floor when the float32 copy of the dense weights fits (~+24 GB for k3-h200).
# Each phase has a time limit and writes its JSON / log under $OUT even when the limit cuts it
# short (the tools save partial results). PRESET (default k3-h200) and BATCHES (default 1,8)
# select the model points. Build the CuTe library first (python -m cute_bridge.build) and take
# cute_bridge/_build along, or the cute backend falls back to Pallas/XLA (and says so).
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}
OUT=${OUT:-gpu_evidence}
PRESET=${PRESET:-k3-h200}
BATCHES=${BATCHES:-1,8}
mkdir -p "$OUT"
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(validate ops parity model)

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
    validate) run_phase validate 120 python -m k3jax.validate --sizes k3 --repeats 1 --out "$OUT/validate" ;;
    ops)      run_phase ops 120 python -m k3jax.bench --ops --batches "$BATCHES" --no-progress --out "$OUT/ops.json" ;;
    parity)   run_phase parity 150 python -m k3jax.validate --model --preset "$PRESET" --backends pallas,cute \
                --steps 64 --out "$OUT/parity" ;;
    bisect)   run_phase bisect 400 python -m k3jax.validate --model --per-op --float32-floor --preset "$PRESET" --backends pallas \
                --steps 64 --out "$OUT/bisect" ;;
    model)    run_phase model 180 python -m k3jax.bench --model --preset "$PRESET" --batches "$BATCHES" \
                --contexts 1024 --backends xla,pallas,cute --granularities xla-ops,per-op --steps 16 \
                --no-progress --out "$OUT/model.json" ;;
    *) echo "unknown phase $phase (validate ops parity model bisect)"; exit 2 ;;
  esac
done
