"""Flax NNX: policy(instance) (remat_kit.nnx.wrap) and remat_kit.nnx.stack, under every policy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err
from flax import nnx

from remat_kit import _jax_internals, policies
from remat_kit import nnx as rk_nnx
from remat_kit.names import tag
from remat_kit.nnx import wrap as wrap_nnx
from remat_kit.policies import tags

D, F, DEPTH = 8, 16, 3  # width, MLP width, depth (3: every_n:2, segments:2 and sqrt_n leave a remainder group)
GROUPING = ("every_n", "segments", "sqrt_n")
#: Policies that apply to one module instance (the grouping ones apply to a stack).
INSTANCE_SPECS = [s for s in ALL_SPECS if s.split(":")[0] not in GROUPING]


class Counter(nnx.Variable):
    """A custom variable type, updated every call (must be carried and written back like BatchStat)."""


class TinyBlock(nnx.Module):
    """A pre-norm attention + SwiGLU block emitting every tag the default policies name.

    Projections are fused (one matmul for q/k/v, one for gate/up) to keep compiles short.
    """

    def __init__(self, rngs: nnx.Rngs):
        # No bias: softmax ignores k's, so its gradient would be rounding noise (which adamw amplifies).
        self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(D, D, rngs=rngs)
        self.gate_up = nnx.Linear(D, 2 * F, rngs=rngs)
        self.down = nnx.Linear(F, D, rngs=rngs)
        self.norm = nnx.BatchNorm(D, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.calls = Counter(jnp.zeros((), jnp.int32))

    def __call__(self, x, *, train: bool = True):  # x: [batch, seq, D]
        self.calls[...] += 1
        x = tag(x, "layer_input")
        h = self.norm(x, use_running_average=not train)
        q, k, v = jnp.split(self.qkv(h), 3, -1)  # [batch, seq, D] each
        q, k, v = tag(q, "q_proj"), tag(k, "k_proj"), tag(v, "v_proj")
        probs = jax.nn.softmax(jnp.einsum("bsd,btd->bst", q, k), axis=-1)  # [batch, seq, seq]
        ctx = tag(jnp.einsum("bst,btd->bsd", probs, v), "context")
        x = x + self.drop(tag(self.o(ctx), "attn_out"), deterministic=not train)
        g, u = jnp.split(self.gate_up(x), 2, -1)  # [batch, seq, F] each
        g, u = tag(g, "mlp_gate"), tag(u, "mlp_up")
        return x + tag(self.down(jax.nn.silu(g) * u), "mlp_out")


class Tagged(nnx.Module):
    """The smallest tagged block."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return x + tag(self.lin(x), "mlp_up")


class Curved(nnx.Module):
    """A tagged block whose tagged value its backward pass needs (sin'), so selective's choice shows."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return x + jnp.sin(tag(self.lin(x), "mlp_up"))


class FlagBlock(nnx.Module):
    """A block taking a Python flag positionally (needs static_argnums=(2,))."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x, double):
        y = jnp.tanh(self.lin(x))
        return 2 * y if double else y


#: Every variable but parameters and RNG keys: what a forward pass updates (keys cannot be compared as numbers).
UPDATED = nnx.Not(nnx.Any(nnx.Param, nnx.RngKey))

X = jax.random.normal(jax.random.key(1), (2, 4, D))


def loss_fn(model, x=X):
    return jnp.mean(model(x) ** 2)


def nonzero_per_layer(tree, layers=None):
    """Every leaf (every layer of it, when stacked) has a non-zero entry."""
    for leaf in jax.tree.leaves(tree):
        a = np.abs(np.asarray(leaf))
        per = a.reshape(layers, -1).max(axis=1) if layers else a.max(keepdims=True)
        if not (per > 0).all():
            return False
    return True


def kept_bytes(model) -> int:
    """Bytes the backward pass of ``loss_fn(model)`` keeps beyond its arguments (a pure split/merge function)."""
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    res = _jax_internals.saved_residuals(lambda p, o, x: loss_fn(nnx.merge(graphdef, p, o), x), params, other, X)
    return sum(r.nbytes for r in res if not r.is_argument)


# ---- policy(instance) ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", INSTANCE_SPECS, ids=INSTANCE_SPECS)
def test_instance_wrapped_outside_grad_matches_bare(spec):
    # The zero-gradient trap: the wrapper is built ONCE, outside nnx.grad, then differentiated. A wrapper
    # that captured the module in a closure would get all-zero gradients here.
    block = TinyBlock(nnx.Rngs(0))
    bare = nnx.clone(block)
    wrapped = policies.parse(spec)(block)
    assert isinstance(wrapped, wrap_nnx.Remat) and wrapped.module is block  # owned, also under none
    grads = nnx.jit(nnx.grad(loss_fn))(wrapped)
    expected = nnx.grad(loss_fn)(bare)
    got = nnx.state(grads, nnx.Param)["module"]
    want = nnx.state(expected, nnx.Param)
    assert max_rel_err(got, want) <= RTOL_F32
    assert nonzero_per_layer(got)
    # Updated state (BatchNorm statistics, the custom counter, RNG counts) written back as without remat.
    assert max_rel_err(nnx.state(wrapped.module, UPDATED), nnx.state(bare, UPDATED)) <= RTOL_F32
    assert int(wrapped.module.calls[...]) == 1


def test_instance_trains_with_optimizer_under_jit(spec="selective"):
    def train(model, steps=2):
        opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt):
            value, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return value

        return [float(step(model, opt)) for _ in range(steps)]

    bare = TinyBlock(nnx.Rngs(0))
    wrapped = policies.parse(spec)(nnx.clone(bare))
    before = jax.tree.map(np.array, nnx.state(bare, nnx.Param))  # a copy: training updates in place
    losses, expected = train(wrapped), train(bare)
    np.testing.assert_allclose(losses, expected, rtol=RTOL_F32)
    assert max_rel_err(nnx.state(wrapped.module, nnx.Param), nnx.state(bare, nnx.Param)) <= RTOL_F32
    assert max_rel_err(nnx.state(bare, nnx.Param), before) > 0  # it really trained


def test_instance_static_argnums_and_static_kwargs():
    block = FlagBlock(nnx.Rngs(0))
    wrapped = wrap_nnx.remat(policies.full(), FlagBlock(nnx.Rngs(0)), static_argnums=(2,))
    got = nnx.grad(lambda m: jnp.sum(m(X, True)))(wrapped)
    want = nnx.grad(lambda m: jnp.sum(m(X, True)))(block)
    assert max_rel_err(got["module"], want) <= RTOL_F32
    # A keyword flag is static without any argument (TinyBlock's train=...).
    eval_out = policies.full()(TinyBlock(nnx.Rngs(0)))(X, train=False)
    np.testing.assert_allclose(eval_out, TinyBlock(nnx.Rngs(0))(X, train=False), rtol=RTOL_F32)


def test_instance_rejects_a_class_and_bad_static_argnums():
    with pytest.raises(TypeError, match=r"policy\(TinyBlock\(\.\.\., rngs=nnx.Rngs\(0\)\)\)"):
        wrap_nnx.remat(policies.full(), TinyBlock)
    with pytest.raises(ValueError, match="0 is the module itself"):
        wrap_nnx.remat(policies.full(), FlagBlock(nnx.Rngs(0)), static_argnums=(0,))


def test_instance_residuals_shrink_full_selective_none():
    kept = {}
    for spec in ("none", "selective", "full"):
        kept[spec] = kept_bytes(policies.parse(spec)(TinyBlock(nnx.Rngs(0))))
    assert 0 < kept["full"] < kept["selective"] < kept["none"], kept


# ---- the tag rule ----------------------------------------------------------------------------------


def test_instance_misspelt_tag_raises_with_nearest_name():
    wrapped = policies.selective(["mlp_upp"])(TinyBlock(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"TinyBlock never emits: mlp_upp \(did you mean 'mlp_up'\?\)"):
        nnx.grad(loss_fn)(wrapped)


def test_stack_missing_or_misspelt_tag_raises():
    layers = rk_nnx.stack(Tagged, 2, "selective", rngs=nnx.Rngs(0))
    # Its tags and (a name missing) its module and parameter paths, any of which a policy may name.
    message = r"Tagged never emits: q_proj, k_proj.*; it emits: layer_input, lin, lin/kernel, mlp_up$"
    with pytest.raises(ValueError, match=message):
        layers(X)
    layers = rk_nnx.stack(Tagged, 2, policies.selective(["mlp_upp"]), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mlp_upp \(did you mean 'mlp_up'\?\)"):
        nnx.grad(loss_fn)(layers)


def test_tag_check_runs_once_per_signature(monkeypatch):
    calls = []
    real = tags.emitted_tags
    monkeypatch.setattr(tags, "emitted_tags", lambda *a: calls.append(1) or real(*a))
    wrapped = policies.selective(["mlp_up"])(Tagged(nnx.Rngs(0)))
    layers = rk_nnx.stack(Tagged, 2, policies.selective(["mlp_up"]), rngs=nnx.Rngs(0))
    for model in (wrapped, layers, wrapped, layers):
        model(X)
    assert len(calls) == 2
    layers(X[:1])  # a new input shape is a new signature
    assert len(calls) == 3


# ---- stack -------------------------------------------------------------------------------------------


@functools.cache
def stack_run(spec: str, depth: int):
    """Build a stack, take one gradient; return (initial params, grads, state after, output)."""
    layers = rk_nnx.stack(TinyBlock, depth, spec, rngs=nnx.Rngs(0))
    init = nnx.state(layers, nnx.Param)
    value_and_grad = nnx.jit(nnx.value_and_grad(loss_fn))
    value, grads = value_and_grad(layers)
    return init, nnx.state(grads, nnx.Param), nnx.state(layers, UPDATED), value


@pytest.mark.parametrize("spec", ALL_SPECS, ids=ALL_SPECS)
def test_stack_matches_none(spec, depth=DEPTH):
    init, grads, after, value = stack_run(spec, depth)
    init0, grads0, after0, value0 = stack_run("none", depth)
    # Same rngs, same parameters, whatever the policy.
    assert max_rel_err(init, init0) == 0
    assert abs(float(value) - float(value0)) <= RTOL_F32 * abs(float(value0))
    assert max_rel_err(grads, grads0) <= RTOL_F32
    assert nonzero_per_layer(grads, depth)
    # BatchNorm statistics, the custom Counter and the dropout RNG counts, updated per layer as under none.
    assert max_rel_err(after, after0) <= RTOL_F32
    assert nonzero_per_layer(nnx.state(after, nnx.BatchStat), depth)
    np.testing.assert_array_equal(after["layers"]["calls"][...], np.ones(depth))
    np.testing.assert_array_equal(after["layers"]["drop"]["rngs"]["count"][...], np.ones(depth))


def test_stack_layers_are_stacked_and_distinct():
    init = stack_run("none", DEPTH)[0]
    kernel = np.asarray(init["layers"]["qkv"]["kernel"][...])
    assert kernel.shape == (DEPTH, D, 3 * D)
    assert not np.allclose(kernel[0], kernel[1])  # per-layer RNG streams, not one copy


def test_stack_eval_mode_keeps_statistics():
    layers = rk_nnx.stack(TinyBlock, 2, "full", rngs=nnx.Rngs(0))
    before = nnx.state(layers, nnx.BatchStat)
    out = layers(X, train=False)
    assert out.shape == X.shape
    assert max_rel_err(nnx.state(layers, nnx.BatchStat), before) == 0


def test_stack_residuals_shrink_in_order():
    specs = ("none", "every_n:2", "selective", "full", "segments:2")
    kept = {spec: kept_bytes(rk_nnx.stack(TinyBlock, 4, spec, rngs=nnx.Rngs(0))) for spec in specs}
    assert kept["full"] < kept["selective"] < kept["none"], kept
    assert kept["full"] < kept["every_n:2"] < kept["none"], kept
    assert kept["segments:2"] < kept["full"], kept


# ---- a mix (policies.mix): one stacked tree, each range of layers under its own policy --------------

#: Mixes over DEPTH layers, every policy kind in some part.
MIXES = ["full*1+none*2", "none*1+every_n:2*2", "segments:2*2+offload*1", "selective*2+dots*1", "sqrt_n*2+full*1"]


@pytest.mark.parametrize("spec", MIXES, ids=MIXES)
def test_stack_under_a_mix_matches_none(spec, depth=DEPTH):
    init, grads, after, value = stack_run(spec, depth)
    init0, grads0, after0, value0 = stack_run("none", depth)
    assert max_rel_err(init, init0) == 0
    assert abs(float(value) - float(value0)) <= RTOL_F32 * abs(float(value0))
    assert max_rel_err(grads, grads0) <= RTOL_F32
    assert nonzero_per_layer(grads, depth)
    assert max_rel_err(after, after0) <= RTOL_F32
    np.testing.assert_array_equal(after["layers"]["calls"][...], np.ones(depth))
    np.testing.assert_array_equal(after["layers"]["drop"]["rngs"]["count"][...], np.ones(depth))


def kept_activations(model) -> list[tuple[int, ...]]:
    """Shapes of the float32 values the backward pass of ``sum(model(X))`` keeps beyond its arguments.

    The int32 residuals left out are the layer indices each scan keeps.
    """
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    res = _jax_internals.saved_residuals(lambda p, o, x: jnp.sum(nnx.merge(graphdef, p, o)(x)), params, other, X)
    return sorted(r.shape for r in res if not r.is_argument and r.dtype == "float32")


def test_stack_under_a_mix_keeps_what_each_part_keeps():
    """full*2+selective:mlp_up*4 keeps full's 2 inputs and selective's 4 inputs + 4 mlp_up: no weight slice."""
    layers = rk_nnx.stack(Curved, 6, "full*2+selective:mlp_up*4", rngs=nnx.Rngs(0))
    assert kept_activations(layers) == [(2, 2, 4, D), (4, 2, 4, D), (4, 2, 4, D)]


@pytest.mark.parametrize("spec", ["none*2+full*4", "every_n:2*4+full*2", "segments:2*4+none*2"])
def test_stack_under_a_mix_keeps_its_parts_own_stacks_residuals(spec):
    mix = policies.parse(spec)
    parts = [s for p, n in mix.parts for s in kept_activations(rk_nnx.stack(Curved, n, p, rngs=nnx.Rngs(0)))]
    assert kept_activations(rk_nnx.stack(Curved, 6, mix, rngs=nnx.Rngs(0))) == sorted(parts)


def test_stack_under_a_mix_checks_each_part_by_its_own_rule():
    with pytest.raises(ValueError, match=r"policy selective:q_proj names tags that Tagged never emits: q_proj"):
        rk_nnx.stack(Tagged, 3, "full*1+selective:q_proj*2", rngs=nnx.Rngs(0))(X)
    rk_nnx.stack(Tagged, 3, "full*1+selective:q_proj;strict=false*2", rngs=nnx.Rngs(0))(X)
    with pytest.raises(ValueError, match=r"counts sum to 4 layers but the stack has 3"):
        rk_nnx.stack(Tagged, 3, "full*2+none*2", rngs=nnx.Rngs(0))


# ---- bad input, before tracing ------------------------------------------------------------------------


def test_stack_bad_input_raises_before_tracing():
    built = []

    def make_block(rngs):
        built.append(1)
        return TinyBlock(rngs)

    with pytest.raises(TypeError, match="make_block must be a callable"):
        rk_nnx.stack(3, 2, "full", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"make_block: pass the class \(or a factory .*\), not an instance"):
        rk_nnx.stack(TinyBlock(nnx.Rngs(0)), 2, "full", rngs=nnx.Rngs(0))
    built_outside = TinyBlock(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"make_block closes over the NNX module TinyBlock; .* lambda rngs: TinyBlock"):
        rk_nnx.stack(lambda rngs: built_outside, 2, "full", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="num_layers must be a positive integer"):
        rk_nnx.stack(make_block, 2.5, "full", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        rk_nnx.stack(make_block, 0, "full", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="greater than the depth"):
        rk_nnx.stack(make_block, 2, "every_n:3", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown policy spec"):
        rk_nnx.stack(make_block, 2, "fulll", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"rngs must be an nnx\.Rngs"):
        rk_nnx.stack(make_block, 2, "full", rngs=0)
    assert not built
    with pytest.raises(TypeError, match=r"must return an nnx\.Module"):
        rk_nnx.stack(lambda rngs: 3, 2, "full", rngs=nnx.Rngs(0))
    layers = rk_nnx.stack(Tagged, 2, "full", rngs=nnx.Rngs(0))
    # Call-time nnx.Rngs are split per layer (tests/test_third_party.py); any other NNX object is refused.
    with pytest.raises(TypeError, match=r"arrays, Python values or nnx\.Rngs, got Linear; give the blocks"):
        layers(X, nnx.Linear(2, 2, rngs=nnx.Rngs(1)))


def test_stack_block_with_wrong_output_raises():
    class Widen(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, 2 * D, rngs=rngs)

        def __call__(self, x):
            return self.lin(x)

    with pytest.raises(TypeError, match="Widen must return one array shaped like its input"):
        rk_nnx.stack(Widen, 2, "full", rngs=nnx.Rngs(0))(X)


# ---- a module captured in a closure ---------------------------------------------------------------------------


def test_function_closing_over_a_module_is_refused_under_a_transform():
    block = nnx.Linear(8, 8, rngs=nnx.Rngs(0))  # no state that a call mutates
    x = jnp.ones((2, 8))
    captured = policies.full()(lambda x: block(x))  # the module is a closure cell, not an argument
    bound = policies.full()(block.__call__)
    layers, named = [block], {"blocks": (block,)}  # held inside containers the closure holds
    in_list = policies.full()(lambda x: layers[0](x))
    in_dict = policies.full()(lambda x: named["blocks"][0](x))
    assert captured(x).shape == x.shape  # eager, outside any transform: it runs as it is
    for fn in (captured, bound, in_list, in_dict):
        with pytest.raises(ValueError, match=r"closes over the NNX module Linear, .* all-zero gradients"):
            nnx.grad(lambda m, fn=fn: fn(x).sum())(block)
    # Wrapped inside the transform, the closure holds the traced module: gradients flow as without remat.
    inside = nnx.grad(lambda m: policies.full()(lambda x: m(x))(x).sum())(block)
    bare = nnx.grad(lambda m: m(x).sum())(block)
    assert max_rel_err(jax.tree.leaves(inside), jax.tree.leaves(bare)) <= RTOL_F32
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(inside))
