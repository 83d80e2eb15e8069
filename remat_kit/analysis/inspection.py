"""What the backward pass of *any* scalar loss keeps, needs and costs: compile-only, nothing allocated.

One job, over 400 lines: the compile-only report of any loss's backward pass (residuals,
compiled memory, FLOPs, :func:`compare`); the records and their formatting share its fields.

:func:`inspect` (``remat_kit.inspect``) lowers and compiles ``jax.value_and_grad(loss_fn)`` from
``jax.ShapeDtypeStruct`` inputs (arrays are read for their shapes only) and reports the saved
residuals (JAX's own residual analysis), XLA's compiled memory, a peak estimate and the matmul
FLOPs of the gradient with scan bodies counted once per trip. :func:`compare` does the same for one
loss built per policy, ``make_loss(policy)``, and sets each policy's FLOPs beside ``none``'s.

>>> import jax, jax.numpy as jnp
>>> w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
>>> x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
>>> r = inspect(lambda w, x: jnp.sum(jnp.sin(x @ w)), w, x)
>>> [(x.label, x.shape) for x in r.residuals]  # cos(x @ w), sin's derivative, computed in the forward pass
[('cos in <lambda>', (8, 1024))]
>>> r.flops == 2 * (2 * 8 * 1024 * 1024)  # forward matmul and the weight gradient (x is not differentiated)
True

The report applies the package's one host-offload rule (:func:`remat_kit.analysis.memory.host_offload`): on a
backend that does not enforce host offload (XLA:CPU lowers the device→host copy to nothing),
offloaded residuals are counted as device bytes, and the report says so.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from remat_kit import _jax_internals
from remat_kit import policies as policies_lib
from remat_kit import target as target_lib
from remat_kit.analysis import _xla_dump, memory
from remat_kit.analysis import explain as explain_lib
from remat_kit.analysis.flops import jaxpr_flops
from remat_kit.analysis.memory import CompiledMemory, tree_bytes
from remat_kit.policies import findings
from remat_kit.units import fmt_bytes


def short_source(source: str) -> str:
    """JAX's residual description, shortened: ``"output of exp from .../a.py:58:12 (attn)"`` → ``"exp in attn"``.

    >>> short_source("named 'q_proj' from x.py:3")
    'q_proj'
    """
    if source.startswith("named '"):
        return source[len("named '") :].split("'", 1)[0]
    head = source.removeprefix("output of ").split(" from ", 1)[0]
    head = head.removeprefix("jitted function ").strip("'")
    func = source.rsplit("(", 1)[-1].rstrip(")") if source.endswith(")") else ""
    return f"{head} in {func}" if func else head


def split_saved(residuals: Sequence[Any], enforced: bool | None = None) -> tuple[int, int]:
    """``(device, host)`` bytes of residuals carrying ``nbytes`` and ``host``, under the one host rule.

    Where host offload is not enforced (:attr:`remat_kit.analysis.memory.HostOffload.enforced`), host residuals count
    as device bytes.
    """
    enforced = memory.host_offload().enforced if enforced is None else enforced
    host = sum(r.nbytes for r in residuals if r.host) if enforced else 0
    return sum(r.nbytes for r in residuals) - host, host


def count_flops(jaxpr) -> int:
    """Matmul FLOPs of a (closed) jaxpr, scans × trip count (:func:`remat_kit.analysis.flops.jaxpr_flops`)."""
    return jaxpr_flops(jaxpr)


# ---- the report ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value the backward pass keeps.

    Attributes:
      label: its ``checkpoint_name`` tag, else a short description of what produced it; a scan's stacked
        residual, which JAX reports untagged (``scan in run``), is labelled by what one trip of the scan body
        keeps with its shape (:func:`scan_candidates`): a tag, candidate tags (``"mlp_gate|mlp_up"``) where only
        shape and dtype tell them apart, or ``scan carry``.
      tag: the tag, when JAX reports one.
      shape, dtype, nbytes: its shape, dtype name and size in bytes.
      memory: the memory kind JAX assigns it: ``"device"`` or a host kind (offloaded).
      source: JAX's full description of what produced it.
      tags: the tags it may be: ``(tag,)`` when JAX reports one, the scan body's candidate tags for a stacked
        residual, else ().
    """

    label: str
    tag: str | None
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    memory: str
    source: str
    tags: tuple[str, ...] = ()

    @property
    def host(self) -> bool:
        """Whether JAX places it in a host memory kind (see :func:`remat_kit.analysis.memory.host_offload`)."""
        return self.memory != "device"


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What every compile-only report of a step carries, defined once: its policy, its caveats and guardrails, and
    (with ``explain=True``) what is live at its peak. :class:`Inspection` (any loss) and
    :class:`remat_kit.planning.analysis.Analysis` (the built-in model, with its textbook figures) extend it.

    Attributes:
      notes: caveats a reader needs (e.g. that no memory moves on CPU).
      policy: the policy spec (None for an :func:`inspect` not made by :func:`compare`).
      at_peak: with ``explain=True``, group -> device bytes live at the compiled peak
        (:mod:`remat_kit.analysis.explain`; sums to ``peak_bytes``); empty otherwise.
      largest_at_peak: with ``explain=True``, the ten largest buffers live there.
      warnings: one-line guardrails: offload that moves nothing, a peak no policy touches (read from XLA's dump
        with ``explain=True``, else estimated from the state's size), and (beside ``none``) a policy that did
        nothing.
      timeline: with ``explain=True``, live bytes over the step (:meth:`plot_timeline`).
      kept: with ``explain=True``, the saved set as compiled (:attr:`remat_kit.analysis.explain.Explanation.kept`).
      peak_at: with ``explain=True``, the phase and op at the peak
        (:attr:`remat_kit.analysis.explain.Explanation.peak_at`).
      host_at_peak: with ``explain=True``, bytes XLA placed in host memory live at the peak (apart from
        ``at_peak``: no part of the device peak).
    """

    _: dataclasses.KW_ONLY
    notes: tuple[str, ...] = ()
    policy: str | None = None
    at_peak: dict[str, int] = dataclasses.field(default_factory=dict)
    largest_at_peak: tuple[explain_lib.PeakBuffer, ...] = ()
    warnings: tuple[str, ...] = ()
    timeline: explain_lib.Timeline | None = dataclasses.field(default=None, repr=False, compare=False)
    kept: tuple = dataclasses.field(default=(), repr=False)
    peak_at: str = ""
    host_at_peak: int = 0

    #: What a report is called and the call that records its timeline, for :meth:`plot_timeline`'s refusal.
    made_by: ClassVar[tuple[str, str]] = ("report", "inspect")

    @staticmethod
    def explained(found: explain_lib.Explanation | None) -> dict[str, Any]:
        """The at-peak fields read from XLA's dump (:func:`remat_kit.analysis.explain.explain`); none without one."""
        if found is None:
            return {}
        return {
            "at_peak": found.at_peak,
            "largest_at_peak": found.largest_at_peak,
            "timeline": found.timeline,
            "kept": found.kept,
            "peak_at": found.peak_at,
            "host_at_peak": found.host_bytes,
        }

    def plot_timeline(self, path: str) -> str:
        """Write this step's memory timeline (live bytes over the instruction sequence, peak marked) as a PNG.

        A scan body is drawn once per trip (see :class:`remat_kit.analysis.explain.Timeline`). Needs ``explain=True``.
        """
        if self.timeline is None:
            what, call = self.made_by
            raise ValueError(f"this {what} has no timeline: {call}(..., explain=True) records one")
        return explain_lib.plot_timelines({self.policy or "step": self.timeline}, path)


@dataclasses.dataclass(frozen=True)
class Inspection(StepRecord):
    """The compile-only measurement of ``jax.value_and_grad(loss_fn)`` at one set of input shapes.

    Attributes (and :class:`StepRecord`'s: ``policy``, ``notes``, ``warnings`` and the at-peak fields):
      residuals: every non-argument value the backward pass keeps, largest first.
      saved_bytes: their device bytes (offloaded ones included where host offload is not enforced).
      saved_host_bytes: bytes really offloaded to host memory (0 where offload is not enforced).
      temp_bytes, argument_bytes, output_bytes, alias_bytes: XLA's compiled memory.
      peak_bytes: ``argument + output − alias + temp``: the device bytes live at the peak.
      flops: matmul FLOPs of the forward and backward pass, scan bodies × trip count.
      forward_flops: the same for the loss alone.
      xla_flops: XLA's raw ``cost_analysis()["flops"]`` (counts a scan body once).
      compile_s: seconds to trace, lower and compile.
      platform: the backend compiled for; host_offload_enforced: the host rule there.
    """

    residuals: tuple[Residual, ...]
    saved_bytes: int
    saved_host_bytes: int
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    peak_bytes: int
    flops: int
    forward_flops: int
    xla_flops: float
    compile_s: float
    platform: str
    host_offload_enforced: bool

    def largest(self, n: int = 5) -> tuple[Residual, ...]:
        """The ``n`` largest residuals: what to target next."""
        return self.residuals[:n]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        out = dataclasses.asdict(self)
        # StepRecord's fields after the inspection's own, where the record has always had them.
        shared = [f.name for f in dataclasses.fields(StepRecord)]
        out = {**{k: v for k, v in out.items() if k not in shared}, **{k: out[k] for k in shared}}
        out["residuals"] = [dataclasses.asdict(r) for r in self.residuals]
        out["notes"] = list(self.notes)
        out["xla_flops"] = None if math.isnan(self.xla_flops) else self.xla_flops
        out["largest_at_peak"] = [dataclasses.asdict(b) for b in self.largest_at_peak]
        out["warnings"] = list(self.warnings)
        out.pop("timeline", None)
        out.pop("kept", None)
        return out

    def table(self, top: int = 10) -> str:
        """A readable summary: the totals, then the ``top`` largest residuals."""
        lines = [
            f"saved {fmt_bytes(self.saved_bytes)} (host {fmt_bytes(self.saved_host_bytes)}), "
            f"XLA temp {fmt_bytes(self.temp_bytes)}, arguments {fmt_bytes(self.argument_bytes)}, "
            f"outputs {fmt_bytes(self.output_bytes)}, peak {fmt_bytes(self.peak_bytes)}; "
            f"{self.flops / 1e9:.3g} GFLOP (forward {self.forward_flops / 1e9:.3g}), {len(self.residuals)} residuals",
            f"{'bytes':>10}  {'memory':12} {'dtype':9} {'shape':24} what",
        ]
        for r in self.residuals[:top]:
            lines.append(f"{fmt_bytes(r.nbytes):>10}  {r.memory:12} {r.dtype:9} {r.shape!s:24} {r.label}")
        if len(self.residuals) > top:
            rest = sum(r.nbytes for r in self.residuals[top:])
            lines.append(f"{fmt_bytes(rest):>10}  ... {len(self.residuals) - top} more")
        lines += [f"note: {n}" for n in self.notes]
        if self.at_peak:
            lines.append(f"peak in {self.peak_at}")
            lines.append(
                explain_lib.format_at_peak(self.at_peak, self.largest_at_peak, self.peak_bytes, self.host_at_peak)
            )
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ---- validation ------------------------------------------------------------------------------------


def check_argnums(argnums, nargs: int) -> tuple[int, ...]:
    """``argnums`` as a tuple of valid positions, or a ValueError naming what is allowed."""
    items = argnums if isinstance(argnums, (tuple, list)) else (argnums,)
    if not items or any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise ValueError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}")
    if any(not -nargs <= i < nargs for i in items) or not nargs:
        raise ValueError(f"argnums={argnums!r} is out of range for {nargs} positional argument(s)")
    out = tuple(i % nargs for i in items)
    if len(set(out)) != len(out):
        raise ValueError(f"argnums={argnums!r} repeats an argument")
    return out


def abstract(args: Sequence[Any]) -> tuple[Any, ...]:
    """Every leaf as a ShapeDtypeStruct (arrays are read for shape and dtype only; nothing is copied)."""

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        if isinstance(x, (bool, int, float, complex)):
            return jax.ShapeDtypeStruct((), jnp.asarray(x).dtype)
        raise TypeError(f"inputs must be arrays, ShapeDtypeStructs or Python scalars, got {type(x).__name__}")

    return tuple(jax.tree.map(leaf, a) for a in args)


def check_loss(loss_fn: Callable, args: Sequence[Any]) -> None:
    """Raise a clear error (before compiling) unless ``loss_fn(*args)`` is a real floating scalar."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    with findings.collect():  # apply's guard says its findings in the report (the measuring trace)
        out = jax.eval_shape(loss_fn, *args)
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != () or not jnp.issubdtype(out.dtype, jnp.floating):
        got = out.shape if isinstance(out, jax.ShapeDtypeStruct) else type(out).__name__
        dtype = getattr(out, "dtype", "")
        raise ValueError(f"loss_fn must return a floating-point scalar, got {got} {dtype}".rstrip())


def refuse_baked_nnx(args: Sequence[Any], where: str) -> None:
    """Raise TypeError if an argument is an NNX module holding a remat_kit policy of its own.

    ``compare``/``auto`` measure ``make_loss(policy)`` per policy; an NNX model passed as an argument
    runs the policy its ``remat_kit.nnx.stack``, ``policy(instance)`` wrapper or ``remat_kit.apply``
    was built with, so every row would measure that one policy under another label. Its state is what
    to pass instead (and, for ``apply``, ``remat_kit.apply_factory(plain_model, loss)`` as ``make_loss``).
    """
    nnx = sys.modules.get("flax.nnx")  # no NNX module exists unless flax.nnx was imported
    owners = (("remat_kit.nnx", "Stack"), ("remat_kit.nnx.wrap", "Remat"))
    found = [getattr(sys.modules.get(m), c, None) for m, c in owners]
    holders = tuple(c for c in found if c is not None)
    if nnx is None:
        return
    for i, arg in enumerate(args):
        for leaf in jax.tree.leaves(arg, is_leaf=nnx.graph.is_graph_node):
            if not nnx.graph.is_graph_node(leaf):
                continue
            nodes = [n for _, n in nnx.graph.iter_graph(leaf)]
            applied = next((n for n in nodes if hasattr(type(n), "_remat_kit_policy")), None)
            if applied is not None:
                raise TypeError(
                    f"{where}: argument {i} is an NNX module ({type(leaf).__name__}) made by remat_kit.apply, whose "
                    f"{type(applied).__name__} blocks run its policy {type(applied)._remat_kit_policy}, so every row "
                    f"would measure that one; pass the plain model's parameters (nnx.state(model, nnx.Param)) and "
                    f"make_loss = remat_kit.apply_factory(plain_model, loss) (docs/unedited-models.md)"
                )
            baked = next((n for n in nodes if holders and isinstance(n, holders)), None)
            if baked is not None:
                raise TypeError(
                    f"{where}: argument {i} is an NNX module ({type(leaf).__name__}) whose {type(baked).__name__} runs "
                    f"its own policy {baked.policy}, so every row would measure that one; pass its state instead "
                    f"(graphdef, params, rest = nnx.split(model, nnx.Param, ...)) and let make_loss(policy) build the "
                    f"model under the row's policy and nnx.merge it "
                    f"(docs/your-model.md, 'Measuring an NNX model per policy')"
                )


def _differentiate_only(loss_fn: Callable, argnums: tuple[int, ...], nargs: int) -> Callable:
    """``loss_fn`` with every argument outside ``argnums`` behind stop_gradient: JAX's residual analysis
    differentiates every input, while the gradient wants only ``argnums``."""

    if len(argnums) == nargs:
        return loss_fn

    def fn(*args):
        return loss_fn(*(a if i in argnums else jax.tree.map(jax.lax.stop_gradient, a) for i, a in enumerate(args)))

    return fn


_STOP = "(_differentiate_only."


def residuals(loss_fn: Callable, *args, argnums=0) -> tuple[Residual, ...]:
    """What the backward pass of ``loss_fn`` w.r.t. ``argnums`` keeps (trace-only), largest first; a scan's
    stacked residuals labelled by its body's tags (:func:`scan_candidates`)."""
    nums = check_argnums(argnums, len(args))
    fn = _differentiate_only(loss_fn, nums, len(args))
    candidates, stack_axes = scan_candidates(jax.make_jaxpr(fn)(*args))
    out = []
    for r in _jax_internals.saved_residuals(fn, *args):
        if r.is_argument or (r.source.startswith("output of stop_gradient") and _STOP in r.source):
            continue  # the inputs live anyway (those behind the stop_gradient are inputs too)
        label, tags = (r.tag, (r.tag,)) if r.tag else ("", ())
        if not r.tag:  # JAX reports a scan's residuals stacked and untagged: one trip of its body names them
            label, tags = label_stacked(r.shape, r.dtype, candidates, stack_axes, unstacked=False)
        out.append(
            Residual(
                label=label or short_source(r.source),
                tag=r.tag,
                shape=r.shape,
                dtype=r.dtype,
                nbytes=r.nbytes,
                memory="pinned_host" if r.host else "device",
                source=r.source,
                tags=tags,
            )
        )
    out.sort(key=lambda r: -r.nbytes)
    return tuple(out)


def scan_candidates(jaxpr) -> tuple[dict[tuple, list[tuple[str, str | None]]], set[int]]:
    """What one trip of each scan body in ``jaxpr`` keeps, for :func:`label_stacked`: ``(shape, dtype)`` ->
    ``[(label, tag)]`` (a tag, JAX's short description of an untagged value, or ``scan carry`` for a carried
    input the body keeps), and the scans' trip counts (the axes a stacked residual carries first).

    >>> import jax, jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> keep = jax.checkpoint_policies.save_only_these_names("act")
    >>> body = jax.checkpoint(lambda h, w: (jnp.sin(checkpoint_name(h @ w, "act")), None), policy=keep)
    >>> loss = lambda ws, x: jnp.sum(jax.lax.scan(body, x, ws)[0])
    >>> cands, axes = scan_candidates(jax.make_jaxpr(loss)(jnp.ones((3, 4, 4)), jnp.ones((2, 4))))
    >>> label_stacked((3, 2, 4), "float32", cands, axes, unstacked=False)
    ('act', ('act',))
    """
    candidates: dict[tuple, list[tuple[str, str | None]]] = collections.defaultdict(list)
    axes: set[int] = set()
    for body in _jax_internals.scan_body_residuals(jaxpr):
        axes |= set(body.lengths)
        found = [(r, r.tag or short_source(r.source), r.tag) for r in body.residuals]
        found += [(r, "scan carry", None) for r in body.carried]
        for r, label, tag in found:
            if (label, tag) not in candidates[(r.shape, r.dtype)]:
                candidates[(r.shape, r.dtype)].append((label, tag))
    return dict(candidates), axes


def label_stacked(
    shape: Sequence[int], dtype: str, candidates: dict, stack_axes: set[int], *, unstacked: bool = True
) -> tuple[str, tuple[str, ...]]:
    """Label a residual by what one layer (one trip of a scan body) keeps with that shape, after stripping scan axes.

    Stacked residuals carry up to two leading scan axes (groups, then layers within a group). Tags are preferred
    over JAX's descriptions; several candidates are all listed (``"mlp_gate|mlp_up"``).

    Args:
      shape, dtype: the residual's.
      candidates: ``(shape, dtype)`` -> ``[(label, tag or None)]`` of one layer (:func:`scan_candidates`).
      stack_axes: the sizes a leading scan axis may have.
      unstacked: also match the residual's own shape (a value kept unstacked); False matches stacked ones only.

    Returns:
      ``(label, tags)``; ``("", ())`` when nothing matches.
    """
    keys = [(tuple(shape), dtype)] if unstacked else []
    for k in (1, 2):
        if len(shape) > k and all(d in stack_axes for d in shape[:k]):
            keys.insert(0, (tuple(shape[k:]), dtype))
    for key in keys:
        if key in candidates:
            labels = candidates[key]
            tags = tuple(t for _, t in labels if t)
            weights = [label for label, t in labels if label.startswith("weight ")]
            return "|".join(tags or weights or [label for label, _ in labels]), tags
    return "", ()


# ---- inspect and compare ---------------------------------------------------------------------------


def inspect(
    loss_fn: Callable,
    *args,
    argnums: int | Sequence[int] = 0,
    policy: str | None = None,
    explain: bool = False,
    target=None,
) -> Inspection:
    """Measure the gradient of any scalar loss, compile-only.

    Args:
      loss_fn: ``loss_fn(*args) -> scalar``; may use any remat policy (``remat_kit.stack``,
        ``nn.remat``, ``jax.checkpoint``).
      *args: its inputs: arrays or ``jax.ShapeDtypeStruct`` pytrees (shapes far beyond this
        machine's memory are fine: nothing is allocated).
      argnums: which arguments the gradient is taken with respect to (as ``jax.grad``).
      policy: a label to carry in the report (used by :func:`compare`).
      explain: also read XLA's dump of the compile (:mod:`remat_kit.analysis.explain`): ``at_peak``,
        ``largest_at_peak`` and the ``timeline`` (the dump makes the compile a little slower).
      target: the device compiled for (:func:`remat_kit.target.parse`): ``"local"`` (default), ``"h100"``, ...
        A GPU target compiles XLA:GPU's own step without a GPU: its device and host bytes apart (host = what
        offload moves to pinned host memory), which XLA:CPU cannot show.

    Returns:
      An :class:`Inspection`. Where the loss rematerializes outside a loop (a Python loop of blocks) and JAX
      keeps fewer residuals than the same loss without those remats (:func:`remat_kit._jax_internals.without_remat`),
      that loss is compiled too (one more compile) and the report carries a note when XLA removed the recompute
      (:func:`remat_kit.analysis.explain.cse_note`), or a warning when it compiles to the same peak and saved set.

    Raises:
      TypeError/ValueError: a non-callable or non-scalar loss, bad inputs or bad ``argnums``,
        before anything is compiled.
    """
    nums = check_argnums(argnums, len(args))
    args = abstract(args)
    check_loss(loss_fn, args)
    target = target_lib.parse(target)
    report, loops = _measure(loss_fn, args, nums, policy, explain, target)
    if loops:
        base = _baseline(_jax_internals.without_remat(loss_fn), args, nums, explain, report.saved_bytes, target)
        report = report if base is None else _guardrail(report, base)
    return report


def _baseline(
    loss_fn: Callable, args: tuple, nums: tuple[int, ...], explain: bool, saved: int, target: target_lib.Target
) -> Inspection | None:
    """``loss_fn`` (a ``none`` baseline) measured, only if JAX keeps more for it than ``saved`` bytes (trace only)."""
    if split_saved(residuals(loss_fn, *args, argnums=nums))[0] <= saved:
        return None  # nothing dropped: there is no saving XLA could have removed
    return _measure(loss_fn, args, nums, "none", explain, target)[0]


def _measure(
    loss_fn: Callable,
    args: tuple,
    nums: tuple[int, ...],
    policy: str | None,
    explain: bool,
    target: target_lib.Target = target_lib.LOCAL,
) -> tuple[Inspection, bool]:
    """:func:`inspect` of checked, abstract inputs, without a baseline: (report, whether the gradient
    rematerializes outside a loop, where XLA may remove the recompute)."""
    start = time.perf_counter()
    grad = jax.value_and_grad(loss_fn, argnums=nums if len(nums) > 1 else nums[0])
    with findings.collect() as found_by_guard, target.tracing():  # the guard's findings; the target's kernels
        rows = residuals(loss_fn, *args, argnums=nums)
        traced = jax.jit(grad).trace(*target.abstract(args))
    if explain:
        compiled, program = _xla_dump.compile_with_dump(traced.lower())
    else:
        compiled, program = traced.lower().compile(), None
    seconds = time.perf_counter() - start
    held = CompiledMemory.from_compiled(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    device = target.devices()[0]
    rule = memory.host_offload(device)
    enforced = rule.enforced
    saved, host = split_saved(rows, enforced)
    notes = []
    if any(r.host for r in rows) and not enforced:
        notes.append(rule.note)
    found = _explain(program, held, args, nums, rows) if program is not None else None
    # The policy offloads when its label says so or when the gradient copies residuals to a memory space (a
    # user's own jax.checkpoint policy, whatever its destination).
    offloads = explain_lib.policy_offloads(policy or "") or any(
        map(_jax_internals.is_host_transfer, _jax_internals.iter_eqns(traced.jaxpr))
    )
    warnings = explain_lib.offload_warnings(sum(r.nbytes for r in rows if r.host), enforced, offloads, held.host)
    warnings += found_by_guard
    if found is not None:
        warnings += explain_lib.dominance_warnings(found.at_peak, found.total)
        if note := explain_lib.reserved_note(found.at_peak, found.total):
            notes.append(note)
    else:  # no dump read: the differentiated arguments and their gradients (the outputs), by size
        state = sum(tree_bytes(args[i]) for i in nums)
        warnings += explain_lib.dominance_warnings(
            explain_lib.state_at_peak(state, gradients=state), held.total, estimated=True
        )
    report = Inspection(
        residuals=rows,
        saved_bytes=saved,
        saved_host_bytes=host,
        temp_bytes=held.temp,
        argument_bytes=held.argument,
        output_bytes=held.output,
        alias_bytes=held.alias,
        peak_bytes=held.total,
        flops=count_flops(traced.jaxpr),
        forward_flops=count_flops(jax.make_jaxpr(loss_fn)(*args)),
        xla_flops=float((cost or {}).get("flops", math.nan)),
        compile_s=seconds,
        platform=device.platform,
        host_offload_enforced=enforced,
        notes=tuple(notes),
        policy=policy,
        warnings=tuple(warnings),
        **StepRecord.explained(found),
    )
    return report, _jax_internals.remat_outside_loops(traced.jaxpr)


def _explain(program, held: CompiledMemory, args, nums: tuple[int, ...], rows) -> explain_lib.Explanation:
    """The at-peak groups of an inspected gradient: the differentiated arguments' leaves are parameters."""
    groups, n = {}, 0
    grads = []
    for i, a in enumerate(args):
        for leaf in jax.tree.leaves(a):
            groups[n] = "parameters" if i in nums else "inputs"
            if i in nums:
                grads.append((tuple(leaf.shape), str(leaf.dtype)))
            n += 1
    tags = unique_tags(rows)
    saved = [(tuple(r.shape), str(r.dtype)) for r in rows]
    return explain_lib.explain(
        program, held, parameter_groups=groups, gradient_shapes=grads, tags=tags, residual_shapes=saved
    )


def unique_tags(rows) -> dict:
    """``(shape, dtype) -> label`` for residual shapes whose residuals all carry one tag label (JAX's tag, or a
    scan body's candidate tags, ``"mlp_gate|mlp_up"``); a shape shared by two labels, or by an untagged
    residual, is ambiguous and left out. ``rows`` carry ``shape``, ``dtype``, ``label`` and ``tags``."""
    seen: dict = {}
    for r in rows:
        key = (tuple(r.shape), str(r.dtype))
        seen.setdefault(key, set()).add(r.label if r.tags else "")
    return {k: next(iter(v)) for k, v in seen.items() if len(v) == 1 and "" not in v}


def gradient_flops(loss_fn: Callable, *args, argnums=0) -> int:
    """Matmul FLOPs of ``value_and_grad(loss_fn)`` (trace only, no compile)."""
    nums = check_argnums(argnums, len(args))
    grad = jax.value_and_grad(loss_fn, argnums=nums if len(nums) > 1 else nums[0])
    return count_flops(jax.make_jaxpr(grad)(*abstract(args)))


#: Columns every policy table of the package prints (plan, compare, auto, bench), in this order.
TABLE_COLUMNS: tuple[str, ...] = ("policy", "saved", "host", "XLA temp", "peak", "GFLOPs", "×none", "compile")


def table_header(extra: Sequence[tuple[str, int]] = ()) -> str:
    """The header of :data:`TABLE_COLUMNS` plus ``extra`` ``(name, width)`` columns."""
    head = f"{'policy':24} {'saved':>10} {'host':>10} {'XLA temp':>10} {'peak':>10} {'GFLOPs':>9} {'×none':>6}"
    head += "".join(f" {name:>{width}}" for name, width in extra)
    return head + f" {'compile':>8}"


def table_row(
    policy: str,
    saved: int,
    host: int,
    temp: int,
    peak: int,
    flops: int,
    base_flops: int | None,
    compile_s: float,
    extra: Sequence[tuple[str, int]] = (),
) -> str:
    """One row under :func:`table_header`; ``extra`` holds ``(text, width)`` cells."""
    ratio = f"{flops / base_flops:.3f}" if base_flops else "-"
    row = (
        f"{policy:24} {fmt_bytes(saved):>10} {fmt_bytes(host):>10} {fmt_bytes(temp):>10} {fmt_bytes(peak):>10} "
        f"{flops / 1e9:>9.3g} {ratio:>6}"
    )
    row += "".join(f" {text:>{width}}" for text, width in extra)
    return row + f" {compile_s:>7.1f}s"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One :class:`Inspection` per policy, in the order asked, and their recompute beside ``none``.

    Attributes:
      policies: the policy specs, in order.
      reports: one report per policy, in the same order.
      base_flops: matmul FLOPs of the gradient under ``none`` (traced, not compiled, when ``none``
        was neither among the policies nor measured for a guardrail).
    """

    policies: tuple[str, ...]
    reports: tuple[Inspection, ...]
    base_flops: int

    def __getitem__(self, policy) -> Inspection:
        """The report of ``policy`` (a spec or a Policy); a KeyError names the policies compared."""
        spec = str(policy)
        if spec not in self.policies:
            raise KeyError(f"policy {spec!r} was not compared; compared: {', '.join(self.policies)}")
        return self.reports[self.policies.index(spec)]

    def __iter__(self):
        """The reports, in the order asked: ``for r in comparison: r.policy, r.peak_bytes``."""
        return iter(self.reports)

    def __len__(self) -> int:
        return len(self.reports)

    def plot_timeline(self, path: str, title: str = "live device memory per policy") -> str:
        """One memory-timeline line per policy on one PNG (needs ``compare(..., explain=True)``; a scan body is
        drawn once per trip, see :class:`remat_kit.analysis.explain.Timeline`)."""
        if any(r.timeline is None for r in self.reports):
            raise ValueError("these reports have no timeline: compare(..., explain=True) records them")
        lines = dict(zip(self.policies, (r.timeline for r in self.reports), strict=True))
        return explain_lib.plot_timelines(lines, path, title)

    @property
    def recompute_flops(self) -> dict[str, int]:
        """Matmul FLOPs each policy spends beyond ``none``."""
        return {p: r.flops - self.base_flops for p, r in zip(self.policies, self.reports, strict=True)}

    @property
    def flops_ratio(self) -> dict[str, float]:
        """Each policy's FLOPs over ``none``'s."""
        return {p: r.flops / self.base_flops for p, r in zip(self.policies, self.reports, strict=True)}

    def table(self) -> str:
        """The comparison table (the columns ``remat-kit plan`` prints), then any notes."""
        head = table_header()
        rows = [head, "-" * len(head)]
        for p, r in zip(self.policies, self.reports, strict=True):
            rows.append(
                table_row(
                    p,
                    r.saved_bytes,
                    r.saved_host_bytes,
                    r.temp_bytes,
                    r.peak_bytes,
                    r.flops,
                    self.base_flops,
                    r.compile_s,
                )
            )
        notes = dict.fromkeys(n for r in self.reports for n in r.notes)
        warnings = explain_lib.warning_lines(
            [(p, r.warnings) for p, r in zip(self.policies, self.reports, strict=True)]
        )
        return "\n".join(rows + [f"note: {n}" for n in notes] + warnings)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record: one inspection record per policy with its recompute FLOPs."""
        records = []
        for p, r in zip(self.policies, self.reports, strict=True):
            records.append({**r.to_dict(), "policy": p, "recompute_flops": r.flops - self.base_flops})
        return {"base_flops": self.base_flops, "records": records}


def _guardrail(r: Inspection, base: Inspection) -> Inspection:
    """``r`` with at most one guardrail against ``base`` (``none``'s): a warning if it compiles to its peak and
    saved set (:func:`remat_kit.analysis.explain.noop_warning`), else a note if XLA's CSE emptied its saving
    (:func:`remat_kit.analysis.explain.cse_note`)."""
    label = r.policy or "the remat in this loss"
    if w := explain_lib.report_noop_warning(label, r, base):
        return dataclasses.replace(r, warnings=(w, *r.warnings))
    if note := explain_lib.cse_note(label, base.saved_bytes - r.saved_bytes, base.temp_bytes - r.temp_bytes):
        return dataclasses.replace(r, notes=(*r.notes, note))
    return r


def compare(
    make_loss: Callable,
    policies: Sequence[Any],
    *args,
    argnums: int | Sequence[int] = 0,
    explain: bool = False,
    target=None,
) -> Comparison:
    """Inspect ``make_loss(policy)`` for each policy, in order, compile-only.

    Args:
      make_loss: ``make_loss(policy) -> loss_fn``, where ``policy`` is a :class:`remat_kit.Policy`.
      policies: Policy objects or spec strings (``"none"``, ``"full"``, ``"sqrt_n"`` ...).
      *args, argnums, explain, target: as :func:`inspect`.

    Returns:
      A :class:`Comparison`; recompute FLOPs are measured against ``none``. Each row carries at most one
      guardrail against ``none``: a warning when it compiles to its peak and saved set (it did nothing:
      :func:`remat_kit.analysis.explain.noop_warning`), else a note when XLA removed its recompute
      (:func:`remat_kit.analysis.explain.cse_note`). Without ``none`` among the policies it is measured for this
      (one more compile) where a row rematerializes outside a loop and keeps less than it; otherwise its
      FLOPs are traced.

    Raises:
      TypeError: an argument is an NNX module holding a policy of its own (a ``remat_kit.nnx.stack``,
        ``policy(instance)`` or ``remat_kit.apply``): each row would measure that policy. Pass its state
        and build the model from the policy in ``make_loss`` (``remat_kit.apply_factory`` for an
        unedited model; see :func:`refuse_baked_nnx`).
    """
    if not callable(make_loss):
        raise TypeError(f"make_loss must be callable (policy -> loss_fn), got {type(make_loss).__name__}")
    if isinstance(policies, (str, policies_lib.Policy)) or not len(policies):
        raise ValueError(f"policies must be a non-empty sequence of policies or specs, got {policies!r}")
    pool = [policies_lib.parse(p) for p in policies]
    check_argnums(argnums, len(args))
    refuse_baked_nnx(args, "compare")
    args = abstract(args)
    nums = check_argnums(argnums, len(args))
    losses = [make_loss(p) for p in pool]
    for loss_fn in losses:  # every row's errors before the first compile
        check_loss(loss_fn, args)
    target = target_lib.parse(target)
    measured = [_measure(loss_fn, args, nums, str(p), explain, target) for p, loss_fn in zip(pool, losses, strict=True)]
    reports = tuple(r for r, _ in measured)
    specs = tuple(str(p) for p in pool)
    if "none" in specs:
        base = reports[specs.index("none")]
    elif any(loops for _, loops in measured):  # XLA may have removed a row's recompute: measure none to tell
        base = _baseline(
            make_loss(policies_lib.none()), args, nums, explain, min(r.saved_bytes for r in reports), target
        )
    else:
        base = None
    if base is not None:
        reports = tuple(_guardrail(r, base) for r in reports)
    flops = base.flops if base is not None else gradient_flops(make_loss(policies_lib.none()), *args, argnums=argnums)
    return Comparison(policies=specs, reports=reports, base_flops=flops)
