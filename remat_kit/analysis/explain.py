"""Why a compiled step does not fit: what is live at its peak, its memory over time, and warnings for silent no-ops.

Everything here reads one compile's XLA dump (:mod:`remat_kit.analysis._xla_dump`, compile-only, nothing runs):

* :func:`explain` groups the buffers live at the peak (:data:`GROUPS`) and names the largest;
* :class:`Timeline` is live device bytes over the executed instruction sequence, phases marked from JAX's
  ``op_name`` metadata (``jvp(...)`` forward, ``transpose(...)`` backward, the rest after the backward the
  optimizer); :func:`plot_timelines` draws one line per policy;
* :func:`noop_warning`, :func:`offload_warnings` and :func:`dominance_warnings` are the guardrails every
  report (``inspect``, ``compare``, ``plan``, ``bench``) prints.

**The groups sum to the compiled peak.** :attr:`Explanation.at_peak` sums exactly to
:attr:`remat_kit.analysis.memory.CompiledMemory.total` (device bytes): the device buffers live at the peak instruction,
plus one group, ``reserved``, for the bytes XLA's buffer assignment holds but no value occupies at that
instruction (the temp block is sized for its fullest moment and packed with gaps; outputs are reserved whole).
Buffers XLA placed in host memory are no part of the device peak: :attr:`Explanation.host_bytes` holds them,
apart. The live groups alone are within :data:`RESERVED_TOLERANCE` of the compiled peak on the built-in model
and the tests' scanned models (``tests/test_explain.py``, ``benchmarks/results/explain_2b.txt``); the measured
``reserved`` is printed, never hidden, and a report whose ``reserved`` exceeds the tolerance says so
(:func:`reserved_note`).

>>> import jax, jax.numpy as jnp
>>> from remat_kit.analysis import _xla_dump
>>> f = jax.jit(jax.value_and_grad(lambda w, x: jnp.sum(jnp.sin(x @ w))))
>>> lowered = f.lower(jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((8, 64), jnp.float32))
>>> compiled, program = _xla_dump.compile_with_dump(lowered)
>>> from remat_kit.analysis.memory import CompiledMemory
>>> e = explain(program, CompiledMemory.from_compiled(compiled), parameter_groups={0: "parameters", 1: "inputs"})
>>> sum(e.at_peak.values()) == CompiledMemory.from_compiled(compiled).total
True
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from remat_kit.analysis import _xla_dump
from remat_kit.units import fmt_bytes

#: The group of a buffer in host memory (:attr:`PeakBuffer.host`): never in :attr:`Explanation.at_peak`.
HOST_GROUP = "host memory"

#: The groups a buffer live at the peak falls in, in the order reports print them.
GROUPS: tuple[str, ...] = (
    "parameters",
    "optimizer state",
    "inputs",
    "gradients",
    "saved residuals",
    "residuals widened by XLA",
    "residual copies by XLA",
    "forward values XLA keeps",
    "weight copies",
    "logits / loss",
    "forward temporaries",
    "backward temporaries",
    "optimizer update",
    "other",
    HOST_GROUP,
    "reserved",
)

#: What the groups that are not plain from their name hold; a report prints the line of each group it shows.
GROUP_NOTES: dict[str, str] = {
    "saved residuals": "forward values the backward pass reads, as JAX saved them (shape and dtype of a JAX residual)",
    "residuals widened by XLA": (
        "saved residuals XLA converted to a wider dtype for the backward pass (XLA:CPU converts a scan's "
        "stacked bfloat16 residuals to float32 whole before the backward loop: twice JAX's saved bytes)"
    ),
    "residual copies by XLA": "a copy, transpose or narrowing convert XLA made of a saved residual",
    "forward values XLA keeps": (
        "forward values the backward pass reads that JAX did not save (XLA merged the backward's recompute "
        "of them into the forward value, e.g. a float32 value before its bfloat16 cast); told apart from the "
        "saved residuals by element count and dtype only, not by producing op: such a value of a JAX residual's "
        "size and dtype is counted as a saved residual"
    ),
    HOST_GROUP: "buffers XLA placed in host memory: no part of the device peak, counted apart",
    "reserved": "bytes XLA holds but no value uses at the peak instruction",
}

#: The groups that hold what the backward pass reads of the forward pass (the compiled saved set).
RESIDUAL_GROUPS: tuple[str, ...] = (
    "saved residuals",
    "residuals widened by XLA",
    "residual copies by XLA",
    "forward values XLA keeps",
)

#: The phases of a training step the timeline marks.
PHASES: tuple[str, ...] = ("forward", "loss", "backward", "optimizer", "other")

#: ``reserved`` (bytes XLA holds but no value uses at the peak) stays under this share of the compiled peak on the
#: built-in model and the tests' scanned models; a report says when it does not (:func:`reserved_note`).
RESERVED_TOLERANCE = 0.10

#: Words in an op's name scopes or innermost function name that mark the logits and the loss.
LOSS_MARKERS: tuple[str, ...] = ("logits", "cross_entropy", "log_softmax", "logsumexp")

#: Source files whose ops are the loss (the built-in model's ``remat_kit/model/loss.py``).
LOSS_FILES: tuple[str, ...] = ("loss.py", "losses.py")

#: Share of the peak above which a group no remat policy touches earns a warning.
DOMINANCE_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """One buffer live at the peak.

    Attributes:
      shape, dtype, nbytes: as XLA assigned it.
      group: one of :data:`GROUPS`.
      producer: its ``checkpoint_name`` tag where one fits, else the producing op and source line.
      host: True in host memory.
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    group: str
    producer: str
    host: bool = False


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Live device bytes over the executed instruction sequence of one compiled step.

    A scan (XLA ``while``) body is drawn once per trip: its instructions repeat ``trip count`` times
    along the x axis (nested loops multiply), each repeat with the bytes XLA's allocation holds during
    that body (a scan's stacked residuals are allocated whole before the loop, so every trip shows them).

    Attributes:
      live: bytes live at each executed step.
      phases: the phase (:data:`PHASES`) of each step.
      peak_index: the step with the most live bytes.
    """

    live: tuple[int, ...]
    phases: tuple[str, ...]
    peak_index: int

    @property
    def peak(self) -> int:
        """The most bytes live at once."""
        return self.live[self.peak_index] if self.live else 0


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What is live at a compiled step's peak, and its timeline.

    Attributes:
      at_peak: group -> device bytes at the peak (:data:`GROUPS` order, empty groups and :data:`HOST_GROUP` left
        out); sums exactly to ``total`` (``reserved`` holds what XLA reserves but no value uses at the peak
        instruction).
      host_bytes: bytes XLA placed in host memory live at the peak: apart from ``at_peak`` and ``total``.
      largest_at_peak: the ten largest buffers live there (device or host), largest first.
      total: the compiled peak (:attr:`remat_kit.analysis.memory.CompiledMemory.total`).
      peak_op, peak_phase: the op at the peak (op and source line) and its phase.
      timeline: the :class:`Timeline`.
      kept: sorted ``(shape, dtype)`` of the forward buffers live when the backward pass starts: the saved
        set as compiled (after XLA's CSE, which may merge a recompute away), for :func:`noop_warning`.
    """

    at_peak: dict[str, int]
    largest_at_peak: tuple[PeakBuffer, ...]
    total: int
    peak_op: str
    peak_phase: str
    timeline: Timeline
    kept: tuple = ()
    host_bytes: int = 0

    @property
    def peak_at(self) -> str:
        """Where the peak is: ``"backward: dot_general at model.py:12"``."""
        return f"{self.peak_phase}: {self.peak_op}"

    @property
    def live_bytes(self) -> int:
        """Bytes occupied by values at the peak (the groups without ``reserved``)."""
        return self.total - self.at_peak.get("reserved", 0)

    def table(self) -> str:
        """The groups at the peak, then the largest buffers."""
        body = format_at_peak(self.at_peak, self.largest_at_peak, self.total, self.host_bytes)
        return f"peak in {self.peak_at}\n" + body


def format_at_peak(at_peak: Mapping[str, int], largest: Sequence[PeakBuffer], total: int, host: int = 0) -> str:
    """The device groups at the peak (bytes and share of ``total``), host memory apart, then the largest buffers."""
    lines = [f"at the peak, {fmt_bytes(total)} of device memory in all:"]
    for group, n in at_peak.items():
        lines.append(f"  {group:24} {fmt_bytes(n):>10}  {100 * n / max(total, 1):5.1f}%")
    if host:
        lines.append(f"  {HOST_GROUP + ' (apart)':24} {fmt_bytes(host):>10}  not in the device peak")
    shown = [*at_peak, *([HOST_GROUP] if host else [])]
    lines += [f"  ({g}: {GROUP_NOTES[g]})" for g in shown if g in GROUP_NOTES and g != "reserved"]
    note = reserved_note(at_peak, total)
    if note:
        lines.append(f"  note: {note}")
    lines.append(f"  {'bytes':>10}  {'group':24} {'dtype':9} {'shape':22} producer")
    for b in largest:
        lines.append(f"  {fmt_bytes(b.nbytes):>10}  {b.group:24} {b.dtype:9} {b.shape!s:22} {b.producer}")
    return "\n".join(lines)


def reserved_note(at_peak: Mapping[str, int], total: int) -> str | None:
    """A note when ``reserved`` exceeds :data:`RESERVED_TOLERANCE` of the peak: the groups then say less of it.

    >>> reserved_note({"parameters": 80, "reserved": 20}, 100).split(":")[0]
    "'reserved' is 20% of the compiled peak, above the 10% tolerance the groups are checked to"
    >>> reserved_note({"parameters": 95, "reserved": 5}, 100) is None
    True
    """
    reserved = at_peak.get("reserved", 0)
    if total <= 0 or reserved <= RESERVED_TOLERANCE * total:
        return None
    return (
        f"'reserved' is {100 * reserved / total:.0f}% of the compiled peak, above the "
        f"{100 * RESERVED_TOLERANCE:.0f}% tolerance the groups are checked to: XLA holds that much that no value "
        "uses at the peak instruction (a temp block packed with gaps, or values this reading of the dump misses)"
    )


# ---- phases and producers -------------------------------------------------------------------------


def phase(op_name: str, source: str = "") -> str:
    """The phase of one op from its ``op_name``: ``"jit(f)/jvp()/dot"`` -> ``"forward"``.

    >>> phase("jit(step)/transpose(jvp(loss))/dot_general"), phase("jit(step)/jvp()/log_softmax")
    ('backward', 'loss')
    """
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "loss" if _is_loss(op_name, source) else "forward"
    return "other"


def _is_loss(op_name: str, source: str) -> bool:
    # A marker in the op's name scopes (``jit(log_softmax)``) or its innermost function's own name, or a loss
    # file: not a function merely *named* loss, which may hold the whole model.
    func = source.rsplit("(", 1)[-1].rstrip(")").rsplit(".", 1)[-1] if source.endswith(")") else ""
    file = source.split(":", 1)[0]
    return any(m in op_name or m in func for m in LOSS_MARKERS) or file in LOSS_FILES


def producer(program: _xla_dump.Program, ins: _xla_dump.Instruction | None, depth: int = 0) -> str:
    """What made a buffer, from JAX's metadata: ``"dot_general at model.py:12 (Block.__call__)"``.

    An instruction XLA made carries no metadata: a fusion is named by the op at its root
    (:meth:`remat_kit.analysis._xla_dump.Program.annotated`), a cast or copy by what it moves
    (``"convert f32->bf16 of params['w']"``, :meth:`~remat_kit.analysis._xla_dump.Program.origin`); the raw
    HLO name only when neither tells.
    """
    if ins is None:
        return "?"
    loop = program.trips.get(ins.computation) if ins.opcode == "parameter" and not ins.op_name else None
    if loop is not None and loop[0] in program.instructions and depth < 8:  # a loop body's carried input
        return f"the carry of {producer(program, program.instructions[loop[0]], depth + 1)}"
    meta = program.annotated(ins.name) or (ins if ins.source else None)
    if meta is not None:
        op = meta.op_name.rsplit("/", 1)[-1] or meta.opcode
        return f"{op} at {meta.source}" if meta.source else op
    o = program.origin(ins.name)
    src = program.instructions.get(o.instruction) if o is not None else None
    if o is not None and src is not None and depth < 8:
        cast = f" {o.dtype}->{ins.dtype}" if ins.dtype and ins.dtype != o.dtype else ""
        return f"{'+'.join(dict.fromkeys(o.moves))}{cast} of {producer(program, src, depth + 1)}"
    return ins.name


# ---- the explanation ------------------------------------------------------------------------------


def explain(
    program: _xla_dump.Program,
    memory: Any,
    *,
    parameter_groups: Mapping[int, str] | Callable[[int], str],
    gradient_shapes: Sequence[tuple[tuple[int, ...], str]] = (),
    tags: Mapping[tuple[tuple[int, ...], str], str] | None = None,
    residual_shapes: Sequence[tuple[tuple[int, ...], str]] | None = None,
    has_optimizer: bool = False,
    top: int = 10,
) -> Explanation:
    """Group the buffers live at ``program``'s peak and draw its timeline.

    Args:
      program: a parsed dump (:func:`remat_kit.analysis._xla_dump.compile_with_dump`).
      memory: the same compile's :class:`remat_kit.analysis.memory.CompiledMemory`.
      parameter_groups: entry parameter number -> group (``"parameters"``, ``"optimizer state"``, ``"inputs"``).
      gradient_shapes: ``(shape, dtype)`` of the differentiated leaves: a backward value of such a shape is a
        gradient, any other a backward temporary; a forward value of such a shape (any axis order) a weight copy.
      tags: ``(shape, dtype)`` -> ``checkpoint_name`` of the saved residuals (from JAX's residual analysis).
      residual_shapes: ``(shape, dtype)`` of every residual JAX saves: a forward value the backward pass reads
        of no such size and dtype is one XLA kept (``"forward values XLA keeps"``); None: every such value is
        a saved residual.
      has_optimizer: the program is a training step: what runs after the backward pass is the optimizer.
      top: how many of the largest buffers to name.

    Returns:
      An :class:`Explanation`.
    """
    # Long: one classifier over one program's buffers; its closures share the phase and slice tables built here.
    groups_of = parameter_groups if callable(parameter_groups) else (lambda n: parameter_groups.get(n, "inputs"))
    ins = {i.name: i for i in program.sequence}
    position = {i.name: t for t, i in enumerate(program.sequence)}
    _hlo_dtype = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s32": "int32", "pred": "bool"}
    grads = {(tuple(s), str(d)) for s, d in gradient_shapes}
    # A weight's element count in any layout: a forward copy of that size is a cast or transposed weight copy.
    weight_sizes = {tuple(sorted(s)) for s, _ in gradient_shapes if len(s) >= 2}
    tags = dict(tags or {})
    # Element count and dtype: XLA may hold a residual under another shape of the same data (a bitcast).
    jax_saved = None if residual_shapes is None else {(_numel(s), str(d)) for s, d in residual_shapes}
    everything = program.instructions or ins
    buffers = {b.name: b for b in program.buffers}
    phases = [phase(i.op_name, i.source) for i in program.sequence]
    last_backward = max((t for t, p in enumerate(phases) if p == "backward"), default=-1)
    # After the backward pass, un-differentiated ops are the optimizer's; before it, bookkeeping ops (copies,
    # tuples, loop counters) carry no AD marker and take the phase of the op before them.
    filled, before = [], "other"
    for t, p in enumerate(phases):
        if p == "other":
            p = ("optimizer" if has_optimizer else "other") if t > last_backward >= 0 else before
        filled.append(p)
        before = p
    phases = filled
    # A forward value live across a backward instruction is one the backward pass reads: a saved residual.
    backward_before = [0]
    for p in phases:
        backward_before.append(backward_before[-1] + (p == "backward"))

    def spans_backward(b: _xla_dump.Buffer) -> bool:
        return backward_before[min(b.end, len(phases) - 1) + 1] > backward_before[max(b.start, 0)]

    at = program.peak_position
    # A phi (a loop-carried alias) has no op of its own: its phase is its loop's, its producer the real value
    # sharing its slice nearest in time to the peak (a slice is reused over time by unrelated values).
    same_slice: dict[tuple[int, int, int], list[_xla_dump.Buffer]] = {}
    for b in program.buffers:
        if not b.phi and b.instruction in ins and ins[b.instruction].op_name:
            same_slice.setdefault((b.allocation, b.offset, b.nbytes), []).append(b)

    def nearest(b: _xla_dump.Buffer) -> _xla_dump.Instruction | None:
        near = same_slice.get((b.allocation, b.offset, b.nbytes), [])
        near = [c for c in near if c.start <= b.end and b.start <= c.end] or near
        best = min(
            near, key=lambda c: 0 if c.start <= at <= c.end else min(abs(c.start - at), abs(c.end - at)), default=None
        )
        return ins[best.instruction] if best else None

    def loop_of(i: _xla_dump.Instruction | None) -> _xla_dump.Instruction | None:
        if i is not None and i.opcode == "parameter" and i.computation in program.trips:
            return ins.get(program.trips[i.computation][0], i)
        return i

    def classify(b: _xla_dump.Buffer) -> tuple[str, str]:
        i = ins.get(b.instruction)
        key = (b.shape, _hlo_dtype.get(b.dtype, b.dtype))
        if b.kind == "parameter" and b.parameter is not None and not b.host:
            return groups_of(b.parameter), (i.op_name if i and i.op_name else b.instruction)
        if b.phi or i is None or not i.op_name:
            made, i = nearest(b), loop_of(i)
            made = made or i
        else:
            made = i
        if b.host:
            return HOST_GROUP, tags.get(key) or producer(program, made)
        # An op with no AD marker of its own (an XLA copy or convert) belongs to the phase it runs in.
        p = phases[position[i.name]] if i is not None and i.name in position else "other"
        # XLA's own convert or copy of a forward value, held for the backward pass: a residual in another form.
        if i is not None and not b.phi and not i.op_name and (spans_backward(b) or p == "backward"):
            o = program.origin(i.name)
            src = everything.get(o.instruction) if o else None
            if src is not None and phase(src.op_name, src.source) == "forward":
                group = "residuals widened by XLA" if b.nbytes > o.nbytes else "residual copies by XLA"
                what = tags.get((o.shape, _hlo_dtype.get(o.dtype, o.dtype))) or producer(program, src)
                return group, f"{'+'.join(dict.fromkeys(o.moves))} {o.dtype}->{b.dtype} of {what} ({o.value})"
        if p == "backward" and key in grads:
            return "gradients", producer(program, made)
        # The loss's buffers and their gradients (what a chunked loss removes), forward or backward.
        if p == "loss" or (p in ("forward", "backward") and made is not None and _is_loss(made.op_name, made.source)):
            return "logits / loss", producer(program, made)
        if p == "backward":
            return "backward temporaries", producer(program, made)
        if p in ("forward", "other") and tuple(sorted(b.shape)) in weight_sizes:
            return "weight copies", producer(program, made)
        if p == "forward":
            if not spans_backward(b):
                # A scan's stacked output filled in place in the loop body: the loop output it becomes.
                out = program.carried(b.name)
                if out in buffers and out != b.name and spans_backward(buffers[out]):
                    group, _ = classify(buffers[out])
                    return group, tags.get(key) or producer(program, made)
                return "forward temporaries", producer(program, made)
            if jax_saved is not None and (_numel(b.shape), key[1]) not in jax_saved:
                return "forward values XLA keeps", producer(program, made)
            return "saved residuals", tags.get(key) or producer(program, made)
        if p == "optimizer":
            return "optimizer update", producer(program, made)
        return "other", producer(program, made)

    kept = [
        (b.shape, _hlo_dtype.get(b.dtype, b.dtype))
        for b in program.buffers
        if b.kind != "parameter" and spans_backward(b) and classify(b)[0] in (*RESIDUAL_GROUPS, "logits / loss")
    ]
    totals = dict.fromkeys(GROUPS, 0)
    rows, host = [], 0
    for b in program.live_at(at):
        group, made_by = classify(b)
        if b.host:
            host += b.nbytes
        else:
            totals[group] += b.nbytes
        rows.append(PeakBuffer(b.shape, _hlo_dtype.get(b.dtype, b.dtype), b.nbytes, group, made_by, b.host))
    live = sum(totals.values())
    # XLA's counted allocations (memory.total, device bytes) hold at least what is live at any instruction: more
    # live than that is a misreading of the dump, said loudly rather than clamped away.
    if live > int(memory.total):
        raise _xla_dump.DumpFormatError(
            f"{live} device bytes are live at the peak instruction but XLA's compiled memory counts "
            f"{int(memory.total)}: the dump was misread (its format may have changed)"
        )
    totals["reserved"] = int(memory.total) - live
    rows.sort(key=lambda r: -r.nbytes)
    timeline = _timeline(program, phases)
    peak_ins = program.sequence[at] if program.sequence else None
    return Explanation(
        at_peak={g: n for g, n in totals.items() if n},
        largest_at_peak=tuple(rows[:top]),
        total=int(memory.total),
        peak_op=producer(program, peak_ins) if peak_ins else "",
        peak_phase=phases[at] if phases else "",
        timeline=timeline,
        kept=tuple(sorted(kept)),
        host_bytes=host,
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _timeline(program: _xla_dump.Program, phases: Sequence[str]) -> Timeline:
    live = program.live_bytes()
    order = program.expanded()
    values = tuple(live[t] for t in order)
    peak = values.index(max(values)) if values else 0
    return Timeline(live=values, phases=tuple(phases[t] for t in order), peak_index=peak)


# ---- the plot -------------------------------------------------------------------------------------

_PHASE_COLORS = {"forward": "#dbe9f6", "loss": "#fde2c4", "backward": "#e3f1dc", "optimizer": "#eadcf0"}

#: The stages the plot's x axis is cut into, in order: what runs before the forward pass, the forward pass, the
#: loss, the backward pass, and what runs after it (the optimizer; for a bare gradient, its last bookkeeping).
STAGES: tuple[str, ...] = ("start", "forward", "loss", "backward", "after")

#: The narrowest share of the x axis a stage that runs at all is drawn with, so a short one (the loss, the
#: optimizer: a few hundred of a 2B step's hundred thousand instructions) stays visible.
MIN_STAGE_WIDTH = 0.06


def stages(phases: Sequence[str]) -> list[int]:
    """The :data:`STAGES` index of each step of a timeline: the non-decreasing cut into stages that agrees with the
    most steps' phases. XLA schedules a few ops out of place (a backward buffer filled before the forward pass, a
    forward slice inside the backward loop): they stay in the stage around them rather than move its boundary.

    >>> stages(["other", "backward", "forward", "forward", "loss", "backward", "forward", "backward", "optimizer"])
    [0, 0, 1, 1, 2, 3, 3, 3, 4]
    """
    agrees = {"other": (0, 4), "forward": (1,), "loss": (2,), "backward": (3,), "optimizer": (4,)}
    k = len(STAGES)
    best = [0] * k  # the most agreeing steps of a cut of the steps so far that ends in each stage
    back: list[list[int]] = []  # per step and stage, the stage of the step before in that best cut
    for p in phases:
        run, arg, step = -1, 0, []
        for stage in range(k):
            if best[stage] > run:  # on a tie the earlier stage: a boundary moves as late as the phases allow
                run, arg = best[stage], stage
            step.append(arg)
            best[stage] = run + (stage in agrees.get(p, ()))
        back.append(step)
    out = [0] * len(phases)
    stage = max(range(k), key=lambda s: best[s])
    for t in range(len(phases) - 1, -1, -1):
        out[t] = stage
        stage = back[t][stage]
    return out


def stage_axis(timelines: Sequence[Timeline]) -> tuple[list[float], list[list[float]]]:
    """The x axis shared by ``timelines``: each stage one band, as wide as its largest share of any timeline and
    at least :data:`MIN_STAGE_WIDTH`, so phase boundaries line up across policies of different length.

    Returns:
      ``(edges, xs)``: the bands' left edges and the right end (``len(STAGES) + 1`` values, 0 to 1), and per
      timeline the x of each step.
    """
    per = [stages(tl.phases) for tl in timelines]
    counts = [[s.count(k) for k in range(len(STAGES))] for s in per]
    widths = [
        max((c[k] / max(len(s), 1) for c, s in zip(counts, per, strict=True)), default=0.0) for k in range(len(STAGES))
    ]
    # A stage narrower than the minimum is pinned to it; the others share what is left, in proportion.
    active = [k for k, w in enumerate(widths) if w > 0]
    pinned: set[int] = set()
    while True:
        free = 1.0 - MIN_STAGE_WIDTH * len(pinned)
        rest = sum(widths[k] for k in active if k not in pinned)
        narrow = {k for k in active if k not in pinned and widths[k] / rest * free < MIN_STAGE_WIDTH}
        if not narrow or len(pinned | narrow) == len(active):
            break
        pinned |= narrow
    widths = [
        0.0 if k not in active else MIN_STAGE_WIDTH if k in pinned else widths[k] / rest * free
        for k in range(len(widths))
    ]
    edges = [0.0]
    for w in widths:
        edges.append(edges[-1] + w)
    xs = []
    for s, c in zip(per, counts, strict=True):
        seen = [0] * len(STAGES)
        row = []
        for k in s:
            row.append(edges[k] + (edges[k + 1] - edges[k]) * seen[k] / c[k])
            seen[k] += 1
        xs.append(row)
    return edges, xs


def plot_timelines(timelines: Mapping[str, Timeline], path: str, title: str = "live device memory") -> str:
    """Draw one line per policy of live bytes over the step, each peak marked; write a PNG to ``path``.

    The x axis is cut into the step's stages (:data:`STAGES`, shaded by phase), each scaled per timeline so the
    forward, loss, backward and optimizer of every policy line up, a narrow stage widened to
    :data:`MIN_STAGE_WIDTH` (the axis label says so); the y axis starts near the lowest value drawn, not at 0.

    Args:
      timelines: label -> :class:`Timeline`.
      path: the PNG to write.
      title: the plot title.

    Returns:
      ``path``.
    """
    if not timelines:
        raise ValueError("plot_timelines needs at least one timeline, got none")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=120)
    edges, xs = stage_axis(list(timelines.values()))
    names = {
        0: "",
        1: "forward",
        2: "loss",
        3: "backward",
        4: "optimizer" if any("optimizer" in tl.phases for tl in timelines.values()) else "",
    }
    shaded = []
    for k in range(len(STAGES)):
        color = _PHASE_COLORS.get(names[k])
        if color and edges[k + 1] > edges[k]:
            ax.axvspan(edges[k], edges[k + 1], color=color, lw=0)
            shaded.append(names[k])
    scale, unit = _unit(max(tl.peak for tl in timelines.values()))
    low = min((min(tl.live) for tl in timelines.values() if tl.live), default=0)
    high = max(tl.peak for tl in timelines.values())
    for (label, tl), x in zip(timelines.items(), xs, strict=True):
        (line,) = ax.plot(x, [v / scale for v in tl.live], lw=1.4, label=f"{label} (peak {fmt_bytes(tl.peak)})")
        if tl.live:
            ax.plot([x[tl.peak_index]], [tl.peak / scale], "v", color=line.get_color(), ms=8)
    handles, _ = ax.get_legend_handles_labels()
    phase_handles = [Patch(color=_PHASE_COLORS[p], label=p) for p in shaded]
    ax.legend(handles=handles + phase_handles, loc="best", fontsize=8, ncol=2)
    ax.set_xlabel(
        "executed instructions, each phase scaled to its own band so phases line up across policies "
        f"(a narrow phase widened to {100 * MIN_STAGE_WIDTH:.0f}%; scan bodies repeated once per trip)",
        fontsize=8,
    )
    # The lines sit far above 0 (the state is live throughout): start the axis near the lowest value drawn.
    bottom = max(0.0, low - 0.1 * max(high - low, 1))
    ax.set_ylabel(f"live device memory ({unit}{', axis not from 0' if bottom > 0 else ''})")
    ax.set_ylim(bottom=bottom / scale, top=(high + 0.08 * max(high - bottom, 1)) / scale)
    ax.set_xlim(0, 1)
    ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _unit(peak: int) -> tuple[float, str]:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):  # the units of units.fmt_bytes
        if peak >= scale:
            return float(scale), unit
    return 1.0, "B"


# ---- the guardrails -------------------------------------------------------------------------------


def noop_warning(policy: str, peak: int, saved: Any, base_peak: int, base_saved: Any) -> str | None:
    """A warning when a remat policy compiles to ``none``'s peak and saved set: the policy did nothing.

    ``saved`` / ``base_saved`` are comparable signatures of the saved set: :attr:`Explanation.kept` (as
    compiled: catches a recompute XLA merged away in unrolled code) or :func:`saved_signature` of JAX's
    residuals.

    >>> noop_warning("full", 10, ((4,), "f32"), 10, ((4,), "f32")) is not None
    True
    """
    if policy == "none" or peak != base_peak or saved != base_saved:
        return None
    return (
        f"policy {policy!r} compiles to the same peak and saved set as 'none': it did nothing here "
        "(unrolled layers on CPU let XLA merge the recompute away: stack them with remat_kit.stack / a scan; "
        "or its tags name nothing saveable: check the names with `remat-kit policies`)"
    )


def cse_note(policy: str, saved_drop: int, temp_drop: int) -> str | None:
    """A note when a policy's residuals drop by ``saved_drop`` bytes under ``none``'s but its compiled temp
    memory by under a quarter of that: XLA merged the recompute away (CSE, unrolled blocks on CPU).

    The companion of :func:`noop_warning`, which fires when even the compiled saved set is ``none``'s: a
    report carries one of the two, never both (:func:`remat_kit.analysis.inspection.compare`).

    >>> cse_note("full", 1000, 10) is not None, cse_note("full", 1000, 900)
    (True, None)
    """
    if saved_drop <= 0 or temp_drop >= saved_drop / 4:
        return None
    return (
        f"{policy} keeps {fmt_bytes(saved_drop)} less than none but its compiled temp memory drops by only "
        f"{fmt_bytes(max(temp_drop, 0))}: XLA removed most of the recompute (CSE, as XLA:CPU does in a Python "
        "loop of blocks); run the blocks under one scan (remat_kit.stack, or remat_kit.apply(..., scan=True)) "
        "for a real saving"
    )


def optimizer_peak_note(policy: str, saved_drop: int, peak_at: str) -> str:
    """The note, in place of :func:`cse_note`, when a policy keeps less than ``none`` but the compiled step's peak
    is in the optimizer update, after the backward pass: no remat policy moves that peak, whatever it keeps.

    >>> optimizer_peak_note("full", 1000, "optimizer: add at optax").split(":")[0]
    'full keeps 1.0 kB less than none, but the step peaks in the optimizer update (optimizer'
    """
    return (
        f"{policy} keeps {fmt_bytes(saved_drop)} less than none, but the step peaks in the optimizer update "
        f"({peak_at}), after the backward pass: no remat policy moves that peak; at a "
        "larger batch or sequence, where the activations outgrow the optimizer's temporaries, the saving shows"
    )


def saved_signature(residuals: Sequence[Any]) -> tuple:
    """The saved set of a residual list as a comparable signature: sorted ``(shape, dtype, host)``."""
    return tuple(sorted((tuple(r.shape), str(r.dtype), bool(r.host)) for r in residuals))


def policy_offloads(policy: Any) -> bool:
    """Whether a policy (or spec) asks for host offload: its spec has an ``offload`` part.

    >>> policy_offloads("offload:q_proj"), policy_offloads("full")
    (True, False)
    """
    return "offload" in str(policy)


def offload_warnings(offloaded_bytes: int, enforced: bool, policy_offloads: bool, xla_host_bytes: int) -> list[str]:
    """Warnings when offloaded bytes stay on the device.

    Args:
      offloaded_bytes: bytes JAX's residual analysis places in host memory.
      enforced: :attr:`remat_kit.analysis.memory.HostOffload.enforced` on this device.
      policy_offloads: whether the policy asks for offload.
      xla_host_bytes: bytes XLA's compile placed in host memory.

    >>> offload_warnings(1024, False, True, 0)[0].startswith("offloaded")
    True
    """
    out = []
    if policy_offloads and offloaded_bytes == 0:
        out.append(
            "the policy offloads, but nothing is saved to host memory: its destination is one jax.checkpoint "
            "keeps on the device (only 'pinned_host' moves bytes), this JAX's remat recomputes instead "
            "(jax 0.10's remat3), or the offloaded names are not saved"
        )
    elif offloaded_bytes and not enforced:
        out.append(
            f"offloaded {fmt_bytes(offloaded_bytes)} stay on the device: this backend does not enforce host "
            "memory (XLA:CPU); the figures count them as device bytes, a GPU/TPU moves them"
        )
    elif offloaded_bytes and enforced and xla_host_bytes == 0:
        out.append(
            f"JAX marks {fmt_bytes(offloaded_bytes)} for host memory but XLA placed none there: "
            "the destination is one jax.checkpoint ignores (only 'pinned_host' moves)"
        )
    return out


@dataclasses.dataclass(frozen=True)
class Levers:
    """What lowers a peak remat cannot move, in the words of the report's reader.

    Attributes:
      state: what shrinks the parameters, optimizer state and gradients.
      logits: what removes the full logits and their gradient.
      explain: how to read what is live at the peak, for a warning made from sizes alone.
    """

    state: str
    logits: str
    explain: str


#: For a report on a user's own function (``remat_kit.inspect``/``compare``): API words, no CLI flags.
USER_LEVERS = Levers(
    state="fewer trainable parameters (LoRA adapters over a frozen base), sharding them over a mesh",
    logits="a chunked loss that never materializes the full logits",
    explain="inspect(..., explain=True) reads what is live there",
)

#: For the built-in model, whose reports the command line prints: its flags.
CLI_LEVERS = Levers(
    state="LoRA (--lora-rank), a mesh sharding the state (--mesh fsdp=N)",
    logits="a chunked loss (--loss-chunks K, remat_kit.model.loss)",
    explain="--explain reads what is live there",
)


def dominance_warnings(
    at_peak: Mapping[str, int],
    total: int,
    *,
    has_optimizer: bool = False,
    estimated: bool = False,
    levers: Levers = USER_LEVERS,
) -> list[str]:
    """Warnings when the peak is mostly something no remat policy touches, naming the lever that does.

    Args:
      at_peak: group -> bytes: :attr:`Explanation.at_peak` (what is live at the peak, read from XLA's dump), or
        with ``estimated`` the sizes of the state alone (:func:`state_at_peak`, no dump needed).
      total: the compiled peak (:attr:`remat_kit.analysis.memory.CompiledMemory.total`).
      has_optimizer: a training step: optimizer-state offload is a lever too.
      estimated: ``at_peak`` holds sizes, not what XLA keeps live at the peak: the warning says "about".
      levers: the words for the reader (:data:`USER_LEVERS` for an API report, :data:`CLI_LEVERS` for the CLI's).

    >>> dominance_warnings({"parameters": 70, "saved residuals": 30}, 100)[0].split(":")[0]
    'the peak is 70% parameters and gradients'
    """
    out = []
    if total <= 0:
        return out
    untouched = ("parameters", "optimizer state", "gradients", "optimizer update", "weight copies")
    state = sum(at_peak.get(g, 0) for g in untouched)
    if state / total >= DOMINANCE_SHARE:
        what = "parameters, optimizer state and gradients" if has_optimizer else "parameters and gradients"
        state_levers = levers.state + (", optimizer-state offload" if has_optimizer else "")
        about = "about " if estimated else ""
        how = f" (their sizes beside XLA's compiled peak; {levers.explain})" if estimated else ""
        out.append(
            f"the peak is {about}{100 * state / total:.0f}% {what}{how}: "
            f"no remat policy changes them; {state_levers} do"
        )
    logits = at_peak.get("logits / loss", 0)
    if logits / total >= DOMINANCE_SHARE / 2:
        out.append(
            f"the peak is {100 * logits / total:.0f}% logits and loss buffers: no remat policy changes them; "
            f"{levers.logits} does"
        )
    return out


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def warning_lines(rows: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """``warning (policy): text`` lines of a table's rows, a warning said once for every row it applies to: rows
    whose texts differ only in their figures share one line, the figures joined in the rows' order.

    Args:
      rows: ``(policy, its warnings)`` per row, in the table's order.

    Returns:
      One line per distinct warning, in the order first met.

    >>> warning_lines([("full", ["the peak is 74% state"]), ("none", []), ("dots", ["the peak is 51% state"])])
    ['warning (full, dots): the peak is 74/51% state']
    """
    groups: dict[str, list[tuple[str, str]]] = {}
    for name, texts in rows:
        for text in texts:
            groups.setdefault(_NUMBER.sub("#", text), []).append((name, text))
    out = []
    for shape, members in groups.items():
        names = ", ".join(dict.fromkeys(n for n, _ in members))
        figures = list(zip(*(_NUMBER.findall(t) for _, t in members), strict=True))
        parts = shape.split("#")
        text = parts[0] + "".join(
            (f[0] if len(set(f)) == 1 else "/".join(f)) + rest for f, rest in zip(figures, parts[1:], strict=True)
        )
        out.append(f"warning ({names}): {text}")
    return out


def state_at_peak(parameters: int, optimizer_state: int = 0, gradients: int = 0) -> dict[str, int]:
    """The state a compile holds at its peak when XLA's dump was not read, for :func:`dominance_warnings`
    (``estimated=True``) against :attr:`remat_kit.analysis.memory.CompiledMemory.total`: the parameters and optimizer
    state (arguments, live for the whole step) and their gradients (a gradient's outputs, or the whole tree an
    optimizer step reads at once), by size.

    Args:
      parameters, optimizer_state, gradients: their bytes (per device where the compiled memory is).

    >>> from remat_kit.analysis.memory import CompiledMemory
    >>> m = CompiledMemory(argument=30, output=10, alias=0, temp=60, host_argument=0, host_output=0, host_temp=0)
    >>> dominance_warnings(state_at_peak(20, 10, 20), m.total, has_optimizer=True, estimated=True)[0].split(" (")[0]
    'the peak is about 50% parameters, optimizer state and gradients'
    """
    return {"parameters": parameters, "optimizer state": optimizer_state, "gradients": gradients}


def saved_set(report: Any) -> tuple:
    """A report's saved set, comparable across policies: :attr:`Explanation.kept` as compiled where the report
    read XLA's dump, else :func:`saved_signature` of JAX's residuals."""
    return report.kept or saved_signature(report.residuals)


def noop_warnings(reports: Mapping[str, Any]) -> dict[str, str]:
    """policy -> :func:`noop_warning` for each report that compiles to ``none``'s peak and saved set.

    Reports carry ``peak_bytes``, ``kept`` and ``residuals`` (:class:`remat_kit.analysis.inspection.Inspection`,
    :class:`remat_kit.planning.analysis.Analysis`); without a ``none`` report there is nothing to compare: ``{}``.
    """
    base = reports.get("none")
    if base is None:
        return {}
    out = {}
    for name, r in reports.items():
        if w := report_noop_warning(name, r, base):
            out[name] = w
    return out


def report_noop_warning(label: str, report: Any, base: Any) -> str | None:
    """:func:`noop_warning` of one report against ``base`` (``none``'s), each read by :func:`saved_set`.

    Reports carry ``peak_bytes``, ``kept`` and ``residuals`` (as for :func:`noop_warnings`).
    """
    return noop_warning(label, report.peak_bytes, saved_set(report), base.peak_bytes, saved_set(base))
