"""A model remat_kit did not write, for the tests of inspect/compare/auto and ``plan --model``.

A Linen MLP-block stack under ``nn.scan``; ``factory(policy)`` returns ``(loss_fn, example_args)``
as ``remat-kit plan --model plan_model_factory:factory`` expects.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

LAYERS, BATCH, SEQ, D = 4, 8, 16, 32


class Block(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x, _):  # x: [batch, seq, d]
        h = jax.nn.gelu(nn.Dense(4 * self.d, use_bias=False, dtype=x.dtype, name="up")(x))
        return x + nn.Dense(self.d, use_bias=False, dtype=x.dtype, name="down")(h), None


class Net(nn.Module):
    policy: object
    layers: int
    d: int

    @nn.compact
    def __call__(self, x):
        block = self.policy(Block, prevent_cse=False)  # under a scan the recompute survives without it
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        x, _ = stack(self.d, name="blocks")(x, None)
        return jnp.mean(x.astype(jnp.float32) ** 2)


def make(policy, layers=LAYERS, batch=BATCH, seq=SEQ, d=D, dtype=jnp.float32):
    """``(loss_fn, (params, x))`` with abstract inputs: nothing is allocated, whatever the size."""
    net = Net(policy=policy, layers=layers, d=d)
    x = jax.ShapeDtypeStruct((batch, seq, d), dtype)
    params = jax.eval_shape(lambda k: net.init(k, jnp.zeros(x.shape, x.dtype))["params"], jax.random.key(0))
    return (lambda p, x: net.apply({"params": p}, x)), (params, x)


def factory(policy):
    return make(policy)


def not_a_pair(policy):
    return make(policy)[0]


NOT_CALLABLE = 3


def wrong_shape(policy):
    """Example inputs the loss cannot take: ``x``'s last axis is not the blocks' width."""
    loss_fn, (params, x) = make(policy)
    return loss_fn, (params, jax.ShapeDtypeStruct((BATCH, SEQ, D + 1), x.dtype))


def not_scalar(policy):
    """A loss that is not one number: the per-example losses."""
    loss_fn, args = make(policy)
    return (lambda p, x: jnp.full((BATCH,), loss_fn(p, x))), args


class OwnBug(RuntimeError):
    """The user's own error, raised by their factory: its traceback is theirs to read."""


def raises(policy):
    raise OwnBug(f"the user's own bug under {policy}")
