"""``remat_kit.apply(..., scan=True)``: consecutive blocks of an unedited model that repeat a period, as one scan.

XLA:CPU strips the recompute out of a Python loop of rematerialized blocks (CSE), so a loop model's
compiled memory does not drop however little the policy keeps; under a ``lax.scan`` it does. The
model's code still loops (``for layer in self.layers: x = layer(x, is_local)``). Its blocks may repeat a
*period* (Gemma 3's local/global attention: the block's class, attributes or a static Python flag
alternate per layer): a trace of the parent's call (nothing compiled, once per call signature) records
every block call's static arguments (:func:`template`), and consecutive blocks whose calls repeat a
period at least twice form a run (:func:`_period`: the period covering the most blocks; a remainder that
breaks it starts the next run or runs block by block under the policy). The first block of a run
computes the whole run as one scan over the blocks' stacked state, one stack per position of the period
(stacked inside the call: the model's own layout, hence its checkpoints, is unchanged), through
:func:`remat_kit.policies.layers.run_periods` (shared with the period stacks: a per-layer policy wraps each
block, a grouping one counts periods), and returns its own output; each later block checks that it is
called with the previous block's output and the static arguments it was traced with, and returns its
precomputed output. Anything else (code between the calls, other arguments) is a ValueError saying why
the model cannot be scanned unedited.

Both sides: array arguments besides the input (positions, an attention mask, segment ids) must be the same
arrays for every block of a run: the scan closes over them (a per-layer KV cache is a ValueError naming the
argument). A block may return its output alone or in a tuple with values of other shapes (gm.nn's and
tunix's ``(cache, x)``, the cache None in training): the scan carries the one part shaped like the input
and stacks the rest (:func:`_carry_at`).

NNX (:func:`nnx_scan`): the blocks of one ``nnx.List`` at consecutive indices; a block's kind is
its graph (class, static attributes) and state shapes. State shared by every block (one ``nnx.Rngs``
stream held by every Dropout) is carried through the scan, so RNG draws match the loop.

Linen (:func:`linen_run`, runs by :func:`linen_runs`): blocks under one parent called one after the
other; a block's kind is its class and attributes. The run's first block reads every block's variables
from the parent (the model's own tree) and scans one functional ``apply`` per position over them.
RNG streams draw each layer's plain key (derived from its path, as Flax does:
:func:`remat_kit._jax_internals.linen_block_rngs`); mutable collections the blocks write (``sow``,
``batch_stats``, a cache) come out stacked and are written back into each block's own scope.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import functools
import inspect as _inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat_kit import _jax_internals
from remat_kit.policies import Mix, Policy, tags
from remat_kit.policies import layers as _layers
from remat_kit.policies.static import is_static
from remat_kit.unedited.engine import Plan, call_naming_submodules, nnx_plain_call, split_static, trace_only
from remat_kit.unedited.paths import join, state_keys

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
            if _same(k, key):
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


def nnx_scan(
    model: nnx.Module, plan: Plan, found: list[tuple[tuple, nnx.Module]], remat_class: Callable, run_block: Callable
) -> nnx.Module:
    """Make the blocks of ``model`` (a copy) that repeat a period in one list run as one scan under ``plan``.

    Which blocks form a run is known only at call time, from their static arguments: each parent's call
    is traced once per call signature (:func:`_schedule`). A block in no run is rematerialized on its own:
    alone in its list, its class becomes ``remat_class(cls, policy, static_argnames, applied)``; left out of
    every run at call time, it runs ``run_block(block, original, policy, static_argnames, args, kwargs)``
    (:mod:`remat_kit.unedited.nnx`'s, which imports this module).

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
            at = next((i for i, k in enumerate(kinds) if _same(k, kind)), None)
            if at is None:
                at, kinds = len(kinds), [*kinds, kind]
            object.__setattr__(block, "_remat_kit_mark", _Mark(parent, path[len(parent) :], at, order[id(block)]))
        for _, block in group:  # after every kind was read: the class is part of a graph
            block.__class__ = _block_class(type(block), plan, run_block)
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
            if todo.next < len(todo.run.rels):
                raise ValueError(
                    f"scan=True: {type(self).__name__} called {todo.next} of the {len(todo.run.rels)} blocks "
                    f"{join(todo.run.rels[0])} .. {join(todo.run.rels[-1])} it was traced calling; a model that "
                    "skips blocks cannot be scanned unedited (use scan=False)"
                )
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
        start = 0
        while start < len(group):
            covered, period = _period(group[start:], lambda a, b: a[0].kind == b[0].kind and a[1].same(b[1]))
            if not covered:
                start += 1
                continue
            part = group[start : start + covered]
            for m, c, arrays in part[1:]:
                _check_shared(f"{where}'s block {join(m.rel)}", join(part[0][0].rel), c, part[0][2], arrays)
            run = NnxRun(tuple(m.rel for m, *_ in part), period, tuple(c for _, c, _ in part[:period]))
            runs.update({m.rel: (run, k) for k, (m, *_) in enumerate(part)})
            start += covered
    if not runs:
        names = "; ".join(f"{join(m.rel)} ({c.describe()})" for m, c, _ in blocks)
        raise ValueError(
            f"scan=True: no two consecutive blocks of {where} are identical, nor do they repeat a period of blocks "
            f"(same class, attributes, parameter shapes and static arguments): {names}; use scan=False"
        )
    return runs


@dataclasses.dataclass
class _Pending:
    run: NnxRun
    outs: tuple  # per position: [periods, ...] stacked outputs
    last: Any  # the next block's input in the output handed to the model most recently
    next: int
    carry_at: tuple  # per position: where the next block's input is in the output (:func:`_carry_at`)
    arrays: tuple  # the first block's array arguments but its input: (positional ones, keyword ones)

    def at(self, k: int) -> Any:
        return jax.tree.map(lambda a: a[k // self.run.period], self.outs[k % self.run.period])


def _block_class(cls: type, plan: Plan, run_block: Callable) -> type:
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
            return run_block(self, original, policy, plan.static_argnames, args, kwargs)
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
            out, outs, carry_at = _scan(layers, originals, plan, run, args[0], rest)
            state.pending[mark.rel] = _Pending(run, outs, _take(out, carry_at[0]), 1, carry_at, rest)
            return out
        pending = state.pending.get(run.rels[0])
        if pending is None or pending.next != k:
            raise ValueError(f"scan=True: block {join(mark.rel)} ran out of order; use scan=False")
        if not args or args[0] is not pending.last:
            raise ValueError(
                f"scan=True: block {join(mark.rel)} is not called with block {join(run.rels[k - 1])}'s output (the "
                "model runs code between its blocks); use scan=False"
            )
        _check_shared(where, join(run.rels[0]), call, pending.arrays, (dyn_args[1:], dyn_kwargs), skip_input=False)
        out = pending.at(k)
        pending.last = _take(out, pending.carry_at[k % run.period])
        pending.next = k + 1
        return out

    # _remat_kit_policy: compare/auto refuse a model that runs a policy of its own (inspection.refuse_baked_nnx).
    return _subclass("block", cls, __call__, (plan, run_block), _remat_kit_policy=plan.policy)


def _scan(layers: list[nnx.Module], originals: list, plan: Plan, run: NnxRun, x, rest: tuple):
    """Run ``layers`` (a run repeating a period) on ``x`` as one scan; write their updated state back.

    ``rest``: the array arguments but the input, ``(positional ones, keyword ones)``, the same for every
    block (positions, an attention mask, segment ids): closed over by the scan.

    Returns:
      ``(the first block's output, each position's outputs stacked over the periods, each position's
      place of the next block's input in its output)`` (:func:`_carry_at`).
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
        y = call_naming_submodules(originals[j], layer, args, kwargs)
        out_at[j] = _carry_at(y, h, f"{type(layers[j]).__name__} block {join(run.rels[j])}")
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
            return (_take(y, out_at[j]), new_carry), (y, new_stack)

        return step

    policy, positions = plan.policy, None
    if policy.tags:
        emitted = []
        for j in range(period):
            first = [a[0] for a in stacked[j]]
            call = functools.partial(layer_call, j)
            _, jaxpr = _jax_internals.name_param_matmuls(call, names(j, x, carry0), first, x, carry0)
            emitted.append(frozenset(t for t, *_ in _jax_internals.jaxpr_tags(jaxpr)))
        where = [f"{type(layers[j]).__name__} block {join(run.rels[j])}" for j in range(period)]
        if isinstance(policy, Policy) and policy.plan(len(layers) // period).mode == "layer":
            positions = [_resolved(policy, emitted[j], where[j]) for j in range(period)]
        else:
            policy = _resolved(policy, frozenset().union(*emitted), where[0])
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
    return jax.tree.map(lambda a: a[0], outs[0]), outs, tuple(out_at[j] for j in range(period))


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


def _identical(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same arrays (the same objects, in the same structure)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(x is y for x, y in zip(la, lb, strict=True))


def _check_shared(where: str, first: str, call: Call, first_arrays: tuple, arrays: tuple, skip_input=True) -> None:
    """A later block of a run gets the first block's array arguments (but the input): else a ValueError naming one.

    Args:
      where: the later block, for the message; first: the first block's path.
      call: the later block's :class:`Call` (its holes name the arrays).
      first_arrays, arrays: ``(positional arrays, keyword arrays)`` of the first and the later block;
        ``skip_input``: they start with the input (not compared).
    """
    (fa, fk), (oa, ok) = first_arrays, arrays
    if skip_input:
        fa, oa = fa[1:], oa[1:]
    names = call.hole_names()[1:]  # without the input
    differing = [n for n, a, b in zip(names, fa, oa, strict=False) if not _identical(a, b)]
    differing += [k for k in sorted({*fk, *ok}) if k not in fk or k not in ok or not _identical(fk[k], ok[k])]
    if len(fa) != len(oa):
        differing.append(names[min(len(fa), len(oa))] if min(len(fa), len(oa)) < len(names) else "argument")
    name = differing[0] if differing else None
    if name is not None:
        raise ValueError(
            f"scan=True: {where} gets its own {name}= (not {first}'s array), and one scan shares every block "
            "argument but the input: a per-layer KV cache or mask cannot be scanned unedited; use scan=False"
        )


def _carry_at(y: Any, h: Any, where: str) -> int | None:
    """Where the next block's input is in a block's output ``y``: None (all of it) or its index in a tuple.

    gm.nn's and tunix's blocks return ``(cache, x)`` (the cache None in training): the scan carries ``x``
    and stacks the rest.

    >>> import jax.numpy as jnp
    >>> h = jnp.ones(3)
    >>> _carry_at(h, h, "b"), _carry_at((None, h), h, "b"), _carry_at(({"k": jnp.ones(2)}, h, 1), h, "b")
    (None, 1, 1)
    """
    want = _shapes(h)
    if _shapes(y) == want:
        return None
    if isinstance(y, (tuple, list)):
        at = [i for i, part in enumerate(y) if not is_static(part) and _shapes(part) == want]
        if len(at) == 1:
            return at[0]
    raise ValueError(
        f"scan=True: {where} returns {_describe(y)}, neither its input's shape and dtype {_describe(h)} nor a tuple "
        "holding exactly one such value, so its output cannot feed the next block in one scan; use scan=False"
    )


def _take(y: Any, at: int | None) -> Any:
    """The next block's input in a block's output (see :func:`_carry_at`)."""
    return y if at is None else y[at]


def _describe(tree: Any) -> str:
    """A value's structure with arrays as ``float32[2,8,16]`` (for messages)."""

    def one(a):
        return f"{jnp.result_type(a)}[{','.join(map(str, jnp.shape(a)))}]"

    if isinstance(tree, tuple):
        return "(" + ", ".join(_describe(t) for t in tree) + ("," if len(tree) == 1 else "") + ")"
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return repr(tree)
    if isinstance(tree, (jax.Array, np.ndarray)):
        return one(tree)
    return str(jax.tree.map(one, tree))


def _leaf_variables(layer: nnx.Module) -> list:
    """The Variable behind each leaf of ``nnx.state(layer)``, in leaf order."""
    return [_get(layer, state_keys(p)) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(layer))[0]]


# ---- Linen --------------------------------------------------------------------------------------------


def _config(module: nn.Module) -> dict:
    """A Linen module's attributes (its dataclass fields but ``parent``/``name``)."""
    return {
        f.name: getattr(module, f.name, None) for f in dataclasses.fields(module) if f.name not in ("parent", "name")
    }


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an array among the attributes: ambiguous, so not provably the same
        return False


class _Hole:
    """Where a call template has an array argument (the same for every block of a run)."""

    def __repr__(self) -> str:
        return "<array>"


_HOLE = _Hole()


@dataclasses.dataclass(frozen=True)
class Call:
    """One block call's arguments with every array argument replaced by a hole: what a scan cannot vary.

    Attributes:
      args, kwargs: the positional arguments and the ``(name, value)`` keyword pairs, holes for arrays.
      names: the positional parameter names of the block's ``__call__`` (for messages).
    """

    args: tuple
    kwargs: tuple
    names: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def same(self, other: Call) -> bool:
        """The same static arguments and holes in the same places."""
        return _same((self.args, self.kwargs), (other.args, other.kwargs))

    def fill(self, arrays: tuple, array_kwargs: dict) -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` with the holes filled in order from ``arrays``/``array_kwargs``."""
        it = iter(arrays)
        args = tuple(next(it) if a is _HOLE else a for a in self.args)
        return args, {k: array_kwargs[k] if v is _HOLE else v for k, v in self.kwargs}

    def hole_names(self) -> tuple[str, ...]:
        """The names of the array arguments, in order: positional ones, then keyword ones.

        >>> Call((_HOLE, True, _HOLE), (("mask", _HOLE),), ("x", "is_local", "positions")).hole_names()
        ('x', 'positions', 'mask')
        """
        named = [self.names[i] if i < len(self.names) else f"argument {i}" for i, a in enumerate(self.args)]
        return tuple(n for n, a in zip(named, self.args, strict=True) if a is _HOLE) + tuple(
            k for k, v in self.kwargs if v is _HOLE
        )

    def describe(self) -> str:
        """The static arguments, named: ``is_local=True, deterministic=False``."""
        named = [f"{self.names[i] if i < len(self.names) else i}={a!r}" for i, a in enumerate(self.args)]
        return ", ".join(
            [n for n, a in zip(named, self.args, strict=True) if a is not _HOLE]
            + [f"{k}={v!r}" for k, v in self.kwargs if v is not _HOLE]
        )


def template(fn: Any, args: tuple, kwargs: dict, static_argnames: frozenset[str]) -> Call:
    """A block call's :class:`Call`: its static arguments (as :func:`remat_kit.apply` splits them), holes for arrays.

    >>> import jax.numpy as jnp, flax.linen as nn
    >>> class B(nn.Module):
    ...     def __call__(self, x, is_local, deterministic=True):
    ...         return x
    >>> template(B.__call__, (jnp.ones(2), True), {"deterministic": False}, frozenset()).describe()
    'is_local=True, deterministic=False'
    """
    rebuild, dyn_args, dyn_kwargs = split_static(fn, args, kwargs, static_argnames, is_static)
    full_args, full_kwargs = rebuild((_HOLE,) * len(dyn_args), dict.fromkeys(dyn_kwargs, _HOLE))
    try:
        names = tuple(_inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):
        names = ()
    return Call(full_args, tuple(sorted(full_kwargs.items(), key=lambda kv: kv[0])), names)


@dataclasses.dataclass(frozen=True)
class LinenRun:
    """Blocks under one parent that repeat a period of ``period`` block calls: run as one scan.

    Attributes:
      paths: every block of the run, in call order (``len(paths)`` a multiple of ``period``).
      period: the blocks in one period (1: identical blocks).
      modules: the discovery trace's module of each position of the period (its class and attributes).
      calls: each position's :class:`Call` (its static arguments).
    """

    paths: tuple[tuple, ...]
    period: int
    modules: tuple
    calls: tuple[Call, ...]


def _period(kinds: list, same) -> tuple[int, int]:
    """``(covered, period)``: the period repeating at least twice from ``kinds[0]`` over the most blocks.

    >>> _period(list("ababa"), str.__eq__), _period(list("aaab"), str.__eq__), _period(list("ab"), str.__eq__)
    ((4, 2), (3, 1), (0, 0))
    """
    best = (0, 0)
    for period in range(1, len(kinds) // 2 + 1):
        end = period
        while end < len(kinds) and same(kinds[end], kinds[end - period]):
            end += 1
        covered = end // period * period
        if covered >= 2 * period and covered > best[0]:
            best = (covered, period)
    return best


def linen_runs(found: list[tuple[tuple, type, Any]], calls: list[Call], matcher) -> dict[tuple, LinenRun]:
    """The runs of blocks that repeat a period (one block, or Gemma 3's local/global ones) in one trace.

    Blocks under one parent, called one after the other, form a run where their calls (class,
    attributes and static arguments) repeat a period at least twice; the period covering the most blocks
    wins (the shortest among equals). Blocks after it (a remainder that breaks the period) start the next
    run, or run one by one under the policy.

    Args:
      found: ``(path, class, module)`` of every module call, in call order (the discovery trace).
      calls: each of those calls' :class:`Call`.
      matcher: the blocks (a :class:`remat_kit.unedited.paths.Where`).

    Returns:
      ``{first block's path: its LinenRun}`` for every run.

    Raises:
      ValueError: no run at all, naming each block with its class and static arguments.
    """
    blocks = []
    for (path, cls, module), call in zip(found, calls, strict=True):
        if path and matcher(module, join(path)) and not any(path[: len(p)] == p and p != path for p, *_ in blocks):
            blocks.append((path, cls, module, call))
    seen = [p for p, *_ in blocks]
    blocks = [b for b in blocks if seen.count(b[0]) == 1]  # a block called twice is not scanned

    def same(a, b) -> bool:
        return a[1] is b[1] and _same(_config(a[2]), _config(b[2])) and a[3].same(b[3])

    siblings: list[list] = []
    for block in blocks:
        if siblings and siblings[-1][-1][0][:-1] == block[0][:-1]:
            siblings[-1].append(block)
        else:
            siblings.append([block])
    runs = {}
    for group in siblings:
        start = 0
        while start < len(group):
            covered, period = _period(group[start:], same)
            if not covered:
                start += 1
                continue
            part = group[start : start + covered]
            runs[part[0][0]] = LinenRun(
                tuple(p for p, *_ in part),
                period,
                tuple(m for _, _, m, _ in part[:period]),
                tuple(c for *_, c in part[:period]),
            )
            start += covered
    if not runs:
        names = "; ".join(f"{join(p)} ({c.__name__}: {call.describe()})" for p, c, _, call in blocks)
        raise ValueError(
            "scan=True: no two consecutive blocks are identical, nor do they repeat a period of blocks (same "
            f"parent, class, attributes and static arguments): {names}; use scan=False"
        )
    return runs


@dataclasses.dataclass
class _LinenPending:
    run: LinenRun
    outs: tuple  # per position: [periods, ...] stacked outputs
    mutated: tuple  # per position: [periods, ...] stacked collections the blocks wrote
    last: Any  # the next block's input in the output handed to the model most recently
    arrays: tuple  # the first block's array arguments but its input, and its array keyword arguments
    next: int
    carry_at: tuple = ()  # per position: where the next block's input is in the output (:func:`_carry_at`)

    def at(self, k: int) -> tuple[Any, Any]:
        """Block ``k``'s output and what it wrote."""
        j, u = k % self.run.period, k // self.run.period
        return jax.tree.map(lambda a: a[u], self.outs[j]), jax.tree.map(lambda a: a[u], self.mutated[j])


def linen_run(run, found: list[tuple[tuple, type, Any]], calls: list[Call], fallback) -> None:
    """Make ``run`` (one ``init``/``apply`` of a Linen ``Applied``) scan each run of blocks that repeat a period.

    The interceptor calls ``run.scan_block(module, path, next_fun, args, kwargs)`` for every block;
    a block in no run goes to ``fallback`` (the per-block remat); :func:`linen_finish` checks, after
    the call, that every run ran whole.
    """
    runs = linen_runs(found, calls, run.matcher)
    first_of = {p: first for first, r in runs.items() for p in r.paths}
    pending: dict[tuple, _LinenPending] = {}

    def scan_block(module, path, next_fun, args, kwargs):
        if path not in first_of:
            return fallback(run, module, path, next_fun, args, kwargs)
        first = first_of[path]
        if path == first:
            out, todo = _linen_scan(run, module, runs[first], args, kwargs)
            pending[first] = todo
            return out
        return _linen_follow(run, module, path, runs[first], pending.get(first), args, kwargs)

    run.scan_block = scan_block
    run.scan_pending = pending


def linen_finish(run) -> None:
    """After the model's call: every run of blocks ran whole (a model that skips blocks is an error)."""
    for todo in getattr(run, "scan_pending", {}).values():
        paths = todo.run.paths
        if todo.next < len(paths):
            raise ValueError(
                f"scan=True: the model called {todo.next} of the {len(paths)} blocks {join(paths[0])} .. "
                f"{join(paths[-1])} it was traced calling; a model that skips blocks cannot be scanned unedited "
                "(use scan=False)"
            )


def _write_back(module: nn.Module, mutated: dict) -> None:
    for col, tree in mutated.items():
        for name, value in tree.items():
            module.scope.put_variable(col, name, value)


def _arrays(cls: type, args: tuple, kwargs: dict, static_argnames: frozenset[str]) -> tuple[tuple, dict]:
    """A block call's array arguments: ``(positional ones, keyword ones)``."""
    _, dyn_args, dyn_kwargs = split_static(cls.__call__, args, kwargs, static_argnames, is_static)
    return dyn_args, dyn_kwargs


def _linen_follow(run, module, path, spec: LinenRun, todo: _LinenPending | None, args, kwargs):
    k = spec.paths.index(path)
    if todo is None or todo.next != k:
        raise ValueError(f"scan=True: block {join(path)} ran out of order; use scan=False")
    if not args or args[0] is not todo.last:
        raise ValueError(
            f"scan=True: block {join(path)} is not called with block {join(spec.paths[k - 1])}'s output (the model "
            "runs code between its blocks); use scan=False"
        )
    statics = run.plan.static_argnames
    expected = spec.calls[k % spec.period]
    call = template(type(module).__call__, args, kwargs, statics)
    if not call.same(expected):
        raise ValueError(
            f"scan=True: block {join(path)} is called with {call.describe()}, not {expected.describe()} as when the "
            "model was traced; use scan=False"
        )
    dyn_args, dyn_kwargs = _arrays(type(module), args, kwargs, statics)
    where = f"{type(module).__name__} block {join(path)}"
    _check_shared(where, join(spec.paths[0]), call, todo.arrays, (dyn_args[1:], dyn_kwargs), skip_input=False)
    out, mutated = todo.at(k)
    todo.last = _take(out, todo.carry_at[k % spec.period])
    todo.next = k + 1
    _write_back(module, mutated)
    return out


def _shapes(tree: Any) -> Any:
    return jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), tree)


def _resolved(policy: Policy | Mix, emitted: frozenset[str], where: str) -> Policy | Mix:
    """``policy`` (each part of a mix) with its names checked and its patterns expanded against ``emitted``."""
    if isinstance(policy, Mix):
        return Mix(tuple((_resolved(p, emitted, where), n) for p, n in policy.parts))
    if not policy.tags:
        return policy
    policy = tags.resolve(policy, emitted, where)
    tags.check(policy, emitted, where)
    return policy


def _linen_scan(run, module: nn.Module, spec: LinenRun, args: tuple, kwargs: dict):
    """Run the blocks of ``spec`` (``module`` is the first) as one scan; (its output, what the others return)."""
    # Long: the checks that the blocks can share one scan read the same call templates the scan then runs.
    paths, period = spec.paths, spec.period
    where = f"{type(module).__name__} block {join(paths[0])}"
    statics = run.plan.static_argnames
    if not args or is_static(args[0]):
        raise ValueError(f"scan=True: {where} takes no array input as its first argument; use scan=False")
    call = template(type(module).__call__, args, kwargs, statics)
    if not call.same(spec.calls[0]):
        raise ValueError(
            f"scan=True: {where} is called with {call.describe()}, not {spec.calls[0].describe()} as when the model "
            "was traced; use scan=False"
        )
    dyn_args, dyn_kwargs = _arrays(type(module), args, kwargs, statics)
    rest = dyn_args[1:]
    holes = [(sum(a is _HOLE for a in c.args), tuple(k for k, v in c.kwargs if v is _HOLE)) for c in spec.calls]
    for j, h in enumerate(holes[1:], start=1):
        if h != holes[0]:
            raise ValueError(
                f"scan=True: blocks {join(paths[0])} and {join(paths[j])} take array arguments in different places, "
                "so one set of arrays cannot reach both; use scan=False"
            )
    x = dyn_args[0]
    names = [p[-1] for p in paths]
    variables = module.parent.variables
    per_layer = [{col: tree[name] for col, tree in variables.items() if name in tree} for name in names]
    for i, (name, layer) in enumerate(zip(names, per_layer, strict=True)):
        like = per_layer[i % period]
        if jax.tree.structure(layer) != jax.tree.structure(like) or _shapes(layer) != _shapes(like):
            cols = sorted(c for c in {*layer, *like} if _shapes(layer.get(c)) != _shapes(like.get(c)))
            raise ValueError(
                f"scan=True: blocks {names[i % period]} and {name} hold differently shaped variables in "
                f"{', '.join(cols)}, which cannot be stacked; use scan=False"
            )
    stacked = [jax.tree.map(lambda *a: jnp.stack(a), *per_layer[j::period]) for j in range(period)]
    rngs, prefixes = _jax_internals.linen_block_rngs(module.scope, names)
    mutable = module.scope.mutable
    blocks = [module.clone(parent=None)] + [m.clone(parent=None) for m in spec.modules[1:]]

    def leaf_names(tree) -> list:
        return [
            join(keys[1:]) if keys and keys[0] == "params" else None
            for keys in (state_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
        ]

    out_at: dict[int, int | None] = {}

    def layer_call(j, layer_vars, h, i):
        full_args, full_kwargs = spec.calls[j].fill((_layers.tag_input(h), *rest), dyn_kwargs)  # the layer input
        outer = run.block
        run.block, run.entering = (), True  # the layer's submodules are named by their path in it
        try:
            with _jax_internals.linen_layer_rngs(prefixes, i):
                res = blocks[j].apply(dict(layer_vars), *full_args, rngs=rngs, mutable=mutable, **full_kwargs)
        finally:
            run.block, run.entering = outer, False
        y, mutated = res if mutable is not False else (res, {})
        # Parameters are read, never written, in apply: not returned (no stacked copy of them).
        mutated = {c: dict(t) for c, t in dict(mutated).items() if c != "params"}
        out_at[j] = _carry_at(y, h, f"{type(blocks[j]).__name__} block {join(paths[j])}")
        return y, mutated

    param_names = [leaf_names(tree) for tree in stacked]  # the same paths as one layer's

    def names_for(j, h):
        return param_names[j] + [None] * (len(jax.tree.leaves(h)) + 1)

    def make_step(j):
        def step(layer_vars, h, i):
            call = functools.partial(layer_call, j)
            named, _ = _jax_internals.name_param_matmuls(call, names_for(j, h), layer_vars, h, i)
            y, mutated = named(layer_vars, h, i)
            return _take(y, out_at[j]), (y, mutated)

        return step

    policy, positions = run.plan.policy, None
    if policy.tags:
        emitted = []
        for j in range(period):
            first = jax.tree.map(lambda a: a[0], stacked[j])
            call = functools.partial(layer_call, j)
            _, jaxpr = _jax_internals.name_param_matmuls(call, names_for(j, x), first, x, jnp.int32(j))
            emitted.append(frozenset(t for t, *_ in _jax_internals.jaxpr_tags(jaxpr)))
        if isinstance(policy, Policy) and policy.plan(len(paths) // period).mode == "layer":
            # Each block of the period is rematerialized on its own: its names are its own.
            positions = [
                _resolved(policy, emitted[j], f"{type(blocks[j]).__name__} block {join(paths[j])}")
                for j in range(period)
            ]
        else:
            policy = _resolved(policy, frozenset().union(*emitted), where)
    steps = [make_step(j) for j in range(period)]
    _, ys = _layers.run_periods(policy, len(paths) // period, steps, stacked, x, positions)
    carry_at = tuple(out_at[j] for j in range(period))
    todo = _LinenPending(spec, tuple(y[0] for y in ys), tuple(y[1] for y in ys), None, (rest, dyn_kwargs), 1, carry_at)
    out, mutated = todo.at(0)
    todo.last = _take(out, carry_at[0])
    _write_back(module, mutated)
    return out, todo
