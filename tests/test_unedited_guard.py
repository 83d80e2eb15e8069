"""The guard apply runs on a model's first call (remat_kit/unedited/guard.py), and a model's own remat seen through.

Each silent no-op we could construct fires it: blocks that do no matmul, a policy that changes nothing the
backward pass keeps, the model's own checkpoint nested with remat_kit's inside a loop. A model's own
``jax.checkpoint`` / ``nnx.remat`` around or inside its blocks is seen through: remat_kit's policy replaces it,
said in one line, and the names it keeps are then in JAX's saved residuals.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from conftest import RTOL_F32, max_rel_err
from flax import nnx

import remat_kit
from remat_kit import _jax_internals
from remat_kit.unedited import guard
from tests import unedited_models as um

X = jax.random.normal(jax.random.key(1), (2, 6, 8))
T = jax.random.normal(jax.random.key(2), X.shape)


def _nnx_loss(model, x):
    return jnp.sum(model(x) * T)


def _nnx_grads(model):
    return nnx.state(nnx.grad(_nnx_loss)(model, X), nnx.Param)


def _nnx_kept(model) -> tuple[set[str], int]:
    graphdef, state = nnx.split(model)
    res = _jax_internals.saved_residuals(lambda s: _nnx_loss(nnx.merge(graphdef, s), X), state)
    return {r.tag for r in res if r.tag}, sum(r.nbytes for r in res if not r.is_argument)


def _same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert max_rel_err(g, w) <= RTOL_F32


def _seen_through(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if "of its own" in str(w.message)]


@pytest.mark.parametrize(
    ("make", "policy", "kept"),
    [
        (lambda: um.NnxSequentialCheckpointed(8, nnx.Rngs(0)), "selective:up", {"up"}),
        (lambda: um.NnxSequentialCheckpointed(8, nnx.Rngs(0)), "dots", set()),
        # Inside nnx.remat the submodules are merged anew in its own trace: their names travel with the graph.
        (lambda: um.NnxRematInsideModel(8, nnx.Rngs(0)), "selective:mlp/up", {"mlp/up"}),
    ],
    ids=["around-selective", "around-dots", "inside-nnx.remat"],
)
def test_nnx_models_own_remat_is_seen_through_and_the_policy_takes_effect(make, policy, kept):
    plain = make()
    applied = remat_kit.apply(plain, policy)
    grads, said = _seen_through(lambda: _nnx_grads(applied))
    assert said and "replaces them" in said[0] and policy in said[0]
    _same(grads, _nnx_grads(plain))
    tags, _ = _nnx_kept(applied)
    assert kept <= tags


def test_linen_checkpoint_inside_a_block_is_seen_through():
    model = um.Loop(um.CheckpointInsideBlock)
    variables = model.init(jax.random.key(0), X)
    applied = remat_kit.apply(model, "selective:w")
    loss = lambda m, v: jnp.sum(m.apply(v, X) * T)
    grads, said = _seen_through(lambda: jax.grad(lambda v: loss(applied, v))(variables))
    assert said and "Loop runs 3 jax.checkpoint call(s) of its own" in said[0]
    _same(grads, jax.grad(lambda v: loss(model, v))(variables))
    res = _jax_internals.saved_residuals(lambda v: loss(applied, v), variables)
    assert sum(r.tag == "w" for r in res) == 3  # the model's own checkpoint would keep none of them


def test_full_on_a_model_that_already_rematerializes_fully_says_so():
    applied = remat_kit.apply(um.NnxSequentialCheckpointed(8, nnx.Rngs(0)), "full")
    with pytest.raises(ValueError, match=r"keeps exactly what the plain model keeps \(the model's own remat around"):
        _nnx_grads(applied)


def test_own_remat_inside_a_loop_is_refused_naming_the_switch():
    applied = remat_kit.apply(um.NnxScannedCheckpointed(8, nnx.Rngs(0)), "full")
    with pytest.raises(ValueError, match=r"the model's own remat \(a jax\.checkpoint inside a loop\).*without its own"):
        _nnx_grads(applied)


def test_a_policy_that_changes_nothing_the_backward_keeps_is_an_error():
    model = um.Loop(um.LinearBlock)
    variables = model.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"under full the backward pass of Loop keeps exactly .* nothing more"):
        remat_kit.apply(model, "full").apply(variables, X)


def test_the_guard_runs_once_per_signature():
    model = um.GptModel()
    tokens = jnp.zeros((2, 6), jnp.int32)
    variables = model.init(jax.random.key(0), tokens)
    applied = remat_kit.apply(model, "full")
    applied.apply(variables, tokens)
    assert len(applied._verdicts) == 1
    applied.apply(variables, tokens + 1)
    assert len(applied._verdicts) == 1
    verdict = next(iter(applied._verdicts.values()))
    assert verdict.see_through is False and 0.5 < verdict.share <= 1


@pytest.mark.parametrize(
    ("module", "switch"),
    [("transformers.models.gpt2", "gradient_checkpointing=False"), ("tunix.models.llama3", "RematConfig.NONE")],
    ids=["hf", "tunix"],
)
def test_own_switch_names_the_familys_switch(module, switch):
    cls = type("Model", (), {"__module__": module})
    assert switch in guard.own_switch(cls)
    assert "jax.checkpoint" in guard.own_switch(type("Model", (), {"__module__": "mypkg"}))


def test_in_a_report_the_guard_is_a_line_not_an_error():
    model = um.Loop(um.LinearBlock)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), X))
    make_loss = remat_kit.apply_factory(model, lambda m, v, x: jnp.sum(m.apply(v, x) ** 2))
    table = remat_kit.compare(make_loss, ["none", "full"], variables, X)
    assert any("keeps exactly what the plain model keeps" in w for w in table["full"].warnings)
    assert not any("keeps exactly" in w for w in table["none"].warnings)
    result = remat_kit.fit(model, lambda m, v, x: jnp.sum(m.apply(v, x) ** 2), variables, X, budget="1GB", scan=False)
    assert result.policy == "none"
