"""Models written the way gm.nn (Linen) and Flax's NNX examples write theirs, with no remat_kit in them.

Used by tests/test_unedited.py and benchmarks/unedited.py. Gemma-style:
RMSNorms named ``pre_attention_norm``/``pre_ffw_norm``, attention projections ``q_einsum``/``k_einsum``/
``attn_vec_einsum``, a FeedForward computing with its own ``gating_einsum``/``linear`` params, a
Python bool per layer (local/global attention), dropout, ``sow``, bfloat16 compute.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name


def _attend(q, k, v, is_local):
    s = jnp.einsum("btd,bsd->bts", q, k) / q.shape[-1] ** 0.5
    t = s.shape[-1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    if is_local:  # a sliding window of 2
        mask = mask & ~jnp.tril(jnp.ones((t, t), bool), -2)
    return jnp.einsum("bts,bsd->btd", jax.nn.softmax(jnp.where(mask, s, -1e9)), v)


# ---- Linen (gm.nn style) ---------------------------------------------------------------------------


class FeedForward(nn.Module):
    features: int
    hidden: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("gating_einsum", nn.initializers.lecun_normal(), (2, self.features, self.hidden))
        g = jnp.einsum("...d,cdf->c...f", x, w.astype(self.dtype))
        lin = self.param("linear", nn.initializers.lecun_normal(), (self.hidden, self.features))
        return jnp.einsum("...f,fd->...d", nn.gelu(g[0]) * g[1], lin.astype(self.dtype))


class Attention(nn.Module):
    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, is_local):
        dense = lambda name: nn.Dense(self.features, use_bias=False, dtype=self.dtype, name=name)
        q, k = dense("q_einsum")(x), dense("k_einsum")(x)
        return dense("attn_vec_einsum")(_attend(q, k, x, is_local))


class Block(nn.Module):
    features: int
    dropout: float = 0.1
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, is_local, deterministic):
        h = Attention(self.features, self.dtype, name="attn")(nn.RMSNorm(name="pre_attention_norm")(x), is_local)
        x = x + nn.Dropout(self.dropout)(h, deterministic=deterministic)
        self.sow("intermediates", "residual", x)
        return x + FeedForward(self.features, 2 * self.features, self.dtype, name="mlp")(
            nn.RMSNorm(name="pre_ffw_norm")(x)
        )


class InlineModel(nn.Module):
    """Blocks created inline in ``@nn.compact``, local/global alternating (``alternate=False``: all global)."""

    num_layers: int = 4
    features: int = 8
    dtype: jnp.dtype = jnp.float32
    alternate: bool = True

    @nn.compact
    def __call__(self, x, deterministic=True):
        for i in range(self.num_layers):
            is_local = self.alternate and i % 2 == 0
            x = Block(self.features, dtype=self.dtype, name=f"layer_{i}")(x, is_local, deterministic)
        return nn.RMSNorm(name="final_norm")(x)


class SetupModel(nn.Module):
    """Blocks created in ``setup`` as a list (flax names them ``blocks_0``, ...), every one global."""

    num_layers: int = 4
    features: int = 8

    def setup(self):
        self.blocks = [Block(self.features) for _ in range(self.num_layers)]
        self.final_norm = nn.RMSNorm()

    def __call__(self, x, deterministic=True):
        for block in self.blocks:
            x = block(x, False, deterministic)
        return self.final_norm(x)


class JitModel(nn.Module):
    """gm.nn's ``Transformer``: ``__call__`` wrapped in ``nn.jit`` (its trace cache ignores method interceptors)."""

    num_layers: int = 4
    features: int = 8

    @functools.partial(nn.jit, static_argnames=("self", "deterministic"))
    @nn.compact
    def __call__(self, x, deterministic=True):
        for i in range(self.num_layers):
            x = Block(self.features, name=f"layer_{i}")(x, False, deterministic)
        return nn.RMSNorm(name="final_norm")(x)


class TransformedBlocksModel(nn.Module):
    """Blocks under a Flax lifted transform of their own: ``nn.remat(Block)``, ``nn.jit(Block)``, ``nn.vmap``."""

    transform: str = "remat"
    num_layers: int = 2

    @nn.compact
    def __call__(self, x, deterministic=True):
        wrap = {
            "remat": lambda cls: nn.remat(cls, static_argnums=(2, 3)),
            "jit": lambda cls: nn.jit(cls, static_argnums=(2, 3)),
            "vmap": lambda cls: nn.vmap(
                cls, in_axes=(0, None, None), variable_axes={"params": None}, split_rngs={"params": False}
            ),
        }[self.transform]
        x = x[None] if self.transform == "vmap" else x  # vmapped over a leading axis of one
        for i in range(self.num_layers):
            x = wrap(Block)(8, name=f"layer_{i}")(x, False, deterministic)
        return x[0] if self.transform == "vmap" else x


# ---- Linen (MaxText style: the layer carries its own checkpoint_name tags) ---------------------------


class TaggedBlock(nn.Module):
    """Tags its values with MaxText's names (``query_proj``, ``mlpwi_0``, ``mlpwi_1``), beside its submodules."""

    features: int

    @nn.compact
    def __call__(self, x):
        q = nn.Dense(self.features, use_bias=False, name="query")(nn.RMSNorm(name="norm")(x))
        q = checkpoint_name(q, "query_proj")
        h = x + jnp.tanh(q)
        gate = checkpoint_name(nn.Dense(2 * self.features, use_bias=False, name="wi_0")(h), "mlpwi_0")
        up = checkpoint_name(nn.Dense(2 * self.features, use_bias=False, name="wi_1")(h), "mlpwi_1")
        return h + nn.Dense(self.features, use_bias=False, name="wo")(nn.silu(gate) * up)


class TaggedModel(nn.Module):
    num_layers: int = 2
    features: int = 8

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = TaggedBlock(self.features, name=f"layers_{i}")(x)
        return x


# ---- Linen: blocks that write mutable collections ----------------------------------------------------


class StatefulBlock(nn.Module):
    """Writes ``batch_stats`` (BatchNorm in training) and a ``cache`` (a call count, the last input)."""

    features: int

    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=not self.is_mutable_collection("batch_stats"), name="norm")(x)
        calls = self.variable("cache", "calls", jnp.zeros, (), jnp.int32)
        last = self.variable("cache", "last_input", jnp.zeros, x.shape, x.dtype)
        if self.is_mutable_collection("cache"):
            calls.value += 1
            last.value = x
        return x + nn.Dense(self.features, name="up")(jnp.tanh(h))


class StatefulModel(nn.Module):
    num_layers: int = 3
    features: int = 8

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = StatefulBlock(self.features, name=f"layer_{i}")(x)
        return x


# ---- NNX (Flax's NNX examples style) ---------------------------------------------------------------


class NnxFeedForward(nnx.Module):
    def __init__(self, d, f, *, rngs):
        init = nnx.initializers.lecun_normal()
        self.gating_einsum = nnx.Param(init(rngs.params(), (2, d, f)))
        self.linear = nnx.Param(init(rngs.params(), (f, d)))

    def __call__(self, x):
        g = jnp.einsum("...d,cdf->c...f", x, self.gating_einsum[...].astype(x.dtype))
        return jnp.einsum("...f,fd->...d", jax.nn.gelu(g[0]) * g[1], self.linear[...].astype(x.dtype))


class NnxAttention(nnx.Module):
    def __init__(self, d, *, dtype=None, rngs):
        self.q_einsum = nnx.Linear(d, d, use_bias=False, dtype=dtype, rngs=rngs)
        self.k_einsum = nnx.Linear(d, d, use_bias=False, dtype=dtype, rngs=rngs)
        self.attn_vec_einsum = nnx.Linear(d, d, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, is_local):
        return self.attn_vec_einsum(_attend(self.q_einsum(x), self.k_einsum(x), x, is_local))


class NnxBlock(nnx.Module):
    """``sow``: store the residual after attention as an ``nnx.Intermediate`` (Gemma's ``sow_config``);
    ``dtype``: the compute dtype (parameters stay float32)."""

    def __init__(self, d, *, sow=False, dtype=None, rngs):
        self.pre_attention_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.attn = NnxAttention(d, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.pre_ffw_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.mlp = NnxFeedForward(d, 2 * d, rngs=rngs)
        self.sow_residual = sow

    def __call__(self, x, is_local, deterministic=False):
        x = x + self.dropout(self.attn(self.pre_attention_norm(x), is_local), deterministic=deterministic)
        if self.sow_residual:
            self.sow(nnx.Intermediate, "residual", x)
        return x + self.mlp(self.pre_ffw_norm(x))


class NnxModel(nnx.Module):
    """``self.layers`` an ``nnx.List``; ``alternate``: local/global attention per layer; ``sow``, ``dtype``:
    see NnxBlock."""

    def __init__(self, num_layers=4, d=8, *, alternate=True, sow=False, dtype=None, rngs):
        self.layers = nnx.List([NnxBlock(d, sow=sow, dtype=dtype, rngs=rngs) for _ in range(num_layers)])
        self.final_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.alternate = alternate

    def __call__(self, x, deterministic=False):
        for i, layer in enumerate(self.layers):
            x = layer(x, self.alternate and i % 2 == 0, deterministic)
        return self.final_norm(x)


class NnxJitModel(NnxModel):
    """``__call__`` decorated with ``nnx.jit``, and (``jit_blocks``) each block's ``__call__`` too."""

    def __init__(self, num_layers=4, d=8, *, jit_blocks=False, rngs):
        super().__init__(num_layers, d, alternate=False, rngs=rngs)
        if jit_blocks:
            self.layers = nnx.List([NnxJitBlock(d, rngs=rngs) for _ in range(num_layers)])

    @nnx.jit(static_argnames="deterministic")
    def __call__(self, x, deterministic=False):
        return super().__call__(x, deterministic)


class NnxJitBlock(NnxBlock):
    @nnx.jit(static_argnums=(2, 3))
    def __call__(self, x, is_local, deterministic=False):
        return super().__call__(x, is_local, deterministic)


# ---- a MODULE:FACTORY for the CLI (remat-kit tags/plan/bench --model tests.unedited_models:factory) -------


def factory(policy):
    """``(loss_fn, (variables, x))`` for the unedited inline model under ``policy`` (abstract inputs)."""
    import remat_kit

    model = InlineModel()
    x = jax.ShapeDtypeStruct((2, 6, 8), jnp.float32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape)))
    make_loss = remat_kit.apply_factory(model, lambda m, v, x: jnp.sum(m.apply(v, x) ** 2))
    return make_loss(policy), (variables, x)
