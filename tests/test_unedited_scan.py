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
from flax import nnx

import remat_kit
from remat_kit.analysis import _xla_dump
from remat_kit.unedited import nnx as unedited_nnx
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
    """Blocks in a ``setup`` list, Gemma 3's pattern in small: local, local, global, repeated; 13 layers leave a
    remainder of one local block after four periods."""

    num_layers: int = 13
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
        for i in range(8):
            x = (Local if i % 2 == 0 else Global)(name=f"layer_{i}")(x, deterministic)
        return x


def _loss(model, variables):
    out, state = model.apply(variables, X, False, rngs={"dropout": jax.random.key(3)}, mutable=["intermediates"])
    return jnp.sum(out * T), state


# Four periods each: every_n:2 then runs two scan steps of two periods, so XLA keeps the loop (it unrolls a
# loop of one trip).
MODELS = {
    "inline-alternating": (lambda: um.InlineModel(num_layers=8), {}),  # [local, global] x 4
    "setup-period3-remainder": (SetupPeriod, {}),  # [local, local, global] x 4 + local
    "two-block-types": (TwoTypes, {"where": "layer_*"}),  # [Local, Global] x 4
}
CASES = [(m, "every_n:2") for m in MODELS] + [("inline-alternating", "selective:attn/q_einsum,mlp/*")]
STEPS = {"every_n:2": 2, "selective:attn/q_einsum,mlp/*": 4}  # scan steps over the four periods


def scan_trips(compiled) -> set[int]:
    """The trip counts of the compiled program's while loops (Dropout's key derivation loops too: 5 trips)."""
    _, trips = _xla_dump.parse_hlo(compiled.as_text())
    return {n for _, n in trips.values()}


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
    assert STEPS[policy] in scan_trips(compiled)  # the blocks run as a scan, one step per group of periods
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
    if noted and jax.default_backend() != "cpu":
        pytest.skip("the merge of a loop's recompute is XLA:CPU's")
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


# ---- NNX: an nnx.List of layers ------------------------------------------------------------------------


class NnxPattern(nnx.Module):
    """``self.layers`` an ``nnx.List`` of one block class; layer ``i`` is local when ``pattern[i % len]``."""

    def __init__(self, num_layers, pattern, *, rngs):
        self.layers = nnx.List([um.NnxBlock(8, rngs=rngs) for _ in range(num_layers)])
        self.pattern = pattern

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x, self.pattern[i % len(self.pattern)])
        return x


class NnxGlobal(nnx.Module):
    """Another block type: other parameters, attention over the whole sequence, its own dropout."""

    def __init__(self, d, *, rngs):
        self.pre_attention_norm = nnx.RMSNorm(d, rngs=rngs)  # pre-norms keep eight layers well conditioned
        self.attn = um.NnxAttention(d, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.pre_ffw_norm = nnx.RMSNorm(d, rngs=rngs)
        self.mlp = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x, is_local=False):
        x = x + self.dropout(self.attn(self.pre_attention_norm(x), is_local))
        return x + self.mlp(jax.nn.gelu(self.pre_ffw_norm(x)))


class NnxLocal(NnxGlobal):
    def __call__(self, x):
        return super().__call__(x, True)


class NnxTwoTypes(nnx.Module):
    def __init__(self, *, rngs):
        self.layers = nnx.List([(NnxLocal if i % 2 == 0 else NnxGlobal)(8, rngs=rngs) for i in range(8)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _nnx_grads(model):
    """The gradient w.r.t. the parameters and the RNG counts after the step, from one compile; its HLO text."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest):
        m = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))  # fresh Variables, updatable here
        return jnp.sum(m(X) * T), nnx.state(m, nnx.RngCount)

    compiled = jax.jit(jax.grad(loss, has_aux=True)).lower(params, rest).compile()
    grads, counts = compiled(params, rest)
    return grads, counts, scan_trips(compiled)


NNX_MODELS = {
    "list-alternating": (lambda: um.NnxModel(num_layers=8, rngs=nnx.Rngs(0)), {}),  # [local, global] x 4
    "list-alternating-remainder": (lambda: NnxPattern(9, (True, False), rngs=nnx.Rngs(0)), {}),  # ... + local
    "two-block-types": (lambda: NnxTwoTypes(rngs=nnx.Rngs(0)), {"where": "layers/*"}),
}


@pytest.mark.parametrize("kind", list(NNX_MODELS), ids=list(NNX_MODELS))
def test_an_nnx_period_of_blocks_scans_with_the_plain_models_gradients_state_and_rng_counts(kind):
    make, kwargs = NNX_MODELS[kind]
    applied = remat_kit.apply(make(), "every_n:2", scan=True, **kwargs)
    assert jax.tree.structure(nnx.state(applied)) == jax.tree.structure(nnx.state(make()))
    want, want_counts, plain_trips = _nnx_grads(make())
    got, got_counts, trips = _nnx_grads(applied)
    assert_leaves_close(got, want)
    # Dropout drew from the shared stream as often as in the plain model (and the same keys: the gradients).
    assert jax.tree.leaves(got_counts) == jax.tree.leaves(want_counts)
    assert 2 in trips and 2 not in plain_trips  # the blocks run as a scan: two steps of two periods each
    zeroed = jax.tree.map(lambda a: a, got)
    zeroed["layers"][7] = jax.tree.map(jnp.zeros_like, got["layers"][7])  # the last block of the last period
    with pytest.raises(AssertionError):
        assert_leaves_close(zeroed, want)


def test_nnx_blocks_that_repeat_no_period_are_refused_naming_each_blocks_flags():
    applied = remat_kit.apply(NnxPattern(3, (False, True, False, False), rngs=nnx.Rngs(0)), "full", scan=True)
    with pytest.raises(ValueError, match=r"nor do they repeat a period.*layers/1 \(is_local=True"):
        applied(X)


# ---- decoders as gm.nn and tunix write them: shared arrays per block, (cache, x), an unhashable config -------

B, L = 2, 6
POS = jnp.broadcast_to(jnp.arange(L), (B, L))
MASK = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
SEG = jnp.asarray([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
X4 = jax.random.normal(jax.random.key(4), (B, L, 8))


def _decoder():
    return um.NnxDecoder(um.DecoderConfig(num_layers=8), rngs=nnx.Rngs(0))


def _decoder_grads(model):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        out, cache = nnx.merge(graphdef, params)(X4, POS, None, MASK, segment_ids=SEG)
        assert cache is None
        return jnp.sum(out * jnp.sin(X4))

    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled(params), scan_trips(compiled)


@pytest.mark.parametrize("policy", ["every_n:2", "selective:q_proj,mlp"], ids=["every_n:2", "selective"])
def test_an_nnx_decoder_with_shared_arrays_and_cache_x_returns_scans_with_the_plain_gradients(policy):
    with pytest.raises(TypeError, match="unhashable"):  # its graph holds the config: the schedule cache cannot hash it
        hash(nnx.graphdef(_decoder()))
    applied = remat_kit.apply(_decoder(), policy, scan=True)
    assert jax.tree.structure(nnx.state(applied)) == jax.tree.structure(nnx.state(_decoder()))
    want, plain_trips = _decoder_grads(_decoder())
    got, trips = _decoder_grads(applied)
    assert_leaves_close(got, want)
    assert {"every_n:2": 4, "selective:q_proj,mlp": 8}[policy] in trips - plain_trips  # one scan over the blocks
    zeroed = jax.tree.map(lambda a: a, got)
    zeroed["layers"][7] = jax.tree.map(jnp.zeros_like, got["layers"][7])
    with pytest.raises(AssertionError):
        assert_leaves_close(zeroed, want)


def test_an_unhashable_config_is_traced_once_per_signature_not_once_per_call():
    applied = remat_kit.apply(_decoder(), "full", scan=True)
    before = len(unedited_nnx._SCHEDULES.by_equality)
    first, _ = applied(X4, POS, None, MASK)
    second, _ = applied(X4, POS, None, MASK)
    np.testing.assert_array_equal(first, second)
    assert len(unedited_nnx._SCHEDULES.by_equality) == before + 1


def scan_bodies(closed) -> list[int]:
    """The equation count (nested ones included) of each ``scan`` body in a closed jaxpr, sorted."""

    def count(jaxpr) -> int:
        return sum(1 + sum(count(j) for j in _sub_jaxprs(e)) for e in jaxpr.eqns)

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "scan":
                yield count(e.params["jaxpr"].jaxpr)
            for j in _sub_jaxprs(e):
                yield from walk(j)

    return sorted(walk(closed.jaxpr))


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(j, "eqns"):
                yield j
            elif hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
                yield j.jaxpr


def test_the_scan_body_does_not_grow_with_depth():
    """One compiled block: the scan bodies of a scanned 4- and 16-layer decoder's gradient are the same size."""

    def jaxpr(n, scan):
        model = um.NnxDecoder(um.DecoderConfig(num_layers=n), rngs=nnx.Rngs(0))
        if scan:
            model = remat_kit.apply(model, "full", scan=True)
        graphdef, params = nnx.split(model, nnx.Param)
        return jax.make_jaxpr(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(X4, POS, None, MASK)[0])))(params)

    assert scan_bodies(jaxpr(4, True)) == scan_bodies(jaxpr(16, True))
    assert scan_bodies(jaxpr(4, True))  # there is a scan
    assert not scan_bodies(jaxpr(4, False))
    # The measure can fail: the unrolled model's program grows with depth.
    assert len(jaxpr(16, False).eqns) > len(jaxpr(4, False).eqns)


def _decode(model_call, cache):
    """Prefill two tokens then decode one, returning the logits of both steps and the final cache."""
    out1, cache = model_call(X4[:, :2], POS[:, :2], cache, MASK[:, :2, :L])
    out2, cache = model_call(X4[:, 2:3], POS[:, 2:3], cache, MASK[:, 2:3, :L])
    return out1, out2, cache


def test_the_nnx_decoders_kv_cache_path_is_the_plain_models_and_scan_names_the_cache():
    cache = um.init_cache(8, B, L, 8)
    want = _decode(_decoder(), cache)
    got = _decode(remat_kit.apply(_decoder(), "full"), cache)
    assert_leaves_close(got, want)
    scanned = remat_kit.apply(_decoder(), "full", scan=True)
    with pytest.raises(ValueError, match=r"NnxDecoder's block layers/1 gets its own cache= .*per-layer KV cache"):
        _decode(scanned, cache)


def test_a_linen_decoder_returning_cache_x_scans_with_the_plain_gradients_and_decodes():
    model = um.CacheModel(num_layers=8)
    variables = model.init(jax.random.key(0), X4, POS, MASK)
    applied = remat_kit.apply(model, "every_n:2", scan=True)

    def loss(m, v):
        out, cache = m.apply(v, X4, POS, MASK)
        assert cache is None
        return jnp.sum(out * jnp.sin(X4))

    want = jax.jit(jax.grad(lambda v: loss(model, v)))(variables)
    compiled = jax.jit(jax.grad(lambda v: loss(applied, v))).lower(variables).compile()
    assert_leaves_close(compiled(variables), want)
    assert 4 in scan_trips(compiled)  # 8 identical blocks, every_n:2: four steps of two
    cache = um.init_cache(8, B, L, 8)

    def call(m):
        return lambda x, p, c, mask: m.apply(variables, x, p, mask, c)

    assert_leaves_close(_decode(call(remat_kit.apply(model, "full")), cache), _decode(call(model), cache))
    with pytest.raises(
        ValueError,
        match=r"CacheBlock block layer_1 gets its own cache=",
    ):
        _decode(call(applied), cache)


class TwinOut(nn.Module):
    """Returns ``(x, x)``: two parts shaped like the input, so which one feeds the next block is unknown."""

    @nn.compact
    def __call__(self, x):
        y = x + nn.Dense(8)(x)
        return y, y


class TwinModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x, _ = TwinOut(name=f"layer_{i}")(x)
        return x


def test_a_block_output_with_no_one_part_shaped_like_its_input_is_refused_in_one_line():
    variables = TwinModel().init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"TwinOut block layer_0 returns \(float32\[2,6,8\], float32\[2,6,8\]\)"):
        remat_kit.apply(TwinModel(), "full", scan=True).apply(variables, X)


class Residual(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(8)(x)


class CodeBetween(nn.Module):
    """Scales each block's output before the next block: code between the blocks, which one scan cannot run."""

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Residual(name=f"layer_{i}")(x) * 0.5
        return x


class NnxResidual(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.lin(x)


class NnxCodeBetween(nnx.Module):
    def __init__(self, *, rngs):
        self.layers = nnx.List([NnxResidual(rngs=rngs) for _ in range(3)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x) * 0.5
        return x


def _call_linen(applied):
    return applied.apply(CodeBetween().init(jax.random.key(0), X), X)


SEAMS = {
    "linen": (lambda: remat_kit.apply(CodeBetween(), "full", scan=True), _call_linen, "layer_1", "layer_0"),
    "nnx": (
        lambda: remat_kit.apply(NnxCodeBetween(rngs=nnx.Rngs(0)), "full", scan=True),
        lambda m: m(X),
        "layers/1",
        "layers/0",
    ),
}


@pytest.mark.parametrize("side", list(SEAMS), ids=list(SEAMS))
def test_code_between_scanned_blocks_is_refused_naming_both_blocks_on_either_side(side):
    make, call, later, first = SEAMS[side]
    with pytest.raises(
        ValueError, match=rf"block {later} is not called with block {first}'s output \(the model runs code"
    ):
        call(make())
