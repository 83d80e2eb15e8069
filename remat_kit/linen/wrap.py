"""A policy on one Flax Linen module class: the class under ``flax.linen.remat``, checking its tags at trace time.

The policy is duck-typed (``.remat``, ``.jax_policy``, ``.tags``, ``.strict``); :func:`remat_kit.remat`
(and ``policy(MyBlock)``) land here for a Linen class.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax

from remat_kit.policies import tags
from remat_kit.policies.static import normalize_argnums, split_static


def remat_class(policy, cls: type[nn.Module], static_argnums, methods, prevent_cse) -> type[nn.Module]:
    names = list(methods) if methods is not None else ["__call__"]
    for name in names:
        if not callable(getattr(cls, name, None)):
            raise ValueError(f"methods={names!r}: {cls.__name__} has no method {name!r}")
    if 0 in static_argnums:
        raise ValueError(f"static_argnums={static_argnums!r}: index 0 is self (flax.linen.remat counts it); x is 1")

    @functools.cache
    def flax_remat(argnums: tuple[int, ...]):
        return nn.remat(cls, policy=policy.jax_policy, prevent_cse=prevent_cse, static_argnums=argnums, methods=methods)

    wrapped = flax_remat(tuple(static_argnums))
    # The same methods, each checking the policy's tags before running the rematerialized one. Negative
    # indices count from the end of each call's arguments, so they are resolved per call: flax shifts
    # indices by self's place, which would move a negative one (its -1 reaches no argument).
    negative = any(i < 0 for i in static_argnums)
    checked = (
        {name: _checked_method(policy, cls, flax_remat, name, static_argnums) for name in names}
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
    bind, dynamic, static_values = split_static(args, static)
    # Every RNG stream falls back to "params" in flax, so one key serves dropout and the rest.
    probe = cls(parent=None, **fields)

    def run(dyn, kw):
        call = bind(lambda *a, **k: probe.init_with_output(jax.random.key(0), *a, method=name, **k), **kw)
        return call(*dyn)

    key = (cls, name, tuple(sorted(fields.items())), tuple(sorted(static_values.items())), tags.signature(kwargs))
    tags.check_traced(policy, f"{cls.__name__}.{name}", run, dynamic, kwargs, key=tags.hashable(key))
