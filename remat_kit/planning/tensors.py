"""Per-tensor choice inside the block: save, recompute or offload each tagged value, under a budget, compiled to check.

:func:`per_tensor` answers "I have X GB: what should each layer keep?" for the built-in Transformer.
The block's tags (:mod:`remat_kit.names`, those the block really emits at this config) are grouped
into a handful of *groups* (q/k/v together, the two MLP input projections together: they are
computed and consumed together), and every assignment of the groups to save / recompute / offload is
priced:

* **Recompute time: exhaustive over the 2^g subsets of kept groups.** What saving a tag spares is not
  additive (it depends on which neighbours are kept: a saved ``context`` is worth nothing once
  ``attn_out`` is saved and ``mlp_*`` are recomputed from it), so no knapsack or ILP over per-tag
  prices would be exact; with g ≈ 9 groups every subset is instead *traced* (one layer's jaxpr under
  each policy, forward and backward; no compile) and priced by the cost model
  (:mod:`remat_kit.planning.cost`): exact under that model. A kept group may be kept on the device or
  offloaded (3^g assignments, only where offload moves memory): an offloaded group is available to the
  backward pass like a saved one, so it costs the recompute of its kept subset plus its host transfer.
* **Memory: additive per layer.** Under a selective or offload policy a layer's residuals are exactly
  its saved tags, so a layer costs the bytes of its kept device tags (read from the block's jaxpr);
  a uniform policy's need is predicted as ``full``'s compiled need plus those bytes over the layers
  times a slope fitted on the uniform options compiled so far (XLA overlaps some of them with the
  recompute working set), and a mix's need is interpolated between its two parts' needs.
* **Across the stack: exact over one or two parts.** Every layer is alike, so the layers' choices form
  a knapsack whose relaxation is optimal on at most two points of the options' lower convex hull;
  every single option and every mix ``a*k+b*(L-k)`` of two Pareto-optimal options is scored and the
  cheapest that the memory model says fits is compiled: a mix's uncompiled part first (which refits
  the slope), then the answer itself; if it does not fit, the next (at most ``max_compiles``). Every
  answer returned is compiled and fits.

The answer is an ordinary :class:`remat_kit.policies.Policy` or :class:`remat_kit.policies.Mix`, its spec
round-tripping through :func:`remat_kit.policies.parse`, and its cost is re-estimated on the full
step (the same pricing :func:`remat_kit.planning.budget.auto` ranks by).

>>> from remat_kit.model.transformer import TransformerConfig
>>> cfg = TransformerConfig.preset("tiny", num_layers=2)
>>> r = per_tensor(cfg, batch=2, seq=32, budget_bytes=10**10, groups=[("q_proj", "k_proj", "v_proj")])
>>> str(r.chosen), r.fits, r.cost_s
('none', True, 0.0)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence

import jax

from remat_kit import _jax_internals, memory, policies
from remat_kit import names as _names
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning import analysis, cost
from remat_kit.planning.budget import Pricer, planner_platform
from remat_kit.planning.pareto import pareto_front
from remat_kit.planning.planner import DEFAULT_MARGIN, Budget, Planner

#: Tags decided together: computed side by side and read by the same backward ops.
TAG_GROUPS: tuple[tuple[str, ...], ...] = (
    (_names.Q_PROJ, _names.K_PROJ, _names.V_PROJ),
    (_names.MLP_GATE, _names.MLP_UP),
)


@dataclasses.dataclass(frozen=True)
class Option:
    """One layer's choice: the groups kept on the device, those offloaded, and what that costs per layer.

    Attributes:
      policy: the policy of such a layer (``full``, ``selective:...``, ``offload:...``, or ``none``).
      device_bytes: residual bytes the layer keeps on the device beyond ``full``'s.
      cost_s: estimated seconds per layer over ``none`` (recompute plus exposed transfer).
    """

    policy: policies.Policy
    device_bytes: int
    cost_s: float


@dataclasses.dataclass(frozen=True)
class TensorResult:
    """:func:`per_tensor`'s answer.

    Attributes:
      chosen: the fitting Policy or Mix with the least estimated cost, None when nothing fits.
      cost_s: its estimated step-time cost over ``none``, on the full step (None when nothing fits).
      need_bytes: its compiled need; fits: whether that fits the budget (always, when chosen).
      budget_bytes, margin: the budget.
      groups: the tag groups decided.
      options: the Pareto-optimal per-layer options (of the ``2^g`` or ``3^g`` priced).
      compiled: ``(spec, need bytes, fits)`` of every answer compiled to check.
      seconds: wall time; traces: one-layer steps traced.
      source: ``"per-tensor"`` when the search's own answer won, ``"baseline"`` when the given baseline did.
    """

    chosen: policies.Policy | policies.Mix | None
    cost_s: float | None
    need_bytes: int | None
    fits: bool
    budget_bytes: int
    margin: float
    groups: tuple[tuple[str, ...], ...]
    options: tuple[Option, ...]
    compiled: tuple[tuple[str, int, bool], ...]
    seconds: float
    traces: int
    source: str = "per-tensor"


def block_body(config: TransformerConfig, batch: int, seq: int, loss_chunks: int = 0):
    """One layer of the stack as a jaxpr (a ClosedJaxpr of the layer's forward), traced once from a one-layer
    model under ``full`` (whose rematerialized unit is exactly one layer)."""
    one = Planner(dataclasses.replace(config, num_layers=1), loss_chunks=loss_chunks)
    loss, params, args = one.build(policies.full(), batch, seq)
    return _jax_internals.first_remat_body(jax.make_jaxpr(loss)(params, *args))


def tag_bytes(config: TransformerConfig, batch: int, seq: int, loss_chunks: int = 0, body=None) -> dict[str, int]:
    """Bytes per layer of each tag the block emits at this shape (the forward values ``checkpoint_name`` marks).

    >>> b = tag_bytes(TransformerConfig.preset("tiny", num_layers=1), 2, 32)
    >>> b["q_proj"] == 2 * 32 * 64 * 4  # [batch, seq, heads · head_dim] float32
    True
    """
    body = body if body is not None else block_body(config, batch, seq, loss_chunks)
    out: dict[str, int] = {}
    for eqn in _jax_internals.iter_eqns(body):
        tag = _jax_internals.checkpoint_name_of(eqn)
        if tag is not None:
            out[tag] = out.get(tag, 0) + sum(_jax_internals.aval_nbytes(v) for v in eqn.outvars)
    return {t: out[t] for t in (*_names.VOCABULARY, *sorted(set(out) - set(_names.VOCABULARY))) if t in out}


def default_groups(emitted: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """The groups decided for a block emitting ``emitted``: :data:`TAG_GROUPS` where all their tags are
    emitted, every other tag alone; ``layer_input`` (what every rematerialized layer keeps) left out.

    >>> default_groups(["layer_input", "q_proj", "k_proj", "v_proj", "mlp_out"])
    (('q_proj', 'k_proj', 'v_proj'), ('mlp_out',))
    """
    emitted = [t for t in emitted if t != _names.LAYER_INPUT]
    out, used = [], set()
    for t in emitted:
        if t in used:
            continue
        group = next((g for g in TAG_GROUPS if t in g and all(x in emitted for x in g)), (t,))
        out.append(group)
        used.update(group)
    return tuple(out)


def _layer_policy(save: tuple[str, ...], off: tuple[str, ...]) -> policies.Policy:
    if off:
        return policies.offload(off, save=save)
    return policies.selective(save) if save else policies.full()


def per_tensor(
    config: TransformerConfig,
    *,
    batch: int,
    seq: int,
    budget_bytes: int,
    margin: float = DEFAULT_MARGIN,
    optimizer: str = "adamw",
    loss_chunks: int = 0,
    planner: Planner | None = None,
    hardware: cost.Hardware | None = None,
    groups: Sequence[Sequence[str]] | None = None,
    max_compiles: int = 8,
    baseline: policies.Policy | policies.Mix | str | None = None,
) -> TensorResult:
    """Choose, per tag group of the block and per layer range, save / recompute / offload under a budget.

    Args:
      config, batch, seq, loss_chunks, optimizer: the step planned (as :func:`remat_kit.planning.budget.auto`).
      budget_bytes, margin: the budget (:class:`remat_kit.planning.planner.Budget`).
      planner: reuse a :class:`Planner`'s memoized compiles (of this config).
      hardware: what recompute is priced against (default: the backend's
        :func:`remat_kit.planning.cost.default_hardware`).
      groups: the tag groups to decide (default: :func:`default_groups` of the tags the block emits);
        a tag not in any group is recomputed.
      max_compiles: compiles at most, besides ``none`` and ``full``: uniform options (which teach the memory
        model how a kept byte turns into compiled need) and the answer.
      baseline: another answer to beat, e.g. :func:`remat_kit.planning.budget.auto`'s: compiled (memoized
        on a shared ``planner``) and returned instead when it fits and the search found nothing cheaper
        (:attr:`TensorResult.source` says which won).

    Returns:
      A :class:`TensorResult`.

    Raises:
      ValueError/TypeError: bad shape, budget or groups (a tag the block does not emit), before anything
        is compiled.
    """
    budget = Budget(budget_bytes, margin)
    analysis.check_shape(config, batch, seq, loss_chunks)
    start = time.perf_counter()
    L = config.num_layers
    sizes = _block(config, batch, seq, loss_chunks)[1]
    if groups is None:
        groups = default_groups(list(sizes))
    groups = tuple(tuple(_names.resolve(g)) for g in groups)
    missing = sorted({t for g in groups for t in g} - set(sizes))
    if missing or not groups:
        raise ValueError(f"groups {groups!r}: the block does not emit {missing}; it emits: {', '.join(sizes)}")
    planner = planner or Planner(config, optimizer, loss_chunks)
    hardware = hardware or cost.default_hardware(planner_platform(planner))
    price = Pricer(planner, hardware, batch, seq)

    def layer_recompute_s(policy: policies.Policy) -> float:
        return _layer_recompute_s(config, batch, seq, loss_chunks, hardware, policy)

    options = [Option(policies.none(), -1, 0.0)]  # none's bytes are filled in from its compile below
    for r in range(len(groups) + 1):
        for kept in itertools.combinations(groups, r):
            tags = tuple(t for g in kept for t in g)
            recompute_s = layer_recompute_s(_layer_policy(tags, ()))
            splits = itertools.product((False, True), repeat=len(kept)) if price.host_moves else [(False,) * len(kept)]
            for off_mask in splits:
                off = tuple(t for g, o in zip(kept, off_mask, strict=True) if o for t in g)
                save = tuple(t for t in tags if t not in off)
                moved = 2 * sum(sizes[t] for t in off)  # out in the forward pass, back in the backward
                options.append(
                    Option(
                        _layer_policy(save, off),
                        sum(sizes[t] for t in save),
                        recompute_s + hardware.transfer_seconds(moved),
                    )
                )
    traces = 2 ** len(groups)
    need_full = planner.memory(policies.full(), batch, seq)[0]
    need_none = planner.memory(policies.none(), batch, seq)[0]
    options[0] = Option(policies.none(), max(0, (need_none - need_full) // L), 0.0)  # for the front's order only
    keep = pareto_front([(o.cost_s, o.device_bytes) for o in options])
    front = sorted((options[i] for i in keep), key=lambda o: (o.cost_s, o.device_bytes))
    known: dict[str, int] = {"full": need_full, "none": need_none}  # compiled needs, by spec
    order: list[str] = []  # what this search compiled, in order

    def measure(policy) -> int:
        key = str(policy)
        if key not in known:
            known[key] = planner.memory(policy, batch, seq)[0]
            order.append(key)
        return known[key]

    model_cost = {str(o.policy): L * o.cost_s for o in front}
    full_option = next(o for o in options if o.policy == policies.full())

    def line() -> tuple[float, float]:
        # need ≈ β + α · kept bytes, least squares over the uniform options compiled (full among them).
        pts = [
            (L * o.device_bytes, known[str(o.policy)])
            for o in (*front, full_option)
            if str(o.policy) in known and o.policy.kind != "none"
        ]
        if len({x for x, _ in pts}) < 2:
            return 1.0, float(need_full)
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        alpha = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        return alpha, my - alpha * mx

    def plans(fit: tuple[float, float], failed: set[str]) -> list[tuple]:
        """``(cost, predicted need, parts)`` of every single option and two-part mix predicted to fit, cheapest
        first; ``parts`` is ``(option,)`` or ``(a, k, b)``: a mix's need is interpolated between its parts'."""
        alpha, beta = fit
        pred = {id(o): known.get(str(o.policy), beta + alpha * L * o.device_bytes) for o in front}
        out = [(L * o.cost_s, pred[id(o)], (o,)) for o in front]
        for a, b in itertools.permutations(front, 2):
            if a.cost_s >= b.cost_s:  # a: the cheaper to run, b: the leaner
                continue
            for k in range(1, L):
                out.append(
                    (k * a.cost_s + (L - k) * b.cost_s, pred[id(b)] + k * (pred[id(a)] - pred[id(b)]) / L, (a, k, b))
                )
        fitting = [p for p in out if p[1] <= budget.target and (not failed or _plan_policy(p[2], L) not in failed)]
        return sorted(fitting, key=lambda p: (round(p[0], 15), p[1]))

    failed: set[str] = set()
    while len(order) < max_compiles:
        ranked = plans(line(), failed)
        if not ranked:
            break
        parts = ranked[0][2]
        unknown = [o for o in parts[::2] if str(o.policy) not in known]
        if len(parts) > 1 and unknown:  # a mix of an uncompiled option: compile the option (it teaches the model)
            measure(unknown[0].policy)
            continue
        policy = policies.parse(_plan_policy(parts, L))
        model_cost[str(policy)] = ranked[0][0]
        if budget.fits(measure(policy)):
            break
        failed.add(str(policy))
    # The answer: the cheapest of everything compiled that fits (a uniform option compiled to teach the model
    # may be it); its cost re-estimated on the full step.
    fitting = [s for s, n in known.items() if budget.fits(n)]
    best, source = None, "per-tensor"
    if fitting:
        spec = min(fitting, key=lambda s: (round(model_cost[s], 15), known[s]))
        policy = policies.parse(spec)
        best = (policy, price.estimate(policy).cost_s, known[spec])
    if baseline is not None:
        other = policies.parse(baseline)
        need = planner.memory(other, batch, seq)[0]
        est = price.estimate(other).cost_s
        if budget.fits(need) and (best is None or (round(est, 15), need) < (round(best[1], 15), best[2])):
            best, source = (other, est, need), "baseline"
    tried = {s: (known[s], budget.fits(known[s])) for s in ("none", "full", *order)}
    return TensorResult(
        chosen=None if best is None else best[0],
        cost_s=None if best is None else best[1],
        need_bytes=None if best is None else best[2],
        fits=best is not None,
        budget_bytes=budget.bytes,
        margin=budget.margin,
        groups=groups,
        options=tuple(front),
        compiled=tuple((s, n, f) for s, (n, f) in tried.items()),
        seconds=time.perf_counter() - start,
        traces=traces,
        source=source,
    )


@functools.cache
def _block(config: TransformerConfig, batch: int, seq: int, loss_chunks: int):
    body = block_body(config, batch, seq, loss_chunks)
    return body, tag_bytes(config, batch, seq, loss_chunks, body=body)


@functools.cache
def _layer_work(config: TransformerConfig, batch: int, seq: int, loss_chunks: int, policy) -> cost.Work:
    # One layer's forward and backward, traced from the layer's jaxpr (no model tracing): what the layer
    # recomputes over `none` is what the stack recomputes per layer (tests/test_tensors.py). Memoized: every
    # budget at one shape prices the same subsets. The base (None) runs the layer as the stack runs `none`,
    # under keep_activations: a plain vjp counts two more softmax sums per layer than the stack executes.
    body, _ = _block(config, batch, seq, loss_chunks)
    jax_policy = policies.keep_activations if policy is None else policy.jax_policy
    return cost.work_of(_jax_internals.vjp_jaxpr(body, jax_policy))


def _layer_recompute_s(config, batch, seq, loss_chunks, hardware: cost.Hardware, policy: policies.Policy) -> float:
    base = _layer_work(config, batch, seq, loss_chunks, None)
    return cost.estimate(_layer_work(config, batch, seq, loss_chunks, policy), base, hardware).recompute_s


def _plan_policy(parts: tuple, num_layers: int) -> str:
    """The spec of a plan: one option's policy, or the mix ``a*k+b*(L-k)``."""
    if len(parts) == 1:
        return str(parts[0].policy)
    a, k, b = parts
    return str(policies.mix([(a.policy, k), (b.policy, num_layers - k)]))


def offload_note() -> str | None:
    """Why offload options are left out here, or None where offload moves memory."""
    return None if memory.host_offload().enforced else "offload moves nothing on this backend: not considered"
