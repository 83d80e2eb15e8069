"""Which modules apply rematerializes (remat_kit/unedited/blocks.py): blocks found by compute, several kinds of block.

The models (tests/unedited_models.py) are written the way Flax model libraries write theirs: a GPT-2 with two
embeddings beside its blocks, a period of recurrent and attention blocks, dense and expert layers.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import RTOL_F32, max_rel_err

import remat_kit
from remat_kit import _jax_internals
from remat_kit.unedited import blocks
from tests import unedited_models as um

X = jax.random.normal(jax.random.key(1), (2, 6, 8))
T = jax.random.normal(jax.random.key(2), X.shape)
TOKENS = jax.random.randint(jax.random.key(3), (2, 6), 0, 64)


def _grads(model, variables, *args):
    return jax.grad(lambda v: jnp.sum(model.apply(v, *args) * T))(variables)


def _assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert max_rel_err(g, w) <= RTOL_F32


def _kept_tags(model, variables, *args) -> set[str]:
    res = _jax_internals.saved_residuals(lambda v: jnp.sum(model.apply(v, *args)), variables)
    return {r.tag for r in res if r.tag}


def _kept_bytes(model, variables, *args) -> int:
    res = _jax_internals.saved_residuals(lambda v: jnp.sum(model.apply(v, *args)), variables)
    return sum(r.nbytes for r in res if not r.is_argument)


# ---- choose: the rule on its own ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flops", "want"),
    [
        ({("h", "0"): 50, ("h", "1"): 50, ("h", "0", "up"): 25, ("h", "1", "up"): 25}, ("Block",)),
        ({}, ("Block",)),  # nothing weighed: the shallowest repeated composite class
    ],
    ids=["by-flops", "unweighed"],
)
def test_choose_takes_the_repeated_module_with_the_compute(flops, want):
    mods = [
        (("wte",), "Embed", False),
        (("wpe",), "Embed", False),
        (("h",), "Blocks", True),
        (("h", "0"), "Block", True),
        (("h", "0", "up"), "Dense", False),
        (("h", "0", "up2"), "Dense", False),
        (("h", "1"), "Block", True),
        (("h", "1", "up"), "Dense", False),
        (("h", "1", "up2"), "Dense", False),
    ]
    assert blocks.choose(mods, flops, 100, "matmul FLOPs").classes == want


def test_choose_prefers_the_finer_of_two_with_the_same_compute_and_adds_a_second_kind():
    # Two stacks of the same class (encoder, decoder) hold the layers: the layers are the blocks.
    mods = [(("enc",), "Stack", True), (("dec",), "Stack", True)]
    mods += [((s, str(i)), "Layer", True) for s in ("enc", "dec") for i in range(3)]
    flops = {("enc",): 60, ("dec",): 60, **{(s, str(i)): 20 for s in ("enc", "dec") for i in range(3)}}
    assert blocks.choose(mods, flops, 120, "matmul FLOPs").classes == ("Layer",)
    # Dense and expert layers under one parent: both kinds, said in one line.
    mods = [(("l0",), "DenseL", True), (("l1",), "MoE", True), (("l2",), "DenseL", True), (("l3",), "MoE", True)]
    choice = blocks.choose(mods, {("l0",): 10, ("l1",): 40, ("l2",): 10, ("l3",): 40}, 100, "matmul FLOPs")
    assert choice.classes == ("MoE", "DenseL")
    assert "blocks of 2 kinds" in choice.several and "where=" in choice.several


def test_choose_with_nothing_repeated_is_one_line():
    with pytest.raises(ValueError, match=r"no repeated block found.*pass where="):
        blocks.choose([(("a",), "A", False), (("b",), "B", False)], {}, 0, "matmul FLOPs")


# ---- case 1: the blocks, not the embeddings -----------------------------------------------------------------


def test_gpt2_style_model_rematerializes_its_blocks_not_its_embeddings():
    model = um.GptModel()
    variables = model.init(jax.random.key(0), TOKENS)
    table = remat_kit.names_of(model, TOKENS)
    assert table.block.startswith("GptBlock block h/0")
    assert "GptBlock ×4" in table.why and "next: Embed ×2 (wte … wpe, 0%)" in table.why
    applied = remat_kit.apply(model, "full")
    plain_tokens = jnp.sum(model.apply(variables, TOKENS) * T)
    assert float(jnp.sum(applied.apply(variables, TOKENS) * T)) == pytest.approx(float(plain_tokens), rel=1e-6)
    g = jax.grad(lambda v: jnp.sum(applied.apply(v, TOKENS).astype(jnp.float32) * T))(variables)
    want = jax.grad(lambda v: jnp.sum(model.apply(v, TOKENS) * T))(variables)
    _assert_same(g, want)
    # What the backward pass keeps drops: the policy took effect.
    assert _kept_bytes(applied, variables, TOKENS) < _kept_bytes(model, variables, TOKENS)


def test_blocks_named_by_where_that_do_no_matmul_are_refused_by_the_guard():
    model = um.GptModel()
    variables = model.init(jax.random.key(0), TOKENS)
    with pytest.raises(
        ValueError, match=r"wrapped GptModel's Embed blocks, which do none of the forward pass's matmuls"
    ):
        remat_kit.apply(model, "full", where=nn.Embed).apply(variables, TOKENS)


# ---- case 2: several kinds of block -------------------------------------------------------------------------


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("policy", ["selective:attn", "selective:rec,mlp", "offload:attn", "full"], ids=str)
def test_a_name_is_kept_where_its_block_emits_it(policy, scan):
    model = um.PeriodModel("rrarra")
    variables = model.init(jax.random.key(0), X)
    applied = remat_kit.apply(model, policy, scan=scan)
    _assert_same(_grads(applied, variables, X), _grads(model, variables, X))
    if policy.startswith("selective") and not scan:
        # mlp feeds the residual sum, which needs nothing of it for the backward pass: kept by no model.
        assert set(policy.split(":")[1].split(",")) - {"mlp"} <= _kept_tags(applied, variables, X)


def test_names_of_says_which_blocks_emit_each_name():
    table = remat_kit.names_of(um.PeriodModel("rra"), X)
    rows = {r.name: r.blocks for r in table.rows}
    assert rows["rec"] == ("b0", "b1") and rows["attn"] == ("b2",) and rows["mlp"] == ()
    assert "attn" in str(table) and "every block" in str(table)


def test_a_name_no_block_emits_is_an_error_with_the_nearest():
    model = um.PeriodModel("rra")
    variables = model.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"names tags that KindBlock never emits: atn \(did you mean 'attn'\?\)"):
        remat_kit.apply(model, "selective:atn").apply(variables, X)


def test_two_block_classes_carrying_the_compute_are_both_rematerialized():
    model = um.MixedLayersModel()
    variables = model.init(jax.random.key(0), X)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied = remat_kit.apply(model, "selective:proj")
        grads = _grads(applied, variables, X)
    assert any("blocks of 2 kinds" in str(w.message) for w in caught)
    _assert_same(grads, _grads(model, variables, X))
    jaxpr = jax.make_jaxpr(lambda v: applied.apply(v, X))(variables)
    assert _jax_internals.remat_nesting(jaxpr).own == 4


# ---- case 3: fit plans over every kind of block -------------------------------------------------------------


def test_fit_plans_a_period_of_kinds_and_never_raises_on_its_own_candidate():
    # Wide enough that the scanned stack under full needs less than the loop as given (7.6 against 9.9 MB).
    model = um.PeriodModel("rra" * 4, expand=4)
    x = jax.random.normal(jax.random.key(1), (4, 256, 32))
    variables = model.init(jax.random.key(0), x)

    def loss(m, v, x):
        return jnp.sum(m.apply(v, x) ** 2)

    plain = remat_kit.fit(model, loss, variables, x, budget="1GB")
    assert plain.policy == "none" and plain.compiles == 1
    budget = int(plain.need_bytes * 0.9)
    tight = remat_kit.fit(model, loss, variables, x, budget=budget, margin=0.0)
    assert tight.policy != "none" and tight.need_bytes <= budget and tight.compiles <= 3
    assert {"rec", "attn"} <= {g[0] for g in tight.choice.groups}  # both kinds' names were priced
    g = jax.grad(lambda v: loss(tight.model, v, x))(variables)
    _assert_same(g, jax.grad(lambda v: loss(model, v, x))(variables))


@pytest.mark.parametrize(
    ("make", "loss", "args", "match"),
    [
        (lambda: um.PeriodModel("rra"), lambda m, x: m(x).sum(), (X,), "takes loss_fn\\(model, variables, \\*batch\\)"),
        (
            lambda: um.NnxUpDown(8, rngs=__import__("flax").nnx.Rngs(0)),
            lambda m, v, x: m(x).sum(),
            ({"params": {}}, X),
            "an NNX model .* takes loss_fn\\(model, \\*batch\\)",
        ),
    ],
    ids=["nnx-style-on-linen", "linen-style-on-nnx"],
)
def test_fit_given_the_other_conventions_arguments_says_so(make, loss, args, match):
    with pytest.raises(TypeError, match=match):
        remat_kit.fit(make(), loss, *args, budget="1GB")


# ---- a policy per kind of block ------------------------------------------------------------------------------


def test_a_policy_per_kind_of_block():
    model = um.MixedLayersModel()
    variables = model.init(jax.random.key(0), X)
    applied = remat_kit.apply(model, {um.DenseLayer: "full", um.ExpertLayer: "selective:expert_0"})
    assert str(applied) == "remat_kit.apply(MixedLayersModel, {DenseLayer: full, ExpertLayer: selective:expert_0})"
    _assert_same(_grads(applied, variables, X), _grads(model, variables, X))
    assert _kept_tags(applied, variables, X) == {"expert_0"}
    none_for_dense = remat_kit.apply(model, {um.DenseLayer: "none", um.ExpertLayer: "full"})
    assert (
        _kept_bytes(applied, variables, X)
        < _kept_bytes(none_for_dense, variables, X)
        < _kept_bytes(model, variables, X)
    )


@pytest.mark.parametrize(
    ("policy", "kwargs", "error", "match"),
    [
        ({}, {}, ValueError, r"policy=\{\}: give at least one pair"),
        ({um.DenseLayer: "every_n:2"}, {}, ValueError, "groups layers; a policy per kind of block takes per-block"),
        ({um.DenseLayer: "full"}, {"scan": True}, ValueError, "a policy per kind of block needs scan=False"),
        ({um.DenseLayer: "full"}, {"where": um.DenseLayer}, TypeError, "give where= or a mapping"),
        ({3: "full"}, {}, TypeError, "where=3: give a flax.linen"),
    ],
    ids=["empty", "grouping", "scan", "where-too", "bad-key"],
)
def test_a_bad_policy_mapping_is_one_line(policy, kwargs, error, match):
    with pytest.raises(error, match=match):
        remat_kit.apply(um.MixedLayersModel(), policy, **kwargs)
