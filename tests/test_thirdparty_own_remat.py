"""A registry model's own remat seen through by remat_kit.apply (issue 45): tunix's ``remat_config``, unedited.

tunix's Llama 3 rematerializes itself with ``nnx.remat`` when its config says so: around each attention and MLP
block (``RematConfig.BLOCK``) or around each decoder layer (``RematConfig.DECODER``), inside the blocks ``apply``
wraps. Without seeing through it, the model's own checkpoint would decide what is kept (nothing of what a selective
policy names). Marked ``thirdparty`` and run by CI's section 4, like tests/test_thirdparty_real.py.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest
from conftest import RTOL_F32, max_rel_err
from flax import nnx
from test_thirdparty_real import _TUNIX, _TUNIX_WHY, CAUSAL, POSITIONS, TOKENS, WEIGHTS, _need, _randomize, _tiny

import remat_kit
from remat_kit import _jax_internals

pytestmark = pytest.mark.thirdparty


@pytest.fixture(autouse=True)
def _numpy_broadcasting():
    with jax.numpy_rank_promotion("allow"):
        yield


def _loss(model, tokens):
    logits, _ = model(tokens, POSITIONS, None, CAUSAL)
    return jnp.sum(logits.astype(jnp.float32) * WEIGHTS)


@pytest.mark.parametrize("remat", ["BLOCK", "DECODER"])
def test_tunix_remat_config_is_seen_through(remat):
    _need(_TUNIX, _TUNIX_WHY)
    llama = _TUNIX[0]
    config = dataclasses.replace(_tiny(llama.ModelConfig.llama3p2_1b(), 2), remat_config=llama.RematConfig[remat])
    plain = _randomize(llama.Llama3(config, rngs=nnx.Rngs(0)), 2)
    applied = remat_kit.apply(plain, "selective:attn/q_proj,mlp/up_proj")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = nnx.state(nnx.grad(_loss)(applied, TOKENS), nnx.Param)
    said = [str(w.message) for w in caught if "of its own" in str(w.message)]
    assert said and "selective:attn/q_proj,mlp/up_proj replaces them" in said[0]
    want = nnx.state(nnx.grad(_loss)(plain, TOKENS), nnx.Param)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        assert max_rel_err(g, w) <= RTOL_F32
    graphdef, state = nnx.split(applied)
    res = _jax_internals.saved_residuals(lambda s: _loss(nnx.merge(graphdef, s), TOKENS), state)
    kept = [r.tag for r in res if r.tag]
    assert kept.count("attn/q_proj") == 2 and kept.count("mlp/up_proj") == 2  # one per layer, as without remat
