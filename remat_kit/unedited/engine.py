"""The engine :func:`remat_kit.apply` shares between Linen and NNX: the plan, static arguments, naming, checking.

>>> str(make_plan("every_n:2", None, None, False, object).policy_for(2))
'full'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect as _inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from flax import nnx

from remat_kit import _jax_internals
from remat_kit import names as _names
from remat_kit.nnx.paths import call_naming_submodules as call_naming_submodules  # apply's NNX naming
from remat_kit.policies import Mix, Policy, full, parse, tags
from remat_kit.policies.tags import name_tree as name_tree  # apply names a tree as the stacks do
from remat_kit.unedited.arrays import split_arrays as split_arrays  # the halves split calls as apply does
from remat_kit.unedited.long import Long, Part, make_long
from remat_kit.unedited.paths import BlockName, NameTable, Where, parse_where


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`apply` was asked for, parsed once.

    Attributes:
      policy: the policy (a grouping ``every_n`` rematerializes blocks 0, n, 2n, ... in call order).
      where: which modules are blocks; None: the repeated block class, found on the first call.
      static_argnames: block call arguments always treated as static (non-array ones always are).
      scan: run consecutive identical blocks as one ``lax.scan`` (see :mod:`remat_kit.unedited.scan`).
      long: query blocks for attention and sequence tiles for per-token submodules inside each block
        (:mod:`remat_kit.unedited.long`); None: neither.
    """

    policy: Policy | PerKind
    where: Where | None
    static_argnames: frozenset[str]
    scan: bool = False
    long: Long | None = None

    def policy_for(self, index: int, module: Any = None, path: str = "") -> Policy | None:
        """The policy block number ``index`` (call order; ``module`` at ``path``) runs under; None: run it plainly."""
        policy = self.policy.for_block(module, path) if isinstance(self.policy, PerKind) else self.policy
        if policy.kind == "every_n":
            return full() if index % policy.period == 0 else None
        return policy if policy.remat else None


@dataclasses.dataclass(frozen=True)
class PerKind:
    """A policy per kind of block (``apply(model, {DenseLayer: "full", MoeLayer: "selective:router"})``).

    Attributes:
      parts: ``(where, policy)`` pairs; a block runs under the first whose ``where`` matches it.

    >>> import flax.linen as nn
    >>> per = make_plan({nn.Dense: "full", "attn*": "selective:q"}, None, None, False, nn.Module).policy
    >>> str(per), per.for_block(nn.Dense(2), "mlp").kind
    ("{Dense: full, 'attn*': selective:q}", 'full')
    """

    parts: tuple[tuple[Where, Policy], ...]

    def for_block(self, module: Any, path: str) -> Policy:
        return next((p for w, p in self.parts if w(module, path)), self.parts[0][1])

    @property
    def policies(self) -> tuple[Policy, ...]:
        return tuple(p for _, p in self.parts)

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for p in self.policies for t in p.tags))

    @property
    def remat(self) -> bool:
        return any(p.remat for p in self.policies)

    def __str__(self) -> str:
        return "{" + ", ".join(f"{w}: {p}" for w, p in self.parts) + "}"


def make_plan(
    policy: Any,
    where: Any,
    static_argnames: Any,
    scan: bool,
    base: type,
    query_blocks: Any = None,
    seq_tiles: Any = None,
) -> Plan:
    """Parse :func:`apply`'s arguments into a :class:`Plan` (every error before any tracing)."""
    long = make_long(query_blocks, seq_tiles)
    if isinstance(policy, Mapping):
        return dataclasses.replace(_per_kind_plan(policy, where, static_argnames, scan, base), long=long)
    parsed = parse(policy)
    if (isinstance(parsed, Mix) or parsed.kind in ("segments", "sqrt_n")) and not scan:
        raise ValueError(
            f"policy {parsed} groups layers and needs one scan over the blocks: pass scan=True, "
            "or use full, every_n:N, selective, offload or dots"
        )
    if static_argnames is None:
        names: tuple = ()
    elif isinstance(static_argnames, str):
        names = (static_argnames,)
    else:
        names = tuple(static_argnames) if isinstance(static_argnames, Iterable) else (static_argnames,)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(
            "static_argnames must be a block argument's name or an iterable of names (strings), "
            f"got {static_argnames!r}"
        )
    if not isinstance(scan, bool):
        raise TypeError(f"scan must be True or False, got {scan!r}")
    return Plan(parsed, parse_where(where, base), frozenset(names), scan, long)


def _per_kind_plan(policy: Mapping, where: Any, static_argnames: Any, scan: bool, base: type) -> Plan:
    """:func:`make_plan` for a mapping ``{where: policy}``: each kind of block under its own per-block policy."""
    if where is not None:
        raise TypeError("give where= or a mapping {where: policy} as the policy, not both")
    if not policy:
        raise ValueError("policy={}: give at least one pair {where: policy} (a block class or path glob: a spec)")
    if scan:
        raise ValueError(
            "scan=True runs one policy over the scanned blocks; a policy per kind of block needs scan=False"
        )
    parts = []
    for key, spec in policy.items():
        parsed = parse(spec)
        if isinstance(parsed, Mix) or parsed.kind in ("segments", "sqrt_n", "every_n"):
            raise ValueError(
                f"policy for {key!r} is {parsed}, which groups layers; a policy per kind of block takes per-block "
                "policies (full, selective, offload, dots, none, jax:...)"
            )
        parts.append((parse_where(key, base), parsed))
    plan = make_plan("full", None, static_argnames, False, base)
    return Plan(PerKind(tuple(parts)), Where(any_of=tuple(w for w, _ in parts)), plan.static_argnames, False)


def check_static_argnames(static_argnames: frozenset[str], blocks: Iterable[type]) -> None:
    """Raise ValueError if a name in ``static_argnames`` is no argument of a block class's ``__call__``.

    A ``__call__`` taking ``**kwargs`` (or whose signature cannot be read) accepts any name.

    >>> class Block:
    ...     def __call__(self, x, is_local=False): ...
    >>> check_static_argnames(frozenset({"is_locl"}), [Block])
    Traceback (most recent call last):
    ...
    ValueError: static_argnames names is_locl, not an argument of Block.__call__; its arguments: x, is_local
    """
    for cls in dict.fromkeys(blocks):
        try:
            params = list(_inspect.signature(cls.__call__).parameters.values())[1:]  # without self
        except (TypeError, ValueError):
            continue
        if any(p.kind is p.VAR_KEYWORD for p in params):
            continue
        args = [p.name for p in params if p.kind is not p.VAR_POSITIONAL]
        unknown = sorted(static_argnames - set(args))
        if unknown:
            raise ValueError(
                f"static_argnames names {', '.join(unknown)}, not an argument of {cls.__name__}.__call__; "
                f"its arguments: {', '.join(args) or '(none)'}"
            )


def applied_twice(model: str, policy: Any, plain: str) -> TypeError:
    """The error for :func:`remat_kit.apply` given a model it made (Linen and NNX alike).

    Args:
      model: the model's class name.
      policy: the policy its blocks already run.
      plain: where the plain model is.
    """
    return TypeError(
        f"remat_kit.apply takes the plain model: this {model} was made by remat_kit.apply and its blocks already "
        f"run {policy}, which another apply would nest; apply to the plain model ({plain}) instead"
    )


def split_static(fn: Callable, args: tuple, kwargs: dict, static_argnames: frozenset[str], is_static: Callable):
    """Split a call's arguments into static ones (closed over) and dynamic ones (traced).

    Returns:
      ``(rebuild, dyn_args, dyn_kwargs)``: ``rebuild(dyn_args, dyn_kwargs) -> (args, kwargs)``.
    """
    try:
        names = [p for p in _inspect.signature(fn).parameters][1:]  # without self
    except (TypeError, ValueError):
        names = []
    static_pos = {i: a for i, a in enumerate(args) if is_static(a) or (i < len(names) and names[i] in static_argnames)}
    static_kw = {k: v for k, v in kwargs.items() if is_static(v) or k in static_argnames}
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_kw}

    def rebuild(dargs, dkwargs):
        it = iter(dargs)
        full_args = tuple(static_pos[i] if i in static_pos else next(it) for i in range(len(args)))
        return full_args, {**static_kw, **dkwargs}

    return rebuild, dyn_args, dyn_kwargs


def trace_only(fn: Callable, args: tuple, kwargs: dict, *, keep: bool = False) -> Any:
    """``fn(*args, **kwargs)`` under ``jax.eval_shape``: array leaves (or ShapeDtypeStructs) traced, others as given.

    Returns the output's shapes when ``keep``, else None (so non-array outputs are allowed).
    """
    arrays, rebuild = split_arrays(args, kwargs)

    def run(*traced):
        a, k = rebuild(traced)
        out = fn(*a, **k)
        return out if keep else None

    return jax.eval_shape(run, *arrays)


def trace_jaxpr(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """The closed jaxpr of ``fn(*args, **kwargs)``, traced as :func:`trace_only` traces it (outputs dropped)."""
    arrays, rebuild = split_arrays(args, kwargs)

    def run(*traced):
        a, k = rebuild(traced)
        fn(*a, **k)

    return jax.make_jaxpr(run)(*arrays)


def tag_input(fn: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block call's arguments with its input (the first argument: the residual stream) tagged ``layer_input``.

    ``apply`` owns what enters each block as the stacks do (:func:`remat_kit.policies.layers.tag_input`), so
    ``offload`` (default: the layer inputs) and ``selective:layer_input`` work on a model that tags nothing.
    Only array leaves are tagged; the other arguments (masks, positions, flags) are left as they are.

    >>> import jax, jax.numpy as jnp
    >>> from remat_kit.policies import tags
    >>> f = lambda x, mask: tag_input(lambda x, mask: None, (x, mask), {})[0][0] * mask
    >>> sorted(tags.emitted_tags(f, jnp.ones(2), jnp.ones(2)))
    ['layer_input']
    """
    if args:
        first = args[0]
        return (first if nnx.graph.is_graph_node(first) else name_tree(first, _names.LAYER_INPUT), *args[1:]), kwargs
    try:
        params = [p for p in _inspect.signature(fn).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        return args, kwargs
    name = params[0].name if params else None
    if name in kwargs and not nnx.graph.is_graph_node(kwargs[name]):
        kwargs = {**kwargs, name: name_tree(kwargs[name], _names.LAYER_INPUT)}
    return args, kwargs


@dataclasses.dataclass
class Collector:
    """Gathers, block by block, the names blocks emit (for :func:`names_of`)."""

    blocks: dict[str, list[BlockName]] = dataclasses.field(default_factory=dict)
    why: str = ""  # how the blocks were found (remat_kit.unedited.blocks.Choice.why)
    parts: dict[str, tuple[Part, ...]] = dataclasses.field(default_factory=dict)  # each block's direct submodules

    def add_parts(self, where: str, parts: list[Part]) -> None:
        self.parts.setdefault(where, tuple(parts))

    def add(self, where: str, jaxpr: Any, module_names: set[str], param_names: set[str]) -> None:
        rows = []
        for name, shape, dtype, nbytes in _jax_internals.jaxpr_tags(jaxpr):
            source = "module" if name in module_names else "param" if name in param_names else "tag"
            source = "input" if name == _names.LAYER_INPUT and source == "tag" else source
            rows.append(BlockName(name, shape, dtype, nbytes, source))
        self.blocks.setdefault(where, rows)

    def table(self) -> NameTable:
        if not self.blocks:
            raise ValueError("no block ran: check where= and the example arguments")
        first = next(iter(self.blocks))
        seen: dict[str, BlockName] = {}
        emitted_by: dict[str, list[str]] = {}
        for where, rows in self.blocks.items():
            for r in rows:
                seen.setdefault(r.name, r)
                emitted_by.setdefault(r.name, []).append(where.rsplit(" block ", 1)[-1])
        rows = tuple(
            r
            if len(emitted_by[r.name]) == len(self.blocks)
            else dataclasses.replace(r, blocks=tuple(emitted_by[r.name]))
            for r in seen.values()
        )
        return NameTable(first, rows, self.why, self.parts.get(first, next(iter(self.parts.values()), ())))


@dataclasses.dataclass
class Ledger:
    """What the blocks of one call of an applied model emitted and saw through (:func:`ledger`).

    A name is a tensor where it exists: each block keeps the names it emits, and only a name that *no* block
    emits is an error, raised once the call has run every block (blocks of several kinds share one policy).
    """

    policy: Any
    emitted: set[str] = dataclasses.field(default_factory=set)
    blocks: list[str] = dataclasses.field(default_factory=list)
    seen_through: int = 0  # the model's own rematerialized calls inside the blocks, evaluated inline

    def check(self) -> None:
        """Raise ValueError if the policy names something no block emitted (with the nearest names)."""
        if not self.blocks or not getattr(self.policy, "tags", ()):
            return
        kinds = sorted(set(self.blocks))
        where = kinds[0] if len(kinds) == 1 else f"any block ({', '.join(kinds[:4])}{', …' if len(kinds) > 4 else ''})"
        for part in getattr(self.policy, "policies", (self.policy,)):
            tags.check(part, self.emitted, where)


_LEDGER: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar("remat_kit_apply_ledger", default=None)


@contextlib.contextmanager
def ledger(policy: Any):
    """Context: one call of an applied model; on a clean exit, :meth:`Ledger.check` the names across its blocks."""
    book = Ledger(policy)
    token = _LEDGER.set(book)
    try:
        yield book
    finally:
        _LEDGER.reset(token)
    book.check()


def checkpointed(policy: Policy, where: str, named: Callable, jaxpr: Any, args: tuple) -> Any:
    """Run ``named(*args)`` under ``policy`` after checking (and expanding) the names it refers to.

    ``jaxpr`` is ``named``'s (from :func:`remat_kit._jax_internals.name_param_matmuls`): the names it
    emits are read there, without tracing the block again. Inside a call's :func:`ledger` a name this block
    does not emit is dropped here and checked across every block at the end; outside one, it is an error here.
    """
    book = _LEDGER.get()
    if book is not None:
        book.seen_through += getattr(named, "seen_through", 0)
    if policy.tags:
        emitted = frozenset(t for t, *_ in _jax_internals.jaxpr_tags(jaxpr))
        if book is not None:
            book.emitted |= emitted
            book.blocks.append(where.split(" block ")[0] if " block " in where else where)
            policy = tags.present(policy, emitted)
        policy = tags.resolve(policy, emitted, where)
        tags.check(policy, emitted, where)
    return _jax_internals.own_checkpoint(named, policy.jax_policy, prevent_cse=True)(*args)


def nnx_plain_call(cls: type) -> Callable:
    """An NNX block class's ``__call__``, an ``nnx.jit`` on it seen through.

    ``nnx.jit`` re-creates the block inside its own trace, so the submodules :func:`call_naming_submodules`
    names would not be the ones that run; under the policy's ``jax.checkpoint`` (itself inside the caller's
    trace) the inner jit compiles nothing of its own, so dropping it changes no value.

    Raises:
      ValueError: another NNX transform on it (``nnx.remat``, ``nnx.vmap`` ...), naming it.
    """
    fn = cls.__call__
    transform = _jax_internals.nnx_transform(fn)
    if transform is None:
        return fn
    if transform == "jit":
        return fn.fun
    raise ValueError(
        f"remat_kit.apply cannot rematerialize {cls.__name__} blocks: their __call__ is decorated with "
        f"nnx.{transform}, whose trace apply cannot reach into (it would keep or override the block's own); "
        "use the block without it"
    )
