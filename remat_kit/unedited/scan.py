"""``remat_kit.apply(..., scan=True)``: consecutive blocks of an unedited model that repeat a period, as one scan.

XLA:CPU strips the recompute out of a Python loop of rematerialized blocks (CSE), so a loop model's
compiled memory does not drop however little the policy keeps; under a ``lax.scan`` it does. The
model's code still loops (``for layer in self.layers: x = layer(x, is_local)``). Its blocks may repeat a
*period* (Gemma 3's local/global attention: the block's class, attributes or a static Python flag
alternate per layer): a trace of the parent's call (nothing compiled, once per call signature) records
every block call's static arguments (:func:`template`), and consecutive blocks whose calls repeat a
period at least twice form a run (:func:`find_period`: the period covering the most blocks; a remainder that
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
and stacks the rest (:func:`carry_index`).

This module is the conversion both halves share (the call templates, the period, the runs, the checks that
blocks can share one scan, the pending outputs, the carry, the per-position names). Each half's scan sits
with the rest of that half (:func:`remat_kit.unedited.nnx.nnx_scan`,
:class:`remat_kit.unedited.linen.LinenScan`), which imports this module, never the other way round.

NNX (:func:`remat_kit.unedited.nnx.nnx_scan`): the blocks of one ``nnx.List`` at consecutive indices; a
block's kind is its graph (class, static attributes) and state shapes. State shared by every block (one
``nnx.Rngs`` stream held by every Dropout) is carried through the scan, so RNG draws match the loop.

Linen (:class:`remat_kit.unedited.linen.LinenScan`): blocks under one parent called one after the
other; a block's kind is its class and attributes. The run's first block reads every block's variables
from the parent (the model's own tree) and scans one functional ``apply`` per position over them.
RNG streams draw each layer's plain key (derived from its path, as Flax does:
:func:`remat_kit._jax_internals.linen_block_rngs`); mutable collections the blocks write (``sow``,
``batch_stats``, a cache) come out stacked and are written back into each block's own scope.
"""

from __future__ import annotations

import dataclasses
import inspect as _inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from remat_kit import _jax_internals
from remat_kit.policies import Mix, Policy
from remat_kit.policies import layers as _layers
from remat_kit.policies.static import is_static
from remat_kit.unedited.engine import split_static
from remat_kit.unedited.paths import join


def _identical(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same arrays (the same objects, in the same structure)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(x is y for x, y in zip(la, lb, strict=True))


def check_shared(where: str, first: str, call: Call, first_arrays: tuple, arrays: tuple, skip_input=True) -> None:
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


def argument_ids(fn: Any, args: tuple, kwargs: dict, static_argnames: frozenset[str]) -> tuple:
    """Which objects a block call's array arguments are, but its input: one ``(treedef, ids)`` per argument, in
    :meth:`Call.hole_names` order. Read during the discovery trace, while every argument is alive, so that a scan can
    tell before it runs whether a later block gets the first one's arrays (:func:`check_shared_ids`).
    """
    _, dyn_args, dyn_kwargs = split_static(fn, args, kwargs, static_argnames, is_static)

    def ids(tree):
        leaves, treedef = jax.tree.flatten(tree)
        return treedef, tuple(id(leaf) for leaf in leaves)

    return tuple(ids(a) for a in dyn_args[1:]) + tuple(ids(dyn_kwargs[k]) for k in sorted(dyn_kwargs))


def check_shared_ids(where: str, first: str, call: Call, first_ids: tuple, ids: tuple) -> None:
    """:func:`check_shared` on :func:`argument_ids`: raise the same ValueError before the scan runs."""
    names = call.hole_names()[1:]
    for i in range(max(len(first_ids), len(ids))):
        if i >= len(first_ids) or i >= len(ids) or first_ids[i] != ids[i]:
            name = names[i] if i < len(names) else "argument"
            raise ValueError(
                f"scan=True: {where} gets its own {name}= (not {first}'s array), and one scan shares every block "
                "argument but the input: a per-layer KV cache or mask cannot be scanned unedited; use scan=False"
            )


def carry_index(y: Any, h: Any, where: str) -> int | None:
    """Where the next block's input is in a block's output ``y``: None (all of it) or its index in a tuple.

    gm.nn's and tunix's blocks return ``(cache, x)`` (the cache None in training): the scan carries ``x``
    and stacks the rest.

    >>> import jax.numpy as jnp
    >>> h = jnp.ones(3)
    >>> carry_index(h, h, "b"), carry_index((None, h), h, "b"), carry_index(({"k": jnp.ones(2)}, h, 1), h, "b")
    (None, 1, 1)
    """
    want = shapes(h)
    if shapes(y) == want:
        return None
    if isinstance(y, (tuple, list)):
        at = [i for i, part in enumerate(y) if not is_static(part) and shapes(part) == want]
        if len(at) == 1:
            return at[0]
    raise ValueError(
        f"scan=True: {where} returns {_describe(y)}, neither its input's shape and dtype {_describe(h)} nor a tuple "
        "holding exactly one such value, so its output cannot feed the next block in one scan; use scan=False"
    )


def take_carry(y: Any, at: int | None) -> Any:
    """The next block's input in a block's output (see :func:`carry_index`)."""
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


def same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an array among the attributes: ambiguous, so not provably the same
        return False


class _Hole:
    """Where a call template has an array argument (the same for every block of a run)."""

    def __repr__(self) -> str:
        return "<array>"


HOLE = _Hole()


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
        return same((self.args, self.kwargs), (other.args, other.kwargs))

    def fill(self, arrays: tuple, array_kwargs: dict) -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` with the holes filled in order from ``arrays``/``array_kwargs``."""
        it = iter(arrays)
        args = tuple(next(it) if a is HOLE else a for a in self.args)
        return args, {k: array_kwargs[k] if v is HOLE else v for k, v in self.kwargs}

    def hole_names(self) -> tuple[str, ...]:
        """The names of the array arguments, in order: positional ones, then keyword ones.

        >>> Call((HOLE, True, HOLE), (("mask", HOLE),), ("x", "is_local", "positions")).hole_names()
        ('x', 'positions', 'mask')
        """
        named = [self.names[i] if i < len(self.names) else f"argument {i}" for i, a in enumerate(self.args)]
        return tuple(n for n, a in zip(named, self.args, strict=True) if a is HOLE) + tuple(
            k for k, v in self.kwargs if v is HOLE
        )

    def describe(self) -> str:
        """The static arguments, named: ``is_local=True, deterministic=False``."""
        named = [f"{self.names[i] if i < len(self.names) else i}={a!r}" for i, a in enumerate(self.args)]
        return ", ".join(
            [n for n, a in zip(named, self.args, strict=True) if a is not HOLE]
            + [f"{k}={v!r}" for k, v in self.kwargs if v is not HOLE]
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
    full_args, full_kwargs = rebuild((HOLE,) * len(dyn_args), dict.fromkeys(dyn_kwargs, HOLE))
    try:
        names = tuple(_inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):
        names = ()
    return Call(full_args, tuple(sorted(full_kwargs.items(), key=lambda kv: kv[0])), names)


def find_period(kinds: list, same) -> tuple[int, int]:
    """``(covered, period)``: the period repeating at least twice from ``kinds[0]`` over the most blocks.

    >>> [find_period(list(kinds), str.__eq__) for kinds in ("ababa", "aaab", "ab")]
    [(4, 2), (3, 1), (0, 0)]
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


def runs_in(blocks: list, alike: Callable[[Any, Any], bool]) -> Iterator[tuple[list, int]]:
    """The runs among ``blocks`` (called one after the other): ``(its blocks, its period)``, in order.

    Each run is the period repeating at least twice that covers the most blocks (:func:`find_period`);
    a block no period covers is skipped (it runs on its own).

    >>> [("".join(run), period) for run, period in runs_in(list("xababaab"), str.__eq__)]
    [('abab', 2), ('aa', 1)]
    """
    start = 0
    while start < len(blocks):
        covered, period = find_period(blocks[start:], alike)
        if not covered:
            start += 1
            continue
        yield blocks[start : start + covered], period
        start += covered


@dataclasses.dataclass
class Pending:
    """A run whose first block computed every block's output: the later blocks take theirs in call order.

    Attributes:
      paths: every block of the run, in call order; calls: each position's :class:`Call`.
      outs: per position, its outputs stacked over the periods; carry_at: per position, where the next
        block's input is in its output (:func:`carry_index`).
      arrays: the first block's array arguments but its input, ``(positional ones, keyword ones)``.
      mutated: per position, the collections its blocks wrote, stacked (Linen; ``()`` for NNX).
      next: the block expected next; last: the next block's input in the output handed out last.
    """

    paths: tuple[tuple, ...]
    calls: tuple[Call, ...]
    outs: tuple
    carry_at: tuple
    arrays: tuple
    mutated: tuple = ()
    next: int = 1
    last: Any = None

    def first(self) -> tuple[Any, Any]:
        """Block 0's output, handed to the model (the next block must be called with it), and what it wrote."""
        out, mutated = self.at(0)
        self.last = take_carry(out, self.carry_at[0])
        return out, mutated

    def at(self, k: int) -> tuple[Any, Any]:
        """Block ``k``'s output and what it wrote (None without ``mutated``)."""
        j, u = k % len(self.calls), k // len(self.calls)
        pick = lambda tree: jax.tree.map(lambda a: a[u], tree)
        return pick(self.outs[j]), (pick(self.mutated[j]) if self.mutated else None)

    def follow(self, k: int, args: tuple, call: Call, arrays: tuple, where: str) -> tuple[Any, Any]:
        """Block ``k`` (``where`` names it) called with ``args``: its output and what it wrote, after checking
        that it is the next block, called with the previous one's output, its static arguments and the first
        block's arrays (``arrays``: its own but its input).

        Raises:
          ValueError: saying which of those fails (the model cannot be scanned unedited).
        """
        path = self.paths[k]
        if self.next != k:
            raise ValueError(f"scan=True: block {join(path)} ran out of order; use scan=False")
        if not args or args[0] is not self.last:
            raise ValueError(
                f"scan=True: block {join(path)} is not called with block {join(self.paths[k - 1])}'s output (the "
                "model runs code between its blocks); use scan=False"
            )
        expected = self.calls[k % len(self.calls)]
        if not call.same(expected):
            raise ValueError(
                f"scan=True: block {join(path)} is called with {call.describe()}, not {expected.describe()} as when "
                "the model was traced; use scan=False"
            )
        check_shared(where, join(self.paths[0]), call, self.arrays, arrays, skip_input=False)
        out, mutated = self.at(k)
        self.last = take_carry(out, self.carry_at[k % len(self.calls)])
        self.next = k + 1
        return out, mutated

    def check_whole(self, caller: str) -> None:
        """After the model's call: the run ran whole (a model that skips blocks is a ValueError)."""
        if self.next < len(self.paths):
            raise ValueError(
                f"scan=True: {caller} called {self.next} of the {len(self.paths)} blocks {join(self.paths[0])} .. "
                f"{join(self.paths[-1])} it was traced calling; a model that skips blocks cannot be scanned "
                "unedited (use scan=False)"
            )


def position_policies(
    policy: Policy | Mix, periods: int, traced: Callable[[int], Any], where: list[str]
) -> tuple[Policy | Mix, list[Policy] | None]:
    """A run's policy with its names resolved against what its blocks emit, for ``run_periods``.

    ``traced(j)``: the jaxpr of position ``j``'s block (traced only when the policy names something);
    ``where[j]`` names that block in messages. See :func:`remat_kit.policies.layers.period_policies`.
    """
    if not policy.tags:
        return policy, None
    emitted = [frozenset(t for t, *_ in _jax_internals.jaxpr_tags(traced(j))) for j in range(len(where))]
    return _layers.period_policies(policy, periods, emitted, where)


def shapes(tree: Any) -> Any:
    return jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), tree)
