"""Models written the way gm.nn (Linen) and Flax's NNX examples write theirs, with no remat_kit in them.

Used by tests/test_unedited.py and benchmarks/unedited.py. Gemma-style:
RMSNorms named ``pre_attention_norm``/``pre_ffw_norm``, attention projections ``q_einsum``/``k_einsum``/
``attn_vec_einsum``, a FeedForward computing with its own ``gating_einsum``/``linear`` params, a
Python bool per layer (local/global attention), dropout, ``sow``, bfloat16 compute.

Decoders written the way gm.nn's ``Transformer`` and tunix's Llama3/Qwen3 write theirs (what remat_kit met
on the real models): every block takes the same ``positions``, attention ``mask`` (and tunix's
``segment_ids``) beside its input and its own layer's KV ``cache`` (None in training), and returns
``(cache, x)``; the NNX one holds a ``@dataclass(slots=True)`` config that is not frozen, so its graph
cannot be hashed.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name


def _attend(q, k, v, is_local):
    s = jnp.einsum("btd,bsd->bts", q, k) / q.shape[-1] ** 0.5
    t = s.shape[-1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    if is_local:  # a sliding window of 2
        mask = mask & ~jnp.tril(jnp.ones((t, t), bool), -2)
    return jnp.einsum("bts,bsd->btd", jax.nn.softmax(jnp.where(mask, s, -1e9)), v)


# ---- Linen (gm.nn style) ---------------------------------------------------------------------------


class FeedForward(nn.Module):
    features: int
    hidden: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("gating_einsum", nn.initializers.lecun_normal(), (2, self.features, self.hidden))
        g = jnp.einsum("...d,cdf->c...f", x, w.astype(self.dtype))
        lin = self.param("linear", nn.initializers.lecun_normal(), (self.hidden, self.features))
        return jnp.einsum("...f,fd->...d", nn.gelu(g[0]) * g[1], lin.astype(self.dtype))


class Attention(nn.Module):
    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, is_local):
        dense = lambda name: nn.Dense(self.features, use_bias=False, dtype=self.dtype, name=name)
        q, k = dense("q_einsum")(x), dense("k_einsum")(x)
        return dense("attn_vec_einsum")(_attend(q, k, x, is_local))


class Block(nn.Module):
    features: int
    dropout: float = 0.1
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, is_local, deterministic):
        h = Attention(self.features, self.dtype, name="attn")(nn.RMSNorm(name="pre_attention_norm")(x), is_local)
        x = x + nn.Dropout(self.dropout)(h, deterministic=deterministic)
        self.sow("intermediates", "residual", x)
        return x + FeedForward(self.features, 2 * self.features, self.dtype, name="mlp")(
            nn.RMSNorm(name="pre_ffw_norm")(x)
        )


class InlineModel(nn.Module):
    """Blocks created inline in ``@nn.compact``, local/global alternating (``alternate=False``: all global)."""

    num_layers: int = 4
    features: int = 8
    dtype: jnp.dtype = jnp.float32
    alternate: bool = True

    @nn.compact
    def __call__(self, x, deterministic=True):
        for i in range(self.num_layers):
            is_local = self.alternate and i % 2 == 0
            x = Block(self.features, dtype=self.dtype, name=f"layer_{i}")(x, is_local, deterministic)
        return nn.RMSNorm(name="final_norm")(x)


class SetupModel(nn.Module):
    """Blocks created in ``setup`` as a list (flax names them ``blocks_0``, ...), every one global."""

    num_layers: int = 4
    features: int = 8

    def setup(self):
        self.blocks = [Block(self.features) for _ in range(self.num_layers)]
        self.final_norm = nn.RMSNorm()

    def __call__(self, x, deterministic=True):
        for block in self.blocks:
            x = block(x, False, deterministic)
        return self.final_norm(x)


class AttributesModel(nn.Module):
    """Blocks held as attributes ``layers_0 … layers_{L-1}`` made in ``setup`` (how some ports of PyTorch models do)."""

    num_layers: int = 4
    features: int = 8

    def setup(self):
        for i in range(self.num_layers):
            setattr(self, f"layers_{i}", Block(self.features))

    def __call__(self, x, deterministic=True):
        for i in range(self.num_layers):
            x = getattr(self, f"layers_{i}")(x, False, deterministic)
        return x


class JitModel(nn.Module):
    """gm.nn's ``Transformer``: ``__call__`` wrapped in ``nn.jit`` (its trace cache ignores method interceptors)."""

    num_layers: int = 4
    features: int = 8

    @functools.partial(nn.jit, static_argnames=("self", "deterministic"))
    @nn.compact
    def __call__(self, x, deterministic=True):
        for i in range(self.num_layers):
            x = Block(self.features, name=f"layer_{i}")(x, False, deterministic)
        return nn.RMSNorm(name="final_norm")(x)


class TransformedBlocksModel(nn.Module):
    """Blocks under a Flax lifted transform of their own: ``nn.remat(Block)``, ``nn.jit(Block)``, ``nn.vmap``."""

    transform: str = "remat"
    num_layers: int = 2

    @nn.compact
    def __call__(self, x, deterministic=True):
        wrap = {
            "remat": lambda cls: nn.remat(cls, static_argnums=(2, 3)),
            "jit": lambda cls: nn.jit(cls, static_argnums=(2, 3)),
            "vmap": lambda cls: nn.vmap(
                cls, in_axes=(0, None, None), variable_axes={"params": None}, split_rngs={"params": False}
            ),
        }[self.transform]
        x = x[None] if self.transform == "vmap" else x  # vmapped over a leading axis of one
        for i in range(self.num_layers):
            x = wrap(Block)(8, name=f"layer_{i}")(x, False, deterministic)
        return x[0] if self.transform == "vmap" else x


# ---- Linen (MaxText style: the layer carries its own checkpoint_name tags) ---------------------------


class TaggedBlock(nn.Module):
    """Tags its values with MaxText's names (``query_proj``, ``mlpwi_0``, ``mlpwi_1``), beside its submodules."""

    features: int

    @nn.compact
    def __call__(self, x):
        q = nn.Dense(self.features, use_bias=False, name="query")(nn.RMSNorm(name="norm")(x))
        q = checkpoint_name(q, "query_proj")
        h = x + jnp.tanh(q)
        gate = checkpoint_name(nn.Dense(2 * self.features, use_bias=False, name="wi_0")(h), "mlpwi_0")
        up = checkpoint_name(nn.Dense(2 * self.features, use_bias=False, name="wi_1")(h), "mlpwi_1")
        return h + nn.Dense(self.features, use_bias=False, name="wo")(nn.silu(gate) * up)


class TaggedModel(nn.Module):
    num_layers: int = 2
    features: int = 8

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = TaggedBlock(self.features, name=f"layers_{i}")(x)
        return x


# ---- Linen: blocks that write mutable collections ----------------------------------------------------


class StatefulBlock(nn.Module):
    """Writes ``batch_stats`` (BatchNorm in training) and a ``cache`` (a call count, the last input)."""

    features: int

    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=not self.is_mutable_collection("batch_stats"), name="norm")(x)
        calls = self.variable("cache", "calls", jnp.zeros, (), jnp.int32)
        last = self.variable("cache", "last_input", jnp.zeros, x.shape, x.dtype)
        if self.is_mutable_collection("cache"):
            calls.value += 1
            last.value = x
        return x + nn.Dense(self.features, name="up")(jnp.tanh(h))


class StatefulModel(nn.Module):
    num_layers: int = 3
    features: int = 8

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = StatefulBlock(self.features, name=f"layer_{i}")(x)
        return x


# ---- NNX (Flax's NNX examples style) ---------------------------------------------------------------


class NnxFeedForward(nnx.Module):
    def __init__(self, d, f, *, rngs):
        init = nnx.initializers.lecun_normal()
        self.gating_einsum = nnx.Param(init(rngs.params(), (2, d, f)))
        self.linear = nnx.Param(init(rngs.params(), (f, d)))

    def __call__(self, x):
        g = jnp.einsum("...d,cdf->c...f", x, self.gating_einsum[...].astype(x.dtype))
        return jnp.einsum("...f,fd->...d", jax.nn.gelu(g[0]) * g[1], self.linear[...].astype(x.dtype))


class NnxAttention(nnx.Module):
    def __init__(self, d, *, dtype=None, rngs):
        self.q_einsum = nnx.Linear(d, d, use_bias=False, dtype=dtype, rngs=rngs)
        self.k_einsum = nnx.Linear(d, d, use_bias=False, dtype=dtype, rngs=rngs)
        self.attn_vec_einsum = nnx.Linear(d, d, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, is_local):
        return self.attn_vec_einsum(_attend(self.q_einsum(x), self.k_einsum(x), x, is_local))


class NnxBlock(nnx.Module):
    """``sow``: store the residual after attention as an ``nnx.Intermediate`` (Gemma's ``sow_config``);
    ``dtype``: the compute dtype (parameters stay float32)."""

    def __init__(self, d, *, sow=False, dtype=None, rngs):
        self.pre_attention_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.attn = NnxAttention(d, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.pre_ffw_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.mlp = NnxFeedForward(d, 2 * d, rngs=rngs)
        self.sow_residual = sow

    def __call__(self, x, is_local, deterministic=False):
        x = x + self.dropout(self.attn(self.pre_attention_norm(x), is_local), deterministic=deterministic)
        if self.sow_residual:
            self.sow(nnx.Intermediate, "residual", x)
        return x + self.mlp(self.pre_ffw_norm(x))


class NnxModel(nnx.Module):
    """``self.layers`` an ``nnx.List``; ``alternate``: local/global attention per layer; ``sow``, ``dtype``:
    see NnxBlock."""

    def __init__(self, num_layers=4, d=8, *, alternate=True, sow=False, dtype=None, rngs):
        self.layers = nnx.List([NnxBlock(d, sow=sow, dtype=dtype, rngs=rngs) for _ in range(num_layers)])
        self.final_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.alternate = alternate

    def __call__(self, x, deterministic=False):
        for i, layer in enumerate(self.layers):
            x = layer(x, self.alternate and i % 2 == 0, deterministic)
        return self.final_norm(x)


class NnxJitModel(NnxModel):
    """``__call__`` decorated with ``nnx.jit``, and (``jit_blocks``) each block's ``__call__`` too."""

    def __init__(self, num_layers=4, d=8, *, jit_blocks=False, rngs):
        super().__init__(num_layers, d, alternate=False, rngs=rngs)
        if jit_blocks:
            self.layers = nnx.List([NnxJitBlock(d, rngs=rngs) for _ in range(num_layers)])

    @nnx.jit(static_argnames="deterministic")
    def __call__(self, x, deterministic=False):
        return super().__call__(x, deterministic)


class NnxJitBlock(NnxBlock):
    @nnx.jit(static_argnums=(2, 3))
    def __call__(self, x, is_local, deterministic=False):
        return super().__call__(x, is_local, deterministic)


# ---- decoders with a KV cache: shared arrays per block, (cache, x) returns ---------------------------------


def _cache_attend(q, k, v, positions, cache, mask, segment_ids=None):
    """Attention over the sequence or, with ``cache``, over the cache updated at its ``end_index``: (cache, out)."""
    q = q * jnp.cos(positions[..., None] / 4.0)  # a stand-in for rotary embeddings: positions matter
    k = k * jnp.cos(positions[..., None] / 4.0)
    if cache is not None:
        at = cache["end_index"][0]
        k = jax.lax.dynamic_update_slice(cache["k"], k, (0, at, 0))
        v = jax.lax.dynamic_update_slice(cache["v"], v, (0, at, 0))
        cache = {"k": k, "v": v, "end_index": cache["end_index"] + q.shape[1]}
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    s = jnp.einsum("btd,bsd->bts", q, k) / q.shape[-1] ** 0.5
    return cache, jnp.einsum("bts,bsd->btd", jax.nn.softmax(jnp.where(mask, s, -1e9)), v)


def init_cache(num_layers, batch, length, d):
    """A KV cache per layer, ``layer_{i}: {k, v, end_index}`` (gm.nn's and tunix's layout)."""
    zeros = jnp.zeros((batch, length, d))
    return {
        f"layer_{i}": {"k": zeros, "v": zeros, "end_index": jnp.zeros((batch,), jnp.int32)} for i in range(num_layers)
    }


class CacheBlock(nn.Module):
    """gm.nn's Block in small: ``(x, positions, cache, mask) -> (cache, x)``."""

    features: int

    @nn.compact
    def __call__(self, x, positions, cache, mask):
        h = nn.RMSNorm(name="pre_attention_norm")(x)
        dense = lambda name: nn.Dense(self.features, use_bias=False, name=name)
        cache, a = _cache_attend(
            dense("q_einsum")(h), dense("k_einsum")(h), dense("v_einsum")(h), positions, cache, mask
        )
        x = x + dense("attn_vec_einsum")(a)
        return cache, x + FeedForward(self.features, 2 * self.features, name="mlp")(nn.RMSNorm(name="pre_ffw_norm")(x))


class CacheModel(nn.Module):
    """gm.nn's Transformer in small: blocks ``layer_{i}`` made in ``setup``, each given its layer's cache."""

    num_layers: int = 4
    features: int = 8

    def setup(self):
        self.blocks = [CacheBlock(self.features, name=f"layer_{i}") for i in range(self.num_layers)]
        self.final_norm = nn.RMSNorm()

    def __call__(self, x, positions, mask, cache=None):
        old, new = cache or {}, {}
        for i, block in enumerate(self.blocks):
            new[f"layer_{i}"], x = block(x, positions, old.get(f"layer_{i}"), mask)
        return self.final_norm(x), (None if cache is None else new)


@dataclasses.dataclass(slots=True)
class DecoderConfig:
    """Not frozen, so not hashable (tunix's Qwen3 ``ModelConfig``); every module of the decoder holds it."""

    num_layers: int = 4
    d: int = 8


class NnxDecoderLayer(nnx.Module):
    """tunix's DecoderLayer in small: ``(x, positions, cache, mask, segment_ids=None) -> (cache, x)``."""

    def __init__(self, config: DecoderConfig, *, rngs):
        d = config.d
        self.config = config
        self.input_layernorm = nnx.RMSNorm(d, rngs=rngs)
        self.q_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(d, rngs=rngs)
        self.mlp = NnxFeedForward(d, 2 * d, rngs=rngs)

    def __call__(self, x, segment_pos, cache, attn_mask, segment_ids=None):
        h = self.input_layernorm(x)
        cache, a = _cache_attend(
            self.q_proj(h), self.k_proj(h), self.v_proj(h), segment_pos, cache, attn_mask, segment_ids
        )
        x = x + self.o_proj(a)
        return cache, x + self.mlp(self.post_attention_layernorm(x))


class NnxDecoder(nnx.Module):
    """tunix's Llama3/Qwen3 in small: ``layers`` an ``nnx.List``; returns ``(out, new cache or None)``."""

    def __init__(self, config: DecoderConfig, *, rngs):
        self.config = config
        self.layers = nnx.List([NnxDecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.d, rngs=rngs)

    def __call__(self, x, positions, cache, attention_mask, segment_ids=None):
        new_cache = None if cache is None else {}
        for i, layer in enumerate(self.layers):
            layer_cache = cache[f"layer_{i}"] if cache else None
            layer_cache, x = layer(x, positions, layer_cache, attention_mask, segment_ids=segment_ids)
            if cache is not None:
                new_cache[f"layer_{i}"] = layer_cache
        return self.final_norm(x), new_cache


# ---- a MODULE:FACTORY for the CLI (remat-kit tags/plan/bench --model tests.unedited_models:factory) -------


def factory(policy):
    """``(loss_fn, (variables, x))`` for the unedited inline model under ``policy`` (abstract inputs)."""
    import remat_kit

    model = InlineModel()
    x = jax.ShapeDtypeStruct((2, 6, 8), jnp.float32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape)))
    make_loss = remat_kit.apply_factory(model, lambda m, v, x: jnp.sum(m.apply(v, x) ** 2))
    return make_loss(policy), (variables, x)


# ---- issue 45: what people install beside one block class in a loop ----------------------------------------


class GptBlock(nn.Module):
    """A GPT-2 style block (Flax Linen, as Hugging Face's Flax GPT-2 writes it): its matmuls are the model's compute."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * x.shape[-1], name="up")(nn.LayerNorm(name="ln")(x))
        return x + nn.Dense(x.shape[-1], name="down")(jnp.tanh(h))


class GptBlocks(nn.Module):
    """The collection of blocks (HF's ``FlaxGPT2BlockCollection``), named by their index."""

    num_layers: int = 4

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = GptBlock(name=str(i))(x)
        return x


class GptModel(nn.Module):
    """Two embeddings (token, position) beside the blocks: the shallowest repeated class is ``Embed``."""

    vocab: int = 64
    d: int = 8

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d, name="wte")(tokens) + nn.Embed(tokens.shape[1], self.d, name="wpe")(
            jnp.arange(tokens.shape[1])[None]
        )
        return GptBlocks(name="h")(x)


class KindBlock(nn.Module):
    """One block class of two kinds (Griffin's recurrent and attention blocks): each emits names the other lacks."""

    kind: str
    expand: int = 1

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.expand * x.shape[-1], name="rec" if self.kind == "r" else "attn")(x)
        return x + nn.Dense(x.shape[-1], name="mlp")(jnp.tanh(h))


class PeriodModel(nn.Module):
    """Blocks in a period of kinds (``rra``: recurrent, recurrent, attention), as recurrentgemma lays them out."""

    pattern: str = "rra"
    expand: int = 1

    @nn.compact
    def __call__(self, x):
        for i, kind in enumerate(self.pattern):
            x = KindBlock(kind, self.expand, name=f"b{i}")(x)
        return x


class DenseLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1], name="ffw")(jnp.tanh(nn.Dense(x.shape[-1], name="proj")(x)))


class ExpertLayer(nn.Module):
    """A second block class beside :class:`DenseLayer` (dense and MoE layers), carrying more of the compute."""

    experts: int = 2

    @nn.compact
    def __call__(self, x):
        outs = [jnp.tanh(nn.Dense(x.shape[-1], name=f"expert_{e}")(x)) for e in range(self.experts)]
        return x + sum(outs) + nn.Dense(x.shape[-1], name="proj")(x)


class MixedLayersModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = (DenseLayer if i % 2 == 0 else ExpertLayer)(name=f"layer_{i}")(x)
        return x


class CheckpointInsideBlock(nn.Module):
    """A block that rematerializes its up projection itself with ``jax.checkpoint`` (a model's own remat switch)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 4 * x.shape[-1]))
        h = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))(x, w)
        return x + nn.Dense(x.shape[-1], name="down")(h)


class Loop(nn.Module):
    """``num_layers`` blocks of one class in a Python loop, named ``layer_{i}``."""

    block: type
    num_layers: int = 3

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = self.block(name=f"layer_{i}")(x)
        return x


class NnxUpDown(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class NnxSequentialCheckpointed(nnx.Module):
    """MaxText's sequential NNX decoder in miniature: every layer under the model's own ``jax.checkpoint``."""

    def __init__(self, d: int, rngs: nnx.Rngs, num_layers: int = 4):
        self.layers = nnx.List([NnxUpDown(d, rngs) for _ in range(num_layers)])

    def __call__(self, x):
        for layer in self.layers:
            graphdef, state = nnx.split(layer)
            x = jax.checkpoint(lambda s, x, g=graphdef: nnx.merge(g, s)(x))(state, x)
        return x


class NnxRematInsideBlock(nnx.Module):
    """A block that runs its MLP under ``nnx.remat`` (tunix's ``RematConfig.BLOCK``)."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.mlp = NnxUpDown(d, rngs)

    def __call__(self, x):
        return nnx.remat(lambda m, x: m(x))(self.mlp, x)


class NnxRematInsideModel(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs, num_layers: int = 4):
        self.layers = nnx.List([NnxRematInsideBlock(d, rngs) for _ in range(num_layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class NnxScannedCheckpointed(nnx.Module):
    """Blocks under the model's own checkpoint inside a ``lax.scan`` (cannot be seen through: refused)."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.layers = nnx.List([NnxUpDown(d, rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            graphdef, state = nnx.split(layer)
            body = jax.checkpoint(lambda c, s, g=graphdef: nnx.merge(g, s)(c))
            x = jax.lax.scan(lambda c, _, s=state, f=body: (f(c, s), None), x, None, length=1)[0]
        return x


class LinearBlock(nn.Module):
    """A block whose backward needs nothing but its input: no policy can change what it keeps."""

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1], name="proj", use_bias=False)(x)


def max_seq_factory():
    """``(model, loss_fn, args_at)`` for ``remat-kit plan --max-seq --model tests.unedited_models:max_seq_factory``:
    remat_kit.max_seq's arguments (the inline model, all global, abstract variables)."""
    model = InlineModel(num_layers=4, features=16, alternate=False)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((1, 8, 16))))
    args_at = lambda seq: (variables, jax.ShapeDtypeStruct((1, seq, 16), jnp.float32))
    return model, (lambda m, v, x: jnp.mean(m.apply(v, x) ** 2)), args_at
