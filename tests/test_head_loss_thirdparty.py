"""remat_kit.head_loss on models installed from the registry, unedited (issue 48): the same loss and gradients
as the plain cross-entropy over the model's own logits.

The models are tests/test_thirdparty_real.py's, at its tiny configs (nothing downloaded): tunix's Llama 3 with
its tied embedding (``embedder.decode``) and untied (``lm_head``), gemma's gm.nn (``embedder.decode`` followed by
its final soft-cap), Hugging Face Flax GPT-2 (tied: its ``lm_head`` applied with the embedding, found
automatically) and Llama, and recurrentgemma's Griffin.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from test_thirdparty_real import (  # noqa: F401  (the autouse fixtures apply here too)
    _TUNIX,
    CAUSAL,
    MODELS,
    POSITIONS,
    TOKENS,
    _flax_param_unpatched,
    _numpy_broadcasting,
    _randomize,
    _tiny,
    assert_leaves_close,
)

import remat_kit

pytestmark = pytest.mark.thirdparty

LABELS = jnp.roll(TOKENS, -1, axis=1)
MASK = jnp.ones(LABELS.shape).at[:, -1].set(0.0)


def plain(logits):
    logits = logits.astype(jnp.float32)
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, LABELS[..., None], -1)[..., 0]
    return jnp.sum(nll * MASK) / jnp.sum(MASK)


def _tunix(untied: bool):
    model = MODELS["tunix-llama3"].make(2)  # skips (or fails, REQUIRE_THIRDPARTY) without tunix
    if untied:
        llama = _TUNIX[0]
        config = dataclasses.replace(_tiny(llama.ModelConfig.llama3p2_1b(), 2), weight_tying=False)
        model = _randomize(llama.Llama3(config, rngs=nnx.Rngs(0)), 2)
    return model


# (model, variant) -> the head as the user names it (None: found automatically).
CASES = {
    ("tunix-llama3", "tied"): "embedder.decode",
    ("tunix-llama3", "tied-found"): None,
    ("tunix-llama3", "untied"): "lm_head",
    ("gemma-gm.nn", "softcap"): "embedder.decode",
    ("hf-gpt2", "tied-found"): None,
    ("hf-llama", "untied"): "lm_head",
    ("griffin", "tied-found"): None,
}


@pytest.mark.parametrize(("name", "variant"), list(CASES), ids=[f"{n}-{v}" for n, v in CASES])
def test_head_loss_equals_the_plain_loss_and_gradients(name, variant):
    real, head = MODELS[name], CASES[name, variant]
    if real.nnx:
        graphdef, params, rest = nnx.split(_tunix(variant == "untied"), nnx.Param, ...)
        args = (TOKENS, POSITIONS, None, CAUSAL)
        want = lambda p: plain(nnx.merge(graphdef, p, rest)(*args)[0])
        got = lambda p: remat_kit.head_loss(
            nnx.merge(graphdef, p, rest), *args, labels=LABELS, mask=MASK, head=head, chunks=4
        )
    else:
        model = real.make(3 if name == "griffin" else 2)
        if variant == "softcap":  # Gemma 2's final soft-cap, after the head: part of the per-position tail
            model = model.clone(config=dataclasses.replace(model.config, final_logit_softcap=30.0))
        params = real.params(model)
        kwargs = {"return_cache": False} if name == "griffin" else {}
        want = lambda v: plain(real.call(model, v, TOKENS))
        got = lambda v: remat_kit.head_loss(
            model, v, *real.args(TOKENS), labels=LABELS, mask=MASK, head=head, chunks=4, **kwargs
        )
    (lw, gw), (lg, gg) = (jax.jit(jax.value_and_grad(f))(params) for f in (want, got))
    assert abs(float(lg) - float(lw)) <= 1e-5 * abs(float(lw))
    assert_leaves_close(gg, gw)


def test_tunix_llama3_never_holds_the_full_logits():
    # Compile-only, at a vocabulary large enough that the [1, 512, 65536] float32 logits (128 MiB) dwarf the rest.
    MODELS["tunix-llama3"].make(1)  # skips (or fails) without tunix
    llama = _TUNIX[0]
    seq, vocab = 512, 65536
    config = dataclasses.replace(_tiny(llama.ModelConfig.llama3p2_1b(), 2), vocab_size=vocab)
    graphdef, params, rest = nnx.split(llama.Llama3(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(0), (1, seq), 0, vocab)
    args = (tokens, jnp.arange(seq)[None], None, jnp.tril(jnp.ones((1, seq, seq), bool)))
    logits_bytes = seq * vocab * 4

    def want(p):
        logits = nnx.merge(graphdef, p, rest)(*args)[0].astype(jnp.float32)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])

    got = lambda p: remat_kit.head_loss(nnx.merge(graphdef, p, rest), *args, labels=tokens, chunks=32)
    temp = lambda f: jax.jit(jax.grad(f)).lower(params).compile().memory_analysis().temp_size_in_bytes
    plain_temp, chunked_temp = temp(want), temp(got)
    assert plain_temp > logits_bytes  # 265 MiB on XLA:CPU (jax 0.12): the logits, their gradient, softmax
    assert chunked_temp < logits_bytes / 4, (chunked_temp, plain_temp, logits_bytes)  # 25 MiB there
