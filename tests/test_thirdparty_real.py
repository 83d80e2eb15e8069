"""remat_kit.apply on models installed from the registry and left unedited (issue 36).

google-tunix's Llama3 and Qwen3 (NNX) and gemma's ``gm.nn.Gemma3_270M`` (Linen), each at a tiny size made
from its own config class (``dataclasses.replace`` of its smallest config) with random weights: nothing is
downloaded. The packages are pinned in ci/thirdparty.txt (gemma needs Python >= 3.12); .ci/run installs
them into its newest-Python venv and runs this module with REMAT_KIT_REQUIRE_THIRDPARTY=1, which turns the
skip below into a failure. Without the packages (the default venv) each model's tests skip, saying why.

Tests whose docstring says ``needs the apply36 fixes`` exercise issue 36's items 2 and 4 as well (default
``offload`` through apply; gm.nn's ``nn.jit``-wrapped ``__call__`` seen through), merged as branch apply36.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

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


@pytest.fixture(autouse=True)
def _numpy_broadcasting():
    """The models broadcast by NumPy's rules (tunix's RMSNorm: ``w * x``); the suite's conftest raises on that."""
    with jax.numpy_rank_promotion("allow"):
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


@dataclasses.dataclass(frozen=True)
class Real:
    """One third-party model: how to build it at a depth, call it, and name its block's parts."""

    name: str
    nnx: bool
    make: Callable[[int], Any]  # num_layers -> the plain model (NNX: with random weights)
    depths: tuple[int, int]  # two depths for the scan tests (the second twice the first)
    selective: str  # a selective policy by module path
    paths: tuple[str, ...]  # module paths names_of must list

    def loss(self, model: Any, *rest: Any) -> jax.Array:
        """apply_factory's loss: NNX ``loss(model, tokens)``, Linen ``loss(model, variables, tokens)``."""
        if self.nnx:
            (tokens,) = rest
            logits, cache = model(tokens, POSITIONS[: len(tokens)], None, CAUSAL[: len(tokens)])
            assert cache is None
        else:
            variables, tokens = rest
            logits = model.apply(variables, tokens).logits
        return jnp.sum(logits.astype(jnp.float32) * WEIGHTS[: len(tokens)])

    def params(self, model: Any) -> Any:
        return nnx.state(model, nnx.Param) if self.nnx else model.init(jax.random.key(0), TOKENS)

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


# ---- names and every policy kind ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_names_of_lists_the_blocks_module_paths(name):
    """gemma-gm.nn: needs the apply36 fixes (nn.jit's trace cache hides the blocks once the plain model ran)."""
    real = MODELS[name]
    model = real.make(real.depths[0])
    table = (
        remat_kit.names_of(model, TOKENS, POSITIONS, None, CAUSAL) if real.nnx else remat_kit.names_of(model, TOKENS)
    )
    missing = [p for p in real.paths if p not in table.names]
    assert not missing, f"{missing} not in {table.names}"


def _policies(real: Real) -> list:
    return [
        "full",
        "every_n:2",
        real.selective,
        "offload:attn/*",
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
        assert jax.tree.map(jnp.shape, applied.init(jax.random.key(0), TOKENS)) == jax.tree.map(jnp.shape, params)
    assert_leaves_close(jax.jit(jax.grad(make("full")))(params, TOKENS), want)
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
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))

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


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
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
            logits = head[0].apply(head[1], t).logits
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

    make = remat_kit.apply_factory(model, loss, scan=True)
    planner = StepPlanner(lambda policy, batch, seq: (make(policy), params, (tokens,)))
    options = dict(candidates=["none", "full"], mixes=False, planner=planner)
    every = remat_kit.auto(make, params, tokens, budget_bytes=10**12, exhaustive=True, **options)
    needs = {str(c.policy): c.need_bytes for c in every.candidates}
    assert needs["full"] < needs["none"], needs
    result = remat_kit.auto(make, params, tokens, budget_bytes=(needs["full"] + needs["none"]) // 2, **options)
    assert str(result.chosen) == "full"
