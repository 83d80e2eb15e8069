"""How far a policy stretches: the largest batch or longest sequence that fits a budget, exactly.

:func:`max_fit` compiles the step (compile-only, from shapes) at a few sizes with the planner of
:mod:`remat_kit.planning.budget`: the step's bytes are affine in the batch and at most quadratic in the
sequence, so a line (or parabola) through the measured points names the answer and two compiles
confirm it (:func:`_boundary`).
"""

from __future__ import annotations

import math

import optax

from remat_kit import policies
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning.planner import DEFAULT_MARGIN, Budget, Planner


def max_fit(
    config: TransformerConfig,
    policy: policies.Policy | str,
    *,
    dim: str,
    batch: int,
    seq: int,
    budget_bytes: int,
    margin: float = DEFAULT_MARGIN,
    planner: Planner | None = None,
    optimizer: str | optax.GradientTransformation = "adamw",
    loss_chunks: int = 0,
    limit: int | None = None,
) -> int:
    """The largest batch (``dim="batch"``, at fixed ``seq``) or the longest sequence (``dim="seq"``,
    at fixed ``batch``) whose step fits the budget under ``policy``; 0 if even 1 does not fit.

    Exact: the answer fits and the answer + 1 does not, both by real compile (or the answer is the
    limit: the model's ``max_seq_len`` for ``seq``, ``limit`` or 2**20 for ``batch``). Compile-only,
    and few compiles: the step's bytes are affine in the batch (a quadratic at most in the sequence,
    through attention), so two compiles give the line, the line names the answer and two more confirm
    it (:func:`_boundary`); a sequence limit that fits is checked first (one compile).
    """
    if dim not in ("batch", "seq"):
        raise ValueError(f"dim must be 'batch' or 'seq', got {dim!r}")
    budget = Budget(budget_bytes, margin)
    policy = policies.parse(policy)
    planner = planner or Planner(config, optimizer, loss_chunks)
    cap = limit or (config.max_seq_len if dim == "seq" else 2**20)
    need = lambda n: planner.memory(policy, *((n, seq) if dim == "batch" else (batch, n)))[0]
    target = budget.target
    first = 1
    if planner.loss_chunks:  # the chunk count may not exceed the token count
        first = -(-planner.loss_chunks // (seq if dim == "batch" else batch))
    start = max(first, min(batch if dim == "batch" else seq, cap))
    if dim == "seq":
        if need(cap) <= target:
            return cap
        # The parabola through the given length, twice it and the limit names the answer.
        return _boundary(need, target, first, cap, probes=(start, 2 * start), degree=2, known={cap: need(cap)})
    # Bytes at batch 1 may not lie on the line (XLA's layout differs there): the line starts at 2 or more.
    p0 = max(start, 2 * first, 2) if cap >= 2 else start
    return _boundary(need, target, first, cap, probes=(p0, 2 * p0), degree=1)


def _boundary(need, target: float, first: int, cap: int, probes=(), degree: int = 1, known=None) -> int:
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
