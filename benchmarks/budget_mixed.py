"""auto's answer for budgets between two presets' needs: the mix it picks against the best single preset.

For each preset the candidate policies are compiled once (one shared :class:`remat_kit.planning.builtin.Planner`);
the budgets are the midpoints between neighbours on their Pareto front (need × (1 + margin)), where a
single preset wastes the difference. At each budget ``auto`` (mixes on) answers; the table sets its
choice and measured recompute against the best single preset that fits (``auto(..., mixes=False)``,
free: same compiles). Then every_n's layer-stack saved bytes against the ideal ((n−1)·none + full)/n
(trace-only). Compile-only, on whatever backend runs it (CPU here). Usage::

    python benchmarks/budget_mixed.py --presets small,2b --out benchmarks/results/budget_mixed.txt
"""

from __future__ import annotations

import argparse
import io
import itertools
import shlex
import sys
import time

from remat_kit import policies as P
from remat_kit.model.transformer import PRESET_SHAPES, TransformerConfig
from remat_kit.planning import analysis, builtin
from remat_kit.planning import fit as F
from remat_kit.planning import planner as planner_lib
from remat_kit.planning.pareto import pareto_front
from remat_kit.units import fmt_bytes

#: The 2b pool: the policies on (or next to) its Pareto front in benchmarks/results/auto_budgets_2b.txt;
#: the whole default pool costs 19 compiles of a 2B step.
POOL_2B = (
    "none",
    "selective",
    "selective:mlp_gate,mlp_up",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "every_n:2",
    "full",
)


def _gflop(flops: int) -> str:
    return f"{flops / 1e9:.1f}"


def run_preset(name: str, out) -> None:
    cfg = TransformerConfig.preset(name)
    batch, seq = PRESET_SHAPES[name]
    pool = [P.parse(s) for s in POOL_2B] if name == "2b" else list(builtin.candidates_for(cfg, offload=False))
    planner = builtin.Planner(cfg)
    start = time.perf_counter()
    planner.precompile([(p, batch, seq) for p in pool])
    rows = {str(p): (planner.memory(p, batch, seq)[0], planner.flops(p, batch, seq)) for p in pool}
    base = rows["none"][1]
    specs = list(rows)
    front = sorted(
        (specs[i] for i in pareto_front([(rows[s][1], rows[s][0]) for s in specs])), key=lambda s: rows[s][1]
    )
    print(
        f"\n## preset {name}: {cfg.num_layers} layers, batch {batch} x seq {seq}, AdamW, margin "
        f"{planner_lib.DEFAULT_MARGIN:.0%}",
        file=out,
    )
    print(f"{len(pool)} candidates compiled in {time.perf_counter() - start:.1f} s; Pareto front:", file=out)
    for s in front:
        print(f"  {s:40} recompute {_gflop(rows[s][1] - base):>9} GFLOP   peak {fmt_bytes(rows[s][0]):>10}", file=out)
    print(
        f"\n{'budget':>10}  {'best single preset':40} {'GFLOP':>9}  {'auto (mixes on)':44} {'GFLOP':>9} "
        f"{'peak':>10} {'saved':>7} {'s':>6}",
        file=out,
    )
    for a, b in itertools.pairwise(front):
        budget = int((rows[a][0] + rows[b][0]) / 2 * (1 + planner_lib.DEFAULT_MARGIN))
        plain = F.auto(cfg, batch=batch, seq=seq, budget_bytes=budget, candidates=pool, planner=planner, mixes=False)
        t = time.perf_counter()
        r = F.auto(cfg, batch=batch, seq=seq, budget_bytes=budget, candidates=pool, planner=planner)
        took = time.perf_counter() - t
        table = {c.policy: c for c in r.candidates}
        single = table[str(plain.chosen)]
        win = table[str(r.chosen)]
        saved = 1 - win.recompute_flops / single.recompute_flops if single.recompute_flops else 0.0
        print(
            f"{fmt_bytes(budget):>10}  {single.policy:40} {_gflop(single.recompute_flops):>9}  {win.policy:44} "
            f"{_gflop(win.recompute_flops):>9} {fmt_bytes(win.need_bytes):>10} {saved:7.0%} {took:6.1f}",
            file=out,
        )
        tried = [c for c in r.candidates if "*" in c.policy]
        for c in tried:
            print(
                f"{'':12}compiled {c.policy:44} peak {fmt_bytes(c.need_bytes):>10} "
                f"{'fits' if c.fits else 'does not fit'}",
                file=out,
            )
    out.flush()


def every_n_bound(name: str, out) -> None:
    cfg = TransformerConfig.preset(name)
    batch, seq = PRESET_SHAPES[name]
    L = cfg.num_layers
    none, full = (analysis.layer_stack_bytes(cfg, s, batch, seq)[0] for s in ("none", "full"))
    print(
        f"\n## every_n saved bytes vs ((n-1)*none + full)/n, preset {name} ({L} layers), batch {batch} x seq {seq}",
        file=out,
    )
    print(f"none {fmt_bytes(none)}, full {fmt_bytes(full)} (layer stack, trace-only)", file=out)
    for n in (2, 3, 4, 8):
        if n > L:
            continue
        got = analysis.layer_stack_bytes(cfg, f"every_n:{n}", batch, seq)[0]
        remat = len(range(0, L, n))
        ideal = ((L - remat) * none + remat * full) / L
        rest = f", remainder group of {L % n}" if L % n else ""
        print(
            f"  every_n:{n}: {fmt_bytes(got):>10}  ideal {fmt_bytes(int(ideal)):>10}  ratio {got / ideal:.4f}"
            f"{rest}  {'<= 1.02 ok' if got <= 1.02 * ideal else '> 1.02 FAIL'}",
            file=out,
        )
    out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="small,2b")
    ap.add_argument("--out", default=None, help="write the report here too")
    ap.add_argument("--every-n-only", action="store_true", help="only the every_n bound sections (trace-only, fast)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    buf = io.StringIO()

    class Tee:
        def write(self, text):
            sys.stdout.write(text)
            buf.write(text)

        def flush(self):
            sys.stdout.flush()

    out = Tee()
    for name in args.presets.split(","):
        if not args.every_n_only:
            run_preset(name, out)
        every_n_bound(name, out)
    wall = time.perf_counter() - start
    if args.out:
        command = "python benchmarks/budget_mixed.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "w") as f:
            f.write(f"$ {command}\nwall time: {wall:.0f} s (compile-only, 2 shared CPU cores)\n{buf.getvalue()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
