"""How far a policy stretches: the largest batch or the longest sequence whose compiled step fits a budget, exactly.

:func:`longest_seq` (and :func:`remat_kit.planning.builtin.max_fit`, its built-in model's twin) compiles the step
(compile-only, from shapes) at a few sizes with a :class:`remat_kit.planning.planner.StepPlanner`: the step's
bytes are affine in the batch and at most quadratic in the sequence, so a line (or parabola) through the measured
points names the answer and two compiles confirm it (:func:`boundary`). Generic: it imports no model.
"""

from __future__ import annotations

import dataclasses
import math

from remat_kit import policies
from remat_kit.planning.planner import DEFAULT_MARGIN, Budget
from remat_kit.units import check_int


def boundary(need, target: float, first: int, cap: int, probes=(), degree: int = 1, known=None) -> int:
    """The largest n in [first, cap] with ``need(n) <= target`` (``need`` increasing), or 0 if none.

    ``probes`` are compiled first (where they lie inside the bracket). Then each next probe is where a
    model of the measured points meets the target — a line (``degree=1``) through the bracket's ends
    (or, before an upper end is known, through the highest fitting point and the farthest one below),
    or (``degree=2``) a parabola through the bracket's ends and the nearest other point — just above the last
    fitting point when the model says that point is the answer, so the next compile confirms it. After
    three model probes in a row on the same side, one bisects (or doubles, with no upper end yet), so a
    poor model costs a few compiles, never a scan.

    Returns:
      The answer: ``need(answer) <= target < need(answer + 1)`` (or the answer is ``cap``), both measured.
    """
    seen: dict[int, float] = dict(known or {})
    lo, hi = first - 1, cap + 1  # lo: largest known to fit (first - 1: none yet); hi: smallest known not to
    for n, v in seen.items():
        if v <= target:
            lo = max(lo, n)
        else:
            hi = min(hi, n)
    queue = list(probes)
    streak: list[bool] = []  # sides of the model's probes since it last changed side
    while hi - lo > 1:
        probe = None
        while queue and probe is None:
            q = queue.pop(0)
            probe = q if lo < q < hi and q not in seen else None
        modelled = probe is None
        if modelled:
            probe = _model_probe(seen, lo, hi, cap, target, first, degree)
            # The model keeps missing on one side: halve the bracket instead (never instead of a confirmation).
            if len(streak) >= 3 and probe > lo + 1:
                probe, streak = ((lo + hi) // 2 if hi <= cap else min(cap, 2 * max(lo, 1))), []
        probe = min(max(probe, lo + 1), hi - 1)
        seen[probe] = need(probe)
        fits = seen[probe] <= target
        if modelled:
            streak = [*streak, fits] if streak and streak[-1] == fits else [fits]
        if fits:
            lo = probe
        else:
            hi = probe
    return lo if lo >= first else 0


def _model_probe(seen: dict[int, float], lo: int, hi: int, cap: int, target: float, first: int, degree: int) -> int:
    """Where the measured points' line (or parabola) reaches ``target``, rounded down; lo + 1 when that
    is lo (to confirm it), the smallest shape when nothing fits yet."""
    if lo < first:
        return first
    xs = sorted(seen)
    if hi <= cap:  # a bracket: its ends, plus the nearest other point for a parabola
        pts = [lo, hi]
        others = sorted((x for x in xs if x not in pts), key=lambda x: min(abs(x - lo), abs(x - hi)))
        pts += others[: degree - 1]
    else:  # no upper end yet: the highest fitting point and the farthest below it (the longest baseline)
        below = [x for x in xs if x < lo]
        if not below:
            return min(cap, 2 * lo)
        pts = [lo, below[0]] + ([below[len(below) // 2]] if degree == 2 and len(below) > 1 else [])
    guess = _solve(sorted(set(pts)), seen, target, lo)
    if guess is None or not math.isfinite(guess):
        return (lo + hi) // 2 if hi <= cap else min(cap, 2 * lo)
    n = math.floor(guess)
    return n if n > lo else lo + 1


def _solve(pts: list[int], seen: dict[int, float], target: float, lo: int) -> float | None:
    """The x >= lo where the interpolant through ``pts`` equals ``target`` (line for two points,
    parabola for three; the line through the outer two when the parabola has no such root)."""
    if len(pts) == 3:
        (x0, x1, x2), (y0, y1, y2) = pts, [seen[x] for x in pts]
        d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
        a = (d12 - d01) / (x2 - x0)  # y = y0 + d01 (x - x0) + a (x - x0)(x - x1)
        b = d01 - a * (x0 + x1)
        c = y0 - d01 * x0 + a * x0 * x1 - target
        if a != 0:
            disc = b * b - 4 * a * c
            if disc >= 0:
                roots = [(-b + sgn * math.sqrt(disc)) / (2 * a) for sgn in (1, -1)]
                roots = [r for r in roots if r >= lo - 1e-9]
                if roots:
                    return min(roots)
        pts = [x0, x2]
    x0, x1 = pts[0], pts[-1]
    slope = (seen[x1] - seen[x0]) / (x1 - x0)
    if slope <= 0:
        return None
    return x0 + (target - seen[x0]) / slope


@dataclasses.dataclass(frozen=True)
class SeqEdge:
    """The longest sequence whose compiled step fits one budget under one policy, and the compiled edge.

    Attributes:
      policy: the policy spec.
      budget_bytes, margin: the budget (a step fits when its need × (1 + margin) is at most the budget).
      seq: the longest multiple of ``step`` that fits (0: not even ``step`` fits), compiled.
      need_bytes: its compiled device need (None when nothing fits).
      next_seq, next_need_bytes: ``seq + step``, compiled and shown not to fit; None when ``seq`` is the limit.
      host_bytes: host memory the step at ``seq`` needs (offloaded residuals; 0 where offload moves nothing).
      step, limit: the granularity and the longest length tried.
    """

    policy: str
    budget_bytes: int
    margin: float
    seq: int
    need_bytes: int | None
    next_seq: int | None
    next_need_bytes: int | None
    host_bytes: int
    step: int
    limit: int


def longest_seq(
    planner,
    policy: policies.Policy | str,
    *,
    batch: int | None,
    budget_bytes: int,
    margin: float = DEFAULT_MARGIN,
    step: int = 256,
    limit: int,
    first: int = 1,
    probes: tuple[int, ...] = (),
) -> SeqEdge:
    """The longest multiple of ``step`` (at most ``limit``) whose compiled step fits, found at its edge.

    The answer is compiled and fits, and the next multiple of ``step`` is compiled and does not (or the
    answer is ``limit``). Few compiles: the need is affine (chunked attention) or at most quadratic in the
    sequence, so a parabola through the measured points names the answer (:func:`boundary`).

    Args:
      planner: a :class:`~remat_kit.planning.planner.StepPlanner` whose ``memory(policy, batch, seq)`` compiles.
      batch: the batch size (None for a model whose factory fixes it).
      step: the granularity in positions; limit: the longest sequence tried (a multiple of ``step``).
      first: the shortest multiple of ``step`` allowed (in units of ``step``).
      probes: lengths (in positions) to compile first, e.g. the reference shape.
    """
    check_int("step", step)
    check_int("limit", limit, step)
    budget = Budget(budget_bytes, margin)
    policy = policies.parse(policy)
    cap = limit // step
    need = lambda n: planner.memory(policy, batch, n * step)[0]
    units = tuple(p // step for p in probes if p % step == 0 and first <= p // step <= cap)
    n = boundary(need, budget.target, first, cap, probes=units, degree=2)
    seq = n * step
    got = planner.memory(policy, batch, seq) if n else (None, 0)
    nxt = (n + 1) * step if n < cap else None
    nxt_need = need(n + 1) if nxt is not None else None
    return SeqEdge(str(policy), budget_bytes, margin, seq, got[0], nxt, nxt_need, got[1], step, limit)
