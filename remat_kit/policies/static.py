"""The one rule for static arguments: which positional arguments are Python values, and how they are closed over.

``jax.checkpoint``, ``flax.linen.remat``, ``nnx.remat`` and :func:`remat_kit.apply` each take
``static_argnums``; remat_kit resolves them here, once: a negative index counts back from the last
positional argument of each call, an index past the call is not static.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np


def as_argnums(value) -> tuple[int, ...]:
    """``static_argnums`` as a tuple of ints (an int is one index; a negative one counts from the end).

    >>> as_argnums(2), as_argnums((1, -1))
    ((2,), (1, -1))
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"static_argnums must be an int or a tuple of ints, got {value!r}") from None
    for i in items:
        if not isinstance(i, int) or isinstance(i, bool):
            raise ValueError(f"static_argnums must be ints, got {value!r}")
    return items


def normalize_argnums(static_argnums: tuple[int, ...], nargs: int) -> tuple[int, ...]:
    """``static_argnums`` for a call with ``nargs`` positional arguments: negatives counted from the end,
    indices outside the call dropped (an argument not passed is not static), sorted.

    >>> normalize_argnums((-1, 1, 7), 3)
    (1, 2)
    """
    return tuple(sorted({i % nargs for i in static_argnums if -nargs <= i < nargs}))


def split_static(args: tuple, static_argnums: tuple[int, ...]):
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


def is_static(value: Any) -> bool:
    """Whether a call argument is a plain Python value (no arrays, no NNX objects inside): closed over, never traced.

    >>> import jax.numpy as jnp
    >>> is_static(True), is_static({"scale": 2.0}), is_static(jnp.ones(2)), is_static(None)
    (True, True, False, True)
    """
    # Flax is not imported here (a policy is pure JAX): an NNX object can only exist once flax.nnx is loaded.
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and nnx.graph.is_graph_node(value):
        return False
    return not any(isinstance(leaf, (jax.Array, np.ndarray, np.generic)) for leaf in jax.tree.leaves(value))
