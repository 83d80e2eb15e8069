"""A pool of policies compiled side by side against a memory budget: the table's search, compile-only.

:func:`search` is :func:`remat_kit.planning.fit.auto`'s (``remat_kit.auto``, the front that keeps the table of
``plan --budget``; the plan that fits is :func:`remat_kit.fit`'s). Every candidate
policy's training step is traced (cheap) and priced by the cost model (:mod:`remat_kit.planning.cost`):
the estimated step time of every op it recomputes over ``none`` (softmax, norms and activations
included, not matmuls alone) plus its exposed host transfers. Candidates are then compiled in order of
increasing cost, from ShapeDtypeStructs, until the cheapest group that fits is found. "Fits" means the
compiled step's device bytes — weights, gradients, optimizer state and activations (arguments + outputs
− aliased + temp of ``Compiled.memory_analysis()``) — times ``1 + margin`` are at most the budget. The
winner is the fitting candidate with the least estimated cost, ties going to less recompute of any kind
(FLOPs, then bytes, then offloaded bytes) and then to less memory. On a backend where offload moves
nothing (XLA:CPU) an offload candidate saves no memory and is never chosen.
:func:`remat_kit.planning.builtin.max_fit` finds the largest batch or the longest sequence a policy fits;
:meth:`AutoResult.table` and :meth:`AutoResult.plot` show the candidates. The compiles are
:class:`remat_kit.planning.planner.StepPlanner`'s.

>>> import jax, jax.numpy as jnp
>>> make_loss = lambda policy: (lambda w, x: jnp.sum(policy(lambda w, x: jnp.tanh(x @ w))(w, x) ** 2))
>>> w, x = jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.float32)
>>> planner = StepPlanner(lambda p, b, s: (make_loss(p), w, (x,)))
>>> str(search(planner, [policies.none(), policies.full()], Budget(10**9)).chosen)
'none'
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from remat_kit import constants, policies
from remat_kit import names as names_lib
from remat_kit.analysis import explain, inspection, memory
from remat_kit.planning import cost
from remat_kit.planning.pareto import pareto_front
from remat_kit.planning.planner import Budget, StepPlanner
from remat_kit.units import fmt_bytes, fmt_bytes_beside, fmt_flops, fmt_seconds
from remat_kit.units import parse_bytes as parse_bytes  # re-exported: remat_kit.planning.budget.parse_bytes

#: What the columns of :meth:`AutoResult.table` mean.
BUDGET_LEGEND = (
    "peak = the compiled step's device bytes at its peak, arguments + outputs − aliased + temp (weights, gradients, "
    "optimizer state, activations and the recompute working set): what must fit; recompute = matmul FLOPs beyond "
    "`none`; est. = the cost model's step-time cost over `none` (every recomputed op at max(FLOPs/peak, "
    "bytes/bandwidth), plus exposed host transfers): what ranks the candidates.\n"
)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One policy's cost at one shape.

    Attributes:
      policy: the spec string.
      flops: matmul FLOPs of the step (scan-aware, from the jaxpr).
      recompute_flops: ``flops`` minus those of ``none``: the price of the policy.
      need_bytes: device bytes of the compiled step (None when it was not compiled).
      host_bytes: host-memory bytes (offloaded residuals), None when not compiled.
      fits: ``need_bytes · (1 + margin) <= budget``; None when not compiled.
      recompute_s: the cost model's seconds of the ops recomputed over ``none``.
      offload_s: its exposed seconds of host transfers (0 where offload moves nothing).
      recompute_bytes: bytes the recomputed ops read and write.
      rank: the sort key (:attr:`remat_kit.planning.cost.Estimate.rank`).
      trips_s: its dispatch seconds of the loop trips it runs beyond ``none``'s.
      seq_tiles: the sequence tiles the step runs its blocks in (1: untiled; see
        :attr:`remat_kit.model.transformer.TransformerConfig.seq_tiles`).
      tiles_s: what running in ``seq_tiles`` tiles costs over the untiled step (the tiled ``none``'s extra ops and
        loop trips over the untiled ``none``'s); 0 untiled.
    """

    policy: str
    flops: int
    recompute_flops: int
    need_bytes: int | None = None
    host_bytes: int | None = None
    fits: bool | None = None
    recompute_s: float = 0.0
    offload_s: float = 0.0
    recompute_bytes: int = 0
    rank: tuple = ()
    trips_s: float = 0.0
    seq_tiles: int = 1
    tiles_s: float = 0.0

    @property
    def cost_s(self) -> float:
        """The estimated step-time cost over the untiled ``none``: recompute, exposed offload, extra loop trips and
        (tiled) the tiles' own cost."""
        return self.recompute_s + self.offload_s + self.trips_s + self.tiles_s

    def is_plan(self, chosen, seq_tiles: int) -> bool:
        """Whether this row is the plan ``chosen`` (a Policy, a Mix or None) run in ``seq_tiles`` tiles."""
        return chosen is not None and self.policy == str(chosen) and self.seq_tiles == seq_tiles

    @property
    def label(self) -> str:
        """The policy's spec, with its tile count when tiled (``full @4 tiles``): what a table shows."""
        return self.policy if self.seq_tiles == 1 else f"{self.policy} @{self.seq_tiles} tiles"


@dataclasses.dataclass(frozen=True)
class AutoResult:
    """The choice and how it was made.

    Attributes:
      chosen: the winning policy, or None when nothing fits.
      budget_bytes, margin: the budget and the safety margin applied to each need.
      batch, seq, loss_chunks, optimizer: the step that was planned (batch and seq None for a
        model given as ``make_loss``).
      candidates: every candidate, in the order considered (least recompute first), then the mixes
        compiled to verify the mixed front (:func:`best_mix`), if any.
      reason: one paragraph: why the winner won, or what is needed and the levers if nothing fits.
      compiled: how many candidates were compiled; seconds: wall time of the search.
    """

    chosen: policies.Policy | policies.Mix | None
    budget_bytes: int
    margin: float
    batch: int | None
    seq: int | None
    loss_chunks: int
    optimizer: str
    candidates: tuple[Candidate, ...]
    reason: str
    compiled: int
    seconds: float
    #: The mixed front: ``(a, b, need_a, need_b, recompute_a, recompute_b)`` for each Pareto-optimal pair a mix
    #: was interpolated on (a recomputes less, b needs less); what a plot draws between presets.
    mixed_front: tuple[tuple[str, str, int, int, int, int], ...] = ()
    #: The throughputs the candidates were priced against (:class:`remat_kit.planning.cost.Hardware`).
    hardware: cost.Hardware | None = None
    #: Caveats a reader needs: where XLA removed a candidate's recompute (:func:`cse_notes`).
    notes: tuple[str, ...] = ()
    #: The sequence tiles the chosen step runs its blocks in (1: untiled); a table's rows carry their own.
    seq_tiles: int = 1
    #: The device planned for (:func:`remat_kit.target.parse`): ``"local"``, or a GPU compiled for without one.
    target: str = "local"

    def is_chosen(self, c: Candidate) -> bool:
        """Whether ``c`` is the chosen row: its policy and its tile count."""
        return c.is_plan(self.chosen, self.seq_tiles)

    @property
    def budget(self) -> Budget:
        """The budget and margin the candidates were held to."""
        return Budget(self.budget_bytes, self.margin)

    def table(self, fit: dict[str, tuple] | None = None) -> list[str]:
        """``plan --budget``'s table (:data:`BUDGET_LEGEND`): each candidate's recompute, peak, peak with the
        margin, whether it fits and (``fit``) the largest batch and sequence that fit; the chosen one marked
        ``*``; then the notes."""
        fit = fit or {}
        budget = self.budget
        width = max(len(c.label) for c in self.candidates) + 1
        head = (
            f"{'policy':{width + 1}} {'recompute':>10} {'est.':>10} {'peak':>10} {'+margin':>10} {'host':>10} "
            f"{'fits':>5}"
        )
        if fit:
            head += f" {'max batch @seq ' + str(self.seq):>18} {'max seq @batch ' + str(self.batch):>18}"
        rows = [head, "-" * len(head)]
        for c in self.candidates:
            mark = "*" if self.is_chosen(c) else " "
            compiled = c.need_bytes is not None
            fits = "-" if c.fits is None else "yes" if c.fits else "no"
            row = (
                f"{mark}{c.label:{width}} {fmt_flops(c.recompute_flops):>10} {fmt_seconds(c.cost_s):>10} "
                f"{fmt_bytes(c.need_bytes) if compiled else '-':>10} "
                f"{fmt_bytes_beside(budget.with_margin(c.need_bytes), budget.bytes) if compiled else '-':>10} "
                f"{fmt_bytes(c.host_bytes) if compiled else '-':>10} {fits:>5}"
            )
            if fit:  # the limits are the untiled step's
                known = c.policy in fit and c.seq_tiles == 1
                row += "".join(f" {fit[c.policy][k] if known else '-':>18}" for k in (0, 1))
            rows.append(row)
        if self.mixed_front:
            pairs = ", ".join(f"{a} → {b}" for a, b, *_ in self.mixed_front)
            rows.append(
                f"mixed front (mixes of neighbours, policies.mix): {pairs}; rows with '*COUNT' are mixes compiled."
            )
        note = memory.host_offload().note if self.target in ("local", "cpu") else None  # a GPU target moves them
        offloading = [c for c in self.candidates if _kind(c.policy) and _has_offload(policies.parse(c.policy))]
        if note and offloading:
            rows.append(f"note: {note}; offload candidates are never chosen here.")
        rows += [f"note: {n}" for n in self.notes]
        if self.hardware is not None:
            rows.append(self.hardware.describe() + ".")
        return rows

    def plot(self, path: str) -> str:
        """Write a PNG of device memory against recompute FLOPs, the Pareto front drawn, the choice marked.

        Only compiled candidates have a memory figure; the budget is drawn as a horizontal line. The front's
        segments are the mixed front (mixes of two neighbours, :func:`remat_kit.planning.budget.best_mix`); mixes
        compiled are diamonds.

        Returns:
          ``path``.
        """
        import matplotlib  # late: an optional heavy dependency, only for the plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [c for c in self.candidates if c.need_bytes is not None]
        # One unit for the axis: GB when the figures reach it, MB below (a tiny model's 0.004 GB reads badly).
        scale, unit = (1e9, "GB") if max([c.need_bytes for c in rows] + [self.budget.target]) >= 1e9 else (1e6, "MB")
        xs = [c.cost_s * 1e3 for c in rows]
        ys = [c.need_bytes / scale for c in rows]
        # The axes on the left, the numbered key of the points on the right: a number beside each point, not its
        # (long, often overlapping) spec.
        fig = plt.figure(figsize=(11, 5.5))
        ax = fig.add_axes((0.08, 0.11, 0.55, 0.77))
        one = [i for i, c in enumerate(rows) if "*" not in c.policy]  # single policies; mixes are drawn below
        colors = ["tab:green" if rows[i].fits else "tab:red" for i in one]
        ax.scatter([xs[i] for i in one], [ys[i] for i in one], c=colors, zorder=3)
        front = sorted((one[j] for j in pareto_front([(xs[i], ys[i]) for i in one])), key=lambda i: xs[i])
        # Mixes of neighbours on the front lie (very nearly) on the segments between them: the mixed front.
        label = "mixed front (mixes of neighbouring policies)" if self.mixed_front else "Pareto front"
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="gray", label=label, zorder=2)
        mixed = [i for i, c in enumerate(rows) if "*" in c.policy]
        if mixed:
            ax.scatter(
                [xs[i] for i in mixed],
                [ys[i] for i in mixed],
                marker="D",
                s=40,
                facecolors="none",
                edgecolors=["tab:green" if rows[i].fits else "tab:red" for i in mixed],
                label="mixes compiled",
                zorder=3,
            )
        ax.axhline(self.budget.target / scale, color="tab:orange", label=f"budget / (1 + {self.margin:.0%} margin)")
        if self.chosen is not None:
            win = next(i for i, c in enumerate(rows) if self.is_chosen(c))
            ax.scatter(
                [xs[win]],
                [ys[win]],
                s=250,
                facecolors="none",
                edgecolors="black",
                linewidths=2,
                label=f"chosen: {_short(rows[win].label)}",
                zorder=4,
            )
        ax.set_xlabel("estimated recompute cost per step (ms over `none`, cost model)")
        ax.set_ylabel(f"compiled step peak ({unit})")
        ax.set_title(
            f"policies at batch {self.batch} x seq {self.seq} (green fits, red does not)\n"
            "peak = arguments + outputs − aliased + temp",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        _number_points(fig, ax, xs, ys, ringed=[] if self.chosen is None else [win])
        key = "\n".join(f"{i + 1:>2}  {_short(c.label)}" for i, c in enumerate(rows))
        fig.text(0.65, 0.88, key, va="top", ha="left", fontsize=7, family="monospace")
        fig.legend(*ax.get_legend_handles_labels(), loc="lower left", bbox_to_anchor=(0.645, 0.1), fontsize=8)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record; ``chosen`` is the winner's spec string (or None)."""
        return {
            "chosen": None if self.chosen is None else str(self.chosen),
            "seq_tiles": self.seq_tiles,
            "budget_bytes": self.budget_bytes,
            "margin": self.margin,
            "batch": self.batch,
            "seq": self.seq,
            "loss_chunks": self.loss_chunks,
            "optimizer": self.optimizer,
            "reason": self.reason,
            "compiled": self.compiled,
            "seconds": self.seconds,
            "candidates": [{**dataclasses.asdict(c), "cost_s": c.cost_s} for c in self.candidates],
            "mixed_front": [list(pair) for pair in self.mixed_front],
            "hardware": None if self.hardware is None else dataclasses.asdict(self.hardware),
            "notes": list(self.notes),
        }


#: The policies :func:`remat_kit.planning.fit.auto` tries for a model it did not build (``make_loss(policy)``): those
#: that need no tags and no knowledge of the depth.
GENERIC_CANDIDATES: tuple[str, ...] = constants.GENERIC_CANDIDATES


def _kind(spec: str) -> str:
    """The kind of the policy a candidate's spec names, "" for one that cannot be parsed back (a JAX
    policy given as a callable: :func:`remat_kit.policies.from_jax`)."""
    try:
        return policies.parse(spec).kind
    except ValueError:
        return ""


def make_loss_checked(make_loss: Callable, policy: policies.Policy) -> Callable:
    """``make_loss(policy)``, or a TypeError saying what ``make_loss`` must return."""
    loss_fn = make_loss(policy)
    if not callable(loss_fn):
        raise TypeError(f"make_loss(policy) must return a loss function, got {type(loss_fn).__name__}")
    return loss_fn


def search(
    planner: StepPlanner,
    pool: Sequence[policies.Policy],
    budget: Budget,
    *,
    exhaustive: bool = False,
    batch: int | None = None,
    seq: int | None = None,
    loss_chunks: int = 0,
    jobs: int = 1,
    num_layers: int | None = None,
    hardware: cost.Hardware | None = None,
) -> AutoResult:
    """:func:`remat_kit.planning.fit.auto`'s search over ``pool`` with ``planner`` at one shape: candidates in order of
    estimated cost (traced, cheap), compiled group by group until the cheapest group that fits; then, given
    the stack's ``num_layers``, the best mix of two compiled Pareto-optimal candidates (:func:`best_mix`)."""
    start = time.perf_counter()
    hardware = hardware or planner.hardware
    price = Pricer(planner, hardware, batch, seq)
    compiles_before = planner.compiles
    order = sorted(pool, key=lambda p: price.rank(p))
    if exhaustive:
        planner.precompile([(p, batch, seq) for p in order], jobs=jobs)

    rows: dict[str, Candidate] = {}
    chosen = None
    i = 0
    while i < len(order):
        group_rank = price.rank(order[i])
        group = [p for p in order[i:] if price.rank(p) == group_rank]
        i += len(group)
        for p in group:
            rows[str(p)] = price.candidate(p, budget)
        fitting = [p for p in group if rows[str(p)].fits and price.choosable(p)]
        if fitting and chosen is None:
            chosen = min(fitting, key=lambda p: rows[str(p)].need_bytes)
            if not exhaustive:
                break
    for p in order:  # the ones the search never needed to compile
        if str(p) not in rows:
            rows[str(p)] = price.candidate(p, None)
    table = tuple(rows[str(p)] for p in order)
    front: tuple = ()
    if num_layers is not None and chosen is not None:
        found, tried, front = best_mix(
            planner, table, rows[str(chosen)], num_layers, budget, batch=batch, seq=seq, price=price
        )
        table += tuple(c for c in tried if c.policy not in rows)
        if found is not None:
            chosen = found
    notes = cse_notes(planner, order, table, batch=batch, seq=seq)
    return AutoResult(
        chosen=chosen,
        budget_bytes=budget.bytes,
        margin=budget.margin,
        batch=batch,
        seq=seq,
        loss_chunks=loss_chunks,
        optimizer=planner.optimizer_name,
        candidates=table,
        reason=why_chosen(chosen, table, budget, loss_chunks, transformer=batch is not None),
        compiled=planner.compiles - compiles_before,
        seconds=time.perf_counter() - start,
        mixed_front=front,
        hardware=hardware,
        notes=notes,
        target=str(planner.target),
    )


def cse_notes(
    planner: StepPlanner,
    pool: Sequence[policies.Policy],
    table: Sequence[Candidate],
    *,
    batch: int | None = None,
    seq: int | None = None,
) -> tuple[str, ...]:
    """A note for each compiled candidate whose step rematerializes outside a loop (a Python loop of blocks)
    and whose JAX residuals drop under ``none``'s while the compiled temp memory barely does, with the
    measured reason: where the step peaks in the optimizer update, remat cannot move that peak
    (:func:`remat_kit.analysis.explain.optimizer_peak_note`); elsewhere XLA removed the recompute
    (:func:`remat_kit.analysis.explain.cse_note`). Traces the losses' residuals; compiles ``none``'s step if
    it was not compiled (only when some candidate keeps less than it), and a noted candidate's step once more
    with XLA's dump (to read what is live at its peak).

    Args:
      planner: the planner ``table`` was compiled with; ``pool``: the candidates' policies.
      table: the candidates (only compiled ones are looked at).
    """
    by_spec = {str(p): p for p in pool}
    loop = [
        by_spec[c.policy]
        for c in table
        if c.need_bytes is not None
        and c.policy in by_spec
        and planner.remat_outside_loops(by_spec[c.policy], batch, seq)
    ]
    if not loop:
        return ()

    def saved(policy) -> int:
        loss_fn, params, batch_args = planner.build(policy, batch, seq)
        return inspection.split_saved(inspection.residuals(loss_fn, params, *batch_args))[0]

    none = policies.none()
    base = saved(none)
    drops = [(p, base - saved(p)) for p in loop]
    if all(drop <= 0 for _, drop in drops):
        return ()
    base_temp = planner.compiled_memory(none, batch, seq).temp
    notes = []
    for p, drop in drops:
        note = explain.cse_note(str(p), drop, base_temp - planner.compiled_memory(p, batch, seq).temp)
        if note:
            # The reason is read from what is live at the step's peak: in the optimizer update, remat cannot move
            # it (the recompute survived); anywhere else, XLA merged the recompute away.
            peak = planner.explanation(p, batch, seq)
            note = explain.optimizer_peak_note(str(p), drop, peak.peak_at) if peak.peak_phase == "optimizer" else note
            notes.append(note)
    return tuple(notes)


def planner_platform(planner: StepPlanner) -> str:
    """The backend a planner compiles for (its mesh's devices, or JAX's default)."""
    return planner.mesh.devices.flat[0].platform if planner.mesh is not None else jax.default_backend()


def device_twin(policy: policies.Policy | policies.Mix) -> policies.Policy | None:
    """The policy that keeps on the device what ``policy`` offloads (None for a mix).

    >>> str(device_twin(policies.offload())), str(device_twin(policies.offload(["q_proj"], save=["mlp_up"])))
    ('full', 'selective:mlp_up,q_proj')
    """
    if not isinstance(policy, policies.Policy) or policy.kind != "offload":
        return None
    kept = [t for t in (*policy.save, *policy.offload) if t != names_lib.LAYER_INPUT]  # a scan keeps layer inputs
    return policies.selective(kept, strict=policy.strict) if kept else policies.full()


def _has_offload(policy: policies.Policy | policies.Mix) -> bool:
    parts = policy.policies
    return any(p.kind == "offload" for p in parts)


class Pricer:
    """Prices policies on one planner at one shape: the cost model's estimate over ``none`` and the compiled need.

    Args:
      planner: whose traces (op counts) and compiles are used, memoized there.
      hardware: the throughputs (:class:`remat_kit.planning.cost.Hardware`).
      batch, seq: the shape (None for a model planned at one fixed shape).
    """

    def __init__(self, planner: StepPlanner, hardware: cost.Hardware, batch: int | None, seq: int | None):
        self.planner, self.hardware, self.batch, self.seq = planner, hardware, batch, seq
        self.host_moves = memory.host_offload(
            planner.mesh.devices.flat[0] if planner.mesh is not None else None
        ).enforced
        self._base = planner.work(policies.none(), batch, seq)
        self._base_flops = planner.flops(policies.none(), batch, seq)
        self._estimates: dict[str, cost.Estimate] = {}

    def estimate(self, policy) -> cost.Estimate:
        """The cost model's estimate of ``policy`` over ``none`` (trace only)."""
        key = str(policy)
        if key not in self._estimates:
            work = self.planner.work(policy, self.batch, self.seq)
            self._estimates[key] = cost.estimate(work, self._base, self.hardware, host_moves=self.host_moves)
        return self._estimates[key]

    def rank(self, policy) -> tuple:
        """The sort key: estimated cost, then less recompute of any kind."""
        return self.estimate(policy).rank

    def choosable(self, policy) -> bool:
        """Whether an offload policy may be chosen: never where offload moves nothing (XLA:CPU: it saves no memory
        there), and once compiled only if its device need is below its twin's, the policy that keeps the same tags
        on the device (:func:`device_twin`, one more compile): offload must lower the device need on the target."""
        if not _has_offload(policy):
            return True
        twin = device_twin(policy) if self.host_moves else None
        compiled = self.planner.compiled_needs(self.batch, self.seq)
        if twin is None or str(policy) not in compiled:
            return self.host_moves
        return compiled[str(policy)] < self.planner.memory(twin, self.batch, self.seq)[0]

    def candidate(self, policy, budget: Budget | None) -> Candidate:
        """``policy``'s row; compiled (need, host, fits) when ``budget`` is given."""
        f = self.planner.flops(policy, self.batch, self.seq)
        e = self.estimate(policy)
        extra = {
            "recompute_s": e.recompute_s,
            "offload_s": e.offload_s,
            "recompute_bytes": e.recompute_bytes,
            "rank": e.rank,
            "trips_s": e.trips_s,
        }
        if budget is None:
            return Candidate(str(policy), f, f - self._base_flops, **extra)
        device, host = self.planner.memory(policy, self.batch, self.seq)
        return Candidate(str(policy), f, f - self._base_flops, device, host, budget.fits(device), **extra)


def _mix_range(a: policies.Policy, b: policies.Policy, num_layers: int) -> range:
    """The counts k for which ``mix([(a, k), (b, L - k)])`` is valid (each part fits its layers)."""
    ok = []
    for k in range(1, num_layers):
        try:
            policies.mix([(a, k), (b, num_layers - k)]).validate_depth(num_layers)
        except ValueError:
            continue
        ok.append(k)
    return range(ok[0], ok[-1] + 1) if ok else range(0)


def best_mix(
    planner: StepPlanner,
    table: Sequence[Candidate],
    best: Candidate,
    num_layers: int,
    budget: Budget,
    *,
    batch: int | None = None,
    seq: int | None = None,
    max_compiles: int = 6,
    price: Pricer | None = None,
) -> tuple[policies.Mix | None, tuple[Candidate, ...], tuple]:
    """The mix with the least estimated cost that fits, when it costs strictly less than ``best``.

    The compiled candidates' Pareto front (need vs estimated cost) is cut by the budget: every pair of a
    front point over it (``a``, less cost) and one under it (``b``) is a line of mixes
    ``a*k+b*(L-k)``, whose need and cost are very nearly linear in k. The k with the least
    cost whose interpolated need fits is then compiled (the answer is measured, never
    interpolated); if it does not fit, k steps down (along the line through the measured point),
    and if it fits, k + 1 is compiled to show that one more layer of ``a`` does not.

    Args:
      planner: the planner whose compiles ``table`` holds (the mixes are compiled with it).
      table: the single candidates, compiled or not; ``best``: the fitting one with least cost.
      num_layers: the depth of the stack the mixes apply to.
      max_compiles: at most this many mixes are compiled.
      price: the :class:`Pricer` the table was priced with (default: the backend's default hardware).

    Returns:
      ``(mix or None, the mixes compiled as Candidates, the mixed front)``: see :attr:`AutoResult.mixed_front`.
    """
    price = price or Pricer(planner, planner.hardware, batch, seq)
    target = budget.target
    compiled = [c for c in table if c.need_bytes is not None and price.choosable(policies.parse(c.policy))]
    front = [compiled[i] for i in pareto_front([(c.cost_s, c.need_bytes) for c in compiled])]
    over = [c for c in front if not c.fits and c.cost_s < best.cost_s]
    under = [c for c in front if c.fits]
    ordered = sorted(front, key=lambda c: (c.cost_s, -c.need_bytes))
    lines = tuple(
        (a.policy, b.policy, a.need_bytes, b.need_bytes, a.recompute_flops, b.recompute_flops)
        for a, b in itertools.pairwise(ordered)
        if a.cost_s < b.cost_s and a.need_bytes > b.need_bytes
    )
    options = []
    for a in over:
        for b in under:
            if a.cost_s >= b.cost_s or a.need_bytes <= b.need_bytes:
                continue
            if not (_kind(a.policy) and _kind(b.policy)):
                continue  # a JAX policy given as a callable has no spec to rebuild it from, so it is not mixed
            ks = _mix_range(policies.parse(a.policy), policies.parse(b.policy), num_layers)
            # need(k) = need_b + k / L · (need_a − need_b): the largest k that fits the target.
            k = min(int((target - b.need_bytes) * num_layers // (a.need_bytes - b.need_bytes)), ks.stop - 1)
            cost_k = b.cost_s + k * (a.cost_s - b.cost_s) / num_layers
            if k >= ks.start and cost_k < best.cost_s:
                options.append((cost_k, b.need_bytes + k * (a.need_bytes - b.need_bytes) / num_layers, a, b, k, ks))
    if not options:
        return None, (), lines
    _, _, a, b, k, ks = min(options, key=lambda o: (o[0], o[1]))
    pa, pb = policies.parse(a.policy), policies.parse(b.policy)
    measured: dict[int, Candidate] = {}

    def measure(k: int) -> Candidate:
        if k not in measured:
            measured[k] = price.candidate(policies.mix([(pa, k), (pb, num_layers - k)]), budget)
        return measured[k]

    winner = None
    while ks.start <= k < ks.stop and len(measured) < max_compiles:
        c = measure(k)
        if c.fits:
            if c.rank < best.rank and (winner is None or k > winner):
                winner = k
            if k + 1 >= ks.stop or (k + 1) in measured:
                break
            k += 1
            continue
        if winner is not None or k - 1 < ks.start:
            break
        # Step down along the line through b (k = 0) and the measured point: the mix's own slope.
        slope = (c.need_bytes - b.need_bytes) / k
        guess = int((target - b.need_bytes) // slope) if slope > 0 else k - 1
        if guess < ks.start:  # the measured line leaves no count that fits: the preset stays
            break
        k = min(k - 1, guess)
    tried = tuple(measured[i] for i in sorted(measured))
    if winner is None:
        return None, tried, lines
    return policies.mix([(pa, winner), (pb, num_layers - winner)]), tried, lines


def why_chosen(chosen, table: Sequence[Candidate], budget: Budget, loss_chunks: int, transformer: bool = True) -> str:
    """:attr:`AutoResult.reason`: what ``chosen`` needs of the budget and costs, and what blocked cheaper rows of
    ``table``; or, nothing chosen, what is needed and which levers remain (the built-in model's when
    ``transformer``)."""
    margin = budget.margin
    if chosen is not None:
        win = next(c for c in table if c.policy == str(chosen))
        cheaper = [c for c in table if c.rank < win.rank and "*" not in c.policy]
        text = (
            f"{win.policy} needs {fmt_bytes(win.need_bytes)} (+{margin:.0%} margin: "
            f"{fmt_bytes(budget.with_margin(win.need_bytes))}) of the {fmt_bytes(budget.bytes)} budget and costs an "
            f"estimated {fmt_seconds(win.cost_s)} per step over `none` ({win.recompute_flops / 1e9:.3g} GFLOP "
            f"of matmuls recomputed)"
        )
        if cheaper:
            blocked = ", ".join(c.policy for c in cheaper if c.fits)
            why = (
                f"needs more than the budget or is an offload that moves nothing here ({blocked})"
                if blocked
                else ("needs more than the budget")
            )
            text += f"; every candidate estimated cheaper ({', '.join(c.policy for c in cheaper)}) {why}"
        if isinstance(chosen, policies.Mix):
            single = [c for c in table if c.fits and "*" not in c.policy]
            if single:
                alone = min(single, key=lambda c: (c.rank, c.need_bytes))
                text += (
                    f"; as a mix of {' and '.join(str(p) for p in chosen.policies)} it costs less than "
                    f"{alone.policy}, the best single policy that fits ({fmt_seconds(alone.cost_s)})"
                )
            return text + "."
        ties = [c for c in table if c.rank == win.rank and c.policy != win.policy and c.fits]
        if ties:
            text += f"; among equal cost it needs the least memory (vs {', '.join(c.policy for c in ties)})"
        return text + "."
    compiled = [c for c in table if c.need_bytes is not None]
    least = min(compiled, key=lambda c: c.need_bytes)
    levers = ["an offload policy on a backend with host memory (GPU/TPU)"]
    if not loss_chunks and transformer:
        levers.append("a chunked loss (--loss-chunks 8) so the full logits never live at once")
    levers += [
        "a smaller batch with gradient accumulation",
        "a shorter sequence",
        "sharding over more devices (--mesh)" if transformer else "sharding over more devices",
    ]
    return (
        f"nothing fits: the leanest candidate, {least.policy}, needs {fmt_bytes(least.need_bytes)} "
        f"(+{margin:.0%} margin: {fmt_bytes_beside(budget.with_margin(least.need_bytes), budget.bytes)}) but the "
        "budget is "
        f"{fmt_bytes(budget.bytes)}. "
        f"Next levers: {'; '.join(levers)}."
    )


def _short(spec: str, width: int = 48) -> str:
    """A spec cut to ``width`` characters for the plot's key."""
    return spec if len(spec) <= width else spec[: width - 1] + "…"


def _number_points(fig, ax, xs: list[float], ys: list[float], ringed: Sequence[int] = (), fontsize: float = 7) -> None:
    """Write each point's number beside it where it overlaps no other number, point or ring (``ringed``).

    Points closer than a marker's width share one label ("3,4"). Each label tries the places around its
    point in turn and takes the first free one; when all are taken it goes further up, with a line to its point.
    """
    ax.set_xlim(ax.get_xlim())  # freeze the limits: the placement works in display points
    ax.set_ylim(ax.get_ylim())
    to_pt = 72 / fig.dpi
    pts = [tuple(p * to_pt for p in ax.transData.transform((x, y))) for x, y in zip(xs, ys, strict=True)]
    groups: list[list[int]] = []
    for i, (px, py) in enumerate(pts):
        near = next((g for g in groups if abs(pts[g[0]][0] - px) < 6 and abs(pts[g[0]][1] - py) < 6), None)
        (near.append(i) if near is not None else groups.append([i]))
    marker = 4.0  # half a marker, in points
    taken = [(px - marker, py - marker, px + marker, py + marker) for px, py in pts]
    ring = 9.0  # the chosen point's ring (s=250), in points
    taken += [(pts[i][0] - ring, pts[i][1] - ring, pts[i][0] + ring, pts[i][1] + ring) for i in ringed]
    height = fontsize * 1.25
    for group in groups:
        text = ",".join(str(i + 1) for i in group)
        width = 0.62 * fontsize * len(text)
        px, py = pts[group[0]]
        pad = ring + 1 if set(group) & set(ringed) else 5.0  # a ringed point's label goes outside its ring
        tries = [
            (pad, 2),
            (pad, -height - 2),
            (-width - pad, 2),
            (-width - pad, -height - 2),
            (-width / 2, pad + 1),
            (-width / 2, -height - pad - 1),
        ]
        tries += [(pad, 2 + k * height) for k in range(2, 30)]
        for dx, dy in tries:
            box = (px + dx, py + dy, px + dx + width, py + dy + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in taken):
                break
        taken.append(box)
        arrow = {"arrowstyle": "-", "lw": 0.5, "color": "gray"} if abs(dy) > 2 * height else None
        ax.annotate(
            text,
            (xs[group[0]], ys[group[0]]),
            xytext=(dx, dy),
            textcoords="offset points",
            fontsize=fontsize,
            va="bottom",
            ha="left",
            arrowprops=arrow,
        )
