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

from remat_kit import _jax_internals as internals
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


# ---- MaxText's names: aliases both ways, presets keep what MaxText's keep --------------------------------

_MINIMAL = ["query_proj", "value_proj", "key_proj", "qkv_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo"]
_cp = jax.checkpoint_policies
#: What MaxText's own presets hand jax.checkpoint (its names, as data).
MAXTEXT_PRESETS = {
    "minimal": _cp.save_only_these_names(*_MINIMAL),
    "minimal_with_context": _cp.save_only_these_names(*_MINIMAL, "context"),
    "save_dot_except_mlp": _cp.save_only_these_names("query_proj", "value_proj", "key_proj", "qkv_proj", "out_proj"),
    "save_qkv_proj": _cp.save_only_these_names("query_proj", "value_proj", "key_proj", "qkv_proj"),
    "save_out_proj": _cp.save_only_these_names("out_proj"),
    "qkv_proj_offloaded": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["query_proj", "value_proj", "key_proj"],
        offload_src="device",
        offload_dst="pinned_host",
    ),
    "minimal_offloaded": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=_MINIMAL,
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def _kept(cls, **fields):
    """What the backward pass keeps, as sorted (tag, shape, dtype, host) rows: the inputs left out."""
    loss, params = _loss(cls, **fields)
    rows = internals.saved_residuals(loss, params, X)
    return sorted((r.tag or "", r.shape, r.dtype, r.host) for r in rows if not r.is_argument)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("preset", sorted(MAXTEXT_PRESETS))
def test_maxtext_preset_keeps_what_maxtext_keeps_on_a_maxtext_layer(preset, fused):
    fields = {"fused_qkv": fused, "fused_mlp": fused}
    ours = _kept(P.parse(preset)(MaxTextStyleLayer, static_argnums=(-1, -2)), **fields)
    theirs = MAXTEXT_PRESETS[preset]
    if preset == "qkv_proj_offloaded" and fused:
        # MaxText's list names only the unfused projections, so its preset recomputes a fused qkv_proj
        # silently; ours offloads the fused value (the one value q/k/v are).
        theirs = _cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["qkv_proj"],
            offload_src="device",
            offload_dst="pinned_host",
        )
    theirs = _kept(nn.remat(MaxTextStyleLayer, policy=theirs, static_argnums=(3, 4)), **fields)
    assert ours == theirs
    assert any(tag or host for tag, _, _, host in ours)  # it keeps named values, not just inputs


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "strict_false"])
@pytest.mark.parametrize("name", ["query_proj", "q_proj"])
def test_alias_keeps_the_value_whichever_spelling_the_code_emits(name, strict):
    policy = P.selective([name], strict=strict)
    kept = _kept(policy(MaxTextStyleLayer, static_argnums=(3, 4)))
    assert [row for row in kept if row[0]] == [("query_proj", (B, S, H, HD), "float32", False)]


def test_strict_false_never_changes_what_is_kept():
    for spec in ("selective:query_proj,mlpwi", "offload:out_proj;save=key_proj"):
        strict = _kept(P.parse(spec)(MaxTextStyleLayer, static_argnums=(3, 4)))
        lax = _kept(P.parse(spec + ";strict=false")(MaxTextStyleLayer, static_argnums=(3, 4)))
        assert strict == lax


def test_a_group_alias_matches_the_fused_value_and_a_missing_tag_still_raises():
    kept = _kept(P.parse("selective:qkv_proj")(MaxTextStyleLayer, static_argnums=(3, 4)), fused_qkv=True)
    assert [row[:2] for row in kept if row[0]] == [("qkv_proj", (B, S, 3, H, HD))]
    with pytest.raises(ValueError, match=r"q_proj \(did you mean 'qkv_proj'\?\)"):
        _kept(P.parse("selective:q_proj")(MaxTextStyleLayer, static_argnums=(3, 4)), fused_qkv=True)


# ---- the stack owns (and tags) each layer's input -------------------------------------------------------


class GemmaStyleBlock(nn.Module):
    """A gm.nn-style block: submodules made in ``setup``, no ``checkpoint_name`` anywhere."""

    width: int = D

    def setup(self):
        self.pre_attention_norm = nn.RMSNorm()
        self.attn = nn.Dense(self.width, use_bias=False)
        self.pre_ffw_norm = nn.RMSNorm()
        self.mlp = nn.Dense(self.width, use_bias=False)

    def __call__(self, x):
        x = x + self.attn(self.pre_attention_norm(x))
        return x + self.mlp(jax.nn.gelu(self.pre_ffw_norm(x)))


class NnxGemmaStyleBlock(nnx.Module):
    """A Flax-NNX-Gemma-style block: untagged, dropout drawn from call-time ``rngs``."""

    def __init__(self, rngs: nnx.Rngs):
        self.pre_attention_norm = nnx.RMSNorm(D, rngs=rngs)
        self.attn = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.mlp = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = x + self.attn(self.pre_attention_norm(x))
        return x + self.dropout(self.mlp(jax.nn.gelu(x)), rngs=rngs, deterministic=rngs is None)


def _linen_stack_rows(spec, depth=3):
    import remat_kit

    layers = remat_kit.stack(GemmaStyleBlock, depth, spec)
    params = layers.init(jax.random.key(0), X)
    rows = internals.saved_residuals(lambda p, x: jnp.sum(layers.apply(p, x) ** 2), params, X)
    return [r for r in rows if not r.is_argument]


def _nnx_stack_rows(spec, depth=3):
    import remat_kit.nnx

    layers = remat_kit.nnx.stack(NnxGemmaStyleBlock, depth, spec, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layers)
    rows = internals.saved_residuals(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2), state, X)
    return [r for r in rows if not r.is_argument]


@pytest.mark.parametrize("rows", [_linen_stack_rows, _nnx_stack_rows], ids=["linen", "nnx"])
def test_offload_and_selective_layer_input_apply_to_an_untagged_block_in_a_stack(rows, depth=3):
    offloaded = rows("offload", depth)
    assert [(r.shape, r.host) for r in offloaded if r.host] == [((depth, B, S, D), True)]
    # Keeping the layer input is what full keeps: the stacked inputs [depth, ...] (and the output squared).
    kept = rows("selective:layer_input", depth)
    assert (
        sorted(r.shape for r in kept) == sorted(r.shape for r in rows("full", depth)) == [(B, S, D), (depth, B, S, D)]
    )


# ---- JAX policies, as MaxText / Levanter / Equinox code carries them ------------------------------------

_CP = jax.checkpoint_policies


def _same_rows(a, b):
    return sorted((r.shape, r.dtype, r.host) for r in a) == sorted((r.shape, r.dtype, r.host) for r in b)


@pytest.mark.parametrize("rows", [_linen_stack_rows, _nnx_stack_rows], ids=["linen", "nnx"])
@pytest.mark.parametrize(
    "theirs, ours",
    [(_CP.nothing_saveable, "full"), (_CP.dots_with_no_batch_dims_saveable, "dots"), (_CP.everything_saveable, "none")],
    ids=["nothing_saveable", "dots_no_batch", "everything_saveable"],
)
def test_a_stack_takes_a_jax_policy_and_keeps_what_it_saves(rows, theirs, ours):
    assert _same_rows(rows(theirs), rows(ours))


def test_a_stack_under_a_jax_policy_has_the_plain_gradients():
    import remat_kit

    plain = remat_kit.stack(GemmaStyleBlock, 3, "none")
    params = plain.init(jax.random.key(0), X)
    want = jax.grad(lambda p: jnp.sum(plain.apply(p, X) ** 2))(params)
    for policy in (_CP.dots_saveable, _CP.save_only_these_names("layer_input"), lambda *_, **__: False):
        layers = remat_kit.stack(GemmaStyleBlock, 3, policy)
        got = jax.jit(jax.grad(lambda p, layers=layers: jnp.sum(layers.apply(p, X) ** 2)))(params)
        assert max_rel_err(got, want) <= RTOL_F32


def test_compare_and_auto_take_jax_policies_as_rows():
    import remat_kit
    from remat_kit.planning.fit import auto

    def make_loss(policy):
        layers = remat_kit.stack(GemmaStyleBlock, 3, policy)
        return lambda p, x: jnp.sum(layers.apply(p, x) ** 2)

    params = jax.eval_shape(remat_kit.stack(GemmaStyleBlock, 3).init, jax.random.key(0), X)
    opaque = lambda *_, **__: False  # a user's own policy: a callable with no JAX name
    mine = "jax:test_compare_and_auto_take_jax_policies_as_rows.<locals>.<lambda>"  # its qualified name
    table = remat_kit.compare(make_loss, ["none", "full", _CP.nothing_saveable, opaque], params, X)
    assert table.policies[2:] == ("jax:nothing_saveable", mine)
    assert table["jax:nothing_saveable"].saved_bytes == table["full"].saved_bytes < table["none"].saved_bytes
    assert table[mine].saved_bytes == table["full"].saved_bytes
    ample = auto(make_loss, params, X, budget_bytes=10**12, candidates=["none", opaque], exhaustive=True)
    need = {c.policy: c.need_bytes for c in ample.candidates}
    assert need[mine] < need["none"]
    budget = (need[mine] + need["none"]) // 2
    result = auto(make_loss, params, X, budget_bytes=budget, candidates=["none", opaque], margin=0.0)
    assert str(result.chosen) == mine and result.chosen.jax_policy is opaque
    assert any(mine in row for row in result.table())


# ---- call-time nnx.Rngs, as the NNX Gemma example passes dropout keys ------------------------------------


def _loop_loss(state, graphdef, x, key, depth):
    """The unstacked loop the stack stands for: layer i under the i-th split of one draw of the stream."""
    keys = jax.random.split(nnx.Rngs(dropout=key).dropout(), depth)
    for i in range(depth):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
        x = layer(x, rngs=nnx.Rngs(dropout=keys[i]))
    return jnp.sum(x**2)


@pytest.mark.parametrize("spec", ["none", "full", "every_n:2", "selective:layer_input"])
def test_nnx_stack_takes_call_time_rngs_split_per_layer(spec, depth=3):
    import remat_kit.nnx

    layers = remat_kit.nnx.stack(NnxGemmaStyleBlock, depth, spec, rngs=nnx.Rngs(0))
    key = jax.random.key(7)
    got = nnx.grad(lambda m: jnp.sum(m(X, rngs=nnx.Rngs(dropout=key)) ** 2))(layers)
    graphdef, state = nnx.split(layers.layers)
    want = jax.grad(_loop_loss)(state, graphdef, X, key, depth)
    assert max_rel_err(jax.tree.leaves(got["layers"]), jax.tree.leaves(want)) <= RTOL_F32
    # Dropout is really on (the gradients differ from the deterministic call's).
    deterministic = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(layers)
    assert max_rel_err(jax.tree.leaves(got["layers"]), jax.tree.leaves(deterministic["layers"])) > 1e-3


def test_nnx_stack_with_call_time_rngs_trains_under_nnx_jit():
    import remat_kit.nnx

    layers = remat_kit.nnx.stack(NnxGemmaStyleBlock, 2, "full", rngs=nnx.Rngs(0))

    @nnx.jit
    def loss(m, key):
        return jnp.sum(m(X, rngs=nnx.Rngs(dropout=key)) ** 2)

    a, b = loss(layers, jax.random.key(1)), loss(layers, jax.random.key(2))
    assert float(a) != float(b) and float(loss(layers, jax.random.key(1))) == float(a)
    with pytest.raises(TypeError, match=r"arrays, Python values or nnx.Rngs, got Linear"):
        layers(X, nnx.Linear(D, D, rngs=nnx.Rngs(0)))


# ---- Gemma 3's local/global pattern: one stack over a period of block types ------------------------------


class LocalAttentionBlock(nn.Module):
    """Gemma-3-style local block, inline in ``@nn.compact``: causal attention within a sliding window."""

    window: int = 2

    @nn.compact
    def __call__(self, x):  # x: [b, s, d]
        h = nn.RMSNorm(name="pre_attention_norm")(x)
        q, k, v = (nn.Dense(D, use_bias=False, name=n)(h) for n in ("q", "k", "v"))
        i = jnp.arange(x.shape[1])
        allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < self.window)
        scores = jnp.where(allowed, jnp.einsum("bqd,bkd->bqk", q, k) / D**0.5, -1e9)
        x = x + nn.Dense(D, use_bias=False, name="o")(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), v))
        return x + nn.Dense(D, use_bias=False, name="mlp")(jax.nn.gelu(nn.RMSNorm(name="pre_ffw_norm")(x)))


class GlobalAttentionBlock(LocalAttentionBlock):
    """Gemma-3-style global block: the same layout, attention over the whole causal prefix."""

    window: int = 10**6


PERIOD = [LocalAttentionBlock, LocalAttentionBlock, GlobalAttentionBlock]


def _unrolled_loss(params, x, depth):
    """The loop the period stack stands for: layer i is PERIOD[i % 3] with its slice of the stacked params."""
    for i in range(depth):
        u, j = divmod(i, len(PERIOD))
        p = jax.tree.map(lambda a, u=u: a[u], params["params"]["layers"][str(j)])
        x = PERIOD[j]().apply({"params": p}, x)
    return jnp.sum(x**2)


@pytest.mark.parametrize("spec", ["none", "full", "every_n:2", "selective:layer_input", "segments:2", "full*1+none*1"])
def test_a_period_stack_has_the_unrolled_loops_gradients(spec, depth=6):
    import remat_kit

    layers = remat_kit.stack(PERIOD, depth, spec)
    params = layers.init(jax.random.key(0), X)
    assert jax.tree.map(lambda a: a.shape[0], params)["params"]["layers"].keys() == {"0", "1", "2"}
    assert all(a.shape[0] == depth // 3 for a in jax.tree.leaves(params))
    got = jax.jit(jax.grad(lambda p: jnp.sum(layers.apply(p, X) ** 2)))(params)
    want = jax.grad(_unrolled_loss)(params, X, depth)
    assert max_rel_err(got, want) <= RTOL_F32
    # Each layer has its own parameters: local and global blocks, and the two periods, differ.
    q = params["params"]["layers"]
    assert max_rel_err(q["0"]["q"]["kernel"][0], q["1"]["q"]["kernel"][0]) > 0.1
    assert max_rel_err(q["2"]["q"]["kernel"][0], q["2"]["q"]["kernel"][1]) > 0.1


def test_a_period_stack_keeps_per_block_what_full_keeps_and_checks_tags(depth=6):
    import remat_kit

    def rows(spec):
        layers = remat_kit.stack(PERIOD, depth, spec)
        params = layers.init(jax.random.key(0), X)
        return [
            r
            for r in internals.saved_residuals(lambda p: jnp.sum(layers.apply(p, X) ** 2), params)
            if not r.is_argument
        ]

    full, none = rows("full"), rows("none")
    # full keeps each block's input: three [periods, b, s, d] stacks (one per position), and the output.
    assert sorted(r.shape for r in full) == sorted([(B, S, D)] + [(depth // 3, B, S, D)] * 3)
    assert sum(r.nbytes for r in full) < sum(r.nbytes for r in none)
    with pytest.raises(ValueError, match=r"LocalAttentionBlock\+LocalAttentionBlock\+GlobalAttentionBlock never"):
        rows("selective:q_proj")


def test_a_period_stack_whose_depth_is_not_a_multiple_is_a_clear_error():
    import remat_kit

    with pytest.raises(ValueError, match=r"num_layers=7 is not a multiple of the period of 3 blocks"):
        remat_kit.stack(PERIOD, 7, "full")
    with pytest.raises(ValueError, match=r"every_n:3: period=3 is greater than the depth \(2 layers\)"):
        remat_kit.stack(PERIOD, 6, "every_n:3")  # every_n counts periods here


class NnxLocalBlock(nnx.Module):
    """NNX-Gemma-3-style local block: causal attention within a sliding window (an untagged block)."""

    window = 2

    def __init__(self, rngs: nnx.Rngs):
        self.q, self.k, self.v = (nnx.Linear(D, D, use_bias=False, rngs=rngs) for _ in range(3))
        self.mlp = nnx.Linear(D, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        i = jnp.arange(x.shape[1])
        allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < self.window)
        scores = jnp.where(allowed, jnp.einsum("bqd,bkd->bqk", self.q(x), self.k(x)) / D**0.5, -1e9)
        x = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), self.v(x))
        return x + self.mlp(jax.nn.gelu(x))


class NnxGlobalBlock(NnxLocalBlock):
    window = 10**6


@pytest.mark.parametrize("spec", ["none", "full", "every_n:2", "selective:layer_input"])
def test_an_nnx_period_stack_has_the_unrolled_loops_gradients(spec, depth=4):
    import remat_kit.nnx

    layers = remat_kit.nnx.stack([NnxLocalBlock, NnxGlobalBlock], depth, spec, rngs=nnx.Rngs(0))
    got = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(layers)
    splits = [nnx.split(p) for p in layers.positions]

    def unrolled(states):
        x = X
        for i in range(depth):
            u, j = divmod(i, 2)
            x = nnx.merge(splits[j][0], jax.tree.map(lambda a, u=u: a[u], states[j]))(x)
        return jnp.sum(x**2)

    want = jax.grad(unrolled)([s for _, s in splits])
    assert max_rel_err(jax.tree.leaves(got["positions"]), jax.tree.leaves(want)) <= RTOL_F32
    with pytest.raises(ValueError, match=r"num_layers=5 is not a multiple of the period of 2 blocks"):
        remat_kit.nnx.stack([NnxLocalBlock, NnxGlobalBlock], 5, spec, rngs=nnx.Rngs(0))


class NnxLocalDropBlock(NnxLocalBlock):
    """The local block with dropout drawn from call-time ``rngs`` (the NNX Gemma example's API)."""

    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        # A mild rate: 0.5 doubles the kept values, and their growth over the layers costs float32 digits.
        self.dropout = nnx.Dropout(0.1)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        return self.dropout(super().__call__(x), rngs=rngs, deterministic=rngs is None)


class NnxGlobalDropBlock(NnxLocalDropBlock):
    window = 10**6


@pytest.mark.parametrize("spec", ["none", "full", "every_n:2", "selective:layer_input"])
def test_an_nnx_period_stack_takes_call_time_rngs_split_per_layer(spec, depth=4):
    import remat_kit.nnx

    period = [NnxLocalDropBlock, NnxGlobalDropBlock]
    layers = remat_kit.nnx.stack(period, depth, spec, rngs=nnx.Rngs(0))
    key = jax.random.key(7)
    got = nnx.grad(lambda m: jnp.sum(m(X, rngs=nnx.Rngs(dropout=key)) ** 2))(layers)
    splits = [nnx.split(p) for p in layers.positions]

    def unrolled(states):
        # Layer i is position i % 2 of period i // 2 and draws the i-th split of one draw of the stream.
        keys = jax.random.split(nnx.Rngs(dropout=key).dropout(), depth)
        x = X
        for i in range(depth):
            u, j = divmod(i, 2)
            layer = nnx.merge(splits[j][0], jax.tree.map(lambda a, u=u: a[u], states[j]))
            x = layer(x, rngs=nnx.Rngs(dropout=keys[i]))
        return jnp.sum(x**2)

    want = jax.grad(unrolled)([s for _, s in splits])
    assert max_rel_err(jax.tree.leaves(got["positions"]), jax.tree.leaves(want)) <= RTOL_F32
    # Dropout is really on (the gradients differ from the deterministic call's).
    deterministic = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(layers)
    assert max_rel_err(jax.tree.leaves(got["positions"]), jax.tree.leaves(deterministic["positions"])) > 1e-3
    with pytest.raises(TypeError, match=r"arrays, Python values or nnx.Rngs, got Linear"):
        layers(X, nnx.Linear(D, D, rngs=nnx.Rngs(0)))
