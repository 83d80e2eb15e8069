"""Rematerialize the blocks of an existing Flax model, Linen or NNX, in one call, without editing its code.

``remat_kit.apply(model, policy)`` finds the model's repeated block (or the blocks ``where=`` names)
and runs each under the policy's ``jax.checkpoint``. Inside a rematerialized block every value a
policy may keep is named without touching the model:

* every submodule call's output, by its path relative to the block (``attn/q_einsum``,
  ``pre_attention_norm``);
* every matmul that consumes one of the block's own parameters, by that parameter's path
  (``mlp/gating_einsum``: gm.nn's FeedForward does ``jnp.einsum`` with its params directly);
* the model's own ``checkpoint_name`` tags (MaxText's ``query_proj``, ``mlpwi``) as they are;
* the block's input (its first argument) as ``layer_input``: ``apply`` owns what enters each block as
  the stacks do, so the default ``offload`` (the layer inputs, HF's ``offload=True``) works unedited.

So ``selective:attn/q_einsum,mlp/*`` and ``offload:attn/*`` work on an untagged model; a pattern or
name that matches nothing is a ValueError with the nearest names (:mod:`remat_kit.policies.tags`).
:func:`names_of` lists what a block emits.

Linen: the returned object has the model's ``init``/``apply``/``init_with_output``; they run the
model's own methods under ``flax.linen.intercept_methods``, so the variables, their tree and the RNG
streams are the plain model's (init itself runs plainly: remat changes no variable). NNX: the result
is a copy of the model graph whose blocks run under ``jax.checkpoint`` with their state passed as
arguments (never captured), so ``nnx.split`` gives the plain model's state and ``nnx.grad``,
``nnx.jit`` and ``nnx.Optimizer`` see every parameter. This module is the front door; the Linen half is
:mod:`remat_kit.unedited.linen`, the NNX half :mod:`remat_kit.unedited.nnx`.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> import remat_kit
>>> class Block(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return x + nn.Dense(4, name="up")(jnp.tanh(x))
>>> class Model(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         for i in range(2):
...             x = Block(name=f"layer_{i}")(x)
...         return x
>>> model = remat_kit.apply(Model(), "selective:up")
>>> x = jnp.ones((2, 4))
>>> params = model.init(jax.random.key(0), x)
>>> jax.tree.structure(params) == jax.tree.structure(Model().init(jax.random.key(0), x))
True
>>> remat_kit.names_of(Model(), x).names
('layer_input', 'up/kernel', 'up')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from remat_kit.policies import Mix, Policy
from remat_kit.unedited import linen as unedited_linen
from remat_kit.unedited import nnx as unedited_nnx
from remat_kit.unedited.engine import applied_twice, make_plan
from remat_kit.unedited.linen import Applied
from remat_kit.unedited.paths import NameTable


def apply(
    model: Any,
    policy: Any,
    *,
    where: Any = None,
    static_argnames: Any = None,
    scan: bool = False,
    query_blocks: int | str | None = None,
    seq_tiles: int | str | None = None,
) -> Any:
    """Rematerialize the blocks of an existing Flax model (Linen or NNX) under ``policy``, unedited.

    Args:
      model: a ``flax.linen.Module`` instance (unbound) or a ``flax.nnx.Module``.
      policy: a policy or spec (``"full"``, ``"every_n:2"``, ``"selective:attn/q_einsum,mlp/*"``,
        ``"offload:attn/*"``). Names may be module paths relative to the block, parameter paths, the
        model's own tags, or glob patterns over them; a name is kept where a block emits it (blocks of
        several kinds), and only a name no block emits is an error. Or a mapping ``{where: policy}``, one
        per-block policy per kind of block (``{DenseLayer: "full", MoeLayer: "selective:router"}``).
      where: the blocks: a block class or tuple of classes, a module-path glob (``"layer_*"``,
        ``"blocks/*"``), or a predicate ``module -> bool``. Default: the repeated modules that carry the
        compute (:mod:`remat_kit.unedited.blocks`: the forward's matmul FLOPs for Linen, parameters for NNX,
        embeddings counting 0); :func:`names_of` says which and why.
      static_argnames: names of block ``__call__`` arguments to treat as static (Python values are
        detected anyway: any argument holding no array is static, never traced).
      scan: run consecutive blocks that repeat a period (identical ones, or Gemma 3's local/global
        ones whose class, attributes or static flags alternate) as one ``lax.scan`` over their stacked
        parameters, one step per period (the model's own parameter layout is kept; a grouping policy
        counts periods); a model that cannot be scanned unedited is a ValueError saying why.
      query_blocks: inside each block, a submodule whose traced program holds attention (scores -> softmax ->
        weighted sum, checked independent along its queries) runs that region this many blocks of queries at a
        time, each under its own checkpoint: the backward holds one block's ``S x S`` scores, not all of them.
        An int dividing the block input's sequence length (axis 1), ``"auto"`` (blocks of about 1,024
        positions, :func:`remat_kit.unedited.long.auto_blocks`) or None. A block where no submodule holds
        attention is a ValueError naming the submodules looked at (:func:`names_of` lists them).
      seq_tiles: inside each block, a submodule proven per-token along the sequence (the MLP, the norms) runs
        this many sequence tiles at a time, each under its own checkpoint; one that mixes positions (attention,
        a cumsum) is never tiled. An int, ``"auto"`` or None, as ``query_blocks``.

    Returns:
      Linen: an :class:`Applied` with the model's ``init``/``apply``/``init_with_output``. NNX: a copy
      of the model graph (sharing its arrays) whose blocks run under the policy.

    On the first call per input signature the guard (:mod:`remat_kit.unedited.guard`) traces the step once: a
    model's own ``jax.checkpoint``/``nnx.remat`` around or inside the blocks is seen through (the policy replaces
    it, said in one warning line), and a policy that would change nothing the backward pass keeps is an error.

    Raises:
      TypeError: ``model`` is not a Flax module instance, or a bad ``where``.
      TypeError/ValueError: ``query_blocks``/``seq_tiles`` not a positive int, ``"auto"`` or None (before any
        trace); on the first call, one that does not divide the sequence length.
      ValueError: a policy that needs a stack (``segments``, ``sqrt_n``, a mix) without ``scan=True``;
        no repeated block; (on the first call) a ``where`` that matches nothing, a name that no block
        emits, blocks that do no matmul, the model's own remat inside a loop around the blocks, or
        residuals equal to the plain model's.

    >>> import flax.linen as nn
    >>> type(apply(nn.Sequential([nn.Dense(2)]), "full", where=nn.Dense)).__name__
    'Applied'
    """
    base = nnx.Module if isinstance(model, nnx.Module) else nn.Module
    plan = make_plan(policy, where, static_argnames, scan, base, query_blocks, seq_tiles)
    if isinstance(model, nnx.Module):
        return unedited_nnx.apply(model, plan)
    if isinstance(model, Applied):
        raise applied_twice(type(model.module).__name__, model.plan.policy, "its .module")
    if isinstance(model, nn.Module):
        if model.scope is not None:
            raise TypeError(f"remat_kit.apply takes an unbound Linen module, got a bound {type(model).__name__}")
        return Applied(model, plan)
    if isinstance(model, type):
        raise TypeError(
            f"remat_kit.apply takes a module instance, not the class {model.__name__}: write {model.__name__}(...)"
        )
    raise TypeError(f"remat_kit.apply takes a flax.linen or flax.nnx Module instance, got {model!r}")


# ---- names_of ----------------------------------------------------------------------------------------


def names_of(model: Any, *example_args: Any, where: Any = None, **example_kwargs: Any) -> NameTable:
    """The names the model's blocks emit (what a policy can keep), with shape, dtype and bytes.

    Traces only (``jax.eval_shape``): nothing is compiled or allocated.

    Args:
      model: a Linen module instance (unbound) or an NNX module.
      *example_args, **example_kwargs: the model's call arguments (arrays or ShapeDtypeStructs; for
        Linen without the variables: they are made with ``init``).
      where: the blocks (see :func:`apply`).

    Returns:
      A :class:`remat_kit.unedited.paths.NameTable`: ``.names``, ``.rows`` and a printable table; ``.parts``:
      the block's direct submodules, each ``attention`` (what ``apply(..., query_blocks=)`` runs in query
      blocks), ``per-token`` (what ``seq_tiles=`` tiles) or ``neither``, with why (the equation that mixes
      positions).

    >>> import jax.numpy as jnp, flax.linen as nn
    >>> names_of(nn.Sequential([nn.Dense(3), nn.Dense(3)]), jnp.ones((1, 3)), where=nn.Dense).names
    ('layer_input', 'kernel')
    """
    if isinstance(model, nnx.Module):
        return unedited_nnx.names_of(model, example_args, example_kwargs, where)
    return unedited_linen.names_of(apply(model, "full", where=where), example_args, example_kwargs)


def apply_factory(model: Any, loss: Callable, **apply_kwargs: Any) -> Callable:
    """``make_loss(policy)`` for :func:`remat_kit.compare`/:func:`remat_kit.inspect`/:func:`remat_kit.auto`.

    Args:
      model: the plain model (Linen instance or NNX module).
      loss: Linen: ``loss(model, variables, *batch) -> scalar`` (call ``model.apply``); NNX:
        ``loss(model, *batch) -> scalar``.
      **apply_kwargs: passed to :func:`apply` (``where=``, ``static_argnames=``, ``scan=``).

    Returns:
      ``make_loss(policy) -> loss_fn(params, *batch)``: Linen's ``params`` are the variables, NNX's
      ``nnx.state(model, nnx.Param)`` (the same tree under every policy; the rest of the state, RNG
      streams included, is closed over).

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(3)(jnp.tanh(nn.Dense(3)(x)))
    >>> model = nn.Sequential([MLP(), MLP()])
    >>> make = apply_factory(model, lambda m, v, x: m.apply(v, x).sum(), where=MLP)
    >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> float(make("full")(v, jnp.zeros((1, 3))))
    0.0
    """
    built: dict[str, Any] = {}  # policy spec -> the applied model: its discovery and guard verdict traced once

    def applied(policy):
        key = policy if isinstance(policy, str) else str(policy) if isinstance(policy, (Policy, Mix)) else None
        if key is None:
            return apply(model, policy, **apply_kwargs)
        if key not in built:
            built[key] = apply(model, policy, **apply_kwargs)
        return built[key]

    return lambda policy: params_loss(applied(policy), loss)


def params_loss(model: Any, loss: Callable) -> Callable:
    """``loss_fn(params, *batch)`` of ``model`` in :func:`apply_factory`'s convention: Linen's ``params`` are the
    variables, NNX's ``nnx.state(model, nnx.Param)`` (the rest of the state, RNG streams included, closed over)."""
    if isinstance(model, nnx.Module):
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        # Fresh Variables for the rest in every trace (Variables made outside it cannot be updated in it).
        return lambda params, *batch: loss(nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest)), *batch)
    return lambda variables, *batch: loss(model, variables, *batch)
