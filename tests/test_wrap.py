"""A policy applied to one function or one Linen class: same gradients, what it keeps, the tag rule."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err
from flax import nnx

from remat_kit import _jax_internals as internals
from remat_kit import policies as P
from remat_kit.names import tag
from remat_kit.policies import tags

#: The policies that apply to one function or module (the grouping ones apply to stacks).
SINGLE_SPECS = [s for s in ALL_SPECS if P.parse(s).kind not in P.GROUPING_KINDS]


def _policy(spec):
    """The spec, with selective/offload aimed at tags the code below emits (the user's own tags)."""
    return P.parse({"selective": "selective:up", "offload": "offload:up;save=gate"}.get(spec, spec))


def _f(w, x, scale):  # w: [4, 8], x: [3, 4]; scale is a Python float (static)
    gate = tag(jnp.tanh(x @ w), "gate")
    up = tag(jnp.sin(x @ w) * scale, "up")
    return jnp.sum(jnp.cos(gate * up) @ w.T)


W, X = jax.random.normal(jax.random.key(0), (4, 8)), jax.random.normal(jax.random.key(1), (3, 4))


@pytest.mark.parametrize("spec", SINGLE_SPECS)
def test_function_gradients_equal_none(spec):
    f = _policy(spec)(_f, static_argnums=2)
    got = jax.jit(jax.grad(f, argnums=(0, 1)), static_argnums=2)(W, X, 2.0)
    want = jax.grad(_f, argnums=(0, 1))(W, X, 2.0)
    assert max_rel_err(got, want) <= RTOL_F32
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in got)


def _kept_bytes(fn, *args):
    return sum(r.nbytes for r in internals.saved_residuals(fn, *args) if not r.is_argument)


def test_function_keeps_less_full_than_selective_than_none():
    kept = {s: _kept_bytes(lambda w, x, s=s: _policy(s)(_f, static_argnums=2)(w, x, 2.0), W, X) for s in SINGLE_SPECS}
    assert kept["full"] < kept["selective"] < kept["none"]
    # selective keeps exactly its tag: one [3, 8] float32 value.
    assert kept["selective"] == 3 * 8 * 4


# ---- Linen classes -----------------------------------------------------------------------------------


class Block(nn.Module):
    """Takes a Python flag positionally, as many user blocks do."""

    width: int = 8

    @nn.compact
    def __call__(self, x, train):  # x: [3, 4]
        gate = tag(jnp.tanh(nn.Dense(self.width, name="gate")(x)), "gate")
        up = tag(nn.Dense(self.width, name="up")(x), "up")
        h = nn.Dropout(0.5)(gate * jnp.sin(up), deterministic=not train)
        return nn.Dense(4, name="down")(h)

    def encode(self, x):
        return jnp.sum(self(x, False) ** 2)


@pytest.mark.parametrize("spec", SINGLE_SPECS)
def test_linen_class_with_positional_flag_gradients_equal_none(spec):
    cls = _policy(spec)(Block, static_argnums=(2,))  # flax counts self: (self, x, train)
    assert (cls is Block) == (spec == "none")
    params = Block().init(jax.random.key(2), X, False)
    assert jax.tree.structure(cls().init(jax.random.key(2), X, False)) == jax.tree.structure(params)
    # Inside a parent, auto-named submodules keep the class's own name: the same tree as without remat.
    in_parent = lambda c: jax.eval_shape(nn.Sequential([lambda x: c()(x, False)] * 2).init, jax.random.key(0), X)
    assert jax.tree.structure(in_parent(cls)) == jax.tree.structure(in_parent(Block))

    def loss(module, p):
        return jnp.sum(module.apply(p, X, True, rngs={"dropout": jax.random.key(3)}) ** 2)

    got = jax.jit(jax.grad(lambda p: loss(cls(), p)))(params)
    want = jax.grad(lambda p: loss(Block(), p))(params)
    assert max_rel_err(got, want) <= RTOL_F32
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(got))


def test_linen_methods_are_rematerialized_and_checked():
    params = Block().init(jax.random.key(2), X, False)
    cls = P.full()(Block, methods=["encode"])
    g = jax.grad(lambda p: cls().apply(p, X, method="encode"))(params)
    assert max_rel_err(g, jax.grad(lambda p: Block().apply(p, X, method="encode"))(params)) <= RTOL_F32
    with pytest.raises(ValueError, match=r"Block.encode never emits: upp \(did you mean 'up'\?\)"):
        P.selective(["upp"])(Block, methods=["encode"])().apply(params, X, method="encode")
    with pytest.raises(ValueError, match=r"Block has no method 'decode'"):
        P.full()(Block, methods=["decode"])


def test_linen_class_keeps_less_full_than_selective_than_none():
    params = Block().init(jax.random.key(2), X, False)
    kept = {}
    for spec in ("none", "selective", "full"):
        cls = _policy(spec)(Block, static_argnums=(2,))
        kept[spec] = _kept_bytes(lambda p, x, c=cls: jnp.sum(c().apply(p, x, False)), params, X)
    assert kept["full"] < kept["selective"] < kept["none"]


# ---- the one tag rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        (P.selective(["upp"]), r"never emits: upp \(did you mean 'up'\?\); it emits: gate, up"),
        (P.selective(["up", "q_proj"]), r"never emits: q_proj; it emits: gate, up"),
        (P.offload(["mlp_up"]), r"never emits: mlp_up; it emits"),
    ],
    ids=["misspelt", "missing", "offload"],
)
def test_missing_or_misspelt_tag_raises_for_function_and_class(policy, match):
    with pytest.raises(ValueError, match=match):
        jax.grad(policy(_f, static_argnums=2))(W, X, 2.0)
    with pytest.raises(ValueError, match=match):
        policy(Block, static_argnums=(2,))().init(jax.random.key(0), X, False)


def test_strict_false_skips_the_check():
    f = P.selective(["up", "not_there"], strict=False)(_f, static_argnums=2)
    assert max_rel_err(jax.grad(f)(W, X, 2.0), jax.grad(_f)(W, X, 2.0)) <= RTOL_F32


def test_tags_are_checked_once_per_input_signature(monkeypatch):
    calls = []
    real = tags.emitted_tags
    monkeypatch.setattr(tags, "emitted_tags", lambda *a: calls.append(1) or real(*a))
    policy = P.parse("selective:gate,up")  # a policy no other test checks (the cache is per process)
    f = policy(lambda w, x, s: _f(w, x, s), static_argnums=2)
    f(W, X, 2.0)
    f(W + 1, X, 2.0)
    assert len(calls) == 1
    f(W, X[:2], 2.0)  # a new shape: checked again
    assert len(calls) == 2
    cls = policy(Block, static_argnums=(2,))
    params = cls().init(jax.random.key(0), X, False)
    cls().apply(params, X, False)
    cls().apply(params, X, False)
    assert len(calls) == 3


# ---- what a policy does not apply to ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["every_n:2", "segments:2", "sqrt_n"])
def test_grouping_policy_on_one_function_or_class_raises(spec):
    with pytest.raises(ValueError, match=r"groups the layers of a stack; apply it with remat_kit.stack"):
        P.parse(spec)(_f)
    with pytest.raises(ValueError, match=r"not to one linen class"):
        P.parse(spec)(Block)


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (Block(), r"not an instance \(Block\(\.\.\.\)\); write policy\(Block\)"),
        (_NnxBlock, r"policy\(_NnxBlock\(rngs=nnx.Rngs\(0\)\)\), or remat_kit.nnx.stack"),
        (3, r"a function, a flax.linen.Module class or an flax.nnx.Module instance"),
    ],
    ids=["linen-instance", "nnx-class", "not-callable"],
)
def test_wrong_target_is_a_type_error(target, match):
    with pytest.raises(TypeError, match=match):
        P.full()(target)


def test_bad_static_argnums_and_methods():
    with pytest.raises(ValueError, match=r"index 0 is self"):
        P.full()(Block, static_argnums=0)
    with pytest.raises(ValueError, match=r"static_argnums must be ints"):
        P.full()(_f, static_argnums=(1.0,))
    with pytest.raises(ValueError, match=r"reaches self in a call with 2 argument"):
        P.full()(Block, static_argnums=(-3,))().init(jax.random.key(0), X, False)
    with pytest.raises(TypeError, match=r"methods= applies to a flax.linen.Module class only"):
        P.full()(_f, methods=["encode"])
