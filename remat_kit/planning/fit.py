"""The one public way to fit a budget: :func:`fit` (and :func:`auto`, a front kept for its table).

A reader follows ``fit`` through a handful of modules: this one (the entry: its checks, and which stack a model
plans on), :mod:`remat_kit.planning.engine` (the model as given, one trace priced, at most three compiles),
:mod:`remat_kit.planning.solve` (the exact DP) and :mod:`remat_kit.planning.planner` (the compiles themselves). The
built-in Transformer is one more model here: :mod:`remat_kit.planning.tensors` gives the engine its stack and its
levers (sequence tiles, loss chunks). This module sits above the generic engine and the built-in model's planner
alike, so nothing below it imports it and no import is late.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import optax
from flax import nnx

from remat_kit import policies
from remat_kit.analysis import inspection
from remat_kit.planning import budget as budget_lib
from remat_kit.planning import builtin, cost, engine, tensors
from remat_kit.planning.budget import GENERIC_CANDIDATES, AutoResult, make_loss_checked
from remat_kit.planning.engine import Choice
from remat_kit.planning.engine import group_names as group_names  # re-exported
from remat_kit.planning.planner import DEFAULT_MARGIN, Budget, StepPlanner, get_optimizer, is_built_in
from remat_kit.policies import findings
from remat_kit.unedited import entry as unedited_lib
from remat_kit.unedited import guard
from remat_kit.units import check_int, parse_bytes

#: The compiles :func:`fit` spends at most (:data:`remat_kit.planning.engine.MAX_COMPILES`).
MAX_COMPILES = engine.MAX_COMPILES


class NothingFits(ValueError):
    """No plan fits the budget: the one-line refusal (its message), with the leanest need found.

    Attributes:
      need_bytes: the least compiled need found; leanest: its spec.
    """

    def __init__(self, message: str, need_bytes: int, leanest: str):
        super().__init__(message)
        self.need_bytes, self.leanest = need_bytes, leanest


def auto(
    model: Any,
    *args,
    budget_bytes: int,
    optimizer: str | optax.GradientTransformation = "adamw",
    candidates: Sequence[policies.Policy | str] | None = None,
    margin: float = DEFAULT_MARGIN,
    exhaustive: bool = False,
    planner: StepPlanner | None = None,
    jobs: int = 1,
    batch: int | None = None,
    seq: int | None = None,
    loss_chunks: int = 0,
    mixes: bool = True,
    hardware: cost.Hardware | None = None,
    tiles: Sequence[int] | None = None,
    target=None,
) -> AutoResult:
    """``plan --budget``'s table: a pool of whole-step policies compiled side by side against a budget; a front.

    ``auto`` is no second way to fit a budget: with the default candidates, its answer (``.chosen``, ``.seq_tiles``,
    ``.reason``) is :func:`fit`'s engine's (:func:`remat_kit.planning.engine.plan`; on the built-in model through
    :func:`remat_kit.planning.tensors.config_choice`, sequence tiles its lever; on a ``make_loss`` whose
    rematerialized blocks name values, uniform over the layers), the pool's rows beside it as the table. What
    ``auto`` adds is the comparison: every candidate of a pool priced by the cost model and compiled against the
    budget, for a table and a plot (:meth:`~remat_kit.planning.budget.AutoResult.plot`). A pool you give
    (``candidates=``) is searched as a pool (:func:`remat_kit.planning.budget.search`, the one search of a pool
    given by hand), as is a ``make_loss`` that names nothing. Migration: ``auto(...).chosen`` is
    ``fit(...).policy`` when what you want is the plan that fits; write ``fit``.

    Two forms, told apart by the first argument:

    * ``auto(make_loss, params, *batch_args, budget_bytes=...)``: any model. ``make_loss(policy)``
      returns ``loss_fn(params, *batch_args) -> scalar``; the inputs may be ShapeDtypeStructs.
    * ``auto(config, batch=..., seq=..., budget_bytes=...)``: the built-in Transformer (a
      convenience over the first form; ``loss_chunks`` selects the chunked loss).

    The step planned is the one ``train`` runs (:mod:`remat_kit.step.update`): gradient, clipping and the
    optimizer update, parameters and optimizer state donated. A candidate's need is the compiled
    step's peak (arguments + outputs − aliased + temp), never its saved bytes alone.

    Args:
      budget_bytes: device memory available, in bytes (see :func:`remat_kit.units.parse_bytes`).
      optimizer: its state counts toward the budget; a name in :data:`OPTIMIZERS` or an optax one.
      candidates: what to consider (default: :func:`remat_kit.planning.builtin.candidates_for` for a config,
        :data:`GENERIC_CANDIDATES` otherwise).
      margin: safety margin: a candidate fits when ``need · (1 + margin) <= budget``.
      exhaustive: compile every candidate instead of stopping at the cheapest fitting group
        (same answer; for checking the search and for full tables).
      planner: reuse a :class:`StepPlanner`'s memoized compiles.
      jobs: candidates compiled at once when ``exhaustive``.
      mixes: for a config, also consider mixes (:func:`remat_kit.policies.mix`) of two Pareto-optimal
        candidates on either side of the budget (see :func:`best_mix`): between two presets' needs the
        answer is then the mix with the least recompute that fits, measured by one more compile or a few.
      hardware: what recompute is priced against (default: :func:`remat_kit.planning.cost.default_hardware`
        of the backend; :func:`remat_kit.planning.cost.calibrate` measures this machine).
      tiles: for a config whose ``seq_tiles`` is 1, the sequence-tile counts tried when nothing fits untiled
        (default :func:`remat_kit.planning.tiles.tile_counts`; ``()`` tries none): the search runs again with the
        blocks in each, most tiles first, every tiled candidate priced over the untiled ``none``, and
        :attr:`AutoResult.seq_tiles` says the count chosen. A budget that fits untiled tries no tiles (they add time).
      target: the device planned for (:func:`remat_kit.target.parse`; default ``"local"``): on a GPU target every
        need is XLA:GPU's own, offloaded bytes leave the device, and the host copies are priced by its link.

    Returns:
      An :class:`remat_kit.planning.budget.AutoResult`; ``chosen`` (a Policy or a Mix) is None when nothing fits, and
      ``reason`` then says what is needed, what was given and which levers remain.

    Raises:
      TypeError/ValueError: bad budget, margin, jobs, inputs or policies (an empty ``candidates`` too), before
        anything is compiled; an NNX module among the inputs that holds a policy of its own (every row would
        measure that one: :func:`remat_kit.analysis.inspection.refuse_baked_nnx`).

    >>> from remat_kit.model.transformer import TransformerConfig
    >>> r = auto(TransformerConfig.preset("tiny"), batch=2, seq=32, budget_bytes=parse_bytes("1GB"))
    >>> str(r.chosen), r.candidates[0].cost_s  # ample budget: nothing recomputed
    ('none', 0.0)
    """
    budget = Budget(budget_bytes, margin)
    check_int("jobs", jobs)
    if candidates is not None and not isinstance(candidates, str) and len(candidates) == 0:
        # Not "the default candidates": an empty list would be read as None, and `none` chosen unasked.
        raise ValueError("candidates=[] names no policy; give at least one, or None for the default candidates")
    wanted = candidates
    if is_built_in(model, "TransformerConfig"):
        planner = planner or builtin.Planner(model, optimizer, loss_chunks, target=target)
        kw = {"optimizer": optimizer, "planner": planner, "batch": batch, "seq": seq, "loss_chunks": loss_chunks}
        kw.update(exhaustive=exhaustive, jobs=jobs, hardware=hardware, mixes=mixes, target=target)
        if wanted is not None:  # a pool given by hand: its own search (tiles when nothing fits)
            return builtin.auto_config(model, args, budget, candidates=wanted, tiles=tiles, **kw)
        # The presets side by side (untiled), and the plan that fits: the engine's, as for fit (tiles its lever).
        table = builtin.auto_config(model, args, budget, candidates=None, tiles=(), **kw)
        choice = tensors.config_choice(
            model,
            budget,
            batch=batch,
            seq=seq,
            planner=planner,
            loss_chunks=loss_chunks,
            hardware=table.hardware,
            tiles=tiles,
        )
        return with_choice(table, choice)
    if not callable(model):
        raise TypeError(f"auto's first argument must be a TransformerConfig or make_loss(policy), got {model!r}")
    if batch is not None or seq is not None or loss_chunks:
        raise TypeError("batch=, seq= and loss_chunks= belong to auto(config, ...); give make_loss its inputs")
    if not args:
        raise TypeError("auto(make_loss, params, *batch_args, ...) needs the loss's inputs (params first)")
    inspection.refuse_baked_nnx(args, "auto")
    inputs = inspection.abstract(args)
    pool = [policies.parse(p) for p in (wanted or GENERIC_CANDIDATES)]
    inspection.check_loss(make_loss_checked(model, pool[0]), inputs)
    planner = planner or StepPlanner(lambda p, b, s: (model(p), inputs[0], inputs[1:]), optimizer, target=target)
    table = budget_lib.search(planner, pool, budget, exhaustive=exhaustive, jobs=jobs, hardware=hardware)
    if wanted is not None:
        return table
    # The plan that fits is the engine's where the loss's rematerialized blocks name values to keep (per tensor,
    # uniform over the layers: a make_loss need not run a mix); a loss that names none is answered from the pool.
    try:
        choice = engine.plan(planner, budget, mixes=False, hardware=table.hardware)
    except ValueError:
        return table
    return with_choice(table, choice)


def with_choice(table: AutoResult, choice: Choice) -> AutoResult:
    """``table`` (the presets compiled side by side) answering with the engine's ``choice``: its plan, tile count and
    reason where they differ from the table's best, and the plans the engine compiled as rows (a row the table
    priced but did not compile takes the engine's compiled figures)."""
    rows = list(table.candidates)
    at = {(c.policy, c.seq_tiles): i for i, c in enumerate(rows)}
    for c in choice.candidates:
        if c.need_bytes is None:
            continue
        i = at.get((c.policy, c.seq_tiles))
        if i is None:
            at[(c.policy, c.seq_tiles)] = len(rows)
            rows.append(c)
        elif rows[i].need_bytes is None:
            rows[i] = dataclasses.replace(rows[i], need_bytes=c.need_bytes, host_bytes=c.host_bytes, fits=c.fits)
    same = (str(choice.chosen), choice.seq_tiles) == (str(table.chosen), table.seq_tiles)
    return dataclasses.replace(
        table,
        chosen=choice.chosen,
        seq_tiles=choice.seq_tiles,
        candidates=tuple(rows),
        reason=table.reason if same else choice.reason,
        compiled=table.compiled + choice.compiles,
        seconds=table.seconds + choice.seconds,
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
        config carries them. Always 1 for a user's model (see ``long``).
      long: for a model remat_kit did not build, the long-context levers the plan needed (``{"query_blocks":
        "auto", "seq_tiles": "auto"}``: :func:`remat_kit.apply`'s attention in query blocks and per-token
        submodules in tiles, tried only when no plan fits without them), or None; ``model`` carries them.
    """

    model: Any
    policy: str
    need_bytes: int
    est_step_time_s: float
    candidates: tuple
    choice: Choice
    seq_tiles: int = 1
    findings: tuple[str, ...] = ()
    long: dict | None = None

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


def as_given(model, loss_fn: Callable, params, batch_args: tuple) -> Callable:
    """A :class:`StepPlanner` build of the model exactly as given: no apply, no guard, what the user runs."""
    loss = unedited_lib.params_loss(model, loss_fn)
    return lambda policy, batch, seq: (loss, params, batch_args)


#: The long-context levers fit offers an unedited model when no plan fits without them (issue 48):
#: attention in blocks of queries and the per-token submodules in sequence tiles, through :func:`remat_kit.apply`.
LONG_LEVERS = {"query_blocks": "auto", "seq_tiles": "auto"}


def _fit_unedited(
    model, loss_fn, inputs, B, optimizer, scan, where, static_argnames, hardware, max_compiles, target, progress
):
    """fit on a model remat_kit did not build: the engine over its blocks' names; when nothing fits, once more with
    :data:`LONG_LEVERS` (their compiles on top: the one case, with the built-in model's tiles, past three).
    Returns ``(choice, applied, findings, levers)``: ``applied(policy)`` the model under it, ``levers`` the
    long-context levers the answer needs or None."""
    is_nnx = isinstance(model, nnx.Module)
    params = nnx.state(model, nnx.Param) if is_nnx else inputs[0]
    params = inspection.abstract((params,))[0]
    batch_args = inputs if is_nnx else inputs[1:]

    def run(long: dict):
        kwargs = {"where": where, "static_argnames": static_argnames, **long}
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
                try:  # the loss alone traced (the engine prices this trace): apply raises where it cannot scan
                    planner.forward_jaxpr(policies.full())
                except ValueError:
                    if s is False or scan is not None:
                        raise
                    continue
                scanned[0] = s
                return planner
            raise AssertionError("unreachable")

        given = StepPlanner(as_given(model, loss_fn, params, batch_args), optimizer, target=target)
        # apply's guard on a candidate is a line of the result, not an error; it verifies the stack's first policy,
        # and the engine's later ones (names the same blocks emit) take its verdict: their compiles show what they keep.
        with findings.collect() as found, guard.verified_once():
            choice = engine.plan(
                stack,
                B,
                plain=planner_of(False) if long else given,
                hardware=hardware,
                max_compiles=max_compiles,
                progress=progress,
            )

        def applied(p):
            if p == policies.none() and not long:
                return model
            return unedited_lib.apply(model, p, scan=scanned[0], **kwargs)

        return choice, applied, found, dict(long) or None

    choice, applied, found, long = run({})
    if choice.chosen is None:
        if progress is not None:
            progress(f"[fit] nothing fits as written: again with {LONG_LEVERS}")
        try:
            longer = run(LONG_LEVERS)
        except ValueError as err:  # no attention, no per-token part: the levers do not apply
            found.append(f"the long-context levers {LONG_LEVERS} do not apply: {err}")
        else:
            least = lambda c: min((x.need_bytes for x in c.candidates if x.need_bytes is not None), default=None)
            if longer[0].chosen is not None or (least(longer[0]) or 0) < (least(choice) or 0):
                # Nothing fits either way: the refusal names the leaner search's leanest plan (the levers').
                longer[2].extend(found)
                if longer[0].chosen is None:
                    longer[2].append(f"nothing fits even with the long-context levers {LONG_LEVERS}")
                return longer
    return choice, applied, found, long


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
    At most three XLA compiles (``max_compiles``), sequence tiles of the built-in model aside, and one more where
    the solver's answer compiles over the budget while only ``full``'s gradient was compiled (full's step then
    verifies the fallback).

    Sequence tiles: for the built-in Transformer (``seq_tiles=1``) tiles are a lever like the others: when no plan fits
    untiled, the blocks' per-token parts are tried in sequence tiles
    (:func:`remat_kit.planning.tensors.config_choice`) and ``.model`` carries the tile count chosen
    (``.seq_tiles``). On any other model the long-context levers of :func:`remat_kit.apply` (attention in blocks of
    queries, per-token submodules in tiles: :data:`LONG_LEVERS`) are tried when no plan fits without them, no code
    edited; ``.long`` says when the answer needs them.

    Args:
      budget: device bytes (an int) or a size string (``"16GB"``, ``"512MiB"``).
      optimizer: a name (``"adamw"``, ``"sgd"``, ...) or an optax transformation; its state counts.
      scan, where, static_argnames: as :func:`remat_kit.apply` (``scan=None``: scan the blocks where they can be,
        the only way a Python loop's recompute survives XLA on CPU).
      margin: a plan fits when its compiled need times ``1 + margin`` is at most the budget.
      max_compiles: at most this many XLA compiles (at least 2; a 4th, if allowed, verifies a refitted answer where
        the first missed; from 3, a user's stack calibrates on ``full``'s gradient alone).
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
    long = None  # the long-context levers an unedited model's answer needs (the built-in model tiles its own)
    if is_built_in(model, "Transformer"):  # the built-in model: its own policy field, its own stack and tags
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
        choice, applied, found, long = _fit_unedited(
            model, loss_fn, inputs, B, optimizer, scan, where, static_argnames, hardware, max_compiles, target, progress
        )
    if choice.chosen is None:
        least = min((c for c in choice.candidates if c.need_bytes is not None), key=lambda c: c.need_bytes)
        raise NothingFits(choice.reason, least.need_bytes, least.policy)
    choice = dataclasses.replace(choice, seconds=time.perf_counter() - start)
    return FitResult(
        model=applied(choice.chosen),
        long=long,
        policy=str(choice.chosen),
        need_bytes=choice.need_bytes,
        est_step_time_s=choice.est_step_time_s,
        candidates=choice.candidates,
        choice=choice,
        seq_tiles=choice.seq_tiles,
        findings=tuple(found),
    )
