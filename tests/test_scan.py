"""The scan core, observed through JAX's own residual analysis (Haliax's test_checkpoint_carries idea)."""

import collections
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err

import remat_kit
from remat_kit import _jax_internals as internals
from remat_kit import policies as P
from remat_kit.model.transformer import TransformerConfig
from remat_kit.names import tag
from remat_kit.planning import analysis

B, S, D, F = 2, 3, 8, 24


class Block(nn.Module):
    """A small user block: tagged, with dropout, shapes chosen so every value is recognizable."""

    rate: float = 0.0

    @nn.compact
    def __call__(self, x, deterministic=True):  # x: [B, S, D]
        x = tag(x, "layer_input")
        q = tag(nn.Dense(D, name="q")(x), "q_proj")
        up = tag(nn.Dense(F, name="up")(jnp.tanh(q)), "mlp_up")
        act = tag(jnp.sin(up), "mlp_act")
        out = nn.Dense(D, name="down")(act)
        return x + nn.Dropout(self.rate)(out, deterministic=deterministic)


def _policy(spec):
    """The spec as a policy, with selective/offload aimed at a tag this block emits."""
    return P.parse(spec + ":q_proj" if spec in ("selective", "offload") else spec)


def _setup(depth, policy, rate=0.0):
    layers = remat_kit.stack(functools.partial(Block, rate=rate), depth, policy)
    x = jax.random.normal(jax.random.key(0), (B, S, D))
    params = remat_kit.stack(Block, depth, "none").init(jax.random.key(1), x)
    return layers, params, x


def _loss(layers, rate=0.0):
    def loss(params, x):
        kw = {} if rate == 0 else {"deterministic": False, "rngs": {"dropout": jax.random.key(7)}}
        return jnp.sum(layers.apply(params, x, **kw) ** 2)

    return loss


def _activations(depth, policy):
    """Saved residuals that are not arguments (parameters, input): the activation memory."""
    layers, params, x = _setup(depth, policy)
    # A linear read-out keeps nothing itself, so every residual belongs to the stack.
    loss = lambda p, x: jnp.sum(layers.apply(p, x))
    return [r for r in internals.saved_residuals(loss, params, x) if not r.is_argument]


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("depth", [4, 5], ids=["L4", "L5"])
@pytest.mark.parametrize("rate", [0.0, 0.3], ids=["nodrop", "dropout"])
def test_gradients_equal_none(spec, depth, rate):
    layers, params, x = _setup(depth, _policy(spec), rate)
    reference, _, _ = _setup(depth, "none", rate)
    g = jax.jit(jax.grad(_loss(layers, rate), argnums=(0, 1)))(params, x)
    g0 = jax.jit(jax.grad(_loss(reference, rate), argnums=(0, 1)))(params, x)
    assert max_rel_err(g, g0) <= RTOL_F32


def test_dropout_is_active_and_layer_dependent():
    layers, params, x = _setup(4, "full", rate=0.5)
    a = layers.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(7)})
    b = layers.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(8)})
    assert not jnp.allclose(a, b)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_parameters_identical_under_every_policy(spec):
    x = jnp.ones((B, S, D))
    ref = remat_kit.stack(Block, 5, "none").init(jax.random.key(3), x)
    got = remat_kit.stack(Block, 5, _policy(spec)).init(jax.random.key(3), x)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert max_rel_err(got, ref) == 0.0
    assert got["params"]["layers"]["up"]["kernel"].shape == (5, D, F)


def test_layers_get_different_initial_parameters():
    params = remat_kit.stack(Block, 3, "none").init(jax.random.key(3), jnp.ones((B, S, D)))
    k = params["params"]["layers"]["q"]["kernel"]
    assert not jnp.allclose(k[0], k[1])


# ---- what each policy keeps -------------------------------------------------------------------------


def _shape_counts(residuals):
    return collections.Counter((r.shape, r.host) for r in residuals)


def test_full_keeps_only_the_stacked_layer_inputs():
    assert [(r.shape, r.host) for r in _activations(6, P.full())] == [((6, B, S, D), False)]


def test_selective_keeps_exactly_the_named_values_plus_inputs():
    got = _shape_counts(_activations(6, P.selective(["q_proj"])))
    assert got == collections.Counter({((6, B, S, D), False): 2})  # q_proj and the layer inputs
    got = _shape_counts(_activations(6, P.selective(["mlp_up"])))
    assert got == collections.Counter({((6, B, S, D), False): 1, ((6, B, S, F), False): 1})


def test_offload_residuals_live_in_host_memory():
    got = _activations(6, P.offload())  # the layer inputs, offloaded
    assert [(r.shape, r.host) for r in got] == [((6, B, S, D), True)]
    got = _shape_counts(_activations(6, P.offload(["mlp_up"], save=["q_proj"])))
    assert got == collections.Counter({((6, B, S, F), True): 1, ((6, B, S, D), False): 2})


def test_none_keeps_internals_of_every_layer():
    acts = _activations(6, P.none())
    assert all(r.shape[0] == 6 for r in acts if len(r.shape) == 4)
    assert sum(1 for r in acts if r.shape == (6, B, S, F)) >= 2  # mlp_up and its sine's input/derivative


def test_every_n_keeps_full_internals_for_half_the_layers():
    none = _shape_counts(r for r in _activations(6, P.none()) if r.shape[1:] in {(B, S, D), (B, S, F)})
    every = _activations(6, P.every_n(2))
    # Groups of 2: the first layer keeps its input only ([3, B, S, D]); the second keeps what `none` keeps.
    inputs = [r for r in every if r.shape == (3, B, S, D)]
    internals_ = _shape_counts(
        dataclasses.replace(r, shape=(6, *r.shape[2:])) for r in every if r.shape[:2] == (3, 1) and len(r.shape) == 5
    )
    assert len(inputs) == 1
    acts = collections.Counter({k: v for k, v in internals_.items() if k[0][1:] in {(B, S, D), (B, S, F)}})
    if internals.remat3_enabled():
        # remat3 keeps only the matmul outputs of the plain layers (_layers.keep_all): a subset.
        assert acts and not acts - none
    else:
        assert acts == none


@pytest.mark.parametrize(("depth", "k"), [(8, 2), (8, 4), (9, 4), (5, 5)], ids=["L8k2", "L8k4", "L9k4", "L5k5"])
def test_segments_keep_one_input_per_group(depth, k):
    acts = _activations(depth, P.segments(k))
    groups = sum(r.shape[0] for r in acts if r.shape[1:] == (B, S, D))
    assert groups == -(-depth // k)
    assert all(r.shape[1:] == (B, S, D) for r in acts if r.dtype == "float32")


def test_sqrt_n_groups_by_root_of_depth():
    acts = _activations(16, P.sqrt_n())
    assert [r.shape for r in acts if r.dtype == "float32"] == [(4, B, S, D)]


# ---- one scan, not L unrolled blocks ---------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_one_block_compiled_whatever_the_depth(spec):
    counts = []
    for depth in (4, 16):
        layers, params, x = _setup(depth, _policy(spec))
        jaxpr = jax.make_jaxpr(jax.grad(_loss(layers)))(params, x)
        counts.append(internals.count_primitive(jaxpr, "dot_general"))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("spec", ["none", "full", "selective:q_proj", "dots"])
def test_forward_is_one_scan_over_the_layers(spec):
    layers, params, x = _setup(12, spec)
    jaxpr = jax.make_jaxpr(layers.apply)(params, x)
    assert internals.count_primitive(jaxpr, "scan") == 1
    assert internals.count_primitive(jaxpr, "dot_general") == 3  # one block's three matmuls


# ---- tag checks ---------------------------------------------------------------------------------------


def test_policy_naming_a_tag_the_block_never_emits_is_an_error():
    layers, params, x = _setup(4, P.selective(["q_proj", "attn_probs", "context"]))
    # What it emits: its tags and (a name missing) its module and parameter paths, any of which a policy may name.
    message = r"never emits: attn_probs, context; it emits: .*\bdown/kernel, layer_input, mlp_act, mlp_up, q, q/kernel"
    with pytest.raises(ValueError, match=message):
        layers.apply(params, x)


def test_misspelt_tag_suggests_the_nearest_emitted_one():
    layers, params, x = _setup(4, P.selective(["mlp_upp"]))
    with pytest.raises(ValueError, match=r"Block never emits: mlp_upp \(did you mean 'mlp_up'\?\)"):
        layers.apply(params, x)


def test_strict_false_opts_out_of_the_tag_check():
    layers, params, x = _setup(4, P.selective(["q_proj", "not_there"], strict=False))
    assert layers.apply(params, x).shape == x.shape


def test_offload_of_missing_tag_is_an_error():
    layers, params, x = _setup(4, P.offload(["attn_out"]))
    with pytest.raises(ValueError, match="never emits: attn_out"):
        layers.apply(params, x)


# ---- every collection, every RNG stream, (x, aux) outputs ------------------------------------------


class StatefulBlock(nn.Module):
    """BatchNorm (mutable batch_stats), dropout, a second RNG stream, a positional flag, an aux output."""

    @nn.compact
    def __call__(self, x, train, scale):  # x: [B, D]; train: Python bool; scale: a broadcast array
        h = tag(nn.Dense(D, name="q")(x), "q_proj")
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(h)
        h = nn.Dropout(0.3)(jnp.tanh(h), deterministic=not train)
        if train:
            h = h + 0.1 * jax.random.normal(self.make_rng("noise"), h.shape)
        return x + scale * h, jnp.mean(h**2)


SX = jax.random.normal(jax.random.key(4), (B, D))
SCALE = jnp.full((1, D), 0.5)


def _stateful_step(spec, depth=5):
    layers = remat_kit.stack(StatefulBlock, depth, _policy(spec))
    variables = remat_kit.stack(StatefulBlock, depth, "none").init(jax.random.key(5), SX, False, SCALE)

    def loss(params, x):
        (y, aux), updated = layers.apply(
            {"params": params, "batch_stats": variables["batch_stats"]},
            x,
            True,
            SCALE,
            rngs={"dropout": jax.random.key(6), "noise": jax.random.key(7)},
            mutable=["batch_stats"],
        )
        return jnp.sum(y**2) + jnp.sum(aux), (updated["batch_stats"], aux)

    grads, (stats, aux) = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(variables["params"], SX)
    return variables, grads, stats, aux


@functools.cache
def _stateful_reference():
    return _stateful_step("none")


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if s != "none"])
def test_collections_rngs_and_aux_equal_none(spec):
    variables, g0, stats0, aux0 = _stateful_reference()
    _, g, stats, aux = _stateful_step(spec)
    assert max_rel_err((g, stats, aux), (g0, stats0, aux0)) <= RTOL_F32
    assert all(float(jnp.max(jnp.abs(leaf))) > 0 for leaf in jax.tree.leaves(g))
    assert aux.shape == (5,)
    # batch_stats are stacked like params and really updated, layer by layer.
    assert stats["layers"]["BatchNorm_0"]["mean"].shape == (5, D)
    assert max_rel_err(stats, variables["batch_stats"]) > 0.1


def test_stack_updates_collections_exactly_as_a_plain_loop():
    """No remat, no stack: the same blocks in a Python loop give the same outputs and batch_stats."""
    variables = remat_kit.stack(StatefulBlock, 3, "none").init(jax.random.key(5), SX, False, SCALE)
    # train=False reads the running statistics; train=True with no RNG would fail, so use BatchNorm's
    # training path through a block copy whose dropout and noise are off.
    (y, aux), updated = remat_kit.stack(StatefulBlock, 3, "full").apply(
        variables, SX, False, SCALE, mutable=["batch_stats"]
    )
    h, auxes = SX, []
    for i in range(3):
        layer = {col: jax.tree.map(lambda a, i=i: a[i], tree["layers"]) for col, tree in variables.items()}
        h, a = StatefulBlock().apply(layer, h, False, SCALE)
        auxes.append(a)
    assert max_rel_err((y, aux), (h, jnp.stack(auxes))) <= RTOL_F32
    assert max_rel_err(updated, {"batch_stats": variables["batch_stats"]}) == 0.0


def test_rng_streams_beyond_dropout_reach_every_layer():
    variables = remat_kit.stack(StatefulBlock, 3, "none").init(jax.random.key(5), SX, False, SCALE)
    layers = remat_kit.stack(StatefulBlock, 3, "full")

    def run(noise):
        rngs = {"dropout": jax.random.key(0), "noise": jax.random.key(noise)}
        return layers.apply(variables, SX, True, SCALE, rngs=rngs, mutable=["batch_stats"])[0][1]

    assert not jnp.allclose(run(1), run(2))


def test_stack_keeps_full_lt_selective_lt_every_n_lt_none():
    kept = {spec: sum(r.nbytes for r in _activations(6, _policy(spec))) for spec in ALL_SPECS}
    assert kept["full"] < kept["selective"] < kept["none"]
    assert kept["full"] < kept["every_n:2"] < kept["none"]


@pytest.mark.parametrize(("depth", "n"), [(4, 2), (5, 3)], ids=["L4n2", "L5n3-remainder"])
def test_every_n_keeps_no_weight_slices(depth, n):
    """Its saved bytes are the ideal mix of none and full layers (within 2 %) on the tiny preset."""
    cfg = TransformerConfig.preset("tiny", num_layers=depth)
    none, full, got = (analysis.layer_stack_bytes(cfg, spec, 2, 16)[0] for spec in ("none", "full", f"every_n:{n}"))
    rematerialized = len(range(0, depth, n))  # the first layer of each group, the remainder's included
    ideal = ((depth - rematerialized) * none + rematerialized * full) / depth
    if internals.remat3_enabled():
        # remat3 asks keep_activations only at names and matmuls: elementwise work is recomputed too.
        assert full < got <= 1.02 * ideal
    else:
        assert ideal <= got <= 1.02 * ideal


def test_every_n_with_a_remainder_group_gradients_equal_none():
    layers, params, x = _setup(5, P.every_n(3), rate=0.3)
    reference, _, _ = _setup(5, "none", rate=0.3)
    g = jax.jit(jax.grad(_loss(layers, 0.3), argnums=(0, 1)))(params, x)
    g0 = jax.jit(jax.grad(_loss(reference, 0.3), argnums=(0, 1)))(params, x)
    assert max_rel_err(g, g0) <= RTOL_F32


class WrongOutput(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D + 1)(x)


def test_block_output_not_shaped_like_its_input_is_a_clear_error():
    layers = remat_kit.stack(WrongOutput, 3, "full")
    with pytest.raises(ValueError, match=r"WrongOutput returns float32\[2, 3, 9\] for an input float32\[2, 3, 8\]"):
        layers.init(jax.random.key(0), jnp.ones((B, S, D)))


# ---- bad input to stack ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((Block, 0, "full"), ValueError, r"num_layers must be a positive integer, got 0"),
        ((Block, 2.0, "full"), TypeError, r"num_layers must be a positive integer, got 2.0"),
        ((Block, 4, "every_n:5"), ValueError, r"period=5 is greater than the depth \(4 layers\)"),
        ((Block, 4, "segments:0"), ValueError, r"got 0"),
        ((Block, 4, "bogus"), ValueError, r"unknown policy spec 'bogus'"),
        (("Block", 4, "full"), TypeError, r"block must be a Flax module class"),
        ((Block(), 4, "full"), TypeError, r"block: pass the class \(or a factory .*\), not an instance: got Block"),
    ],
    ids=["depth-0", "depth-float", "every_n-too-big", "segments-0", "bad-spec", "block-not-callable", "block-instance"],
)
def test_stack_rejects_bad_input_before_tracing(args, error, match):
    with pytest.raises(error, match=match):
        remat_kit.stack(*args)
