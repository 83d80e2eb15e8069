"""Sequence tiles as a planning lever: which tile counts to try and what tiles cost.

When no plan fits a budget untiled, the planners (:func:`remat_kit.planning.tensors.config_choice`, which ``plan
--budget``, ``train --budget`` and :func:`remat_kit.fit` run, and :func:`remat_kit.planning.fit.auto`) search
again with the built-in model's blocks in sequence tiles
(:attr:`remat_kit.model.transformer.TransformerConfig.seq_tiles`). A tiled candidate is priced over the *untiled*
``none``: its own cost over the tiled ``none`` plus what the tiles cost (:func:`tiles_cost_s`: the tiled
``none``'s extra ops and loop trips), so tiled and untiled plans compare on one scale.

>>> tile_counts(2, 64), tile_counts(2, 50_000), tile_counts(2, 12)
((8, 4, 2), (25, 8, 4, 2), ())
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from remat_kit import policies
from remat_kit.model.transformer import auto_tiles
from remat_kit.planning import cost
from remat_kit.planning.planner import StepPlanner
from remat_kit.policies import tiling
from remat_kit.units import check_int

R = TypeVar("R")

#: Tiles shorter than this many positions are never tried by the planners: the loop trips would cost more than the
#: working set they save.
MIN_TILE_POSITIONS = 8


def tile_counts(batch: int, seq: int) -> tuple[int, ...]:
    """The sequence-tile counts the planners try when no plan fits untiled, most tiles first: 2, 4, 8 and
    ``seq_tiles="auto"``'s count at this shape (:func:`remat_kit.model.transformer.auto_tiles`), those that divide
    ``seq`` into tiles of at least :data:`MIN_TILE_POSITIONS` positions."""
    counts = {2, 4, 8, auto_tiles(batch, seq)}
    return tuple(sorted((k for k in counts if k > 1 and seq % k == 0 and seq // k >= MIN_TILE_POSITIONS), reverse=True))


def check_counts(tiles: Sequence[int] | None, batch: int, seq: int) -> tuple[int, ...]:
    """``tiles`` (default :func:`tile_counts`) as distinct counts, most first, once each is an integer >= 2 that
    divides ``seq``; a one-line error naming the bad one otherwise.

    >>> check_counts((2, 4, 4), 2, 64)
    (4, 2)
    """
    counts = tile_counts(batch, seq) if tiles is None else tuple(tiles)
    for k in counts:
        check_int("tiles", k, 2)
        tiling.check_tiles(k, seq, what="tiles")
    return tuple(sorted(set(counts), reverse=True))


def sweep(counts: Sequence[int], at: Callable[[int], R], key: Callable[[R], Any]) -> tuple[list[R], R | None]:
    """``at(k)`` for each of ``counts``, most tiles first, until an answer where nothing fits (fewer tiles hold more:
    nothing fits below it either). Returns ``(every answer, the fitting one least by key, or None)``; an answer has
    ``.chosen`` (None when nothing fits).

    >>> from types import SimpleNamespace as A
    >>> sweep((8, 4, 2), lambda k: A(k=k, chosen=None if k == 2 else "full"), key=lambda a: a.k)[1].k
    4
    """
    tried, best = [], None
    for k in counts:
        r = at(k)
        tried.append(r)
        if r.chosen is None:
            break
        if best is None or key(r) < key(best):
            best = r
    return tried, best


def tiles_cost_s(
    untiled: StepPlanner, tiled: StepPlanner, batch: int | None, seq: int | None, hardware: cost.Hardware
) -> float:
    """What running the step in tiles costs over running it untiled, by the cost model: the tiled ``none``'s ops
    (the slicing and stitching of the tiles) and loop trips beyond the untiled ``none``'s (trace only)."""
    a, b = untiled.work(policies.none(), batch, seq), tiled.work(policies.none(), batch, seq)
    return b.seconds(hardware) - a.seconds(hardware) + (b.trips - a.trips) * hardware.trip_s


def priced_tiled(candidates: Sequence, seq_tiles: int, over_s: float) -> tuple:
    """Candidates planned in ``seq_tiles`` tiles, repriced over the untiled ``none``: their ``tiles_s`` set to
    ``over_s`` (:func:`tiles_cost_s`) and their rank moved by it."""
    return tuple(
        dataclasses.replace(c, seq_tiles=seq_tiles, tiles_s=over_s, rank=(round(c.cost_s + over_s, 15), *c.rank[1:]))
        for c in candidates
    )
