"""remat_kit.fit over budgets from full's need to past the plain need: compiles, seconds against one compile, and
the predicted against the compiled need of each answer.

For each model (a preset of the built-in Transformer, an unedited Linen model and an unedited NNX model of
tests/unedited_models.py, and ``tunix``: tunix's Llama 3 from the registry, unedited, a small config of its own
config class, where ``google-tunix`` is installed) the needs of the model as given (``none``) and of ``full``
(scanned) are compiled once, outside any fit. Then, for ``--budgets`` budgets spread evenly from full's need to
just past the plain need (the margin added), a fresh ``remat_kit.fit`` chooses; beside it, one compile of the plain
training step (gradient + clipped AdamW, ``jax.jit(...).lower().compile()`` with XLA's defaults, as the user's
first step pays it) is timed in the same process just before, so the ratio compares like with like on a loaded
machine. Usage::

    python benchmarks/fit.py --models tiny,linen,nnx,small --out benchmarks/results/fit.txt
    python benchmarks/fit.py --models tunix   # in an environment with google-tunix (Python >= 3.12)
"""

from __future__ import annotations

import argparse
import os
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
from tests.unedited_models import InlineModel, NnxModel


def tunix_llama3():
    """tunix's Llama 3 (registry package ``google-tunix``, unedited), a small config from its own config class."""
    import dataclasses

    import tunix.models.llama3.model as llama

    config = dataclasses.replace(
        llama.ModelConfig.llama3p2_1b(),
        num_layers=6,
        vocab_size=256,
        embed_dim=64,
        hidden_dim=256,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
    )
    model = llama.Llama3(config, rngs=nnx.Rngs(0))
    batch, seq = 8, 128
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    positions = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, seq, seq), jnp.bool_)

    def loss(m, tokens, positions, mask):
        logits, _ = m(tokens, positions, None, mask)
        picked = jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)

    what = f"tunix Llama3 (unedited, registry), {config.num_layers} layers, d={config.embed_dim}, {batch}x{seq}"
    return model, loss, (tokens, positions, mask), what


def setup(name: str):
    """``(model, loss_fn, example args, description)``."""
    if name == "tunix":
        return tunix_llama3()
    if name == "nnx":
        model = NnxModel(6, 64, alternate=False, rngs=nnx.Rngs(0))
        x = jax.ShapeDtypeStruct((8, 128, 64), jnp.float32)
        return model, (lambda m, x: jnp.mean(m(x, True) ** 2)), (x,), "unedited NNX NnxModel, 6 layers, d=64, 8x128"
    if name == "linen":
        model = InlineModel(num_layers=6, features=64, alternate=False)
        x = jax.ShapeDtypeStruct((8, 128, 64), jnp.float32)
        variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape)))
        loss = lambda m, v, x: jnp.mean(m.apply(v, x) ** 2)
        return model, loss, (variables, x), "unedited Linen InlineModel, 6 layers, d=64, 8x128"
    cfg = TransformerConfig.preset(name)
    batch, seq = PRESET_SHAPES[name]
    model = Transformer(cfg)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((batch, seq), jnp.int32))["params"])
    return model, (lambda m, p, t: lm_loss(m, p, t)), (params, tokens), f"preset {name}, batch {batch} x seq {seq}"


def plain_loss(model, loss_fn, args):
    """``(loss(params, *batch), params, batch)`` of the model as given."""
    if isinstance(model, nnx.Module):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss = lambda p, *b: loss_fn(nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest)), *b)
        return loss, params, args
    return (lambda p, *b: loss_fn(model, p, *b)), args[0], args[1:]


def one_compile(model, loss_fn, args) -> float:
    """Seconds of one compile of the plain training step, XLA's defaults (a fresh jit: nothing cached)."""
    loss, params, batch = plain_loss(model, loss_fn, args)
    opt = get_optimizer("adamw")
    params, state = step_lib.abstract_state(params, opt)
    kwargs = step_lib.jit_kwargs(params, state, None, batch_args=len(batch))
    t = time.perf_counter()
    jax.jit(step_lib.make_step(loss, opt), **kwargs).lower(params, state, *batch).compile()
    return time.perf_counter() - t


def ends(model, loss_fn, args) -> dict[str, int]:
    """Compiled needs of the model as given (none) and of full, scanned where the model is not built-in."""
    loss, params, batch = plain_loss(model, loss_fn, args)
    if isinstance(model, Transformer):
        full = lambda p, b, s: ((lambda v, *a: loss_fn(model.clone(policy=p), v, *a)), args[0], args[1:])
    else:
        make = remat_kit.apply_factory(model, loss_fn, scan=True)
        full = lambda p, b, s: (make(p), params, batch)
    return {
        "none": StepPlanner(lambda p, b, s: (loss, params, batch)).memory(policies.none())[0],
        "full": StepPlanner(full).memory(policies.full())[0],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,linen,nnx,small")
    ap.add_argument("--budgets", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lines = [f"$ python benchmarks/fit.py {' '.join(argv if argv is not None else sys.argv[1:])}", ""]

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"jax {jax.__version__}, backend {jax.default_backend()}, margin {DEFAULT_MARGIN:.0%}; each fit is fresh")
    say(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    worst = [0, 0.0, 0.0]
    for name in a.models.split(","):
        model, loss_fn, args, what = setup(name)
        one_compile(model, loss_fn, args)  # warm JAX's own caches of the model's tracing
        e = ends(model, loss_fn, args)
        say(f"\n{what}: the model as given (none) needs {fmt_bytes(e['none'])}, full {fmt_bytes(e['full'])}")
        say(
            f"{'budget':>10} {'compiles':>8} {'fit s':>6} {'1 compile':>9} {'ratio':>6} {'predicted':>10} "
            f"{'compiled':>10} {'error':>6}  plan"
        )
        for i in range(a.budgets):
            need = e["full"] + i * (e["none"] * 1.02 - e["full"]) / (a.budgets - 1)
            budget = int(need * (1 + DEFAULT_MARGIN)) + 1
            base = one_compile(model, loss_fn, args)
            t = time.perf_counter()
            try:
                r = remat_kit.fit(model, loss_fn, *args, budget=budget)
            except remat_kit.planning.fit.NothingFits as err:
                say(f"{fmt_bytes(budget):>10} nothing fits: {err}")
                continue
            took = time.perf_counter() - t
            pred = r.predicted_bytes
            error = "-" if pred is None else f"{(pred - r.need_bytes) / r.need_bytes:+.1%}"
            plan = r.policy if len(r.policy) <= 90 else r.policy[:89] + "…"
            say(
                f"{fmt_bytes(budget):>10} {r.compiles:>8} {took:>6.1f} {base:>9.2f} {took / base:>5.2f}x "
                f"{fmt_bytes(pred) if pred else '-':>10} {fmt_bytes(r.need_bytes):>10} {error:>6}  {plan}"
            )
            worst = [max(worst[0], r.compiles), max(worst[1], took / base), worst[2]]
            if pred is not None:
                worst[2] = max(worst[2], abs(pred - r.need_bytes) / r.need_bytes)
    say(f"\nworst: {worst[0]} compiles, {worst[1]:.2f}x one compile, prediction error {worst[2]:.1%}")
    say(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
