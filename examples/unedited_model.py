"""Take a model you did not write, unedited: list its names, fit it to a memory budget, train a few steps.

The model (tests/unedited_models.py's NnxModel, written like Flax's NNX examples) has no remat hook and
no checkpoint_name tags. remat_kit.apply names what each block computes by module path, runs its
identical blocks as one scan (scan=True: on CPU a Python loop's recompute is removed by XLA), and
remat_kit.auto picks the least-recompute policy whose compiled step fits a budget halfway between full's
need and none's.

    python examples/unedited_model.py --steps 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests/unedited_models.py

import remat_kit
from tests.unedited_models import NnxModel


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)

    model = NnxModel(args.layers, args.width, alternate=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (args.batch_size, args.seq_len, args.width))
    print(remat_kit.names_of(model, x))

    def loss(m, x):
        return jnp.mean(m(x, True) ** 2)

    make_loss = remat_kit.apply_factory(model, loss, scan=True)
    params = nnx.state(model, nnx.Param)
    candidates = ["none", "selective:attn/q_einsum,attn/k_einsum,mlp/gating_einsum", "full"]
    every = remat_kit.auto(
        make_loss, params, x, budget_bytes=10**12, candidates=candidates, mixes=False, exhaustive=True
    )
    needs = {c.policy: c.need_bytes for c in every.candidates}
    budget = (needs["full"] + needs["none"]) // 2  # between full's need and none's
    result = remat_kit.auto(make_loss, params, x, budget_bytes=budget, candidates=candidates, mixes=False)
    print(f"needs: {', '.join(f'{p} {n}' for p, n in needs.items())}; budget {budget}")
    print(f"chosen: {result.chosen}")

    trained = remat_kit.apply(model, result.chosen, scan=True)
    opt = nnx.Optimizer(trained, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, x):
        value, grads = nnx.value_and_grad(loss)(m, x)
        opt.update(m, grads)
        return value

    for i in range(args.steps):
        print(f"step {i + 1} loss {float(step(trained, opt, x)):.5f}")


if __name__ == "__main__":
    main()
