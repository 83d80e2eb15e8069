"""How far a policy stretches, and which plan fits: the longest sequence that fits a budget, exactly, and ``fit``.

:func:`longest_seq` (and :func:`remat_kit.planning.builtin.max_fit`, its built-in model's twin) compiles the step
(compile-only, from shapes) at a few sizes with a :class:`remat_kit.planning.planner.StepPlanner`: the step's
bytes are affine in the batch and at most quadratic in the sequence, so a line (or parabola) through the measured
points names the answer and two compiles confirm it (:func:`_boundary`). :func:`fit` is the public way to fit a
budget: its engine is :func:`remat_kit.planning.engine.plan` (the model as given first, one trace priced, an exact
solve, at most three compiles); :func:`choose` remains the search over a pool of presets given by hand
(``plan --budget --policies``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import optax
from flax import nnx

from remat_kit import policies
from remat_kit.analysis import inspection
from remat_kit.planning import budget as budget_lib
from remat_kit.planning import cost, engine
from remat_kit.planning.budget import Candidate, Pricer
from remat_kit.planning.engine import LEVERS, Choice
from remat_kit.planning.engine import emitted_bytes as emitted_bytes  # re-exported: tensors, tests
from remat_kit.planning.engine import group_names as group_names  # re-exported
from remat_kit.planning.planner import DEFAULT_MARGIN, Budget, StepPlanner, get_optimizer, is_built_in
from remat_kit.policies import findings
from remat_kit.unedited import entry as unedited_lib
from remat_kit.units import check_int, fmt_bytes, fmt_seconds, parse_bytes


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


# ---- fit: the policy that fits a budget, chosen per tensor from the model's own names --------------------------

#: The compiles :func:`fit` spends at most (:data:`remat_kit.planning.engine.MAX_COMPILES`).
MAX_COMPILES = engine.MAX_COMPILES

#: The compiles :func:`choose` (the preset search ``plan --budget`` runs over a given pool) may spend.
SEARCH_COMPILES = 12

#: A candidate whose predicted need exceeds the target by more than this share is not compiled: the prediction
#: (a line in kept bytes through the compiled points) is a guide for what to compile, never the answer.
PREDICTION_SLACK = 0.03


class NothingFits(ValueError):
    """No plan fits the budget: the one-line refusal (its message), with the leanest need found.

    Attributes:
      need_bytes: the least compiled need found; leanest: its spec.
    """

    def __init__(self, message: str, need_bytes: int, leanest: str):
        super().__init__(message)
        self.need_bytes, self.leanest = need_bytes, leanest


def tensor_candidates(
    price: Pricer, groups: Sequence[tuple[tuple[str, ...], int]], keep: Sequence[str] = ()
) -> list[policies.Policy]:
    """The per-tensor candidates: each group kept alone, and the greedy chain of the groups by recompute time saved
    per byte kept (each alone, priced on the whole step: one trace each), every prefix of it. ``keep``: names every
    candidate keeps (``layer_input``, which every rematerialized layer keeps anyway)."""
    full = price.estimate(policies.full()).cost_s
    singles = [(policies.selective([*keep, *g[0]]), g) for g in groups]
    saved = sorted(
        singles, key=lambda pg: -(full - price.estimate(pg[0]).cost_s) / max(pg[1][1], 1)
    )  # most seconds saved per byte first
    chain, kept = [], list(keep)
    for _, (names, _) in saved[:-1]:  # the whole chain is `none` but for the names' neighbours: left to `none`
        kept.extend(names)
        chain.append(policies.selective(list(kept)))
    return list(dict.fromkeys([p for p, _ in singles] + chain))


def choose(
    planner: StepPlanner,
    budget: Budget,
    *,
    presets: Sequence[policies.Policy],
    groups: Sequence[tuple[tuple[str, ...], int]] = (),
    keep: Sequence[str] = (),
    num_layers: int | None = None,
    depth: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    hardware: cost.Hardware | None = None,
    max_compiles: int = SEARCH_COMPILES,
    levers: str = "",
) -> Choice:
    """The engine of :func:`fit`, ``plan --budget`` and ``train --budget``: the fitting plan with the least estimated
    step time, keeping, recomputing (or, where the backend moves memory, offloading) per tensor.

    The pool: ``presets`` and the per-tensor candidates of ``groups`` (:func:`tensor_candidates`), every one priced
    by the cost model (a trace each, no compile). ``none`` is compiled first (it fits: the answer), then ``full``
    (the leanest; if it does not fit, the leaner presets, then the refusal). Then, cheapest first, the next candidate
    cheaper than the best compiled answer whose need a line in kept bytes (through every compiled ``none``, ``full``
    and per-tensor point) predicts to fit is compiled, until none is left or ``max_compiles``; presets without a
    kept-bytes figure are compiled when their turn comes. Given ``num_layers`` (a stack), the best mix of two
    compiled Pareto-optimal candidates (:func:`remat_kit.planning.budget.best_mix`) with what compiles remain.
    The answer is always a compiled need: "fits" is ``need · (1 + margin) <= budget``.

    Returns:
      A :class:`Choice` (``chosen`` None, ``reason`` the refusal, when nothing fits).
    """
    start, before = time.perf_counter(), planner.compiles
    hardware = hardware or planner.hardware
    price = Pricer(planner, hardware, batch, seq)
    rows: dict[str, Candidate] = {}

    def measure(p) -> Candidate:
        if str(p) not in rows:
            rows[str(p)] = price.candidate(p, budget)
        return rows[str(p)]

    def spent() -> int:
        return planner.compiles - before

    none, full = policies.none(), policies.full()
    measure(none)
    # A budget none fits needs nothing else priced.
    pool = [none] if rows["none"].fits else [none, *presets, *tensor_candidates(price, groups, keep), full]
    pool = [p for p in dict.fromkeys(pool) if price.choosable(p)]
    sizes = {n: b for names, b in groups for n in names}
    if not rows["none"].fits:
        measure(full)
        if not rows["full"].fits:  # leaner than full: the nested and offload presets, then the refusal
            for p in pool:
                if p.kind in ("segments", "sqrt_n", "offload") and spent() < max_compiles:
                    measure(p)

    def kept(p) -> int | None:
        """Bytes per block a selective candidate keeps beyond full (None: no such figure)."""
        if (
            isinstance(p, policies.Mix)
            or p.kind not in ("selective", "full")
            or not set(p.save) - set(keep) <= set(sizes)
        ):
            return None
        return sum(sizes[n] for n in set(p.save) - set(keep))

    total = sum(b for _, b in groups)

    def predict(p) -> float | None:
        k = kept(p)
        if k is None:
            if not isinstance(p, policies.Mix) and p.kind == "every_n" and "full" in rows:
                span = rows["none"].need_bytes - rows["full"].need_bytes
                return rows["full"].need_bytes + span * (p.period - 1) / p.period
            return None
        base = rows["full"].need_bytes
        pts = [(kept(policies.parse(s)), c.need_bytes) for s, c in rows.items() if c.need_bytes is not None]
        pts = [(x, y - base) for x, y in pts if x]
        if pts:  # least squares through full's point
            return base + k * sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
        # Nothing compiled yet: every block keeps its bytes (a lower bound: compiling too much, never skipping a fit);
        # without a depth, none's need over every group's bytes.
        slope = depth or (rows["none"].need_bytes - base) / max(total, 1)
        return base + slope * k

    def best() -> Candidate | None:
        fitting = [c for s, c in rows.items() if c.fits and price.choosable(policies.parse(s))]
        return min(fitting, key=lambda c: (c.rank, c.need_bytes)) if fitting else None

    order = sorted(pool, key=price.rank)
    while best() is not None and best().policy != "none" and spent() < max_compiles:
        bound = best().rank
        nxt = None
        for p in order:
            if price.rank(p) >= bound:
                break
            if str(p) in rows:
                continue
            guess = predict(p)
            if guess is None or guess <= budget.target * (1 + PREDICTION_SLACK):
                nxt = p
                break
        if nxt is None:
            break
        measure(nxt)

    chosen = best()
    table = tuple(rows.values())
    if chosen is not None and num_layers is not None and chosen.policy != "none" and spent() < max_compiles:
        mix, tried, _ = budget_lib.best_mix(
            planner,
            table,
            chosen,
            num_layers,
            budget,
            batch=batch,
            seq=seq,
            max_compiles=max_compiles - spent(),
            price=price,
        )
        table += tuple(c for c in tried if c.policy not in rows)
        if mix is not None:
            chosen = next(c for c in table if c.policy == str(mix))
    table += tuple(price.candidate(p, None) for p in pool if str(p) not in {c.policy for c in table})
    base_s = price._base.seconds(hardware)
    if chosen is None:
        compiled = [c for c in table if c.need_bytes is not None]
        least = min(compiled, key=lambda c: c.need_bytes)
        reason = (
            f"nothing fits the {fmt_bytes(budget.bytes)} budget: the leanest plan found, {least.policy}, needs "
            f"{fmt_bytes(least.need_bytes)} ({fmt_bytes(budget.with_margin(least.need_bytes))} with the "
            f"{budget.margin:.0%} margin); remat cannot shrink the parameters and optimizer state, the logits or the "
            f"batch: {levers or LEVERS}"
        )
        policy = None
    else:
        policy = policies.parse(chosen.policy)
        why = [c for c in table if c.rank < chosen.rank and c.need_bytes is not None]
        reason = (
            f"{chosen.policy} needs {fmt_bytes(chosen.need_bytes)} (+{budget.margin:.0%} margin: "
            f"{fmt_bytes(budget.with_margin(chosen.need_bytes))}) of {fmt_bytes(budget.bytes)} at an estimated "
            f"{fmt_seconds(chosen.cost_s)} per step over none"
            + (f"; the {len(why)} cheaper ones compiled need more" if why else "")
            + "."
        )
    return Choice(
        chosen=policy,
        need_bytes=None if chosen is None else chosen.need_bytes,
        est_step_time_s=None if chosen is None else base_s + chosen.cost_s,
        candidates=table,
        budget=budget,
        compiles=spent(),
        seconds=time.perf_counter() - start,
        reason=reason,
        groups=tuple(names for names, _ in groups),
    )


@dataclasses.dataclass(frozen=True)
class FitResult:
    """:func:`fit`'s answer.

    Attributes:
      model: the model under the chosen plan, used exactly like the plain one.
      policy: the plan's spec (round-trips through :func:`remat_kit.parse`).
      need_bytes: the compiled step's device bytes under it.
      est_step_time_s: the cost model's estimate of the whole step under it.
      candidates: every candidate priced (:class:`remat_kit.planning.budget.Candidate`).
      choice: the engine's whole answer (:class:`Choice`).
      findings: what apply's guard found on a candidate (:mod:`remat_kit.unedited.guard`: a policy that changes
        nothing the backward pass keeps), one line each.
      seq_tiles: the sequence tiles the built-in model's blocks run in under the plan (1: untiled); ``model``'s
        config carries them. Always 1 for a user's model: fit inserts no tiles there (:func:`remat_kit.tiled` is the
        user's to place).
    """

    model: Any
    policy: str
    need_bytes: int
    est_step_time_s: float
    candidates: tuple
    choice: Choice
    seq_tiles: int = 1
    findings: tuple[str, ...] = ()

    def table(self) -> str:
        """The candidates priced, their compiled needs and the choice (:meth:`Choice.table`)."""
        return self.choice.table()

    @property
    def compiles(self) -> int:
        """The XLA compiles the fit spent."""
        return self.choice.compiles

    @property
    def predicted_bytes(self) -> int | None:
        """The need the memory model predicted for the answer before compiling it (None: compiled to calibrate)."""
        return self.choice.predicted_bytes


def budget_bytes_of(budget: int | str) -> int:
    """Bytes from ``budget``: a positive int or a size string (``"16GB"``, ``"512MiB"``); a one-line error else.

    >>> budget_bytes_of("512MiB"), budget_bytes_of(10**9)
    (536870912, 1000000000)
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise TypeError(f"budget must be bytes (an int) or a size string such as '16GB', got {budget!r}")
    return parse_bytes(budget)


def check_convention(model: Any, loss_fn: Callable, example_args: tuple) -> None:
    """Raise TypeError, in one line, when ``loss_fn`` and ``example_args`` follow the other API's convention.

    Linen: ``loss_fn(model, variables, *batch)`` with ``example_args = (variables, *batch)``; NNX:
    ``loss_fn(model, *batch)`` with ``example_args = batch`` (the variables live in the model).

    >>> import flax.linen as nn, jax.numpy as jnp
    >>> try:
    ...     check_convention(nn.Dense(2), lambda m, x: m(x).sum(), (jnp.ones(2),))
    ... except TypeError as err:
    ...     print(str(err).split(" and the")[0])
    fit of a Linen model (Dense) takes loss_fn(model, variables, *batch)
    """
    is_nnx = isinstance(model, nnx.Module)
    first = example_args[0] if example_args else None
    name = type(model).__name__
    if not is_nnx and not isinstance(first, Mapping):
        raise TypeError(
            f"fit of a Linen model ({name}) takes loss_fn(model, variables, *batch) and the variables first among the "
            f"example arguments (model.init(key, *batch)), got {type(first).__name__} first: that is the NNX convention"
        )
    if is_nnx and isinstance(first, Mapping) and "params" in first:
        raise TypeError(
            f"fit of an NNX model ({name}) takes loss_fn(model, *batch): its variables live in the model, so the "
            "example arguments are the batch alone; got a variables dict first: that is the Linen convention"
        )
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(model, *example_args)
    except TypeError:
        shape = "loss_fn(model, variables, *batch)" if not is_nnx else "loss_fn(model, *batch)"
        raise TypeError(
            f"fit of {'a Linen' if not is_nnx else 'an NNX'} model ({name}) calls {shape} with the model and the "
            f"{len(example_args)} example argument(s), which loss_fn{signature} does not take"
        ) from None


def fit(
    model: Any,
    loss_fn: Callable,
    *example_args: Any,
    budget: int | str,
    optimizer: str | optax.GradientTransformation = "adamw",
    scan: bool | None = None,
    where: Any = None,
    static_argnames: Any = None,
    margin: float = DEFAULT_MARGIN,
    hardware: cost.Hardware | None = None,
    max_compiles: int = MAX_COMPILES,
    target=None,
    progress: Callable[[str], None] | None = None,
) -> FitResult:
    """Fit a training step to a memory budget: the plan with the least estimated step time whose compiled step fits.

    ``model`` is a Flax model, Linen or NNX, unedited or built with remat_kit (the built-in Transformer), and
    ``loss_fn`` its loss in :func:`remat_kit.apply_factory`'s convention (Linen: ``loss_fn(model, variables,
    *batch)``; NNX: ``loss_fn(model, *batch)``); ``example_args`` are the loss's arguments after the model
    (arrays or ShapeDtypeStructs). The step that must fit is the loss's gradient plus ``optimizer``'s update,
    parameters and state donated. The model as given is compiled first (one compile when it fits); else the
    candidates come from the model itself: the names its blocks emit (its own tags, the module paths
    :func:`remat_kit.names_of` lists), kept, recomputed or offloaded per tensor and mixed over two layer ranges,
    priced from one trace and solved exactly (:func:`remat_kit.planning.engine.plan`); nothing is listed by hand.
    At most three XLA compiles (``max_compiles``), sequence tiles of the built-in model aside.

    Sequence tiles: for the built-in Transformer (``seq_tiles=1``) tiles are a lever like the others: when no plan fits
    untiled, the blocks' per-token parts are tried in sequence tiles
    (:func:`remat_kit.planning.tensors.config_choice`) and ``.model`` carries the tile count chosen
    (``.seq_tiles``). For any other model fit inserts no tiles: they change the model's code, which is the user's
    (wrap a block's per-token part in :func:`remat_kit.tiled` and fit plans the model as given).

    Args:
      budget: device bytes (an int) or a size string (``"16GB"``, ``"512MiB"``).
      optimizer: a name (``"adamw"``, ``"sgd"``, ...) or an optax transformation; its state counts.
      scan, where, static_argnames: as :func:`remat_kit.apply` (``scan=None``: scan the blocks where they can be,
        the only way a Python loop's recompute survives XLA on CPU).
      margin: a plan fits when its compiled need times ``1 + margin`` is at most the budget.
      max_compiles: at most this many XLA compiles (at least 2; a 4th, if allowed, verifies a refitted answer where
        the first missed).
      progress: called with one line per phase (also logged to ``remat_kit.fit`` at INFO); Ctrl-C stops a fit at
        once.
      target: the device planned for (:func:`remat_kit.target.parse`; default ``"local"``): ``"h100"`` compiles
        XLA:GPU's own step without a GPU (needs ``pip install 'remat-kit[gpu-target]'``).

    Returns:
      A :class:`FitResult`: ``.model``, ``.policy``, ``.need_bytes``, ``.predicted_bytes``, ``.compiles``,
      ``.est_step_time_s``, ``.candidates``, ``.table()``. ``.model`` is the model itself when the answer is the
      model as given.

    Raises:
      TypeError/ValueError: a bad budget, model or loss, in one line before anything is compiled.
      NothingFits: (a ValueError) no plan fits: the smallest need found and the levers remat does not have.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + nn.Dense(16, name="up")(jnp.tanh(x))
    >>> class Net(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         for i in range(2):
    ...             x = Block(name=f"layer_{i}")(x)
    ...         return x
    >>> x = jnp.ones((4, 16))
    >>> v = Net().init(jax.random.key(0), x)
    >>> r = fit(Net(), lambda m, v, x: jnp.sum(m.apply(v, x) ** 2), v, x, budget="1GB")
    >>> r.policy, r.need_bytes <= 10**9
    ('none', True)
    """
    B = Budget(budget_bytes_of(budget), margin)
    get_optimizer(optimizer)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (loss_fn(model, ...) -> scalar), got {loss_fn!r}")
    if scan is not None and not isinstance(scan, bool):
        raise TypeError(f"scan must be True, False or None (decide), got {scan!r}")
    is_nnx = isinstance(model, nnx.Module)
    if not is_nnx and not isinstance(model, nn.Module):
        raise TypeError(f"fit takes a flax.linen or flax.nnx Module instance, got {model!r}")
    if not example_args and not is_nnx:
        raise TypeError("fit(linen_model, loss_fn, variables, *batch, budget=...) needs the variables and the batch")
    check_convention(model, loss_fn, example_args)
    inputs = inspection.abstract(example_args)
    start = time.perf_counter()
    found: list[str] = []
    if is_built_in(model, "Transformer"):  # the built-in model: its own policy field, its own stack and tags
        from remat_kit.planning import tensors  # late: the built-in model is loaded only when it is planned

        choice, applied = tensors.fit_transformer(
            model,
            loss_fn,
            inputs,
            budget=B,
            optimizer=optimizer,
            hardware=hardware,
            max_compiles=max_compiles,
            target=target,
            progress=progress,
        )
    else:
        kwargs = {"where": where, "static_argnames": static_argnames}
        params = nnx.state(model, nnx.Param) if is_nnx else inputs[0]
        params = inspection.abstract((params,))[0]
        batch_args = inputs if is_nnx else inputs[1:]
        planner_of = lambda s: StepPlanner(
            lambda p, b, q: (unedited_lib.apply_factory(model, loss_fn, scan=s, **kwargs)(p), params, batch_args),
            optimizer,
            target=target,
        )
        scanned = [scan]

        def stack() -> StepPlanner:
            """The blocks rematerialized: scanned where they can be (on CPU XLA removes a Python loop's recompute)."""
            for s in [True, False] if scan is None else [scan]:
                planner = planner_of(s)
                try:
                    planner.prepare(policies.full())
                except ValueError:
                    if s is False or scan is not None:
                        raise
                    continue
                scanned[0] = s
                return planner
            raise AssertionError("unreachable")

        with findings.collect() as found:  # apply's guard on a candidate: a line of the result, not an error
            choice = engine.plan(
                stack,
                B,
                plain=planner_of(False),
                hardware=hardware,
                max_compiles=max_compiles,
                progress=progress,
            )
        applied = lambda p: model if p == policies.none() else unedited_lib.apply(model, p, scan=scanned[0], **kwargs)
    if choice.chosen is None:
        least = min((c for c in choice.candidates if c.need_bytes is not None), key=lambda c: c.need_bytes)
        raise NothingFits(choice.reason, least.need_bytes, least.policy)
    choice = dataclasses.replace(choice, seconds=time.perf_counter() - start)
    return FitResult(
        model=applied(choice.chosen),
        policy=str(choice.chosen),
        need_bytes=choice.need_bytes,
        est_step_time_s=choice.est_step_time_s,
        candidates=choice.candidates,
        choice=choice,
        seq_tiles=choice.seq_tiles,
        findings=tuple(found),
    )


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
    sequence, so a parabola through the measured points names the answer (:func:`_boundary`).

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
    n = _boundary(need, budget.target, first, cap, probes=units, degree=2)
    seq = n * step
    got = planner.memory(policy, batch, seq) if n else (None, 0)
    nxt = (n + 1) * step if n < cap else None
    nxt_need = need(n + 1) if nxt is not None else None
    return SeqEdge(str(policy), budget_bytes, margin, seq, got[0], nxt, nxt_need, got[1], step, limit)
