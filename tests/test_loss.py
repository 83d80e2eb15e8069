"""Cross-entropy: plain against a NumPy reference, chunked (fused) against plain: loss, gradients, what is kept."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RTOL_F32, max_rel_err

from remat_kit import _jax_internals
from remat_kit.analysis import flops
from remat_kit.model import loss
from remat_kit.model.transformer import Transformer, TransformerConfig, init_params

B, S, D, V = 2, 16, 8, 50


@pytest.fixture(scope="module")
def inputs():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(k1, (B, S, D))
    w = jax.random.normal(k2, (D, V)) * 0.5
    targets = jax.random.randint(k3, (B, S), 0, V)
    masks = {
        "next_token": loss.shift_targets(targets)[1],
        "random": (jax.random.uniform(k4, (B, S)) < 0.6).astype(jnp.float32),
        "all_zero": jnp.zeros((B, S)),
    }
    return hidden, w, targets, masks


def test_shift_targets():
    tokens = jnp.array([[1, 2, 3], [4, 5, 6]])
    targets, mask = loss.shift_targets(tokens)
    np.testing.assert_array_equal(targets, [[2, 3, 0], [5, 6, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 0], [1, 1, 0]])


def test_plain_loss_matches_numpy(inputs):
    hidden, w, targets, masks = inputs
    logits = np.asarray(hidden, np.float64) @ np.asarray(w, np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1)[..., None]
    )
    nll = -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    m = np.asarray(masks["random"])
    want = (nll * m).sum() / m.sum()
    got = loss.cross_entropy(hidden @ w, targets, masks["random"])
    np.testing.assert_allclose(float(got), want, rtol=RTOL_F32)


# Chunk counts that divide B*S = 32, that do not (padding), one chunk, and more chunks than tokens.
@pytest.mark.parametrize("chunks", [1, 2, 3, 5, 7, 32, 40], ids=lambda c: f"chunks{c}")
@pytest.mark.parametrize("mask", ["next_token", "random", "all_zero"])
def test_chunked_equals_plain_loss_and_gradients(inputs, chunks, mask):
    hidden, w, targets, masks = inputs
    m = masks[mask]
    plain = lambda h, w: loss.cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), targets, m)
    chunked = lambda h, w: loss.chunked_cross_entropy(h, w, targets, m, chunks)
    (lp, gp), (lc, gc) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, w) for f in (plain, chunked))
    assert max_rel_err(lc, lp) <= RTOL_F32
    assert max_rel_err(gc, gp) <= RTOL_F32
    if mask == "all_zero":
        assert float(lc) == 0.0 and not np.any(np.asarray(gc[0]))


def test_chunked_keeps_no_full_logits(inputs):
    hidden, w, targets, masks = inputs
    m = masks["next_token"]

    def logit_residuals(fn):
        res = _jax_internals.saved_residuals(fn, hidden, w)
        return [r.shape for r in res if r.shape and r.shape[-1] == V and not r.is_argument]

    plain = logit_residuals(lambda h, w: loss.cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), targets, m))
    chunked = logit_residuals(lambda h, w: loss.chunked_cross_entropy(h, w, targets, m, 4))
    assert (B, S, V) in plain
    # Each chunk's gradients are taken in the forward pass: what is kept is the output matrix's gradient.
    assert chunked == [(D, V)], chunked


def test_chunked_recomputes_no_logits(inputs):
    # The plain loss's matmul FLOPs exactly: the logits, and the two gradients, once each.
    hidden, w, targets, masks = inputs
    m = masks["random"]
    plain = lambda h, w: loss.cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), targets, m)
    chunked = lambda h, w: loss.chunked_cross_entropy(h, w, targets, m, 4)
    count = lambda f: flops.jaxpr_flops(jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1)))(hidden, w))
    assert count(chunked) == count(plain) == 3 * 2 * B * S * D * V


def test_chunked_computes_no_gradient_for_a_frozen_output_matrix(inputs):
    # A frozen matrix (LoRA's base): neither its gradient's matmul nor its gradient's buffer.
    hidden, w, targets, masks = inputs
    m = masks["random"]
    plain = lambda h: loss.cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), targets, m)
    chunked = lambda h: loss.chunked_cross_entropy(h, w, targets, m, 4)
    (lp, gp), (lc, gc) = (jax.value_and_grad(f)(hidden) for f in (plain, chunked))
    assert max_rel_err(lc, lp) <= RTOL_F32 and max_rel_err(gc, gp) <= RTOL_F32
    kept = [r.shape for r in _jax_internals.saved_residuals(chunked, hidden) if not r.is_argument]
    assert not [s for s in kept if V in s], kept
    assert flops.jaxpr_flops(jax.make_jaxpr(jax.grad(chunked))(hidden)) == 2 * 2 * B * S * D * V


def test_chunked_takes_a_vocab_by_d_matrix_in_any_dtype(inputs):
    # A tied embedding is [vocab, d] and float32 while the hidden states are bfloat16: no transpose or
    # cast of it is made outside the chunks (tests/test_model.py checks none is kept).
    hidden, w, targets, masks = inputs
    m = masks["random"]
    h16 = hidden.astype(jnp.bfloat16)
    plain = lambda h, w: loss.cross_entropy(jnp.einsum("bsd,dv->bsv", h, w.astype(h.dtype).T), targets, m)
    chunked = lambda h, w: loss.chunked_cross_entropy(h, w, targets, m, 3, vocab_axis=0)
    for h in (hidden, h16):
        (lp, gp), (lc, gc) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w.T) for f in (plain, chunked))
        assert gc[1].dtype == jnp.float32 and gc[0].dtype == h.dtype
        tol = RTOL_F32 if h.dtype == jnp.float32 else 2e-2  # bfloat16 logits
        assert max_rel_err(lc, lp) <= tol and max_rel_err(gc, gp) <= tol


def _vocab_wide(jaxpr, vocab: int) -> list:
    """Shapes of the equations' outputs as wide as the whole vocabulary on a matrix axis (a whole-matrix copy)."""
    outs = (v.aval for e in _jax_internals.iter_eqns(jaxpr) for v in e.outvars if hasattr(v.aval, "shape"))
    return [a.shape for a in outs if len(a.shape) == 2 and vocab in a.shape and D in a.shape]


@pytest.mark.parametrize("blocks", [1, 2, 5, 25], ids=lambda b: f"blocks{b}")
@pytest.mark.parametrize("axis", [0, 1], ids=lambda a: f"vocab_axis{a}")
def test_a_frozen_matrix_in_vocabulary_slices_equals_the_plain_loss(inputs, blocks, axis):
    # The frozen path casts each vocabulary slice where it is read: the same loss and hidden-state gradient,
    # the plain loss's matmul FLOPs, and with more than one slice no whole-matrix copy anywhere in the program.
    hidden, w, targets, masks = inputs
    m = masks["random"]
    w_ = w if axis == 1 else w.T
    plain = lambda h: loss.cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), targets, m)
    chunked = lambda h: loss.chunked_cross_entropy(h, w_, targets, m, 4, vocab_axis=axis, vocab_blocks=blocks)
    (lp, gp), (lc, gc) = (jax.jit(jax.value_and_grad(f))(hidden) for f in (plain, chunked))
    assert max_rel_err(lc, lp) <= RTOL_F32 and max_rel_err(gc, gp) <= RTOL_F32
    program = jax.make_jaxpr(jax.grad(chunked))(hidden)
    assert flops.jaxpr_flops(program) == 2 * 2 * B * S * D * V
    if blocks > 1:
        assert _vocab_wide(program, V) == [], _vocab_wide(program, V)
    assert float(jax.jit(chunked)(hidden)) == pytest.approx(float(lc), rel=1e-6)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_a_frozen_quantized_table_is_dequantized_by_vocabulary_slice(mode):
    # A quantized tied embedding ([vocab, d], int8 per row or NF4): read by row slices (lookup), never whole,
    # with the loss and gradient of the plain loss over the whole dequantized matrix.
    from remat_kit.model import lora_layer

    vocab, d = 64, 16
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    hidden = jax.random.normal(k1, (B, S, d))
    table = lora_layer.quantize_matrix(jax.random.normal(k2, (vocab, d)), mode, w_in_axis=1)
    targets = jax.random.randint(k3, (B, S), 0, vocab)
    m = loss.shift_targets(targets)[1]
    dense = lora_layer.dequantize_matrix(table, jnp.float32)
    plain = lambda h: loss.cross_entropy(jnp.einsum("bsd,vd->bsv", h, dense), targets, m)
    chunked = lambda h: loss.chunked_cross_entropy(h, table, targets, m, 4, vocab_axis=0, vocab_blocks=4)
    (lp, gp), (lc, gc) = (jax.jit(jax.value_and_grad(f))(hidden) for f in (plain, chunked))
    assert max_rel_err(lc, lp) <= RTOL_F32 and max_rel_err(gc, gp) <= RTOL_F32
    outs = (v.aval for e in _jax_internals.iter_eqns(jax.make_jaxpr(jax.grad(chunked))(hidden)) for v in e.outvars)
    assert not [a.shape for a in outs if getattr(a, "size", 0) >= vocab * d and a.dtype == jnp.float32]


def test_a_differentiated_quantized_table_gets_its_scales_gradient():
    # Differentiated (not a LoRA base), an NF4 table's float leaves get the gradient of its dequantization.
    from remat_kit.model import lora_layer

    vocab, d = 64, 16
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    hidden = jax.random.normal(k1, (B, S, d))
    table = lora_layer.quantize_matrix(jax.random.normal(k2, (vocab, d)), "nf4", w_in_axis=1)
    targets = jax.random.randint(k3, (B, S), 0, vocab)
    m = loss.shift_targets(targets)[1]
    floats = {k: v for k, v in table.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    ints = {k: v for k, v in table.items() if k not in floats}

    def plain(h, f):
        dense = lora_layer.dequantize_matrix({**ints, **f}, jnp.float32)
        return loss.cross_entropy(jnp.einsum("bsd,vd->bsv", h, dense), targets, m)

    chunked = lambda h, f: loss.chunked_cross_entropy(h, {**ints, **f}, targets, m, 3, vocab_axis=0)
    (lp, gp), (lc, gc) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, floats) for f in (plain, chunked))
    assert max_rel_err(lc, lp) <= RTOL_F32 and max_rel_err(gc, gp) <= RTOL_F32
    assert set(gc[1]) == set(floats) and all(np.any(np.asarray(g)) for g in gc[1].values())


@pytest.mark.parametrize(
    ("blocks", "match"),
    [(3, "vocab_blocks=3 does not divide the vocabulary size 50"), (0, "vocab_blocks"), (2.5, "vocab_blocks")],
    ids=str,
)
def test_bad_vocab_blocks(inputs, blocks, match):
    hidden, w, targets, masks = inputs
    with pytest.raises((ValueError, TypeError), match=match):
        loss.chunked_cross_entropy(hidden, w, targets, masks["random"], 2, vocab_blocks=blocks)


@pytest.mark.parametrize("axis", [2, -1, True], ids=str)
def test_bad_vocab_axis(inputs, axis):
    hidden, w, targets, masks = inputs
    with pytest.raises(ValueError, match=f"vocab_axis must be 0 .* or 1 .*, got {axis!r}"):
        loss.chunked_cross_entropy(hidden, w, targets, masks["random"], 2, vocab_axis=axis)


@pytest.mark.parametrize("chunks", [0, -1, 2.5, True], ids=str)
def test_bad_chunk_count(inputs, chunks):
    hidden, w, targets, masks = inputs
    with pytest.raises(ValueError, match=f"loss chunks must be a positive integer, got {chunks!r}"):
        loss.chunked_cross_entropy(hidden, w, targets, masks["random"], chunks)


def test_lm_loss_chunked_equals_plain_on_the_model(tokens):
    # Tied embeddings: the output matrix's gradient meets the embedding's, the harder case.
    cfg = TransformerConfig.preset("tiny", tie_embeddings=True)
    model = Transformer(config=cfg, policy="full")
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    grad = lambda k: jax.jit(jax.value_and_grad(lambda p: loss.lm_loss(model, p, tokens, loss_chunks=k)))(params)
    (lp, gp), (lc, gc) = grad(0), grad(3)
    assert max_rel_err(lc, lp) <= RTOL_F32
    assert max_rel_err(gc, gp) <= RTOL_F32


def test_an_evaluation_of_the_fused_loss_takes_no_gradients(inputs):
    # Not differentiated, the custom_vjp runs its primal: the logits' matmul FLOPs alone.
    hidden, w, targets, masks = inputs
    fused = lambda h, w_: loss.chunked_cross_entropy(h, w_, targets, masks["random"], 4)
    count = lambda f: flops.jaxpr_flops(jax.make_jaxpr(f)(hidden, w))
    assert count(fused) == 2 * B * S * D * V
    assert count(jax.value_and_grad(fused, argnums=(0, 1))) == 3 * 2 * B * S * D * V
    value, _ = jax.value_and_grad(fused)(hidden, w)
    np.testing.assert_allclose(fused(hidden, w), value, rtol=1e-6)


@pytest.mark.parametrize(
    ("tokens", "vocab", "devices", "expected"),
    [
        (4 * 256, 4096, 1, 0),  # the small preset: 16 MiB of logits, the plain loss
        (2048, 32_768, 1, 2),  # exactly AUTO_FUSED_FROM: fused, two 128 MiB chunks
        (2048, 32_767, 1, 0),  # one vocabulary entry short of it
        (4 * 1024, 32_000, 1, 4),  # benchmarks/peer_hf.py's shape: 500 MiB
        (2 * 1024, 248_000, 1, 16),  # the 2b preset's default shape: 1.9 GiB
        (4 * 1024, 32_000, 2, 0),  # a batch over two devices keeps the plain loss
        (3, 2**30, 1, 3),  # never more chunks than tokens
    ],
)
def test_auto_chunks(tokens, vocab, devices, expected):
    assert loss.auto_chunks(tokens, vocab, devices) == expected
    assert loss.resolve_chunks("auto", tokens, vocab, devices) == expected
    assert loss.resolve_chunks(5, tokens, vocab) == 5


@pytest.mark.parametrize("value", [-1, 2.5, True, "fused", None], ids=repr)
def test_bad_loss_chunks(value):
    with pytest.raises(ValueError, match=f"loss_chunks must be 'auto', 0 .* or a positive integer .*got {value!r}"):
        loss.check_chunks(value)


def test_lm_loss_auto_is_the_chunk_count_it_picks(tokens, monkeypatch):
    cfg = TransformerConfig.preset("tiny")
    model = Transformer(config=cfg, policy="none")
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    program = lambda k: str(jax.make_jaxpr(lambda p: loss.lm_loss(model, p, tokens, loss_chunks=k))(params))
    logits = tokens.size * cfg.vocab_size * 4  # 32 KiB: the plain loss
    assert loss.auto_chunks(tokens.size, cfg.vocab_size) == 0 and program("auto") == program(0)
    # Thresholds scaled down to the test's logits: "auto" then is the fused loss in 4 chunks.
    monkeypatch.setattr(loss, "AUTO_FUSED_FROM", logits // 2)
    monkeypatch.setattr(loss, "AUTO_CHUNK_BYTES", logits // 4)
    assert loss.auto_chunks(tokens.size, cfg.vocab_size) == 4
    assert program("auto") == program(4) != program(0)
