"""The NNX side of :func:`remat_kit.apply`: an unedited NNX model's blocks run under ``jax.checkpoint``.

The model graph is copied (``nnx.merge(*nnx.split(model))``: same arrays, new Variable objects) and
each block of the copy gets a subclass of its own class whose ``__call__`` splits the block (and any
graph-node argument, such as call-time ``nnx.Rngs``) into state, runs the original ``__call__`` on a
merged copy inside ``jax.checkpoint`` with that state as an *argument*, and writes the updated
non-parameter state (RNG counts, batch statistics) back. No module is ever captured by a closure, so
``nnx.grad``/``nnx.Optimizer`` see every parameter, and ``nnx.split`` gives the plain model's state.
Inside, submodule outputs are named by their path relative to the block, and matmuls with the
block's parameters by the parameter's path (as on the Linen side, :mod:`remat_kit.apply`).
"""

from __future__ import annotations

import contextvars
from typing import Any

import jax
from flax import nnx

from remat_kit import _jax_internals
from remat_kit.policies.static import is_static
from remat_kit.unedited import scan as unedited_scan
from remat_kit.unedited.engine import (
    Collector,
    Plan,
    applied_twice,
    call_naming_submodules,
    check_static_argnames,
    checkpointed,
    make_plan,
    nnx_plain_call,
    split_static,
    tag_input,
    trace_only,
)
from remat_kit.unedited.paths import NameTable, Where, join, repeated_block, state_keys

_COLLECT: contextvars.ContextVar[Collector | None] = contextvars.ContextVar("remat_kit_nnx_collect", default=None)
_REMAT_CLASSES: dict[tuple, type] = {}


def blocks(model: nnx.Module, where: Where | None) -> list[tuple[tuple, nnx.Module]]:
    """The ``(path, module)`` of each block of ``model`` (outermost matches only), in graph order."""
    modules = [(tuple(path), node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]
    modules.sort(key=lambda pm: [str(p) for p in pm[0]])
    if where is None:
        where = Where(classes=(repeated_block([(p, type(m)) for p, m in modules]),))
    found = []
    for path, node in modules:
        if path and where(node, join(path)) and not any(path[: len(p)] == p for p, _ in found):
            found.append((path, node))
    if not found:
        listed = ", ".join(join(p) for p, _ in modules if p)
        raise ValueError(f"where={where} matches no module of {type(model).__name__}; its modules: {listed}")
    # Graph order sorts "10" before "2": order the blocks by their list index where there is one.
    found.sort(key=lambda pm: [(0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in pm[0]])
    return found


def apply(model: nnx.Module, plan: Plan) -> nnx.Module:
    """A copy of ``model`` whose blocks run under ``plan`` (see :func:`remat_kit.apply`)."""
    for _, node in nnx.iter_graph(model):
        if hasattr(type(node), "_remat_kit_policy"):
            raise applied_twice(type(model).__name__, node._remat_kit_policy, "apply returned a copy of it")
    copy = nnx.clone(model)
    found = blocks(copy, plan.where)
    for cls in dict.fromkeys(type(b) for _, b in found):
        nnx_plain_call(cls)  # a transform on the blocks' __call__: seen through (nnx.jit) or refused here
    check_static_argnames(plan.static_argnames, [type(b) for _, b in found])
    if plan.scan:
        return unedited_scan.nnx_scan(copy, plan, found, remat_class, run_block)
    for index, (_, block) in enumerate(found):
        policy = plan.policy_for(index)
        block.__class__ = remat_class(type(block), policy, plan.static_argnames, plan.policy)
    return copy


def remat_class(cls: type, policy, static_argnames: frozenset[str], applied=None) -> type:
    """``cls`` with a ``__call__`` that runs the original under ``policy`` (None: plainly, names only).

    The class records ``applied`` (the policy :func:`remat_kit.apply` was given) as ``_remat_kit_policy``:
    ``compare``/``auto`` refuse a model whose blocks carry one (:func:`remat_kit.analysis.inspection.refuse_baked_nnx`).
    """
    key = (cls, policy, static_argnames, applied)
    if key not in _REMAT_CLASSES:
        original = nnx_plain_call(cls)

        def __call__(self, *args, **kwargs):
            if policy is None and _COLLECT.get() is None:
                return original(self, *args, **kwargs)
            return run_block(self, original, policy, static_argnames, args, kwargs)

        __call__.__doc__ = original.__doc__
        _REMAT_CLASSES[key] = type(cls)(
            cls.__name__,
            (cls,),
            {
                "__call__": __call__,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_remat_kit_policy": applied if applied is not None else policy,
            },
        )
    return _REMAT_CLASSES[key]


def run_block(block: nnx.Module, original, policy, static_argnames: frozenset[str], args: tuple, kwargs: dict):
    """Run ``original(block, *args, **kwargs)`` on the block's state under ``policy`` (see the module doc)."""
    rebuild, dyn_args, dyn_kwargs = split_static(original, args, kwargs, static_argnames, is_static)
    # Graph nodes among the arguments (call-time nnx.Rngs) travel as state with the block.
    flat, treedef = jax.tree.flatten((dyn_args, dyn_kwargs), is_leaf=nnx.graph.is_graph_node)
    node_at = [i for i, leaf in enumerate(flat) if nnx.graph.is_graph_node(leaf)]
    nodes = (block, *[flat[i] for i in node_at])
    graphdef, params, rest = nnx.split(nodes, nnx.Param, ...)
    param_leaves, param_tree = jax.tree.flatten(params)
    rest_leaves, rest_tree = jax.tree.flatten(rest)
    arrays = [leaf for i, leaf in enumerate(flat) if i not in node_at]
    where = f"{type(block).__name__} block"

    def body(param_leaves, rest_leaves, arrays):
        merged = nnx.merge(
            graphdef, jax.tree.unflatten(param_tree, param_leaves), jax.tree.unflatten(rest_tree, rest_leaves)
        )
        inner, node_args = merged[0], merged[1:]
        it_nodes, it_arrays = iter(node_args), iter(arrays)
        call_flat = [next(it_nodes) if i in node_at else next(it_arrays) for i in range(len(flat))]
        dargs, dkwargs = jax.tree.unflatten(treedef, call_flat)
        full_args, full_kwargs = tag_input(original, *rebuild(dargs, dkwargs))
        out = call_naming_submodules(original, inner, full_args, full_kwargs)
        # A State, not leaves: the call may add variables (a first ``sow``), changing the tree.
        _, _, new_rest = nnx.split(merged, nnx.Param, ...)
        return out, new_rest

    leaf_names = [_param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    all_args = (param_leaves, rest_leaves, arrays)
    names_all = leaf_names + [None] * (len(rest_leaves) + len(arrays))
    named, jaxpr = _jax_internals.name_param_matmuls(body, names_all, *all_args)
    collect = _COLLECT.get()
    if collect is not None:
        module_names = {t for t, *_ in _jax_internals.jaxpr_tags(jaxpr)} - set(leaf_names)
        collect.add(where, jaxpr, module_names, {n for n in leaf_names if n})
        out, new_rest = named(*all_args)
    elif policy is None:  # names only (an NNX stack's layer, under the stack's own policy)
        out, new_rest = named(*all_args)
    else:
        out, new_rest = checkpointed(policy, where, named, jaxpr, all_args)
    nnx.update(nodes, new_rest)
    return out


def _param_name(keypath) -> str | None:
    """A parameter's path in the block from its key path in the split ``(block, *nodes)`` state."""
    keys = state_keys(keypath)
    return join(keys[1:]) if keys and keys[0] == 0 else None


def names_of(model: nnx.Module, example_args: tuple, example_kwargs: dict, where: Any) -> NameTable:
    """:func:`remat_kit.names_of` for an NNX model: trace one call (nothing compiled), gather the names."""
    plan = make_plan("full", where, None, False, nnx.Module)
    applied = apply(model, plan)
    collector = Collector()
    token = _COLLECT.set(collector)
    try:
        graphdef, state = nnx.split(applied)
        trace_only(lambda s, *a, **k: nnx.merge(graphdef, s)(*a, **k), (state, *example_args), example_kwargs)
    finally:
        _COLLECT.reset(token)
    return collector.table()
