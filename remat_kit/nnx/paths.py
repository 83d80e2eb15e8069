"""Names by module path inside an NNX block, as :func:`remat_kit.apply` gives them (and the NNX stacks use).

:func:`call_naming_submodules` names every submodule output of a block by its path; :func:`run_named` adds the
matmuls with the block's parameters, named by the parameter's path, for :func:`remat_kit.nnx.stack` when a
policy names ``attn/q_einsum`` on an untagged block (:func:`remat_kit.policies.tags.stack_policy`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from remat_kit import _jax_internals
from remat_kit.names import join, state_keys
from remat_kit.policies.tags import name_tree

# id(submodule) -> its name, for the tagging subclasses while a block's copy runs.
_NAMES: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("remat_kit_nnx_names", default=None)
_TAG_CLASSES: dict[type, type] = {}
#: The attribute a submodule of a block being named carries its path in (see :func:`call_naming_submodules`).
_NAME_ATTR = "_remat_kit_name"


def call_naming_submodules(original: Callable, block: nnx.Module, args: tuple, kwargs: dict) -> Any:
    """``original(block, *args, **kwargs)`` with every submodule output named by its path in ``block``.

    ``block`` must be a private copy (merged inside the traced call): its submodules' classes are
    swapped for naming subclasses.
    """
    names = {}
    for path, node in nnx.iter_graph(block):
        if path and isinstance(node, nnx.Module) and not isinstance(node, (nnx.List, nnx.Dict)):
            names[id(node)] = join(path)
            node.__class__ = _tag_class(type(node))
            # A static attribute travels with the graph: a transform of the model's own inside the block (its
            # nnx.remat splits and merges the submodules into new objects) keeps the name.
            object.__setattr__(node, _NAME_ATTR, join(path))
    token = _NAMES.set(names)
    try:
        return original(block, *args, **kwargs)
    finally:
        _NAMES.reset(token)


def _tag_class(cls: type) -> type:
    """``cls`` whose ``__call__`` names its output by the instance's path (from :data:`_NAMES`)."""
    if cls not in _TAG_CLASSES:
        original = cls.__call__

        def __call__(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            names = _NAMES.get()
            if names is None:
                return out
            name = names.get(id(self), getattr(self, _NAME_ATTR, None))
            return name_tree(out, name) if name else out

        _TAG_CLASSES[cls] = type(cls)(
            cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    return _TAG_CLASSES[cls]


def run_named(block: nnx.Module, fn: Callable, *arrays: Any) -> Any:
    """``fn(block, *arrays)`` with the block's submodule outputs named by their paths and its parameter matmuls
    by the parameters' paths; the block's other state (RNG counts, sown values) is updated as the call leaves it.

    The block runs as a merged copy inside the call (its state passed as arguments, never captured), as
    :func:`remat_kit.apply` runs one.
    """
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    param_leaves, param_tree = jax.tree.flatten(params)
    rest_leaves, rest_tree = jax.tree.flatten(rest)

    def body(param_leaves, rest_leaves, arrays):
        inner = nnx.merge(
            graphdef, jax.tree.unflatten(param_tree, param_leaves), jax.tree.unflatten(rest_tree, rest_leaves)
        )
        out = call_naming_submodules(fn, inner, arrays, {})
        return out, nnx.split(inner, nnx.Param, ...)[2]  # a State: the call may add variables (a first sow)

    names = [join(state_keys(p)) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    names += [None] * (len(rest_leaves) + len(jax.tree.leaves(arrays)))
    named, _ = _jax_internals.name_param_matmuls(body, names, param_leaves, rest_leaves, arrays)
    out, new_rest = named(param_leaves, rest_leaves, arrays)
    nnx.update(block, new_rest)
    return out
