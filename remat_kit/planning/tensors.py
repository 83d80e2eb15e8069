"""Per-tensor choice inside the block: save, recompute or offload each tagged value, under a budget, compiled to check.

:func:`per_tensor` answers "I have X GB: what should each layer keep?" for the built-in Transformer.
The block's tags (:mod:`remat_kit.names`, those the block really emits at this config) are grouped
into a handful of *groups* (q/k/v together, the two MLP input projections together: they are
computed and consumed together), and every assignment of the groups to save / recompute / offload is
priced. What the search is, exactly:

* **Inside the block: exhaustive enumeration.** What saving a tag spares is not additive (it depends on
  which neighbours are kept: a saved ``context`` is worth nothing once ``attn_out`` is saved and
  ``mlp_*`` are recomputed from it), so no knapsack, DP or ILP over per-tag prices would be exact;
  with g ≈ 8 groups every one of the 2^g subsets is instead *traced* (one layer's jaxpr under each
  policy, forward and backward; no compile) and priced by the cost model
  (:mod:`remat_kit.planning.cost`): exact under that model. A kept group may be kept on the device or
  offloaded (3^g assignments, only where offload moves memory): an offloaded group is available to the
  backward pass like a saved one, so it costs the recompute of its kept subset plus its host transfer.
  The layer's price plus the stack's constant per remat layer (what the stack recomputes beyond L
  times one layer, measured once on ``full``: zero on the classic remat, the same for every remat
  policy under remat3) is the stack's price per layer.
* **Across the stack: exhaustive over one or two parts.** The layers are alike and a layer's memory is
  (nearly) additive, so the layers' choices form a knapsack over identical items whose relaxation is
  optimal on at most two options (two points of the lower convex hull; the integer optimum may differ
  by one layer). Every single option and every mix ``a*k+b*(L-k)`` of two of the Pareto-optimal
  options (``none`` among them, kept out of the pruning: its memory is a compiled figure, not a sum of
  tag bytes) is scored, cheapest first.
* **Memory: modelled, then compiled.** A selective or offload layer keeps exactly its saved tags, so a
  uniform option's need is predicted as a line in its kept bytes fitted on every uniform policy
  compiled so far (XLA overlaps some of them with the recompute working set); a mix's need is
  interpolated between its parts' needs and through every mix of the same two parts already
  compiled. A mix with ``none`` is not linear in its count (XLA may peak above ``none`` itself): its
  compiled points decide, and before any is compiled the share by which compiled ``none`` mixes of
  the same count lay above their line is added to it. The
  cheapest plan the model says fits is compiled (a mix's uncompiled part first, which refits the
  line), and the search goes on while a plan cheaper than the best compiled answer is predicted to
  fit, at most ``max_compiles`` compiles.
* **Seeds: the presets.** Before it starts, :func:`remat_kit.planning.fit.auto`'s own search runs
  on the same planner over the preset pool (compiles memoized there): its compiled presets and its
  best mix are known points of the memory model and candidate answers. The answer is the fitting
  compiled policy with the least estimated cost on the full step (ties to less recompute, then to
  less memory), so by construction it never costs more than the best preset or mix at that budget.

The answer is an ordinary :class:`remat_kit.policies.Policy` or :class:`remat_kit.policies.Mix`, its spec
round-tripping through :func:`remat_kit.policies.parse`. ``maxtext=True`` keeps to what MaxText's
``custom`` remat can name (:func:`remat_kit.policies.to_maxtext`), part by part for a mix.

:func:`config_choice` is the engine of :func:`remat_kit.fit` (:func:`remat_kit.planning.engine.plan`) on the
built-in Transformer: its presets, its tags as groups, mixes over its layers; ``plan --budget``, ``train --budget``
and ``fit`` of a ``Transformer`` (:func:`fit_transformer`) run it.

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
from collections.abc import Callable, Sequence

import jax
import optax

from remat_kit import _jax_internals, policies
from remat_kit import names as _names
from remat_kit.model.transformer import Transformer, TransformerConfig
from remat_kit.planning import analysis, cost, engine
from remat_kit.planning import tiles as tiles_lib
from remat_kit.planning.budget import AutoResult, Pricer, search
from remat_kit.planning.builtin import Planner, candidates_for, retiled
from remat_kit.planning.engine import MAX_COMPILES, Choice, emitted_bytes
from remat_kit.planning.pareto import pareto_front
from remat_kit.planning.planner import DEFAULT_MARGIN, Budget, StepPlanner
from remat_kit.units import fmt_bytes, fmt_seconds

#: Tags decided together: computed side by side and read by the same backward ops.
TAG_GROUPS: tuple[tuple[str, ...], ...] = (
    (_names.Q_PROJ, _names.K_PROJ, _names.V_PROJ),
    (_names.MLP_GATE, _names.MLP_UP),
)

#: Where a compiled answer came from (:attr:`TensorResult.source`): a preset of the pool, auto's mix of two
#: presets, or the per-tensor search's own plan.
SOURCES: tuple[str, ...] = ("preset", "mix", "per-tensor")


@dataclasses.dataclass(frozen=True)
class Option:
    """One layer's choice: the groups kept on the device, those offloaded, and what that costs per layer.

    Attributes:
      policy: the policy of such a layer (``full``, ``selective:...``, ``offload:...``, or ``none``).
      device_bytes: tag bytes the layer keeps on the device beyond ``full``'s (0 for ``none``, whose
        memory is only known compiled).
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
      options: the Pareto-optimal per-layer options (of the ``2^g`` or ``3^g`` priced; ``none`` apart).
      compiled: ``(spec, need bytes, fits, source)`` of every policy compiled and considered: the seeds
        (``source`` ``"preset"`` or ``"mix"``, compiled by auto's search) and the search's own
        (``"per-tensor"``), in that order.
      seconds: wall time; traces: one-layer steps traced.
      source: where the answer came from, one of :data:`SOURCES`.
      maxtext: whether the search kept to what MaxText's ``custom`` remat can name.
    """

    chosen: policies.Policy | policies.Mix | None
    cost_s: float | None
    need_bytes: int | None
    fits: bool
    budget_bytes: int
    margin: float
    groups: tuple[tuple[str, ...], ...]
    options: tuple[Option, ...]
    compiled: tuple[tuple[str, int, bool, str], ...]
    seconds: float
    traces: int
    source: str = "per-tensor"
    maxtext: bool = False


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
    out = emitted_bytes(body)
    return {t: out[t] for t in (*_names.VOCABULARY, *sorted(set(out) - set(_names.VOCABULARY))) if t in out}


def default_groups(emitted: Sequence[str], *, maxtext: bool = False) -> tuple[tuple[str, ...], ...]:
    """The groups decided for a block emitting ``emitted``: :data:`TAG_GROUPS` where all their tags are
    emitted, every other tag alone; ``layer_input`` (what every rematerialized layer keeps) left out, and with
    ``maxtext`` every tag MaxText's ``custom`` remat has no name for (:data:`remat_kit.policies.MAXTEXT_TAGS`).

    >>> default_groups(["layer_input", "q_proj", "k_proj", "v_proj", "mlp_out"])
    (('q_proj', 'k_proj', 'v_proj'), ('mlp_out',))
    >>> default_groups(["attn_norm", "q_proj", "context", "mlp_act"], maxtext=True)
    (('q_proj',), ('context',))
    """
    emitted = [t for t in emitted if t != _names.LAYER_INPUT and (not maxtext or t in policies.MAXTEXT_TAGS)]
    out, used = [], set()
    for t in emitted:
        if t in used:
            continue
        group = next((g for g in TAG_GROUPS if t in g and all(x in emitted for x in g)), (t,))
        out.append(group)
        used.update(group)
    return tuple(out)


def _layer_policy(save: Sequence[str], off: Sequence[str]) -> policies.Policy:
    """The policy of a layer keeping ``save`` and offloading ``off``, its tags in block order (so a subset
    equal to a preset's tags is that preset, spec and all)."""
    order = {t: i for i, t in enumerate(_names.VOCABULARY)}
    save, off = (tuple(sorted(ts, key=lambda t: order.get(t, len(order)))) for ts in (save, off))
    if off:
        return policies.offload(off, save=save)
    return policies.selective(save) if save else policies.full()


def maxtext_ok(policy: policies.Policy | policies.Mix) -> bool:
    """Whether MaxText's ``custom`` remat can say ``policy`` (each part of a mix on its own)."""
    parts = policy.policies
    try:
        for part in parts:
            policies.to_maxtext(part)
    except ValueError:
        return False
    return True


def layer_options(
    price: Pricer,
    config: TransformerConfig,
    groups: Sequence[Sequence[str]],
    sizes: dict[str, int],
    loss_chunks: int = 0,
) -> list[Option]:
    """Every option of one layer: each subset of ``groups`` kept (the rest recomputed), priced on the layer's jaxpr
    (2^g traces, no compile); where offload moves memory (``price.host_moves``) each kept group also offloaded
    (3^g options), charged the recompute of what stays kept plus the exposed transfer of its bytes both ways.

    Args:
      price: the step's :class:`remat_kit.planning.budget.Pricer` (hardware, shape, the stack's constant per layer).
      sizes: bytes per layer of each tag (:func:`tag_bytes`).
    """
    hardware = price.hardware
    options = []
    for r in range(len(groups) + 1):
        for kept in itertools.combinations(groups, r):
            tags = tuple(t for g in kept for t in g)
            recompute_s = _layer_recompute_s(price, config, loss_chunks, _layer_policy(tags, ()))
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
    return options


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
    pool: Sequence[policies.Policy | str] | None = None,
    max_compiles: int = 8,
    maxtext: bool = False,
) -> TensorResult:
    """Choose, per tag group of the block and per layer range, save / recompute / offload under a budget.

    The search (the module docstring says exactly what it is): every subset of the groups priced on one
    layer's jaxpr, every single option and two-part mix of the Pareto-optimal ones scored, the cheapest
    predicted to fit compiled, with auto's compiled presets and best mix as seeds: the answer never costs
    more (estimated) than the best preset or mix of ``pool`` at this budget.

    Args:
      config, batch, seq, loss_chunks, optimizer: the step planned (as :func:`remat_kit.planning.fit.auto`).
      budget_bytes, margin: the budget (:class:`remat_kit.planning.planner.Budget`).
      planner: reuse a :class:`Planner`'s memoized compiles (of this config).
      hardware: what recompute is priced against (default: the backend's
        :func:`remat_kit.planning.cost.default_hardware`).
      groups: the tag groups to decide (default: :func:`default_groups` of the tags the block emits);
        a tag not in any group is recomputed.
      pool: the presets auto's seed search considers (default:
        :func:`remat_kit.planning.builtin.candidates_for`); ``()`` for the per-tensor search alone.
      max_compiles: compiles at most by the search itself, besides ``none``, ``full`` and the seeds: uniform
        options (which teach the memory model) and answers.
      maxtext: keep to what MaxText's ``custom`` remat can name: groups of :data:`remat_kit.policies.MAXTEXT_TAGS`
        only, and seeds :func:`remat_kit.policies.to_maxtext` accepts (each part of a mix on its own).

    Returns:
      A :class:`TensorResult`.

    Raises:
      ValueError/TypeError: bad shape, budget or groups (a tag the block does not emit, or with ``maxtext``
        one MaxText has no name for), before anything is compiled.
    """
    budget = Budget(budget_bytes, margin)
    analysis.check_shape(config, batch, seq, loss_chunks)
    if not isinstance(maxtext, bool):
        raise TypeError(f"maxtext must be True or False, got {maxtext!r}")
    if isinstance(max_compiles, bool) or not isinstance(max_compiles, int) or max_compiles < 0:
        raise ValueError(f"max_compiles must be an integer >= 0 (0: the seeds alone), got {max_compiles!r}")
    start = time.perf_counter()
    L = config.num_layers
    sizes = _block(config, batch, seq, loss_chunks)[1]
    if groups is None:
        groups = default_groups(list(sizes), maxtext=maxtext)
    groups = tuple(tuple(_names.resolve(g)) for g in groups)
    missing = sorted({t for g in groups for t in g} - set(sizes))
    if missing or not groups:
        raise ValueError(f"groups {groups!r}: the block does not emit {missing}; it emits: {', '.join(sizes)}")
    unnamed = sorted({t for g in groups for t in g} - set(policies.MAXTEXT_TAGS))
    if maxtext and unnamed:
        raise ValueError(
            f"groups {groups!r}: MaxText's custom remat has no name for {unnamed}; with maxtext=True decide only "
            f"{', '.join(t for t in sizes if t in policies.MAXTEXT_TAGS and t != _names.LAYER_INPUT)}"
        )
    planner = planner or Planner(config, optimizer, loss_chunks)
    hardware = hardware or planner.hardware
    price = Pricer(planner, hardware, batch, seq)
    pool = candidates_for(config) if pool is None else [policies.parse(p, num_layers=L) for p in pool]
    if maxtext:
        pool = [p for p in pool if maxtext_ok(p)]

    options = layer_options(price, config, groups, sizes, loss_chunks)
    traces = 2 ** len(groups)
    # `none` stays out of the pruning: its memory is a compiled figure, not comparable with summed tag bytes.
    keep = pareto_front([(o.cost_s, o.device_bytes) for o in options])
    front = sorted((options[i] for i in keep), key=lambda o: (o.cost_s, o.device_bytes))
    none_option = Option(policies.none(), 0, 0.0)
    parts = [none_option, *front]

    # ---- what is known compiled: none, full, the seeds (auto's search over the pool) and whatever of this search's
    # space the planner compiled before at this shape (memoized: free)
    pool_specs = {str(p) for p in pool}
    space = {str(o.policy) for o in options} | {"none"}

    def source(spec: str) -> str | None:
        """Where a compiled spec belongs (one of SOURCES), None outside the search's space and the seeds'."""
        try:
            policy = policies.parse(spec)
        except ValueError:  # a JAX policy given as a callable has no spec to rebuild it from
            return None
        if maxtext and not maxtext_ok(policy):
            return None
        if spec in pool_specs:
            return "preset"
        members = [str(p) for p, _ in policy.parts] if isinstance(policy, policies.Mix) else [spec]
        if len(members) == 2 and set(members) <= pool_specs:
            return "mix"
        return "per-tensor" if len(members) <= 2 and set(members) <= space else None

    known: dict[str, int] = {}  # spec -> compiled need
    spent = [0]  # the search's own compiles

    def measure(policy) -> int:
        key = str(policy)
        if key not in known:
            done = planner.compiles
            known[key] = planner.memory(policy, batch, seq)[0]
            spent[0] += planner.compiles - done
        return known[key]

    if pool:
        search(planner, pool, budget, batch=batch, seq=seq, loss_chunks=loss_chunks, num_layers=L, hardware=hardware)
    for spec, need in planner.compiled_needs(batch, seq).items():
        if source(spec) is not None:
            known[spec] = need
    measure(policies.none())
    measure(policies.full())
    spent[0] = 0

    # ---- the memory model
    def tag_sum(policy) -> int | None:
        """A uniform selective/offload/full policy's kept device tag bytes per layer (None for any other)."""
        if policy.kind not in ("full", "selective", "offload") or not set(policy.save) <= set(sizes):
            return None
        return sum(sizes[t] for t in policy.save)

    def line() -> tuple[float, float]:
        # need ≈ β + α · L · kept bytes, least squares over every uniform policy compiled (full among them).
        pts = []
        for spec, need in known.items():
            policy = policies.parse(spec)
            kept = None if isinstance(policy, policies.Mix) else tag_sum(policy)
            if kept is not None and (policy.kind != "offload" or price.host_moves):
                pts.append((L * kept, need))
        if len({x for x, _ in pts}) < 2:
            return 1.0, float(known["full"])
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        alpha = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        return alpha, my - alpha * mx

    def mixes_known() -> dict[tuple[str, int, str], int]:
        """Compiled two-part mixes by ``(a, k, b)`` specs: the measured points of each pair's line."""
        out = {}
        for spec, need in known.items():
            policy = policies.parse(spec)
            if isinstance(policy, policies.Mix) and len(policy.parts) == 2:
                (a, k), (b, _) = policy.parts
                out[(str(a), k, str(b))] = need
        return out

    def plans() -> list[tuple[float, float, tuple]]:
        """``(modelled cost, predicted need, parts)`` of every single option and two-part mix, cheapest first;
        ``parts`` is ``(option,)`` or ``(a, k, b)``: the mix ``a*k+b*(L-k)``, a the cheaper to run, b the leaner."""
        alpha, beta = line()
        measured = mixes_known()
        need = {id(o): known.get(str(o.policy), beta + alpha * L * o.device_bytes) for o in parts}
        # A mix with `none` is not linear in its count (XLA may peak above `none` itself): the share of the span
        # its compiled points lay above the line, per count, is added to the line of every `none` pair not compiled.
        excess: dict[int, float] = {}
        for (x, k, y), n in measured.items():
            if x == "none" and y in known and known["none"] > known[y]:
                span = known["none"] - known[y]
                excess[k] = max(excess.get(k, 0.0), (n - known[y]) / span - k / L)
        out = [(L * o.cost_s, need[id(o)], (o,)) for o in parts]
        for a, b in itertools.permutations(parts, 2):
            if a.cost_s >= b.cost_s:
                continue
            # The mix's need through its two ends and every mix of the same two parts already compiled.
            sa, sb = str(a.policy), str(b.policy)
            points = {0: need[id(b)], L: need[id(a)]}
            points.update({k: n for (x, k, y), n in measured.items() if (x, y) == (sa, sb)})
            ks = sorted(points)
            for k in range(1, L):
                lo = max(x for x in ks if x <= k)
                hi = min(x for x in ks if x >= k)
                pred = points[k] if k in points else points[lo] + (k - lo) * (points[hi] - points[lo]) / (hi - lo)
                if sa == "none" and k not in points:
                    pred += max(excess.get(k, 0.0), 0.0) * max(points[L] - points[0], 0)
                out.append((k * a.cost_s + (L - k) * b.cost_s, pred, (a, k, b)))
        return sorted(out, key=lambda p: (round(p[0], 15), p[1]))

    def best_fitting() -> tuple | None:
        """The cheapest compiled policy that fits, by the full step's estimate: ``(rank, need, spec)``."""
        rows = [(price.estimate(policies.parse(s)).rank, n, s) for s, n in known.items() if budget.fits(n)]
        rows = [r for r in rows if not maxtext or maxtext_ok(policies.parse(r[2]))]
        rows = [r for r in rows if price.choosable(policies.parse(r[2]))]
        return min(rows) if rows else None

    while spent[0] < max_compiles:
        best = best_fitting()
        bound = float("inf") if best is None else best[0][0]
        # The cheapest plan not yet compiled, predicted to fit and cheaper than the best compiled answer.
        plan = None
        for c, n, p in plans():
            if c >= bound * (1 - 1e-9):  # not cheaper than the best compiled answer (beyond rounding)
                break
            if n <= budget.target and _plan_policy(p, L) not in known:
                plan = p
                break
        if plan is None:
            break  # nothing cheaper than the best compiled answer is predicted to fit: that one is the answer
        unknown = [o for o in plan[::2] if str(o.policy) not in known]
        if len(plan) > 1 and unknown:  # a mix of an uncompiled option: compile the option (it teaches the line)
            measure(unknown[0].policy)
            continue
        measure(policies.parse(_plan_policy(plan, L)))

    best = best_fitting()
    chosen = None if best is None else policies.parse(best[2])
    origin = {spec: source(spec) or "per-tensor" for spec in known}
    rows = sorted(known.items(), key=lambda kv: SOURCES.index(origin[kv[0]]))
    return TensorResult(
        chosen=chosen,
        cost_s=None if chosen is None else price.estimate(chosen).cost_s,
        need_bytes=None if best is None else best[1],
        fits=best is not None,
        budget_bytes=budget.bytes,
        margin=budget.margin,
        groups=groups,
        options=tuple(front),
        compiled=tuple((s, n, budget.fits(n), origin[s]) for s, n in rows),
        seconds=time.perf_counter() - start,
        traces=traces,
        source="per-tensor" if best is None else origin[best[2]],
        maxtext=maxtext,
    )


@functools.cache
def _block(config: TransformerConfig, batch: int, seq: int, loss_chunks: int):
    body = block_body(config, batch, seq, loss_chunks)
    return body, tag_bytes(config, batch, seq, loss_chunks, body=body)


@functools.cache
def _layer_work(config: TransformerConfig, batch: int, seq: int, loss_chunks: int, policy) -> cost.Work:
    # One layer's forward and backward, traced from the layer's jaxpr (no model tracing). Memoized: every
    # budget at one shape prices the same subsets. The base (None) runs the layer as the stack runs `none`,
    # under keep_activations: a plain vjp counts two more softmax sums per layer than the stack executes.
    body, _ = _block(config, batch, seq, loss_chunks)
    jax_policy = policies.keep_activations if policy is None else policy.jax_policy
    return cost.work_of(_jax_internals.vjp_jaxpr(body, jax_policy))


def _layer_price(config, batch, seq, loss_chunks, hardware: cost.Hardware, policy: policies.Policy) -> float:
    base = _layer_work(config, batch, seq, loss_chunks, None)
    return cost.estimate(_layer_work(config, batch, seq, loss_chunks, policy), base, hardware).recompute_s


def _layer_recompute_s(price: Pricer, config: TransformerConfig, loss_chunks: int, policy: policies.Policy) -> float:
    """What one layer under ``policy`` adds to the stack's recompute time: the layer's own price (its jaxpr,
    forward and backward) plus the stack's constant per remat layer, measured once on ``full`` as
    (the step's full cost − L × the layer's full price) / L. The constant is 0 on JAX's classic remat; under
    remat3 the stack re-runs a fixed set of elementwise ops (RoPE's) per remat layer whatever the policy,
    which one layer's jaxpr does not show (tests/test_tensors.py checks the identity for several policies)."""
    if not policy.remat:
        return 0.0
    args = (config, price.batch, price.seq, loss_chunks, price.hardware)
    L = config.num_layers
    stack_full = price.estimate(policies.full()).recompute_s
    per_layer = (stack_full - L * _layer_price(*args, policies.full())) / L
    return _layer_price(*args, policy) + per_layer


def _plan_policy(parts: tuple, num_layers: int) -> str:
    """The spec of a plan: one option's policy, or the mix ``a*k+b*(L-k)``."""
    if len(parts) == 1:
        return str(parts[0].policy)
    a, k, b = parts
    return str(policies.mix([(a.policy, k), (b.policy, num_layers - k)]))


def config_choice(
    config: TransformerConfig,
    budget: Budget,
    *,
    batch: int,
    seq: int,
    planner: StepPlanner | None = None,
    loss_chunks: int = 0,
    presets: Sequence[policies.Policy] | None = None,
    hardware: cost.Hardware | None = None,
    max_compiles: int = MAX_COMPILES,
    tiles: Sequence[int] | None = None,
    retile: Callable[[int], StepPlanner] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Choice:
    """The engine of :func:`remat_kit.fit` for the built-in Transformer at one shape
    (:func:`remat_kit.planning.engine.plan`: the block's tags kept, recomputed or offloaded per tensor, mixed over
    its layers), or with ``presets`` given, the pool search over them alone. What ``plan --budget``, ``train
    --budget``, :func:`remat_kit.fit` and :func:`remat_kit.auto` of the built-in model run.

    Sequence tiles are a lever like the others: when no plan fits untiled and ``config.seq_tiles`` is 1 (a tile
    count or ``"auto"`` given is kept as given), the search runs again with the blocks in each of ``tiles``
    sequence tiles (default :func:`remat_kit.planning.tiles.tile_counts`; ``()`` tries none), most tiles first,
    until a count where nothing fits (fewer tiles hold more). Every tiled candidate is priced over the untiled
    ``none``: its own cost plus the tiles' (:attr:`remat_kit.planning.budget.Candidate.tiles_s`: the extra loop
    trips and slicing of the tiled step), so the answer is the fitting (tile count, plan) with the least estimated
    step time, and :attr:`Choice.seq_tiles` says how many tiles it runs in. A step that fits untiled is never
    tiled: tiles only add time there (each count tried would also cost a search's compiles). Each tile count's
    search may spend ``max_compiles`` compiles.

    Args:
      tiles: the tile counts to try when nothing fits untiled (each must divide ``seq``).
      retile: ``retile(k) -> StepPlanner`` of the same step with the blocks in ``k`` tiles (default: a
        :class:`~remat_kit.planning.builtin.Planner` of ``config`` with ``seq_tiles=k``, see
        :func:`remat_kit.planning.builtin.retiled`).
      progress: called with one line per phase of the engine (:func:`remat_kit.planning.engine.plan`).
    """
    counts = tiles_lib.check_counts(tiles, batch, seq)  # before anything is compiled
    planner = planner or Planner(config, loss_chunks=loss_chunks)

    def run(cfg: TransformerConfig, pl: StepPlanner) -> Choice:
        kw = {"loss_chunks": loss_chunks, "presets": presets, "hardware": hardware, "max_compiles": max_compiles}
        kw["progress"] = progress
        return _config_choice_at(cfg, budget, batch=batch, seq=seq, planner=pl, **kw)

    choice = run(config, planner)
    if choice.chosen is not None or config.seq_tiles != 1 or not counts:
        return choice
    start = time.perf_counter()
    hardware = hardware or planner.hardware
    untiled = planner.work(policies.none(), batch, seq)

    def at(k: int) -> Choice:
        config_k = dataclasses.replace(config, seq_tiles=k)
        tiled_planner = retile(k) if retile is not None else retiled(planner, config_k)
        lean = _leanest_fit(tiled_planner, budget, config_k, presets, batch, seq, hardware, max_compiles)
        # Nothing lean fits in k tiles: the search there would price every candidate to find nothing (as untiled).
        at_k = run(config_k, tiled_planner) if lean is None else lean
        over = tiles_lib.tiles_cost_s(planner, tiled_planner, batch, seq, hardware)
        rows = tiles_lib.priced_tiled(at_k.candidates, k, over)
        won = next((c for c in rows if c.is_plan(at_k.chosen, k)), None)
        est = None if won is None else untiled.seconds(hardware) + won.cost_s
        return dataclasses.replace(at_k, candidates=rows, seq_tiles=k, est_step_time_s=est)

    swept, best = tiles_lib.sweep(counts, at, key=lambda c: (c.est_step_time_s, c.need_bytes))
    tried = [choice, *swept]
    table = tuple(c for t in tried for c in t.candidates)
    compiles = sum(t.compiles for t in tried)
    seconds = choice.seconds + time.perf_counter() - start
    shown = ", ".join(str(t.seq_tiles) for t in tried[1:])
    if best is None:
        reason = f"{choice.reason}; nor in {shown} sequence tiles (--seq-tiles)"
        return dataclasses.replace(choice, candidates=table, compiles=compiles, seconds=seconds, reason=reason)
    won = next(c for c in best.candidates if best.is_chosen(c))
    reason = (
        f"nothing fits untiled; in {best.seq_tiles} sequence tiles (the cheapest that fits of {shown} tried), "
        f"{won.policy} needs {fmt_bytes(won.need_bytes)} (+{budget.margin:.0%} margin: "
        f"{fmt_bytes(budget.with_margin(won.need_bytes))}) of {fmt_bytes(budget.bytes)} at an estimated "
        f"{fmt_seconds(won.cost_s)} per step over the untiled none, {fmt_seconds(won.tiles_s)} of it the tiles' own "
        "(extra loop trips and slicing)."
    )
    return dataclasses.replace(best, candidates=table, compiles=compiles, seconds=seconds, reason=reason)


def _leanest_fit(
    planner: StepPlanner,
    budget: Budget,
    config: TransformerConfig,
    presets: Sequence[policies.Policy] | None,
    batch: int,
    seq: int,
    hardware: cost.Hardware | None,
    max_compiles: int,
) -> Choice | None:
    """None when ``full`` or a preset leaner than it fits (the whole search is then worth running); else the
    no-fit :class:`Choice` of those lean candidates, compiled (at most ``max_compiles``)."""
    before, start = planner.compiles, time.perf_counter()
    hardware = hardware or planner.hardware
    price = Pricer(planner, hardware, batch, seq)
    pool = [p for p in (presets or candidates_for(config)) if not isinstance(p, policies.Mix)]
    lean = [policies.full(), *(p for p in pool if p.kind in ("segments", "sqrt_n", "offload") and price.choosable(p))]
    rows = []
    for p in list(dict.fromkeys(lean))[:max_compiles]:
        rows.append(price.candidate(p, budget))
        if rows[-1].fits:
            return None
    return Choice(None, None, None, tuple(rows), budget, planner.compiles - before, time.perf_counter() - start, "")


def _config_choice_at(
    config: TransformerConfig,
    budget: Budget,
    *,
    batch: int,
    seq: int,
    planner: StepPlanner,
    loss_chunks: int,
    presets: Sequence[policies.Policy] | None,
    hardware: cost.Hardware | None,
    max_compiles: int,
    progress: Callable[[str], None] | None = None,
) -> Choice:
    """:func:`config_choice` at one tile count: the engine (:func:`remat_kit.planning.engine.plan`), or with
    ``presets`` given, the pool search over them alone (:func:`remat_kit.planning.budget.search`, the one search of a
    pool given by hand: ``remat_kit.auto``'s and ``plan --budget --policies``')."""
    levers = (
        "train LoRA adapters over a quantized base (--lora-rank R --quantize nf4), chunk the loss "
        "(--loss-chunks 8), shard over a mesh (--mesh fsdp=N) or take a smaller batch"
    )
    if presets is None:
        return engine.plan(
            planner,
            budget,
            hardware=hardware,
            max_compiles=max_compiles,
            levers=levers,
            batch=batch,
            seq=seq,
            progress=progress,
            depth=config.num_layers,  # its stack's custom VJP holds the block twice in the jaxpr
        )
    hardware = hardware or planner.hardware
    kw = {"batch": batch, "seq": seq, "loss_chunks": loss_chunks, "num_layers": config.num_layers}
    return choice_of(search(planner, presets, budget, hardware=hardware, **kw), planner, budget)


def choice_of(result: AutoResult, planner: StepPlanner, budget: Budget) -> Choice:
    """The pool search's answer (``result``, :func:`remat_kit.planning.budget.search`) as the engine's
    :class:`~remat_kit.planning.engine.Choice`: the same fields, the whole step's estimate from ``none``'s."""
    won = next((c for c in result.candidates if result.is_chosen(c)), None)
    base_s = planner.work(policies.none(), result.batch, result.seq).seconds(result.hardware)
    return Choice(
        chosen=result.chosen,
        need_bytes=None if won is None else won.need_bytes,
        est_step_time_s=None if won is None else base_s + won.cost_s,
        candidates=result.candidates,
        budget=budget,
        compiles=result.compiled,
        seconds=result.seconds,
        reason=result.reason,
        seq_tiles=result.seq_tiles,
    )


def fit_transformer(
    model: Transformer,
    loss_fn: Callable,
    inputs: tuple,
    *,
    budget: Budget,
    optimizer: str | optax.GradientTransformation = "adamw",
    hardware: cost.Hardware | None = None,
    max_compiles: int = MAX_COMPILES,
    target=None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Choice, Callable]:
    """:func:`remat_kit.planning.fit.fit` of the built-in model: its own policy field, its own stack and tags.

    Returns:
      ``(choice, applied)``: :func:`config_choice`'s answer and ``applied(policy)``, the model under a policy.
    """
    variables, batch_args = inputs[0], inputs[1:]
    tokens = next((a for a in batch_args if getattr(a, "ndim", len(getattr(a, "shape", ()))) == 2), None)
    if tokens is None:
        raise ValueError("fit of the built-in Transformer needs a [batch, seq] token array among the batch")
    batch, seq = tokens.shape

    def planner_at(tiles: int) -> StepPlanner:
        config = model.config if tiles == 1 else dataclasses.replace(model.config, seq_tiles=tiles)

        def build(policy, _b, _s):
            m = dataclasses.replace(model, config=config, policy=policy)
            return (lambda v, *a: loss_fn(m, v, *a)), variables, batch_args

        return StepPlanner(build, optimizer, target=target)

    choice = config_choice(
        model.config,
        budget,
        batch=batch,
        seq=seq,
        planner=planner_at(1),
        hardware=hardware,
        max_compiles=max_compiles,
        retile=planner_at,
        progress=progress,
    )
    tiled = lambda c: c if choice.seq_tiles == 1 else dataclasses.replace(c, seq_tiles=choice.seq_tiles)
    applied = lambda p: dataclasses.replace(model, config=tiled(model.config), policy=p)
    return choice, applied
