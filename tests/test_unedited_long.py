"""apply(model, policy, query_blocks=, seq_tiles=): attention in query blocks and per-token submodules in tiles,
inside each block of an unedited model (remat_kit.unedited.long), on the repo's gm.nn- and NNX-style models."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import max_rel_err
from flax import nnx
from unedited_models import InlineModel, NnxModel

import remat_kit
from remat_kit.policies import positions
from remat_kit.unedited.long import auto_blocks

RTOL = 1e-5  # float32, the same math in another order (blocks of queries, tiles)
S = 24  # not a feature size (8, 16) of the models, so no other axis looks like the sequence
X = jax.random.normal(jax.random.key(1), (2, S, 8))
# A random cotangent: sum(out ** 2) of an RMS-normalized output is flat, its gradient rounding noise.
T = jax.random.normal(jax.random.key(2), (2, S, 8))

CASES = [
    ("query_blocks", "full", {"query_blocks": 4}),
    ("seq_tiles", "full", {"seq_tiles": 3}),
    ("both", "full", {"query_blocks": 4, "seq_tiles": 2}),
    ("both-selective", "selective:mlp,attn", {"query_blocks": 6, "seq_tiles": 4}),
    ("every_n", "every_n:2", {"query_blocks": 2, "seq_tiles": 2}),
    ("scan", "full", {"query_blocks": 4, "seq_tiles": 2, "scan": True}),
]


def _linen_grads(model, variables):
    return jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, X) * T)))(variables)


@pytest.mark.parametrize(("policy", "kwargs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_linen_gradients_equal_the_plain_model(policy, kwargs):
    model = InlineModel()  # local (sliding window) and global attention alternating
    variables = model.init(jax.random.key(0), X)
    want = _linen_grads(model, variables)
    got = _linen_grads(remat_kit.apply(model, policy, **kwargs), variables)
    assert max_rel_err(got, want) <= RTOL


NNX_CASES = [*CASES[:3], CASES[-1]]


@pytest.mark.parametrize(("policy", "kwargs"), [c[1:] for c in NNX_CASES], ids=[c[0] for c in NNX_CASES])
def test_nnx_gradients_equal_the_plain_model(policy, kwargs):
    def loss(model):
        return jnp.sum(model(X, deterministic=True) * T)

    plain = NnxModel(rngs=nnx.Rngs(0))
    want = nnx.jit(nnx.grad(loss))(plain)
    got = nnx.jit(nnx.grad(loss))(remat_kit.apply(plain, policy, **kwargs))
    assert max_rel_err(got, want) <= RTOL


def _kinds(table) -> dict[str, str]:
    return {p.path: p.kind for p in table.parts}


@pytest.mark.parametrize("kind", ["linen", "nnx"], ids=["linen", "nnx"])
def test_names_of_says_which_submodules_are_attention_and_per_token(kind):
    if kind == "linen":
        table = remat_kit.names_of(InlineModel(), X)
        dropout = "Dropout_0"
    else:
        table = remat_kit.names_of(NnxModel(rngs=nnx.Rngs(0)), X, deterministic=True)
        dropout = "dropout"
    assert _kinds(table) == {
        "pre_attention_norm": "per-token",
        "attn": "attention",
        dropout: "per-token",
        "pre_ffw_norm": "per-token",
        "mlp": "per-token",
    }
    assert re.search(r"^  attn +attention +1 region\(s\): dot_general", str(table), re.M)


def test_a_submodule_that_draws_random_numbers_runs_as_written():
    table = remat_kit.names_of(NnxModel(rngs=nnx.Rngs(0)), X, deterministic=False)
    dropout = next(p for p in table.parts if p.path == "dropout")
    assert dropout.kind == "neither" and "updates its state" in dropout.why


class CumsumMix(nn.Module):
    """Mixes positions along the sequence (a running sum): never per-token."""

    @nn.compact
    def __call__(self, x):
        return jnp.cumsum(nn.Dense(x.shape[-1], use_bias=False, name="proj")(x), axis=1)


class MixBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + CumsumMix(name="mix")(nn.RMSNorm(name="norm")(x))
        return x + nn.Dense(x.shape[-1], name="mlp")(jnp.tanh(x))


class MixModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = MixBlock(name=f"layer_{i}")(x)
        return x


def test_a_submodule_that_mixes_positions_is_never_tiled():
    model = MixModel()
    table = remat_kit.names_of(model, X)
    parts = {p.path: p for p in table.parts}
    assert parts["mix"].kind == "neither" and "cumsum" in parts["mix"].why
    assert parts["norm"].kind == parts["mlp"].kind == "per-token"
    variables = model.init(jax.random.key(0), X)
    got = _linen_grads(remat_kit.apply(model, "full", seq_tiles=4), variables)
    assert max_rel_err(got, _linen_grads(model, variables)) <= RTOL


def test_query_blocks_without_attention_is_one_line_naming_the_submodules():
    model = MixModel()
    variables = model.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"query_blocks=2: no attention region .* mix \(") as err:
        remat_kit.apply(model, "full", query_blocks=2).apply(variables, X)
    assert "\n" not in str(err.value)


BAD = [
    ("zero", {"query_blocks": 0}, ValueError, r"query_blocks=0: give a positive number"),
    ("negative", {"seq_tiles": -2}, ValueError, r"seq_tiles=-2: give a positive number"),
    ("float", {"seq_tiles": 2.5}, TypeError, r"seq_tiles=2.5: give a positive int, \"auto\" or None, not a float"),
    ("word", {"query_blocks": "fast"}, TypeError, r"query_blocks='fast': give a positive int"),
    ("bool", {"query_blocks": True}, TypeError, r"query_blocks=True: give a positive int"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_values_are_one_line_errors_before_tracing(kwargs, error, match):
    with pytest.raises(error, match=match):
        remat_kit.apply(InlineModel(), "full", **kwargs)  # no call: nothing traced
    with pytest.raises(error, match=match):
        remat_kit.apply(NnxModel(rngs=nnx.Rngs(0)), "full", **kwargs)


def test_blocks_that_do_not_divide_the_length_name_its_divisors():
    model = InlineModel()
    variables = model.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"query_blocks=5 does not divide the sequence length 24; divisors of 24"):
        remat_kit.apply(model, "full", query_blocks=5).apply(variables, X)


@pytest.mark.parametrize(("length", "blocks"), [(512, 1), (4096, 4), (3072, 3), (8191, 1)], ids=str)
def test_auto_aims_at_about_1024_positions_a_block(length, blocks):
    assert auto_blocks(length) == blocks


def _temp_bytes(model, variables, x) -> int:
    t = jnp.ones_like(x)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) * t)))
    return grad.lower(variables).compile().memory_analysis().temp_size_in_bytes


def test_query_blocks_cut_the_backward_temp_bytes_at_a_longer_sequence():
    # 1 x 512 positions, 8 features: one layer's [1, 512, 512] float32 scores (1 MiB) dominate the backward.
    x = jax.random.normal(jax.random.key(1), (1, 512, 8))
    model = InlineModel(num_layers=2, alternate=False)
    variables = model.init(jax.random.key(0), x)
    full = _temp_bytes(remat_kit.apply(model, "full"), variables, x)
    blocked = _temp_bytes(remat_kit.apply(model, "full", query_blocks=8), variables, x)
    assert blocked < 0.5 * full, (blocked, full)


def test_a_projection_as_wide_as_the_length_does_not_hide_the_attention():
    # Llama 3 1B at 2,048 positions: 32 heads x 64 = 2,048, so the q projection's output is [B, S, S] by shape and
    # starts a second, larger region around the real one (not per-query: its input has two axes of S).
    heads, hd = 4, 6  # 4 x 6 = S = 24

    def attention(x, wq, wk, wv):
        q = (x @ wq).reshape(2, S, heads, hd)
        k, v = (x @ wk).reshape(2, S, 1, hd), (x @ wv).reshape(2, S, 1, hd)
        s = jnp.einsum("bthd,bsgd->bhts", q, k) / hd**0.5
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
        return jnp.einsum("bhts,bsgd->bthd", jax.nn.softmax(s), v).reshape(2, S, S)

    keys = jax.random.split(jax.random.key(3), 4)
    widths = (S, hd, hd)  # q, k, v
    args = [jax.random.normal(keys[0], (2, S, 8))]
    args += [jax.random.normal(k, (8, n)) for k, n in zip(keys[1:], widths, strict=True)]
    flat = positions.inline(jax.make_jaxpr(attention)(*args))
    regions = positions.attention_regions(flat, S)
    assert len(regions) == 1
    run = positions.run_regions(flat, regions, 4)
    got = jax.grad(lambda a: jnp.sum(run(*a)[0] * T[..., :1]), argnums=0)(args)
    want = jax.grad(lambda a: jnp.sum(attention(*a) * T[..., :1]), argnums=0)(args)
    assert max_rel_err(got, want) <= RTOL
