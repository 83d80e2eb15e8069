"""remat_kit.apply on models installed from the registry and left unedited (issues 36 and 45).

google-tunix's Llama3 and Qwen3 (NNX), gemma's ``gm.nn.Gemma3_270M`` (Linen), Hugging Face transformers 4.x's
Flax GPT-2 and Llama (Linen: the ``.module`` of ``FlaxGPT2LMHeadModel``/``FlaxLlamaForCausalLM``) and
recurrentgemma's Griffin (Linen: a period of two recurrent blocks and one local-attention block), each at a tiny
size made from its own config class with random weights: nothing is downloaded (no weights, no tokenizer). The
packages are pinned in ci/thirdparty.txt (gemma needs Python >= 3.12); .ci/run installs them into its
newest-Python venv and runs this module with REMAT_KIT_REQUIRE_THIRDPARTY=1, which turns the skip below into a
failure. Without the packages (the default venv) each model's tests skip, saying why.

Every policy test also checks that the policy took effect (JAX keeps fewer residual bytes than for the plain
model), not only that the gradients are the plain model's: a policy applied to the wrong modules keeps them too.

Tests whose docstring says ``needs the apply36 fixes`` exercise issue 36's items 2 and 4 as well (default
``offload`` through apply; gm.nn's ``nn.jit``-wrapped ``__call__`` seen through), merged as branch apply36.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

import remat_kit
from remat_kit.planning.planner import StepPlanner

pytestmark = pytest.mark.thirdparty

REQUIRED = os.environ.get("REMAT_KIT_REQUIRE_THIRDPARTY") == "1"
RTOL = 1e-5  # float32 gradients, per leaf
B, L, VOCAB = 2, 8, 64


def _load(*modules: str) -> tuple[list[Any] | None, str]:
    """The modules, or None and why not (the skip's reason)."""
    try:
        return [importlib.import_module(m) for m in modules], ""
    except ImportError as err:  # a missing package, or one of theirs
        return None, f"{err} (pip install --no-deps -r ci/thirdparty.txt, on Python >= 3.12)"


_TUNIX, _TUNIX_WHY = _load("tunix.models.llama3.model", "tunix.models.qwen3.model")
_GEMMA, _GEMMA_WHY = _load("gemma.gm", "gemma.gm.nn._config")
# The Flax modules and their config classes only: ``import transformers`` alone would not import the Flax models,
# and neither path imports torch.
_HF, _HF_WHY = _load(
    "transformers.models.gpt2.modeling_flax_gpt2",
    "transformers.models.gpt2.configuration_gpt2",
    "transformers.models.llama.modeling_flax_llama",
    "transformers.models.llama.configuration_llama",
)


def _load_griffin() -> tuple[list[Any] | None, str]:
    """recurrentgemma.jax, imported with typeguard's decorator off.

    recurrentgemma 1.0.1 checks its signatures with jaxtyping + typeguard, pinned < 3; gemma's kauldron needs
    typeguard 4, whose decorator parses the source of the decorated function's module and fails on jaxtyping's
    shape strings (``SyntaxError: *b t f``) at import. Type checking is a debugging aid that no computation goes
    through: with ``typeguard.typechecked`` an identity while the package is imported, the model is unedited.
    """
    try:
        import typeguard
    except ImportError as err:
        return None, f"{err} (pip install --no-deps -r ci/thirdparty.txt, on Python >= 3.12)"
    with mock.patch.object(typeguard, "typechecked", lambda target=None, **_: target):
        return _load("recurrentgemma.jax")


_GRIFFIN, _GRIFFIN_WHY = _load_griffin()


@pytest.fixture(autouse=True)
def _numpy_broadcasting():
    """The models broadcast by NumPy's rules (tunix's RMSNorm: ``w * x``); the suite's conftest raises on that."""
    with jax.numpy_rank_promotion("allow"):
        yield


@pytest.fixture(autouse=True)
def _flax_param_unpatched(request):
    """The other models' tests run with flax's own ``nn.Module.param``, not gemma's replacement.

    gemma's gm.nn, once imported, replaces ``flax.linen.Module.param`` process-wide
    (gemma/gm/utils/_dtype_params.py) with a wrapper that passes ``dtype`` to every init function positionally:
    transformers' Flax Llama RMSNorm initializer, ``lambda _, shape: ...``, then raises a TypeError, in whichever
    test runs after a gemma test in the same process. A clash between two packages, not a remat_kit behaviour.
    """
    import flax.linen as nn

    original = getattr(nn.Module.param, "__original_fn__", None)  # etils' wraps_with_reload keeps it there
    callspec = getattr(request.node, "callspec", None)
    if original is None or (callspec is not None and callspec.params.get("name") == "gemma-gm.nn"):
        yield
        return
    with mock.patch.object(nn.Module, "param", original):
        yield


def _need(found: Any, why: str) -> None:
    if found is None:
        if REQUIRED:
            pytest.fail(f"REMAT_KIT_REQUIRE_THIRDPARTY=1 but the third-party models cannot be imported: {why}")
        pytest.skip(why)


# ---- the models -------------------------------------------------------------------------------------------


def _randomize(model: nnx.Module, seed: int) -> nnx.Module:
    """Random weights everywhere (tunix initializes its MLP kernels to zeros: their gradients would be zero)."""
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(
        model,
        jax.tree.unflatten(
            tree, [0.3 * jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves, strict=True)]
        ),
    )
    return model


def _tiny(config: Any, num_layers: int) -> Any:
    return dataclasses.replace(
        config,
        num_layers=num_layers,
        vocab_size=VOCAB,
        embed_dim=16,
        hidden_dim=32,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
    )


TOKENS = jax.random.randint(jax.random.key(7), (B, L), 1, VOCAB)
POSITIONS = jnp.broadcast_to(jnp.arange(L), (B, L))
CAUSAL = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
WEIGHTS = jax.random.normal(jax.random.key(8), (B, L, VOCAB))  # the loss weighs every logit


def _positions(tokens: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)


@dataclasses.dataclass(frozen=True)
class Real:
    """One third-party model: how to build it at a depth, call it, and name its block's parts."""

    name: str
    nnx: bool
    make: Callable[[int], Any]  # num_layers -> the plain model (NNX: with random weights)
    depths: tuple[int, int]  # two depths for the scan tests (the second twice the first)
    selective: str  # a selective policy by module path
    paths: tuple[str, ...]  # module paths names_of must list
    offload: str = "offload:attn/*"  # an offload policy by module path
    # Linen: the call's positional arguments for a batch of tokens (init, names_of), and its logits.
    args: Callable[[jax.Array], tuple] = lambda tokens: (tokens,)
    call: Callable[[Any, Any, jax.Array], jax.Array] = lambda m, v, tokens: m.apply(v, tokens).logits

    def loss(self, model: Any, *rest: Any) -> jax.Array:
        """apply_factory's loss: NNX ``loss(model, tokens)``, Linen ``loss(model, variables, tokens)``."""
        if self.nnx:
            (tokens,) = rest
            logits, cache = model(tokens, POSITIONS[: len(tokens)], None, CAUSAL[: len(tokens)])
            assert cache is None
        else:
            variables, tokens = rest
            logits = self.call(model, variables, tokens)
        return jnp.sum(logits.astype(jnp.float32) * WEIGHTS[: len(tokens)])

    def params(self, model: Any) -> Any:
        return nnx.state(model, nnx.Param) if self.nnx else model.init(jax.random.key(0), *self.args(TOKENS))

    def plain_loss(self, model: Any) -> Callable:
        """``loss(params, tokens)`` of the plain model (no remat_kit in it)."""
        if self.nnx:
            graphdef, _, rest = nnx.split(model, nnx.Param, ...)
            return lambda p, t: self.loss(nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest)), t)
        return lambda v, t: self.loss(model, v, t)


def _llama(n: int):
    _need(_TUNIX, _TUNIX_WHY)
    llama = _TUNIX[0]
    return _randomize(llama.Llama3(_tiny(llama.ModelConfig.llama3p2_1b(), n), rngs=nnx.Rngs(0)), n)


def _qwen(n: int):
    _need(_TUNIX, _TUNIX_WHY)
    qwen = _TUNIX[1]
    return _randomize(qwen.Qwen3(_tiny(qwen.ModelConfig.qwen3_0p6b(), n), rngs=nnx.Rngs(0)), n)


def _gemma(n: int):
    _need(_GEMMA, _GEMMA_WHY)
    gm, config = _GEMMA
    base = gm.nn.Gemma3_270M.config
    tiny = dataclasses.replace(
        base,
        num_embed=VOCAB,
        embed_dim=16,
        hidden_dim=32,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        sliding_window_size=4,
        # Gemma 2's local/global alternation (Gemma2_2B's): Gemma 3's five-to-one pattern needs 12 layers
        # for the two periods a scan needs, which compiles too slowly for CI.
        attention_types=config.make_attention_layers_types(gm.nn.Gemma2_2B.config.attention_types[:2], num_layers=n),
    )
    return gm.nn.Gemma3_270M(config=tiny, dtype=jnp.float32)


TUNIX_PATHS = (
    "input_layernorm",
    "attn/q_proj",
    "attn/k_proj",
    "attn/o_proj",
    "post_attention_layernorm",
    "mlp/gate_proj",
    "mlp",
)


# HF's own initializer at a larger scale: at its 0.02 the gradients are so small that Adam's eps, not the
# gradient, decides the AdamW test's step, which then barely moves the parameters.
HF_INIT_STD = 0.3


def _gpt2(n: int):
    _need(_HF, _HF_WHY)
    gpt2, config = _HF[:2]
    tiny = config.GPT2Config(
        vocab_size=VOCAB, n_positions=2 * L, n_embd=16, n_layer=n, n_head=2, initializer_range=HF_INIT_STD
    )
    return gpt2.FlaxGPT2LMHeadModule(tiny, dtype=jnp.float32)  # FlaxGPT2LMHeadModel(...).module


def _hf_llama(n: int):
    _need(_HF, _HF_WHY)
    llama, config = _HF[2:]
    tiny = config.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=n,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2 * L,
        initializer_range=HF_INIT_STD,
    )
    return llama.FlaxLlamaForCausalLMModule(tiny, dtype=jnp.float32)  # FlaxLlamaForCausalLM(...).module


def _hf_args(tokens: jax.Array) -> tuple:
    """HF Flax's positional ``(input_ids, attention_mask, position_ids)``: no padding."""
    return tokens, jnp.ones_like(tokens), _positions(tokens)


def _griffin_config(n: int) -> Any:
    """RecurrentGemma 2B's config (its Preset) at width 16, ``n`` blocks of its (recurrent, recurrent, attention)."""
    _need(_GRIFFIN, _GRIFFIN_WHY)
    (rg,) = _GRIFFIN
    base = rg.GriffinConfig.from_preset(rg.Preset.RECURRENT_GEMMA_2B_V1, vocab_size=VOCAB)
    period = tuple(base.block_types[:3])
    assert n % len(period) == 0, n
    return base._replace(  # a NamedTuple
        width=16,
        mlp_expanded_width=32,
        num_heads=2,
        lru_width=16,
        attention_window_size=4,
        block_types=period * (n // len(period)),
    )


def _griffin(n: int, gradient_checkpointing: bool = False):
    """``gradient_checkpointing=False``: Griffin's default (True) puts every block under its own ``nn.remat``."""
    config = _griffin_config(n)
    return _GRIFFIN[0].Griffin(config, gradient_checkpointing=gradient_checkpointing, dtype=jnp.float32)


MODELS = {
    "tunix-llama3": Real("tunix-llama3", True, _llama, (4, 8), "selective:attn/q_proj,mlp/*", TUNIX_PATHS),
    "tunix-qwen3": Real(
        "tunix-qwen3", True, _qwen, (4, 8), "selective:attn/q_proj,mlp/*", (*TUNIX_PATHS, "attn/q_norm")
    ),
    "gemma-gm.nn": Real(
        "gemma-gm.nn",
        False,
        _gemma,
        (4, 8),
        "selective:attn/q_einsum,mlp/*",
        ("pre_attention_norm", "attn/q_einsum", "attn/attn_vec_einsum", "mlp/gating_einsum", "mlp/linear", "mlp"),
    ),
    "hf-gpt2": Real(
        "hf-gpt2",
        False,
        _gpt2,
        (4, 8),
        "selective:attn/c_attn,mlp/*",
        ("ln_1", "attn/c_attn", "attn/c_proj", "ln_2", "mlp/c_fc", "mlp/c_proj", "mlp"),
        args=_hf_args,
        call=lambda m, v, t: m.apply(v, *_hf_args(t)).logits,
    ),
    "hf-llama": Real(
        "hf-llama",
        False,
        _hf_llama,
        (4, 8),
        "selective:self_attn/q_proj,mlp/*",
        (
            "input_layernorm",
            "self_attn/q_proj",
            "self_attn/k_proj",
            "self_attn/o_proj",
            "post_attention_layernorm",
            "mlp/gate_proj",
            "mlp",
        ),
        offload="offload:self_attn/*",
        args=_hf_args,
        call=lambda m, v, t: m.apply(v, *_hf_args(t)).logits,
    ),
    # Two block types in one period: each keeps its own projections (names only one type emits).
    "griffin": Real(
        "griffin",
        False,
        _griffin,
        (6, 12),  # two periods: at 3 blocks the scan runs the two identical recurrent blocks, not the period
        "selective:attention_block/proj_q,recurrent_block/linear_x,mlp_block/*",
        (
            "temporal_pre_norm",
            "recurrent_block/linear_x",
            "recurrent_block/rg_lru",
            "recurrent_block/conv_1d",
            "attention_block/proj_q",
            "attention_block/proj_final",
            "channel_pre_norm",
            "mlp_block/ffw_up",
            "mlp_block",
        ),
        offload="offload:mlp_block/*",
        args=lambda t: (t, _positions(t)),
        call=lambda m, v, t: m.apply(v, t, _positions(t), return_cache=False)[0],
    ),
}
NAMES = list(MODELS)


def assert_leaves_close(got: Any, want: Any, rtol: float = RTOL) -> None:
    """Every leaf within ``rtol`` of its own largest magnitude; a leaf the loss does not reach is an error."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        scale = float(np.max(np.abs(np.asarray(w, np.float32))))
        assert scale > 0, f"{jax.tree_util.keystr(path)}: the loss does not depend on it"
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0, atol=rtol * scale, err_msg=str(path)
        )


_PLAIN: dict = {}


def _plain_grads(real: Real, n: int) -> tuple[Any, Any]:
    """The plain model's ``(params, gradient)`` at ``n`` layers (computed once per model and depth)."""
    if (real.name, n) not in _PLAIN:
        model = real.make(n)
        params = real.params(model)
        _PLAIN[real.name, n] = params, jax.jit(jax.grad(real.plain_loss(model)))(params, TOKENS)
    return _PLAIN[real.name, n]


def _applied_grads(real: Real, n: int, policy: Any, **kwargs: Any) -> Any:
    params, _ = _plain_grads(real, n)
    loss = remat_kit.apply_factory(real.make(n), real.loss, **kwargs)(policy)
    return jax.jit(jax.grad(loss))(params, TOKENS)


def residual_bytes(loss: Callable, *args: Any) -> int:
    """The bytes JAX keeps for ``loss``'s backward pass (``saved_residuals``: a trace, nothing compiled)."""
    return sum(aval.size * aval.dtype.itemsize for aval, _ in saved_residuals(loss, *args))


def assert_the_policy_took_effect(real: Real, n: int, policy: Any, **kwargs: Any) -> None:
    """Every policy here recomputes something in each block it reaches: JAX keeps less than for the plain model.

    Equal gradients alone would pass a policy applied to the wrong modules (an embedding taken for the block), or
    to none at all.
    """
    params, _ = _plain_grads(real, n)
    plain = residual_bytes(real.plain_loss(real.make(n)), params, TOKENS)
    applied = residual_bytes(remat_kit.apply_factory(real.make(n), real.loss, **kwargs)(policy), params, TOKENS)
    assert applied < plain, f"{policy}: keeps {applied} bytes, the plain model {plain}"


# ---- names and every policy kind ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_names_of_lists_the_blocks_module_paths(name):
    """gemma-gm.nn: needs the apply36 fixes (nn.jit's trace cache hides the blocks once the plain model ran)."""
    real = MODELS[name]
    model = real.make(real.depths[0])
    table = (
        remat_kit.names_of(model, TOKENS, POSITIONS, None, CAUSAL)
        if real.nnx
        else remat_kit.names_of(model, *real.args(TOKENS))
    )
    missing = [p for p in real.paths if p not in table.names]
    assert not missing, f"{missing} not in {table.names}"


def _policies(real: Real) -> list:
    return [
        "full",
        "every_n:2",
        real.selective,
        real.offload,
        "offload",  # the layer inputs: needs the apply36 fixes (issue 36 item 2)
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    ]


POLICY_IDS = ["full", "every_n:2", "selective-paths", "offload-paths", "offload-default", "jax-policy"]
CASES = [(n, i) for n in NAMES for i in range(len(POLICY_IDS))]


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{POLICY_IDS[i]}" for n, i in CASES])
def test_every_policy_kind_gives_the_plain_models_gradients(name, index):
    """gemma-gm.nn and offload-default: need the apply36 fixes."""
    real = MODELS[name]
    policy = _policies(real)[index]
    n = real.depths[0]
    _, want = _plain_grads(real, n)
    assert_leaves_close(_applied_grads(real, n, policy), want)
    assert_the_policy_took_effect(real, n, policy)


# ---- scan=True ----------------------------------------------------------------------------------------------


def scan_bodies(closed) -> list[int]:
    """The equation count (nested ones included) of each ``scan`` body in a closed jaxpr, sorted."""

    def subs(eqn):
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else (v,):
                if hasattr(j, "eqns"):
                    yield j
                elif hasattr(getattr(j, "jaxpr", None), "eqns"):
                    yield j.jaxpr

    def count(jaxpr) -> int:
        return sum(1 + sum(count(j) for j in subs(e)) for e in jaxpr.eqns)

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "scan":
                yield count(e.params["jaxpr"].jaxpr)
            for j in subs(e):
                yield from walk(j)

    return sorted(walk(closed.jaxpr))


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_scan_gives_the_plain_gradients_keeps_the_layout_and_compiles_one_block(name):
    """gemma-gm.nn: needs the apply36 fixes (nn.jit)."""
    real = MODELS[name]
    n, deeper = real.depths
    params, want = _plain_grads(real, n)
    make = remat_kit.apply_factory(real.make(n), real.loss, scan=True)
    # The parameter layout is the plain model's: its checkpoints load.
    if real.nnx:
        applied = remat_kit.apply(real.make(n), "full", scan=True)
        assert jax.tree.map(jnp.shape, nnx.state(applied)) == jax.tree.map(jnp.shape, nnx.state(real.make(n)))
    else:
        applied = remat_kit.apply(real.make(n), "full", scan=True)
        layout = applied.init(jax.random.key(0), *real.args(TOKENS))
        assert jax.tree.map(jnp.shape, layout) == jax.tree.map(jnp.shape, params)
    assert_leaves_close(jax.jit(jax.grad(make("full")))(params, TOKENS), want)
    assert_the_policy_took_effect(real, n, "full", scan=True)
    # One compiled block: the scan bodies are the same at twice the depth.
    bodies = scan_bodies(jax.make_jaxpr(jax.grad(make("full")))(params, TOKENS))
    deep = real.make(deeper)
    deep_params = jax.eval_shape(lambda: real.params(deep)) if not real.nnx else nnx.state(deep, nnx.Param)
    deep_make = remat_kit.apply_factory(deep, real.loss, scan=True)
    assert bodies and bodies == scan_bodies(jax.make_jaxpr(jax.grad(deep_make("full")))(deep_params, TOKENS))


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_an_adamw_step_through_scan_is_the_plain_models(name):
    """gemma-gm.nn: needs the apply36 fixes (nn.jit)."""
    real = MODELS[name]
    n = real.depths[0]
    params, grads = _plain_grads(real, n)
    # eps at the clipped gradients' scale: Adam's first update is lr * g / (|g| + eps), whose slope in g is
    # lr * eps / (|g| + eps)^2, up to lr / eps where g is 0. With optax's 1e-8, an entry the clip takes to
    # about eps (Griffin's gradient norm is 331) turns a 5e-7 rounding difference (the gradients agree to
    # 4e-8 of their largest entry) into 2 % of lr; at 1e-2 the slope is at most lr / eps = 1.
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, eps=1e-2))

    def step(grads):
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    # The parameters after the step (Adam's first update is about lr * sign(g): comparing the updates themselves
    # would magnify float32 rounding where a gradient is near 0; a wrong block gradient still moves them by lr).
    assert_leaves_close(step(_applied_grads(real, n, "every_n:2", scan=True)), step(grads))


# ---- the KV-cache decode path -------------------------------------------------------------------------------


def _cache(real: Real, model: Any, n: int, length: int) -> Any:
    if not real.nnx:
        return model.config.init_cache(batch_size=B, dtype=jnp.float32, cache_length=length)
    shape = (B, length, 1, 8)  # batch, cache length, kv heads, head dim (the tiny config's)
    zeros = jnp.zeros(shape, jnp.float32)
    return {f"layer_{i}": {"k": zeros, "v": zeros, "end_index": jnp.zeros((B,), jnp.int32)} for i in range(n)}


def _decode(real: Real, call: Callable, cache: Any) -> tuple:
    """Prefill ``L // 2`` tokens, then decode one: both steps' logits and the last cache."""
    t = L // 2
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    logits1, cache = call(TOKENS[:, :t], POSITIONS[:, :t], cache, mask[:, :t])
    logits2, cache = call(TOKENS[:, t : t + 1], POSITIONS[:, t : t + 1], cache, mask[:, t : t + 1])
    return logits1, logits2, cache


DECODES = ["tunix-llama3", "tunix-qwen3", "gemma-gm.nn"]  # the others' decode tests follow


@pytest.mark.parametrize("name", DECODES, ids=DECODES)
def test_the_decode_path_is_the_plain_models_and_scan_names_the_per_layer_cache(name):
    """gemma-gm.nn: needs the apply36 fixes (nn.jit)."""
    real = MODELS[name]
    n = real.depths[0]
    model = real.make(n)
    params = real.params(model)

    def caller(m):
        if real.nnx:
            return lambda t, p, c, mask: m(t, p, c, mask)

        def call(t, p, c, mask):
            out = m.apply(params, t, positions=p, cache=c, attention_mask=mask)
            return out.logits, out.cache

        return call

    cache = _cache(real, model, n, L)
    want = _decode(real, caller(model), cache)
    got = _decode(real, caller(remat_kit.apply(real.make(n) if real.nnx else model, "full")), cache)
    assert_leaves_close(got[:2], want[:2])
    assert jax.tree.structure(got[2]) == jax.tree.structure(want[2])
    # A scan cannot give each block its own cache: one line names the argument.
    with pytest.raises(ValueError, match=r"gets its own cache= .*per-layer KV cache"):
        _decode(real, caller(remat_kit.apply(real.make(n) if real.nnx else model, "full", scan=True)), cache)


# ---- auto ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_auto_picks_a_policy_for_a_budget_between_fulls_need_and_nones(name):
    """gemma-gm.nn: needs the apply36 fixes (nn.jit). 32 x 16 tokens: activations, not the optimizer, peak."""
    real = MODELS[name]
    n = real.depths[0]
    model = real.make(n)
    tokens = jax.ShapeDtypeStruct((32, 16), jnp.int32)
    params = jax.eval_shape(lambda: real.params(model)) if not real.nnx else nnx.state(model, nnx.Param)

    def loss(*args):  # the module's POSITIONS/CAUSAL are (B, L): this batch makes its own
        *head, t = args
        if real.nnx:
            pos = jnp.broadcast_to(jnp.arange(16), t.shape)
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((16, 16), bool)), (32, 16, 16))
            logits, _ = head[0](t, pos, None, mask)
        else:
            logits = real.call(head[0], head[1], t)
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

    make = remat_kit.apply_factory(model, loss, scan=True)
    planner = StepPlanner(lambda policy, batch, seq: (make(policy), params, (tokens,)))
    options = dict(candidates=["none", "full"], mixes=False, planner=planner)
    every = remat_kit.auto(make, params, tokens, budget_bytes=10**12, exhaustive=True, **options)
    needs = {str(c.policy): c.need_bytes for c in every.candidates}
    assert needs["full"] < needs["none"], needs
    result = remat_kit.auto(make, params, tokens, budget_bytes=(needs["full"] + needs["none"]) // 2, **options)
    assert str(result.chosen) == "full"


# ---- the new families' own decode paths and switches (issue 45) ----------------------------------------------

HF = ["hf-gpt2", "hf-llama"]


@pytest.mark.parametrize("name", HF, ids=HF)
def test_hf_decode_keeps_its_cache_collection_looped_and_scanned(name):
    """HF Flax keeps its KV cache in each attention module's ``cache`` collection (``init_cache=True``), not in an
    argument of the block: under ``scan=True`` it goes back into each block's own collection, so decoding scans."""
    real = MODELS[name]
    n = real.depths[0]
    model = real.make(n)
    params = real.params(model)
    mask = jnp.ones((B, L), jnp.int32)  # HF's generate: the whole cache length, the future masked by the cache index
    cache = model.init(jax.random.key(0), TOKENS, mask, POSITIONS, init_cache=True)["cache"]

    def decode(m):
        t = L // 2
        out1, c = m.apply({**params, "cache": cache}, TOKENS[:, :t], mask, POSITIONS[:, :t], mutable=["cache"])
        out2, c = m.apply({**params, **c}, TOKENS[:, t : t + 1], mask, POSITIONS[:, t : t + 1], mutable=["cache"])
        return out1.logits, out2.logits, c["cache"]

    want = decode(model)
    for scan in (False, True):
        got = decode(remat_kit.apply(real.make(n), "full", scan=scan))
        assert_leaves_close(got, want)


def test_griffin_decode_is_the_plain_models_and_scan_names_the_per_block_cache():
    """Griffin passes each block its own cache (``cache[f"blocks.{i}"]``): decoding through ``apply`` is the plain
    model's; a scan cannot give each block its own array, and one line says so."""
    real = MODELS["griffin"]
    n = real.depths[0]
    model = real.make(n)
    params = real.params(model)

    def decode(m):
        t = L // 2
        logits1, cache = m.apply(params, TOKENS[:, :t], POSITIONS[:, :t])  # no cache: the prefill fills one
        logits2, cache = m.apply(params, TOKENS[:, t : t + 1], POSITIONS[:, t : t + 1], cache)
        return logits1, logits2, cache

    want = decode(model)
    got = decode(remat_kit.apply(real.make(n), "full"))
    assert_leaves_close(got[:2], want[:2])
    assert jax.tree.structure(got[2]) == jax.tree.structure(want[2])
    with pytest.raises(ValueError, match=r"gets its own cache= .*per-layer KV cache"):
        decode(remat_kit.apply(real.make(n), "full", scan=True))


def test_griffins_own_remat_is_seen_through_or_refused_in_one_line():
    """Griffin's default ``gradient_checkpointing=True`` puts every block under its own ``nn.remat``.

    ``apply`` either sees through it (the plain gradients, and the policy, not the model's remat, decides what is
    kept: the bytes of the same policy on ``gradient_checkpointing=False``) or refuses in one line naming
    ``nn.remat``; never the model's remat run as if the policy applied.
    """
    real = MODELS["griffin"]
    n = real.depths[0]
    params, want = _plain_grads(real, n)
    policy = "selective:mlp_block/*"  # keeps more than nn.remat's default (nothing), less than the plain model
    loss = remat_kit.apply_factory(_griffin(n, gradient_checkpointing=True), real.loss)(policy)
    try:
        got = jax.jit(jax.grad(loss))(params, TOKENS)
    except ValueError as err:
        assert "nn.remat" in str(err) and len(str(err).strip().splitlines()) == 1, str(err)
        return
    assert_leaves_close(got, want)
    without = remat_kit.apply_factory(real.make(n), real.loss)(policy)
    assert residual_bytes(loss, params, TOKENS) == residual_bytes(without, params, TOKENS)
