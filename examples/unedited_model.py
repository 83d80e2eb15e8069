"""Take a model you did not write, unedited: list its names, fit it to a memory budget, train a few steps.

The model below is written the way Flax's NNX examples write theirs: no remat hook and no
checkpoint_name tags. remat_kit.apply names what each block computes by module path, runs its
identical blocks as one scan (scan=True: on CPU a Python loop's recompute is removed by XLA), and
remat_kit.auto picks the least-recompute policy whose compiled step fits a budget halfway between full's
need and none's.

    python examples/unedited_model.py --steps 3
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import remat_kit


class FeedForward(nnx.Module):
    def __init__(self, d, f, *, rngs):
        init = nnx.initializers.lecun_normal()
        self.gating_einsum = nnx.Param(init(rngs.params(), (2, d, f)))  # [gate|up, d_model, d_ff]
        self.linear = nnx.Param(init(rngs.params(), (f, d)))

    def __call__(self, x):
        g = jnp.einsum("...d,cdf->c...f", x, self.gating_einsum[...])
        return jnp.einsum("...f,fd->...d", jax.nn.gelu(g[0]) * g[1], self.linear[...])


class Attention(nnx.Module):
    def __init__(self, d, *, rngs):
        self.q_einsum = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.k_einsum = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.attn_vec_einsum = nnx.Linear(d, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        q, k = self.q_einsum(x), self.k_einsum(x)  # [batch, seq, d]
        s = jnp.einsum("btd,bsd->bts", q, k) / q.shape[-1] ** 0.5
        causal = jnp.tril(jnp.ones(s.shape[-2:], bool))
        return self.attn_vec_einsum(jnp.einsum("bts,bsd->btd", jax.nn.softmax(jnp.where(causal, s, -1e9)), x))


class Block(nnx.Module):
    def __init__(self, d, *, rngs):
        self.pre_attention_norm = nnx.RMSNorm(d, rngs=rngs)
        self.attn = Attention(d, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.pre_ffw_norm = nnx.RMSNorm(d, rngs=rngs)
        self.mlp = FeedForward(d, 2 * d, rngs=rngs)

    def __call__(self, x, deterministic=False):
        x = x + self.dropout(self.attn(self.pre_attention_norm(x)), deterministic=deterministic)
        return x + self.mlp(self.pre_ffw_norm(x))


class Model(nnx.Module):
    def __init__(self, num_layers, d, *, rngs):
        self.layers = nnx.List([Block(d, rngs=rngs) for _ in range(num_layers)])
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)

    def __call__(self, x, deterministic=False):
        for layer in self.layers:
            x = layer(x, deterministic)
        return self.final_norm(x)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)

    model = Model(args.layers, args.width, rngs=nnx.Rngs(0))
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
