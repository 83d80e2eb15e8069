"""Names by module path inside a Linen block, as :func:`remat_kit.apply` gives them, for the Linen stacks.

A policy naming ``attn/q_einsum`` applies to a stack of an untagged block (:func:`remat_kit.linen.stack`):
the layer then runs with every submodule output named by its path in the block and every matmul with a
parameter by the parameter's path (:func:`remat_kit.policies.tags.stack_policy` decides when).

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> from remat_kit.policies import tags
>>> block = nn.Dense(2, name="up")
>>> v = block.init(jax.random.key(0), jnp.ones((1, 2)))
>>> sorted(tags.emitted_tags(lambda v, x: apply_named(block.apply, v, x), v, jnp.ones((1, 2))))
['kernel']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from remat_kit import _jax_internals
from remat_kit.names import join, state_keys
from remat_kit.policies.tags import name_tree


def _name_linen_output(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    path = tuple(context.module.path)
    return name_tree(out, join(path)) if context.method_name == "__call__" and path else out


def apply_named(apply: Callable, variables: Any, *args: Any) -> Any:
    """``apply(variables, *args)`` (a Linen block's functional apply) with every submodule output named by its
    path in the block and every matmul with a parameter by the parameter's path (as :func:`remat_kit.apply`)."""
    names = [
        join(keys[1:]) if keys and keys[0] == "params" else None
        for keys in (state_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(variables)[0])
    ]

    def run(variables, *args):
        with nn.intercept_methods(_name_linen_output):
            return apply(variables, *args)

    named, _ = _jax_internals.name_param_matmuls(run, names + [None] * len(jax.tree.leaves(args)), variables, *args)
    return named(variables, *args)
