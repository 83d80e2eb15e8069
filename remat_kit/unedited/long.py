"""Long context inside :func:`remat_kit.apply`: a block's attention in query blocks, its per-token parts in tiles.

Inside each block :func:`remat_kit.apply` runs, every direct submodule call (``attn``, ``mlp``, the norms) is
traced on its own, with the module's current variables passed as inputs (never captured, so gradients reach
them), and run from that program (:mod:`remat_kit.policies.positions`):

* a submodule whose program holds an attention region (``scores -> softmax -> weighted sum``, checked to be
  independent along its queries) runs that region ``query_blocks`` blocks of queries at a time, each block under
  its own checkpoint, so the backward never holds the ``S x S`` scores of more than one block;
* a submodule whose program is proven per-token along the sequence (axis 1 of its first array argument; the
  length is the block input's) runs ``seq_tiles`` tiles at a time (the MLP's ``[tokens, d_ff]`` intermediates);
* any other (a cumsum over the sequence, a state update, a call-time ``nnx.Rngs``) runs as written.

Nothing of the model is edited; its output keeps its name (``mlp``), so ``selective:mlp`` still works.
:func:`remat_kit.names_of` lists each submodule's kind and why (:class:`Part`).

>>> auto_blocks(8192), auto_blocks(1000), check_blocks("query_blocks", "auto")
(8, 1, 'auto')
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from remat_kit.policies import positions
from remat_kit.policies.positions import NotPerPosition
from remat_kit.policies.tiling import check_tiles
from remat_kit.unedited.arrays import split_arrays

#: ``"auto"`` aims a block at this many positions (the one definition; 512 to 2048 where a divisor allows).
AUTO_BLOCK = 1024

ATTENTION, PER_TOKEN, NEITHER = "attention", "per-token", "neither"


def auto_blocks(length: int) -> int:
    """The number of blocks ``"auto"`` cuts ``length`` positions into: the divisor whose block is nearest
    :data:`AUTO_BLOCK` positions (on a log scale; fewer blocks on a tie).

    >>> auto_blocks(4096), auto_blocks(3072), auto_blocks(512)
    (4, 3, 1)
    """
    divisors = [k for k in range(1, length + 1) if length % k == 0]
    return min(divisors, key=lambda k: (abs(math.log(length / k / AUTO_BLOCK)), k))


#: ``query_blocks="auto"`` sizes a block so its float32 scores (every head, every key) stay under this: a
#: block's scores, a few copies of them live in its backward, are then a fixed cost, not one per position.
AUTO_SCORES_BYTES = 64 * 2**20
#: ... but never fewer queries per block than this (tiny matmuls; the scan's trip count).
MIN_QUERY_BLOCK = 16


def auto_query_blocks(length: int, row_bytes: int) -> int:
    """The number of query blocks ``"auto"`` cuts ``length`` queries into when one query's scores (all heads,
    all keys, float32) take ``row_bytes``: the fewest whose block is at most :data:`AUTO_BLOCK` queries and
    keeps a block's scores under :data:`AUTO_SCORES_BYTES` (blocks of at least :data:`MIN_QUERY_BLOCK`).

    >>> auto_query_blocks(16384, 32 * 16384 * 4)  # Llama 3 1B's 32 heads at 16K: blocks of 32 queries
    512
    >>> auto_query_blocks(2048, 4 * 2048 * 4)  # 4 heads at 2K: AUTO_BLOCK decides
    2
    """
    cap = min(AUTO_BLOCK, max(MIN_QUERY_BLOCK, AUTO_SCORES_BYTES // max(row_bytes, 1)))
    sizes = [b for b in range(1, min(cap, length) + 1) if length % b == 0]
    return length // max(sizes)


def check_blocks(what: str, value: Any) -> int | str | None:
    """``query_blocks``/``seq_tiles`` as given, once it is None, ``"auto"`` or a positive int (before any trace).

    >>> check_blocks("seq_tiles", 0)
    Traceback (most recent call last):
    ...
    ValueError: seq_tiles=0: give a positive number of blocks, "auto" or None
    """
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f'{what}={value!r}: give a positive int, "auto" or None, not a {type(value).__name__}')
    if value < 1:
        raise ValueError(f'{what}={value}: give a positive number of blocks, "auto" or None')
    return int(value)


def blocks_for(what: str, value: int | str, length: int, row_bytes: int | None = None) -> int:
    """The blocks for ``length`` positions: ``"auto"`` (:func:`auto_blocks`; with ``row_bytes``, one query's
    scores, :func:`auto_query_blocks`) or ``value`` when it divides it.

    >>> blocks_for("query_blocks", "auto", 2048), blocks_for("seq_tiles", 4, 2048)
    (2, 4)
    """
    if value != "auto":
        return check_tiles(value, length, what=what)
    return auto_blocks(length) if row_bytes is None else auto_query_blocks(length, row_bytes)


@dataclasses.dataclass(frozen=True)
class Long:
    """What :func:`remat_kit.apply` was asked for: ``query_blocks`` and ``seq_tiles`` (None: not asked)."""

    query_blocks: int | str | None = None
    seq_tiles: int | str | None = None


def make_long(query_blocks: Any, seq_tiles: Any) -> Long | None:
    """A :class:`Long` from :func:`remat_kit.apply`'s arguments (None when neither is asked), checked.

    >>> make_long(None, None) is None, make_long("auto", 4)
    (True, Long(query_blocks='auto', seq_tiles=4))
    """
    long = Long(check_blocks("query_blocks", query_blocks), check_blocks("seq_tiles", seq_tiles))
    return None if long == Long() else long


@dataclasses.dataclass(frozen=True)
class Part:
    """One direct submodule of a block: ``attention`` (query blocks), ``per-token`` (tiles) or ``neither``, and why."""

    path: str
    kind: str
    why: str


@dataclasses.dataclass(frozen=True)
class _Block:
    """The block call being run: what was asked, its sequence length, and what each submodule turned out to be."""

    long: Long | None  # None: only classify (names_of), run everything as written
    length: int
    where: str
    parts: list[Part] = dataclasses.field(default_factory=list)

    def add(self, part: Part) -> None:
        if all(p.path != part.path for p in self.parts):
            self.parts.append(part)


_BLOCK: contextvars.ContextVar[_Block | None] = contextvars.ContextVar("remat_kit_long_block", default=None)
#: True while a submodule is traced on its own: its own submodules run as written (no interception twice).
_RETRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("remat_kit_long_retracing", default=False)


def seq_length(args: tuple, kwargs: dict) -> int | None:
    """A block call's sequence length: axis 1 of its first array argument with two axes or more (else None).

    >>> seq_length((None, np.ones((2, 16, 4))), {})
    16
    """
    for leaf in jax.tree.leaves((args, kwargs)):
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)) and np.ndim(leaf) >= 2:
            return int(np.shape(leaf)[1])
    return None


_SAID: set[str] = set()  # query_blocks="auto" without attention: each block kind said once per process


@contextlib.contextmanager
def block_scope(long: Long | None, args: tuple, kwargs: dict, where: str, collect: Any = None) -> Iterator[Any]:
    """Context: one block call whose direct submodules :func:`run_part` may run in blocks.

    Yields the block's state (None when nothing is asked: no ``long`` and no ``collect``). On a clean exit with
    ``query_blocks`` asked, a block where no submodule held an attention region is a ValueError naming them (a
    warning, once, under ``"auto"``).
    ``collect``: :func:`remat_kit.names_of`'s collector, given each submodule's :class:`Part`.
    """
    length = seq_length(args, kwargs)
    if (long is None and collect is None) or length is None or _RETRACING.get():
        yield None
        return
    block = _Block(long, length, where)
    token = _BLOCK.set(block)
    try:
        yield block
    finally:
        _BLOCK.reset(token)
    if collect is not None:
        collect.add_parts(where, block.parts)
    if long is not None and long.query_blocks is not None and not any(p.kind == ATTENTION for p in block.parts):
        looked = "; ".join(f"{p.path} ({p.why})" for p in block.parts) or "none was called"
        message = (
            f"query_blocks={long.query_blocks}: no attention region (scores -> softmax -> weighted sum) in "
            f"{where}'s submodules: {looked}"
        )
        if long.query_blocks != "auto":
            raise ValueError(message)
        # "auto" is a default (max_seq's): a model without attention runs as written, said once (every layer alike).
        if looked not in _SAID:
            _SAID.add(looked)
            warnings.warn(message + "; they run as written", UserWarning, stacklevel=2)


def active() -> bool:
    """Whether a submodule called now is a direct one of a block under :func:`block_scope` (and not re-traced)."""
    return _BLOCK.get() is not None and not _RETRACING.get()


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def run_part(path: str, fn: Callable, state: list, args: tuple, kwargs: dict, plain: Callable[[], Any]) -> Any:
    """Run one direct submodule of the current block in query blocks, in tiles, or as written (``plain()``).

    Args:
      path: the submodule's path in the block (``attn``).
      fn: ``fn(state_leaves, args, kwargs) -> (output, new_state_leaves or None)``: the submodule run on its
        variables given as leaves; each new state leaf must be an input one, unchanged (a submodule that writes
        state runs as written).
      state: the submodule's variables as leaves (arrays or tracers).
      args, kwargs: the call's arguments; array leaves are traced, the others (None caches, flags) closed over.
      plain: the call as written.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((1, 4, 2))
    >>> with block_scope(Long(seq_tiles=2), (x,), {}, "demo") as block:
    ...     y = run_part("act", lambda state, a, k: (jnp.tanh(a[0]), None), [], (x,), {}, lambda: None)
    >>> y.shape, block.parts[0].kind
    ((1, 4, 2), 'per-token')
    """
    block = _BLOCK.get()
    arrays, rebuild = split_arrays(args, kwargs)
    n = len(state)
    box: dict[str, Any] = {}

    def flat(*leaves):
        a, k = rebuild(list(leaves[n:]))
        token = _RETRACING.set(True)
        try:
            out, new = fn(list(leaves[:n]), a, k)
        finally:
            _RETRACING.reset(token)
        out_leaves, box["tree"] = jax.tree.flatten(out)
        box["n_out"] = len(out_leaves)
        if isinstance(new, str):
            box["writes"] = new
            new = []
        box["n_new"] = len(new or [])
        return [*out_leaves, *(new or [])]

    try:
        closed = jax.make_jaxpr(flat)(*state, *arrays)
    except Exception as err:  # a submodule that cannot be traced on its own runs as written
        block.add(Part(path, NEITHER, f"not traced on its own ({_one_line(err)})"))
        return plain()
    n_out = box["n_out"]
    jaxpr = closed.jaxpr
    news = jaxpr.outvars[n_out:]
    writes = box.get("writes")
    if writes is None and any(o not in jaxpr.invars[:n] for o in news):
        writes = "updates its state (RNG counts, sown values, mutable collections)"
    if writes is not None:
        block.add(Part(path, NEITHER, writes))
        return plain()
    program = jcore.ClosedJaxpr(jaxpr.replace(outvars=jaxpr.outvars[:n_out]), closed.consts)
    first = next((n + i for i, a in enumerate(arrays) if np.ndim(a) >= 2), None)
    kind, why, run = _classify(program, first, block)
    block.add(Part(path, kind, why))
    if run is None:
        return plain()
    return jax.tree.unflatten(box["tree"], run(*state, *arrays))


def _classify(program, first: int | None, block: _Block) -> tuple[str, str, Callable | None]:
    """A submodule's kind, why, and (when asked and worth it) the function that runs it in blocks."""
    long, length = block.long, block.length
    want_attention = long is None or long.query_blocks is not None
    want_tiles = long is None or long.seq_tiles is not None
    proof_blocks = 2 if length % 2 == 0 else 1  # the proof is by rules, not by size: any divisor will do
    reasons = []
    # Per-token first: an MLP whose width happens to equal the length looks like scores by shape alone.
    shape = None if first is None else program.in_avals[first].shape
    if shape is None:
        reasons.append("no array argument with a sequence axis")
    elif shape[1] != length:
        reasons.append(f"axis 1 of its first array argument is {shape[1]}, not the sequence length {length}")
    else:
        in_axes = tuple(1 if i == first else None for i in range(len(program.in_avals)))
        try:
            positions.check(program, in_axes, proof_blocks)
        except NotPerPosition as err:
            reasons.append(str(err))
        else:
            if not want_tiles:
                return PER_TOKEN, "proven per-token along the sequence (seq_tiles= not asked)", None
            if long is None:
                return PER_TOKEN, "proven per-token along the sequence", None
            k = blocks_for("seq_tiles", long.seq_tiles, length)
            why = f"proven per-token along the sequence, in {k} tiles"
            return PER_TOKEN, why, positions.blocked(program, in_axes, k) if k > 1 else None
    if want_attention:
        flat = positions.inline(program)
        try:
            regions = positions.attention_regions(flat, length)
        except NotPerPosition as err:
            regions = []
            reasons.append(str(err))
        else:
            if not regions:
                reasons.append("no scores -> softmax -> weighted sum region")
        if regions:
            where = ", ".join(r.where for r in regions)
            if long is None:
                return ATTENTION, f"{len(regions)} region(s): {where}", None
            scores = max(flat.jaxpr.eqns[r.eqns[0]].outvars[0].aval.size for r in regions)  # r.eqns[0]: the scores
            k = blocks_for("query_blocks", long.query_blocks, length, row_bytes=scores // length * 4)
            why = f"{len(regions)} region(s) in {k} query blocks: {where}"
            return ATTENTION, why, positions.run_regions(flat, regions, k) if k > 1 else None
    return NEITHER, "; ".join(reasons), None
