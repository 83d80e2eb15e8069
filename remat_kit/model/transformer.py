"""A decoder-only transformer LM whose layers run under the scan core.

RMSNorm pre-norm, RoPE, causal multi-head attention with grouped key/value heads, SwiGLU MLP,
residual dropout, separate parameter and compute dtypes. Every tag of :mod:`remat_kit.names` is
attached inside :class:`Block`, so any selective or offload policy can address it.

The block is *lean*: what its backward pass keeps is chosen here, not left to autodiff. Without a
policy (``none``) a layer keeps what its backward pass needs and nothing else: its input, the two
norm outputs, the rotated q and k, v, the context (and attention's float32 per-query logsumexp), the
post-attention residual stream, gate, up and their product, all in the compute dtype (on the 2B
preset 0.94 × Korthikanti's 34·b·s·h per layer; ``benchmarks/results/plan_2b.txt``). Three small
``jax.custom_vjp`` functions of :mod:`remat_kit.model.ops` make it so, with :func:`remat_kit.model.attention.rope`
(which keeps nothing):

* :func:`~remat_kit.model.ops.project` (every weight matmul, the output head too) keeps the *stored* weight, which the
  scan forwards for free, and casts it to the compute dtype again in the backward pass: no
  compute-dtype copy of a weight is ever a residual;
* :func:`~remat_kit.model.ops.rms_norm` keeps its input and recomputes its float32 statistics in the backward pass;
* :func:`~remat_kit.model.ops.swiglu` keeps gate and up (not silu's three intermediates).

Each backward pass is exactly autodiff's up to float rounding (``tests/test_model.py`` compares
them with Flax's ``Dense``/``RMSNorm`` and ``silu``). Being ``custom_vjp`` functions, they are
transparent to ``jax.checkpoint`` policies: every tag and every dot stays visible to them.

>>> import jax, jax.numpy as jnp
>>> cfg = TransformerConfig.preset("tiny")
>>> model = Transformer(config=cfg, policy=policies.parse("selective"))
>>> tokens = jnp.zeros((2, 16), jnp.int32)
>>> params = model.init(jax.random.key(0), tokens)
>>> model.apply(params, tokens).shape
(2, 16, 256)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat_kit import constants, names, policies
from remat_kit.linen.scan import stack
from remat_kit.model import attention, lora_layer
from remat_kit.model.ops import project, rms_norm, swiglu
from remat_kit.policies import tiling
from remat_kit.units import check_int

DTYPES: tuple[str, ...] = constants.DTYPES


#: ``seq_tiles="auto"`` tiles a step once its batch × sequence passes this many tokens, with tiles of about
#: this many tokens each: the per-tile working set then stays fixed as the sequence grows.
AUTO_TILE_TOKENS = 4096


def check_seq_tiles(seq_tiles) -> int | str:
    """``seq_tiles`` as given once it is ``"auto"`` or an integer >= 1 (one line naming it otherwise).

    >>> check_seq_tiles("auto"), check_seq_tiles(4)
    ('auto', 4)
    """
    if isinstance(seq_tiles, str) and seq_tiles == "auto":
        return seq_tiles
    if isinstance(seq_tiles, bool) or not isinstance(seq_tiles, int) or seq_tiles < 1:
        raise ValueError(f"seq_tiles must be 'auto' or an integer >= 1 (1: untiled), got {seq_tiles!r}")
    return seq_tiles


def auto_tiles(batch: int, seq: int) -> int:
    """The tile count ``seq_tiles="auto"`` picks: 1 up to :data:`AUTO_TILE_TOKENS` tokens, else the smallest
    divisor of ``seq`` that brings a tile to at most that many tokens.

    >>> auto_tiles(2, 1024), auto_tiles(2, 16384), auto_tiles(1, 6000)
    (1, 8, 2)
    """
    tokens = batch * seq
    if tokens <= AUTO_TILE_TOKENS:
        return 1
    need = -(-tokens // AUTO_TILE_TOKENS)
    return next(k for k in range(need, seq + 1) if seq % k == 0)


def resolve_tiles(seq_tiles, batch: int, seq: int) -> int:
    """``seq_tiles`` as a count for a ``batch × seq`` step: ``"auto"`` becomes :func:`auto_tiles`; a count
    must divide ``seq`` (one line naming both otherwise).

    >>> resolve_tiles("auto", 2, 16384), resolve_tiles(4, 2, 1024)
    (8, 4)
    """
    seq_tiles = check_seq_tiles(seq_tiles)
    if seq_tiles == "auto":
        return auto_tiles(batch, seq)
    return tiling.check_tiles(seq_tiles, seq, what="seq_tiles")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Model shape and numerics. Build presets with :meth:`preset`.

    Attributes:
      vocab_size: number of token ids.
      d_model: width of the residual stream.
      num_layers: depth.
      num_heads: query heads; ``d_model`` must be divisible by it.
      num_kv_heads: key/value heads (grouped-query attention); divides ``num_heads``.
      d_ff: hidden width of the SwiGLU MLP.
      max_seq_len: the longest sequence the model accepts.
      dropout: residual dropout rate in [0, 1).
      dtype: compute dtype name.
      param_dtype: parameter dtype name.
      rope_base: RoPE frequency base.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: use the embedding matrix as the output projection.
      attention: attention implementation, one of :data:`remat_kit.model.attention.ATTENTION_KINDS`;
        ``auto`` (default) is cuDNN flash attention on a GPU, ``chunked`` elsewhere.
      attention_block: block size of ``chunked`` attention in positions; None for the backend's
        default (:func:`remat_kit.model.attention.default_block`).
      lora_rank, lora_alpha, lora_targets, quantize: LoRA adapters / an int8 or NF4 base: its Block
        kernels, embedding and untied output head (see :mod:`remat_kit.model.lora`).
      seq_tiles: run the block's per-token parts (the norms, the q/k/v projections, the attention output
        projection, the MLP, the residual adds) over the sequence in this many tiles, each under its own
        checkpoint (:func:`remat_kit.policies.tiling.tiled`), so a layer's recompute never holds their whole-sequence
        intermediates; 1 (default) untiled; ``"auto"``: :func:`auto_tiles` of the shape. Attention itself
        cannot be tiled by position (it mixes them); it is chunked instead (``attention``). With tiles, a batch
        of several rows runs each layer one row at a time (attention never mixes rows), so a layer's backward
        pass holds one row's whole-sequence attention state.
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    d_ff: int = 176
    max_seq_len: int = 128
    dropout: float = 0.0
    dtype: str = "float32"
    param_dtype: str = "float32"
    rope_base: float = 10_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    attention: str = "auto"
    attention_block: int | None = None
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    quantize: str = "none"
    seq_tiles: int | str = 1

    def __post_init__(self):
        for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff", "max_seq_len"):
            check_int(f"TransformerConfig.{field}", getattr(self, field))
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"head_dim={self.d_model // self.num_heads} must be even for RoPE")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field}={getattr(self, field)!r}; allowed: {', '.join(DTYPES)}")
        attention.check_kind(self.attention, self.dtype, self.head_dim)
        check_int("attention_block", self.attention_block, none_ok=True)
        if isinstance(self.lora_targets, list):
            # A config that went through JSON (a bench worker's job, checkpoint metadata) has a list here.
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        lora_layer.check_config(self)
        check_seq_tiles(self.seq_tiles)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TransformerConfig:
        """A named preset with optional field overrides.

        Args:
          name: one of :data:`PRESETS` (``tiny`` for tests, ``small`` for CPU benchmarks, ``2b``
            for compile-only planning of the seed's 2B-class model).
          **overrides: any config field.

        Raises:
          ValueError: an unknown preset name. TypeError: an unknown field.

        >>> TransformerConfig.preset("2b").d_model
        2048
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"unknown TransformerConfig field(s) {unknown}; allowed: {', '.join(sorted(fields))}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def num_params(self) -> int:
        """Parameter count (embeddings included)."""
        d, f, hd = self.d_model, self.d_ff, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.num_layers * per_layer + self.vocab_size * d + head + d


PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(),
    "small": TransformerConfig(
        vocab_size=4096, d_model=256, num_layers=8, num_heads=8, num_kv_heads=8, d_ff=704, max_seq_len=512
    ),
    # The seeds' illustrative 2B-class model; plan it with remat_kit.planning.analysis, never instantiate it here.
    "2b": TransformerConfig(
        vocab_size=248_000,
        d_model=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        d_ff=6144,
        max_seq_len=4096,
        dtype="bfloat16",
        param_dtype="float32",
        tie_embeddings=True,
    ),
}

#: (batch, seq) each preset is measured at by default.
PRESET_SHAPES: dict[str, tuple[int, int]] = constants.PRESET_SHAPES


class Dense(nn.Module):
    """A bias-free dense layer over :func:`project`; its parameter tree is ``nn.Dense``'s (``kernel``).

    Attributes:
      features: output width.
      dtype: compute dtype; param_dtype: the kernel's dtype.
    """

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):  # [..., in] -> [..., features]
        kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features), self.param_dtype)
        return project(x.astype(self.dtype), kernel, 0, jnp.dtype(self.dtype))


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned scale; its parameter tree is ``nn.RMSNorm``'s (``scale``)."""

    epsilon: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, scale, self.epsilon, jnp.dtype(self.dtype))


def _dense(features: int, cfg: TransformerConfig, name: str) -> nn.Module:
    if lora_layer.enabled(cfg):  # adapters and/or an int8 base: same parameter names, see remat_kit.model.lora
        return lora_layer.dense(features, cfg, name)
    return Dense(features, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), name=name)


def _norm(cfg: TransformerConfig, name: str) -> RMSNorm:
    return RMSNorm(epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), name=name)


class Block(nn.Module):
    """One lean pre-norm transformer layer; emits every tag of :data:`remat_kit.names.VOCABULARY`.

    Attributes:
      config: the model shape; its ``seq_tiles`` runs the per-token parts in sequence tiles.
      tile_policy: what each sequence tile's checkpoint keeps (the layer's policy, so a tile keeps what the
        layer would: nothing for ``full``, the tagged outputs for ``selective``, everything for ``none``);
        None keeps nothing but the tile's inputs.
    """

    config: TransformerConfig
    tile_policy: Any = None

    @nn.compact
    def __call__(self, x, deterministic: bool = True):  # x: [batch, seq, d_model]
        cfg = self.config
        b, s, _ = x.shape
        h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = names.tag(x, names.LAYER_INPUT)
        attn_norm, mlp_norm = _norm(cfg, "attn_norm"), _norm(cfg, "mlp_norm")
        q_proj, k_proj, v_proj = (_dense(n * hd, cfg, f"{w}_proj") for n, w in ((h, "q"), (kv, "k"), (kv, "v")))
        attn_out = _dense(cfg.d_model, cfg, "attn_out")
        gate_proj, up_proj = _dense(cfg.d_ff, cfg, "mlp_gate"), _dense(cfg.d_ff, cfg, "mlp_up")
        out_proj = _dense(cfg.d_model, cfg, "mlp_out")
        drop = cfg.dropout > 0 and not deterministic
        keys = (self.make_rng("dropout"), self.make_rng("dropout")) if drop else (None, None)

        tiles = resolve_tiles(cfg.seq_tiles, b, s)
        # With sequence tiles (long context) the layer also runs one batch row at a time, under a scan over the
        # rows: attention mixes positions within a row, never across rows, so a row's backward pass holds that
        # row's whole-sequence q, k, v, attention output and their gradients, not the batch's (the 2B step for an
        # H100 under offload: benchmarks/results/long_context_h100.txt).
        rows = b if tiles > 1 and b > 1 and not self.is_initializing() else 1

        def layer(x, pos, row):  # one row (rows > 1) or the whole batch
            n_b = x.shape[0]
            # Each row draws its own dropout masks: fold the row into the keys.
            fold = rows > 1 and keys[0] is not None
            row_keys = tuple(jax.random.fold_in(k, row[0, 0]) for k in keys) if fold else keys

            def qkv(x, pos):  # per token: the attention norm, the q/k/v projections and q and k's rotation
                y = names.tag(attn_norm(x), names.ATTN_NORM)
                n = x.shape[1]
                q = names.tag(q_proj(y).reshape(n_b, n, h, hd), names.Q_PROJ)
                k = names.tag(k_proj(y).reshape(n_b, n, kv, hd), names.K_PROJ)
                v = names.tag(v_proj(y).reshape(n_b, n, kv, hd), names.V_PROJ)
                # A tile rotates by its own positions (kept by a policy that keeps everything); untiled, rope's
                # own 0 .. s - 1, so nothing more is kept.
                pos = pos if tiles > 1 else None
                return attention.rope(q, cfg.rope_base, pos), attention.rope(k, cfg.rope_base, pos), v

            def rest(x, context, pos):  # per token: attention's output projection, the MLP, both residual adds
                attn = names.tag(attn_out(context), names.ATTN_OUT)
                x = x + _dropout(attn, cfg.dropout, row_keys[0], pos)
                y = names.tag(mlp_norm(x), names.MLP_NORM)
                gate = names.tag(gate_proj(y), names.MLP_GATE)
                up = names.tag(up_proj(y), names.MLP_UP)
                act = names.tag(swiglu(gate, up), names.MLP_ACT)
                out = names.tag(out_proj(act), names.MLP_OUT)
                return x + _dropout(out, cfg.dropout, row_keys[1], pos)

            if tiles > 1 and not self.is_initializing():  # init creates the same parameters untiled
                qkv = tiling.tiled(qkv, tiles, policy=self.tile_policy)
                rest = tiling.tiled(rest, tiles, policy=self.tile_policy)
            # The positions ride along as a tiled input: a tile rotates q and k by its own positions, and its
            # dropout key is folded with its first position.
            q, k, v = qkv(x, pos)
            # attend() tags the context itself (inside chunked attention's custom_vjp); flat, so the out
            # projection's input is the very array attention's backward keeps, not a second copy.
            context = attention.attend(q, k, v, kind=cfg.attention, block=cfg.attention_block, flat=True)
            return rest(x, context, pos)

        pos = jnp.arange(s, dtype=jnp.int32)[None, :]
        if rows > 1:
            layer = tiling.tiled(layer, rows, axis=0, in_axes=(0, None, 0), policy=self.tile_policy)
        return layer(x, pos, jnp.arange(b, dtype=jnp.int32)[:, None])


def _dropout(y, rate: float, key, pos):
    """Residual dropout of ``y`` (``key`` None: none), its key folded with the first position of ``pos``
    (a sequence tile draws its own mask)."""
    if key is None:
        return y
    keep = jax.random.bernoulli(jax.random.fold_in(key, pos[0, 0]), 1.0 - rate, y.shape)
    return jnp.where(keep, y / (1.0 - rate), jnp.zeros_like(y))


class Transformer(nn.Module):
    """Decoder-only LM: embed → scanned :class:`Block` stack under ``policy`` → norm → logits.

    Attributes:
      config: the model shape.
      policy: rematerialization policy for the layer stack (a Policy or spec string).

    ``apply(params, tokens[batch, seq] int, deterministic=True)`` returns float32 logits
    ``[batch, seq, vocab]``; pass ``deterministic=False`` and ``rngs={"dropout": key}`` to train
    with dropout.
    """

    config: TransformerConfig
    policy: policies.Policy | str = "none"

    def __post_init__(self):
        # Validate before any tracing so bad input never surfaces as a JAX traceback.
        if not isinstance(self.config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(self.config).__name__}")
        object.__setattr__(self, "policy", policies.parse(self.policy, num_layers=self.config.num_layers))
        attention.resolve(self.config.attention, self.config.dtype, self.config.head_dim)  # backend checks
        super().__post_init__()

    def setup(self):
        cfg = self.config
        init = nn.initializers.normal(0.02)
        if cfg.quantize != "none":  # a quantized (frozen) base stores its embedding and head quantized too
            self.embed = lora_layer.QuantizedEmbed(
                cfg.vocab_size, cfg.d_model, cfg.quantize, dtype=jnp.dtype(cfg.dtype), embedding_init=init, name="embed"
            )
        else:
            self.embed = nn.Embed(
                cfg.vocab_size,
                cfg.d_model,
                dtype=jnp.dtype(cfg.dtype),
                param_dtype=jnp.dtype(cfg.param_dtype),
                embedding_init=init,
                name="embed",
            )
        self.layers = self.make_layers()
        self.final_norm = _norm(cfg, "final_norm")
        if not cfg.tie_embeddings:
            shape = (cfg.d_model, cfg.vocab_size)
            if cfg.quantize != "none":
                quantized = lambda key: lora_layer.quantize_matrix(init(key, shape, jnp.float32), cfg.quantize)
                self.lm_head = self.param("lm_head", quantized)
            else:
                self.lm_head = self.param("lm_head", init, shape, jnp.dtype(cfg.param_dtype))

    def make_layers(self) -> nn.Module:
        """The layer stack (called in ``setup``; a subclass may lay the layers out otherwise)."""
        # Long-context mode (sequence tiles) also keeps full's layer inputs as 16-bit words, which XLA:CPU does
        # not widen to float32 (remat_kit.policies.layers.run_packed).
        pack = self.config.seq_tiles != 1
        return stack(
            _block_class(self.config, self.policy), self.config.num_layers, self.policy, pack=pack, name="layers"
        )

    def hidden(self, tokens, deterministic: bool = True):
        """Final hidden states ``[batch, seq, d_model]`` (before the output projection)."""
        check_tokens(self.config, tokens)
        x = self.embed(tokens)
        x = self.layers(x, deterministic=deterministic)
        return self.final_norm(x)

    def output_weights(self):
        """The output projection as stored, ``(w, vocab_axis)``, in the parameter dtype.

        ``w`` is ``lm_head [d_model, vocab]`` (``vocab_axis=1``) or, with tied embeddings, the
        embedding ``[vocab, d_model]`` itself (``vocab_axis=0``): neither a transpose nor a cast of
        it is made here, so none is kept for the backward pass; users cast it where they multiply.
        Under a quantized base ``w`` is the stored quantized matrix (a mapping of its leaves): multiply
        by it with :func:`remat_kit.model.lora_layer.project_weight`, or hand it to
        :func:`remat_kit.model.loss.chunked_cross_entropy`, which both dequantize it inside the computation.
        """
        if self.config.tie_embeddings:
            return self.embed.embedding, 0
        return self.lm_head, 1

    def features(self, tokens, deterministic: bool = True):
        """``(hidden [batch, seq, d_model], w, vocab_axis)`` for a chunked loss (see :meth:`output_weights`)."""
        return (self.hidden(tokens, deterministic), *self.output_weights())

    def __call__(self, tokens, deterministic: bool = True):
        x = self.hidden(tokens, deterministic)
        w, vocab_axis = self.output_weights()
        return lora_layer.project_weight(x, w, 1 - vocab_axis, jnp.dtype(self.config.dtype), jnp.float32)


def _block_class(cfg: TransformerConfig, policy: policies.Policy | policies.Mix | None = None):
    # Sequence tiles keep what the layer's policy keeps; under a mix (parts with different rules, one block
    # class) they keep nothing but their inputs.
    tile_policy = policy if isinstance(policy, policies.Policy) else None
    return functools.partial(Block, config=cfg, tile_policy=tile_policy)


def check_tokens(cfg: TransformerConfig, tokens) -> None:
    """Raise a clear error for token arrays the model cannot take (checked on shapes, before compiling)."""
    shape = getattr(tokens, "shape", None)
    dtype = getattr(tokens, "dtype", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"tokens must be a [batch, seq] array, got shape {shape}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"tokens must be integers, got dtype {dtype}")
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"tokens must have batch >= 1 and seq >= 1, got shape {shape}")
    if shape[1] > cfg.max_seq_len:
        raise ValueError(f"sequence length {shape[1]} exceeds the model's max_seq_len={cfg.max_seq_len}")
    resolve_tiles(cfg.seq_tiles, shape[0], shape[1])


def init_params(config: TransformerConfig, key, batch: int = 1, seq: int | None = None):
    """Initialize parameters (the policy does not affect them)."""
    seq = seq or min(8, config.max_seq_len)
    return Transformer(config=config).init(key, jnp.zeros((batch, seq), jnp.int32))["params"]


def abstract_params(config: TransformerConfig):
    """Parameter ShapeDtypeStructs via ``jax.eval_shape``: nothing is allocated."""
    return jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
