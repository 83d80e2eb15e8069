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
Linen models: not yet (a ValueError says so).
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from remat_kit import _jax_internals, _layers, tags
from remat_kit._unedited import Plan, call_naming_submodules
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


def linen_run(run):
    """Linen models cannot be scanned unedited yet."""
    raise ValueError(
        "scan=True is not supported for Linen models yet (flax derives each layer's RNG keys from its path, "
        "which one scan cannot reproduce); use scan=False, or remat_kit.stack for a model you can edit"
    )


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


def _subclass(kind: str, cls: type, call, key=()) -> type:
    k = (kind, cls, *key)
    if k not in _CLASSES:
        _CLASSES[k] = type(cls)(
            cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
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

    return _subclass("first", cls, __call__, (plan,))


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

    def layer_call(layer_stack, h, carry):
        it_s, it_c = iter(layer_stack), iter(carry)
        full = [next(it_c) if carried[j] else next(it_s) for j in range(len(carried))]
        layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, full))
        y = call_naming_submodules(original, layer, (h, *args), kwargs)
        new = jax.tree.leaves(nnx.state(layer))
        return (
            y,
            [new[j] for j in range(len(carried)) if carried[j]],
            [new[j] for j in range(len(carried)) if not carried[j]],
        )

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
        it_s, it_c = iter(new_stack), iter(carry)
        new = [next(it_c) if carried[j] else next(it_s)[k] for j in range(len(carried))]
        nnx.update(layer, jax.tree.unflatten(treedef, new))
    return jax.tree.map(lambda a: a[0], outs), outs


def _leaf_variables(layer: nnx.Module) -> list:
    """The Variable behind each leaf of ``nnx.state(layer)``, in leaf order."""
    return [_get(layer, state_keys(p)) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(layer))[0]]
