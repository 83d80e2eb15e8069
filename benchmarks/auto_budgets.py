"""remat_kit.auto on the 2b preset under 24, 40 and 80 GB against an exhaustive search: same answer, fewer compiles.

For each budget a fresh :class:`remat_kit.planning.builtin.Planner` runs the search (trace every candidate, compile
in order of recompute until the cheapest fitting group), timed; the exhaustive search compiles every
candidate once (needs do not depend on the budget) and picks the least-recompute fitting one. The two
answers must agree. Usage::

    python benchmarks/auto_budgets.py --preset 2b --batch 2 --seq 1024 --budgets 24GB,40GB,80GB
"""

from __future__ import annotations

import argparse
import json
import time

from remat_kit.model.transformer import PRESET_SHAPES, TransformerConfig
from remat_kit.planning import budget as auto
from remat_kit.planning import builtin, fit
from remat_kit.planning import planner as planner_lib
from remat_kit.units import fmt_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="2b")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--budgets", default="24GB,40GB,80GB")
    ap.add_argument("--loss-chunks", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = TransformerConfig.preset(args.preset)
    batch = args.batch or PRESET_SHAPES[args.preset][0]
    seq = args.seq or PRESET_SHAPES[args.preset][1]
    budgets = [auto.parse_bytes(b) for b in args.budgets.split(",")]

    start = time.perf_counter()
    every = builtin.Planner(cfg, loss_chunks=args.loss_chunks)
    reference = [fit.auto(cfg, batch=batch, seq=seq, budget_bytes=b, planner=every, exhaustive=True) for b in budgets]
    exhaustive_s = time.perf_counter() - start
    print(
        f"preset {args.preset}, batch {batch} x seq {seq}, loss chunks {args.loss_chunks}, AdamW, margin "
        f"{planner_lib.DEFAULT_MARGIN:.0%}"
    )
    print(f"exhaustive: {every.compiles} compiles, {exhaustive_s:.1f} s for all budgets\n")
    print(f"{'candidate':58} {'recompute GFLOP':>16} {'device bytes':>14}")
    for c in reference[0].candidates:
        print(f"{c.policy:58} {c.recompute_flops / 1e9:16.1f} {fmt_bytes(c.need_bytes):>14}")

    records = []
    print(f"\n{'budget':>8} {'search':>24} {'exhaustive':>24} {'same':>5} {'search s':>9} {'compiles':>9}")
    for budget, ref in zip(budgets, reference, strict=True):
        t = time.perf_counter()
        fast = fit.auto(cfg, batch=batch, seq=seq, budget_bytes=budget, loss_chunks=args.loss_chunks)
        fast_s = time.perf_counter() - t
        same = fast.chosen == ref.chosen
        print(
            f"{fmt_bytes(budget):>8} {fast.chosen!s:>24} {ref.chosen!s:>24} {'yes' if same else 'NO':>5} "
            f"{fast_s:9.1f} {fast.compiled:9d}"
        )
        print(f"         {fast.reason}")
        records.append(
            {
                "budget_bytes": budget,
                "search": fast.to_dict(),
                "search_s": fast_s,
                "exhaustive_chosen": None if ref.chosen is None else str(ref.chosen),
                "same": same,
            }
        )
    print(f"\nexhaustive search, all budgets: {exhaustive_s:.1f} s ({every.compiles} compiles)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "batch": batch,
                    "seq": seq,
                    "exhaustive_s": exhaustive_s,
                    "exhaustive_compiles": every.compiles,
                    "budgets": records,
                },
                f,
                indent=1,
            )
    return 0 if all(r["same"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
