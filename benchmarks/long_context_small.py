"""The small preset on CPU: the longest sequence ``plan --max-seq`` says fits a budget, then a real step there.

``plan --max-seq`` (compile-only) names the longest sequence (a multiple of ``--seq-step``) whose step fits
``--budget`` with the 10 % margin; this script runs real AdamW steps at that length in a fresh process
(:func:`remat_kit.bench.run.run_bench`) and sets its peak RSS above the process's baseline beside the plan's
compiled need and that need plus the margin.

Usage::

    python benchmarks/long_context_small.py --budget 300MB > benchmarks/results/long_context_small.txt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from remat_kit.bench.run import run_bench
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning.builtin import Planner
from remat_kit.units import fmt_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="300MB")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--seq-tiles", default="auto")
    ap.add_argument("--seq-step", type=int, default=256)
    ap.add_argument("--limit", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        plan = [
            *(sys.executable, "-m", "remat_kit.cli", "plan", "--preset", "small", "--max-seq", str(args.limit)),
            *("--seq-step", str(args.seq_step), "--batch-size", str(args.batch), "--seq-len", str(args.seq_step)),
            *("--budget", args.budget, "--seq-tiles", args.seq_tiles, "--policies", args.policy),
            *("--json", f.name, "--no-progress"),
        ]
        print("$ " + " ".join(plan[2:]).replace("-m remat_kit.cli", "remat-kit"), flush=True)
        print(subprocess.run(plan, check=True, capture_output=True, text=True).stdout)
        with open(f.name) as g:
            report = json.load(g)
    edge = report["policies"][0]["edges"][0]
    seq, need, margin = edge["seq"], edge["need_bytes"], edge["margin"]
    tiles = args.seq_tiles if args.seq_tiles == "auto" else int(args.seq_tiles)
    config = TransformerConfig.preset("small", max_seq_len=args.limit, seq_tiles=tiles)
    print(f"real steps at the plan's longest sequence: batch {args.batch} x {seq:,}, {args.policy}, seq_tiles={tiles}")
    records = run_bench(
        config, args.batch, seq, [args.policy], steps=args.steps, warmup=1, grad_check=False, subprocesses=True
    )  # none runs too (every bench compares with it)
    record = next(r for r in records if r.policy == args.policy)
    state = Planner(config).state_bytes()  # parameters and AdamW state, from shapes
    used = record.peak_bytes - record.baseline_bytes + state  # the step's own bytes, the state put back
    print(
        f"plan: compiled need {fmt_bytes(need)} (the step compiled here: {fmt_bytes(record.xla_peak_bytes)}), with "
        f"the {margin:.0%} margin {fmt_bytes(need * (1 + margin))} (budget {fmt_bytes(edge['budget_bytes'])})"
    )
    print(
        f"measured: peak RSS {fmt_bytes(record.peak_bytes)}, baseline before the first step (runtime, compiled "
        f"code, parameters, optimizer state) {fmt_bytes(record.baseline_bytes)}; the step's peak above it plus the "
        f"state ({fmt_bytes(state)}) {fmt_bytes(used)} = {used / need:.2f}x the compiled need; within the need "
        f"plus the margin: {'yes' if used <= need * (1 + margin) else 'no'}; median step {record.step_time_s:.2f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
