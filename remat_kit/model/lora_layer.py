"""The LoRA layer: :class:`LoRADense`, a Dense with a low-rank adapter and an optional int8 or NF4 base.

This is what :class:`remat_kit.model.transformer.Block` builds when its config asks for adapters or a quantized
base (:func:`dense`, :func:`enabled`, :func:`check_config`); training with it (``partition``,
``update``, ``from_base`` ...) is :mod:`remat_kit.model.lora`, which re-exports every public name here.
Kept apart from it because :mod:`remat_kit.model.transformer` needs the layer while ``lora.from_base`` and
``lora.param_bytes`` need the model: layer below the model, training above it, no cycle.

``quantize="int8"`` (QLoRA-style) stores every Block kernel as int8 with a per-output-channel
absmax scale (``{"qvalue": int8 [d_in, d_out], "scale": float32 [1, d_out]}``) and computes
``(x @ qvalue) · scale`` in the compute dtype inside the block (:func:`int8_project`): under every
policy, ``none`` included, the backward pass keeps the int8 kernel and casts it again, never a
dequantized or compute-dtype copy.

``quantize="nf4"`` (QLoRA's own format, :mod:`remat_kit.model.nf4`) stores every Block kernel as
4-bit NormalFloat codes packed two per byte, with a double-quantized absmax per 64 weights
(``{"codes": uint8 [d_in, d_out/2], "absmax_q": int8, "absmax_scale": f32, "absmax_offset": f32}``).
:func:`nf4_project` dequantizes it inside the block (a temporary in the compute dtype, as
bitsandbytes does per matmul) and its backward pass keeps the packed codes and the scales and
dequantizes again: no dequantized kernel is ever saved, under any policy, ``none`` included.

A quantized base stores its other matrices the same way (:data:`BASE_MATRICES`): the embedding
table (int8 with a scale per row, or NF4), looked up by :class:`QuantizedEmbed`, which gathers the
stored rows and dequantizes those alone, and the untied output head; the output head, tied or not,
runs through :func:`project_weight` (the int8 or NF4 matmul above, contracting the table's axis 1
when tied) or, under the fused chunked loss, is dequantized there (:func:`dequantize_matrix`).

Why not a library: qwix 0.1.8 (Google's JAX quantization library) installs and imports on jax
0.10.2 and quantizes a plain Linen ``nn.Dense`` weight-only to int8 per channel
(``QtRule(weight_qtype="int8")`` → ``QArray(qvalue int8, scale [1, out])``), but it works by
intercepting parameter creation in the module being initialized. remat_kit's scan core initializes
each layer with ``layer.init`` inside ``self.param`` and applies it with ``layer.apply`` inside
``lax.scan`` + ``jax.checkpoint``; there qwix's ``quantize_model(Transformer(...), PtqProvider(...))``
fails at ``init`` with ``ValueError: It seems you're feeding an unquantized param to a quantized
model.`` (``qwix/_src/providers/ptq.py``, ``create_quantized_param``), for the PTQ and the LoRA
providers alike. So this module carries the smallest correct int8 and NF4 paths instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat_kit import constants
from remat_kit.model import nf4
from remat_kit.model.ops import matmul, project, weight_grad

# The trainable part (adapters) is the shared step's (it trains any model the same way); re-exported here.
from remat_kit.step.update import ADAPTER_NAMES as ADAPTER_NAMES
from remat_kit.step.update import combine as combine
from remat_kit.step.update import init_optimizer as init_optimizer
from remat_kit.step.update import is_adapter as is_adapter
from remat_kit.step.update import partition as partition
from remat_kit.step.update import update as update

#: The Dense layers of :class:`remat_kit.model.transformer.Block` an adapter may target.
TARGETS: tuple[str, ...] = constants.LORA_TARGETS

#: Base-weight storage: ``none`` (param dtype), ``int8`` (per-output-channel absmax scale) or ``nf4``
#: (QLoRA's 4-bit NormalFloat, :mod:`remat_kit.model.nf4`).
QUANTIZE_MODES: tuple[str, ...] = constants.QUANTIZE_MODES

#: Compute dtypes the quantized paths support. int8's matmul runs on unscaled int8 values (up to 127x
#: the real output) before the scale, which float16's range (65504) cannot hold at d_model in the
#: thousands; nf4 keeps the same list (one rule for a quantized base; float16 is untested there).
QUANTIZE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def check_config(config: Any) -> None:
    """Validate the ``lora_*`` and ``quantize`` fields of a TransformerConfig (raise one-line ValueErrors).

    Args:
      config: anything with ``lora_rank``, ``lora_alpha``, ``lora_targets``, ``quantize``, ``dtype``,
        ``d_model`` (and, for ``nf4``, the shape fields :func:`kernel_shapes` and :func:`matrix_shapes` read).
    """
    rank, alpha, targets = config.lora_rank, config.lora_alpha, config.lora_targets
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"lora_rank must be an integer >= 0 (0: no adapters), got {rank!r}")
    if rank > config.d_model:
        raise ValueError(f"lora_rank={rank} exceeds d_model={config.d_model}; a low-rank adapter needs rank < width")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"lora_alpha must be a number > 0, got {alpha!r}")
    if isinstance(targets, str) or not isinstance(targets, tuple):
        raise ValueError(f"lora_targets must be a tuple of layer names from {', '.join(TARGETS)}, got {targets!r}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"unknown lora_targets {unknown}; allowed: {', '.join(TARGETS)}")
    if rank and not targets:
        raise ValueError(f"lora_rank={rank} needs at least one lora_target; allowed: {', '.join(TARGETS)}")
    if config.quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize={config.quantize!r}; allowed: {', '.join(QUANTIZE_MODES)}")
    if config.quantize != "none":
        if not rank:
            raise ValueError(f"quantize={config.quantize!r} needs lora_rank > 0: a quantized base is frozen")
        if config.dtype not in QUANTIZE_DTYPES:
            raise ValueError(
                f"quantize={config.quantize!r} does not support compute dtype {config.dtype!r}; "
                f"allowed: {', '.join(QUANTIZE_DTYPES)}"
            )
    if config.quantize == "nf4":
        for name, shape in {**kernel_shapes(config), **matrix_shapes(config)}.items():
            try:
                nf4.check_shape(shape)
            except ValueError as err:
                raise ValueError(f"quantize='nf4' cannot store {name}: {err}") from None


def matrix_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """``{name: shape}`` of the base's matrices outside the Block: the embedding and the untied output head."""
    d, v = config.d_model, config.vocab_size
    return {"embed": (v, d), **({} if config.tie_embeddings else {"lm_head": (d, v)})}


def kernel_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """``{layer name: (d_in, d_out)}`` of the Block's Dense layers under ``config`` (one layer's kernels)."""
    d, hd = config.d_model, config.head_dim
    return {
        "q_proj": (d, config.num_heads * hd),
        "k_proj": (d, config.num_kv_heads * hd),
        "v_proj": (d, config.num_kv_heads * hd),
        "attn_out": (config.num_heads * hd, d),
        "mlp_gate": (d, config.d_ff),
        "mlp_up": (d, config.d_ff),
        "mlp_out": (config.d_ff, d),
    }


# ---- quantization ---------------------------------------------------------------------------------------


def quantize_int8(kernel: jax.Array, axis: int = -2) -> dict[str, jax.Array]:
    """Symmetric per-output-channel int8: ``{"qvalue": int8 [..., d_in, d_out], "scale": f32 [..., 1, d_out]}``.

    The scale is ``max|kernel[:, j]| / 127`` (1 for an all-zero channel), so the round trip error
    of each entry is at most half a scale step. ``axis=-1`` takes the absmax over the last axis
    instead (``scale [..., d_in, 1]``): per row, as an embedding table ``[vocab, d]`` is stored.

    >>> q = quantize_int8(jnp.array([[1.0, -0.5], [-2.0, 0.25]]))
    >>> q["qvalue"].tolist(), q["scale"].tolist()
    ([[64, -127], [-127, 64]], [[0.015748031437397003, 0.003937007859349251]])
    """
    if axis not in (-2, -1):
        raise ValueError(f"axis must be -2 (per output channel) or -1 (per row), got {axis!r}")
    kernel = jnp.asarray(kernel, jnp.float32)
    absmax = jnp.max(jnp.abs(kernel), axis=axis, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    qvalue = jnp.clip(jnp.round(kernel / scale), -127, 127).astype(jnp.int8)
    return {"qvalue": qvalue, "scale": scale}


def dequantize(q: Mapping[str, jax.Array], dtype=jnp.float32) -> jax.Array:
    """The float kernel an int8 ``{"qvalue", "scale"}`` stands for."""
    return (q["qvalue"].astype(jnp.float32) * q["scale"]).astype(dtype)


def _int8_matmul(x, qvalue, scale, dtype, w_in_axis, out_dtype):
    y = matmul(x, qvalue.astype(dtype), w_in_axis, out_dtype)
    return y * scale.astype(y.dtype).reshape((1,) * (x.ndim - 1) + (-1,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def int8_project(x, qvalue, scale, dtype, w_in_axis: int = 0, out_dtype=None):
    """``(x @ qvalue) · scale`` in ``dtype`` whose backward pass keeps ``x`` and the int8 ``qvalue``.

    Autodiff would keep the compute-dtype cast of the kernel (2 or 4 bytes per entry, under ``none``);
    this casts it again in the backward pass, as :func:`remat_kit.model.ops.project` does for float weights.

    Args:
      x: the activation ``[..., k]``.
      qvalue, scale: an int8 weight from :func:`quantize_int8`: ``[k, out]`` with ``scale [1, out]``
        (``w_in_axis=0``, a kernel), or ``[out, k]`` with ``scale [out, 1]`` (``w_in_axis=1``, a tied
        embedding quantized per row, ``axis=-1``).
      dtype: the compute dtype; out_dtype: ``preferred_element_type`` of the matmul (None: ``dtype``).

    >>> q = quantize_int8(jnp.array([[1.0, -0.5], [-2.0, 0.25]]))
    >>> x = jnp.ones((1, 2))
    >>> bool(jnp.allclose(int8_project(x, q["qvalue"], q["scale"], jnp.dtype("float32")), x @ dequantize(q)))
    True
    """
    return _int8_matmul(x, qvalue, scale, dtype, w_in_axis, out_dtype)


def _int8_project_fwd(x, qvalue, scale, dtype, w_in_axis, out_dtype):
    return _int8_matmul(x, qvalue, scale, dtype, w_in_axis, out_dtype), (x, qvalue, scale)


def _int8_project_bwd(dtype, w_in_axis, out_dtype, residuals, g):
    x, qvalue, scale = residuals
    qc = qvalue.astype(dtype)
    s = scale.astype(g.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
    (dx,) = jax.linear_transpose(lambda x_: matmul(x_, qc, w_in_axis, out_dtype), x)(g * s)
    # The scale is frozen in LoRA training (XLA drops this then); computed anyway so the rule is right.
    unscaled = matmul(x, qc, w_in_axis, out_dtype)
    dscale = jnp.sum((g * unscaled).astype(jnp.float32).reshape(-1, scale.size), axis=0)
    return dx.astype(x.dtype), None, dscale.reshape(scale.shape).astype(scale.dtype)  # None: int input, no cotangent


int8_project.defvjp(_int8_project_fwd, _int8_project_bwd)


def quantize_nf4(kernel: jax.Array) -> dict[str, jax.Array]:
    """QLoRA's NF4 with double-quantized scales (:func:`remat_kit.model.nf4.quantize`; its docstring has the format)."""
    return nf4.quantize(kernel)


def _nf4_kernel(codes, absmax_q, absmax_scale, absmax_offset, dtype):
    q = {"codes": codes, "absmax_q": absmax_q, "absmax_scale": absmax_scale, "absmax_offset": absmax_offset}
    return nf4.dequantize(q, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def nf4_project(x, codes, absmax_q, absmax_scale, absmax_offset, dtype, w_in_axis: int = 0, out_dtype=None):
    """``x @ dequantize(nf4 kernel)`` in ``dtype`` whose backward pass keeps ``x``, the packed codes and the scales.

    The dequantized kernel is a temporary of the forward pass and dequantized again in the backward
    pass; autodiff would keep it (2 or 4 bytes per weight instead of the stored 0.52). ``w_in_axis``
    and ``out_dtype`` are :func:`remat_kit.model.ops.project`'s: 1 for a weight stored ``[out, k]``
    (a tied embedding), and the matmul's ``preferred_element_type`` (None: ``dtype``).

    >>> q = quantize_nf4(jax.random.normal(jax.random.key(0), (64, 8)))
    >>> x = jnp.ones((2, 64))
    >>> y = nf4_project(x, *(q[k] for k in nf4.LEAVES), jnp.dtype("float32"))
    >>> bool(jnp.allclose(y, x @ nf4.dequantize(q)))
    True
    """
    return matmul(x, _nf4_kernel(codes, absmax_q, absmax_scale, absmax_offset, dtype), w_in_axis, out_dtype)


def _nf4_project_fwd(x, codes, absmax_q, absmax_scale, absmax_offset, dtype, w_in_axis, out_dtype):
    # The same one dot_general as ops.project's forward, so a policy that keeps dots sees it.
    y = matmul(x, _nf4_kernel(codes, absmax_q, absmax_scale, absmax_offset, dtype), w_in_axis, out_dtype)
    return y, (x, codes, absmax_q, absmax_scale, absmax_offset)


def _nf4_project_bwd(dtype, w_in_axis, out_dtype, residuals, g):
    x, codes, absmax_q, absmax_scale, absmax_offset = residuals
    w = _nf4_kernel(codes, absmax_q, absmax_scale, absmax_offset, dtype)
    (dx,) = jax.linear_transpose(lambda x_: matmul(x_, w, w_in_axis, out_dtype), x)(g)
    # The scales are frozen in LoRA training (XLA drops this then); computed anyway so the rule is right.
    dw = weight_grad(x, g, w_in_axis, jnp.float32).astype(jnp.float32)
    _, scale_vjp = jax.vjp(lambda s, o: _nf4_kernel(codes, absmax_q, s, o, jnp.float32), absmax_scale, absmax_offset)
    dscale, doffset = scale_vjp(dw)
    return dx, None, None, dscale, doffset  # None: integer inputs have no cotangent


nf4_project.defvjp(_nf4_project_fwd, _nf4_project_bwd)


# ---- the frozen embedding and output head --------------------------------------------------------------

#: Parameter names of the base's weight matrices, which a quantized base stores quantized, and the axis
#: their matmul contracts: every Block ``kernel [d_in, d_out]`` and the untied ``lm_head [d, vocab]``
#: (0), and the ``embedding [vocab, d]``, looked up by row and, tied, the output head contracting axis 1.
#: Norm scales stay in the parameter dtype.
BASE_MATRICES: dict[str, int] = {"kernel": 0, "lm_head": 0, "embedding": 1}


def quantize_matrix(w: jax.Array, mode: str, w_in_axis: int = 0) -> dict[str, jax.Array]:
    """A float weight matrix stored as ``mode``: int8 per output channel, or NF4 (:func:`quantize_nf4`).

    Args:
      w: float weights ``[..., k, out]`` (``w_in_axis=0``) or ``[..., out, k]`` (``w_in_axis=1``, an
        embedding table, whose int8 scale is then one per row).
      mode: ``"int8"`` or ``"nf4"``.
      w_in_axis: the axis a matmul with ``w`` contracts (see :data:`BASE_MATRICES`).

    >>> quantize_matrix(jnp.ones((4, 2)), "int8", w_in_axis=1)["scale"].shape
    (4, 1)
    """
    if w_in_axis not in (0, 1) or isinstance(w_in_axis, bool):
        raise ValueError(f"w_in_axis must be 0 ([k, out]) or 1 ([out, k]), got {w_in_axis!r}")
    if mode == "int8":
        return quantize_int8(w, axis=-2 + w_in_axis)
    if mode == "nf4":
        return quantize_nf4(w)
    raise ValueError(f"quantize={mode!r} stores no quantized matrix; allowed: int8, nf4")


def is_quantized(w: Any) -> bool:
    """Whether a stored weight is a quantized matrix (a mapping of :func:`quantize_matrix`'s leaves)."""
    return isinstance(w, Mapping) and ("qvalue" in w or "codes" in w)


def _dequantize_any(q: Mapping[str, jax.Array], dtype) -> jax.Array:
    if "qvalue" in q:
        return dequantize(q, dtype)
    if "codes" in q:
        return nf4.dequantize(q, dtype)
    raise ValueError(f"not a quantized matrix: leaves {sorted(q)}; expected int8 (qvalue, scale) or nf4 {nf4.LEAVES}")


def dequantize_matrix(q: Mapping[str, jax.Array], dtype=jnp.float32) -> jax.Array:
    """The float matrix an int8 or NF4 ``q`` stands for, in ``dtype``; its backward pass keeps ``q`` alone.

    Autodiff of the dequantization would keep the unscaled values (a float copy of the matrix) for
    the scales' gradient; this recomputes them in the backward pass. A frozen ``q`` has no backward
    pass at all, and the result is then a temporary of the forward pass (the fused loss's output
    matrix, :func:`remat_kit.model.loss.chunked_cross_entropy`).

    >>> q = quantize_matrix(jnp.array([[1.0, -0.5], [-2.0, 0.25]]), "int8")
    >>> dequantize_matrix(q, jnp.bfloat16).dtype
    dtype(bfloat16)
    """
    names = tuple(sorted(q))
    return _dequantize_leaves(names, jnp.dtype(dtype), *(q[n] for n in names))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dequantize_leaves(names, dtype, *leaves):
    return _dequantize_any(dict(zip(names, leaves, strict=True)), dtype)


def _dequantize_leaves_fwd(names, dtype, *leaves):
    return _dequantize_leaves(names, dtype, *leaves), leaves


def _dequantize_leaves_bwd(names, dtype, leaves, g):
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]

    def with_floats(*values):
        merged = list(leaves)
        for i, v in zip(floats, values, strict=True):
            merged[i] = v
        return _dequantize_any(dict(zip(names, merged, strict=True)), dtype)

    _, vjp = jax.vjp(with_floats, *(leaves[i] for i in floats))
    cotangents: list = [None] * len(leaves)  # None: integer leaves have no cotangent
    for i, ct in zip(floats, vjp(g), strict=True):
        cotangents[i] = ct
    return tuple(cotangents)


_dequantize_leaves.defvjp(_dequantize_leaves_fwd, _dequantize_leaves_bwd)


def project_weight(x, w, w_in_axis: int, dtype, out_dtype=None):
    """:func:`remat_kit.model.ops.project` of a stored weight that may be quantized (int8 or NF4).

    The quantized paths are :func:`int8_project` and :func:`nf4_project`: the backward pass keeps
    the stored (packed) weight, never a dequantized or compute-dtype copy of it.

    >>> w = jax.random.normal(jax.random.key(0), (64, 8))
    >>> x = jnp.ones((2, 8))
    >>> y = project_weight(x, quantize_matrix(w, "nf4"), 1, jnp.dtype("float32"), jnp.float32)
    >>> bool(jnp.allclose(y, x @ nf4.dequantize(quantize_nf4(w)).T))
    True
    """
    if not is_quantized(w):
        return project(x, w, w_in_axis, dtype, out_dtype)
    if "qvalue" in w:
        return int8_project(x, w["qvalue"], w["scale"], dtype, w_in_axis, out_dtype)
    return nf4_project(x, *(w[k] for k in nf4.LEAVES), dtype, w_in_axis, out_dtype)


def lookup(table: Mapping[str, jax.Array], tokens: jax.Array, dtype) -> jax.Array:
    """Rows ``tokens`` of a quantized embedding table ``[vocab, d]``, only those rows dequantized.

    Equal to ``dequantize_matrix(table, dtype)[tokens]`` exactly (the same arithmetic per entry).

    Args:
      table: from ``quantize_matrix(embedding, mode, w_in_axis=1)``.
      tokens: integer ids ``[...]``.
      dtype: the output dtype.

    Returns:
      ``[..., d]`` in ``dtype``.
    """
    if "qvalue" in table:  # the gathered rows and their per-row scales are an int8 matrix of their own
        return dequantize({k: jnp.take(table[k], tokens, axis=0) for k in ("qvalue", "scale")}, dtype)
    if "codes" in table:
        return nf4.dequantize_rows(table, tokens, dtype)
    raise ValueError(f"not a quantized table: leaves {sorted(table)}; expected int8 (qvalue, scale) or nf4 leaves")


class QuantizedEmbed(nn.Module):
    """``nn.Embed`` over a frozen quantized table: ``embedding`` stored int8 per row or NF4.

    The parameter keeps ``nn.Embed``'s name (``embedding``), so :func:`remat_kit.model.lora.from_base`
    quantizes a full checkpoint's table into it. A lookup gathers the stored rows and dequantizes
    those alone (:func:`lookup`); the table is never dequantized whole for it.

    Attributes:
      num_embeddings: vocabulary size; features: row width.
      quantize: ``"int8"`` or ``"nf4"``.
      dtype: the output (compute) dtype.
      embedding_init: the float table's initializer (quantized at init).

    >>> emb = QuantizedEmbed(256, 64, quantize="nf4")
    >>> p = emb.init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))["params"]
    >>> p["embedding"]["codes"].shape, emb.apply({"params": p}, jnp.ones((1, 3), jnp.int32)).shape
    ((256, 32), (1, 3, 64))
    """

    num_embeddings: int
    features: int
    quantize: str
    dtype: Any = jnp.float32
    embedding_init: Callable = nn.initializers.normal(0.02)

    def setup(self):
        shape = (self.num_embeddings, self.features)
        init = lambda key: quantize_matrix(self.embedding_init(key, shape, jnp.float32), self.quantize, 1)
        self.embedding = self.param("embedding", init)

    def __call__(self, tokens):
        return lookup(self.embedding, tokens, jnp.dtype(self.dtype))


# ---- the layer ------------------------------------------------------------------------------------------


class LoRADense(nn.Module):
    """A bias-free Dense with an optional low-rank adapter and an optional int8 or NF4 base kernel.

    A drop-in for ``nn.Dense(features, use_bias=False)`` in your own Flax model: the base kernel
    keeps the name ``kernel``. Train it with :func:`partition` / :func:`update` so only the
    adapters learn.

    Attributes:
      features: output width.
      rank: adapter rank (0: no adapter, just the frozen or quantized base).
      alpha: the adapter's output is scaled by ``alpha / rank``.
      quantize: one of :data:`QUANTIZE_MODES`.
      dtype: compute dtype.
      param_dtype: dtype of the float parameters (base kernel, adapters).
      kernel_init: the base kernel's initializer.

    >>> layer = LoRADense(3, rank=2)
    >>> x = jnp.ones((4, 5))
    >>> p = layer.init(jax.random.key(0), x)["params"]
    >>> {k: v.shape for k, v in p.items()}
    {'kernel': (5, 3), 'lora_a': (5, 2), 'lora_b': (2, 3)}
    >>> bool(jnp.all(layer.apply({"params": p}, x) == x @ p["kernel"]))  # B = 0: equal to the base
    True
    """

    features: int
    rank: int = 0
    alpha: float = 16.0
    quantize: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):  # x: [..., d_in] -> [..., features]
        # ops.project: the backward pass keeps each float weight as stored and casts it again, as in
        # the lean Block's own Dense.
        d_in, dtype = x.shape[-1], jnp.dtype(self.dtype)
        x = x.astype(dtype)
        shape = (d_in, self.features)
        if self.quantize == "int8":
            q = self.param("kernel", lambda key: quantize_int8(self.kernel_init(key, shape, jnp.float32)))
            # Scale after the matmul (it is per output channel), so no dequantized kernel is ever
            # materialized; the backward pass keeps the int8 kernel, not its compute-dtype cast.
            y = int8_project(x, q["qvalue"], q["scale"], dtype)
        elif self.quantize == "nf4":
            q = self.param("kernel", lambda key: quantize_nf4(self.kernel_init(key, shape, jnp.float32)))
            # Dequantized inside the block, so inside the policy's rematerialized region; the backward
            # pass keeps the packed codes and scales, not the dequantized kernel.
            y = nf4_project(x, *(q[k] for k in nf4.LEAVES), dtype)
        elif self.quantize == "none":
            y = project(x, self.param("kernel", self.kernel_init, shape, self.param_dtype), 0, dtype)
        else:
            raise ValueError(f"quantize={self.quantize!r}; allowed: {', '.join(QUANTIZE_MODES)}")
        if self.rank:
            # PEFT's init: A ~ kaiming-uniform(a=sqrt(5)) (bound 1/sqrt(d_in)), B = 0.
            a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
            a = self.param(ADAPTER_NAMES[0], a_init, (d_in, self.rank), self.param_dtype)
            b = self.param(ADAPTER_NAMES[1], nn.initializers.zeros, (self.rank, self.features), self.param_dtype)
            y = y + project(project(x, a, 0, dtype), b, 0, dtype) * jnp.asarray(self.alpha / self.rank, dtype)
        return y


def dense(features: int, config: Any, name: str) -> LoRADense:
    """The Block's Dense layer ``name`` under ``config``'s LoRA / quantize settings (model.py's hook)."""
    return LoRADense(
        features,
        rank=config.lora_rank if name in config.lora_targets else 0,
        alpha=float(config.lora_alpha),
        quantize=config.quantize,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(config.param_dtype),
        kernel_init=nn.initializers.normal(0.02),
        name=name,
    )


def enabled(config: Any) -> bool:
    """Whether ``config`` asks for adapters or a quantized base (i.e. Block uses :class:`LoRADense`)."""
    return bool(config.lora_rank) or config.quantize != "none"
