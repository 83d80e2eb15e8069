"""LoRA adapters on a frozen (optionally int8-quantized) base, for fine-tuning under any policy.

``TransformerConfig(lora_rank=r, lora_alpha=a, lora_targets=("q_proj", "v_proj"))`` replaces the
targeted Dense layers of :class:`remat_kit.model.Block` by :class:`LoRADense`: the base kernel keeps
its name and shape (a full checkpoint's parameters load into it, see :func:`from_base`), and two
adapters ``lora_a [d_in, r]`` and ``lora_b [r, d_out]`` add ``(x @ A) @ B · a / r``. ``B`` starts at
zero, so the adapted model starts exactly equal to the base. The adapter product is computed inside
the block, hence inside the policy's rematerialized region: every tag and every policy work unchanged.

Only the adapters train. :func:`partition` splits a parameter tree into ``(trainable, frozen)``
(the equinox ``partition``/``combine`` idiom, and what ``nnx.Optimizer(wrt=nnx.LoRAParam)`` does):
the step differentiates the trainable part alone and the optimizer is initialized on it alone
(:func:`init_optimizer`, :func:`update`), so the frozen base has no gradient and no optimizer
state at all (not zeros). A tree without adapters is all trainable, so full fine-tuning is unchanged.

``quantize="int8"`` (QLoRA-style) stores every Block kernel as int8 with a per-output-channel
absmax scale (``{"qvalue": int8 [d_in, d_out], "scale": float32 [1, d_out]}``) and computes
``(x @ qvalue) · scale`` in the compute dtype inside the block (:func:`int8_project`): under every
policy, ``none`` included, the backward pass keeps the int8 kernel and casts it again, never a
dequantized or compute-dtype copy.

Why not a library: qwix 0.1.8 (Google's JAX quantization library) installs and imports on jax
0.10.2 and quantizes a plain Linen ``nn.Dense`` weight-only to int8 per channel
(``QtRule(weight_qtype="int8")`` → ``QArray(qvalue int8, scale [1, out])``), but it works by
intercepting parameter creation in the module being initialized. remat_kit's scan core initializes
each layer with ``layer.init`` inside ``self.param`` and applies it with ``layer.apply`` inside
``lax.scan`` + ``jax.checkpoint``; there qwix's ``quantize_model(Transformer(...), PtqProvider(...))``
fails at ``init`` with ``ValueError: It seems you're feeding an unquantized param to a quantized
model.`` (``qwix/_src/providers/ptq.py``, ``create_quantized_param``), for the PTQ and the LoRA
providers alike. So this module carries the smallest correct int8 path instead; 4-bit (nf4) is
not offered.

>>> import jax, jax.numpy as jnp
>>> from remat_kit.model import TransformerConfig, init_params
>>> cfg = TransformerConfig.preset("tiny", lora_rank=4, lora_targets=("q_proj", "v_proj"))
>>> params = init_params(cfg, jax.random.key(0))
>>> trainable, frozen = partition(params)
>>> sorted(trainable["layers"]["layers"]), sorted(trainable["layers"]["layers"]["q_proj"])
(['q_proj', 'v_proj'], ['lora_a', 'lora_b'])
>>> num_trainable(cfg)
3584
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from flax.core import FrozenDict

from remat_kit import constants

#: The Dense layers of :class:`remat_kit.model.Block` an adapter may target.
TARGETS: tuple[str, ...] = constants.LORA_TARGETS

#: Base-weight storage: ``none`` (param dtype) or ``int8`` (per-output-channel absmax scale).
QUANTIZE_MODES: tuple[str, ...] = constants.QUANTIZE_MODES

#: Compute dtypes the int8 path supports: the matmul runs on unscaled int8 values (up to 127x the
#: real output) before the scale, which float16's range (65504) cannot hold at d_model in the thousands.
QUANTIZE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")

#: Parameter names of the adapters: a leaf whose path ends in one of them is trainable.
ADAPTER_NAMES: tuple[str, ...] = ("lora_a", "lora_b")


def check_config(config: Any) -> None:
    """Validate the ``lora_*`` and ``quantize`` fields of a TransformerConfig (raise one-line ValueErrors).

    Args:
      config: anything with ``lora_rank``, ``lora_alpha``, ``lora_targets``, ``quantize``, ``dtype``
        and ``d_model``.
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
        raise ValueError(f"quantize={config.quantize!r}; allowed: {', '.join(QUANTIZE_MODES)} (nf4 is not supported)")
    if config.quantize != "none":
        if not rank:
            raise ValueError(f"quantize={config.quantize!r} needs lora_rank > 0: a quantized base is frozen")
        if config.dtype not in QUANTIZE_DTYPES:
            raise ValueError(
                f"quantize={config.quantize!r} does not support compute dtype {config.dtype!r}; "
                f"allowed: {', '.join(QUANTIZE_DTYPES)}"
            )


def parse_targets(text: str) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` → ``("q_proj", "v_proj")``; ``"all"`` → :data:`TARGETS` (for the CLI)."""
    if text.strip() == "all":
        return TARGETS
    return tuple(t.strip() for t in text.split(",") if t.strip())


# ---- quantization ---------------------------------------------------------------------------------------


def quantize_int8(kernel: jax.Array) -> dict[str, jax.Array]:
    """Symmetric per-output-channel int8: ``{"qvalue": int8 [..., d_in, d_out], "scale": f32 [..., 1, d_out]}``.

    The scale is ``max|kernel[:, j]| / 127`` (1 for an all-zero channel), so the round trip error
    of each entry is at most half a scale step.

    >>> q = quantize_int8(jnp.array([[1.0, -0.5], [-2.0, 0.25]]))
    >>> q["qvalue"].tolist(), q["scale"].tolist()
    ([[64, -127], [-127, 64]], [[0.015748031437397003, 0.003937007859349251]])
    """
    kernel = jnp.asarray(kernel, jnp.float32)
    absmax = jnp.max(jnp.abs(kernel), axis=-2, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    qvalue = jnp.clip(jnp.round(kernel / scale), -127, 127).astype(jnp.int8)
    return {"qvalue": qvalue, "scale": scale}


def dequantize(q: Mapping[str, jax.Array], dtype=jnp.float32) -> jax.Array:
    """The float kernel an int8 ``{"qvalue", "scale"}`` stands for."""
    return (q["qvalue"].astype(jnp.float32) * q["scale"]).astype(dtype)


def _int8_matmul(x, qvalue, scale, dtype):
    return (x @ qvalue.astype(dtype)) * scale.astype(dtype).reshape((1,) * (x.ndim - 1) + scale.shape[-1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def int8_project(x, qvalue, scale, dtype):
    """``(x @ qvalue) · scale`` in ``dtype`` whose backward pass keeps ``x`` and the int8 ``qvalue``.

    Autodiff would keep the compute-dtype cast of the kernel (2 or 4 bytes per entry, under ``none``);
    this casts it again in the backward pass, as :func:`remat_kit.model.project` does for float weights.

    >>> q = quantize_int8(jnp.array([[1.0, -0.5], [-2.0, 0.25]]))
    >>> x = jnp.ones((1, 2))
    >>> bool(jnp.allclose(int8_project(x, q["qvalue"], q["scale"], jnp.dtype("float32")), x @ dequantize(q)))
    True
    """
    return _int8_matmul(x, qvalue, scale, dtype)


def _int8_project_fwd(x, qvalue, scale, dtype):
    return _int8_matmul(x, qvalue, scale, dtype), (x, qvalue, scale)


def _int8_project_bwd(dtype, residuals, g):
    x, qvalue, scale = residuals
    qc = qvalue.astype(dtype)
    s = scale.astype(dtype).reshape((1,) * (x.ndim - 1) + scale.shape[-1:])
    dx = ((g * s) @ qc.T).astype(x.dtype)
    # The scale is frozen in LoRA training (XLA drops this then); computed anyway so the rule is right.
    dscale = jnp.sum((g * (x @ qc)).astype(jnp.float32).reshape(-1, scale.shape[-1]), axis=0)
    return dx, None, dscale.reshape(scale.shape).astype(scale.dtype)  # None: an integer input has no cotangent


int8_project.defvjp(_int8_project_fwd, _int8_project_bwd)


# ---- the layer ------------------------------------------------------------------------------------------


class LoRADense(nn.Module):
    """A bias-free Dense with an optional low-rank adapter and an optional int8 base kernel.

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
        # model.project: the backward pass keeps each float weight as stored and casts it again, as in
        # the lean Block's own Dense (model imports this module, hence the late import).
        from remat_kit.model import project

        d_in, dtype = x.shape[-1], jnp.dtype(self.dtype)
        x = x.astype(dtype)
        shape = (d_in, self.features)
        if self.quantize == "int8":
            q = self.param("kernel", lambda key: quantize_int8(self.kernel_init(key, shape, jnp.float32)))
            # Scale after the matmul (it is per output channel), so no dequantized kernel is ever
            # materialized; the backward pass keeps the int8 kernel, not its compute-dtype cast.
            y = int8_project(x, q["qvalue"], q["scale"], dtype)
        elif self.quantize == "none":
            y = project(x, self.param("kernel", self.kernel_init, shape, self.param_dtype), 0, dtype)
        else:
            raise ValueError(f"quantize={self.quantize!r}; allowed: {', '.join(QUANTIZE_MODES)}")
        if self.rank:
            # PEFT's init: A ~ kaiming-uniform(a=sqrt(5)) (bound 1/sqrt(d_in)), B = 0.
            a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
            a = self.param("lora_a", a_init, (d_in, self.rank), self.param_dtype)
            b = self.param("lora_b", nn.initializers.zeros, (self.rank, self.features), self.param_dtype)
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


# ---- trainable / frozen -------------------------------------------------------------------------------


def _is_adapter(path: tuple) -> bool:
    return bool(path) and path[-1] in ADAPTER_NAMES


def partition(params: Mapping) -> tuple[dict, dict]:
    """Split a parameter tree into ``(trainable, frozen)`` nested dicts.

    With adapters present, ``trainable`` holds exactly the adapter leaves and ``frozen`` the rest
    (base kernels, quantized or not, embeddings, norms). Without adapters, everything is trainable
    and ``frozen`` is ``{}`` (plain full fine-tuning, unchanged). :func:`combine` inverts it.
    """
    if not isinstance(params, (dict, FrozenDict)):  # any other pytree (an array, an NNX state...): all trainable
        return params, {}
    flat = traverse_util.flatten_dict(params)
    if not any(_is_adapter(k) for k in flat):
        return params, {}
    trainable = {k: v for k, v in flat.items() if _is_adapter(k)}
    frozen = {k: v for k, v in flat.items() if not _is_adapter(k)}
    return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def combine(trainable: Mapping, frozen: Mapping) -> dict:
    """The full parameter tree from :func:`partition`'s two parts."""
    if not frozen:
        return trainable
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(frozen), **traverse_util.flatten_dict(trainable)})


def init_optimizer(optimizer: optax.GradientTransformation, params: Mapping):
    """The optimizer state for the trainable part of ``params`` only (none for the frozen base)."""
    return optimizer.init(partition(params)[0])


def update(loss_fn: Callable[[Any], jax.Array], optimizer: optax.GradientTransformation, params, opt_state):
    """One optimizer update of the trainable part: the frozen part gets no gradient and no state.

    Args:
      loss_fn: ``params -> scalar loss`` over the full tree.
      optimizer: applied to the trainable part (state from :func:`init_optimizer`).
      params: the full tree.
      opt_state: the optimizer state.

    Returns:
      ``(loss, grads of the trainable part, new full params, new opt_state)``.
    """
    trainable, frozen = partition(params)
    loss, grads = jax.value_and_grad(lambda t: loss_fn(combine(t, frozen)))(trainable)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return loss, grads, combine(optax.apply_updates(trainable, updates), frozen), opt_state


def num_trainable(config: Any) -> int:
    """Adapter parameter count of a TransformerConfig (0 without adapters)."""
    if not config.lora_rank:
        return 0
    d, hd = config.d_model, config.head_dim
    shapes = {
        "q_proj": (d, config.num_heads * hd),
        "k_proj": (d, config.num_kv_heads * hd),
        "v_proj": (d, config.num_kv_heads * hd),
        "attn_out": (config.num_heads * hd, d),
        "mlp_gate": (d, config.d_ff),
        "mlp_up": (d, config.d_ff),
        "mlp_out": (config.d_ff, d),
    }
    per_layer = sum(config.lora_rank * (shapes[t][0] + shapes[t][1]) for t in config.lora_targets)
    return config.num_layers * per_layer


def from_base(base_params: Mapping, config: Any, key: jax.Array) -> dict:
    """Parameters of ``config`` (with adapters / int8 base) from a full model's parameters.

    Base weights are copied (quantized where ``config.quantize`` says so); adapters are freshly
    initialized from ``key`` (``B = 0``), so the result computes exactly what the base did (up to
    quantization).

    Args:
      base_params: the ``params`` of a model of the same shape without adapters (e.g. restored
        from a full-fine-tuning checkpoint).
      config: the adapted config.
      key: PRNG key for the adapters.

    Raises:
      ValueError: the base tree does not match ``config``'s shapes.
    """
    from remat_kit.model import init_params  # model imports this module

    fresh = traverse_util.flatten_dict(jax.eval_shape(lambda k: init_params(config, k), key))
    base = traverse_util.flatten_dict(base_params)
    adapters = {}
    if any(_is_adapter(k) for k in fresh):
        init = traverse_util.flatten_dict(partition(init_params(config, key))[0])
        adapters = dict(init)
    out = {}
    for k, spec in fresh.items():
        if _is_adapter(k):
            out[k] = adapters[k]
            continue
        quantized = k[-1] in ("qvalue", "scale") and k[-2] == "kernel"
        src = k[:-1] if quantized else k
        if src not in base:
            raise ValueError(f"base parameters lack {'/'.join(src)}; they are not of this model's shape")
        value = base[src]
        if quantized:
            value = quantize_int8(value)[k[-1]]
        if tuple(value.shape) != tuple(spec.shape):
            raise ValueError(f"base parameter {'/'.join(src)} has shape {value.shape}, the model needs {spec.shape}")
        out[k] = jnp.asarray(value, spec.dtype)
    return traverse_util.unflatten_dict(out)


@dataclasses.dataclass(frozen=True)
class ParamBytes:
    """Parameter bytes of a config split by role (from shapes; nothing allocated).

    Attributes:
      trainable: adapter (or, without adapters, all) parameter bytes.
      frozen: frozen base bytes (int8 kernels count one byte per entry).
    """

    trainable: int
    frozen: int


def param_bytes(config: Any) -> ParamBytes:
    """:class:`ParamBytes` of ``config`` via ``jax.eval_shape``."""
    from remat_kit.model import abstract_params

    trainable, frozen = partition(abstract_params(config))
    count = lambda tree: int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))
    return ParamBytes(trainable=count(trainable), frozen=count(frozen))
