"""The Linen side of :func:`remat_kit.apply`: an unedited Linen model's blocks run under the policy.

:class:`Applied` has the model's ``init``/``apply``/``init_with_output``; they run the model's own methods
under ``flax.linen.intercept_methods``, so the variables, their tree and the RNG streams are the plain
model's (init itself runs plainly: remat changes no variable). The interceptor finds the blocks (a
discovery trace of the call, once), and runs each block under the policy's ``jax.checkpoint`` through a
lifted transform, its submodule outputs named by their path in the block.

With ``scan=True`` (:class:`LinenScan`) blocks under one parent that repeat a period run as one scan,
through the conversion both halves share (:mod:`remat_kit.unedited.scan`); a block left out of every run
is rematerialized here on its own (:func:`_remat_block`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import lift

from remat_kit import _jax_internals
from remat_kit.policies import Policy, tags
from remat_kit.policies import layers as _layers
from remat_kit.policies.static import is_static
from remat_kit.unedited import blocks, guard, long
from remat_kit.unedited.engine import (
    Collector,
    Plan,
    check_static_argnames,
    checkpointed,
    ledger,
    name_tree,
    split_arrays,
    split_static,
    tag_input,
    trace_jaxpr,
    trace_only,
)
from remat_kit.unedited.paths import NameTable, Where, join, state_keys
from remat_kit.unedited.scan import (
    HOLE,
    Call,
    Pending,
    argument_ids,
    carry_index,
    check_shared_ids,
    position_policies,
    runs_in,
    same,
    shapes,
    take_carry,
    template,
)


@dataclasses.dataclass
class _Run:
    """The state of one ``init``/``apply`` of an :class:`Applied` model (one per call, not shared)."""

    plan: Plan
    matcher: Where | None
    discovered: list | None = None  # (path, class, module) of every module called, while finding the blocks
    calls: list = dataclasses.field(default_factory=list)  # scan=True: each of those calls' static arguments
    shares: list = dataclasses.field(default_factory=list)  # scan=True: which objects each call's arrays are
    collect: Collector | None = None  # names_of: gather names instead of rematerializing
    index: int = 0  # blocks started so far, in call order
    block: tuple[str, ...] | None = None  # path of the block being run, while inside it
    entering: bool = False  # the next __call__ is the block's own
    module_names: set[str] = dataclasses.field(default_factory=set)
    lifted: dict = dataclasses.field(default_factory=dict)  # path -> Flax transforms its call ran inside
    ran: int = 0  # blocks this call handed to the policy (0 after an apply: nothing was rematerialized)
    scan: LinenScan | None = None  # scan=True: the runs of blocks this call scans
    retrace: tuple[str, ...] | None = None  # a block's submodule traced on its own (long.run_part): its path


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What one discovery trace of a call saw (:meth:`Applied._discover`).

    Attributes:
      found: ``(path, class, module)`` of every module call, in call order.
      calls: with ``scan=True``, each call's static arguments (:func:`remat_kit.unedited.scan.template`): a scan runs
        every block of a period at the first one's call, so it needs the later blocks' static arguments from here.
      shares: with ``scan=True``, which objects each call's arrays are (:func:`remat_kit.unedited.scan.argument_ids`).
      flops: ``{index in found: matmul FLOPs}``; total_flops: the whole call's.
    """

    found: list
    calls: list
    shares: list
    flops: dict[int, int]
    total_flops: int


_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("remat_kit_apply_run", default=None)
#: The discovery trace runs module number i (in call order) inside a named scope of this prefix and i.
_MODULE_SCOPE = "remat_kit_module_"


def _choose(found: list, flops: dict[int, int], total: int) -> blocks.Choice:
    """The block classes of one discovery trace: the repeated modules that carry its matmul FLOPs."""
    weights: dict[tuple, int] = {}
    for i, (path, _, _) in enumerate(found):
        weights[path] = weights.get(path, 0) + flops.get(i, 0)  # a module called twice carries both calls
    paths = {p for p, _, _ in found}
    modules = [
        (p, c, any(q[: len(p)] == p and q != p for q in paths)) for p, c in dict((p, c) for p, c, _ in found).items()
    ]
    return blocks.choose(modules, weights, total, "matmul FLOPs")


class Applied:
    """A Linen model with its blocks rematerialized; build it with :func:`apply`.

    ``init``, ``init_with_output`` and ``apply`` take exactly the model's arguments and return what
    the model's own do; every other attribute is the model's.

    Attributes:
      module: the plain model (unchanged).
      plan: what was applied.
    """

    def __init__(self, module: nn.Module, plan: Plan):
        self.module = module
        self.plan = plan
        self._matcher = plan.where
        self._traces: dict = {}  # (method, call signature) -> its Discovery
        self._lifted: dict = {}  # module path -> the Flax transforms its call runs inside (discovery)
        self._choice: blocks.Choice | None = None  # the blocks found by compute (where= not given)
        self._verdicts: dict = {}  # call signature -> the guard's verdict (remat_kit.unedited.guard)
        self._seen_inside = 0  # the last call's own remats inside blocks, seen through (Ledger.seen_through)

    def init(self, *args, **kwargs):
        """The model's ``init`` (runs plainly: remat changes no variable)."""
        return self._run("init", args, kwargs)

    def init_with_output(self, *args, **kwargs):
        """The model's ``init_with_output``."""
        return self._run("init_with_output", args, kwargs)

    def apply(self, *args, **kwargs):
        """The model's ``apply``, with the blocks rematerialized."""
        return self._run("apply", args, kwargs)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["module"], name)

    def __repr__(self) -> str:
        return f"remat_kit.apply({type(self.module).__name__}, {self.plan.policy})"

    def matcher(self, method: str, args: tuple, kwargs: dict) -> Where:
        """The blocks: ``where=``, or the repeated block class found by tracing the call once (cached)."""
        if self._matcher is not None and getattr(self, "_checked", False):
            return self._matcher
        found = self._discover(method, args, kwargs).found
        if not any(path for path, *_ in found):
            lifted = [
                f"nn.{_jax_internals.linen_transform(fn)} on {type(self.module).__name__}.{name}"
                for name, fn in vars(type(self.module)).items()
                if _jax_internals.linen_transform(fn)
            ]
            raise ValueError(
                f"remat_kit.apply saw no submodule of {type(self.module).__name__} called (a Flax transform that "
                f"replays a cached trace hides them{': ' + ', '.join(lifted) if lifted else ''}); apply to the model "
                "without it, or call the model's own methods (not a jitted helper)"
            )
        if self._matcher is None:
            traced = self._discover(method, args, kwargs)
            self._choice = _choose(found, traced.flops, traced.total_flops)
            if self._choice.several:
                warnings.warn(f"remat_kit.apply: {self._choice.several}", stacklevel=4)
        matcher = self._matcher or Where(classes=self._choice.classes)
        blocks = [(path, module) for path, _, module in found if path and matcher(module, join(path))]
        for path, module in blocks:
            if self._lifted.get(path):
                transform, owner = self._lifted[path][0]
                transform = {"checkpoint": "remat"}.get(transform, transform)  # nn.remat is nn.checkpoint
                raise ValueError(
                    f"remat_kit.apply cannot rematerialize {type(module).__name__} block {join(path)}: it runs inside "
                    f"flax's nn.{transform} (on {owner}), whose trace apply cannot reach into (a cached or lifted "
                    f"trace would keep or override the block's own); use the model without nn.{transform} there"
                    + (f" ({guard.own_switch(type(self.module))})" if transform == "remat" else "")
                )
        if not blocks:
            listed = ", ".join(join(p) for p, *_ in found if p)
            raise ValueError(
                f"where={matcher} matches no module of {type(self.module).__name__}; its modules: {listed}"
            )
        check_static_argnames(self.plan.static_argnames, [type(b) for _, b in blocks])
        self._matcher, self._checked = matcher, True
        return matcher

    def _discover(self, method: str, args: tuple, kwargs: dict) -> Discovery:
        """One trace of the call (nothing compiled), its module calls and their FLOPs: cached per signature."""
        sig = tags.signature((args, kwargs))
        key = None if sig is None else (method, sig)
        if key is None or key not in self._traces:
            # Within guard.verified_once (a planner applying many policies), shared by every policy on this module.
            session = guard.session()
            shared = (self.module, key, self.plan.scan, self.plan.static_argnames)
            shared = None if session is None else tags.hashable(("discovery", *shared))
            if shared is not None and shared in session:
                traced, lifted = session[shared]
            else:
                run = _Run(self.plan, None, discovered=[])
                with _running(run):
                    jaxpr = trace_jaxpr(getattr(self.module, method), args, self._see_through(kwargs))
                lifted = run.lifted
                traced = Discovery(
                    run.discovered,
                    run.calls,
                    run.shares,
                    _jax_internals.scoped_flops(jaxpr, _MODULE_SCOPE),
                    _jax_internals.remat_nesting(jaxpr).total_flops,
                )
                if shared is not None:
                    session[shared] = traced, lifted
            self._lifted.update(lifted)
            if key is None:
                return traced
            self._traces[key] = traced
        return self._traces[key]

    def _see_through(self, kwargs: dict) -> dict:
        """``kwargs`` with the model's method, when ``nn.jit`` wraps it, run as a plain method.

        ``nn.jit`` replays its cached trace whatever interceptors are active (gm.nn wraps
        ``Transformer.__call__`` in it): the blocks would silently run plainly. Inside an outer ``jax.jit``
        the inner one compiles nothing of its own, so dropping it changes no value
        (:func:`remat_kit._jax_internals.linen_see_through_jit`).
        """
        method = kwargs.get("method")
        fn = (
            getattr(type(self.module), method or "__call__", None)
            if method is None or isinstance(method, str)
            else method
        )
        if _jax_internals.linen_transform(fn) == "jit":
            return {**kwargs, "method": _jax_internals.linen_see_through_jit(fn)}
        return kwargs

    def _run(self, method: str, args: tuple, kwargs: dict):
        matcher = self.matcher(method, args, kwargs)
        if method != "apply":
            return self._call(method, matcher, args, kwargs)
        arrays, rebuild = split_arrays(args, kwargs)
        verdict = self._verify(matcher, arrays, rebuild)
        if not verdict.see_through:
            return self._call(method, matcher, args, kwargs)
        # The model's own jax.checkpoint around the blocks: evaluated inline, remat_kit's policy replaces it.
        return _jax_internals.without_foreign_remat(lambda *a: self._call(method, matcher, *rebuild(a)))(*arrays)

    def _verify(self, matcher: Where, arrays: list, rebuild) -> guard.Verdict:
        """The guard's verdict on this call signature (:func:`remat_kit.unedited.guard.verify`), once per signature."""
        abstract = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in arrays]
        key = tags.signature(rebuild(abstract))
        if key is None or key not in self._verdicts:
            model = type(self.module).__name__

            def plain(*a):
                args, kwargs = rebuild(a)
                return self.module.apply(*args, **self._see_through(kwargs))

            verdict = guard.verify(
                plain,
                lambda *a: self._call("apply", matcher, *rebuild(a)),
                abstract,
                self.plan.policy,
                model,
                f"{matcher} blocks",
                guard.own_switch(type(self.module)),
                lambda: self._seen_inside,
                plain_key=None if key is None else (self.module, key),
            )
            if key is None or verdict.finding:
                return verdict
            self._verdicts[key] = verdict
        return self._verdicts[key]

    def _call(self, method: str, matcher: Where, args: tuple, kwargs: dict):
        run = _Run(self.plan, matcher)
        if self.plan.scan:
            traced = self._discover(method, args, kwargs)
            run.scan = LinenScan(traced.found, traced.calls, run.matcher, traced.shares)
        with _running(run), ledger(self.plan.policy) as book:
            out = getattr(self.module, method)(*args, **self._see_through(kwargs))
        self._seen_inside = book.seen_through
        if run.scan is not None:
            run.scan.finish()
        if method == "apply" and not run.ran:
            # The no-op guardrail: discovery found blocks, yet this call handed none to the policy.
            raise ValueError(
                f"remat_kit.apply ran no block of {type(self.module).__name__} under {self.plan.policy}: the call "
                f"reached none of the blocks found ({self._matcher}), so it would keep what the plain model keeps "
                "(a transform on the model that replays a cached trace?); apply to the model without it"
            )
        return out


class _running:
    """Context: ``run`` is the current call's state and the interceptor is installed."""

    def __init__(self, run: _Run):
        self.run = run

    def __enter__(self):
        self.token = _RUN.set(self.run)
        self.intercept = nn.intercept_methods(_intercept)
        self.intercept.__enter__()

    def __exit__(self, *exc):
        self.intercept.__exit__(*exc)
        _RUN.reset(self.token)


def _intercept(next_fun, args, kwargs, context):
    run = _RUN.get()
    if run is None:
        return next_fun(*args, **kwargs)
    module, method = context.module, context.method_name
    if run.discovered is not None:
        if method != "__call__":
            return next_fun(*args, **kwargs)
        index = len(run.discovered)
        run.discovered.append((tuple(module.path), type(module), module))
        if around := _jax_internals.linen_transforms_around():
            run.lifted[tuple(module.path)] = around
        if run.plan.scan:
            run.calls.append(template(type(module).__call__, args, kwargs, run.plan.static_argnames))
            run.shares.append(argument_ids(type(module).__call__, args, kwargs, run.plan.static_argnames))
        with jax.named_scope(f"{_MODULE_SCOPE}{index}"):  # its matmul FLOPs, to find the blocks by compute
            return next_fun(*args, **kwargs)
    if run.block is not None:
        if run.entering and method == "__call__":
            run.entering, run.block = False, tuple(module.path)
            return next_fun(*args, **kwargs)
        path = tuple(module.path)
        if run.retrace is not None:  # a submodule's own trace (long.run_part): paths are relative to it
            out = next_fun(*args, **kwargs)
            if method == "__call__" and path:
                name = join(run.retrace + path)
                run.module_names.add(name)
                out = name_tree(out, name)
            return out
        depth = len(run.block)
        inside = method == "__call__" and len(path) > depth and path[:depth] == run.block
        if inside and len(path) == depth + 1 and long.active() and not module.is_initializing():
            out = _long_part(run, module, path[depth:], next_fun, args, kwargs)
        else:
            out = next_fun(*args, **kwargs)
        if inside:
            name = join(path[depth:])
            run.module_names.add(name)
            out = name_tree(out, name)
        return out
    if method != "__call__" or (module.is_initializing() and run.collect is None):
        return next_fun(*args, **kwargs)
    path = tuple(module.path)
    if not run.matcher(module, join(path)):
        return next_fun(*args, **kwargs)
    run.ran += 1
    if run.scan is not None and run.scan.covers(path):
        return run.scan.block(run, module, path, args, kwargs)
    return _remat_block(run, module, path, next_fun, args, kwargs)


def _remat_block(run: _Run, module: nn.Module, path, next_fun, args: tuple, kwargs: dict):
    index, run.index = run.index, run.index + 1
    policy = run.plan.policy_for(index, module, join(path))
    where = f"{type(module).__name__} block {join(path)}"
    if policy is None and run.collect is None:
        if run.plan.long is None:
            return next_fun(*args, **kwargs)
        # Not rematerialized, yet its attention still runs in query blocks: the scores are as big here.
        outer = run.block
        run.block = path
        try:
            with long.block_scope(run.plan.long, args, kwargs, where):
                return next_fun(*args, **kwargs)
        finally:
            run.block = outer
    rebuild, dyn_args, dyn_kwargs = split_static(
        type(module).__call__, args, kwargs, run.plan.static_argnames, is_static
    )

    def call(mdl, dargs, dkwargs):
        full_args, full_kwargs = tag_input(type(module).__call__, *rebuild(dargs, dkwargs))
        outer = run.block
        run.block, run.entering = path, True
        try:
            with long.block_scope(run.plan.long, full_args, full_kwargs, where, run.collect):
                return mdl(*full_args, **full_kwargs)
        finally:
            run.block, run.entering = outer, False

    call.__name__ = "remat_kit_block"
    lifted = nn.transforms.lift_transform(_lifted, call, run=run, policy=policy, where=where)
    return lifted(module, dyn_args, dyn_kwargs)


def _long_part(run: _Run, module: nn.Module, rel: tuple, next_fun, args: tuple, kwargs: dict):
    """A direct submodule of the block traced on its own with its current variables as inputs
    (:func:`remat_kit.unedited.long.run_part`): in query blocks, in tiles, or as written."""
    variables = module.variables
    leaves, tree = jax.tree.flatten(variables)
    clone = module.clone(parent=None)
    mutable = module.scope.mutable

    def fn(state, a, k):
        outer, run.retrace = run.retrace, rel
        try:
            if mutable is False:
                return clone.apply(jax.tree.unflatten(tree, state), *a, **k), None
            out, written = clone.apply(jax.tree.unflatten(tree, state), *a, mutable=mutable, **k)
            return out, jax.tree.leaves(written)
        finally:
            run.retrace = outer

    return long.run_part(join(rel), fn, leaves, args, kwargs, lambda: next_fun(*args, **kwargs))


def _linen_leaf_names(args: tuple) -> list[str | None]:
    """The ``params`` leaves of a lifted call's ``variable_groups`` (args[0]) by path; None elsewhere."""
    out = []
    for keypath, _ in jax.tree_util.tree_flatten_with_path(args)[0]:
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in keypath]
        # argument 0 (variable_groups), then group and scope indices, the collection, the path in the block
        at = next((i for i, k in enumerate(keys) if not isinstance(k, int)), len(keys))
        out.append(join(keys[at + 1 :]) if keys and keys[0] == 0 and at < len(keys) and keys[at] == "params" else None)
    return out


def _lifted(fn, run: _Run, policy: Policy | None, where: str):
    """A Linen lifted transform: ``fn``'s block under ``policy``, its parameter matmuls named."""

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
        def body(variable_groups, rng_groups, *args):
            scope = scope_fn(variable_groups, rng_groups)
            y = fn(scope, *args)
            return y, repack_fn(scope)

        all_args = (variable_groups, rng_groups, *args)
        leaf_names = _linen_leaf_names(all_args)
        named, jaxpr = _jax_internals.name_param_matmuls(body, leaf_names, *all_args)
        if run.collect is not None:
            run.collect.add(where, jaxpr, run.module_names, {n for n in leaf_names if n})
            return named(*all_args)
        return checkpointed(policy, where, named, jaxpr, all_args)

    return lift.pack(inner, (True,), (True,), (True,), name="remat")


# ---- scan=True: runs of blocks as one scan (the shared conversion: remat_kit.unedited.scan) ----------


def _config(module: nn.Module) -> dict:
    """A Linen module's attributes (its dataclass fields but ``parent``/``name``)."""
    return {
        f.name: getattr(module, f.name, None) for f in dataclasses.fields(module) if f.name not in ("parent", "name")
    }


@dataclasses.dataclass(frozen=True)
class LinenRun:
    """Blocks under one parent that repeat a period of ``period`` block calls: run as one scan.

    Attributes:
      paths: every block of the run, in call order (``len(paths)`` a multiple of ``period``).
      period: the blocks in one period (1: identical blocks).
      modules: the discovery trace's module of each position of the period (its class and attributes).
      calls: each position's :class:`Call` (its static arguments).
    """

    paths: tuple[tuple, ...]
    period: int
    modules: tuple
    calls: tuple[Call, ...]


def linen_runs(found: list[tuple[tuple, type, Any]], calls: list[Call], matcher) -> dict[tuple, LinenRun]:
    """The runs of blocks that repeat a period (one block, or Gemma 3's local/global ones) in one trace.

    Blocks under one parent, called one after the other, form a run where their calls (class,
    attributes and static arguments) repeat a period at least twice; the period covering the most blocks
    wins (the shortest among equals). Blocks after it (a remainder that breaks the period) start the next
    run, or run one by one under the policy.

    Args:
      found: ``(path, class, module)`` of every module call, in call order (the discovery trace).
      calls: each of those calls' :class:`Call`.
      matcher: the blocks (a :class:`remat_kit.unedited.paths.Where`).

    Returns:
      ``{first block's path: its LinenRun}`` for every run.

    Raises:
      ValueError: no run at all, naming each block with its class and static arguments.
    """
    blocks = []
    for (path, cls, module), call in zip(found, calls, strict=True):
        if path and matcher(module, join(path)) and not any(path[: len(p)] == p and p != path for p, *_ in blocks):
            blocks.append((path, cls, module, call))
    seen = [p for p, *_ in blocks]
    blocks = [b for b in blocks if seen.count(b[0]) == 1]  # a block called twice is not scanned

    def alike(a, b) -> bool:
        return a[1] is b[1] and same(_config(a[2]), _config(b[2])) and a[3].same(b[3])

    siblings: list[list] = []
    for block in blocks:
        if siblings and siblings[-1][-1][0][:-1] == block[0][:-1]:
            siblings[-1].append(block)
        else:
            siblings.append([block])
    runs = {}
    for group in siblings:
        for part, period in runs_in(group, alike):
            runs[part[0][0]] = LinenRun(
                tuple(p for p, *_ in part),
                period,
                tuple(m for _, _, m, _ in part[:period]),
                tuple(c for *_, c in part[:period]),
            )
    if not runs:
        names = "; ".join(f"{join(p)} ({c.__name__}: {call.describe()})" for p, c, _, call in blocks)
        raise ValueError(
            "scan=True: no two consecutive blocks are identical, nor do they repeat a period of blocks (same "
            f"parent, class, attributes and static arguments): {names}; use scan=False"
        )
    return runs


class LinenScan:
    """The runs of blocks one ``init``/``apply`` of a Linen ``Applied`` scans (``scan=True``).

    The interceptor asks :meth:`covers` for every block and hands a covered one to :meth:`block`; the
    others it rematerializes one by one itself. :meth:`finish` checks, after the call, that every run ran
    whole.
    """

    def __init__(self, found: list[tuple[tuple, type, Any]], calls: list[Call], matcher, shares: list | None = None):
        self.runs = linen_runs(found, calls, matcher)
        self.first_of = {p: first for first, r in self.runs.items() for p in r.paths}
        self.pending: dict[tuple, Pending] = {}
        if shares:  # before any scan runs: a later block given its own array (a per-block cache) is refused here
            at = {}
            for i, (path, _, _) in enumerate(found):
                at.setdefault(path, i)
            for first, r in self.runs.items():
                for path in r.paths[1:]:
                    where = f"{type(found[at[path]][2]).__name__} block {join(path)}"
                    check_shared_ids(where, join(first), calls[at[path]], shares[at[first]], shares[at[path]])

    def covers(self, path: tuple) -> bool:
        """Whether the block at ``path`` belongs to a run."""
        return path in self.first_of

    def block(self, run, module: nn.Module, path: tuple, args: tuple, kwargs: dict) -> Any:
        """A covered block's output: the first of a run computes the run, the later ones take their part."""
        first = self.first_of[path]
        if path == first:
            out, self.pending[first] = _linen_scan(run, module, self.runs[first], args, kwargs)
            return out
        return _linen_follow(run, module, path, self.runs[first], self.pending.get(first), args, kwargs)

    def finish(self) -> None:
        """After the model's call: every run of blocks ran whole (a model that skips blocks is an error)."""
        for todo in self.pending.values():
            todo.check_whole("the model")


def _write_back(module: nn.Module, mutated: dict) -> None:
    for col, tree in mutated.items():
        for name, value in tree.items():
            module.scope.put_variable(col, name, value)


def _arrays(cls: type, args: tuple, kwargs: dict, static_argnames: frozenset[str]) -> tuple[tuple, dict]:
    """A block call's array arguments: ``(positional ones, keyword ones)``."""
    _, dyn_args, dyn_kwargs = split_static(cls.__call__, args, kwargs, static_argnames, is_static)
    return dyn_args, dyn_kwargs


def _linen_follow(run, module, path, spec: LinenRun, todo: Pending | None, args, kwargs):
    k = spec.paths.index(path)
    if todo is None:
        raise ValueError(f"scan=True: block {join(path)} ran out of order; use scan=False")
    statics = run.plan.static_argnames
    call = template(type(module).__call__, args, kwargs, statics)
    dyn_args, dyn_kwargs = _arrays(type(module), args, kwargs, statics)
    where = f"{type(module).__name__} block {join(path)}"
    out, mutated = todo.follow(k, args, call, (dyn_args[1:], dyn_kwargs), where)
    _write_back(module, mutated)
    return out


def _linen_scan(run, module: nn.Module, spec: LinenRun, args: tuple, kwargs: dict):
    """Run the blocks of ``spec`` (``module`` is the first) as one scan; (its output, what the others return)."""
    # Long: the checks that the blocks can share one scan read the same call templates the scan then runs.
    paths, period = spec.paths, spec.period
    where = f"{type(module).__name__} block {join(paths[0])}"
    statics = run.plan.static_argnames
    if not args or is_static(args[0]):
        raise ValueError(f"scan=True: {where} takes no array input as its first argument; use scan=False")
    call = template(type(module).__call__, args, kwargs, statics)
    if not call.same(spec.calls[0]):
        raise ValueError(
            f"scan=True: {where} is called with {call.describe()}, not {spec.calls[0].describe()} as when the model "
            "was traced; use scan=False"
        )
    dyn_args, dyn_kwargs = _arrays(type(module), args, kwargs, statics)
    rest = dyn_args[1:]
    holes = [(sum(a is HOLE for a in c.args), tuple(k for k, v in c.kwargs if v is HOLE)) for c in spec.calls]
    for j, h in enumerate(holes[1:], start=1):
        if h != holes[0]:
            raise ValueError(
                f"scan=True: blocks {join(paths[0])} and {join(paths[j])} take array arguments in different places, "
                "so one set of arrays cannot reach both; use scan=False"
            )
    x = dyn_args[0]
    names = [p[-1] for p in paths]
    variables = module.parent.variables
    per_layer = [{col: tree[name] for col, tree in variables.items() if name in tree} for name in names]
    for i, (name, layer) in enumerate(zip(names, per_layer, strict=True)):
        like = per_layer[i % period]
        if jax.tree.structure(layer) != jax.tree.structure(like) or shapes(layer) != shapes(like):
            cols = sorted(c for c in {*layer, *like} if shapes(layer.get(c)) != shapes(like.get(c)))
            raise ValueError(
                f"scan=True: blocks {names[i % period]} and {name} hold differently shaped variables in "
                f"{', '.join(cols)}, which cannot be stacked; use scan=False"
            )
    stacked = [jax.tree.map(lambda *a: jnp.stack(a), *per_layer[j::period]) for j in range(period)]
    rngs, prefixes = _jax_internals.linen_block_rngs(module.scope, names)
    mutable = module.scope.mutable
    blocks = [module.clone(parent=None)] + [m.clone(parent=None) for m in spec.modules[1:]]

    def leaf_names(tree) -> list:
        return [
            join(keys[1:]) if keys and keys[0] == "params" else None
            for keys in (state_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
        ]

    out_at: dict[int, int | None] = {}
    wheres = [f"{type(blocks[j]).__name__} block {join(paths[j])}" for j in range(period)]

    def layer_call(j, layer_vars, h, i):
        full_args, full_kwargs = spec.calls[j].fill((_layers.tag_input(h), *rest), dyn_kwargs)  # the layer input
        outer = run.block
        run.block, run.entering = (), True  # the layer's submodules are named by their path in it
        try:
            with (
                _jax_internals.linen_layer_rngs(prefixes, i),
                long.block_scope(run.plan.long, full_args, full_kwargs, wheres[j]),
            ):
                res = blocks[j].apply(dict(layer_vars), *full_args, rngs=rngs, mutable=mutable, **full_kwargs)
        finally:
            run.block, run.entering = outer, False
        y, mutated = res if mutable is not False else (res, {})
        # Parameters are read, never written, in apply: not returned (no stacked copy of them).
        mutated = {c: dict(t) for c, t in dict(mutated).items() if c != "params"}
        out_at[j] = carry_index(y, h, f"{type(blocks[j]).__name__} block {join(paths[j])}")
        return y, mutated

    param_names = [leaf_names(tree) for tree in stacked]  # the same paths as one layer's

    def names_for(j, h):
        return param_names[j] + [None] * (len(jax.tree.leaves(h)) + 1)

    def make_step(j):
        def step(layer_vars, h, i):
            call = functools.partial(layer_call, j)
            named, _ = _jax_internals.name_param_matmuls(call, names_for(j, h), layer_vars, h, i)
            y, mutated = named(layer_vars, h, i)
            return take_carry(y, out_at[j]), (y, mutated)

        return step

    def traced(j):
        first = jax.tree.map(lambda a: a[0], stacked[j])
        return _jax_internals.name_param_matmuls(
            functools.partial(layer_call, j), names_for(j, x), first, x, jnp.int32(j)
        )[1]

    policy, positions = position_policies(run.plan.policy, len(paths) // period, traced, wheres)
    steps = [make_step(j) for j in range(period)]
    _, ys = _layers.run_periods(policy, len(paths) // period, steps, stacked, x, positions)
    carry_at = tuple(out_at[j] for j in range(period))
    todo = Pending(
        spec.paths, spec.calls, tuple(y[0] for y in ys), carry_at, (rest, dyn_kwargs), tuple(y[1] for y in ys)
    )
    out, mutated = todo.first()
    _write_back(module, mutated)
    return out, todo


def names_of(applied: Applied, example_args: tuple, example_kwargs: dict) -> NameTable:
    """:func:`remat_kit.names_of` for a Linen model (``applied`` under ``full``): trace one call, gather the names."""
    key = jax.random.key(0)
    variables = trace_only(applied.module.init, (key, *example_args), example_kwargs, keep=True)
    matcher = applied.matcher("apply", (variables, *example_args), example_kwargs)
    collector = Collector(why=applied._choice.why if applied._choice else "")
    run = _Run(applied.plan, matcher, collect=collector)
    with _running(run):
        trace_only(
            applied.module.apply,
            (variables, *example_args),
            {"rngs": {"params": key}, "mutable": True, **example_kwargs},
        )
    return collector.table()
