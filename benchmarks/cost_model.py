"""The cost model against measured CPU step times, and the per-tensor planner against the best preset and mix.

Part 1 (``--rank``): on ``small`` at its default shape, every candidate preset's estimated step-time cost
(:mod:`remat_kit.planning.cost`, calibrated on this machine) against its measured CPU step time
(:func:`interleaved`: every step compiled in this process, then rounds of one step per policy in a random
order, the fastest run kept); Spearman's rank correlation, and the measurement's own split-half agreement.

Part 2 (``--budgets``): at 8 budgets from ``full``'s need to ``none``'s, over auto's whole default pool (offload
variants left out: they move nothing on CPU), the estimated cost of the best single preset
(``auto(mixes=False)``), the best mix (``auto``) and the per-tensor answer
(:func:`remat_kit.planning.tensors.per_tensor` as ``plan --per-tensor`` runs it: the same pool as its seeds, no
baseline), all compiled and fitting; ``vs best`` is the per-tensor answer's estimate against the better of the
other two, ``from`` where it came from (the search's own plan, a preset, auto's mix). For ``small``
(``--measure``) the measured step times of the answers. Usage::

    python benchmarks/cost_model.py --rank --presets small --out benchmarks/results/cost_model_small.txt
    python benchmarks/cost_model.py --budgets --measure --presets small --defaults \
        --out benchmarks/results/cost_model_small_budgets.txt
    python benchmarks/cost_model.py --budgets --presets 2b --defaults --max-compiles 4 \
        --out benchmarks/results/cost_model_2b.txt
"""

from __future__ import annotations

import argparse
import io
import shlex
import statistics
import sys
import time

from remat_kit import policies as P
from remat_kit.model.transformer import PRESET_SHAPES, Transformer, TransformerConfig
from remat_kit.planning import budget as A
from remat_kit.planning import builtin, cost, tensors
from remat_kit.planning import fit as F
from remat_kit.planning import planner as planner_lib
from remat_kit.units import fmt_bytes

#: A short pool (as benchmarks/budget_mixed.py) for quick runs (--short-pool): its best is not auto's real best.
POOL_2B = (
    "none",
    "selective",
    "selective:mlp_gate,mlp_up",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "every_n:2",
    "full",
)


def spearman(xs, ys) -> float:
    """Spearman's rank correlation, ties given their average rank."""

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den


def interleaved(cfg, batch, seq, specs, rounds, seed=0):
    """Every policy's step compiled once in this process, then ``rounds`` rounds of one step each, in a
    fresh random order per round: a drift of the machine's speed falls on all policies alike.

    Returns ``{spec: [seconds per round]}``. One training state runs through every policy's step (they
    share the parameter tree), so the state's memory is paid once.
    """
    import random

    import jax

    from remat_kit.planning import analysis
    from remat_kit.step import update as step_lib

    steps = {s: analysis.analyze_compiled(cfg, s, batch, seq)[1] for s in specs}
    model = Transformer(config=cfg, policy=P.none())
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, dtype=jax.numpy.int32)
    params = jax.jit(lambda k: model.init(k, tokens[:1])["params"])(jax.random.key(0))
    opt = jax.jit(lambda p: step_lib.init_optimizer(analysis.optimizer(1e-3), p))(params)
    for s in specs:  # warm-up: each step once
        params, opt, *_ = jax.block_until_ready(steps[s](params, opt, tokens))
    order, times = list(specs), {s: [] for s in specs}
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for s in order:
            t = time.perf_counter()
            params, opt, *_ = jax.block_until_ready(steps[s](params, opt, tokens))
            times[s].append(time.perf_counter() - t)
    return times


def rank_part(out, hw, rounds, preset="small", shape=None, short_pool=False):
    cfg = TransformerConfig.preset(preset)
    batch, seq = shape or PRESET_SHAPES[preset]
    planner = builtin.Planner(cfg)
    pool = [P.parse(s) for s in POOL_2B] if short_pool else list(builtin.candidates_for(cfg, offload=False))
    price = A.Pricer(planner, hw, batch, seq)
    est = {str(p): price.estimate(p) for p in pool}
    base_step = planner.work(P.none(), batch, seq).seconds(hw)
    t = time.perf_counter()
    runs = interleaved(cfg, batch, seq, list(est), rounds)
    # The fastest of a policy's runs: the machine's interruptions only ever add time.
    times = {s: min(v) for s, v in runs.items()}
    print(
        f"\n## cost model vs measured step time: {preset}, batch {batch} x seq {seq}, {rounds} rounds of one step "
        f"per policy, interleaved in a random order per round (the fastest run), measured in "
        f"{time.perf_counter() - t:.0f} s",
        file=out,
    )
    print(f"estimated none step (roofline of every op): {base_step * 1e3:.1f} ms", file=out)
    print(f"{'policy':64} {'est. cost':>10} {'est. step':>10} {'measured':>10} {'median':>10} {'GFLOP':>8}", file=out)
    specs = sorted(est, key=lambda s: est[s].rank)
    for s in specs:
        e = est[s]
        print(
            f"{s:64} {e.cost_s * 1e3:8.1f}ms {(base_step + e.cost_s) * 1e3:8.1f}ms {times[s] * 1e3:8.1f}ms "
            f"{statistics.median(runs[s]) * 1e3:8.1f}ms {e.recompute_flops / 1e9:8.2f}",
            file=out,
        )
    rho = spearman([est[s].cost_s for s in specs], [times[s] for s in specs])
    rho_flops = spearman([est[s].recompute_flops for s in specs], [times[s] for s in specs])
    halves = spearman([min(runs[s][0::2]) for s in specs], [min(runs[s][1::2]) for s in specs])
    print(
        f"Spearman(estimated cost, measured step time) over {len(specs)} presets: {rho:.3f} "
        f"({'meets' if rho >= 0.8 else 'misses'} >= 0.8); FLOPs-only ranking: {rho_flops:.3f}; the measurement "
        f"against itself (fastest of the odd rounds vs of the even rounds): {halves:.3f}",
        file=out,
    )
    out.flush()


def budgets_part(name, out, hw, rounds, max_compiles, short_pool):
    cfg = TransformerConfig.preset(name)
    batch, seq = PRESET_SHAPES[name]
    planner = builtin.Planner(cfg)
    pool = [P.parse(s) for s in POOL_2B] if short_pool else list(builtin.candidates_for(cfg, offload=False))
    t = time.perf_counter()
    full = planner.memory(P.full(), batch, seq)[0]
    none = planner.memory(P.none(), batch, seq)[0]
    m = planner_lib.DEFAULT_MARGIN
    budgets = [int((full + i / 7 * (none - full)) * (1 + m)) + 1 for i in range(8)]
    print(
        f"\n## budgets: {name}, {cfg.num_layers} layers, batch {batch} x seq {seq}, margin {m:.0%}; "
        f"full needs {fmt_bytes(full)}, none {fmt_bytes(none)}; pool: {len(pool)} presets "
        f"({'the short 2b pool' if short_pool else 'auto default, offload left out'}); {hw.describe()}",
        file=out,
    )
    print(
        f"{'budget':>10}  {'best preset':40} {'est.':>10}  {'best mix':44} {'est.':>10}  {'per-tensor':60} "
        f"{'est.':>10} {'peak':>10} {'s':>5} {'vs best':>8}  from",
        file=out,
    )
    answers = set()
    for b in budgets:
        plain = F.auto(
            cfg, batch=batch, seq=seq, budget_bytes=b, candidates=pool, planner=planner, mixes=False, hardware=hw
        )
        mixed = F.auto(cfg, batch=batch, seq=seq, budget_bytes=b, candidates=pool, planner=planner, hardware=hw)
        row = lambda r: next(c for c in r.candidates if c.policy == str(r.chosen))
        t0 = time.perf_counter()
        # As `plan --per-tensor` runs it: the same pool as its seeds, no baseline; `from` says where the answer
        # came from (per-tensor: the search's own plan; preset or mix: a seed, nothing cheaper found).
        q = tensors.per_tensor(
            cfg,
            batch=batch,
            seq=seq,
            budget_bytes=b,
            planner=planner,
            hardware=hw,
            pool=pool,
            max_compiles=max_compiles,
        )
        took = time.perf_counter() - t0
        best = min(row(plain).cost_s, row(mixed).cost_s)
        gain = "=" if q.cost_s == best else f"{(q.cost_s - best) / best:+.0%}" if best else "-"
        print(
            f"{fmt_bytes(b):>10}  {plain.chosen!s:40} {row(plain).cost_s * 1e3:8.2f}ms  {mixed.chosen!s:44} "
            f"{row(mixed).cost_s * 1e3:8.2f}ms  {q.chosen!s:60} "
            f"{(q.cost_s or 0) * 1e3:8.2f}ms {fmt_bytes(q.need_bytes or 0):>10} {took:5.0f} {gain:>8}  {q.source}",
            file=out,
        )
        out.flush()
        answers.update({str(plain.chosen), str(mixed.chosen), str(q.chosen)})
    print(f"({time.perf_counter() - t:.0f} s, {planner.compiles} compiles)", file=out)
    if rounds:
        t = time.perf_counter()
        times = {s: min(v) for s, v in interleaved(cfg, batch, seq, sorted(answers), rounds).items()}
        price = A.Pricer(planner, hw, batch, seq)
        print(
            f"\nmeasured step times of the answers ({rounds} interleaved rounds, the fastest run; "
            f"{time.perf_counter() - t:.0f} s):",
            file=out,
        )
        for s in sorted(answers, key=lambda s: price.estimate(P.parse(s)).rank):
            print(
                f"  {s:64} est. {price.estimate(P.parse(s)).cost_s * 1e3:8.2f}ms  measured {times[s] * 1e3:8.1f}ms",
                file=out,
            )
    out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="small")
    ap.add_argument("--rank", action="store_true")
    ap.add_argument("--budgets", action="store_true")
    ap.add_argument("--measure", action="store_true", help="measure the answers' step times (part 2)")
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds of one step per policy")
    ap.add_argument("--max-compiles", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--short-pool", action="store_true", help="the 7-policy short pool (a quick run, not auto's best)")
    ap.add_argument("--rank-preset", default="small", help="the preset part 1 ranks (default small)")
    ap.add_argument("--rank-shape", default=None, help="BATCHxSEQ for part 1 (default: the preset's)")
    ap.add_argument("--defaults", action="store_true", help="the backend's default figures, no calibration")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    buf = io.StringIO()

    class Tee:
        def write(self, text):
            sys.stdout.write(text)
            buf.write(text)

        def flush(self):
            sys.stdout.flush()
            if args.out:  # partial results survive a run cut short
                with open(args.out, "w") as f:
                    f.write(f"$ {command}\n(in progress)\n{buf.getvalue()}")

    command = "python benchmarks/cost_model.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    out = Tee()
    hw = cost.default_hardware() if args.defaults else cost.calibrate()
    print(hw.describe(), file=out)
    if args.rank:
        shape = tuple(int(v) for v in args.rank_shape.lower().split("x")) if args.rank_shape else None
        rank_part(out, hw, args.rounds, args.rank_preset, shape, args.short_pool)
    if args.budgets:
        for name in args.presets.split(","):
            budgets_part(name, out, hw, args.rounds if args.measure else 0, args.max_compiles, args.short_pool)
    wall = time.perf_counter() - start
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"$ {command}\nwall time: {wall:.0f} s (2 shared CPU cores)\n{buf.getvalue()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
