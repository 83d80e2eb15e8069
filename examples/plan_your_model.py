"""Plan your own model: inspect it, compare policies, and fit it to a memory budget, compile-only.

The model below is written here, not in remat_kit: a small pre-norm transformer-style stack of
Linen blocks under ``nn.scan``. remat_kit only needs ``make_loss(policy)``; nothing is allocated,
so the default size (a 1.2B-parameter stack at batch 8 × 2048 tokens) plans on a laptop.

    python examples/plan_your_model.py                  # the 1.2B stack, budget 80GB
    python examples/plan_your_model.py --small --budget 8MB     # none does not fit: auto picks dots
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp

import remat_kit
from remat_kit.units import fmt_bytes, parse_bytes


class Block(nn.Module):
    """Attention-free token mixing plus an MLP: enough structure to show what each policy keeps."""

    d: int

    @nn.compact
    def __call__(self, x, _):  # x: [batch, seq, d]
        h = nn.LayerNorm(dtype=x.dtype)(x)
        mix = nn.Dense(self.d, use_bias=False, dtype=x.dtype)(jnp.cumsum(h, axis=1) / x.shape[1])
        x = x + mix
        h = nn.LayerNorm(dtype=x.dtype)(x)
        h = jax.nn.gelu(nn.Dense(4 * self.d, use_bias=False, dtype=x.dtype)(h))
        return x + nn.Dense(self.d, use_bias=False, dtype=x.dtype)(h), None


class Stack(nn.Module):
    policy: remat_kit.Policy
    layers: int
    d: int

    @nn.compact
    def __call__(self, x):
        # A policy applied to a module class wraps it in nn.remat; inside a scan CSE need not be prevented.
        block = self.policy(Block, prevent_cse=False)
        scan = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        y, _ = scan(self.d, name="blocks")(x, None)  # named: the parameters are the same under every policy
        return jnp.mean(jnp.square(y.astype(jnp.float32) - x.astype(jnp.float32)))


def model(small: bool):
    """``(make_loss, params, x)``: the loss under a policy, and abstract inputs."""
    layers, d, batch, seq = (4, 64, 4, 64) if small else (32, 2048, 8, 2048)
    x = jax.ShapeDtypeStruct((batch, seq, d), jnp.bfloat16)

    def make_loss(policy):
        net = Stack(policy=remat_kit.parse(policy), layers=layers, d=d)
        return lambda params, x: net.apply({"params": params}, x)

    net = Stack(policy=remat_kit.parse("none"), layers=layers, d=d)
    params = jax.eval_shape(lambda k: net.init(k, jnp.zeros((1, 8, d), x.dtype))["params"], jax.random.key(0))
    return make_loss, params, x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny stack (seconds)")
    parser.add_argument("--budget", default="80GB", help="device memory budget (any unit)")
    args = parser.parse_args(argv)
    make_loss, params, x = model(args.small)
    count = sum(p.size for p in jax.tree.leaves(params))
    print(f"model: {count / 1e6:.1f} M parameters, input {x.shape} {x.dtype}\n")

    # 1. What does the backward pass keep under one policy?
    report = remat_kit.inspect(make_loss("full"), params, x)
    print("inspect, policy full:")
    print(report.table(top=4))

    # 2. Every policy side by side: saved bytes, the compiled peak and the recompute.
    comparison = remat_kit.compare(make_loss, ["none", "dots", "full"], params, x)
    print("\ncompare:")
    print(comparison.table())

    # 3. The least recompute whose whole training step (AdamW state included) fits the budget.
    result = remat_kit.auto(make_loss, params, x, budget_bytes=parse_bytes(args.budget))
    print(f"\nauto, budget {fmt_bytes(result.budget_bytes)}:")
    print("\n".join(result.table()))
    print(f"chosen: {result.chosen}")
    print(result.reason)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
