#!/usr/bin/env bash
# Issue 15: `remat-kit train --mesh data=2,fsdp=2` as 2 JAX processes x 2 CPU devices on localhost
# (coordinator on 127.0.0.1, cross-process collectives over gloo) against the same run in 1 process
# x 4 devices, per policy: per-step losses, final parameters (from each run's orbax checkpoint),
# throughput. Then kills process 1 of a checkpointing run mid-way, times how long process 0 takes to
# abort (JAX's heartbeat timeout, --distributed-timeout), restarts both with --resume and compares
# with the uninterrupted 2-process run bit for bit.
#
#   bash benchmarks/multiprocess.sh              # writes benchmarks/results/multiprocess.txt
#   POLICIES=full STEPS=4 bash benchmarks/multiprocess.sh
#
# About 3 minutes on 2 CPU cores. Figures are CPU-only: gloo over loopback TCP is much slower than
# in-process collectives, so throughput here says nothing about a real cluster's network.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
POLICIES="${POLICIES:-full selective offload}"
STEPS="${STEPS:-10}"
TIMEOUT_S="${TIMEOUT_S:-15}"
RESULT="${RESULT:-benchmarks/results/multiprocess.txt}"
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 -- "-$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
head -c 400000 "$("$PY" -c 'import json, os; print(os.path.join(os.path.dirname(json.__file__), "decoder.py"))')" \
  > "$WORK/corpus.txt"
for i in 1 2 3 4; do cat "$WORK/corpus.txt"; done > "$WORK/corpus4.txt"
ARGS=(--preset tiny --steps "$STEPS" --batch-size 8 --seq-len 64 --data "$WORK/corpus4.txt" --eval-every 0
      --no-progress --mesh data=2,fsdp=2)
RK=("$PY" -m remat_kit.cli train)

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# two NAME ARGS...: process 0 and 1 of one run, each in its own process group, lines prefixed [p0]/[p1]
# (remat-kit prefixes process 1's own lines; the prefix here also covers JAX's and gloo's). Sets RC0 RC1.
two() {
  local name=$1; shift
  local port; port=$(free_port)
  PIDS=()
  for id in 0 1; do
    setsid bash -c '"$@" 2>&1 | sed -u "/^\[p'"$id"'\] /!s/^/[p'"$id"'] /" > "'"$WORK/$name"'-p'"$id"'.log"' _ \
      "${RK[@]}" "${ARGS[@]}" "$@" --coordinator "127.0.0.1:$port" --num-processes 2 --process-id "$id" &
    PIDS+=($!)
  done
}

{
  echo "\$ bash benchmarks/multiprocess.sh  (POLICIES='$POLICIES' STEPS=$STEPS TIMEOUT_S=$TIMEOUT_S)"
  echo
  "$PY" -c 'import jax, os; print(f"jax {jax.__version__}, {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}'\
'  at the start: timings are only indicative); mesh data=2,fsdp=2; tiny preset, batch 8 x 64")'
  echo
  for policy in $POLICIES; do
    t0=$(date +%s.%N)
    "${RK[@]}" "${ARGS[@]}" --policy "$policy" --metrics "$WORK/one-$policy.jsonl" \
      --checkpoint-dir "$WORK/one-$policy" --checkpoint-every 1000 > "$WORK/one-$policy.log" 2>&1
    t1=$(date +%s.%N)
    two "two-$policy" --policy "$policy" --metrics "$WORK/two-$policy.jsonl" --checkpoint-dir "$WORK/two-$policy" \
      --checkpoint-every 1000
    wait "${PIDS[@]}"
    t2=$(date +%s.%N)
    grep -h "trained" "$WORK/two-$policy"-p*.log | sed 's/^/  /'
    "$PY" - "$WORK" "$policy" "$(echo "$t1 - $t0" | bc)" "$(echo "$t2 - $t1" | bc)" <<'EOF'
import json, sys
from pathlib import Path
import jax, numpy as np
from remat_kit import train
from remat_kit.train.checkpoint import Checkpoints
from remat_kit.model.transformer import TransformerConfig

work, policy, t_one, t_two = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
runs = {k: [json.loads(l) for l in (work / f"{k}-{policy}.jsonl").read_text().splitlines()] for k in ("one", "two")}
abstract = train.Trainer(train.TrainConfig(model=TransformerConfig.preset("tiny"), steps=2)).abstract_state()
params = {}
for k in runs:
    with Checkpoints(work / f"{k}-{policy}") as c:
        params[k] = jax.tree.leaves(c.restore_latest(abstract)[1]["params"])
rel = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))
          for a, b in zip(params["two"], params["one"]))
bitwise = all(np.array_equal(a, b) for a, b in zip(params["two"], params["one"]))
print(f"policy {policy}: step  loss 1 process x 4 dev   loss 2 processes x 2 dev   rel. diff")
for a, b in zip(runs["one"], runs["two"]):
    print(f"{'':16}{a['step']:4}  {a['loss']:22.9f}  {b['loss']:25.9f}   {abs(a['loss'] - b['loss']) / abs(a['loss']):.1e}")
tps = {k: np.median([r["tokens_per_s"] for r in v[1:]]) for k, v in runs.items()}
print(f"  final parameters: max rel. diff {rel:.1e} ({'bit for bit' if bitwise else 'float rounding: gloo adds in another order'})")
print(f"  median tokens/s after step 1: 1 process {tps['one']:,.0f}, 2 processes {tps['two']:,.0f}; "
      f"wall (start-up, compile, {len(runs['one'])} steps): {t_one:.1f} s vs {t_two:.1f} s")
print()
EOF
  done

  # Kill process 1 after step 3 of a checkpointing run; process 0 must abort within the heartbeat timeout.
  KILL=(--policy full --checkpoint-dir "$WORK/kill" --checkpoint-every 1 --metrics "$WORK/kill.jsonl"
        --distributed-timeout "$TIMEOUT_S")
  two kill "${KILL[@]}"
  steps_done() { local n; n=$(grep -c '"step"' "$WORK/kill.jsonl" 2>/dev/null) || true; echo "${n:-0}"; }
  deadline=$(( $(date +%s) + 300 ))
  while [ "$(steps_done)" -lt 3 ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.1; done
  kill -9 -- "-${PIDS[1]}"  # process 1's whole process group
  wait "${PIDS[1]}" 2>/dev/null || true  # (quietly: bash would report the kill)
  t_kill=$(date +%s.%N)
  echo "killed process 1 (SIGKILL) after step $(tail -1 "$WORK/kill.jsonl" | sed 's/.*"step": \([0-9]*\).*/\1/') of $STEPS; --distributed-timeout $TIMEOUT_S"
  wait "${PIDS[0]}" || true
  t_end=$(date +%s.%N)
  echo "process 0 stopped $(printf %.1f "$(echo "$t_end - $t_kill" | bc)") s later with:"
  grep -h -m1 -A1 "Terminating process" "$WORK/kill-p0.log" | cut -c1-240 | sed 's/^/  /'
  echo "checkpoints left: $(ls "$WORK/kill" | grep -v tmp | tr '\n' ' ')"
  two resume "${KILL[@]}" --resume
  wait "${PIDS[@]}"
  grep -h "resumed from" "$WORK"/resume-p*.log | sed 's/^/  /'
  "$PY" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
import jax, numpy as np
from remat_kit import train
from remat_kit.train.checkpoint import Checkpoints
from remat_kit.model.transformer import TransformerConfig

work = Path(sys.argv[1])
abstract = train.Trainer(train.TrainConfig(model=TransformerConfig.preset("tiny"), steps=2)).abstract_state()
leaves = {}
for k in ("kill", "two-full"):
    with Checkpoints(work / k) as c:
        leaves[k] = jax.tree.leaves(c.restore_latest(abstract)[1]["params"])
same = all(np.array_equal(a, b) for a, b in zip(leaves["kill"], leaves["two-full"]))
losses = {k: [json.loads(l)["loss"] for l in (work / f"{k}.jsonl").read_text().splitlines()] for k in ("kill", "two-full")}
print(f"killed + resumed vs uninterrupted 2-process run: losses {'identical' if losses['kill'] == losses['two-full'] else 'DIFFER'}, "
      f"final parameters {'bit for bit identical' if same else 'DIFFER'}")
EOF
} 2>&1 | tee "$RESULT"
