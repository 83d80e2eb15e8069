"""Your own Flax block under a remat_kit policy: tag it, choose what to keep, stack it, train it.

The block tags two of its values with ``remat_kit.names.tag``; ``selective(["ffn_up"])`` keeps the
tagged ``ffn_up`` for the backward pass and recomputes everything else. Your own tag names need no
flag: when the stack is traced, remat_kit checks that the block really emits every tag the policy
names (a typo such as ``ffn_upp`` is an error suggesting ``ffn_up``). ``remat_kit.stack`` runs the
layers under one scan, so XLA compiles one block whatever the depth.

    python examples/custom_module.py --steps 100
"""

import argparse
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import remat_kit
from remat_kit.model import loss
from remat_kit.names import tag
from remat_kit.train import data


class MyBlock(nn.Module):
    """A pre-norm residual MLP block with a causal token-mixing (shift) step."""

    width: int

    @nn.compact
    def __call__(self, x):  # x: [batch, seq, width]
        h = nn.LayerNorm()(x)
        prev = jnp.pad(h, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # the previous position (causal)
        up = tag(nn.Dense(4 * self.width)(jnp.concatenate([h, prev], -1)), "ffn_up")  # costly: keep
        act = tag(nn.gelu(up), "ffn_act")  # cheap: recompute
        return x + nn.Dense(self.width)(act)


class ByteLM(nn.Module):
    """Embedding -> ``depth`` stacked blocks under ``policy`` -> logits over the 256 bytes."""

    width: int
    depth: int
    policy: remat_kit.Policy

    @nn.compact
    def __call__(self, tokens):  # tokens: [batch, seq]
        x = nn.Embed(data.BYTE_VOCAB, self.width)(tokens)
        x = remat_kit.stack(functools.partial(MyBlock, width=self.width), self.depth, self.policy)(x)
        return nn.Dense(data.BYTE_VOCAB)(nn.LayerNorm()(x))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args(argv)

    policy = remat_kit.policies.selective(["ffn_up"])
    model = ByteLM(width=args.width, depth=args.depth, policy=policy)
    corpus = data.load_corpus(max_bytes=2**20)  # the Python standard library: real, local text
    batches = data.Batches(corpus.tokens, batch_size=8, seq_len=64, seed=0)
    params = model.init(jax.random.key(0), jnp.asarray(batches.batch(0)))["params"]
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        def loss_fn(p):
            targets, mask = loss.shift_targets(tokens)
            return loss.cross_entropy(model.apply({"params": p}, tokens), targets, mask)

        value, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    print(f"{args.depth} x MyBlock under {policy}; params per layer stacked on axis 0:")
    print("  ", jax.tree.map(jnp.shape, params["Stack_0"]["layers"]["Dense_0"]))
    for i in range(args.steps):
        params, opt_state, value = step(params, opt_state, jnp.asarray(batches.batch(i)))
        if i == 0 or (i + 1) % max(1, args.steps // 5) == 0:
            print(f"step {i + 1:4d}  loss {float(value):.4f}")


if __name__ == "__main__":
    main()
