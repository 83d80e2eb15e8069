#!/usr/bin/env bash
# GPU check for issues 3 and 27 (one CUDA GPU, e.g. an H200; about 10 minutes).
#
# Runs `remat-kit bench` on the `small` preset and on a larger one (default: the 2B-class preset at
# batch 2 × 1,024, bf16) on the GPU and records, per policy, the device's peak bytes
# (memory_stats()["peak_bytes_in_use"], one fresh process per policy) beside the compile-only
# figures -- including `offload`, whose saving only a device with separate host memory shows.
#
#   bash benchmarks/gpu_check.sh                # results under $OUT if set, else benchmarks/results/gpu
#   PARTS=bench bash benchmarks/gpu_check.sh; PARTS=cost bash benchmarks/gpu_check.sh  # as two device calls
#   GPU_CHECK_ALLOW_CPU=1 SMALL_PRESET=tiny LARGE_PRESET=tiny bash benchmarks/gpu_check.sh  # logic smoke test
#
# Tests and CI never need a GPU; this script is the only GPU measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
# Each policy runs in its own process; without preallocation the allocator's peak is the step's own.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python}"
DEST="${OUT:-benchmarks/results/gpu}"
mkdir -p "$DEST"
POLICIES="${POLICIES:-none,full,every_n:2,selective,offload,sqrt_n}"
# Fewer on the large preset: each policy there pays a fresh process, a 2B-parameter init and a compile.
LARGE_POLICIES="${LARGE_POLICIES:-none,full,selective,offload}"
SMALL_PRESET="${SMALL_PRESET:-small}"
LARGE_PRESET="${LARGE_PRESET:-2b}"
LARGE_ARGS="${LARGE_ARGS:---batch 2 --seq 1024}"
# bench: the two bench runs (~10 min); cost: the cost model's ranking (~7 min). One device call each.
PARTS="${PARTS:-bench,cost}"
START=$(date +%s)

{
  echo "\$ bash benchmarks/gpu_check.sh  (POLICIES=$POLICIES LARGE_POLICIES=$LARGE_POLICIES SMALL_PRESET=$SMALL_PRESET LARGE_PRESET=$LARGE_PRESET LARGE_ARGS='$LARGE_ARGS')"
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not available"
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
} > "$DEST/gpu_env.txt" 2>&1
cat "$DEST/gpu_env.txt"

platform=$("$PY" -c "import jax; print(jax.devices()[0].platform)" 2>/dev/null)
if [ "$platform" != "gpu" ] && [ -z "${GPU_CHECK_ALLOW_CPU:-}" ]; then
  echo "gpu_check: no GPU (jax platform: $platform); set GPU_CHECK_ALLOW_CPU=1 to smoke-test on CPU" >&2
  exit 3
fi

# bench NAME PRESET POLICIES TIMEOUT_S EXTRA_ARGS...: one bench run, its command at the top of NAME.txt.
bench() {
  local name=$1 preset=$2 policies=$3 limit=$4; shift 4
  local cmd=("$PY" -m remat_kit.cli bench --preset "$preset" --policies "$policies" --steps 5 --warmup 1 "$@"
             --json "$DEST/$name.json" --markdown "$DEST/$name.md" --plot "$DEST/$name.png")
  echo "== $name (limit ${limit}s)" >&2
  { echo "\$ ${cmd[*]}"; echo; timeout "$limit" "${cmd[@]}"; } > "$DEST/$name.txt" || {
    echo "gpu_check: $name failed or ran past ${limit}s (exit $?); see $DEST/$name.txt" >&2
    return 1
  }
  cat "$DEST/$name.txt"
}

status=0
if [[ ",$PARTS," == *",bench,"* ]]; then
  bench gpu_bench_small "$SMALL_PRESET" "$POLICIES" "${SMALL_LIMIT:-240}" || status=1
  # shellcheck disable=SC2086  # LARGE_ARGS is a list of options
  bench gpu_bench_large "$LARGE_PRESET" "$LARGE_POLICIES" "${LARGE_LIMIT:-330}" --no-grad-check $LARGE_ARGS || status=1
fi
# Issue 27: the cost model's estimated recompute cost of the 2b pool's presets against their measured
# step times on the device (one process, the figures calibrated on it), Spearman at the end.
if [[ ",$PARTS," == *",cost,"* ]]; then
  echo "== gpu_cost_model (limit ${COST_LIMIT:-420}s)" >&2
  timeout "${COST_LIMIT:-420}" "$PY" benchmarks/cost_model.py --rank --short-pool --rank-preset "$LARGE_PRESET" \
    --rank-shape "${COST_SHAPE:-2x1024}" --rounds 6 --out "$DEST/gpu_cost_model.txt" >&2 || {
    echo "gpu_check: gpu_cost_model failed or ran past ${COST_LIMIT:-420}s; see $DEST/gpu_cost_model.txt" >&2
    status=1
  }
fi
echo "gpu_check: done in $(( $(date +%s) - START )) s, exit $status; results in $DEST" >&2
exit $status
