"""The longest sequence a model trains at in a budget, every lever on: :func:`max_seq`.

A user's model, unedited, and its loss; ``args_at(seq)`` gives the loss's example arguments at a sequence length
(the tokens, positions, mask: shapes are enough). Each length tried is one compile of the whole training step
(the loss's gradient, clipping and the optimizer update; :class:`remat_kit.planning.planner.StepPlanner`),
compile-only: nothing is allocated. Lengths are multiples of ``step``: doubled from ``start`` until one does not
fit, then the bracket is closed by bisection guided by a parabola through the needs measured
(:func:`remat_kit.planning.limits.boundary`: the need is at most quadratic in the sequence). The answer is compiled
at its edge: it fits, the next multiple of ``step`` is compiled too and does not.

The levers, all on by default and each with its opt-out:

* ``policy`` (``"full"``) over the blocks, ``scan`` (True: on CPU only a scan keeps a loop's recompute);
* ``query_blocks`` and ``seq_tiles`` (``"auto"``): attention in blocks of queries and the per-token parts in
  sequence tiles, by :func:`remat_kit.apply` on the unedited model, where this remat_kit's ``apply`` has them;
* ``loss_chunks`` (``"auto"``): given to a loss that takes a ``loss_chunks`` keyword (0 included: off), one
  written with :func:`remat_kit.head_loss`, the loss at the head in chunks; a loss without it runs as given;
* ``offload`` (None: where the target moves memory): the blocks' kept inputs go to the host
  (:func:`remat_kit.analysis.memory.host_offload`; XLA:CPU moves nothing, so there it is off).

A lever asked for that this install or this model lacks is not an error when it is a default (``"auto"``): the
result's ``unavailable`` says it in one line each.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from remat_kit import policies
from remat_kit import target as target_lib
from remat_kit.analysis import inspection
from remat_kit.analysis import memory as memory_lib
from remat_kit.planning.fit import budget_bytes_of, check_convention
from remat_kit.planning.limits import boundary
from remat_kit.planning.planner import DEFAULT_MARGIN, Budget, StepPlanner, get_optimizer
from remat_kit.unedited import entry as unedited_lib
from remat_kit.units import fmt_bytes

#: The longest sequence tried unless ``limit`` says otherwise.
DEFAULT_LIMIT = 131_072


@dataclasses.dataclass(frozen=True)
class Levers:
    """The levers one search ran with (the effective values: a lever this install lacks is at its off value).

    Attributes:
      policy: the blocks' policy spec; ``"none"`` with every other lever off is the model as given.
      scan: the blocks run as one ``lax.scan``.
      query_blocks: attention in this many query blocks (``"auto"``: :func:`remat_kit.apply` chooses per length;
        1: whole).
      seq_tiles: the per-token parts in this many sequence tiles (``"auto"`` or a count; 1: untiled).
      loss_chunks: passed to the loss as ``loss_chunks=`` (0: off, the loss computes its logits whole; a loss
        without the keyword runs as given).
      offload: the blocks' kept inputs offloaded to the host.
    """

    policy: str = "full"
    scan: bool = True
    query_blocks: int | str = 1
    seq_tiles: int | str = 1
    loss_chunks: int | str = 0
    offload: bool = False

    @property
    def plain(self) -> bool:
        """Whether this is the model as given (no remat, no blocks, no tiles)."""
        return self.policy == "none" and not self.scan and self.query_blocks == 1 and self.seq_tiles == 1

    def describe(self) -> str:
        """One line: ``full, scan, query_blocks=auto, seq_tiles=auto, loss_chunks=auto``."""
        if self.plain:
            parts = ["the model as given"]
        else:
            parts = [self.policy] + (["scan"] if self.scan else [])
            parts += [f"{k}={getattr(self, k)}" for k in ("query_blocks", "seq_tiles") if getattr(self, k) != 1]
        parts.append(f"loss_chunks={self.loss_chunks}" if self.loss_chunks != 0 else "the loss as given")
        return ", ".join(parts + (["offload"] if self.offload else []))


@dataclasses.dataclass(frozen=True)
class MaxSeq:
    """:func:`max_seq`'s answer: the longest sequence that fits, compiled at its edge.

    Attributes:
      seq: the longest multiple of ``step`` (at most ``limit``) whose step fits (0: not even ``step`` fits).
      need_bytes: its compiled device need (None when nothing fits).
      next_seq, next_need_bytes: ``seq + step``, compiled and over the budget; None when ``seq`` is ``limit``.
      levers: the :class:`Levers` used.
      unavailable: the levers asked for that were not used, one line each (why).
      budget_bytes, margin: the budget (a step fits when its need × (1 + margin) is at most the budget).
      step, limit: the granularity and the longest length tried.
      compiles: the XLA compiles spent (each a whole training step).
      needs: every length compiled and its need, ``((seq, bytes), ...)`` by length.
      seconds: the search's wall time.
    """

    seq: int
    need_bytes: int | None
    next_seq: int | None
    next_need_bytes: int | None
    levers: Levers
    unavailable: tuple[str, ...]
    budget_bytes: int
    margin: float
    step: int
    limit: int
    compiles: int
    needs: tuple[tuple[int, int], ...]
    seconds: float

    def summary(self) -> str:
        """Two lines: the answer and its edge, then the levers."""
        m, budget = 1 + self.margin, fmt_bytes(self.budget_bytes)
        if not self.seq:
            head = f"nothing fits {budget}: {self.step:,} needs {fmt_bytes(self.next_need_bytes * m)}"
        else:
            head = f"longest sequence {self.seq:,}: needs {fmt_bytes(self.need_bytes * m)} of {budget}"
            head += (
                f" (margin {self.margin:.0%}); {self.next_seq:,} needs {fmt_bytes(self.next_need_bytes * m)}, over"
                if self.next_seq is not None
                else f" (margin {self.margin:.0%}); {self.limit:,} is the limit"
            )
        return f"{head}; {self.compiles} compiles\nlevers: {self.levers.describe()}" + "".join(
            f"\nnot used: {u}" for u in self.unavailable
        )


def _count_or_auto(name: str, value: Any, off: int) -> int | str:
    if value == "auto" and isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < off:
        raise ValueError(f"{name} must be 'auto' or an integer >= {off} ({off}: off), got {value!r}")
    return value


def _apply_levers() -> frozenset[str]:
    """The sequence levers this install's :func:`remat_kit.apply` takes (``query_blocks``, ``seq_tiles``)."""
    params = inspect.signature(unedited_lib.apply).parameters
    return frozenset(k for k in ("query_blocks", "seq_tiles") if k in params)


def _takes_chunks(loss_fn: Callable) -> bool:
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False
    return "loss_chunks" in params


class Search:
    """One model, loss and set of levers, compiled at the lengths asked (memoized), answering :func:`max_seq` for
    one budget or several (the command line's ``--budget 16GB,24GB,80GB`` shares the compiles).

    Args: as :func:`max_seq` (``levers`` resolved).
    """

    def __init__(
        self,
        model: Any,
        loss_fn: Callable,
        args_at: Callable[[int], tuple],
        levers: Levers,
        unavailable: tuple[str, ...],
        *,
        optimizer: str | optax.GradientTransformation,
        step: int,
        limit: int,
        start: int,
        where: Any,
        static_argnames: Any,
        target: Any,
        progress: Callable[[str], None] | None,
    ):
        self.model, self.loss_fn, self.args_at = model, loss_fn, args_at
        self.levers, self.unavailable = levers, unavailable
        self.step, self.limit, self.start = step, limit, start
        self.progress = progress
        is_nnx = isinstance(model, nnx.Module)
        kwargs: dict[str, Any] = {"where": where, "static_argnames": static_argnames, "scan": levers.scan}
        kwargs.update({k: getattr(levers, k) for k in ("query_blocks", "seq_tiles") if getattr(levers, k) != 1})
        loss = functools.partial(loss_fn, loss_chunks=levers.loss_chunks) if _takes_chunks(loss_fn) else loss_fn
        policy = policies.parse(levers.policy)
        make = unedited_lib.apply_factory(model, loss, **kwargs)
        made: dict[str, Any] = {}

        def build(_policy, _batch, seq):
            args = inspection.abstract(tuple(args_at(seq)))
            if "fn" not in made:  # the model under the levers, once: each length only retraces it
                made["fn"] = (lambda *a: loss(model, *a)) if levers.plain and is_nnx else make(policy)
            if is_nnx:
                params = inspection.abstract((nnx.state(model, nnx.Param),))[0]
                if levers.plain:
                    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
                    fn = lambda p, *b: loss(nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest)), *b)
                    return fn, params, args
                return made["fn"], params, args
            return made["fn"], args[0], args[1:]

        self.policy = policy
        self.planner = StepPlanner(build, optimizer, target=target)
        self.started = time.perf_counter()

    def need(self, seq: int) -> int:
        """The compiled step's device need at ``seq`` (one compile the first time)."""
        known = self.planner.is_compiled(self.policy, None, seq)
        t = time.perf_counter()
        got = self.planner.memory(self.policy, None, seq)[0]
        if self.progress and not known:
            self.progress(f"[max-seq] {seq:,}: needs {fmt_bytes(got)} (compiled in {time.perf_counter() - t:.1f} s)")
        return got

    def edge(self, budget_bytes: int, margin: float = DEFAULT_MARGIN) -> MaxSeq:
        """The longest length that fits ``budget_bytes`` with ``margin``, compiled at its edge."""
        budget = Budget(budget_bytes, margin)
        cap, step = self.limit // self.step, self.step
        need = lambda n: self.need(n * step)
        known = {s // step: v for (_, _, s), v in self._needs().items()}
        n = max(1, min(cap, self.start // step))
        if not known:  # doubling from start until a length does not fit (or the limit)
            while True:
                known[n] = need(n)
                if known[n] > budget.target or n == cap:
                    break
                n = min(cap, 2 * n)
        n = boundary(need, budget.target, 1, cap, degree=2, known=known)
        seq = n * step
        got = need(n) if n else None
        nxt = (n + 1) * step if n < cap else None
        nxt_need = need(n + 1) if nxt is not None else None
        needs = tuple(sorted((s, v) for (_, _, s), v in self._needs().items()))
        return MaxSeq(
            seq=seq,
            need_bytes=got,
            next_seq=nxt,
            next_need_bytes=nxt_need,
            levers=self.levers,
            unavailable=self.unavailable,
            budget_bytes=budget_bytes,
            margin=margin,
            step=step,
            limit=self.limit,
            compiles=self.planner.compiles,
            needs=needs,
            seconds=time.perf_counter() - self.started,
        )

    def _needs(self) -> dict[tuple, int]:
        return self.planner.needs_by_shape()


def resolve_levers(
    model: Any,
    loss_fn: Callable,
    *,
    policy: str,
    scan: bool,
    query_blocks: int | str,
    seq_tiles: int | str,
    loss_chunks: int | str,
    offload: bool | None,
    step: int,
    target: Any,
) -> tuple[Levers, tuple[str, ...]]:
    """The levers :func:`max_seq` runs with, each checked in one line, and the ones it cannot use (why).

    Raises:
      TypeError/ValueError: a bad value (naming the argument and what is allowed), or a lever set to a count
        (not ``"auto"``) that this install does not have.
    """
    spec = str(policies.parse(policy))
    if not isinstance(scan, bool):
        raise TypeError(f"scan must be True or False, got {scan!r}")
    if offload is not None and not isinstance(offload, bool):
        raise TypeError(f"offload must be True, False or None (where the target moves memory), got {offload!r}")
    values = {
        "query_blocks": _count_or_auto("query_blocks", query_blocks, 1),
        "seq_tiles": _count_or_auto("seq_tiles", seq_tiles, 1),
        "loss_chunks": _count_or_auto("loss_chunks", loss_chunks, 0),
    }
    for name in ("query_blocks", "seq_tiles"):
        if isinstance(values[name], int) and step % values[name]:
            raise ValueError(f"step {step} must be a multiple of {name}={values[name]}: every length tried is split")
    unavailable: list[str] = []
    has = _apply_levers()
    for name in ("query_blocks", "seq_tiles"):
        if values[name] != 1 and name not in has:
            if values[name] != "auto":
                raise ValueError(f"{name}={values[name]}: this remat_kit's apply has no {name} (use {name}=1)")
            unavailable.append(f"{name}: this remat_kit's apply does not take it")
            values[name] = 1
    if values["loss_chunks"] != 0 and not _takes_chunks(loss_fn):
        if values["loss_chunks"] != "auto":
            raise ValueError(
                f"loss_chunks={values['loss_chunks']}: loss_fn takes no loss_chunks keyword (use loss_chunks=0)"
            )
        unavailable.append("loss_chunks: loss_fn takes no loss_chunks keyword, so it runs as given")
        values["loss_chunks"] = 0
    moves = memory_lib.host_offload(_device(target)).enforced
    if offload and not moves:
        raise ValueError(f"offload=True: the target ({target or 'local'}) moves no memory to the host; use None")
    use_offload = bool(moves if offload is None else offload) and spec == "full"
    if use_offload:
        spec = "offload"
    elif offload is None and spec == "full" and not moves:
        unavailable.append("offload: the target moves no memory to the host (XLA:CPU)")
    return Levers(spec, scan, values["query_blocks"], values["seq_tiles"], values["loss_chunks"], use_offload), tuple(
        unavailable
    )


def _device(target: Any):
    return target_lib.parse(target).devices()[0]


def max_seq(
    model: Any,
    loss_fn: Callable,
    args_at: Callable[[int], tuple],
    *,
    budget: int | str,
    step: int = 256,
    limit: int = DEFAULT_LIMIT,
    start: int | None = None,
    policy: str = "full",
    scan: bool = True,
    query_blocks: int | str = "auto",
    seq_tiles: int | str = "auto",
    loss_chunks: int | str = "auto",
    offload: bool | None = None,
    optimizer: str | optax.GradientTransformation = "adamw",
    margin: float = DEFAULT_MARGIN,
    where: Any = None,
    static_argnames: Any = None,
    target: Any = None,
    progress: Callable[[str], None] | None = None,
) -> MaxSeq:
    """The longest sequence (a multiple of ``step``) whose compiled training step fits ``budget``, every lever on.

    Compile-only: each length tried is one XLA compile of the step (the loss's gradient, clipping, ``optimizer``'s
    update, parameters and state donated) from abstract inputs. Lengths double from ``start`` until one does not
    fit; a bisection guided by the needs measured closes the bracket; the answer is compiled and fits, the next
    multiple of ``step`` is compiled and does not (or the answer is ``limit``).

    Args:
      model: a Flax model, Linen or NNX, unedited (an NNX model may be abstract: ``nnx.eval_shape``).
      loss_fn: as :func:`remat_kit.fit` (Linen: ``loss_fn(model, variables, *batch)``; NNX:
        ``loss_fn(model, *batch)``); with a ``loss_chunks`` keyword it gets ``loss_chunks=`` (see
        :func:`remat_kit.head_loss`: ``chunks=loss_chunks``; 0 is off: the plain loss).
      args_at: ``args_at(seq) -> example_args``: the loss's arguments after the model at sequence length
        ``seq`` (Linen: the variables first), arrays or ``jax.ShapeDtypeStruct``.
      budget: device bytes (an int) or a size string (``"24GB"``); a step fits when its need × (1 + margin) is
        at most the budget.
      step, limit, start: lengths are multiples of ``step`` up to ``limit``, the doubling starting at ``start``
        (default ``4 * step``).
      policy, scan: the blocks' policy and whether they run as one scan (``policy="none", scan=False`` and the
        other levers off: the model as given).
      query_blocks, seq_tiles: as :func:`remat_kit.apply` (``"auto"``, a count, or 1: off).
      loss_chunks: ``"auto"``, a count, or 0 (off): given to a loss with a ``loss_chunks`` keyword.
      offload: offload the blocks' kept inputs (None: where the target moves memory; True there only).
      optimizer, margin, where, static_argnames, target: as :func:`remat_kit.fit`.
      progress: called with one line per compile.

    Returns:
      A :class:`MaxSeq`: ``.seq``, ``.need_bytes``, ``.next_seq``, ``.next_need_bytes``, ``.levers``,
      ``.unavailable``, ``.compiles``, ``.summary()``.

    Raises:
      TypeError/ValueError: a bad argument, in one line naming it, before anything is compiled.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + nn.Dense(16)(jnp.tanh(nn.Dense(64)(x)))
    >>> class Net(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         for _ in range(4):
    ...             x = Block()(x)
    ...         return x
    >>> v = jax.eval_shape(lambda: Net().init(jax.random.key(0), jnp.ones((1, 8, 16))))
    >>> args_at = lambda seq: (v, jax.ShapeDtypeStruct((1, seq, 16), jnp.float32))
    >>> r = max_seq(Net(), lambda m, v, x: jnp.mean(m.apply(v, x) ** 2), args_at, budget="2MB", step=64)
    >>> r.seq > 0 and r.need_bytes * 1.1 <= 2 * 10**6 < r.next_need_bytes * 1.1
    True
    """
    budget_bytes = budget_bytes_of(budget)
    Budget(budget_bytes, margin)
    search = prepare(
        model,
        loss_fn,
        args_at,
        step=step,
        limit=limit,
        start=start,
        policy=policy,
        scan=scan,
        query_blocks=query_blocks,
        seq_tiles=seq_tiles,
        loss_chunks=loss_chunks,
        offload=offload,
        optimizer=optimizer,
        where=where,
        static_argnames=static_argnames,
        target=target,
        progress=progress,
    )
    return search.edge(budget_bytes, margin)


def prepare(
    model: Any,
    loss_fn: Callable,
    args_at: Callable[[int], tuple],
    *,
    step: int = 256,
    limit: int = DEFAULT_LIMIT,
    start: int | None = None,
    policy: str = "full",
    scan: bool = True,
    query_blocks: int | str = "auto",
    seq_tiles: int | str = "auto",
    loss_chunks: int | str = "auto",
    offload: bool | None = None,
    optimizer: str | optax.GradientTransformation = "adamw",
    where: Any = None,
    static_argnames: Any = None,
    target: Any = None,
    progress: Callable[[str], None] | None = None,
) -> Search:
    """:func:`max_seq`'s search, checked and ready, for one budget or several (:meth:`Search.edge` per budget; the
    compiles are shared). Arguments as :func:`max_seq`'s, less the budget and margin.

    Raises:
      TypeError/ValueError: a bad argument, in one line naming it, before anything is compiled.
    """
    get_optimizer(optimizer)
    is_nnx = isinstance(model, nnx.Module)
    if not is_nnx and not _is_linen(model):
        raise TypeError(f"max_seq takes a flax.linen or flax.nnx Module instance, got {model!r}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (loss_fn(model, ...) -> scalar), got {loss_fn!r}")
    if not callable(args_at):
        raise TypeError(f"args_at must be callable (args_at(seq) -> the loss's example arguments), got {args_at!r}")
    for name, value, least in (("step", step, 1), ("limit", limit, step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if limit % step:
        raise ValueError(f"limit {limit} must be a multiple of step {step}")
    start = min(limit, 4 * step) if start is None else start
    if isinstance(start, bool) or not isinstance(start, int) or start < step or start % step:
        raise ValueError(f"start must be a positive multiple of step {step}, got {start!r}")
    levers, unavailable = resolve_levers(
        model,
        loss_fn,
        policy=policy,
        scan=scan,
        query_blocks=query_blocks,
        seq_tiles=seq_tiles,
        loss_chunks=loss_chunks,
        offload=offload,
        step=step,
        target=target,
    )
    example = args_at(step)
    if not isinstance(example, (tuple, list)):
        raise TypeError(f"args_at({step}) must return a tuple of the loss's arguments, got {type(example).__name__}")
    chunked = functools.partial(loss_fn, loss_chunks=levers.loss_chunks) if _takes_chunks(loss_fn) else loss_fn
    check_convention(model, chunked, tuple(example))
    return Search(
        model,
        loss_fn,
        args_at,
        levers,
        unavailable,
        optimizer=optimizer,
        step=step,
        limit=limit,
        start=start,
        where=where,
        static_argnames=static_argnames,
        target=target,
        progress=progress,
    )


def _is_linen(model: Any) -> bool:
    import flax.linen as nn

    return isinstance(model, nn.Module)


def layer_input_floor(num_layers: int, d_model: int, bytes_per_value: int, batch: int = 1) -> int:
    """Bytes per position that a stack keeping only its layer inputs holds: ``batch × layers × d_model × bytes``.

    >>> layer_input_floor(16, 2048, 2)
    65536
    """
    return math.prod((batch, num_layers, d_model, bytes_per_value))
