"""Apply a policy to one function or one Flax Linen module class (``policy(target)`` lands here).

The policy is duck-typed (``.kind``, ``.remat``, ``.jax_policy``, ``.tags``, ``.strict``): this module
never imports :mod:`remat_kit.policies`, which imports it lazily. NNX instances go to
:mod:`remat_kit.wrap_nnx`.

Both wrappers check the policy's tags against the tags the code really emits, at trace time, once
per input signature (:func:`remat_kit.tags.check_traced`): a misspelt or missing tag is a
ValueError with the nearest emitted name, never a silent full recompute.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from remat_kit import _jax_internals, tags


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


def remat(
    policy: Any,
    target: Callable,
    *,
    static_argnums: tuple[int, ...] = (),
    methods: Sequence[str] | None = None,
    prevent_cse: bool = True,
) -> Any:
    """``policy`` applied to a function (``jax.checkpoint``) or a Linen class (``flax.linen.remat``).

    Args:
      policy: a :class:`remat_kit.policies.Policy` that is not a grouping policy.
      target: a callable or a ``flax.linen.Module`` subclass.
      static_argnums: Python-valued positional arguments: for a function its argument indices, for a
        Linen class indices counting ``self`` as 0 (flax's meaning); a negative one counts from the end
        of each call's positional arguments (``-1``: the last).
      methods: Linen only: the methods to rematerialize (default ``["__call__"]``).
      prevent_cse: passed on; keep True outside scans.

    Returns:
      The wrapped function or class; ``target`` itself for ``none``.
    """
    if not policy.remat:
        return target
    if target_kind(target) == "linen_class":
        return _remat_linen(policy, target, static_argnums, methods, prevent_cse)
    return _remat_function(policy, target, static_argnums, prevent_cse)


# ---- functions ---------------------------------------------------------------------------------------


def normalize_argnums(static_argnums: tuple[int, ...], nargs: int) -> tuple[int, ...]:
    """``static_argnums`` for a call with ``nargs`` positional arguments: negatives counted from the end,
    indices outside the call dropped (an argument not passed is not static), sorted.

    >>> normalize_argnums((-1, 1, 7), 3)
    (1, 2)
    """
    return tuple(sorted({i % nargs for i in static_argnums if -nargs <= i < nargs}))


def _split_static(args: tuple, static_argnums: tuple[int, ...]):
    """Close the static positional arguments over ``fn``; return (bind, dynamic args)."""
    static = {i: args[i] for i in normalize_argnums(static_argnums, len(args))}
    dynamic = tuple(a for i, a in enumerate(args) if i not in static)

    def bind(fn, **kwargs):
        def run(*dyn):
            it = iter(dyn)
            full = [static[i] if i in static else next(it) for i in range(len(args))]
            return fn(*full, **kwargs)

        return run

    return bind, dynamic, static


def captured_nnx_modules(fn: Callable) -> list[nnx.Module]:
    """The NNX modules ``fn`` holds without taking them as arguments: in its closure or the module-level
    names its code reads, a bound method's ``self``, or a ``functools.partial``'s arguments, and inside
    the lists, tuples and dicts (any pytree) those hold.

    >>> from flax import nnx
    >>> lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> [type(m).__name__ for m in captured_nnx_modules(lambda x: lin(x))], captured_nnx_modules(lambda m, x: m(x))
    (['Linear'], [])
    >>> layers = {"first": [lin]}
    >>> [type(m).__name__ for m in captured_nnx_modules(lambda x: layers["first"][0](x))]
    ['Linear']
    """
    held = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if c.cell_contents is not None]
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    held += [scope[n] for n in (code.co_names if code else ()) if n in scope]  # module-level names it reads
    held += [getattr(fn, "__self__", None)]
    if isinstance(fn, functools.partial):
        held += [*fn.args, *fn.keywords.values(), *captured_nnx_modules(fn.func)]
    # A module in a container (layers[0]) is as captured as one held directly; a module is not looked into.
    leaves = jax.tree.leaves(held, is_leaf=lambda x: isinstance(x, nnx.Module))
    found = {id(m): m for m in leaves if isinstance(m, nnx.Module)}
    return list(found.values())


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
                f"function {getattr(fn, '__qualname__', repr(fn))} closes over the NNX module {name}, so its "
                f"parameters never reach the transform (nnx.grad would return all-zero gradients); apply the "
                f"policy to the module instead: policy({name.lower()}), or wrap inside the transformed function"
            )


def _remat_function(policy, fn: Callable, static_argnums: tuple[int, ...], prevent_cse: bool) -> Callable:
    checkpointed = jax.checkpoint(fn, policy=policy.jax_policy, prevent_cse=prevent_cse, static_argnums=static_argnums)
    captured = captured_nnx_modules(fn)
    if captured:  # checked at each call: captured under a transform is fine, captured outside it is not
        inner = checkpointed

        @functools.wraps(fn)
        def checkpointed(*args, **kwargs):
            _check_not_captured(fn, captured, args, kwargs)
            return inner(*args, **kwargs)

    if not tags.needs_check(policy):
        return checkpointed
    where = f"function {getattr(fn, '__qualname__', repr(fn))}"

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        bind, dynamic, static = _split_static(args, static_argnums)
        key = (fn, tuple(sorted(static.items())), tags.signature(kwargs))
        # Keyword arguments are traced like the dynamic positionals (jax.checkpoint's rule).
        tags.check_traced(policy, where, lambda dyn, kw: bind(fn, **kw)(*dyn), dynamic, kwargs, key=tags.hashable(key))
        return checkpointed(*args, **kwargs)

    return wrapped


# ---- Linen classes -----------------------------------------------------------------------------------


def _remat_linen(policy, cls: type[nn.Module], static_argnums, methods, prevent_cse) -> type[nn.Module]:
    names = list(methods) if methods is not None else ["__call__"]
    for name in names:
        if not callable(getattr(cls, name, None)):
            raise ValueError(f"methods={names!r}: {cls.__name__} has no method {name!r}")
    if 0 in static_argnums:
        raise ValueError(f"static_argnums={static_argnums!r}: index 0 is self (flax.linen.remat counts it); x is 1")

    @functools.cache
    def remat_class(argnums: tuple[int, ...]):
        return nn.remat(cls, policy=policy.jax_policy, prevent_cse=prevent_cse, static_argnums=argnums, methods=methods)

    wrapped = remat_class(tuple(static_argnums))
    # The same methods, each checking the policy's tags before running the rematerialized one. Negative
    # indices count from the end of each call's arguments, so they are resolved per call: flax shifts
    # indices by self's place, which would move a negative one (its -1 reaches no argument).
    negative = any(i < 0 for i in static_argnums)
    checked = (
        {name: _checked_method(policy, cls, remat_class, name, static_argnums) for name in names}
        if tags.needs_check(policy) or negative
        else {}
    )
    # Named like the class itself (flax would say "CheckpointMyBlock"): a parent's auto-named
    # submodules, hence the parameter tree, are the same under every policy and without one.
    return type(cls.__name__, (wrapped,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__, **checked})


def _checked_method(policy, cls, remat_class, name: str, static_argnums: tuple[int, ...]):
    def method(self, *args, **kwargs):
        # Flax counts self as argument 0; the method's own arguments start at 1.
        argnums = normalize_argnums(static_argnums, len(args) + 1)
        if 0 in argnums:
            raise ValueError(
                f"static_argnums={static_argnums!r} reaches self in a call with {len(args)} argument(s); "
                f"a negative index counts back from the last argument"
            )
        if tags.needs_check(policy):
            _check_linen(policy, cls, self, name, args, kwargs, tuple(i - 1 for i in argnums))
        return getattr(remat_class(argnums), name)(self, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"{cls.__qualname__}.{name}"
    method.__doc__ = getattr(cls, name).__doc__
    return method


def _check_linen(policy, cls, module: nn.Module, name: str, args: tuple, kwargs: dict, static: tuple[int, ...]):
    """Trace the unwrapped module's ``name`` (via ``init``: variables exist or not) and check its tags."""
    fields = {
        f.name: getattr(module, f.name) for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")
    }
    bind, dynamic, static_values = _split_static(args, static)
    # Every RNG stream falls back to "params" in flax, so one key serves dropout and the rest.
    probe = cls(parent=None, **fields)

    def run(dyn, kw):
        call = bind(lambda *a, **k: probe.init_with_output(jax.random.key(0), *a, method=name, **k), **kw)
        return call(*dyn)

    key = (cls, name, tuple(sorted(fields.items())), tuple(sorted(static_values.items())), tags.signature(kwargs))
    tags.check_traced(policy, f"{cls.__name__}.{name}", run, dynamic, kwargs, key=tags.hashable(key))
