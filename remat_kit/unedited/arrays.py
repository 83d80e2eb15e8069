"""A call's array leaves apart from the rest (None caches, flags, strings): what is traced and what is closed over."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np


def split_arrays(args: tuple, kwargs: dict) -> tuple[list, Callable]:
    """A call's array leaves (arrays, tracers, ShapeDtypeStructs) and ``rebuild(arrays) -> (args, kwargs)``.

    >>> import jax.numpy as jnp
    >>> arrays, rebuild = split_arrays((jnp.ones(2), "tanh"), {"train": False})
    >>> len(arrays), rebuild([jnp.zeros(2)])[0][1]
    (1, 'tanh')
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))]

    def rebuild(arrays):
        full = list(leaves)
        for i, a in zip(at, arrays, strict=True):
            full[i] = a
        return jax.tree.unflatten(treedef, full)

    return [leaves[i] for i in at], rebuild
