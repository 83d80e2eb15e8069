"""Your own Flax NNX block under a remat_kit policy: tag it, stack it, see what is kept, train it.

``MyBlock`` tags two of its values with ``remat_kit.names.tag``; ``selective(["ffn_up"])`` keeps
the tagged ``ffn_up`` for the backward pass and recomputes everything else (your own tag names need
no flag: the policy checks at trace time that the block emits them).
``remat_kit.nnx.stack`` creates the layers with their parameters stacked on axis 0 and runs them
under one scan (one compiled block whatever the depth), each layer under ``nnx.remat``. A misspelt
tag (``ffn_upp``) is an error naming ``ffn_up``, not a silent full recompute.

    python examples/nnx_module.py --steps 100
"""

import argparse

import jax.numpy as jnp
import optax
from flax import nnx

import remat_kit.nnx
from remat_kit import policies, units
from remat_kit.analysis import inspection
from remat_kit.model import loss
from remat_kit.names import tag
from remat_kit.train import data


class MyBlock(nnx.Module):
    """A pre-norm residual MLP block with a causal token-mixing (shift) step and dropout."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(2 * width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)  # its RNG stream is split per layer by the stack

    def __call__(self, x, *, train: bool = True):  # x: [batch, seq, width]
        h = self.norm(x)
        prev = jnp.pad(h, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # the previous position (causal)
        up = tag(self.up(jnp.concatenate([h, prev], -1)), "ffn_up")  # costly: keep
        act = tag(nnx.gelu(up), "ffn_act")  # cheap: recompute
        return x + self.drop(self.down(act), deterministic=not train)


class ByteLM(nnx.Module):
    """Embedding -> ``depth`` stacked blocks under ``policy`` -> logits over the 256 bytes."""

    def __init__(self, width: int, depth: int, policy, rngs: nnx.Rngs):
        self.embed = nnx.Embed(data.BYTE_VOCAB, width, rngs=rngs)
        self.blocks = remat_kit.nnx.stack(lambda r: MyBlock(width, r), depth, policy, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, data.BYTE_VOCAB, rngs=rngs)

    def __call__(self, tokens, *, train: bool = True):  # tokens: [batch, seq]
        return self.head(self.norm(self.blocks(self.embed(tokens), train=train)))


def lm_loss(model: ByteLM, tokens):
    targets, mask = loss.shift_targets(tokens)
    return loss.cross_entropy(model(tokens), targets, mask)


def kept_for_backward(model: ByteLM, tokens) -> tuple[inspection.Residual, ...]:
    """What the backward pass of ``lm_loss`` keeps besides the parameters (traced, nothing runs)."""
    graphdef, params, other = nnx.split(model, nnx.Param, ...)

    def pure(params, other, tokens):  # a pure function of the state, so JAX sees every input
        return lm_loss(nnx.merge(graphdef, params, other), tokens)

    return inspection.residuals(pure, params, other, tokens)  # the gradient w.r.t. params, as training takes it


def describe(r: inspection.Residual, args) -> str:
    """A readable label: stacked residuals of the block are recognised by their shape."""
    tokens = (args.batch_size, args.seq_len)
    if r.shape == (args.depth, *tokens, 4 * args.width):
        return "ffn_up of every layer (tagged, kept)"
    if r.shape == (args.depth, *tokens, args.width):
        return "every layer's input (the scan's checkpoints)"
    return r.source.split(" from ")[0] + " (outside the stack)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)

    policy = policies.selective(["ffn_up"])
    corpus = data.load_corpus(max_bytes=2**20)  # the Python standard library: real, local text
    batches = data.Batches(corpus.tokens, batch_size=args.batch_size, seq_len=args.seq_len, seed=0)
    first = jnp.asarray(batches.batch(0))

    print(f"{args.depth} x MyBlock under {policy}; what the backward pass keeps besides parameters:")
    for name in ("none", str(policy), "full"):
        kept = kept_for_backward(ByteLM(args.width, args.depth, name, nnx.Rngs(0)), first)
        print(f"  {name:32s} {units.fmt_bytes(sum(r.nbytes for r in kept)):>10s} in {len(kept)} arrays")
        if name == str(policy):
            for r in sorted(kept, key=lambda r: -r.nbytes)[:4]:
                print(f"    {list(r.shape)!s:18s} {r.dtype:8s} {units.fmt_bytes(r.nbytes):>9s}  {describe(r, args)}")

    model = ByteLM(args.width, args.depth, policy, nnx.Rngs(0))
    print(f"  parameters stacked on axis 0, e.g. up.kernel {model.blocks.layers.up.kernel.shape}")
    opt = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tokens):
        value, grads = nnx.value_and_grad(lm_loss)(model, tokens)
        opt.update(model, grads)
        return value

    for i in range(args.steps):
        value = step(model, opt, jnp.asarray(batches.batch(i)))
        if i == 0 or (i + 1) % max(1, args.steps // 5) == 0:
            print(f"step {i + 1:4d}  loss {float(value):.4f}")


if __name__ == "__main__":
    main()
