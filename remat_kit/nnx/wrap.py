"""Apply a policy to one Flax NNX module instance: a module that owns it and runs it under ``nnx.remat``.

Why a module that *owns* the instance, rather than a function that captures it: NNX transforms
(``nnx.grad``, ``nnx.value_and_grad``, ``nnx.jit``, ``nnx.Optimizer``) find parameters by walking the
graph of their *arguments*. A closure over the module hides it: wrapped once outside ``nnx.grad`` and
then trained, every gradient would silently be 0.0. :class:`Remat` keeps the instance as its attribute
``module`` (so it is part of the graph) and hands it to ``nnx.remat`` as an argument on every call.

The policy is duck-typed (this module must not import :mod:`remat_kit.policies`, which imports it): it
needs ``remat``, ``jax_policy``, ``tags`` and a readable ``str``.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from remat_kit import policies
>>> model = policies.full()(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
>>> type(model).__name__, type(model.module).__name__
('Remat', 'Linear')
>>> grads = nnx.grad(lambda m: m(jnp.ones((1, 3))).sum())(model)
>>> float(grads["module"]["bias"][...].sum())
2.0
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from remat_kit.policies import tags as _tags
from remat_kit.policies.static import is_static


class Remat(nnx.Module):
    """An ``nnx.Module`` that owns ``module`` and runs its ``__call__`` under ``nnx.remat``.

    Build it with ``policy(instance)`` or :func:`remat`. Parameters appear under ``module``
    (``nnx.state(wrapper)["module"]``), so optimizers and checkpoints see the wrapped module's tree
    one level down.

    Attributes:
      module: the wrapped instance (the same object, not a copy: training the wrapper trains it).
      policy: the policy (a :class:`remat_kit.policies.Policy`).
      static_argnums: positions of ``__call__`` arguments that are Python values, counting ``self``
        as 0 as ``flax.linen.remat`` does (so ``__call__(self, x, train)`` takes ``(2,)``).
      prevent_cse: passed to ``nnx.remat``; keep True outside scans.
    """

    def __init__(self, policy, module: nnx.Module, *, static_argnums: tuple[int, ...] = (), prevent_cse: bool = True):
        self.module = module
        self.policy = policy
        self.static_argnums = static_argnums
        self.prevent_cse = prevent_cse

    def __call__(self, *args, **kwargs):
        """Run ``module(*args, **kwargs)`` under the policy.

        Keyword arguments holding no array (flags such as ``train=True``) are static; array keyword
        arguments are traced. Positional Python flags need ``static_argnums``.

        Raises:
          ValueError: the policy names a tag the module never emits (checked once per input signature).
        """
        static_kw = {k: v for k, v in kwargs.items() if is_static(v)}
        traced_kw = {k: v for k, v in kwargs.items() if k not in static_kw}
        # Indices of ``run``'s positional arguments equal ``__call__``'s with ``self`` as 0; a negative one
        # counts from the end of this call's arguments (nnx.remat counts the same way).
        static = {i if i > 0 else len(args) + 1 + i for i in self.static_argnums}

        def run(module, *a, **kw):
            return module(*a, **kw, **static_kw)

        if self.policy.tags:
            check_tags_once(self.policy, self.module, run, args, traced_kw, static)
        if not self.policy.remat:
            return run(self.module, *args, **traced_kw)
        lifted = nnx.remat(
            run,
            policy=self.policy.jax_policy,
            static_argnums=self.static_argnums,
            prevent_cse=self.prevent_cse,
            # Propagate variable updates (BatchNorm statistics, RNG counts) but not graph-structure
            # changes: the lifted function then returns only what changed, never a copy of the params.
            graph_updates=False,
        )
        return lifted(self.module, *args, **traced_kw)


def remat(policy, module: nnx.Module, *, static_argnums=(), prevent_cse: bool = True) -> Remat:
    """Wrap an NNX module instance so that its ``__call__`` runs under ``policy``.

    Also for ``none``: the result is always a :class:`Remat` (which then runs the module plainly), so
    the tree of parameters has the same shape under every policy.

    Args:
      policy: a :class:`remat_kit.policies.Policy` (normally reached as ``policy(instance)``).
      module: an ``nnx.Module`` instance.
      static_argnums: positions of Python-valued arguments of ``module.__call__``, ``self`` being 0
        (``flax.linen.remat``'s convention); an int or a tuple of ints >= 1, or negative ones counting
        from the end of each call's arguments (``-1``: the last).
      prevent_cse: passed to ``nnx.remat``.

    Returns:
      A :class:`Remat` owning ``module``.

    Raises:
      TypeError: ``module`` is not an ``nnx.Module`` instance (a class gets a hint how to build one).
      ValueError: a bad ``static_argnums``.
    """
    if isinstance(module, type) and issubclass(module, nnx.Module):
        raise TypeError(
            f"apply a policy to an NNX module instance, not the class {module.__name__}: "
            f"write policy({module.__name__}(..., rngs=nnx.Rngs(0))), or use remat_kit.nnx.stack for layers"
        )
    if not isinstance(module, nnx.Module):
        raise TypeError(f"remat_kit.nnx.wrap.remat wraps an nnx.Module instance, got {module!r}")
    argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    for i in argnums:
        if isinstance(i, bool) or not isinstance(i, int) or i == 0:
            raise ValueError(
                f"static_argnums must hold ints >= 1 (0 is the module itself, 1 its first argument) or "
                f"negative ones counting from the last argument (-1), got {static_argnums!r}"
            )
    return Remat(policy, module, static_argnums=argnums, prevent_cse=bool(prevent_cse))


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


def abstract(tree):
    """``tree`` with each array replaced by its ``jax.ShapeDtypeStruct`` (other leaves kept)."""

    def one(leaf):
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)
        return leaf

    return jax.tree.map(one, tree)


def check_tags_once(policy, module: nnx.Module, run, args: tuple, kwargs: dict, static: set[int]) -> None:
    """Apply the tag rule to ``run(module, *args, **kwargs)``, once per (policy, module graph, input signature).

    The module is traced as a copy (``nnx.merge`` of its abstract state), so running the check changes
    nothing: no statistics or RNG counters move.
    """
    graphdef, state = nnx.split(module)
    # Positions in ``args`` are one less than ``run``'s (``run`` takes the module first).
    dynamic = {i: a for i, a in enumerate(args) if i + 1 not in static}
    abstract_state, abstract_dynamic, abstract_kwargs = abstract((state, dynamic, kwargs))
    statics = tuple((i, a) for i, a in enumerate(args) if i + 1 in static)
    # Checking traces the module once more, so it runs once per signature, like compilation.
    key = (
        "instance",
        policy,
        graphdef,
        jax.tree.structure((dynamic, kwargs)),
        tuple(jax.tree.leaves((abstract_dynamic, abstract_kwargs))),
        statics,
    )

    def traced(state, dyn, kw):
        full = [dyn.get(i, a) for i, a in enumerate(args)]
        return run(nnx.merge(graphdef, state), *full, **kw)

    def run_check():
        emitted = _tags.emitted_tags(traced, abstract_state, abstract_dynamic, abstract_kwargs)
        _tags.check(policy, emitted, type(module).__name__)

    _tags.once(key, run_check)
