"""apply(..., query_blocks=, seq_tiles=) on the registry models as users install them: tunix's Llama 3 (NNX) and
gemma's gm.nn (Linen), built as tests/test_thirdparty_real.py builds them (tiny configs, random weights)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import max_rel_err
from flax import nnx
from test_thirdparty_real import (  # noqa: F401 - the fixtures: NumPy broadcasting, flax's own param
    MODELS,
    VOCAB,
    _flax_param_unpatched,
    _numpy_broadcasting,
)

import remat_kit

pytestmark = pytest.mark.thirdparty

RTOL = 1e-5
B, L = 2, 24  # L is no other axis of the tiny configs (16, 32, 8 ...): only the sequence looks like it
TOKENS = jax.random.randint(jax.random.key(7), (B, L), 1, VOCAB)
POSITIONS = jnp.broadcast_to(jnp.arange(L), (B, L))
CAUSAL = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
WEIGHTS = jax.random.normal(jax.random.key(8), (B, L, VOCAB))  # the loss weighs every logit


def _grads(name: str, model, plain, variables=None):
    if MODELS[name].nnx:

        def loss(m):
            logits, _ = m(TOKENS, POSITIONS, None, CAUSAL)
            return jnp.sum(logits.astype(jnp.float32) * WEIGHTS)

        return nnx.jit(nnx.grad(loss))(model)
    return jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, TOKENS).logits.astype(jnp.float32) * WEIGHTS)))(variables)


LONG = [("query_blocks", {"query_blocks": 3}), ("both", {"query_blocks": 4, "seq_tiles": 2})]


@pytest.mark.parametrize("kwargs", [k for _, k in LONG], ids=[i for i, _ in LONG])
@pytest.mark.parametrize("name", ["tunix-llama3", "gemma-gm.nn"], ids=["tunix-llama3", "gemma-gm.nn"])
def test_registry_model_gradients_equal_the_plain_model(name, kwargs):
    real = MODELS[name]
    plain = real.make(2)
    variables = None if real.nnx else plain.init(jax.random.key(0), TOKENS)
    want = _grads(name, plain, plain, variables)
    got = _grads(name, remat_kit.apply(plain, "full", **kwargs), plain, variables)
    assert max_rel_err(got, want) <= RTOL


@pytest.mark.parametrize("name", ["tunix-llama3", "gemma-gm.nn"], ids=["tunix-llama3", "gemma-gm.nn"])
def test_names_of_finds_the_registry_models_attention_and_mlp(name):
    real = MODELS[name]
    plain = real.make(2)
    args = (TOKENS, POSITIONS, None, CAUSAL) if real.nnx else (TOKENS,)
    parts = {p.path: p.kind for p in remat_kit.names_of(plain, *args).parts}
    assert parts["attn"] == "attention" and parts["mlp"] == "per-token", parts
