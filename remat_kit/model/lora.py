"""LoRA adapters on a frozen (optionally int8- or NF4-quantized) base, for fine-tuning under any policy.

``TransformerConfig(lora_rank=r, lora_alpha=a, lora_targets=("q_proj", "v_proj"))`` replaces the
targeted Dense layers of :class:`remat_kit.model.transformer.Block` by :class:`LoRADense`: the base kernel keeps
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
absmax scale and keeps it int8 in the backward pass under every policy (:func:`int8_project`).
``quantize="nf4"`` is QLoRA's own format (:mod:`remat_kit.model.nf4`: 4-bit NormalFloat codes packed
two per byte, an absmax per 64 weights, those scales double-quantized to int8 per 256), about 0.52
byte per base weight; the backward pass keeps the packed codes and scales (:func:`nf4_project`).
Either mode stores the embedding table (int8 per row, or NF4) and an untied output head quantized
too (:data:`BASE_MATRICES`; only the norm scales stay float): a lookup dequantizes the gathered rows
alone (:class:`QuantizedEmbed`), and the output head, tied or not, dequantizes inside its matmul
(:func:`project_weight`) or inside the fused chunked loss, never keeping a dequantized copy.

The layer itself (:class:`LoRADense`, the int8 and NF4 paths, the config check) and the trainable/frozen split
beside the adapter names it defines live in :mod:`remat_kit.model.lora_layer`, below the transformer
(the generic training step needs the split, not the model); this module re-exports them and holds what
needs the model (:func:`from_base`, :func:`param_bytes`).

>>> import jax, jax.numpy as jnp
>>> from remat_kit.model.transformer import TransformerConfig, init_params
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
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from remat_kit.analysis.memory import tree_bytes

# The layer, re-exported: ``lora.LoRADense``, ``lora.TARGETS`` ... are this module's public names.
from remat_kit.model.lora_layer import ADAPTER_NAMES as ADAPTER_NAMES
from remat_kit.model.lora_layer import BASE_MATRICES as BASE_MATRICES
from remat_kit.model.lora_layer import QUANTIZE_DTYPES as QUANTIZE_DTYPES
from remat_kit.model.lora_layer import QUANTIZE_MODES as QUANTIZE_MODES
from remat_kit.model.lora_layer import TARGETS as TARGETS
from remat_kit.model.lora_layer import LoRADense as LoRADense
from remat_kit.model.lora_layer import QuantizedEmbed as QuantizedEmbed
from remat_kit.model.lora_layer import check_config as check_config
from remat_kit.model.lora_layer import combine as combine
from remat_kit.model.lora_layer import dense as dense
from remat_kit.model.lora_layer import dequantize as dequantize
from remat_kit.model.lora_layer import dequantize_matrix as dequantize_matrix
from remat_kit.model.lora_layer import enabled as enabled
from remat_kit.model.lora_layer import init_optimizer as init_optimizer
from remat_kit.model.lora_layer import int8_project as int8_project
from remat_kit.model.lora_layer import is_adapter as is_adapter
from remat_kit.model.lora_layer import is_quantized as is_quantized
from remat_kit.model.lora_layer import kernel_shapes as kernel_shapes
from remat_kit.model.lora_layer import lookup as lookup
from remat_kit.model.lora_layer import matrix_shapes as matrix_shapes
from remat_kit.model.lora_layer import nf4_project as nf4_project
from remat_kit.model.lora_layer import partition as partition
from remat_kit.model.lora_layer import project_weight as project_weight
from remat_kit.model.lora_layer import quantize_int8 as quantize_int8
from remat_kit.model.lora_layer import quantize_matrix as quantize_matrix
from remat_kit.model.lora_layer import quantize_nf4 as quantize_nf4
from remat_kit.model.lora_layer import update as update
from remat_kit.model.transformer import abstract_params, init_params


def parse_targets(text: str) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` → ``("q_proj", "v_proj")``; ``"all"`` → :data:`TARGETS` (for the CLI)."""
    if text.strip() == "all":
        return TARGETS
    return tuple(t.strip() for t in text.split(",") if t.strip())


def num_trainable(config: Any) -> int:
    """Adapter parameter count of a TransformerConfig (0 without adapters)."""
    if not config.lora_rank:
        return 0
    shapes = kernel_shapes(config)
    per_layer = sum(config.lora_rank * (shapes[t][0] + shapes[t][1]) for t in config.lora_targets)
    return config.num_layers * per_layer


def from_base(base_params: Mapping, config: Any, key: jax.Array) -> dict:
    """Parameters of ``config`` (with adapters / an int8 or NF4 base) from a full model's parameters.

    Base weights are copied (quantized where ``config.quantize`` says so: every matrix of
    :data:`BASE_MATRICES`, int8 per output channel (the embedding per row), or NF4 per 64-block);
    adapters are freshly initialized from ``key`` (``B = 0``), so the result computes exactly what
    the base did (up to quantization: what the base with :func:`dequantize_matrix`'d matrices does).

    Args:
      base_params: the ``params`` of a model of the same shape without adapters (e.g. restored
        from a full-fine-tuning checkpoint).
      config: the adapted config.
      key: PRNG key for the adapters.

    Raises:
      ValueError: the base tree does not match ``config``'s shapes.
    """
    fresh = traverse_util.flatten_dict(jax.eval_shape(lambda k: init_params(config, k), key))
    base = traverse_util.flatten_dict(base_params)
    adapters = {}
    if any(is_adapter(k) for k in fresh):
        init = traverse_util.flatten_dict(partition(init_params(config, key))[0])
        adapters = dict(init)
    quantized_kernels: dict[tuple, dict] = {}  # one quantization per matrix, read once per leaf
    out = {}
    for k, spec in fresh.items():
        if is_adapter(k):
            out[k] = adapters[k]
            continue
        quantized = config.quantize != "none" and len(k) > 1 and k[-2] in BASE_MATRICES
        src = k[:-1] if quantized else k
        if src not in base:
            raise ValueError(f"base parameters lack {'/'.join(src)}; they are not of this model's shape")
        value = base[src]
        if quantized:
            if src not in quantized_kernels:
                quantized_kernels[src] = quantize_matrix(value, config.quantize, BASE_MATRICES[src[-1]])
            value = quantized_kernels[src][k[-1]]
        if tuple(value.shape) != tuple(spec.shape):
            raise ValueError(f"base parameter {'/'.join(src)} has shape {value.shape}, the model needs {spec.shape}")
        out[k] = jnp.asarray(value, spec.dtype)
    return traverse_util.unflatten_dict(out)


@dataclasses.dataclass(frozen=True)
class ParamBytes:
    """Parameter bytes of a config split by role (from shapes; nothing allocated).

    Attributes:
      trainable: adapter (or, without adapters, all) parameter bytes.
      frozen: frozen base bytes as stored (int8 matrices count one byte per entry, NF4 matrices
        half a byte plus their scales; the embedding and an untied head are quantized too).
    """

    trainable: int
    frozen: int


def param_bytes(config: Any) -> ParamBytes:
    """:class:`ParamBytes` of ``config`` via ``jax.eval_shape``."""
    trainable, frozen = partition(abstract_params(config))
    return ParamBytes(trainable=tree_bytes(trainable), frozen=tree_bytes(frozen))
