"""The NNX side of :func:`remat_kit.apply`: an unedited NNX model's blocks run under ``jax.checkpoint``.

The model graph is copied (``nnx.merge(*nnx.split(model))``: same arrays, new Variable objects) and
each block of the copy gets a subclass of its own class whose ``__call__`` splits the block (and any
graph-node argument, such as call-time ``nnx.Rngs``) into state, runs the original ``__call__`` on a
merged copy inside ``jax.checkpoint`` with that state as an *argument*, and writes the updated
non-parameter state (RNG counts, batch statistics) back. No module is ever captured by a closure, so
``nnx.grad``/``nnx.Optimizer`` see every parameter, and ``nnx.split`` gives the plain model's state.
Inside, submodule outputs are named by their path relative to the block, and matmuls with the
block's parameters by the parameter's path (as on the Linen side, :mod:`remat_kit.apply`).

With ``scan=True`` (:func:`nnx_scan`) the blocks of one list that repeat a period run as one scan,
through the conversion both halves share (:mod:`remat_kit.unedited.scan`); a block left out of every
run is rematerialized here on its own (:func:`remat_class`, :func:`run_block`).
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat_kit import _jax_internals
from remat_kit.policies import layers as _layers
from remat_kit.policies import tags
from remat_kit.policies.static import is_static
from remat_kit.unedited import blocks, guard, long
from remat_kit.unedited.engine import (
    Collector,
    Plan,
    applied_twice,
    call_naming_submodules,
    check_static_argnames,
    checkpointed,
    ledger,
    make_plan,
    nnx_plain_call,
    split_arrays,
    split_static,
    tag_input,
    trace_only,
)
from remat_kit.unedited.paths import NameTable, Where, join, state_keys
from remat_kit.unedited.scan import (
    Call,
    Pending,
    carry_index,
    check_shared,
    position_policies,
    runs_in,
    same,
    take_carry,
    template,
)

_COLLECT: contextvars.ContextVar[Collector | None] = contextvars.ContextVar("remat_kit_nnx_collect", default=None)
_REMAT_CLASSES: dict[tuple, type] = {}


def find_blocks(model: nnx.Module, where: Where | None) -> tuple[list[tuple[tuple, nnx.Module]], str]:
    """The ``(path, module)`` of each block of ``model`` (outermost matches only), in graph order, and how they
    were found (``where=``, or by the parameters they carry)."""
    modules = [(tuple(path), node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]
    modules.sort(key=lambda pm: [str(p) for p in pm[0]])
    why = ""
    if where is None:
        choice = _choose(model, modules)
        where, why = Where(classes=choice.classes), choice.why
        if choice.several:
            warnings.warn(f"remat_kit.apply: {choice.several}", stacklevel=4)
    found = []
    for path, node in modules:
        if path and where(node, join(path)) and not any(path[: len(p)] == p for p, _ in found):
            found.append((path, node))
    if not found:
        listed = ", ".join(join(p) for p, _ in modules if p)
        raise ValueError(f"where={where} matches no module of {type(model).__name__}; its modules: {listed}")
    # Graph order sorts "10" before "2": order the blocks by their list index where there is one.
    found.sort(key=lambda pm: [(0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in pm[0]])
    return found, why


def _choose(model: nnx.Module, modules: list[tuple[tuple, nnx.Module]]) -> blocks.Choice:
    """The block classes of an NNX model: its repeated modules that carry the most parameters.

    No call is traced when apply runs (NNX takes no example arguments there), so parameters stand for compute; an
    embedding table does no matmul and counts 0. The guard (:mod:`remat_kit.unedited.guard`) checks on the first
    call that the blocks carry the forward pass's matmuls.
    """
    embeds = [p for p, m in modules if isinstance(m, nnx.Embed)]
    sizes = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        path = tuple(state_keys(keypath))
        if not any(path[: len(e)] == e for e in embeds):
            sizes.append((path, int(np.prod(jnp.shape(leaf)))))
    paths = [p for p, _ in modules]
    weights = {p: sum(n for q, n in sizes if q[: len(p)] == p) for p in paths if p}
    described = [(p, type(m), any(q != p and q[: len(p)] == p for q in paths)) for p, m in modules]
    total = sum(n for _, n in sizes)
    return blocks.choose(described, weights, total, "parameters (embeddings count 0)")


def apply(model: nnx.Module, plan: Plan) -> nnx.Module:
    """A copy of ``model`` whose blocks run under ``plan`` (see :func:`remat_kit.apply`)."""
    for _, node in nnx.iter_graph(model):
        if hasattr(type(node), "_remat_kit_policy"):
            raise applied_twice(type(model).__name__, node._remat_kit_policy, "apply returned a copy of it")
    copy = nnx.clone(model)
    found, why = find_blocks(copy, plan.where)
    for cls in dict.fromkeys(type(b) for _, b in found):
        nnx_plain_call(cls)  # a transform on the blocks' __call__: seen through (nnx.jit) or refused here
    check_static_argnames(plan.static_argnames, [type(b) for _, b in found])
    if plan.scan:
        nnx_scan(copy, plan, found)
    else:
        for index, (path, block) in enumerate(found):
            policy = plan.policy_for(index, block, join(path))
            block.__class__ = remat_class(type(block), policy, plan.static_argnames, plan.policy, plan.long)
    label = str(plan.where) if plan.where is not None else " or ".join(sorted({type(b).__name__ for _, b in found}))
    copy.__class__ = _root_class(type(copy), plan, nnx.graphdef(model), f"{label} blocks", why)
    return copy


def _root_class(cls: type, plan: Plan, plain: Any, blocks_label: str, why: str) -> type:
    """The applied model's own class: each call checks its blocks' names across them all (:func:`ledger`), and the
    first call per signature runs the guard (:func:`remat_kit.unedited.guard.verify`) against the plain model's
    graph ``plain``; a model whose own ``jax.checkpoint`` wraps its blocks runs with it seen through."""
    original = cls.__call__
    verdicts: dict = {}

    def __call__(self, *args, **kwargs):
        flat = jax.tree.leaves((args, kwargs), is_leaf=nnx.graph.is_graph_node)
        if any(nnx.graph.is_graph_node(a) for a in flat) or _COLLECT.get() is not None:
            with ledger(plan.policy):
                return original(self, *args, **kwargs)
        graphdef, state = nnx.split(self)
        state_leaves, state_tree = jax.tree.flatten(state)
        arrays, rebuild = split_arrays(args, kwargs)
        n = len(state_leaves)

        seen_inside = [0]

        def call(graph, leaves, fn):
            model = nnx.merge(graph, jax.tree.unflatten(state_tree, leaves[:n]))
            a, k = rebuild(leaves[n:])
            with ledger(plan.policy) as book:
                out = fn(model, *a, **k)
            seen_inside[0] = book.seen_through
            return out, nnx.state(model)

        leaves = [*state_leaves, *arrays]
        abstract = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in leaves]
        key = tags.signature((rebuild(abstract[n:]), abstract[:n]))
        verdict = verdicts.get(key) if key is not None else None
        if verdict is None:
            verdict = guard.verify(
                lambda *a: call(plain, a, _plain_call)[0],
                lambda *a: call(graphdef, a, original)[0],
                abstract,
                plan.policy,
                cls.__name__,
                blocks_label,
                guard.own_switch(cls),
                lambda: seen_inside[0],
                plain_key=None if key is None else (plain, key),
            )
            if key is not None and not verdict.finding:
                verdicts[key] = verdict
        if not verdict.see_through:
            with ledger(plan.policy):
                return original(self, *args, **kwargs)
        out, new_state = _jax_internals.without_foreign_remat(lambda *a: call(graphdef, a, original))(*leaves)
        nnx.update(self, new_state)
        return out

    __call__.__doc__ = original.__doc__
    return type(cls)(
        cls.__name__,
        (cls,),
        {
            "__call__": __call__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_remat_kit_policy": plan.policy,
            "_remat_kit_why": why,
        },
    )


def _plain_call(model: nnx.Module, *args, **kwargs):
    """The plain model's own ``__call__`` (its graph holds the plain classes)."""
    return type(model).__call__(model, *args, **kwargs)


def remat_class(cls: type, policy, static_argnames: frozenset[str], applied=None, long_plan=None) -> type:
    """``cls`` with a ``__call__`` that runs the original under ``policy`` (None: plainly, names only), its
    submodules in query blocks or tiles as ``long_plan`` asks (:mod:`remat_kit.unedited.long`).

    The class records ``applied`` (the policy :func:`remat_kit.apply` was given) as ``_remat_kit_policy``:
    ``compare``/``auto`` refuse a model whose blocks carry one (:func:`remat_kit.analysis.inspection.refuse_baked_nnx`).
    """
    key = (cls, policy, static_argnames, applied, long_plan)
    if key not in _REMAT_CLASSES:
        original = nnx_plain_call(cls)

        def __call__(self, *args, **kwargs):
            if policy is None and _COLLECT.get() is None and long_plan is None:
                return original(self, *args, **kwargs)
            return run_block(self, original, policy, static_argnames, args, kwargs, long_plan)

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


def run_block(
    block: nnx.Module, original, policy, static_argnames: frozenset[str], args: tuple, kwargs: dict, long_plan=None
):
    """Run ``original(block, *args, **kwargs)`` on the block's state under ``policy`` (see the module doc), its
    submodules in query blocks or tiles as ``long_plan`` asks."""
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
        out = _call_block(original, inner, full_args, full_kwargs, long_plan, where)
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


def _call_block(original, inner: nnx.Module, args: tuple, kwargs: dict, long_plan, where: str):
    """``original(inner, ...)`` with its submodules named (:func:`call_naming_submodules`) and its direct ones
    run in query blocks or tiles as ``long_plan`` asks (classified only under :func:`names_of`)."""
    collect = _COLLECT.get()
    if long_plan is None and collect is None:
        return call_naming_submodules(original, inner, args, kwargs)
    graph = [(tuple(p), n) for p, n in nnx.iter_graph(inner) if p and isinstance(n, nnx.Module)]
    owners = {p for p, n in graph if not isinstance(n, (nnx.List, nnx.Dict))}
    for path, node in graph:
        # A direct submodule: no module but a container (nnx.List/Dict) between it and the block.
        if path in owners and not any(path[:i] in owners for i in range(1, len(path))):
            try:
                cls = _part_class(type(node))
            except ValueError:  # an NNX transform on its __call__ (nnx.remat ...): it runs as written
                continue
            object.__setattr__(node, _PART_ATTR, join(path))
            node.__class__ = cls
    with long.block_scope(long_plan, args, kwargs, where, collect):
        return call_naming_submodules(original, inner, args, kwargs)


#: A direct submodule of a block under long context carries its path in the block here.
_PART_ATTR = "_remat_kit_part"


def _part_class(cls: type) -> type:
    """``cls`` whose calls, inside a block under :func:`long.block_scope`, go through :func:`long.run_part`."""
    original = nnx_plain_call(cls)

    def __call__(self, *args, **kwargs):
        path = getattr(self, _PART_ATTR, None)
        nodes = jax.tree.leaves((args, kwargs), is_leaf=nnx.graph.is_graph_node)
        if path is None or not long.active() or any(nnx.graph.is_graph_node(a) for a in nodes):
            return original(self, *args, **kwargs)
        graphdef, state = nnx.split(self)
        leaves, tree = jax.tree.flatten(state)

        def fn(state_leaves, a, k):
            # A merged copy with the leaves as inputs: nothing of the module captured, so gradients reach it.
            copy = nnx.merge(graphdef, jax.tree.unflatten(tree, state_leaves))
            return original(copy, *a, **k), jax.tree.leaves(nnx.state(copy))

        return long.run_part(path, fn, leaves, args, kwargs, lambda: original(self, *args, **kwargs))

    return _subclass("part", cls, __call__)


def _param_name(keypath) -> str | None:
    """A parameter's path in the block from its key path in the split ``(block, *nodes)`` state."""
    keys = state_keys(keypath)
    return join(keys[1:]) if keys and keys[0] == 0 else None


def names_of(model: nnx.Module, example_args: tuple, example_kwargs: dict, where: Any) -> NameTable:
    """:func:`remat_kit.names_of` for an NNX model: trace one call (nothing compiled), gather the names."""
    plan = make_plan("full", where, None, False, nnx.Module)
    applied = apply(model, plan)
    collector = Collector(why=type(applied)._remat_kit_why)
    token = _COLLECT.set(collector)
    try:
        graphdef, state = nnx.split(applied)
        trace_only(lambda s, *a, **k: nnx.merge(graphdef, s)(*a, **k), (state, *example_args), example_kwargs)
    finally:
        _COLLECT.reset(token)
    return collector.table()


# ---- scan=True: runs of blocks as one scan (the shared conversion: remat_kit.unedited.scan) ----------

#: The state of the running call of a parent module whose blocks are scanned (:class:`_CallState`).
_CALL: contextvars.ContextVar[Any] = contextvars.ContextVar("remat_kit_scan_call", default=None)
#: While a parent's call is traced to find its blocks' static arguments: the list they are recorded in.
_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("remat_kit_scan_record", default=None)


class _Schedules:
    """(parent graphdef, signatures of its state and call) -> that call's runs: the discovery trace, once per key.

    A graphdef holds the model's static attributes; one that cannot be hashed (tunix's Qwen3 keeps a
    ``@dataclass(slots=True)`` config, which is not frozen) is looked up by equality among the unhashable
    keys instead, so such a model is traced once per signature too. The newest ``limit`` keys are kept.

    >>> cache = _Schedules(limit=2)
    >>> cache.put(("g", [1]), "runs"); cache.get(("g", [1])), cache.get(("g", [2]))
    ('runs', None)
    """

    def __init__(self, limit: int = 64):
        self.limit = limit
        self.hashed: collections.OrderedDict = collections.OrderedDict()
        self.by_equality: list[tuple[Any, Any]] = []  # oldest first

    def get(self, key: Any) -> Any:
        if tags.hashable(key) is not None:
            if key in self.hashed:
                self.hashed.move_to_end(key)
                return self.hashed[key]
            return None
        for i, (k, runs) in enumerate(self.by_equality):
            if same(k, key):
                self.by_equality.append(self.by_equality.pop(i))
                return runs
        return None

    def put(self, key: Any, runs: Any) -> None:
        if tags.hashable(key) is not None:
            self.hashed[key] = runs
            if len(self.hashed) > self.limit:
                self.hashed.popitem(last=False)
        else:
            self.by_equality.append((key, runs))
            del self.by_equality[: -self.limit]


_SCHEDULES = _Schedules()


def _get(node, path):
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _parent_path(model: nnx.Module, path: tuple) -> tuple:
    """The longest proper prefix of ``path`` that is a module other than a list/dict container."""
    for cut in range(len(path) - 1, -1, -1):
        node = _get(model, path[:cut])
        if isinstance(node, nnx.Module) and not isinstance(node, (nnx.List, nnx.Dict)):
            return path[:cut]
    return ()


def _lists(found: list[tuple[tuple, nnx.Module]]) -> list[list[tuple[tuple, nnx.Module]]]:
    """The blocks split into groups at consecutive indices of one container (a list of layers)."""
    out: list[list] = []
    for path, block in found:
        prev = out[-1][-1][0] if out else None
        if (
            prev is not None
            and path[:-1] == prev[:-1]
            and isinstance(path[-1], int)
            and isinstance(prev[-1], int)
            and path[-1] == prev[-1] + 1
        ):
            out[-1].append((path, block))
        else:
            out.append([(path, block)])
    return out


@dataclasses.dataclass(frozen=True)
class _Mark:
    """What a block of an NNX model applied with ``scan=True`` knows of itself (an attribute of the block)."""

    parent: tuple  # its parent module's path in the model
    rel: tuple  # its path in the parent
    kind: int  # blocks of one kind share their graph (class, static attributes) and state shapes
    index: int  # its place among all the blocks (for every_n when it runs on its own)


def nnx_scan(model: nnx.Module, plan: Plan, found: list[tuple[tuple, nnx.Module]]) -> nnx.Module:
    """Make the blocks of ``model`` (a copy) that repeat a period in one list run as one scan under ``plan``.

    Which blocks form a run is known only at call time, from their static arguments: each parent's call
    is traced once per call signature (:func:`_schedule`). A block in no run is rematerialized on its own:
    alone in its list, its class becomes :func:`remat_class`'s; left out of every run at call time, it runs
    through :func:`run_block`.

    Raises:
      ValueError: no two consecutive blocks of one list (nothing could ever be scanned), naming them.
    """
    groups = _lists(found)
    if all(len(g) < 2 for g in groups):
        names = ", ".join(f"{join(p)} ({type(b).__name__})" for p, b in found)
        loose = [join(p) for p, _ in found if not isinstance(p[-1], int)]
        if loose:  # held as attributes or in a dict: their call order is not known before the call
            raise ValueError(
                f"scan=True scans consecutive items of one list (nnx.List), and {', '.join(loose)} "
                f"{'is no list item' if len(loose) == 1 else 'are no list items'}: hold the blocks in an nnx.List, "
                "or use scan=False"
            )
        raise ValueError(
            f"scan=True: no two consecutive blocks are identical, nor do two sit at consecutive places of one list: "
            f"{names}; use scan=False"
        )
    kinds: list = []
    order = {id(b): i for i, (_, b) in enumerate(found)}
    parents = set()
    for group in groups:
        if len(group) < 2:
            _, block = group[0]
            index = order[id(block)]
            block.__class__ = remat_class(type(block), plan.policy_for(index), plan.static_argnames, plan.policy)
            continue
        parent = _parent_path(model, group[0][0])
        parents.add(parent)
        for path, block in group:
            kind = (nnx.graphdef(block), jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), nnx.state(block)))
            at = next((i for i, k in enumerate(kinds) if same(k, kind)), None)
            if at is None:
                at, kinds = len(kinds), [*kinds, kind]
            object.__setattr__(block, "_remat_kit_mark", _Mark(parent, path[len(parent) :], at, order[id(block)]))
        for _, block in group:  # after every kind was read: the class is part of a graph
            block.__class__ = _block_class(type(block), plan)
    for parent in parents:
        node = _get(model, parent)
        object.__setattr__(node, "_remat_kit_path", parent)
        node.__class__ = _parent_class(type(node))
    return model


_CLASSES: dict[tuple, type] = {}


def _subclass(kind: str, cls: type, call, key=(), **attrs) -> type:
    k = (kind, cls, *key)
    if k not in _CLASSES:
        _CLASSES[k] = type(cls)(
            cls.__name__,
            (cls,),
            {"__call__": call, "__module__": cls.__module__, "__qualname__": cls.__qualname__, **attrs},
        )
    return _CLASSES[k]


@dataclasses.dataclass(frozen=True)
class NnxRun:
    """Blocks of one list whose calls repeat a period: run as one scan.

    Attributes:
      rels: every block's path in the parent, in call order.
      period: the blocks in one period.
      calls: each position's :class:`Call` (its static arguments).
    """

    rels: tuple[tuple, ...]
    period: int
    calls: tuple[Call, ...]


@dataclasses.dataclass
class _CallState:
    """One call of a parent: ``runs`` by each block's path (``(run, k)``: block ``k`` of it); outputs pending."""

    parent: Any
    runs: dict
    pending: dict = dataclasses.field(default_factory=dict)


def _parent_class(cls: type) -> type:
    original = cls.__call__

    def __call__(self, *args, **kwargs):
        if _RECORD.get() is not None:  # an outer parent's discovery trace: its blocks record themselves
            return original(self, *args, **kwargs)
        state = _CallState(self, _schedule(self, original, args, kwargs))
        token = _CALL.set(state)
        try:
            out = original(self, *args, **kwargs)
        finally:
            _CALL.reset(token)
        for todo in state.pending.values():
            todo.check_whole(type(self).__name__)
        return out

    return _subclass("parent", cls, __call__)


def _schedule(parent: nnx.Module, original, args: tuple, kwargs: dict) -> dict:
    """``{block path in parent: (NnxRun, k)}`` for this call: its blocks' calls traced once per call signature.

    Raises:
      ValueError: no run at all, naming each block with its class and static arguments.
    """
    flat, treedef = jax.tree.flatten((args, kwargs), is_leaf=nnx.graph.is_graph_node)
    node_at = [i for i, leaf in enumerate(flat) if nnx.graph.is_graph_node(leaf)]
    graphdef, state = nnx.split((parent, *[flat[i] for i in node_at]))
    others = [leaf for i, leaf in enumerate(flat) if i not in node_at]
    sig = tags.signature((state, others))
    key = None if sig is None else (graphdef, treedef, tuple(node_at), sig)
    cached = None if key is None else _SCHEDULES.get(key)
    if cached is not None:
        return cached
    records: list = []

    def probe(state, others):
        merged = nnx.merge(graphdef, state)
        nodes, rest = iter(merged[1:]), iter(others)
        a, k = jax.tree.unflatten(treedef, [next(nodes) if i in node_at else next(rest) for i in range(len(flat))])
        token = _RECORD.set(records)
        try:
            original(merged[0], *a, **k)
        finally:
            _RECORD.reset(token)

    trace_only(probe, (state, others), {})
    mine = [(m, call, arrays) for m, call, arrays in records if m.parent == parent._remat_kit_path]
    runs = _nnx_runs(mine, type(parent).__name__)
    if key is not None:
        _SCHEDULES.put(key, runs)
    return runs


def _nnx_runs(records: list[tuple[_Mark, Call, tuple]], where: str) -> dict:
    """The runs among one parent call's block calls (``(mark, call, array arguments)`` in call order).

    See :func:`linen_runs`. Every block of a run must get the first one's array arguments but the input
    (one scan shares them): a block given its own (a per-layer cache) is a ValueError naming the argument.
    """
    seen = [m.rel for m, *_ in records]
    blocks = [r for r in records if seen.count(r[0].rel) == 1]  # a block called twice is not scanned
    siblings: list[list] = []
    for r in blocks:
        m = r[0]
        prev = siblings[-1][-1][0].rel if siblings else None
        if prev is not None and prev[:-1] == m.rel[:-1] and m.rel[-1] == prev[-1] + 1:
            siblings[-1].append(r)
        else:
            siblings.append([r])
    runs: dict = {}
    for group in siblings:
        for part, period in runs_in(group, lambda a, b: a[0].kind == b[0].kind and a[1].same(b[1])):
            for m, c, arrays in part[1:]:
                check_shared(f"{where}'s block {join(m.rel)}", join(part[0][0].rel), c, part[0][2], arrays)
            run = NnxRun(tuple(m.rel for m, *_ in part), period, tuple(c for _, c, _ in part[:period]))
            runs.update({m.rel: (run, k) for k, (m, *_) in enumerate(part)})
    if not runs:
        names = "; ".join(f"{join(m.rel)} ({c.describe()})" for m, c, _ in blocks)
        raise ValueError(
            f"scan=True: no two consecutive blocks of {where} are identical, nor do they repeat a period of blocks "
            f"(same class, attributes, parameter shapes and static arguments): {names}; use scan=False"
        )
    return runs


def _block_class(cls: type, plan: Plan) -> type:
    original = nnx_plain_call(cls)  # an nnx.jit on it seen through (another transform refused)

    def __call__(self, *args, **kwargs):
        mark = self._remat_kit_mark
        records = _RECORD.get()
        if records is not None:  # the parent's discovery trace: record the call, run it plainly
            _, dyn_args, dyn_kwargs = split_static(original, args, kwargs, plan.static_argnames, is_static)
            records.append((mark, template(original, args, kwargs, plan.static_argnames), (dyn_args, dyn_kwargs)))
            return original(self, *args, **kwargs)
        state = _CALL.get()
        if state is None or getattr(state.parent, "_remat_kit_path", None) != mark.parent:
            raise ValueError("scan=True: the blocks were called outside their parent module's __call__")
        if mark.rel not in state.runs:  # in no run: on its own, under the policy
            policy = plan.policy_for(mark.index)
            if policy is None:
                return original(self, *args, **kwargs)
            return run_block(self, original, policy, plan.static_argnames, args, kwargs, plan.long)
        run, k = state.runs[mark.rel]
        call = template(original, args, kwargs, plan.static_argnames)
        if not call.same(run.calls[k % run.period]):
            raise ValueError(
                f"scan=True: block {join(mark.rel)} is called with {call.describe()}, not "
                f"{run.calls[k % run.period].describe()} as when the model was traced; use scan=False"
            )
        _, dyn_args, dyn_kwargs = split_static(original, args, kwargs, plan.static_argnames, is_static)
        where = f"{cls.__name__} block {join(mark.rel)}"
        if k == 0:
            _check_scannable_call(where, args, dyn_args, dyn_kwargs, run.calls)
            layers = [_get(state.parent, rel) for rel in run.rels]
            originals = [nnx_plain_call(type(layer).__mro__[1]) for layer in layers[: run.period]]
            rest = (dyn_args[1:], dyn_kwargs)
            outs, carry_at = _scan(layers, originals, plan, run, args[0], rest)
            state.pending[mark.rel] = Pending(run.rels, run.calls, outs, carry_at, rest)
            return state.pending[mark.rel].first()[0]
        pending = state.pending.get(run.rels[0])
        if pending is None:
            raise ValueError(f"scan=True: block {join(mark.rel)} ran out of order; use scan=False")
        return pending.follow(k, args, call, (dyn_args[1:], dyn_kwargs), where)[0]

    # _remat_kit_policy: compare/auto refuse a model that runs a policy of its own (inspection.refuse_baked_nnx).
    return _subclass("block", cls, __call__, (plan,), _remat_kit_policy=plan.policy)


def _scan(layers: list[nnx.Module], originals: list, plan: Plan, run: NnxRun, x, rest: tuple):
    """Run ``layers`` (a run repeating a period) on ``x`` as one scan; write their updated state back.

    ``rest``: the array arguments but the input, ``(positional ones, keyword ones)``, the same for every
    block (positions, an attention mask, segment ids): closed over by the scan.

    Returns:
      ``(each position's outputs stacked over the periods, each position's place of the next block's
      input in its output)`` (:func:`carry_index`).
    """
    # Long: split, stack, scan and write back are one transaction over the same layers' state.
    out_at: dict[int, Any] = {}
    period = run.period
    graphdefs = [nnx.graphdef(layer) for layer in layers[:period]]
    treedefs = [jax.tree.structure(nnx.state(layer)) for layer in layers[:period]]
    leaves = [jax.tree.leaves(nnx.state(layer)) for layer in layers]
    # A Variable held by every layer (a shared RNG stream) is carried through the scan, the others stacked.
    held = [_leaf_variables(layer) for layer in layers]
    shared_ids = set.intersection(*[{id(v) for v in vs} for vs in held])
    shared = list(dict.fromkeys(id(v) for vs in held[:period] for v in vs if id(v) in shared_ids))
    # Per position: each leaf's place in the carry, or None for a stacked leaf.
    carry_at = [[shared.index(id(v)) if id(v) in shared_ids else None for v in held[j]] for j in range(period)]
    carry0 = [None] * len(shared)
    for j in range(period):
        for leaf, at in zip(leaves[j], carry_at[j], strict=True):
            if at is not None and carry0[at] is None:
                carry0[at] = leaf
    stacked = [
        [jnp.stack([lv[i] for lv in leaves[j::period]]) for i, at in enumerate(carry_at[j]) if at is None]
        for j in range(period)
    ]
    stack_names = []
    for j in range(period):
        paths = jax.tree_util.tree_flatten_with_path(nnx.state(layers[j]))[0]
        params = [isinstance(v, nnx.Param) for v in held[j]]
        stack_names.append(
            [join(state_keys(p)) if params[i] else None for i, (p, _) in enumerate(paths) if carry_at[j][i] is None]
        )

    carried_paths = [
        [
            (tuple(state_keys(p)), at)
            for (p, _), at in zip(
                jax.tree_util.tree_flatten_with_path(nnx.state(layers[j]))[0], carry_at[j], strict=True
            )
            if at is not None
        ]
        for j in range(period)
    ]

    def layer_call(j, layer_stack, h, carry):
        it_s = iter(layer_stack)
        full = [carry[at] if at is not None else next(it_s) for at in carry_at[j]]
        layer = nnx.merge(graphdefs[j], jax.tree.unflatten(treedefs[j], full))
        args, kwargs = run.calls[j].fill((_layers.tag_input(h), *rest[0]), rest[1])  # apply owns the layer input
        y = _call_block(originals[j], layer, args, kwargs, plan.long, f"{type(layers[j]).__name__} block")
        out_at[j] = carry_index(y, h, f"{type(layers[j]).__name__} block {join(run.rels[j])}")
        # By path, not position: the call may add variables (a first sow), shifting the leaves after them.
        new = dict(nnx.to_flat_state(nnx.state(layer)))
        new_carry = list(carry)
        for path, at in carried_paths[j]:
            new_carry[at] = new.pop(path).get_value()
        return y, new_carry, nnx.from_flat_state(new)

    def names(j, h, carry):
        return stack_names[j] + [None] * (len(jax.tree.leaves(h)) + len(carry))

    def make_step(j):
        def step(layer_stack, hc, i):
            h, carry = hc
            call = functools.partial(layer_call, j)
            named, _ = _jax_internals.name_param_matmuls(call, names(j, h, carry), layer_stack, h, carry)
            y, new_carry, new_stack = named(layer_stack, h, carry)
            return (take_carry(y, out_at[j]), new_carry), (y, new_stack)

        return step

    def traced(j):
        first = [a[0] for a in stacked[j]]
        return _jax_internals.name_param_matmuls(
            functools.partial(layer_call, j), names(j, x, carry0), first, x, carry0
        )[1]

    where = [f"{type(layers[j]).__name__} block {join(run.rels[j])}" for j in range(period)]
    policy, positions = position_policies(plan.policy, len(layers) // period, traced, where)
    steps = [make_step(j) for j in range(period)]
    (_, carry), ys = _layers.run_periods(policy, len(layers) // period, steps, stacked, (x, carry0), positions)
    for k, layer in enumerate(layers):
        j, u = k % period, k // period
        nnx.update(layer, jax.tree.map(lambda a, u=u: a[u], ys[j][1]))  # sown values included, each its own
    for j in range(period):
        for variable, at in zip(held[j], carry_at[j], strict=True):
            if at is not None:
                variable.set_value(carry[at])
    outs = tuple(y[0] for y in ys)
    return outs, tuple(out_at[j] for j in range(period))


def _check_scannable_call(where: str, args: tuple, dyn_args: tuple, dyn_kwargs: dict, calls: tuple) -> None:
    """The first block of a run can start the scan: an array input first, shared arguments the scan can close over.

    Raises:
      ValueError: no array input first; positions of the period taking arrays in different places; an NNX
        object (a call-time ``nnx.Rngs``) among the shared arguments.
    """
    if not args or is_static(args[0]) or nnx.graph.is_graph_node(args[0]):
        raise ValueError(f"scan=True: {where} takes no array input as its first argument; use scan=False")
    holes = [c.hole_names() for c in calls]
    for j, h in enumerate(holes[1:], start=1):
        if h != holes[0]:
            raise ValueError(
                f"scan=True: position 0 and {j} of the period take array arguments in different places "
                f"({', '.join(holes[0])} vs {', '.join(h)}), so one set of arrays cannot reach both; use scan=False"
            )
    shared = [*zip(holes[0][1 : len(dyn_args)], dyn_args[1:], strict=True), *dyn_kwargs.items()]
    for name, value in shared:
        if any(nnx.graph.is_graph_node(leaf) for leaf in jax.tree.leaves(value, is_leaf=nnx.graph.is_graph_node)):
            raise ValueError(
                f"scan=True: {where} takes the NNX object {name}= (a call-time nnx.Rngs?), which one scan cannot "
                "share between its blocks; pass arrays and Python values only, or use scan=False"
            )


def _leaf_variables(layer: nnx.Module) -> list:
    """The Variable behind each leaf of ``nnx.state(layer)``, in leaf order."""
    return [_get(layer, state_keys(p)) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(layer))[0]]
