"""``remat_kit.apply(..., scan=True)`` for NNX: consecutive identical blocks of an unedited model as one scan.

XLA:CPU strips the recompute out of a Python loop of rematerialized blocks (CSE), so a loop model's
compiled memory does not drop however little the policy keeps; under a ``lax.scan`` it does. The
model's code still loops (``for layer in self.layers: x = layer(x)``): the first block of a run of
identical ones computes the whole run as one scan over the blocks' stacked state (stacked inside the
call: the model's own layout, hence its checkpoints, is unchanged) and returns its own output; each
later block checks that it is called with the previous block's output and the same static arguments
and returns its precomputed output. Anything else (code between the calls, other arguments) is a
ValueError saying why the model cannot be scanned unedited. State shared by every block (one
``nnx.Rngs`` stream held by every Dropout) is carried through the scan, so RNG draws match the loop.

Linen models run the same way (:func:`linen_run`): a run is consecutive calls of blocks of one class
with equal attributes under one parent; the first reads every block's variables from the parent
(the model's own tree), stacks them, and scans one functional ``apply`` of the block over them.
Array arguments besides the input must be the same for every block (they are broadcast); RNG
streams draw each layer's plain key (derived from its path, as Flax does:
:func:`remat_kit._jax_internals.linen_block_rngs`); mutable collections the blocks write (``sow``,
``batch_stats``, a cache) come out stacked and are written back into each block's own scope.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from remat_kit import _jax_internals, _layers, tags
from remat_kit._unedited import Plan, call_naming_submodules, split_static
from remat_kit.pathnames import join, state_keys
from remat_kit.wrap_nnx import is_static

#: The parent module whose call is running (where a run's first block finds the others).
_PARENT: contextvars.ContextVar[Any] = contextvars.ContextVar("remat_kit_scan_parent", default=None)
#: Precomputed outputs awaiting the later blocks of a run: id(first block) -> _Pending.
_PENDING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("remat_kit_scan_pending", default=None)


@dataclasses.dataclass
class _Pending:
    outs: Any  # [n, ...] stacked outputs
    last: Any  # the output handed to the model most recently
    statics: Any
    next: int
    count: int


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


def runs(model: nnx.Module, found: list[tuple[tuple, nnx.Module]]) -> list[list[tuple[tuple, nnx.Module]]]:
    """Split the blocks into runs of consecutive identical ones (same container, class and state shapes)."""
    out: list[list] = []
    for path, block in found:
        prev = out[-1][-1] if out else None
        same = (
            prev is not None
            and path[:-1] == prev[0][:-1]
            and isinstance(path[-1], int)
            and isinstance(prev[0][-1], int)
            and path[-1] == prev[0][-1] + 1
            and nnx.graphdef(block) == nnx.graphdef(prev[1])
            and jax.tree.map(jnp.shape, nnx.state(block)) == jax.tree.map(jnp.shape, nnx.state(prev[1]))
        )
        if same:
            out[-1].append((path, block))
        else:
            out.append([(path, block)])
    return out


def nnx_scan(model: nnx.Module, plan: Plan, found: list[tuple[tuple, nnx.Module]]) -> nnx.Module:
    """Make each run of identical blocks of ``model`` (a copy) run as one scan under ``plan.policy``.

    Raises:
      ValueError: no two consecutive blocks are identical (nothing to scan), naming how they differ.
    """
    groups = runs(model, found)
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
            f"scan=True: no two consecutive blocks are identical (same list, class and parameter shapes): {names}; "
            "use scan=False"
        )
    parents = set()
    for group in groups:
        if len(group) < 2:
            continue
        parent = _parent_path(model, group[0][0])
        parents.add(parent)
        rel = tuple(p[len(parent) :] for p, _ in group)
        first = group[0][1]
        object.__setattr__(first, "_remat_kit_run", rel)
        first.__class__ = _first_class(type(first), plan)
        for k, (_, block) in enumerate(group[1:], start=1):
            object.__setattr__(block, "_remat_kit_follow", (rel[0], k))
            block.__class__ = _follower_class(type(block))
    for parent in parents:
        node = _get(model, parent)
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


def _parent_class(cls: type) -> type:
    original = cls.__call__

    def __call__(self, *args, **kwargs):
        t1, t2 = _PARENT.set(self), _PENDING.set({})
        try:
            out = original(self, *args, **kwargs)
            left = [p for p in _PENDING.get().values() if p.next < p.count]
        finally:
            _PARENT.reset(t1)
            _PENDING.reset(t2)
        if left:
            raise ValueError(
                f"scan=True: {type(self).__name__} called {left[0].next} of the {left[0].count} identical blocks "
                "it holds; a model that skips blocks cannot be scanned unedited (use scan=False)"
            )
        return out

    return _subclass("parent", cls, __call__)


def _follower_class(cls: type) -> type:
    def __call__(self, x, *args, **kwargs):
        first, k = self._remat_kit_follow
        pending = (_PENDING.get() or {}).get(first)
        if pending is None or pending.next != k:
            raise ValueError(f"scan=True: block {join(first[:-1])}/{k} ran out of order; use scan=False")
        if x is not pending.last or (args, kwargs) != pending.statics:
            raise ValueError(
                f"scan=True: block {k} is not called with block {k - 1}'s output and the same other arguments "
                "(the model runs code between its blocks, or passes each its own flags); use scan=False"
            )
        pending.last = jax.tree.map(lambda a: a[k], pending.outs)
        pending.next = k + 1
        return pending.last

    return _subclass("follow", cls, __call__)


def _first_class(cls: type, plan: Plan) -> type:
    original = cls.__mro__[0].__call__

    def __call__(self, x, *args, **kwargs):
        parent = _PARENT.get()
        rel = self._remat_kit_run
        if parent is None:
            raise ValueError("scan=True: the blocks were called outside their parent module's __call__")
        if not all(is_static(a) for a in (args, kwargs)):
            raise ValueError(
                "scan=True: the blocks take array arguments besides the input; only Python flags can be shared"
            )
        layers = [_get(parent, p) for p in rel]
        out, outs = _scan(layers, original, plan, x, args, kwargs)
        _PENDING.get()[rel[0]] = _Pending(outs, out, (args, kwargs), 1, len(layers))
        return out

    # _remat_kit_policy: compare/auto refuse a model that runs a policy of its own (inspection.refuse_baked_nnx).
    return _subclass("first", cls, __call__, (plan,), _remat_kit_policy=plan.policy)


def _scan(layers: list[nnx.Module], original, plan: Plan, x, args: tuple, kwargs: dict):
    """Run ``layers`` on ``x`` as one scan; write their updated state back; (first output, all outputs)."""
    graphdef = nnx.graphdef(layers[0])
    treedef = jax.tree.structure(nnx.state(layers[0]))
    leaves = [jax.tree.leaves(nnx.state(layer)) for layer in layers]
    # A Variable held by every layer (a shared RNG stream) is carried through the scan, the others stacked.
    held = [_leaf_variables(layer) for layer in layers]
    shared = set.intersection(*[{id(v) for v in vs} for vs in held])
    carried = [id(v) in shared for v in held[0]]
    is_param = [isinstance(v, nnx.Param) for v in held[0]]
    names = [join(state_keys(p)) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(layers[0]))[0]]
    stacked = [jnp.stack([lv[j] for lv in leaves]) for j in range(len(carried)) if not carried[j]]
    carry0 = [leaves[0][j] for j in range(len(carried)) if carried[j]]
    stack_names = [names[j] if is_param[j] else None for j in range(len(carried)) if not carried[j]]
    keypaths = [p for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(layers[0]))[0]]
    carried_paths = [tuple(state_keys(keypaths[j])) for j in range(len(carried)) if carried[j]]

    def layer_call(layer_stack, h, carry):
        it_s, it_c = iter(layer_stack), iter(carry)
        full = [next(it_c) if carried[j] else next(it_s) for j in range(len(carried))]
        layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, full))
        y = call_naming_submodules(original, layer, (h, *args), kwargs)
        # By path, not position: the call may add variables (a first sow), shifting the leaves after them.
        new = dict(nnx.to_flat_state(nnx.state(layer)))
        return y, [new.pop(p).get_value() for p in carried_paths], nnx.from_flat_state(new)

    def step(layer_stack, hc, i):
        h, carry = hc
        names_all = stack_names + [None] * (len(jax.tree.leaves(h)) + len(carry))
        named, _ = _jax_internals.name_param_matmuls(layer_call, names_all, layer_stack, h, carry)
        y, new_carry, new_stack = named(layer_stack, h, carry)
        return (y, new_carry), (y, new_stack)

    policy = plan.policy
    if policy.tags:
        first = [a[0] for a in stacked]
        _, jaxpr = _jax_internals.name_param_matmuls(
            layer_call, stack_names + [None] * (len(jax.tree.leaves(x)) + len(carry0)), first, x, carry0
        )
        emitted = frozenset(t for t, *_ in _jax_internals.jaxpr_tags(jaxpr))
        where = f"{type(layers[0]).__name__} block"
        policy = tags.resolve(policy, emitted, where)
        tags.check(policy, emitted, where)
    (_, carry), (outs, new_stack) = _layers.run(policy, len(layers), step, stacked, (x, carry0))
    for k, layer in enumerate(layers):
        nnx.update(layer, jax.tree.map(lambda a, k=k: a[k], new_stack))  # sown values included, each its own
    for variable, value in zip([v for v, c in zip(held[0], carried, strict=True) if c], carry, strict=True):
        variable.set_value(value)
    return jax.tree.map(lambda a: a[0], outs), outs


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


def linen_runs(found: list[tuple[tuple, type, Any]], matcher) -> dict[tuple, tuple[tuple, ...]]:
    """The runs of consecutive identical blocks among the module calls of one trace.

    Args:
      found: ``(path, class, module)`` of every module call, in call order (the discovery trace).
      matcher: the blocks (a :class:`remat_kit.pathnames.Where`).

    Returns:
      ``{first block's path: paths of the run}`` for every run of two or more blocks.

    Raises:
      ValueError: no two consecutive blocks are identical, naming the blocks.
    """
    calls = []
    for path, cls, module in found:
        if path and matcher(module, join(path)) and not any(path[: len(p)] == p and p != path for p, *_ in calls):
            calls.append((path, cls, module))
    seen = [p for p, *_ in calls]
    blocks = [(p, c, m) for p, c, m in calls if seen.count(p) == 1]  # a block called twice is not scanned
    groups: list[list] = []
    for path, cls, module in blocks:
        prev = groups[-1][-1] if groups else None
        if (
            prev is not None
            and prev[0][:-1] == path[:-1]
            and prev[1] is cls
            and _same(_config(prev[2]), _config(module))
        ):
            groups[-1].append((path, cls, module))
        else:
            groups.append([(path, cls, module)])
    runs = {g[0][0]: tuple(p for p, *_ in g) for g in groups if len(g) > 1}
    if not runs:
        names = ", ".join(f"{join(p)} ({c.__name__})" for p, c, _ in calls)
        raise ValueError(
            f"scan=True: no two consecutive blocks are identical (same parent, class and attributes): {names}; "
            "use scan=False"
        )
    return runs


@dataclasses.dataclass
class _LinenPending:
    paths: tuple[tuple, ...]
    outs: Any  # [n, ...] stacked outputs
    mutated: Any  # [n, ...] stacked collections the blocks wrote
    last: Any
    statics: Any  # the first block's call arguments but its input
    next: int


def linen_run(run, found: list[tuple[tuple, type, Any]], fallback) -> None:
    """Make ``run`` (one ``init``/``apply`` of a Linen ``Applied``) scan each run of identical blocks.

    The interceptor calls ``run.scan_block(module, path, next_fun, args, kwargs)`` for every block;
    a block in no run goes to ``fallback`` (the per-block remat); :func:`linen_finish` checks, after
    the call, that every run ran whole.
    """
    runs = linen_runs(found, run.matcher)
    first_of = {p: first for first, paths in runs.items() for p in paths}
    pending: dict[tuple, _LinenPending] = {}

    def scan_block(module, path, next_fun, args, kwargs):
        if path not in first_of:
            return fallback(run, module, path, next_fun, args, kwargs)
        first = first_of[path]
        if path == first:
            out, todo = _linen_scan(run, module, runs[first], args, kwargs)
            pending[first] = todo
            return out
        return _linen_follow(module, path, pending.get(first), args, kwargs)

    run.scan_block = scan_block
    run.scan_pending = pending


def linen_finish(run) -> None:
    """After the model's call: every run of blocks ran whole (a model that skips blocks is an error)."""
    for todo in getattr(run, "scan_pending", {}).values():
        if todo.next < len(todo.paths):
            raise ValueError(
                f"scan=True: the model called {todo.next} of the {len(todo.paths)} identical blocks "
                f"{join(todo.paths[0])} .. {join(todo.paths[-1])}; a model that skips blocks cannot be scanned "
                "unedited (use scan=False)"
            )


def _write_back(module: nn.Module, mutated: dict) -> None:
    for col, tree in mutated.items():
        for name, value in tree.items():
            module.scope.put_variable(col, name, value)


def _linen_follow(module, path, todo: _LinenPending | None, args, kwargs):
    k = todo.paths.index(path) if todo is not None else -1
    if todo is None or todo.next != k:
        raise ValueError(f"scan=True: block {join(path)} ran out of order; use scan=False")
    same_rest = len(args) == len(todo.statics[0]) + 1 and all(
        a is b or (_is_static(a) and _same(a, b)) for a, b in zip(args[1:], todo.statics[0], strict=True)
    )
    same_kw = kwargs.keys() == todo.statics[1].keys() and all(
        kwargs[n] is todo.statics[1][n] or (_is_static(kwargs[n]) and _same(kwargs[n], todo.statics[1][n]))
        for n in kwargs
    )
    if not args or args[0] is not todo.last:
        raise ValueError(
            f"scan=True: block {join(path)} is not called with block {join(todo.paths[k - 1])}'s output (the model "
            "runs code between its blocks); use scan=False"
        )
    if not (same_rest and same_kw):
        raise ValueError(
            f"scan=True: block {join(path)} is not called with the same other arguments as {join(todo.paths[0])} "
            "(the model passes each block its own flags, e.g. a per-layer local/global switch, which one scan "
            "cannot vary); use scan=False"
        )
    todo.last = jax.tree.map(lambda a: a[k], todo.outs)
    todo.next = k + 1
    _write_back(module, jax.tree.map(lambda a: a[k], todo.mutated))
    return todo.last


def _is_static(value: Any) -> bool:
    return not any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(value))


def _shapes(tree: Any) -> Any:
    return jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), tree)


def _linen_scan(run, module: nn.Module, paths: tuple[tuple, ...], args: tuple, kwargs: dict):
    """Run the blocks ``paths`` (``module`` is the first) as one scan; (its output, what the others return)."""
    where = f"{type(module).__name__} block {join(paths[0])}"
    if not args or _is_static(args[0]):
        raise ValueError(f"scan=True: {where} takes no array input as its first argument; use scan=False")
    rebuild, dyn_args, dyn_kwargs = split_static(
        type(module).__call__, args, kwargs, run.plan.static_argnames, _is_static
    )
    x, rest = dyn_args[0], dyn_args[1:]
    names = [p[-1] for p in paths]
    variables = module.parent.variables
    per_layer = [{col: tree[name] for col, tree in variables.items() if name in tree} for name in names]
    for name, layer in zip(names[1:], per_layer[1:], strict=True):
        if jax.tree.structure(layer) != jax.tree.structure(per_layer[0]) or _shapes(layer) != _shapes(per_layer[0]):
            cols = sorted(c for c in {*layer, *per_layer[0]} if _shapes(layer.get(c)) != _shapes(per_layer[0].get(c)))
            raise ValueError(
                f"scan=True: blocks {names[0]} and {name} hold differently shaped variables in {', '.join(cols)}, "
                "which cannot be stacked; use scan=False"
            )
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    rngs, prefixes = _jax_internals.linen_block_rngs(module.scope, names)
    mutable = module.scope.mutable
    block = module.clone(parent=None)
    leaf_names = [
        join(keys[1:]) if keys and keys[0] == "params" else None
        for keys in (state_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(stacked)[0])
    ]

    def layer_call(layer_vars, h, i):
        full_args, full_kwargs = rebuild((h, *rest), dyn_kwargs)
        outer = run.block
        run.block, run.entering = (), True  # the layer's submodules are named by their path in it
        try:
            with _jax_internals.linen_layer_rngs(prefixes, i):
                res = block.apply(dict(layer_vars), *full_args, rngs=rngs, mutable=mutable, **full_kwargs)
        finally:
            run.block, run.entering = outer, False
        y, mutated = res if mutable is not False else (res, {})
        # Parameters are read, never written, in apply: not returned (no stacked copy of them).
        mutated = {c: dict(t) for c, t in dict(mutated).items() if c != "params"}
        if _shapes(y) != _shapes(h):
            raise ValueError(
                f"scan=True: {where} returns {_shapes(y)}, not its input's shape and dtype {_shapes(h)}, so its "
                "output cannot feed the next block in one scan; use scan=False"
            )
        return y, mutated

    def names_for(h):
        return leaf_names + [None] * (len(jax.tree.leaves(h)) + 1)

    def step(layer_vars, h, i):
        named, _ = _jax_internals.name_param_matmuls(layer_call, names_for(h), layer_vars, h, i)
        y, mutated = named(layer_vars, h, i)
        return y, (y, mutated)

    policy = run.plan.policy
    if policy.tags:
        first = jax.tree.map(lambda a: a[0], stacked)
        _, jaxpr = _jax_internals.name_param_matmuls(layer_call, names_for(x), first, x, jnp.int32(0))
        emitted = frozenset(t for t, *_ in _jax_internals.jaxpr_tags(jaxpr))
        policy = tags.resolve(policy, emitted, where)
        tags.check(policy, emitted, where)
    _, (outs, mutated) = _layers.run(policy, len(paths), step, stacked, x)
    out = jax.tree.map(lambda a: a[0], outs)
    _write_back(module, jax.tree.map(lambda a: a[0], mutated))
    return out, _LinenPending(paths, outs, mutated, out, (args[1:], kwargs), 1)
