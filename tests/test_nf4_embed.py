"""A quantized base's embedding and output head: stored packed, looked up exactly, never kept dequantized."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err
from flax import traverse_util

from remat_kit import _jax_internals
from remat_kit.model import lora, nf4
from remat_kit.model.loss import lm_loss
from remat_kit.model.transformer import Transformer, TransformerConfig, init_params

#: Relative tolerance of a whole model's float32 outputs (house rule: 1e-4 for the model).
MODEL_RTOL = 1e-4

TARGETS = ("q_proj", "v_proj", "mlp_out")
CONFIGS = {
    f"{mode}-{'tied' if tied else 'untied'}": TransformerConfig.preset(
        "tiny", lora_rank=4, lora_targets=TARGETS, quantize=mode, tie_embeddings=tied
    )
    for mode in ("int8", "nf4")
    for tied in (True, False)
}


def _base(cfg):
    return init_params(TransformerConfig.preset("tiny", tie_embeddings=cfg.tie_embeddings), jax.random.key(0))


def _adapted(cfg):
    """``from_base`` of a full model, adapters made non-zero so gradients reach A as well as B."""
    t, f = lora.partition(lora.from_base(_base(cfg), cfg, jax.random.key(5)))
    t = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape), t)
    return t, f


def _dequantized(frozen):
    """The plain model's parameters: every quantized matrix replaced by the float matrix it stands for."""
    flat = traverse_util.flatten_dict(frozen)
    matrices = {k[:-1] for k in flat if k[-2] in lora.BASE_MATRICES}
    out = {k: v for k, v in flat.items() if k[:-1] not in matrices}
    for k in matrices:
        out[k] = lora.dequantize_matrix({path[-1]: v for path, v in flat.items() if path[:-1] == k})
    return traverse_util.unflatten_dict(out)


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (2, 16), 0, 256, dtype=jnp.int32)


@pytest.mark.parametrize("name", list(CONFIGS), ids=str)
def test_embedding_and_head_are_stored_quantized(name):
    cfg = CONFIGS[name]
    v, d = cfg.vocab_size, cfg.d_model
    for params in (init_params(cfg, jax.random.key(0)), lora.from_base(_base(cfg), cfg, jax.random.key(5))):
        table = params["embed"]["embedding"]
        if cfg.quantize == "nf4":  # two codes per byte, an int8 scale per 64 entries
            assert table["codes"].dtype == jnp.uint8 and table["codes"].shape == (v, d // 2)
            assert table["absmax_q"].dtype == jnp.int8 and table["absmax_q"].shape == (nf4.num_scales((v, d)),)
        else:  # one byte per entry, a float32 scale per row
            assert table["qvalue"].dtype == jnp.int8 and table["qvalue"].shape == (v, d)
            assert table["scale"].shape == (v, 1)
        assert ("lm_head" in params) == (not cfg.tie_embeddings)
        if not cfg.tie_embeddings:
            assert lora.is_quantized(params["lm_head"])


def test_frozen_bytes_are_half_a_byte_per_base_parameter_plus_scales():
    cfg = CONFIGS["nf4-tied"]
    layer = list(lora.kernel_shapes(cfg).values())
    outside = list(lora.matrix_shapes(cfg).values())
    assert outside == [(cfg.vocab_size, cfg.d_model)]  # tied: the embedding is the head
    weights = cfg.num_layers * sum(a * b for a, b in layer) + sum(a * b for a, b in outside)
    scale_bytes = lambda s: nf4.num_scales(s) + 4 * nf4.num_scales(s) // nf4.SCALE_BLOCK + 4
    scales = cfg.num_layers * sum(scale_bytes(s) for s in layer) + sum(scale_bytes(s) for s in outside)
    norms = cfg.num_params() - weights  # the only float32 parameters left
    assert lora.param_bytes(cfg).frozen == weights // 2 + scales + 4 * norms


@pytest.mark.parametrize("mode", ["int8", "nf4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
# 256 x 64: blocks are rows; 6 x 96: NF4 blocks of 64 straddle rows (entry 64 of row 0 is in block 1).
@pytest.mark.parametrize("shape", [(256, 64), (6, 96)], ids=["aligned", "straddling"])
def test_lookup_equals_the_dequantized_table_lookup_exactly(mode, dtype, shape):
    table = lora.quantize_matrix(0.02 * jax.random.normal(jax.random.key(3), shape), mode, w_in_axis=1)
    rows = jax.random.randint(jax.random.key(4), (3, 7), 0, shape[0])
    got = lora.lookup(table, rows, jnp.dtype(dtype))
    want = lora.dequantize_matrix(table, dtype)[rows]
    assert got.dtype == jnp.dtype(dtype) and got.shape == (3, 7, shape[1])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("name", list(CONFIGS), ids=str)
def test_model_equals_the_plain_model_over_the_dequantized_base(name, tokens):
    cfg = CONFIGS[name]
    params = lora.from_base(_base(cfg), cfg, jax.random.key(5))  # B = 0: the adapters add nothing yet
    plain_cfg = TransformerConfig.preset("tiny", tie_embeddings=cfg.tie_embeddings)
    deq = _dequantized(lora.partition(params)[1])
    ref = np.asarray(Transformer(config=plain_cfg).apply({"params": deq}, tokens))
    out = np.asarray(Transformer(config=cfg, policy="full").apply({"params": params}, tokens))
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) < MODEL_RTOL
    # The fused chunked loss dequantizes the (tied) head inside it: the same loss to float32 rounding.
    for chunks in (0, 4):
        got = lm_loss(Transformer(config=cfg), params, tokens, loss_chunks=chunks)
        want = lm_loss(Transformer(config=plain_cfg), deq, tokens, loss_chunks=chunks)
        assert abs(float(got) - float(want)) / abs(float(want)) < MODEL_RTOL, chunks


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_tied_head_equals_the_dequantized_matmul_to_float32_rounding(mode):
    table = lora.quantize_matrix(0.02 * jax.random.normal(jax.random.key(3), (256, 64)), mode, w_in_axis=1)
    h = jax.random.normal(jax.random.key(4), (2, 5, 64))
    got = lora.project_weight(h, table, 1, jnp.dtype("float32"), jnp.float32)
    want = h @ lora.dequantize_matrix(table).T
    assert max_rel_err(got, want) < RTOL_F32


def _residuals(cfg, trainable, frozen, tokens, spec, chunks):
    model = Transformer(config=cfg, policy=spec)
    loss = lambda t, x: lm_loss(model, lora.combine(t, frozen), x, loss_chunks=chunks)
    return _jax_internals.saved_residuals(loss, trainable, tokens)


@pytest.mark.parametrize("chunks", [0, 4], ids=["plain-loss", "fused-loss"])
@pytest.mark.parametrize("name", list(CONFIGS), ids=str)
def test_no_dequantized_embedding_or_head_is_saved(name, chunks, tokens):
    cfg = CONFIGS[name]
    trainable, frozen = _adapted(cfg)
    v, d = cfg.vocab_size, cfg.d_model
    # Every form a dequantized table or head could take: either layout, per 64-block, flat.
    forms = {(v, d), (d, v), (v * d // nf4.BLOCK, nf4.BLOCK), (v * d,)}
    # The tied table is the one used twice (lookup and head): every policy there; the untied, two kinds.
    for spec in ALL_SPECS if cfg.tie_embeddings else ["none", "full"]:
        res = _residuals(cfg, trainable, frozen, tokens, spec, chunks)
        floats = [r for r in res if r.shape in forms and r.dtype not in ("uint8", "int8")]
        assert not floats, (spec, floats)


def test_tied_head_keeps_the_packed_table_for_the_backward_pass(tokens):
    # The plain loss's head needs the table in its backward pass (for the hidden states' gradient):
    # what it keeps is the stored table, the packed codes, whose [vocab, d/2] shape nothing else has.
    cfg = CONFIGS["nf4-tied"]
    res = _residuals(cfg, *_adapted(cfg), tokens, "full", 0)
    assert any(r.dtype == "uint8" and r.shape == (cfg.vocab_size, cfg.d_model // 2) for r in res), res


@pytest.mark.parametrize("name", ["nf4-tied", "int8-tied"], ids=str)
def test_adapter_gradients_equal_across_policies_and_losses(name, tokens):
    cfg = CONFIGS[name]
    trainable, frozen = _adapted(cfg)

    def grads(spec, chunks):
        model = Transformer(config=cfg, policy=spec)
        return jax.jit(jax.grad(lambda t: lm_loss(model, lora.combine(t, frozen), tokens, loss_chunks=chunks)))(
            trainable
        )

    ref = grads("none", 0)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(ref))
    # The untied NF4 base's policies are tests/test_lora.py's; here the tied head, plain and fused.
    cases = [("full", 0), ("none", 4), ("selective", 4), ("dots", 0)] if cfg.quantize == "nf4" else [("full", 4)]
    for spec, chunks in cases:
        assert max_rel_err(grads(spec, chunks), ref) < RTOL_F32, (spec, chunks)


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_head_and_dequantize_gradients_match_autodiff(mode):
    # The scales are frozen in LoRA training; the custom rules are right for them anyway.
    q = lora.quantize_matrix(jax.random.normal(jax.random.key(0), (64, 8)), mode, w_in_axis=1)
    floats = {k: v for k, v in q.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    h = jax.random.normal(jax.random.key(1), (3, 8))
    plain_w = lambda f: q["qvalue"].astype(jnp.float32) * f["scale"] if mode == "int8" else nf4.dequantize({**q, **f})
    f32 = jnp.dtype("float32")
    for custom in (
        lambda h, f: lora.project_weight(h, {**q, **f}, 1, f32, jnp.float32),
        lambda h, f: h @ lora.dequantize_matrix({**q, **f}).T,
    ):
        got = jax.grad(lambda h, f, fn=custom: jnp.sum(jnp.sin(fn(h, f))), argnums=(0, 1))(h, floats)
        want = jax.grad(lambda h, f: jnp.sum(jnp.sin(h @ plain_w(f).T)), argnums=(0, 1))(h, floats)
        assert max_rel_err(got, want) < RTOL_F32
        assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(want))


def test_nf4_head_of_odd_width_is_one_line_error():
    with pytest.raises(ValueError, match="quantize='nf4' cannot store lm_head: nf4 needs kernels") as err:
        TransformerConfig.preset("tiny", lora_rank=4, quantize="nf4", vocab_size=255)
    assert "\n" not in str(err.value)
