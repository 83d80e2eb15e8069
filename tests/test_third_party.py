"""remat_kit on layers written the way third-party Flax code writes them (MaxText, gm.nn, Flax's NNX Gemma).

The models are the tests' own, written in those libraries' idioms (never their code): MaxText's
decoder layer with its ``checkpoint_name`` vocabulary and its positional flags made static by negative
``static_argnums``; Gemma 3's repeating local/global pattern; the NNX Gemma example's call-time
``nnx.Rngs`` for dropout.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import RTOL_F32, max_rel_err
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from remat_kit import policies as P

B, S, D, H, HD, F = 2, 4, 8, 2, 4, 16  # batch, sequence, model width, heads, head width, MLP width


class MaxTextStyleLayer(nn.Module):
    """A decoder layer as MaxText writes one: its own tag vocabulary, positional Python flags after the
    arrays (``deterministic``, ``model_mode``), which MaxText marks static with negative indices."""

    fused_qkv: bool = False
    fused_mlp: bool = False

    @nn.compact
    def __call__(self, inputs, segment_ids, deterministic, model_mode):
        del segment_ids
        x = checkpoint_name(inputs, "decoder_layer_input")
        h = nn.RMSNorm(name="pre_self_attention_norm")(x)
        if self.fused_qkv:
            qkv = checkpoint_name(nn.DenseGeneral((3, H, HD), use_bias=False, name="qkv")(h), "qkv_proj")
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q = checkpoint_name(nn.DenseGeneral((H, HD), use_bias=False, name="query")(h), "query_proj")
            k = checkpoint_name(nn.DenseGeneral((H, HD), use_bias=False, name="key")(h), "key_proj")
            v = checkpoint_name(nn.DenseGeneral((H, HD), use_bias=False, name="value")(h), "value_proj")
        probs = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / HD**0.5, axis=-1)
        ctx = checkpoint_name(jnp.einsum("bhqk,bkhd->bqhd", probs, v), "context")
        out = checkpoint_name(nn.DenseGeneral(D, axis=(-2, -1), use_bias=False, name="out")(ctx), "out_proj")
        x = x + nn.Dropout(0.1)(out, deterministic=deterministic)
        h = nn.RMSNorm(name="post_self_attention_norm")(x)
        if self.fused_mlp:
            wi = checkpoint_name(nn.DenseGeneral((2, F), use_bias=False, name="wi")(h), "mlpwi")
            gate, up = wi[:, :, 0], wi[:, :, 1]
        else:
            gate = checkpoint_name(nn.Dense(F, use_bias=False, name="wi_0")(h), "mlpwi_0")
            up = checkpoint_name(nn.Dense(F, use_bias=False, name="wi_1")(h), "mlpwi_1")
        mlp = checkpoint_name(nn.Dense(D, use_bias=False, name="wo")(nn.silu(gate) * up), "mlpwo")
        scale = 1.0 if model_mode == "train" else 0.5
        return x + scale * mlp


X = jax.random.normal(jax.random.key(0), (B, S, D))
SEG = jnp.ones((B, S), jnp.int32)


def _loss(cls, **fields):
    params = MaxTextStyleLayer(**fields).init(jax.random.key(1), X, SEG, True, "train")

    def loss(params, x):
        return jnp.sum(cls(**fields).apply(params, x, SEG, True, "train") ** 2)

    return loss, params


# ---- negative static_argnums (MaxText's (-1, -2)) -------------------------------------------------------


@pytest.mark.parametrize("spec", ["full", "selective:context"], ids=["full", "selective"])
def test_negative_static_argnums_count_from_the_last_argument(spec):
    cls = P.parse(spec)(MaxTextStyleLayer, static_argnums=(-1, -2))  # model_mode, deterministic
    loss, params = _loss(cls)
    want = jax.grad(_loss(MaxTextStyleLayer)[0])(params, X)
    got = jax.jit(jax.grad(loss))(params, X)
    assert max_rel_err(got, want) <= RTOL_F32


def test_negative_static_argnums_for_a_function_and_an_nnx_instance():
    def f(x, flag):
        return jnp.sum(jnp.sin(x) * (2.0 if flag else 1.0))

    assert float(jax.grad(P.full()(f, static_argnums=-1))(1.0, True)) == pytest.approx(2 * float(jnp.cos(1.0)))

    class Flagged(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x, scale):
            return self.lin(x) * (2.0 if scale == "double" else 1.0)

    wrapped = P.full()(Flagged(nnx.Rngs(0)), static_argnums=-1)
    got = nnx.grad(lambda m: jnp.sum(m(X, "double") ** 2))(wrapped)["module"]
    want = nnx.grad(lambda m: jnp.sum(m(X, "double") ** 2))(Flagged(nnx.Rngs(0)))
    assert max_rel_err(got, want) <= RTOL_F32

