import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err

from remat_kit import _jax_internals as internals
from remat_kit import names
from remat_kit import policies as P
from remat_kit.model import loss
from remat_kit.model.ops import project, rms_norm, swiglu
from remat_kit.model.transformer import (
    PRESETS,
    Block,
    Transformer,
    TransformerConfig,
    abstract_params,
    init_params,
)
from remat_kit.planning import analysis


def _lm_loss(cfg, policy, tokens, dropout_key=None):
    model = Transformer(config=cfg, policy=policy)

    def loss(params):
        kw = {} if dropout_key is None else {"deterministic": False, "rngs": {"dropout": dropout_key}}
        logits = model.apply({"params": params}, tokens, **kw)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return loss


@functools.cache
def _none_gradients(dropout: float, attn: str):
    """The ``none`` reference of :func:`test_model_gradients_equal_none`, compiled once per configuration."""
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256, dtype=jnp.int32)
    cfg = TransformerConfig.preset("tiny", dropout=dropout, num_layers=5, attention=attn)
    params = init_params(cfg, jax.random.key(0))
    key = jax.random.key(5) if dropout else None
    return cfg, params, tokens, key, jax.jit(jax.grad(_lm_loss(cfg, "none", tokens, key)))(params)


@pytest.mark.parametrize("spec", [*ALL_SPECS, "minimal", "minimal_offloaded", "selective:attn_probs,mlp_act"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["nodrop", "dropout"])
def test_model_gradients_equal_none(spec, dropout):
    # attn_probs exists only under XLA's attention: chunked attention never forms the probabilities.
    cfg, params, tokens, key, g0 = _none_gradients(dropout, "xla" if "attn_probs" in spec else "auto")
    g = jax.jit(jax.grad(_lm_loss(cfg, P.parse(spec), tokens, key)))(params)
    assert max_rel_err(g, g0) <= RTOL_F32


def test_dropout_changes_the_loss_and_deterministic_ignores_rng(tokens):
    cfg = TransformerConfig.preset("tiny", dropout=0.3)
    params = init_params(cfg, jax.random.key(0))
    a = _lm_loss(cfg, "full", tokens, jax.random.key(1))(params)
    b = _lm_loss(cfg, "full", tokens, jax.random.key(2))(params)
    c = _lm_loss(cfg, "full", tokens)(params)
    assert a != b and c != a


def test_block_emits_the_whole_vocabulary():
    cfg = TransformerConfig.preset("tiny", attention="xla")  # chunked emits all but attn_probs (test_attention)
    block = Block(config=cfg)
    x = jnp.ones((2, 8, cfg.d_model))
    p = block.init(jax.random.key(0), x)
    assert internals.emitted_tags(lambda p, x: block.apply(p, x), p, x) == set(names.VOCABULARY)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_parameters_identical_under_every_policy(spec, tokens):
    cfg = TransformerConfig.preset("tiny")
    ref = Transformer(config=cfg).init(jax.random.key(4), tokens)
    got = Transformer(config=cfg, policy=spec).init(jax.random.key(4), tokens)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert max_rel_err(got, ref) == 0.0


def test_param_tree_shapes_and_count():
    cfg = TransformerConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    layers = params["layers"]["layers"]
    assert layers["q_proj"]["kernel"].shape == (cfg.num_layers, cfg.d_model, cfg.num_heads * cfg.head_dim)
    assert layers["k_proj"]["kernel"].shape == (cfg.num_layers, cfg.d_model, cfg.num_kv_heads * cfg.head_dim)
    assert params["lm_head"].shape == (cfg.d_model, cfg.vocab_size)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()


def test_2b_preset_is_planned_by_shape_only():
    cfg = TransformerConfig.preset("2b")
    assert (cfg.d_model, cfg.num_layers, cfg.vocab_size) == (2048, 28, 248_000)
    shapes = abstract_params(cfg)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert n == cfg.num_params() and 1.5e9 < n < 2.5e9


def test_logits_are_float32_even_in_bfloat16(tokens):
    cfg = TransformerConfig.preset("tiny", dtype="bfloat16")
    model = Transformer(config=cfg, policy="full")
    params = model.init(jax.random.key(0), tokens)
    out = model.apply(params, tokens)
    assert out.shape == (2, 16, cfg.vocab_size) and out.dtype == jnp.float32


def test_causal_future_tokens_do_not_change_past_logits(tokens):
    cfg = TransformerConfig.preset("tiny")
    model = Transformer(config=cfg)
    params = model.init(jax.random.key(0), tokens)
    changed = tokens.at[:, 10:].set(7)
    a, b = model.apply(params, tokens), model.apply(params, changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_config_is_frozen_and_presets_override():
    cfg = TransformerConfig.preset("small", num_layers=3)
    assert cfg.num_layers == 3 and PRESETS["small"].num_layers == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 4


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: TransformerConfig.preset("huge"), ValueError, r"unknown preset 'huge'; allowed: tiny, small, 2b"),
        (
            lambda: TransformerConfig.preset("tiny", layers=3),
            TypeError,
            r"unknown TransformerConfig field\(s\) \['layers'\]",
        ),
        (lambda: TransformerConfig(num_layers=0), ValueError, r"num_layers must be a positive integer, got 0"),
        (lambda: TransformerConfig(d_model=65), ValueError, r"not divisible by num_heads"),
        (lambda: TransformerConfig(num_kv_heads=3), ValueError, r"not a multiple of num_kv_heads=3"),
        (lambda: TransformerConfig(dropout=1.0), ValueError, r"dropout must be in \[0, 1\)"),
        (lambda: TransformerConfig(dtype="float8"), ValueError, r"dtype='float8'; allowed: float32"),
        (lambda: Transformer(config=TransformerConfig(), policy="every_n:5"), ValueError, r"greater than the depth"),
        (lambda: Transformer(config=TransformerConfig(), policy="nope"), ValueError, r"unknown policy spec 'nope'"),
        (lambda: Transformer(config={"d_model": 4}), TypeError, r"config must be a TransformerConfig"),
    ],
    ids=["preset", "field", "layers", "heads", "kv", "dropout", "dtype", "every_n", "spec", "config-type"],
)
def test_bad_config_and_policy(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    ("tok", "error", "match"),
    [
        (jnp.zeros((2, 129), jnp.int32), ValueError, r"sequence length 129 exceeds the model's max_seq_len=128"),
        (jnp.zeros((16,), jnp.int32), ValueError, r"must be a \[batch, seq\] array"),
        (jnp.zeros((2, 8), jnp.float32), TypeError, r"must be integers"),
    ],
    ids=["too-long", "rank", "dtype"],
)
def test_bad_tokens(tok, error, match):
    model = Transformer(config=TransformerConfig.preset("tiny"))
    with pytest.raises(error, match=match):
        model.init(jax.random.key(0), tok)


# ---- the lean block -----------------------------------------------------------------------------------

_F32 = jnp.dtype("float32")


def _check_like_autodiff(lean, reference, *args):
    """Values and gradients (under a random cotangent) of a lean op equal autodiff of the plain one."""
    out, vjp = jax.vjp(lean, *args)
    ref, ref_vjp = jax.vjp(reference, *args)
    ct = jax.random.normal(jax.random.key(9), ref.shape, ref.dtype)
    assert out.dtype == ref.dtype and max_rel_err(out, ref) <= RTOL_F32
    assert max_rel_err(vjp(ct), ref_vjp(ct)) <= RTOL_F32


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.parametrize("w_in_axis", [0, 1], ids=["kernel", "tied"])
def test_project_equals_autodiff_of_the_matmul(w_in_axis):
    x, w = _normal(0, (2, 5, 8)), _normal(1, (8, 6) if w_in_axis == 0 else (6, 8))
    spec = "bsi,io->bso" if w_in_axis == 0 else "bsi,oi->bso"
    _check_like_autodiff(lambda x, w: project(x, w, w_in_axis, _F32), lambda x, w: jnp.einsum(spec, x, w), x, w)


@pytest.mark.parametrize("w_in_axis", [0, 1], ids=["kernel", "tied"])
def test_project_mixed_precision_equals_autodiff(w_in_axis):
    # bfloat16 compute, float32 weights and float32 output: the lm head of a bfloat16 model.
    x, w = _normal(0, (2, 5, 8)).astype(jnp.bfloat16), _normal(1, (8, 6) if w_in_axis == 0 else (6, 8))
    spec = "bsi,io->bso" if w_in_axis == 0 else "bsi,oi->bso"
    bf16 = jnp.dtype("bfloat16")
    lean = lambda x, w: project(x, w, w_in_axis, bf16, jnp.float32)
    plain = lambda x, w: jnp.einsum(spec, x, w.astype(bf16), preferred_element_type=jnp.float32)
    out, vjp = jax.vjp(lean, x, w)
    ref, ref_vjp = jax.vjp(plain, x, w)
    ct = _normal(9, ref.shape)
    assert out.dtype == ref.dtype == jnp.float32 and bool(jnp.all(out == ref))
    for got, want in zip(vjp(ct), ref_vjp(ct), strict=True):
        assert got.dtype == want.dtype
        assert max_rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) <= 1e-2  # bfloat16 rounding


@pytest.mark.parametrize("w_in_axis", [0, 1], ids=["kernel", "tied"])
def test_project_weight_gradient_needs_no_transpose(w_in_axis):
    # Autodiff's weight gradient is dot_general(g, x) and a transpose, which XLA:CPU turns into a
    # transposed write of the whole [tokens, out] cotangent; project's backward contracts in w's layout.
    x, w = _normal(0, (2, 5, 8)), _normal(1, (8, 6) if w_in_axis == 0 else (6, 8))
    _, vjp = jax.vjp(lambda x, w: project(x, w, w_in_axis, _F32), x, w)
    jaxpr = jax.make_jaxpr(vjp)(_normal(9, (2, 5, 6))).jaxpr
    prims = [e.primitive.name for e in jaxpr.eqns]
    assert "transpose" not in prims and prims.count("dot_general") == 2, prims


def test_rms_norm_equals_flax():
    x, scale = _normal(2, (2, 5, 8)) * 3.0, 1.0 + _normal(3, (8,))
    flax_norm = nn.RMSNorm(epsilon=1e-6)
    _check_like_autodiff(
        lambda x, s: rms_norm(x, s, 1e-6, _F32), lambda x, s: flax_norm.apply({"params": {"scale": s}}, x), x, scale
    )


def test_swiglu_equals_autodiff_of_silu():
    _check_like_autodiff(swiglu, lambda g, u: nn.silu(g) * u, _normal(4, (2, 5, 8)) * 3.0, _normal(5, (2, 5, 8)))


_MIXED = TransformerConfig.preset("tiny", dtype="bfloat16")  # float32 parameters, bfloat16 compute


def _stack_residuals(cfg, spec, b=2, s=16):
    model = Transformer(config=cfg, policy=spec)
    x = jax.ShapeDtypeStruct((b, s, cfg.d_model), jnp.dtype(cfg.dtype))
    fn = lambda p, h: jnp.sum(model.apply({"params": p}, h, method=lambda m, h: m.layers(h)).astype(jnp.float32))
    return [r for r in internals.saved_residuals(fn, abstract_params(cfg), x) if not r.is_argument]


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_no_policy_keeps_a_compute_dtype_copy_of_a_weight(spec):
    weight_shapes = {leaf.shape[1:] for leaf in jax.tree.leaves(abstract_params(_MIXED)["layers"])}
    copies = [r for r in _stack_residuals(_MIXED, spec) if r.dtype == "bfloat16" and r.shape[-2:] in weight_shapes]
    assert not copies, copies


@pytest.mark.parametrize("cfg", [_MIXED, TransformerConfig.preset("tiny")], ids=["bfloat16", "float32"])
def test_none_keeps_exactly_the_lean_floor(cfg):
    # Per token and layer: input, both norm outputs, q, context, post-attention residual (6·d), k and v,
    # gate, up and act (3·d_ff) in the compute dtype, and attention's float32 logsumexp per head.
    L, b, s, d, f = cfg.num_layers, 2, 16, cfg.d_model, cfg.d_ff
    kv, item = cfg.num_kv_heads * cfg.head_dim, jnp.dtype(cfg.dtype).itemsize
    assert analysis.layer_stack_bytes(cfg, "none", b, s) == (
        L * b * s * ((6 * d + 2 * kv + 3 * f) * item + 4 * cfg.num_heads),
        0,
    )
    assert {r.dtype for r in _stack_residuals(cfg, "none") if r.nbytes > L * b * s * 4 * cfg.num_heads} == {cfg.dtype}


@pytest.mark.parametrize("chunks", [0, 4], ids=["plain", "chunked"])
@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied"])
def test_head_keeps_no_copy_of_the_output_matrix(chunks, tie, tokens):
    cfg = TransformerConfig.preset("tiny", dtype="bfloat16", tie_embeddings=tie)
    model = Transformer(config=cfg, policy="full")
    fn = lambda p, t: loss.lm_loss(model, p, t, loss_chunks=chunks)
    res = [r for r in internals.saved_residuals(fn, abstract_params(cfg), tokens) if not r.is_argument]
    V = cfg.vocab_size
    matrix_shaped = [r for r in res if r.shape in ((cfg.d_model, V), (V, cfg.d_model))]
    if not chunks:
        assert not matrix_shaped
    else:
        # The fused loss keeps the output matrix's gradient (float32, as the parameter), never a bfloat16
        # copy of the matrix, and nothing else vocabulary-sized: no chunk's logits.
        shape = (V, cfg.d_model) if tie else (cfg.d_model, V)
        assert [(r.dtype, r.shape) for r in matrix_shaped] == [("float32", shape)]
        assert [r for r in res if V in r.shape] == matrix_shaped


def test_config_survives_a_json_round_trip():
    # Bench workers and checkpoint metadata rebuild the config from JSON, where tuples become lists.
    import dataclasses
    import json

    cfg = TransformerConfig.preset("tiny", lora_rank=4, lora_targets=("q_proj", "v_proj"))
    again = TransformerConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg and again.lora_targets == ("q_proj", "v_proj")
