"""The one planning engine of ``fit``: the model as given first, then an exact plan priced from one trace, verified.

:func:`plan` answers "which plan fits this budget at the least estimated step time?" for any model that a
:class:`remat_kit.planning.planner.StepPlanner` compiles, in at most three XLA compiles:

1. **The model as given** (``plain``: the user's own loop, unscanned where that is what they wrote) is compiled
   under ``none``. It fits: that is the answer, after one compile. Scan is a lever used only past this point,
   where it lowers the need.
2. **One trace prices every choice.** The step under ``full`` is traced once (a trace, not a compile); its first
   rematerialized block is that block type's body: every value it names, with its bytes and the seconds of the
   ops that compute it since the named value before it (:func:`price_block`). Those prices make the additive
   cost model the exact solver optimizes (:mod:`remat_kit.planning.solve`).
3. **Two compiles calibrate and verify.** ``full`` calibrates: the need of a plan is then modelled as
   ``need(full) + α · (bytes its layers keep beyond full)`` (α = 1: a scan stacks what each layer keeps; less where
   ``none`` compiled on the same stack shows XLA keeps the named values narrower, :func:`_slope`). Where the stack
   is the model as given, ``full``'s step is compiled; where it is not (a user's loop, scanned), full's gradient
   alone is compiled and the optimizer state added (:meth:`~remat_kit.planning.planner.StepPlanner.gradient_need`:
   on XLA:CPU half the step's compile, within the parameters' bytes under its need), and full's step is compiled
   only where full is the answer, which it is when the budget is within that uncertainty of the estimate. The
   solver's optimum under ``budget.target`` is compiled to verify it. When it misses, α is refitted through the
   two points and, while compiles remain (``max_compiles``, one kept for full where full is still uncompiled), the
   new optimum is compiled; otherwise the answer falls back to ``full``, compiled (a fourth compile where only its
   gradient was), which fits.

Every answer's need is a compiled figure; :attr:`Choice.predicted_bytes` is what the model predicted for it.
Several block types: :class:`BlockPrice` is per type and :func:`remat_kit.planning.solve.solve` takes one front
per layer, so a model whose period is ``[R, R, A]`` prices each name where its type emits it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import jax
from jax.extend import core as jax_core

from remat_kit import _jax_internals, policies
from remat_kit.analysis import memory
from remat_kit.planning import cost, solve
from remat_kit.planning.budget import Candidate
from remat_kit.planning.planner import Budget, StepPlanner
from remat_kit.unedited import guard
from remat_kit.units import fmt_bytes, fmt_bytes_beside, fmt_seconds

log = logging.getLogger("remat_kit.fit")

#: The XLA compiles one :func:`plan` spends at most: the model as given, ``full`` (or its gradient) and the answer.
MAX_COMPILES = 3

#: Distinct per-layer options a plan mixes at most: each is its own scan, and a third scan costs compile time and
#: memory the additive model does not see (a three-part mix measured 10 % over its prediction, two-part ones under).
MIX_PARTS = 2

#: The calibrated slope (:func:`_slope`) is raised by this factor: a prediction under the compiled need costs the
#: answer (its verify misses, ``full`` is the fallback), one over it only some recompute.
SLOPE_SLACK = 1.1

#: What changes what remat cannot (the state, the logits, the batch), said when nothing fits.
LEVERS = "train LoRA adapters over a quantized base, chunk the loss, shard over a mesh or take a smaller batch"


@dataclasses.dataclass(frozen=True)
class Choice:
    """:func:`plan`'s answer: the plan, what it needs and costs, and what was compiled.

    Attributes:
      chosen: the fitting Policy or Mix with the least estimated step time; None when nothing fits.
      need_bytes: its compiled need (None when nothing fits).
      est_step_time_s: the cost model's whole step under it (``none``'s step plus its recompute and exposed offload).
      candidates: the plans compiled (:class:`remat_kit.planning.budget.Candidate`), in the order compiled.
      budget: the :class:`Budget`; compiles: XLA compiles this choice spent; seconds: its wall time.
      reason: one paragraph: why the winner won, or (nothing fits) the one-line refusal.
      groups: the named values (one name each) the plan was chosen over.
      seq_tiles: the sequence tiles the chosen step runs its blocks in (1: untiled).
      predicted_bytes: the need the memory model predicted for the answer before compiling it (None for the
        model as given and ``full``, which are compiled to calibrate, not predicted).
      plain: whether the answer is the model as given (``none``, unscanned where the user's loop is).
    """

    chosen: policies.Policy | policies.Mix | None
    need_bytes: int | None
    est_step_time_s: float | None
    candidates: tuple
    budget: Budget
    compiles: int
    seconds: float
    reason: str
    groups: tuple[tuple[str, ...], ...] = ()
    seq_tiles: int = 1
    predicted_bytes: int | None = None
    plain: bool = False

    def is_chosen(self, c: Candidate) -> bool:
        """Whether ``c`` is the chosen row: its policy and its tile count."""
        return c.is_plan(self.chosen, self.seq_tiles)

    def table(self) -> str:
        """The candidates, cheapest first: estimated cost over ``none``, compiled need (``-``: not compiled), need
        with the margin, whether it fits; the chosen one marked ``*``."""
        rows = sorted(self.candidates, key=lambda c: c.rank)
        width = max([len(c.label) for c in rows] + [6]) + 1
        head = f" {'policy':{width}} {'est. cost':>10} {'need':>10} {'+margin':>10} {'fits':>5}"
        out = [head, "-" * len(head)]
        for c in rows:
            mark = "*" if self.is_chosen(c) else " "
            compiled = c.need_bytes is not None
            margin = fmt_bytes_beside(self.budget.with_margin(c.need_bytes), self.budget.bytes) if compiled else "-"
            out.append(
                f"{mark}{c.label:{width}} {fmt_seconds(c.cost_s):>10} "
                f"{fmt_bytes(c.need_bytes) if compiled else '-':>10} {margin:>10} "
                f"{'-' if c.fits is None else 'yes' if c.fits else 'no':>5}"
            )
        predicted = "" if self.predicted_bytes is None else f" Predicted {fmt_bytes(self.predicted_bytes)}."
        out.append(f"{self.compiles} compiles, {self.seconds:.1f} s.{predicted} {self.reason}")
        return "\n".join(out)


def emitted_bytes(body) -> dict[str, int]:
    """Bytes of each name a block's jaxpr (``body``) marks with ``checkpoint_name``, in the order it computes them:
    the block's own tags, and on a :func:`remat_kit.apply`-ed model the module-path names it gives."""
    out: dict[str, int] = {}
    for eqn in _jax_internals.iter_eqns(body):
        tag = _jax_internals.checkpoint_name_of(eqn)
        if tag is not None:
            out[tag] = out.get(tag, 0) + sum(_jax_internals.aval_nbytes(v) for v in eqn.outvars)
    return out


def group_names(emitted: dict[str, int]) -> tuple[tuple[tuple[str, ...], int], ...]:
    """The values a block emits, one name each, with their bytes: a name that is a path-prefix of the name just
    before it (``attn`` after ``attn/attn_vec_einsum``, ``attn/q_einsum`` after its parameter's matmul
    ``attn/q_einsum/kernel``) with the same bytes names the same value (a module returns its last call's output),
    so only the outermost of such names is kept.

    >>> group_names({"attn/q/kernel": 64, "attn/q": 64, "attn/o": 64, "attn": 64, "mlp": 128})
    ((('attn/q',), 64), (('attn',), 64), (('mlp',), 128))
    """
    out: list[tuple[list[str], int]] = []
    for name, nbytes in emitted.items():
        prev = out[-1] if out else None
        if prev is not None and prev[1] == nbytes and prev[0][-1].startswith(name + "/"):
            prev[0].append(name)
        else:
            out.append(([name], nbytes))
    return tuple(((names[-1],), nbytes) for names, nbytes in out)


@dataclasses.dataclass(frozen=True)
class BlockPrice:
    """One block type priced from one trace of its body.

    Attributes:
      kind: the block type's label; count: how many layers of the step are of this type.
      values: its named values (:class:`remat_kit.planning.solve.Value`), in the order it computes them.
      tail_s: seconds of the ops after its last named value (recomputed under any remat of the layer).
    """

    kind: str
    count: int
    values: tuple[solve.Value, ...]
    tail_s: float

    @property
    def full_s(self) -> float:
        """One layer's recompute under ``full``: every segment and the tail."""
        return sum(v.recompute_s for v in self.values) + self.tail_s

    def front(self) -> list[solve.Option]:
        """The Pareto front of one layer's assignments (:func:`remat_kit.planning.solve.layer_front`)."""
        return solve.layer_front(self.values, base_s=self.tail_s)


def price_block(
    body,
    count: int,
    hardware: cost.Hardware,
    *,
    host_moves: bool = False,
    kind: str = "block",
    needed_only: bool = True,
) -> BlockPrice:
    """Price every named value of a block's body (a jaxpr) from that one trace, no compile.

    A value's recompute price is the roofline seconds (:meth:`remat_kit.planning.cost.Hardware.op_seconds`) of the
    block's ops from the named value before it up to it; several names of one value (:func:`group_names`) are one
    value, priced once. Where offload moves memory (``host_moves``), offloading a value costs its bytes' transfer out
    and back. A value the backward pass never needs (:func:`needed_names`: the block's output added to the residual
    stream) is kept by no plan and recomputed by none: it costs neither bytes nor seconds; nor does a name of the
    block's own input (:func:`given_names`), which every remat keeps already. ``needed_only=False``
    prices every name at its bytes: where the memory slope is calibrated on ``none`` and ``full`` of the same stack
    (:func:`_slope`), the slope over all names is what was measured (over needed names alone it predicted the
    built-in presets' plans under their compiled need, and a plan at the budget's edge missed).
    """
    emitted = emitted_bytes(body)
    outer = {}  # every name -> the name its value is kept by
    for (name,), _ in group_names(emitted):
        outer[name] = name
    for name in emitted:  # inner names of a value take the outer name that follows them
        if name not in outer:
            later = [n for n in emitted if n in outer and name.startswith(n + "/")]
            outer[name] = later[0] if later else name
    # A value is needed when the backward reads it under any of its names; given (the block's input) under any.
    needed = {outer[n] for n in needed_names(body, list(emitted))} if needed_only else set(outer.values())
    needed -= {outer[n] for n in given_names(body)} if needed_only else set()
    seconds = dict.fromkeys(outer.values(), 0.0)
    pending = 0.0
    for eqn, times in _jax_internals.weighted_leaf_eqns(body):
        tag = _jax_internals.checkpoint_name_of(eqn)
        if tag is not None:
            seconds[outer.get(tag, tag)] = seconds.get(outer.get(tag, tag), 0.0) + pending
            pending = 0.0
            continue
        _, op_flops, op_bytes = cost._op_key(eqn)
        pending += times * hardware.op_seconds(op_flops, op_bytes)
    values = tuple(
        solve.Value(name, nbytes, seconds[name], hardware.transfer_seconds(2 * nbytes) if host_moves else None)
        if name in needed
        else solve.Value(name, 0, 0.0, 0.0 if host_moves else None)
        for (name,), nbytes in group_names(emitted)
    )
    return BlockPrice(kind, count, values, pending)


def given_names(body) -> set[str]:
    """Names a block's body gives one of its own inputs (the layer input): a rematerialized call keeps its arguments
    whatever its policy (a scan's carry), so keeping them costs nothing beyond ``full``."""
    jaxpr = getattr(body, "jaxpr", body)
    return {
        tag
        for eqn in jaxpr.eqns
        if (tag := _jax_internals.checkpoint_name_of(eqn)) is not None
        and any(v is w for v in eqn.invars for w in jaxpr.invars)
    }


def needed_names(body, names: Sequence[str]) -> set[str]:
    """Of ``names`` (values a block's body marks), those its backward pass needs when the policy keeps them all.

    One trace of the body alone under ``save_only_these_names(*names)`` (no compile): JAX keeps only values some
    derivative reads, so a value used only linearly (the block's output added to the residual stream, its last
    matmul) is no residual and keeping it changes nothing. A name whose value shares another's residual counts as
    needed.
    """
    fn = jax.checkpoint(jax_core.jaxpr_as_fun(body), policy=jax.checkpoint_policies.save_only_these_names(*names))
    kept = {r.tag for r in guard.residuals(fn, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in body.in_avals])}
    return {n for n in names if n in kept}


def price_blocks(
    forward,
    hardware: cost.Hardware,
    *,
    host_moves: bool = False,
    kind: str = "block",
    depth: int | None = None,
    needed_only: bool = True,
) -> BlockPrice:
    """Every kind of block a step's forward pass (a jaxpr under ``full``) rematerializes, priced as one block.

    Blocks of several kinds (a period of recurrent and attention blocks, dense and expert layers) share one policy,
    and a name is kept where a block emits it: so each kind is priced from its own body (:func:`price_block`) and a
    name's bytes and seconds are averaged over all the layers (a name two of six layers emit costs a third of its
    bytes per layer), which prices a plan over the whole stack exactly.

    Args:
      depth: the layers of the stack, where the jaxpr holds a block more than once per layer (a custom-VJP stack).

    Raises:
      ValueError: no rematerialized block, or none names a value.
    """
    kinds: dict[tuple, list] = {}
    for body, runs, _ in _jax_internals.own_remat_bodies(forward):
        key = tuple(emitted_bytes(body))
        kinds.setdefault(key, [body, 0])[1] += runs
    if not kinds:  # a stack rematerialized by other means than remat_kit's own checkpoint: its first block
        body = _jax_internals.first_remat_body(forward)
        if body is not None:
            first = next(iter(emitted_bytes(body)), None)
            names = ((_jax_internals.checkpoint_name_of(e), t) for e, t in _jax_internals.weighted_leaf_eqns(forward))
            kinds[tuple(emitted_bytes(body))] = [body, sum(t for name, t in names if name == first)]
    if not any(kinds):
        raise ValueError("fit found no named value in the model's block to keep or recompute; give where=")
    priced = [
        price_block(body, runs, hardware, host_moves=host_moves, kind=kind, needed_only=needed_only)
        for body, runs in kinds.values()
    ]
    total = sum(p.count for p in priced)
    if len(priced) == 1:
        return dataclasses.replace(priced[0], count=depth or total)
    merged: dict[str, list[float]] = {}
    for p in priced:
        for v in p.values:
            acc = merged.setdefault(v.name, [0.0, 0.0, 0.0, v.offload_s is not None])
            acc[0] += v.nbytes * p.count
            acc[1] += v.recompute_s * p.count
            acc[2] += (v.offload_s or 0.0) * p.count
    values = tuple(
        solve.Value(name, int(b / total), r / total, o / total if moves else None)
        for name, (b, r, o, moves) in merged.items()
    )
    tail = sum(p.tail_s * p.count for p in priced) / total
    return BlockPrice(kind, depth or total, values, tail)


def policy_of(option: solve.Option) -> policies.Policy:
    """The policy of a layer taking ``option``: ``full``, ``selective:...`` or ``offload:...``."""
    if option.offload:
        return policies.offload(option.offload, save=option.keep)
    return policies.selective(option.keep) if option.keep else policies.full()


def plan_of(options: Sequence[solve.Option]) -> policies.Policy | policies.Mix:
    """One block type's layers' options as a policy: uniform, or a mix of runs (leanest layers first)."""
    counts: dict[solve.Option, int] = {}
    for o in sorted(options, key=lambda o: (o.nbytes, o.cost_s)):
        counts[o] = counts.get(o, 0) + 1
    if len(counts) == 1:
        return policy_of(options[0])
    return policies.mix([(policy_of(o), k) for o, k in counts.items()])


class Background:
    """``fn(*args)`` run in a daemon thread from now on; :meth:`result` waits for it in short slices, so a Ctrl-C
    stops the caller at once (XLA's compile does not look at signals; the abandoned thread dies with the process).
    Meanwhile the caller may trace the next step: XLA compiles outside the GIL."""

    def __init__(self, fn: Callable, *args):
        self._box: dict[str, object] = {}
        self.done = threading.Event()  # set when fn returns (a thread's own is_alive can lie after a Ctrl-C)
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn, *args):
        try:
            self._box["value"] = fn(*args)
        except BaseException as err:  # handed to the caller in result()
            self._box["error"] = err
        finally:
            self.done.set()

    def result(self):
        """``fn``'s value (or its exception, raised here)."""
        try:
            while not self.done.wait(0.05):
                pass
        except BaseException:  # a Ctrl-C: the compile cannot be stopped, so it is left behind (see _exit_past)
            _ABANDONED.append(self.done)
            raise
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]


#: Compiles a Ctrl-C left running. XLA's compile cannot be stopped, and a daemon thread still inside it when the
#: interpreter finalizes aborts the process ("FATAL: exception not rethrown"): :func:`_exit_past` ends it first.
_ABANDONED: list[threading.Event] = []


@atexit.register
def _exit_past() -> None:
    """At exit, with a compile a Ctrl-C left running: flush and end the process now (status 130, as for SIGINT)
    instead of letting interpreter shutdown abort it."""
    if any(not done.is_set() for done in _ABANDONED):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(130)


def interruptible(fn: Callable, *args):
    """``fn(*args)``, waited on so that a Ctrl-C stops the caller at once (:class:`Background`)."""
    return Background(fn, *args).result()


def plan(
    planner: StepPlanner | Callable[[], StepPlanner],
    budget: Budget,
    *,
    plain: StepPlanner | None = None,
    kind: str = "block",
    mixes: bool = True,
    hardware: cost.Hardware | None = None,
    max_compiles: int = MAX_COMPILES,
    progress: Callable[[str], None] | None = None,
    levers: str = "",
    batch: int | None = None,
    seq: int | None = None,
    depth: int | None = None,
) -> Choice:
    """The fitting plan with the least estimated step time, in at most ``max_compiles`` compiles (the module
    docstring says how).

    Args:
      planner: compiles the step under a policy (the blocks rematerialized, scanned where they can be), or a
        function making it, called only when the model as given does not fit.
      budget: the :class:`Budget`.
      plain: compiles the model as given (default: ``planner`` under ``none``).
      kind: the block type's label.
      mixes: whether the layers may take different options (a mix over the stack; a model whose stack cannot run
        one is planned uniform).
      hardware: what recompute is priced against (default: the backend's).
      max_compiles: at least 2; the third verifies the solver's answer, a fourth (if allowed) a refitted one.
      progress: called with one line per phase (also logged to ``remat_kit.fit`` at INFO).
      levers: what to say when nothing fits (default: :data:`LEVERS`).
      batch, seq: the shape the planners compile at (None for a model planned at one fixed shape).
      depth: the layers of the stack (default: how often the loss's jaxpr names the block's first value; a model
        whose stack holds its block twice in the jaxpr, as a custom-VJP stack does, says it here).

    Returns:
      A :class:`Choice` (``chosen`` None, ``reason`` the refusal, when nothing fits).
    """
    start = time.perf_counter()
    same_stack = plain is None  # the model as given is the planned stack itself: its none calibrates the slope
    plain = plain or planner
    spent, before = [0], {}

    def count(pl: StepPlanner) -> StepPlanner:
        before.setdefault(id(pl), (pl, pl.compiles))
        return pl

    def say(line: str) -> None:
        log.info(line)
        if progress is not None:
            progress(line)

    def compiled(pl: StepPlanner, policy, label: str):
        say(f"compiling {label} ({spent[0] + 1} of at most {max_compiles})")
        # Traced here, in the caller's thread: JAX's config contexts (rank promotion, x64, precision) are per thread.
        count(pl).prepare(policy, batch, seq)
        need = interruptible(pl.memory, policy, batch, seq)[0]
        spent[0] = sum(p.compiles - n for p, n in before.values())
        say(f"{label} needs {fmt_bytes(need)}")
        return need

    hardware = hardware or plain.hardware
    none, full = policies.none(), policies.full()
    rows: list[Candidate] = []

    def row(policy, need: int, cost_s: float, pl: StepPlanner) -> Candidate:
        f = pl.flops(policy, batch, seq)
        extra = max(f - plain.flops(none, batch, seq), 0)  # matmul FLOPs recomputed over the model as given
        c = Candidate(str(policy), f, extra, need, 0, budget.fits(need), recompute_s=cost_s, rank=(round(cost_s, 15),))
        rows.append(c)
        return c

    def done(chosen, c: Candidate | None, reason: str, predicted=None, is_plain=False, groups=()) -> Choice:
        base_s = plain.work(none, batch, seq).seconds(hardware)
        return Choice(
            chosen=chosen,
            need_bytes=None if c is None else c.need_bytes,
            est_step_time_s=None if c is None else base_s + c.cost_s,
            candidates=tuple(rows),
            budget=budget,
            compiles=spent[0],
            seconds=time.perf_counter() - start,
            reason=reason,
            groups=groups,
            predicted_bytes=predicted,
            plain=is_plain,
        )

    # 1. The model as given, compiled in the background while the stack is traced and priced (a trace: no compile).
    say(f"compiling the model as given (none) (1 of at most {max_compiles})")
    count(plain).prepare(none, batch, seq)  # traced here: the thread only compiles (XLA, outside the GIL)
    job = Background(plain.memory, none, batch, seq)

    def price():
        stack = count(planner if isinstance(planner, StepPlanner) else planner())
        forward = stack.forward_jaxpr(full, batch, seq)  # each kind of block once: its body, and how many run
        block = price_blocks(
            forward, hardware, host_moves=_host_moves(stack), kind=kind, depth=depth, needed_only=not same_stack
        )
        # What calibrates (see 2. below), traced and lowered while the model as given compiles.
        if not same_stack and stack.gradient_calibrates and max_compiles >= MAX_COMPILES:
            return stack, block, stack.lower_gradient(full, batch, seq)
        stack.prepare(full, batch, seq)
        return stack, block, None

    try:
        priced = price()
    except ValueError as err:
        priced = err  # raised only if the model as given does not fit
    need_none = job.result()[0]
    spent[0] = sum(p.compiles - n for p, n in before.values())
    say(f"the model as given (none) needs {fmt_bytes(need_none)}")
    first = row(none, need_none, 0.0, plain)
    if first.fits:
        return done(none, first, _fits_text("the model as given, none,", first, budget), is_plain=True)
    if isinstance(priced, ValueError):
        raise priced

    # 2. One trace priced every choice; full calibrates: its step compiled, or, where the stack is not the model
    # as given (the slope is 1) and the gradient compiles alone here, its gradient plus the optimizer state (on
    # XLA:CPU half a scanned step's compile: the update is most of its kernels). Full is then compiled only where
    # it is the answer, so every answer's need stays a compiled figure.
    planner, block, calibration = priced
    depth = block.count
    groups = tuple((v.name,) for v in block.values)
    front = block.front()
    full_s = depth * block.full_s
    lean: list[Candidate] = []  # full's compiled row, once compiled

    def compile_full() -> Candidate:
        if not lean:
            lean.append(row(full, compiled(planner, full, "full"), full_s, planner))
        return lean[0]

    def refuse(c: Candidate) -> Choice:
        reason = (
            f"nothing fits the {fmt_bytes(budget.bytes)} budget: the leanest plan, full, needs "
            f"{fmt_bytes(c.need_bytes)} ({fmt_bytes_beside(budget.with_margin(c.need_bytes), budget.bytes)} with the "
            f"{budget.margin:.0%} margin); remat cannot shrink the parameters and optimizer state, the logits or the "
            f"batch: {levers or LEVERS}"
        )
        return done(None, None, reason, groups=groups)

    def answer_full() -> Choice:
        c = compile_full()
        if not c.fits:
            return refuse(c)
        return done(full, c, _fits_text("full", c, budget) + _missed(rows), groups=groups)

    if calibration is not None:
        say(f"compiling full's gradient ({spent[0] + 1} of at most {max_compiles})")
        need_full, uncertainty = interruptible(planner.gradient_need, calibration)
        spent[0] = sum(p.compiles - n for p, n in before.values())
        say(f"full needs about {fmt_bytes(need_full)} (its gradient and the optimizer state)")
        # Within the estimate's uncertainty of the budget only full is sure to verify: compiled as the answer (or
        # the refusal's compiled need), where a plan keeping a little could miss and cost a fourth compile.
        if not budget.fits(need_full + uncertainty):
            return answer_full()
    else:
        need_full = compile_full().need_bytes
        if not budget.fits(need_full):
            return answer_full()

    # 3. Solve, verify; refit once where the prediction missed.
    alpha = _slope(need_none, need_full, depth * sum(v.nbytes for v in block.values), same_stack)
    say(f"need modelled as full's {fmt_bytes(need_full)} + {alpha:.2f} x the bytes a plan keeps beyond full")
    missed = False
    while True:
        options = solve.solve([front] * depth, (budget.target - need_full) / alpha, uniform=not mixes, parts=MIX_PARTS)
        kept = solve.plan_bytes(options)
        # A refitted answer is compiled only with a compile left over for full, the verified fallback.
        if kept == 0 or spent[0] + (missed and not lean) >= max_compiles:
            if missed and not lean:  # the answer missed while full was only estimated: compiled now, a 4th
                say("the solver's answer missed: full is compiled to verify the fallback")
            return answer_full()
        answer = plan_of(options)
        cost_s = sum(o.cost_s for o in options)
        predicted = int(need_full + alpha * kept)
        say(f"the solver's optimum {answer}: predicted {fmt_bytes(predicted)}, {fmt_seconds(cost_s)} per step")
        try:
            need = compiled(planner, answer, str(answer))
        except ValueError:  # the stack cannot run this mix (a period, or no scan): plan it uniform
            if not mixes or not isinstance(answer, policies.Mix):
                raise
            mixes = False
            continue
        got = row(answer, need, cost_s, planner)
        if got.fits:
            return done(answer, got, _fits_text(str(answer), got, budget), predicted=predicted, groups=groups)
        alpha = max((got.need_bytes - need_full) / kept, alpha * 1.01)
        missed = True


def _fits_text(label: str, c: Candidate, budget: Budget) -> str:
    return (
        f"{label} needs {fmt_bytes(c.need_bytes)} (+{budget.margin:.0%} margin: "
        f"{fmt_bytes_beside(budget.with_margin(c.need_bytes), budget.bytes)}) of {fmt_bytes(budget.bytes)} at an "
        f"estimated {fmt_seconds(c.cost_s)} per step over none."
    )


def _missed(rows: Sequence[Candidate]) -> str:
    missed = [c.policy for c in rows if not c.fits and c.policy not in ("none", "full")]
    if not missed:
        return ""
    return f" The solver's answer {missed[0]} compiled over the budget; full is the verified fallback."


def _slope(need_none: int, need_full: int, named: int, same_stack: bool) -> float:
    """Device bytes per byte a plan keeps beyond ``full``: 1 (a scan stacks each layer's kept values), or, where
    ``none`` was compiled on the same stack, the share of the named bytes its need shows over ``full``'s
    (:data:`SLOPE_SLACK` more), when that is less: XLA keeps some named values narrower or merged (0.59 on the
    tiny preset, 0.79 on small, whose uniform plans it then predicts within -4 % to +3 %). A plain loop's ``none``
    is another program, and a block naming only its modules' outputs keeps unnamed values too: 1 there."""
    if not same_stack or named <= 0:
        return 1.0
    return min(1.0, max(0.1, SLOPE_SLACK * (need_none - need_full) / named))


def _host_moves(planner: StepPlanner) -> bool:
    """Whether offload moves memory where ``planner`` compiles (a GPU target's pinned host; not XLA:CPU)."""
    return memory.host_offload(planner.device).enforced
