"""The one training step that ``plan``, ``auto``, ``bench`` and ``train`` compile: what is planned is what is trained.

:func:`make_optimizer` builds the optimizer (global-norm clipping, AdamW with decoupled weight decay,
``optax.MultiSteps`` gradient accumulation, whose buffers are part of the optimizer state and so of
every planned figure); :func:`make_step` the update ``(params, opt_state, *batch) -> (params,
opt_state, loss, grad_norm, params_finite)``; :func:`init_optimizer` its optimizer state; :func:`jit_kwargs`
its donation and mesh shardings.

With LoRA adapters in the parameters (leaves named :data:`ADAPTER_NAMES`, as :mod:`remat_kit.model.lora` makes
them), the step differentiates and updates only the adapters, and the optimizer state covers only them: the frozen
base gets neither a gradient nor optimizer state, in every caller (plan, auto, fit, bench, train) alike. Without
adapters nothing changes.

>>> import jax, jax.numpy as jnp
>>> opt = make_optimizer(0.1)
>>> step = make_step(lambda w, x: jnp.sum((x @ w) ** 2), opt)
>>> w, x = jnp.ones((2, 2)), jnp.ones((1, 2))
>>> w, state, loss, norm, finite = step(w, opt.init(w), x)
>>> float(loss), bool(finite)
(8.0, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from flax.core import FrozenDict

from remat_kit.step import mesh as mesh_lib
from remat_kit.units import check_int

#: Parameter names of the adapters: a leaf whose path ends in one of them is trainable.
ADAPTER_NAMES: tuple[str, ...] = ("lora_a", "lora_b")


#: What :func:`make_optimizer` clips the global gradient norm to unless told otherwise (``train``'s default).
DEFAULT_CLIP_NORM = 1.0


def make_optimizer(
    learning_rate: float | optax.Schedule = 1e-3,
    *,
    clip_norm: float | None = DEFAULT_CLIP_NORM,
    weight_decay: float = 1e-4,
    mask: Any = None,
    grad_accum: int = 1,
) -> optax.GradientTransformation:
    """Clipped AdamW, wrapped in ``optax.MultiSteps`` when ``grad_accum > 1``.

    Args:
      learning_rate: a float or an optax schedule.
      clip_norm: global-norm clip (None: no clipping).
      weight_decay: AdamW's decoupled weight decay (``mask`` selects the decayed leaves).
      grad_accum: micro-batches averaged per update; MultiSteps keeps a gradient-sized buffer.
    """
    check_int("grad_accum", grad_accum)
    adamw = optax.adamw(learning_rate, weight_decay=weight_decay, mask=mask)
    inner = adamw if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), adamw)
    return inner if grad_accum == 1 else optax.MultiSteps(inner, every_k_schedule=grad_accum)


def make_step(
    loss_fn: Callable[..., jax.Array], optimizer: optax.GradientTransformation, *, on_trace: Callable | None = None
) -> Callable:
    """One optimizer update of ``loss_fn(params, *batch)`` (not jitted; see :func:`jit_kwargs`).

    Args:
      loss_fn: the scalar loss; its gradient is taken with respect to the first argument.
      optimizer: an optax transformation (e.g. :func:`make_optimizer`).
      on_trace: called each time the step is traced (a retrace check).

    Returns:
      ``step(params, opt_state, *batch) -> (params, opt_state, loss, grad_norm, params_finite)``, with
      ``opt_state`` from :func:`init_optimizer`; with adapters only they are differentiated and updated.
    """

    def step(params, opt_state, *batch):
        if on_trace is not None:
            on_trace()
        # LoRA: only the trainable part is differentiated and updated; the frozen base has no gradient
        # at all (not zeros). Without adapters the whole tree is trainable: a plain update.
        loss, grads, params, opt_state = update(lambda p: loss_fn(p, *batch), optimizer, params, opt_state)
        # A finite loss does not prove finite new parameters; check them so none is ever saved (the
        # frozen part is passed through unchanged).
        trainable = partition(params)[0]
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(trainable)]))
        return params, opt_state, loss, optax.tree.norm(grads), finite

    return step


def jit_kwargs(params, opt_state, mesh=None, *, batch_args: int = 1) -> dict[str, Any]:
    """``jax.jit`` keyword arguments for a :func:`make_step` step: donated state, and with a ``mesh``
    FSDP shardings for the state (in and out, so donation aliases) and the first batch argument
    split over ``data`` × ``fsdp`` (any further batch arguments, such as a key, replicated)."""
    kwargs: dict[str, Any] = {"donate_argnums": (0, 1)}
    if mesh is None:
        return kwargs
    state = (mesh_lib.tree_shardings(params, mesh), mesh_lib.tree_shardings(opt_state, mesh))
    extra = (None,) * (batch_args - 1)
    kwargs["in_shardings"] = (*state, mesh_lib.batch_sharding(mesh), *extra)
    kwargs["out_shardings"] = (*state, None, None, None)
    return kwargs


def init_optimizer(optimizer: optax.GradientTransformation, params):
    """The optimizer state :func:`make_step` expects: of the trainable part of ``params`` only
    (the LoRA adapters when there are any, see :func:`partition`; else all of it)."""
    return optimizer.init(partition(params)[0])


def abstract_state(params, optimizer: optax.GradientTransformation):
    """``(params, opt_state)`` as ShapeDtypeStructs (opt_state as :func:`init_optimizer`'s): nothing is allocated."""
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return params, jax.eval_shape(lambda p: init_optimizer(optimizer, p), params)


# ---- the trainable part: adapters, when there are any -------------------------------------------------


def is_adapter(path: tuple) -> bool:
    """Whether a flattened parameter path names an adapter leaf (it ends in one of :data:`ADAPTER_NAMES`)."""
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
    if not any(is_adapter(k) for k in flat):
        return params, {}
    trainable = {k: v for k, v in flat.items() if is_adapter(k)}
    frozen = {k: v for k, v in flat.items() if not is_adapter(k)}
    return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def combine(trainable: Mapping, frozen: Mapping) -> dict:
    """The full parameter tree from :func:`partition`'s two parts."""
    if not frozen:
        return trainable
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(frozen), **traverse_util.flatten_dict(trainable)})


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
    loss, grads = trainable_value_and_grad(loss_fn, frozen)(trainable)
    try:  # jitted once per optimizer: a step traced again (a planner's next policy) reuses the update's trace
        apply = _jitted_update(optimizer)
    except TypeError:  # an optimizer that cannot be hashed: traced with each step
        apply = functools.partial(_apply_update, optimizer)
    trainable, opt_state = apply(grads, opt_state, trainable)
    return loss, grads, combine(trainable, frozen), opt_state


def trainable_value_and_grad(loss_fn: Callable[..., jax.Array], frozen: Mapping) -> Callable:
    """``(trainable, *batch) -> (loss, grads)``: ``loss_fn(params, *batch)``'s value and gradient over the trainable
    part (:func:`partition`), ``frozen`` held fixed: what :func:`update` differentiates."""
    return jax.value_and_grad(lambda t, *batch: loss_fn(combine(t, frozen), *batch))


def _apply_update(optimizer: optax.GradientTransformation, grads, opt_state, trainable):
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state


@functools.lru_cache(maxsize=16)
def _jitted_update(optimizer: optax.GradientTransformation) -> Callable:
    return jax.jit(functools.partial(_apply_update, optimizer))
