"""remat_kit.apply(..., scan=True) on unedited models whose blocks repeat a period (Gemma 3's local/global).

Tiny shapes; each gradient case compiles the plain and the applied gradient once (the applied compile also
shows the scan's while loop).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_kit
from tests import unedited_models as um

X = jax.random.normal(jax.random.key(1), (2, 6, 8))
T = jax.random.normal(jax.random.key(2), (2, 6, 8))  # the loss weights every output: every block matters
RTOL = 1e-5  # float32, per leaf


def assert_leaves_close(got, want, rtol=RTOL):
    """Every leaf within ``rtol`` of its own largest magnitude; a leaf the loss does not reach is an error."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        scale = float(np.max(np.abs(np.asarray(w, np.float32))))
        assert scale > 0, f"{jax.tree_util.keystr(path)}: the loss does not depend on it"
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0, atol=rtol * scale, err_msg=str(path)
        )


class SetupPeriod(nn.Module):
    """Blocks in a ``setup`` list, Gemma 3's pattern in small: local, local, global, repeated; 7 layers leave a
    remainder of one local block after two periods."""

    num_layers: int = 7
    pattern: tuple = (True, True, False)

    def setup(self):
        self.blocks = [um.Block(8) for _ in range(self.num_layers)]
        self.final_norm = nn.RMSNorm()

    def __call__(self, x, deterministic=True):
        for i, block in enumerate(self.blocks):
            x = block(x, self.pattern[i % len(self.pattern)], deterministic)
        return self.final_norm(x)


class Local(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic):
        h = um.Attention(8, name="attn")(nn.RMSNorm(name="pre_attention_norm")(x), True)
        x = x + nn.Dropout(0.1)(h, deterministic=deterministic)
        return x + um.FeedForward(8, 16, name="mlp")(nn.RMSNorm(name="pre_ffw_norm")(x))


class Global(nn.Module):
    """Another block type: other parameters (a Dense MLP), attention over the whole sequence."""

    @nn.compact
    def __call__(self, x, deterministic):
        h = um.Attention(8, name="attn")(nn.RMSNorm(name="pre_attention_norm")(x), False)
        x = x + nn.Dropout(0.1)(h, deterministic=deterministic)
        return x + nn.Dense(8, name="mlp")(jax.nn.gelu(x))


class TwoTypes(nn.Module):
    """The block *class* alternates, created inline in ``@nn.compact``."""

    @nn.compact
    def __call__(self, x, deterministic=True):
        for i in range(4):
            x = (Local if i % 2 == 0 else Global)(name=f"layer_{i}")(x, deterministic)
        return x


def _loss(model, variables):
    out, state = model.apply(variables, X, False, rngs={"dropout": jax.random.key(3)}, mutable=["intermediates"])
    return jnp.sum(out * T), state


MODELS = {
    "inline-alternating": (lambda: um.InlineModel(num_layers=4), {}),  # [local, global] x 2
    "setup-period3-remainder": (SetupPeriod, {}),  # [local, local, global] x 2 + local
    "two-block-types": (TwoTypes, {"where": "layer_*"}),  # [Local, Global] x 2
}
CASES = [(m, "every_n:2") for m in MODELS] + [("inline-alternating", "selective:attn/q_einsum,mlp/*")]


@pytest.mark.parametrize(("kind", "policy"), CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_a_period_of_blocks_scans_with_the_plain_models_gradients_tree_and_sow(kind, policy):
    make, kwargs = MODELS[kind]
    model = make()
    variables = model.init(jax.random.key(0), X)
    applied = remat_kit.apply(model, policy, scan=True, **kwargs)
    assert jax.tree.structure(applied.init(jax.random.key(0), X)) == jax.tree.structure(variables)
    want, want_state = jax.jit(jax.grad(lambda v: _loss(model, v), has_aux=True))(variables)
    compiled = jax.jit(jax.grad(lambda v: _loss(applied, v), has_aux=True)).lower(variables).compile()
    got, got_state = compiled(variables)
    assert_leaves_close(got, want)
    assert_leaves_close(got_state, want_state)  # sow'n intermediates: each block's own, the same values
    assert "while" in compiled.as_text()  # the blocks run as a scan (a plain loop model compiles to none)
    # The comparison sees every block: one block's gradient zeroed fails it.
    blocks = sorted(k for k in got["params"] if k not in ("final_norm",))
    zeroed = {**got, "params": {**got["params"], blocks[-1]: jax.tree.map(jnp.zeros_like, got["params"][blocks[-1]])}}
    with pytest.raises(AssertionError):
        assert_leaves_close(zeroed, want)


class NoPeriod(nn.Module):
    """Global, local, global: the flag repeats no period, so no two consecutive blocks match."""

    @nn.compact
    def __call__(self, x, deterministic=True):
        for i in range(3):
            x = um.Block(8, name=f"layer_{i}")(x, i == 1, deterministic)
        return x


def test_blocks_that_repeat_no_period_are_refused_naming_each_blocks_flags():
    variables = NoPeriod().init(jax.random.key(0), X)
    applied = remat_kit.apply(NoPeriod(), "full", scan=True)
    with pytest.raises(ValueError, match=r"nor do they repeat a period.*layer_1 \(Block: is_local=True"):
        applied.apply(variables, X)


# ---- the CSE note in every report ------------------------------------------------------------------------


def _block(w, x):
    return x + jnp.tanh(jnp.sin(x @ w[0]) @ w[1])


def _make_loss(layout):
    """``make_loss(policy)`` of three blocks run in a Python loop, or under one ``lax.scan``.

    The loop's checkpoints take ``prevent_cse=False`` so that XLA:CPU merges their recompute into the forward
    pass on every JAX version (as it does for jax 0.10's ``prevent_cse=True`` loops of unedited models).
    """

    def make(policy):
        block = remat_kit.policies.parse(policy).checkpoint(_block, prevent_cse=False)

        def loss(ws, x):
            if layout == "scan":
                x, _ = jax.lax.scan(lambda h, w: (block(w, h), None), x, ws)
            else:
                for i in range(ws.shape[0]):
                    x = block(ws[i], x)
            return jnp.sum(x**2)

        return loss

    return make


WS = jax.ShapeDtypeStruct((3, 2, 64, 64), jnp.float32)
XS = jax.ShapeDtypeStruct((128, 64), jnp.float32)
NOTE = "XLA removed most of the recompute"


@pytest.mark.parametrize(("layout", "noted"), [("loop", True), ("scan", False)], ids=["python-loop", "scanned"])
def test_the_cse_note_is_in_inspect_compare_without_none_and_auto(layout, noted):
    make = _make_loss(layout)
    report = remat_kit.inspect(make("full"), WS, XS)
    assert any(NOTE in n for n in report.notes) == noted, report.notes
    assert (NOTE in str(report)) == noted
    table = remat_kit.compare(make, ["full"], WS, XS)  # no "none" row: compare measures it for the note
    assert (NOTE in str(table)) == noted, str(table)
    result = remat_kit.auto(make, WS, XS, budget_bytes=10**9, candidates=["full"])
    assert any(NOTE in n for n in result.notes) == noted, result.notes
    assert any(NOTE in line for line in result.table()) == noted
    assert (NOTE in " ".join(result.to_dict()["notes"])) == noted
