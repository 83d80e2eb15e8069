"""The exact solver of ``fit``: per tensor keep / recompute / offload per block type, mixed over layers.

The cost model :mod:`remat_kit.planning.engine` prices is additive: a block's named values each have bytes (what
keeping one costs in memory) and a recompute price (the block's ops between it and the named value before it: what
recomputing it costs); offloading one costs its transfer both ways and no device bytes. A layer's price is the sum
over its values, and the step's the sum over its layers. Under such a model the choice is a multiple-choice
knapsack, and a dynamic program over it is exact with no discretization: the states after each decision are the
Pareto-optimal ``(bytes, cost)`` pairs reached so far, and a state another beats on both (fewer or equal bytes,
lower or equal cost) can never complete to a better plan, since what is added after it is the same for both.

* :func:`layer_front`: the Pareto front of one layer's assignments (a DP over its values; at most ``3^g`` points,
  a handful in practice).
* :func:`solve`: the cheapest assignment of one front point to each layer whose bytes fit a capacity (a DP over
  the layers, each layer taking its own block type's front: several block types are one more list). ``fit`` asks
  for at most two distinct options per block type (``parts=2``: a uniform plan or a mix ``a*k+b*(L-k)``, two
  scans), scored exhaustively over every pair and count: exact within that pool as well.

Why a DP rather than an ILP: the pool is small and has this exact structure, the DP needs no solver library (none is
a dependency of the project) and its answer is provably the optimum of the same model that prices it
(``tests/test_fit.py`` compares it with exhaustive enumeration).

>>> a = Value("a", nbytes=4, recompute_s=3.0)
>>> b = Value("b", nbytes=2, recompute_s=1.0)
>>> front = layer_front([a, b])
>>> [(o.nbytes, o.cost_s, o.keep) for o in front]
[(0, 4.0, ()), (2, 3.0, ('b',)), (4, 1.0, ('a',)), (6, 0.0, ('a', 'b'))]
>>> plan = solve([front, front], capacity=5)  # two layers, 5 bytes between them
>>> sorted(o.keep for o in plan), sum(o.cost_s for o in plan)
([(), ('a',)], 5.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Value:
    """One named value of a block, priced.

    Attributes:
      name: the name a policy keeps it by (several names of one value: the one kept).
      nbytes: device bytes per layer when kept.
      recompute_s: the estimated seconds of recomputing it (its segment of the block) per layer.
      offload_s: the exposed seconds of moving it to the host and back; None where offload moves nothing.
    """

    name: str
    nbytes: int
    recompute_s: float
    offload_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Option:
    """One layer's assignment: the values it keeps on the device and offloads (the rest recomputed).

    Attributes:
      keep, offload: the names, in the block's order.
      nbytes: device bytes the layer keeps (beyond what ``full`` keeps); cost_s: its estimated seconds.
    """

    keep: tuple[str, ...]
    offload: tuple[str, ...]
    nbytes: int
    cost_s: float


def _prune(states: dict) -> dict:
    """The Pareto-optimal states of ``{bytes: (cost, ...)}``: each kept only if it is cheaper than every state
    with fewer bytes."""
    out, best = {}, float("inf")
    for nbytes in sorted(states):
        if states[nbytes][0] < best:
            out[nbytes], best = states[nbytes], states[nbytes][0]
    return out


def layer_front(values: Sequence[Value], *, base_s: float = 0.0) -> list[Option]:
    """Every Pareto-optimal assignment of one layer (least cost for its bytes), fewest bytes first.

    Args:
      values: the layer's named values, in the block's order.
      base_s: what the layer recomputes whatever it keeps (the ops after its last named value).
    """
    # state: bytes -> (cost, keep, offload)
    states: dict[int, tuple[float, tuple, tuple]] = {0: (base_s, (), ())}
    for v in values:
        nxt: dict[int, tuple[float, tuple, tuple]] = {}
        for nbytes, (c, keep, off) in states.items():
            moves = [(nbytes, (c + v.recompute_s, keep, off)), (nbytes + v.nbytes, (c, (*keep, v.name), off))]
            if v.offload_s is not None:
                moves.append((nbytes, (c + v.offload_s, keep, (*off, v.name))))
            for key, item in moves:
                if key not in nxt or item[0] < nxt[key][0]:
                    nxt[key] = item
        states = _prune(nxt)
    return [Option(keep, off, nbytes, c) for nbytes, (c, keep, off) in sorted(states.items())]


def solve(
    fronts: Sequence[Sequence[Option]], capacity: float, *, uniform: bool = False, parts: int | None = None
) -> list[Option] | None:
    """The cheapest choice of one option per layer whose bytes sum to at most ``capacity``; None if none does.

    Args:
      fronts: per layer, the options of its block type (:func:`layer_front`), in layer order.
      capacity: the device bytes all layers together may keep beyond ``full``.
      uniform: every layer of one block type takes the same option (where the model cannot mix over layers).
      parts: at most this many distinct options per block type (``2``: uniform plans and mixes of two, what a
        stack runs as two scans, a mix's bytes as :func:`plan_bytes` counts them; None: any). Exact within that
        pool too: every pair of front options and count is scored (``O(|front|² · layers)``).

    Returns:
      One option per layer (ties: fewer bytes), or None.
    """
    if parts == 2 and not uniform and len({id(f) for f in fronts}) == 1:
        return _two_parts(list(fronts[0]), len(fronts), capacity)
    if uniform:
        kinds = list(dict.fromkeys(id(f) for f in fronts))
        by_id = {id(f): f for f in fronts}
        counts = {k: sum(1 for f in fronts if id(f) == k) for k in kinds}
        # one option per block type, scaled by its layer count: a DP over the types
        scaled = [
            [dataclasses.replace(o, nbytes=o.nbytes * counts[k], cost_s=o.cost_s * counts[k]) for o in by_id[k]]
            for k in kinds
        ]
        picked = solve(scaled, capacity)
        if picked is None:
            return None
        chosen = {k: by_id[k][scaled[i].index(picked[i])] for i, k in enumerate(kinds)}
        return [chosen[id(f)] for f in fronts]
    # state: bytes -> (cost, parent state bytes, option): one dict per layer for the walk back
    layers: list[dict[int, tuple[float, int, Option | None]]] = [{0: (0.0, 0, None)}]
    for front in fronts:
        nxt: dict[int, tuple[float, int, Option]] = {}
        for nbytes, (c, _, _) in layers[-1].items():
            for o in front:
                total = nbytes + o.nbytes
                if total > capacity:
                    break  # the front is sorted by bytes
                if total not in nxt or c + o.cost_s < nxt[total][0]:
                    nxt[total] = (c + o.cost_s, nbytes, o)
        if not nxt:
            return None
        layers.append(_prune(nxt))
    end = min(layers[-1], key=lambda b: (layers[-1][b][0], b))
    out = []
    for states in reversed(layers[1:]):
        _, end, option = states[end]
        out.append(option)
    return out[::-1]


def plan_bytes(options: Sequence[Option]) -> int:
    """The bytes a plan of one block type keeps beyond ``full``: its layers' own, and for a mix of several options
    (several scans) one layer of the keepiest option more. Measured on the unedited Linen model of the benchmark: a
    mix ``a*1+b*5`` needed 2.1 MB over the layers' sum where ``b*6`` alone needed 2.9 MB under it; the second scan's
    residual buffers and working set are live beside the first's."""
    distinct = set(options)
    return sum(o.nbytes for o in options) + (max(o.nbytes for o in distinct) if len(distinct) > 1 else 0)


def _two_parts(front: list[Option], layers: int, capacity: float) -> list[Option] | None:
    """The cheapest ``a`` on ``k`` layers and ``b`` on the rest (``a == b``: uniform) within ``capacity``, a mix
    charged :func:`plan_bytes`' extra layer."""
    best = None
    for a in front:
        for b in front:
            for k in range(1 if a != b else layers, layers + 1):
                nbytes = a.nbytes * k + b.nbytes * (layers - k) + (max(a.nbytes, b.nbytes) if a != b else 0)
                if nbytes > capacity:
                    continue
                key = (a.cost_s * k + b.cost_s * (layers - k), nbytes)
                if best is None or key < best[0]:
                    best = (key, [a] * k + [b] * (layers - k))
    return None if best is None else best[1]
