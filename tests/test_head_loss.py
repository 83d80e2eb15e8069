"""remat_kit.head_loss: the loss at an unedited model's head in chunks equals the plain loss over its logits.

Small language models written as users write them (Linen and NNX, the blocks of tests/unedited_models.py), with a
Dense head or a tied embedding's ``attend``, with and without a soft-cap after the head.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import RTOL_F32, max_rel_err
from flax import nnx
from unedited_models import GptBlocks, NnxBlock

import remat_kit
from remat_kit.unedited import head as head_mod

B, S, D, V = 2, 8, 16, 40


class LinenLM(nn.Module):
    vocab: int = V
    d: int = D
    tied: bool = False
    softcap: float | None = None
    mixing: bool = False  # a tail that mixes positions (centred over the sequence): refused

    def setup(self):
        self.embedder = nn.Embed(self.vocab, self.d)
        self.h = GptBlocks(num_layers=2)
        self.final_norm = nn.LayerNorm()
        if not self.tied:
            self.lm_head = nn.Dense(self.vocab)

    def __call__(self, tokens):
        x = self.final_norm(self.h(self.embedder(tokens)))
        logits = self.embedder.attend(x) if self.tied else self.lm_head(x)
        if self.softcap is not None:
            logits = jnp.tanh(logits / self.softcap) * self.softcap
        if self.mixing:
            logits = logits - jnp.mean(logits, axis=1, keepdims=True)
        return logits, {"aux": jnp.sum(x)}  # another output beside the logits, dropped by head_loss


class NnxLM(nnx.Module):
    def __init__(self, *, tied=False, softcap=None, vocab=V, d=D, rngs):
        self.embedder = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([NnxBlock(d, rngs=rngs) for _ in range(2)])
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)
        self.lm_head = None if tied else nnx.Linear(d, vocab, rngs=rngs)
        self.softcap = softcap

    def __call__(self, tokens, deterministic=True):
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x, False, deterministic)
        x = self.final_norm(x)
        logits = self.embedder.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits if self.softcap is None else jnp.tanh(logits / self.softcap) * self.softcap


TOKENS = jax.random.randint(jax.random.key(1), (B, S), 0, V)
LABELS = jnp.roll(TOKENS, -1, axis=1)
MASK = jnp.ones((B, S)).at[:, -1].set(0.0).at[0, :3].set(0.0)


def plain(logits, labels=LABELS, mask=MASK):
    logits = logits.astype(jnp.float32)
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return jnp.sum(nll * mask) / jnp.sum(mask)


LINEN = {
    "linen-dense": (dict(), "lm_head"),
    "linen-tied": (dict(tied=True), "embedder.attend"),
    "linen-softcap": (dict(tied=True, softcap=3.0), "embedder/attend"),
}
NNX = {
    "nnx-dense": (dict(), "lm_head"),
    "nnx-tied": (dict(tied=True), "embedder.attend"),
    "nnx-softcap": (dict(softcap=3.0), "lm_head"),
}


def _linen(kw):
    model = LinenLM(**kw)
    return model, model.init(jax.random.key(0), TOKENS)


@pytest.mark.parametrize("head", ["named", "found"], ids=["named", "found"])
@pytest.mark.parametrize("chunks", [1, 4, "auto"], ids=["chunks1", "chunks4", "auto"])
@pytest.mark.parametrize("name", list(LINEN), ids=list(LINEN))
def test_linen_loss_and_gradients_equal_the_plain_loss(name, chunks, head):
    kw, path = LINEN[name]
    model, variables = _linen(kw)
    want = lambda v: plain(model.apply(v, TOKENS)[0])
    got = lambda v: remat_kit.head_loss(
        model, v, TOKENS, labels=LABELS, mask=MASK, head=path if head == "named" else None, chunks=chunks
    )
    (lw, gw), (lg, gg) = (jax.jit(jax.value_and_grad(f))(variables) for f in (want, got))
    assert max_rel_err(lg, lw) <= RTOL_F32
    assert max_rel_err(gg, gw) <= RTOL_F32


@pytest.mark.parametrize("head", ["named", "found"], ids=["named", "found"])
@pytest.mark.parametrize("name", list(NNX), ids=list(NNX))
def test_nnx_loss_and_gradients_equal_the_plain_loss(name, head):
    kw, path = NNX[name]
    graphdef, params, rest = nnx.split(NnxLM(**kw, rngs=nnx.Rngs(0)), nnx.Param, ...)
    model = lambda p: nnx.merge(graphdef, p, rest)
    want = lambda p: plain(model(p)(TOKENS))
    got = lambda p: remat_kit.head_loss(
        model(p), TOKENS, labels=LABELS, mask=MASK, head=path if head == "named" else None, chunks=2
    )
    (lw, gw), (lg, gg) = (jax.jit(jax.value_and_grad(f))(params) for f in (want, got))
    assert max_rel_err(lg, lw) <= RTOL_F32
    assert max_rel_err(gg, gw) <= RTOL_F32


def test_nnx_grad_through_the_module():
    model = NnxLM(tied=True, rngs=nnx.Rngs(0))
    want = nnx.grad(lambda m: plain(m(TOKENS)))(model)
    got = nnx.grad(lambda m: remat_kit.head_loss(m, TOKENS, labels=LABELS, mask=MASK, chunks=4))(model)
    assert max_rel_err(got, want) <= RTOL_F32


def test_a_tail_that_mixes_positions_is_refused_in_one_line():
    model, variables = _linen(dict(mixing=True))
    with pytest.raises(ValueError, match=r"the head 'lm_head' .* not per-position: reduce_sum .*") as err:
        remat_kit.head_loss(model, variables, TOKENS, labels=LABELS, head="lm_head", chunks=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(head="lm_haed"), ValueError, r"head='lm_haed' names no module of the model; .*lm_head"),
        (dict(head=3), TypeError, r"head must be a module path .*got 3"),
        (dict(chunks=3), ValueError, r"chunks=3 does not divide the sequence length 8"),
        (dict(chunks=0), ValueError, r"chunks.*got 0"),
        (dict(chunks=2.5), TypeError, r"chunks.*2.5"),
        (dict(chunks="fused"), TypeError, r"chunks.*'fused'"),
        (dict(labels=LABELS.astype(jnp.float32)), ValueError, r"labels must be an integer array .*float32"),
        (dict(mask=jnp.ones((B, S + 1))), ValueError, r"mask must be shaped as labels \(2, 8\), got \(2, 9\)"),
    ],
    ids=["unknown-head", "head-not-str", "chunks-not-divisor", "chunks-zero", "chunks-float", "chunks-str",
         "float-labels", "mask-shape"],
)  # fmt: skip
def test_bad_input_is_named_before_tracing(kwargs, error, match, monkeypatch):
    model, variables = _linen({})
    monkeypatch.setattr(head_mod, "_loss", lambda *a: pytest.fail("traced"))
    with pytest.raises(error, match=match):
        remat_kit.head_loss(model, variables, TOKENS, **{"labels": LABELS, **kwargs})


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m, v: remat_kit.head_loss(lambda t: t, v, TOKENS, labels=LABELS), "model must be a Linen module"),
        (lambda m, v: remat_kit.head_loss(m, TOKENS, labels=LABELS), "takes its variables first"),
    ],
    ids=["not-a-module", "no-variables"],
)
def test_bad_model_is_a_type_error(call, match):
    model, variables = _linen({})
    with pytest.raises(TypeError, match=match):
        call(model, variables)


def test_the_full_logits_and_their_gradient_never_exist():
    # A vocabulary large enough that the [B, S, V] float32 logits dwarf everything else the step holds.
    b, s, vocab = 1, 2048, 16384
    model = LinenLM(vocab=vocab, d=32)
    tokens = jax.random.randint(jax.random.key(0), (b, s), 0, vocab)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    logits_bytes = b * s * vocab * 4
    plain_loss = lambda v: plain(model.apply(v, tokens)[0], tokens, jnp.ones((b, s)))
    chunked = lambda v: remat_kit.head_loss(model, v, tokens, labels=tokens, head="lm_head", chunks=64)
    temp = lambda f: jax.jit(jax.grad(f)).lower(variables).compile().memory_analysis().temp_size_in_bytes
    assert temp(plain_loss) > logits_bytes
    assert temp(chunked) < logits_bytes / 8, (temp(chunked), logits_bytes)  # weights, their gradients, a chunk


def test_auto_chunks_divides_the_sequence():
    assert head_mod.auto_chunks(8 * 2**30, 1000) == 100  # 64 chunks of 128 MiB wanted: 100 divides 1000
    assert head_mod.auto_chunks(2**50, 1000) == 1000  # at most one position a chunk
    assert head_mod.auto_chunks(300 * 2**20, 12) == 3


@pytest.mark.parametrize("kind", ["linen", "nnx"], ids=["linen", "nnx"])
def test_a_model_from_apply_keeps_its_policy_and_the_plain_gradients(kind):
    # remat_kit.apply's model: the layers under its policy (fewer residuals kept), the head in chunks.
    from remat_kit._jax_internals import saved_residuals

    if kind == "linen":
        model, variables = _linen(dict(tied=True))
        applied = remat_kit.apply(model, "full", where=lambda m: type(m).__name__ == "GptBlock")
        loss = lambda m: lambda v: remat_kit.head_loss(m, v, TOKENS, labels=LABELS, mask=MASK, chunks=2)
        want = jax.grad(lambda v: plain(model.apply(v, TOKENS)[0]))(variables)
    else:
        plain_model = NnxLM(tied=True, rngs=nnx.Rngs(0))
        applied = remat_kit.apply(plain_model, "full")
        graphdef_p, variables, rest_p = nnx.split(plain_model, nnx.Param, ...)
        want = jax.grad(lambda p: plain(nnx.merge(graphdef_p, p, rest_p)(TOKENS)))(variables)

        def loss(m):
            graphdef, _, rest = nnx.split(m, nnx.Param, ...)
            return lambda p: remat_kit.head_loss(nnx.merge(graphdef, p, rest), TOKENS, labels=LABELS, mask=MASK)

        model = plain_model
    got = jax.jit(jax.grad(loss(applied)))(variables)
    assert max_rel_err(got, want) <= RTOL_F32
    kept = lambda m: sum(r.nbytes for r in saved_residuals(loss(m), variables) if not r.is_argument)
    assert kept(applied) < kept(model)


def test_an_unknown_nnx_head_is_named_before_tracing(monkeypatch):
    model = NnxLM(rngs=nnx.Rngs(0))
    monkeypatch.setattr(head_mod, "_loss", lambda *a: pytest.fail("traced"))
    with pytest.raises(ValueError, match=r"head=.embedder.decode/x. names no module of the model; .*embedder"):
        remat_kit.head_loss(model, TOKENS, labels=LABELS, head="embedder.decode/x")
    with pytest.raises(TypeError, match="method is for a Linen module"):
        remat_kit.head_loss(model, TOKENS, labels=LABELS, method="attend")


class TwiceLM(nn.Module):
    """The head applied twice on the way to the logits (two views averaged): no one call to chunk."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embedder")(tokens)
        head = nn.Dense(V, name="lm_head")
        return (head(x) + head(jnp.tanh(x))) / 2


def test_a_head_called_twice_on_the_way_to_the_logits_is_refused():
    model = TwiceLM()
    variables = model.init(jax.random.key(0), TOKENS)
    with pytest.raises(ValueError, match=r"head='lm_head' is called 2 times on the way to the logits"):
        remat_kit.head_loss(model, variables, TOKENS, labels=LABELS, head="lm_head")


def test_nnx_rng_state_advances_as_the_plain_call_does():
    # Dropout on: each call draws new masks from the module's RNG counts; head_loss writes them back, so two
    # steps in a row see the plain model's two pairs of masks.
    a, b = NnxLM(rngs=nnx.Rngs(0)), NnxLM(rngs=nnx.Rngs(0))
    for _ in range(2):
        want = plain(a(TOKENS, deterministic=False))
        got = remat_kit.head_loss(b, TOKENS, deterministic=False, labels=LABELS, mask=MASK, chunks=2)
        assert max_rel_err(got, want) <= RTOL_F32
