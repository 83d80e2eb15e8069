"""Apply a policy to one target: the one dispatcher behind :func:`remat_kit.remat` and ``policy(target)``.

A function goes under ``jax.checkpoint`` (here), a Flax Linen class under ``flax.linen.remat``
(:mod:`remat_kit.linen.wrap`), an NNX instance into a module that owns it (:mod:`remat_kit.nnx.wrap`).
Wherever it is applied, a strict policy checks at trace time, once per input signature, that the code
emits every tag it names (:func:`remat_kit.policies.tags.check_traced`): a misspelt or missing tag is a
ValueError with the nearest emitted name, never a silent full recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from remat_kit import _jax_internals
from remat_kit.linen import wrap as linen_wrap
from remat_kit.nnx import wrap as nnx_wrap
from remat_kit.policies import GROUPING_KINDS, Mix, Policy, parse, tags
from remat_kit.policies.static import as_argnums, split_static


def remat(
    target: Any,
    policy: Policy | str,
    *,
    static_argnums: int | tuple[int, ...] = (),
    methods: Sequence[str] | None = None,
    prevent_cse: bool = True,
) -> Any:
    """``target`` under ``policy``: a function, a Flax Linen module class or a Flax NNX module instance.

    ``policy(target, ...)`` is the same call. A strict policy checks, once per input signature at trace
    time, that the code emits every tag it names.

    Args:
      target: a callable; a ``flax.linen.Module`` subclass; or a ``flax.nnx.Module`` instance.
      policy: a :class:`remat_kit.Policy` or a spec string (``"full"``, ``"selective:mlp_up"``); not a
        grouping policy (``every_n``, ``segments``, ``sqrt_n``: those apply to a stack).
      static_argnums: positional arguments that are Python values (flags), not arrays. For a function
        they index its arguments (``jax.checkpoint``'s meaning); for a Linen class or an NNX instance
        they count ``self`` as 0 (``flax.linen.remat``'s meaning: ``__call__(self, x, train)`` takes
        ``static_argnums=(2,)``). A negative index counts from the end of each call's positional
        arguments (``-1``: the last), as MaxText's ``(-1, ..., -5)`` intends.
      methods: Linen classes only: the methods to rematerialize (default ``["__call__"]``).
      prevent_cse: passed to ``jax.checkpoint``; keep True outside scans.

    Returns:
      The function under ``jax.checkpoint``, the class under ``flax.linen.remat``, or an ``nnx.Module``
      owning the instance (``target`` itself for ``none`` on a function or class).

    Raises:
      ValueError: a grouping policy, or a bad ``static_argnums``/``methods``.
      TypeError: a target of another kind (a Linen instance, an NNX class, a non-callable).

    >>> import jax, jax.numpy as jnp
    >>> f = remat(lambda x: jnp.sin(jnp.sin(x)), "full")
    >>> float(jax.grad(f)(0.0))
    1.0
    """
    if isinstance(policy, str):
        policy = parse(policy)
    if isinstance(policy, Mix) or not isinstance(policy, Policy):
        raise TypeError(f"policy must be a remat_kit.Policy or a spec string, got {policy!r}")
    argnums = as_argnums(static_argnums)
    kind = target_kind(target)
    if policy.kind in GROUPING_KINDS:
        raise ValueError(
            f"policy {policy} groups the layers of a stack; apply it with remat_kit.stack (Linen) or "
            f"remat_kit.nnx.stack (NNX), not to one {kind.replace('_', ' ')}; for a single function or "
            f"module use full, selective, offload, dots or none"
        )
    if kind == "nnx_instance":
        return nnx_wrap.remat(policy, target, static_argnums=argnums, prevent_cse=prevent_cse)
    if methods is not None and kind != "linen_class":
        raise TypeError(f"methods= applies to a flax.linen.Module class only, got {target!r}")
    if not policy.remat:
        return target
    if kind == "linen_class":
        return linen_wrap.remat_class(policy, target, argnums, methods, prevent_cse)
    return _remat_function(policy, target, argnums, prevent_cse)


def target_kind(target: Any) -> str:
    """Classify what a policy is applied to.

    Returns:
      ``"linen_class"``, ``"nnx_instance"`` or ``"function"``.

    Raises:
      TypeError: a Linen module instance, an NNX module class, or something not callable; the
        message names the call to write instead.
    """
    if isinstance(target, type) and issubclass(target, nn.Module):
        return "linen_class"
    if isinstance(target, type) and issubclass(target, nnx.Module):
        name = target.__name__
        raise TypeError(
            f"apply a policy to an NNX module instance, not the class {name}: write "
            f"policy({name}(rngs=nnx.Rngs(0))), or remat_kit.nnx.stack(lambda rngs: {name}(rngs=rngs), ...)"
        )
    if isinstance(target, nnx.Module):
        return "nnx_instance"
    if isinstance(target, nn.Module):
        name = type(target).__name__
        raise TypeError(f"apply a policy to a Module class, not an instance ({name}(...)); write policy({name})")
    if not callable(target):
        raise TypeError(
            f"a policy applies to a function, a flax.linen.Module class or an flax.nnx.Module instance, got {target!r}"
        )
    return "function"


def _short_name(fn: Callable) -> str:
    """A function's name for a one-line message: a partial's repr holds its arguments' (a module's is 20 lines).

    >>> _short_name(functools.partial(max, 1, key=abs))
    'functools.partial(max, …)'
    """
    if isinstance(fn, functools.partial):
        return f"functools.partial({_short_name(fn.func)}, …)"
    return getattr(fn, "__qualname__", type(fn).__name__)


def _check_not_captured(fn: Callable, modules: list[nnx.Module], args: tuple, kwargs: dict) -> None:
    """Raise when a captured module's parameters are constants of the transform the call runs under
    (its state holds no tracer: it was captured outside ``nnx.grad``/``nnx.jit``, not inside)."""
    if not _jax_internals.under_transform():
        return  # a plain eager call: the captured module runs as it is
    for module in modules:
        leaves = jax.tree.leaves(nnx.state(module))
        if leaves and not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            name = type(module).__name__
            raise ValueError(
                f"function {_short_name(fn)} closes over the NNX module {name}, so its "
                f"parameters never reach the transform (nnx.grad would return all-zero gradients); apply the "
                f"policy to the module instead: policy({name.lower()}), or wrap inside the transformed function"
            )


def _remat_function(policy, fn: Callable, static_argnums: tuple[int, ...], prevent_cse: bool) -> Callable:
    checkpointed = jax.checkpoint(fn, policy=policy.jax_policy, prevent_cse=prevent_cse, static_argnums=static_argnums)
    captured = nnx_wrap.captured_nnx_modules(fn)
    if captured:  # checked at each call: captured under a transform is fine, captured outside it is not
        inner = checkpointed

        @functools.wraps(fn)
        def checkpointed(*args, **kwargs):
            _check_not_captured(fn, captured, args, kwargs)
            return inner(*args, **kwargs)

    if not tags.needs_check(policy):
        return checkpointed
    where = f"function {_short_name(fn)}"

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        bind, dynamic, static = split_static(args, static_argnums)
        key = (fn, tuple(sorted(static.items())), tags.signature(kwargs))
        # Keyword arguments are traced like the dynamic positionals (jax.checkpoint's rule).
        tags.check_traced(policy, where, lambda dyn, kw: bind(fn, **kw)(*dyn), dynamic, kwargs, key=tags.hashable(key))
        return checkpointed(*args, **kwargs)

    return wrapped
