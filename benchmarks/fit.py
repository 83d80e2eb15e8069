"""remat_kit.fit at 8 budgets from full's need to none's: the plan, compiles, seconds, estimated vs measured step.

For each model (a preset of the built-in Transformer, or the unedited NNX model of tests/unedited_models.py) the
needs of ``none`` and ``full`` are compiled once; then for 8 budgets spread evenly from full's need to none's
(the margin added) a fresh ``remat_kit.fit`` chooses (its compiles and wall time are its own: nothing memoized is
shared), and the chosen plan's real step (gradient + clipped AdamW, CPU) is timed: median of ``--runs`` after a
warm-up. Usage::

    python benchmarks/fit.py --models tiny,small,unedited --out benchmarks/results/fit.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests/unedited_models.py

import remat_kit
from remat_kit import policies
from remat_kit.model.loss import lm_loss
from remat_kit.model.transformer import PRESET_SHAPES, Transformer, TransformerConfig
from remat_kit.planning.planner import DEFAULT_MARGIN, StepPlanner, get_optimizer
from remat_kit.step import update as step_lib
from remat_kit.units import fmt_bytes
from tests.unedited_models import NnxModel


def setup(name: str):
    """``(model, loss_fn, real example args, description)``."""
    if name == "unedited":
        model = NnxModel(4, 64, alternate=False, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (8, 128, 64))
        return model, (lambda m, x: jnp.mean(m(x, True) ** 2)), (x,), "unedited NnxModel, 4 layers, d=64, x 8x128x64"
    cfg = TransformerConfig.preset(name)
    batch, seq = PRESET_SHAPES[name]
    model = Transformer(cfg)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size)
    params = model.init(jax.random.key(0), tokens)["params"]
    return model, (lambda m, p, t: lm_loss(m, p, t)), (params, tokens), f"preset {name}, batch {batch} x seq {seq}"


def loss_of(model, loss_fn):
    """``(loss(params, *batch), params)`` of a model (NNX: its Param state; Linen: the first argument)."""
    if isinstance(model, nnx.Module):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return (lambda p, *b: loss_fn(nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest)), *b)), params
    return (lambda p, *b: loss_fn(model, p, *b)), None


def measure(model, loss_fn, args, runs: int) -> float:
    """Median seconds of the real step (gradient + clipped AdamW), after one warm-up."""
    loss, params = loss_of(model, loss_fn)
    batch = args if params is not None else args[1:]
    params = params if params is not None else args[0]
    opt = get_optimizer("adamw")
    state = step_lib.init_optimizer(opt, params)
    step = jax.jit(step_lib.make_step(loss, opt))
    out = step(params, state, *batch)
    jax.block_until_ready(out)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(step(params, state, *batch))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def needs(model, loss_fn, args) -> dict[str, int]:
    """Compiled needs of none and full (the ends of the budget range), on one planner."""
    if isinstance(model, Transformer):
        build = lambda p, b, s: ((lambda v, *a: loss_fn(model.clone(policy=p), v, *a)), args[0], args[1:])
    else:
        make = remat_kit.apply_factory(model, loss_fn, scan=True)
        build = lambda p, b, s: (make(p), nnx.state(model, nnx.Param), args)
    planner = StepPlanner(build)
    return {spec: planner.memory(policies.parse(spec))[0] for spec in ("none", "full")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small,unedited")
    ap.add_argument("--budgets", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lines = [f"$ python benchmarks/fit.py {' '.join(argv if argv is not None else sys.argv[1:])}", ""]

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"jax {jax.__version__}, backend {jax.default_backend()}, margin {DEFAULT_MARGIN:.0%}; each fit is fresh")
    for name in a.models.split(","):
        model, loss_fn, args, what = setup(name)
        ends = needs(model, loss_fn, args)
        say(f"\n{what}: full needs {fmt_bytes(ends['full'])}, none {fmt_bytes(ends['none'])}")
        say(f"{'budget':>10} {'plan':<64} {'need':>9} {'compiles':>8} {'fit s':>6} {'est. step':>10} {'measured':>10}")
        timed: dict[str, float] = {}
        for i in range(a.budgets):
            need = ends["full"] + i * (ends["none"] - ends["full"]) / (a.budgets - 1)
            budget = int(need * (1 + DEFAULT_MARGIN)) + 1
            t = time.perf_counter()
            r = remat_kit.fit(model, loss_fn, *args, budget=budget)
            took = time.perf_counter() - t
            if r.policy not in timed:
                timed[r.policy] = measure(r.model, loss_fn, args, a.runs)
            plan = r.policy if len(r.policy) <= 64 else r.policy[:63] + "…"
            say(
                f"{fmt_bytes(budget):>10} {plan:<64} {fmt_bytes(r.need_bytes):>9} {r.choice.compiles:>8} "
                f"{took:>6.1f} {r.est_step_time_s * 1e3:>8.2f}ms {timed[r.policy] * 1e3:>8.2f}ms"
            )
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
