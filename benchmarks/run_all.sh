#!/usr/bin/env bash
# Regenerate the files under benchmarks/results/. Run from anywhere, on a QUIET machine (timings!).
#   bash benchmarks/run_all.sh            # every section
#   bash benchmarks/run_all.sh policies   # one section
# Each results file starts with the command that made it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
SECTIONS=("${@:-all}")

want() { [[ " ${SECTIONS[*]} " == *" all "* || " ${SECTIONS[*]} " == *" $1 "* ]]; }

# run_to FILE CMD...: write "$ CMD" then CMD's stdout to FILE (progress stays on the terminal).
run_to() {
  local file=$1; shift
  { echo "\$ $*"; echo; "$@"; } > "$file"
  echo "wrote $file" >&2
}

# ---- policies (issue 3): remat_kit.planning.analysis, remat-kit plan, remat-kit bench -------------------------
if want policies; then
  RK=("$PY" -m remat_kit.cli)
  # Compile-only: the seed's 2B-class model, every policy (bytes/FLOPs do not depend on load).
  run_to "$RESULTS/plan_2b.txt" "${RK[@]}" plan --preset 2b --batch 2 --seq 1024 --json "$RESULTS/plan_2b.json"
  # The same with XLA's materializing attention: shows the [b, h, s, s] probabilities Korthikanti counts apart.
  run_to "$RESULTS/plan_2b_xla_attention.txt" "${RK[@]}" plan --preset 2b --batch 2 --seq 1024 --attention xla \
    --json "$RESULTS/plan_2b_xla_attention.json"
  # Real steps, one subprocess per policy (peak RSS), on the small preset.
  run_to "$RESULTS/bench_small.txt" "${RK[@]}" bench --preset small \
    --policies none,full,every_n:2,selective,offload,sqrt_n --steps 5 --warmup 1 \
    --json "$RESULTS/bench_small.json" --markdown "$RESULTS/bench_small.md" --plot "$RESULTS/bench_small.png"
  # Issue 3's targets: compile-only ones, step-time ratios from the bench above, compile time vs depth.
  run_to "$RESULTS/targets_small.txt" "$PY" benchmarks/policy_targets.py \
    --bench-json "$RESULTS/bench_small.json" --out "$RESULTS/targets_small"
fi

# ---- other sections: add yours below as `if want NAME; then ... fi` ----------------------------------

# ---- peer (issue 6): remat_kit beside PyTorch + Transformers Llama, same config/batch/AdamW/threads -------
# Needs a SEPARATE interpreter with torch + transformers (never the project venv), e.g.
#   python3 -m venv .venv-peer && .venv-peer/bin/pip install torch==2.13.0 transformers
# and PEER_PYTHON pointing at it (default .venv-peer/bin/python). The remat_kit side runs under $PY.
# Full config (hidden 512, 8 layers, vocab 32k, batch 4 x 1024, float32), workers interleaved, remat_kit with the plain
# and the fused (--loss-chunks 4) loss: ~20 min on 2 cores. The step-time profiles follow (~10 min).
if want peer; then
  PEER_PY="${PEER_PYTHON:-.venv-peer/bin/python}"
  if "$PEER_PY" -c "import torch, transformers" 2>/dev/null; then
    run_to "$RESULTS/peer_hf.txt" "$PY" benchmarks/peer_hf.py --jax-python "$PY" --torch-python "$PEER_PY" \
      --interleave --steps 8 --loss-chunks 4 --json "$RESULTS/peer_hf.json"
    "$PY" benchmarks/profile_step.py --shape peer --policies none,full,every_n:2 --steps 1 --warmup 1 \
      --torch-python "$PEER_PY" --out "$RESULTS/profile_peer.md"
    "$PY" benchmarks/profile_step.py --torch-python "$PEER_PY" --out "$RESULTS/profile_small.md"
  else
    echo "peer: skipped, $PEER_PY cannot import torch and transformers (set PEER_PYTHON)" >&2
  fi
fi

# ---- budget (issue 5): remat_kit.auto on the 2B preset at 24/40/80 GB, against exhaustive search ----------
if want budget; then
  run_to "$RESULTS/auto_budgets_2b.txt" "$PY" benchmarks/auto_budgets.py --preset 2b --batch 2 --seq 1024 \
    --budgets 24GB,40GB,80GB --json "$RESULTS/auto_budgets_2b.json"
  # The CLI table on a CPU-sized model: every candidate, the choice, the limits that fit.
  run_to "$RESULTS/plan_budget_small.txt" "$PY" -m remat_kit.cli plan --preset small --budget 280MB \
    --json "$RESULTS/plan_budget_small.json" --plot "$RESULTS/plan_budget_small.png"
fi

# ---- mesh (issue 7): per-device bytes over simulated CPU meshes (compile-only) -------------------------------
if want mesh; then
  run_to "$RESULTS/mesh_scaling_tiny.txt" "$PY" benchmarks/mesh_scaling.py --preset tiny --policy full --devices 4
  run_to "$RESULTS/mesh_scaling_small.txt" "$PY" benchmarks/mesh_scaling.py --preset small --policy full --devices 4
fi
