"""Rematerialize the blocks of an existing Flax model, Linen or NNX, in one call, without editing its code.

``remat_kit.apply(model, policy)`` finds the model's repeated block (or the blocks ``where=`` names)
and runs each under the policy's ``jax.checkpoint``. Inside a rematerialized block every value a
policy may keep is named without touching the model:

* every submodule call's output, by its path relative to the block (``attn/q_einsum``,
  ``pre_attention_norm``);
* every matmul that consumes one of the block's own parameters, by that parameter's path
  (``mlp/gating_einsum``: gm.nn's FeedForward does ``jnp.einsum`` with its params directly);
* the model's own ``checkpoint_name`` tags (MaxText's ``query_proj``, ``mlpwi``) as they are;
* the block's input (its first argument) as ``layer_input``: ``apply`` owns what enters each block as
  the stacks do, so the default ``offload`` (the layer inputs, HF's ``offload=True``) works unedited.

So ``selective:attn/q_einsum,mlp/*`` and ``offload:attn/*`` work on an untagged model; a pattern or
name that matches nothing is a ValueError with the nearest names (:mod:`remat_kit.policies.tags`).
:func:`names_of` lists what a block emits.

Linen: the returned object has the model's ``init``/``apply``/``init_with_output``; they run the
model's own methods under ``flax.linen.intercept_methods``, so the variables, their tree and the RNG
streams are the plain model's (init itself runs plainly: remat changes no variable). NNX: the result
is a copy of the model graph whose blocks run under ``jax.checkpoint`` with their state passed as
arguments (never captured), so ``nnx.split`` gives the plain model's state and ``nnx.grad``,
``nnx.jit`` and ``nnx.Optimizer`` see every parameter (:mod:`remat_kit.unedited.nnx`).

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> import remat_kit
>>> class Block(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return x + nn.Dense(4, name="up")(jnp.tanh(x))
>>> class Model(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         for i in range(2):
...             x = Block(name=f"layer_{i}")(x)
...         return x
>>> model = remat_kit.apply(Model(), "selective:up")
>>> x = jnp.ones((2, 4))
>>> params = model.init(jax.random.key(0), x)
>>> jax.tree.structure(params) == jax.tree.structure(Model().init(jax.random.key(0), x))
True
>>> remat_kit.names_of(Model(), x).names
('layer_input', 'up/kernel', 'up')
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import lift

from remat_kit import _jax_internals
from remat_kit.policies import Policy, tags
from remat_kit.policies.static import is_static
from remat_kit.unedited import nnx as unedited_nnx
from remat_kit.unedited import scan as unedited_scan
from remat_kit.unedited.engine import (
    Collector,
    Plan,
    applied_twice,
    check_static_argnames,
    checkpointed,
    make_plan,
    name_tree,
    split_static,
    tag_input,
    trace_only,
)
from remat_kit.unedited.paths import NameTable, Where, join, repeated_block


def apply(model: Any, policy: Any, *, where: Any = None, static_argnames: Any = None, scan: bool = False) -> Any:
    """Rematerialize the blocks of an existing Flax model (Linen or NNX) under ``policy``, unedited.

    Args:
      model: a ``flax.linen.Module`` instance (unbound) or a ``flax.nnx.Module``.
      policy: a policy or spec (``"full"``, ``"every_n:2"``, ``"selective:attn/q_einsum,mlp/*"``,
        ``"offload:attn/*"``). Names may be module paths relative to the block, parameter paths, the
        model's own tags, or glob patterns over them.
      where: the blocks: a block class or tuple of classes, a module-path glob (``"layer_*"``,
        ``"blocks/*"``), or a predicate ``module -> bool``. Default: the block class repeated (at least
        twice) among the children of the shallowest module that repeats one.
      static_argnames: names of block ``__call__`` arguments to treat as static (Python values are
        detected anyway: any argument holding no array is static, never traced).
      scan: run consecutive blocks that repeat a period (identical ones, or Gemma 3's local/global
        ones whose class, attributes or static flags alternate) as one ``lax.scan`` over their stacked
        parameters, one step per period (the model's own parameter layout is kept; a grouping policy
        counts periods); a model that cannot be scanned unedited is a ValueError saying why.

    Returns:
      Linen: an :class:`Applied` with the model's ``init``/``apply``/``init_with_output``. NNX: a copy
      of the model graph (sharing its arrays) whose blocks run under the policy.

    Raises:
      TypeError: ``model`` is not a Flax module instance, or a bad ``where``.
      ValueError: a policy that needs a stack (``segments``, ``sqrt_n``, a mix) without ``scan=True``;
        no or several repeated block classes; (on the first call) a ``where`` that matches nothing or
        a name that the block never emits.

    >>> import flax.linen as nn
    >>> type(apply(nn.Sequential([nn.Dense(2)]), "full", where=nn.Dense)).__name__
    'Applied'
    """
    plan = make_plan(policy, where, static_argnames, scan, nnx.Module if isinstance(model, nnx.Module) else nn.Module)
    if isinstance(model, nnx.Module):
        return unedited_nnx.apply(model, plan)
    if isinstance(model, Applied):
        raise applied_twice(type(model.module).__name__, model.plan.policy, "its .module")
    if isinstance(model, nn.Module):
        if model.scope is not None:
            raise TypeError(f"remat_kit.apply takes an unbound Linen module, got a bound {type(model).__name__}")
        return Applied(model, plan)
    if isinstance(model, type):
        raise TypeError(
            f"remat_kit.apply takes a module instance, not the class {model.__name__}: write {model.__name__}(...)"
        )
    raise TypeError(f"remat_kit.apply takes a flax.linen or flax.nnx Module instance, got {model!r}")


# ---- Linen -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """The state of one ``init``/``apply`` of an :class:`Applied` model (one per call, not shared)."""

    plan: Plan
    matcher: Where | None
    discovered: list | None = None  # (path, class, module) of every module called, while finding the blocks
    calls: list = dataclasses.field(default_factory=list)  # scan=True: each of those calls' static arguments
    collect: Collector | None = None  # names_of: gather names instead of rematerializing
    index: int = 0  # blocks started so far, in call order
    block: tuple[str, ...] | None = None  # path of the block being run, while inside it
    entering: bool = False  # the next __call__ is the block's own
    module_names: set[str] = dataclasses.field(default_factory=set)
    lifted: dict = dataclasses.field(default_factory=dict)  # path -> Flax transforms its call ran inside
    ran: int = 0  # blocks this call handed to the policy (0 after an apply: nothing was rematerialized)
    scan: unedited_scan.LinenScan | None = None  # scan=True: the runs of blocks this call scans


_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("remat_kit_apply_run", default=None)


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
        self._traces: dict = {}  # (method, call signature) -> the discovery trace's (found, calls)
        self._lifted: dict = {}  # module path -> the Flax transforms its call runs inside (discovery)

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
        found, _ = self._discover(method, args, kwargs)
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
        matcher = self._matcher or Where(classes=(repeated_block([(p, c) for p, c, _ in found]),))
        blocks = [(path, module) for path, _, module in found if path and matcher(module, join(path))]
        for path, module in blocks:
            if self._lifted.get(path):
                transform, owner = self._lifted[path][0]
                transform = {"checkpoint": "remat"}.get(transform, transform)  # nn.remat is nn.checkpoint
                raise ValueError(
                    f"remat_kit.apply cannot rematerialize {type(module).__name__} block {join(path)}: it runs inside "
                    f"flax's nn.{transform} (on {owner}), whose trace apply cannot reach into (a cached or lifted "
                    f"trace would keep or override the block's own); use the model without nn.{transform} there"
                )
        if not blocks:
            listed = ", ".join(join(p) for p, *_ in found if p)
            raise ValueError(
                f"where={matcher} matches no module of {type(self.module).__name__}; its modules: {listed}"
            )
        check_static_argnames(self.plan.static_argnames, [type(b) for _, b in blocks])
        self._matcher, self._checked = matcher, True
        return matcher

    def _discover(self, method: str, args: tuple, kwargs: dict) -> tuple[list, list]:
        """Every module call of one trace of the call (nothing compiled): ``(found, calls)``, cached per signature.

        ``found`` holds ``(path, class, module)``; with ``scan=True``, ``calls`` each call's static arguments
        (:func:`remat_kit.unedited.scan.template`): a scan runs every block of a period at the first one's
        call, so it needs the later blocks' static arguments from here.
        """
        sig = tags.signature((args, kwargs))
        key = None if sig is None else (method, sig)
        if key is None or key not in self._traces:
            run = _Run(self.plan, None, discovered=[])
            with _running(run):
                trace_only(getattr(self.module, method), args, self._see_through(kwargs))
            self._lifted.update(run.lifted)
            if key is None:
                return run.discovered, run.calls
            self._traces[key] = (run.discovered, run.calls)
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
        run = _Run(self.plan, self.matcher(method, args, kwargs))
        if self.plan.scan:
            run.scan = unedited_scan.LinenScan(*self._discover(method, args, kwargs), run.matcher)
        with _running(run):
            out = getattr(self.module, method)(*args, **self._see_through(kwargs))
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
        if method == "__call__":
            run.discovered.append((tuple(module.path), type(module), module))
            if around := _jax_internals.linen_transforms_around():
                run.lifted[tuple(module.path)] = around
            if run.plan.scan:
                run.calls.append(unedited_scan.template(type(module).__call__, args, kwargs, run.plan.static_argnames))
        return next_fun(*args, **kwargs)
    if run.block is not None:
        if run.entering and method == "__call__":
            run.entering, run.block = False, tuple(module.path)
            return next_fun(*args, **kwargs)
        out = next_fun(*args, **kwargs)
        path = tuple(module.path)
        depth = len(run.block)
        if method == "__call__" and len(path) > depth and path[:depth] == run.block:
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
    policy = run.plan.policy_for(index)
    if policy is None and run.collect is None:
        return next_fun(*args, **kwargs)
    rebuild, dyn_args, dyn_kwargs = split_static(
        type(module).__call__, args, kwargs, run.plan.static_argnames, is_static
    )
    where = f"{type(module).__name__} block {join(path)}"

    def call(mdl, dargs, dkwargs):
        full_args, full_kwargs = tag_input(type(module).__call__, *rebuild(dargs, dkwargs))
        outer = run.block
        run.block, run.entering = path, True
        try:
            return mdl(*full_args, **full_kwargs)
        finally:
            run.block, run.entering = outer, False

    call.__name__ = "remat_kit_block"
    lifted = nn.transforms.lift_transform(_lifted, call, run=run, policy=policy, where=where)
    return lifted(module, dyn_args, dyn_kwargs)


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


# ---- names_of ----------------------------------------------------------------------------------------


def names_of(model: Any, *example_args: Any, where: Any = None, **example_kwargs: Any) -> NameTable:
    """The names the model's blocks emit (what a policy can keep), with shape, dtype and bytes.

    Traces only (``jax.eval_shape``): nothing is compiled or allocated.

    Args:
      model: a Linen module instance (unbound) or an NNX module.
      *example_args, **example_kwargs: the model's call arguments (arrays or ShapeDtypeStructs; for
        Linen without the variables: they are made with ``init``).
      where: the blocks (see :func:`apply`).

    Returns:
      A :class:`remat_kit.unedited.paths.NameTable`: ``.names``, ``.rows`` and a printable table.

    >>> import jax.numpy as jnp, flax.linen as nn
    >>> names_of(nn.Sequential([nn.Dense(3), nn.Dense(3)]), jnp.ones((1, 3)), where=nn.Dense).names
    ('layer_input', 'kernel')
    """
    if isinstance(model, nnx.Module):
        return unedited_nnx.names_of(model, example_args, example_kwargs, where)
    applied = apply(model, "full", where=where)
    key = jax.random.key(0)
    variables = trace_only(applied.module.init, (key, *example_args), example_kwargs, keep=True)
    collector = Collector()
    run = _Run(applied.plan, applied.matcher("apply", (variables, *example_args), example_kwargs), collect=collector)
    with _running(run):
        trace_only(
            applied.module.apply,
            (variables, *example_args),
            {"rngs": {"params": key}, "mutable": True, **example_kwargs},
        )
    return collector.table()


def apply_factory(model: Any, loss: Callable, **apply_kwargs: Any) -> Callable:
    """``make_loss(policy)`` for :func:`remat_kit.compare`/:func:`remat_kit.inspect`/:func:`remat_kit.auto`.

    Args:
      model: the plain model (Linen instance or NNX module).
      loss: Linen: ``loss(model, variables, *batch) -> scalar`` (call ``model.apply``); NNX:
        ``loss(model, *batch) -> scalar``.
      **apply_kwargs: passed to :func:`apply` (``where=``, ``static_argnames=``, ``scan=``).

    Returns:
      ``make_loss(policy) -> loss_fn(params, *batch)``: Linen's ``params`` are the variables, NNX's
      ``nnx.state(model, nnx.Param)`` (the same tree under every policy; the rest of the state, RNG
      streams included, is closed over).

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> model = nn.Sequential([nn.Dense(3), nn.Dense(3)])
    >>> make = apply_factory(model, lambda m, v, x: m.apply(v, x).sum(), where=nn.Dense)
    >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> float(make("full")(v, jnp.zeros((1, 3))))
    0.0
    """
    if isinstance(model, nnx.Module):

        def make_nnx(policy):
            graphdef, _, rest = nnx.split(apply(model, policy, **apply_kwargs), nnx.Param, ...)
            # Fresh Variables for the rest in every trace (Variables made outside it cannot be updated in it).
            return lambda params, *batch: loss(nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest)), *batch)

        return make_nnx

    def make_linen(policy):
        applied = apply(model, policy, **apply_kwargs)
        return lambda variables, *batch: loss(applied, variables, *batch)

    return make_linen
