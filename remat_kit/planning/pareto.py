"""Pareto fronts of memory against cost: which points no other point beats on both."""

from __future__ import annotations

from collections.abc import Sequence


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better on both).

    >>> pareto_front([(1, 5), (2, 2), (3, 3), (5, 1)])
    [0, 1, 3]
    """
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((a <= x and b <= y) and (a, b) != (x, y) for a, b in points)
        if not dominated:
            front.append(i)
    return front
