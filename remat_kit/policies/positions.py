"""Run part of a traced program a block of positions at a time, after checking that it may be.

Long sequences run out of memory in two places a model's author rarely tiles: the per-token layers
(an MLP's ``[tokens, d_ff]`` intermediates) and attention's ``[heads, S, S]`` scores, which a plain
``softmax(q k^T) v`` holds for every head, forward and backward. Both are independent along one axis
of their inputs: a per-token layer along the sequence, attention along its queries (given the keys and
values). This module works on the program JAX traced from the user's unedited code (a jaxpr):

* :func:`check` proves, equation by equation, that the outputs at positions ``[i, i + b)`` depend only
  on the inputs at those positions (and on inputs passed whole): elementwise math, matmuls that do not
  contract the axis, reductions over other axes, reshapes that keep it. Anything else (a reduction over
  the axis, a scan, a gather, a matmul contracting it) is a :class:`NotPerPosition` naming the equation:
  checked, not assumed.
* :func:`blocked` evaluates such a program over ``K`` blocks under :func:`remat_kit.policies.tiling.tiled`
  (a scan, each block under its own checkpoint), re-binding each equation at the block's size. Values
  computed from whole inputs only (an ``iota``, a mask) stay whole and are sliced where they meet a
  blocked value, at the block's offset, so a causal mask built inside the program stays right.
* :func:`attention_regions` finds, in a flat program, each ``scores -> softmax -> weighted sum`` region:
  the equations between a matmul whose output is ``[.., S, .., S]`` and the matmuls that contract one of
  those ``S`` axes back away. :func:`run_regions` evaluates the program with each region run over blocks
  of queries, so the backward never holds the scores of more than one block.

>>> import jax, jax.numpy as jnp
>>> w = jnp.full((4, 4), 0.1)
>>> closed = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((2, 8, 4)), w)
>>> check(closed, (1, None))
(1,)
>>> x = jnp.arange(64.0).reshape(2, 8, 4) / 64
>>> bool(jnp.allclose(blocked(closed, (1, None), 4)(x, w)[0], jnp.tanh(x @ w)))
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from remat_kit._jax_internals import checkpoint_name_of, eqn_source, own_nothing_saveable, rebind, remat_body
from remat_kit.policies.tiling import check_tiles, tiled


class NotPerPosition(ValueError):
    """A program (or one of its equations) mixes positions along the blocked axis."""


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: Primitives whose output at an index depends only on their operands at that index.
ELEMENTWISE = _words(
    "abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp clz complex conj convert_element_type "
    "copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma imag integer_pow "
    "is_finite le lgamma log log1p logistic lt max min mul name ne neg nextafter not or population_count pow real "
    "reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh "
    "sqrt square stop_gradient sub tan tanh xor"
)
_REDUCTIONS = _words("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin")
_CUMULATIVE = _words("cumsum cumprod cummax cummin cumlogsumexp")
#: Call-like primitives whose body is evaluated inline (a model's own ``jax.checkpoint`` inside a blocked
#: region is dropped: each block already runs under its own checkpoint).
_CALLS = _words("jit pjit closed_call core_call remat2 checkpoint custom_jvp_call custom_vjp_call")
#: Calls flattened by :func:`inline`: the others keep their custom derivative outside the regions.
_PLAIN_CALLS = _words("jit pjit closed_call core_call remat2 checkpoint")


def _remat3(eqn) -> bool:
    """JAX's remat3 (``JAX_REMAT3=true``): a checkpoint is a ``call_hi_primitive`` equation with a body."""
    return eqn.primitive.name == "call_hi_primitive" and remat_body(eqn) is not None


def _kind(eqn) -> str:
    """The primitive's name, remat3's checkpoint (``remat2``) and ``checkpoint_name`` (``name``) read as classic."""
    if checkpoint_name_of(eqn) is not None:
        return "name"
    return "remat2" if _remat3(eqn) else eqn.primitive.name


def body_of(eqn) -> tuple[Any, list[Any]]:
    """A call-like equation's body as ``(jaxpr, consts)`` (``jit``, ``remat2``, ``custom_jvp_call``, ...)."""
    if _remat3(eqn):
        body = remat_body(eqn)
        return body.jaxpr, list(body.consts)
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, jcore.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, jcore.Jaxpr):
            return sub, []
    raise NotPerPosition(f"{eqn.primitive.name}: no body to evaluate")


def _bind(eqn, invals: Sequence[Any], **params: Any) -> list[Any]:
    tag = checkpoint_name_of(eqn)
    if tag is not None and eqn.primitive.name != "name":  # remat3's name carries its shapes: name anew
        return [checkpoint_name(v, tag) for v in invals]
    return rebind(eqn, list(invals), **params)


def _where(eqn) -> str:
    at = eqn_source(eqn)
    return f"{eqn.primitive.name} at {at}" if at else eqn.primitive.name


@dataclasses.dataclass(frozen=True)
class _Block:
    """The block being evaluated: its offset on the full axis, its size and the full size."""

    start: Any
    size: int
    full: int


def _slice(x, axis: int, block: _Block):
    """A whole value's block on ``axis`` (shapes match there, or it is 1: a broadcast)."""
    if x.shape[axis] == 1:  # broadcast along the axis (lax lets a size-1 dimension meet any size)
        return x
    if x.shape[axis] != block.full:
        raise NotPerPosition(f"a whole value of shape {x.shape} meets the blocked axis {axis} of length {block.full}")
    return jax.lax.dynamic_slice_in_dim(x, block.start, block.size, axis)


class _Cutter:
    """Whole values cut to the block where they meet blocked ones, recomputed at the block's size from what
    made them (a mask from ``iota``, its broadcast to the scores' shape) rather than sliced from a whole
    ``[.., S, .., S]`` copy: only inputs and values of other making are sliced."""

    def __init__(self, env, block: _Block):
        self.env, self.block = env, block
        self.made: dict[Any, Any] = {}
        self.memo: dict[tuple[Any, int], Any] = {}

    def __call__(self, var, axis: int):
        if isinstance(var, jcore.Literal):
            return var.val
        value = self.env[var][0]
        if jnp.ndim(value) <= axis or value.shape[axis] == 1:
            return value
        key = (var, axis)
        if key not in self.memo:
            self.memo[key] = self._remake(var, axis, value)
        return self.memo[key]

    def _remake(self, var, axis: int, value):
        eqn, b = self.made.get(var), self.block
        if eqn is None or len(eqn.outvars) != 1:
            return _slice(value, axis, b)
        name, p = _kind(eqn), eqn.params
        if name == "iota":
            shape = _resized(p["shape"], axis, b.size)
            if p["dimension"] != axis:
                return _bind(eqn, [], shape=shape)[0]
            start = jnp.asarray(b.start).astype(p["dtype"])
            return _bind(eqn, [], shape=shape)[0] + start
        if name in ELEMENTWISE:
            ins = [self(v, axis) if jnp.ndim(self._val(v)) == jnp.ndim(value) else self._val(v) for v in eqn.invars]
            return _bind(eqn, ins)[0]
        if name == "broadcast_in_dim" and len(eqn.invars) == 1:
            dims = list(p["broadcast_dimensions"])
            operand = self(eqn.invars[0], dims.index(axis)) if axis in dims else self._val(eqn.invars[0])
            return _bind(eqn, [operand], shape=_resized(p["shape"], axis, b.size))[0]
        if name == "convert_element_type" or name == "reduce_precision":
            return _bind(eqn, [self(eqn.invars[0], axis)])[0]
        if name == "transpose":
            return _bind(eqn, [self(eqn.invars[0], p["permutation"][axis])])[0]
        if name == "reshape" and p.get("dimensions") is None:
            j = _reshaped_axis(list(p["new_sizes"]), axis, list(self._val(eqn.invars[0]).shape))
            if j is not None:
                new = _resized(p["new_sizes"], axis, b.size)
                return _bind(eqn, [self(eqn.invars[0], j)], new_sizes=new)[0]
        return _slice(value, axis, b)

    def _val(self, v):
        return v.val if isinstance(v, jcore.Literal) else self.env[v][0]


def _eval(jaxpr, consts, args, axes, block: _Block) -> tuple[list[Any], list[int | None]]:
    """Evaluate ``jaxpr`` on blocked ``args`` (``axes[i]``: the blocked axis, or None for a whole value)."""
    env: dict[Any, tuple[Any, int | None]] = {}
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = (c, None)
    for v, a, ax in zip(jaxpr.invars, args, axes, strict=True):
        env[v] = (a, ax)
    cutter = _Cutter(env, block)

    def read(v):
        return (v.val, None) if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        vals, ins = zip(*map(read, eqn.invars), strict=True) if eqn.invars else ((), ())
        if all(a is None for a in ins):
            outs, out_axes = _bind(eqn, vals), [None] * len(eqn.outvars)
            cutter.made.update(dict.fromkeys(eqn.outvars, eqn))
        else:
            cut = lambda i, axis, eqn=eqn: cutter(eqn.invars[i], axis)
            outs, out_axes = _rule(eqn, list(vals), list(ins), block, cut)
        for v, o, a in zip(eqn.outvars, outs, out_axes, strict=True):
            env[v] = (o, a)
    outs = [read(v) for v in jaxpr.outvars]
    return [o for o, _ in outs], [a for _, a in outs]


def _rule(eqn, vals: list[Any], axes: list[int | None], block: _Block, cut) -> tuple[list[Any], list[int | None]]:
    """One equation with at least one blocked operand: its blocked outputs and their axes."""
    name, p = _kind(eqn), eqn.params
    carried = {a for a in axes if a is not None}
    if name in ELEMENTWISE:
        if len(carried) != 1:
            raise NotPerPosition(f"{_where(eqn)} combines values blocked on different axes {sorted(carried)}")
        (a,) = carried
        vals = [cut(i, a) if ax is None else v for i, (v, ax) in enumerate(zip(vals, axes, strict=True))]
        return _bind(eqn, vals), [a] * len(eqn.outvars)
    if name in _CALLS:
        body, consts = body_of(eqn)
        return _eval(body, consts, vals, axes, block)
    if name in ("optimization_barrier", "sharding_constraint"):
        return _bind(eqn, vals), list(axes)
    if len(carried) != 1 and name not in ("dot_general", "concatenate", "split", "pad"):
        raise NotPerPosition(f"{_where(eqn)} combines values blocked on different axes {sorted(carried)}")
    a = next(iter(carried)) if len(carried) == 1 else None
    if name == "broadcast_in_dim":
        b = p["broadcast_dimensions"][a]
        return _bind(eqn, vals, shape=_resized(p["shape"], b, block.size)), [b]
    if name == "reshape":
        if p.get("dimensions") is not None:
            raise NotPerPosition(f"{_where(eqn)} reorders dimensions")
        full = list(vals[0].shape)
        full[a] = block.full
        b = _reshaped_axis(full, a, list(p["new_sizes"]))
        if b is None:
            shapes = f"{tuple(full)} -> {tuple(p['new_sizes'])}"
            raise NotPerPosition(f"{_where(eqn)} merges the blocked axis with another ({shapes})")
        return _bind(eqn, vals, new_sizes=_resized(p["new_sizes"], b, block.size)), [b]
    if name == "transpose":
        return _bind(eqn, vals), [list(p["permutation"]).index(a)]
    if name in _REDUCTIONS:
        if a in p["axes"]:
            raise NotPerPosition(f"{_where(eqn)} reduces over the blocked axis")
        return _bind(eqn, vals), [a - sum(1 for x in p["axes"] if x < a)]
    if name == "squeeze":
        if a in p["dimensions"]:
            raise NotPerPosition(f"{_where(eqn)} squeezes the blocked axis")
        return _bind(eqn, vals), [a - sum(1 for x in p["dimensions"] if x < a)]
    if name in _CUMULATIVE or name == "sort":
        if p.get("axis", p.get("dimension")) == a:
            raise NotPerPosition(f"{_where(eqn)} runs along the blocked axis")
        return _bind(eqn, vals), [a] * len(eqn.outvars)
    if name == "rev":
        if a in p["dimensions"]:
            raise NotPerPosition(f"{_where(eqn)} reverses the blocked axis")
        return _bind(eqn, vals), [a]
    if name == "dot_general":
        return _dot(eqn, vals, axes, cut)
    if name in ("concatenate", "split"):
        return _concat_split(eqn, vals, axes, cut)
    if name == "slice":
        if a is None:
            raise NotPerPosition(f"{_where(eqn)}: one operand expected")
        start, limit = p["start_indices"][a], p["limit_indices"][a]
        stride = (p["strides"] or (1,) * len(limit))[a] if p.get("strides") else 1
        if (start, limit, stride) != (0, block.full, 1):
            raise NotPerPosition(f"{_where(eqn)} slices the blocked axis")
        return _bind(eqn, vals, limit_indices=_resized(p["limit_indices"], a, block.size)), [a]
    if name == "pad" and axes[1] is None:
        a = axes[0]
        if tuple(p["padding_config"][a]) != (0, 0, 0):
            raise NotPerPosition(f"{_where(eqn)} pads the blocked axis")
        return _bind(eqn, vals), [a]
    raise NotPerPosition(f"{_where(eqn)} is not known to keep positions apart along the blocked axis")


def _resized(shape, axis: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[axis] = size
    return tuple(out)


def _reshaped_axis(full: list[int], a: int, new: list[int]) -> int | None:
    """Where axis ``a`` of ``full`` lands in ``new``, when the reshape keeps it whole and apart."""
    before = math.prod(full[:a])
    for b, size in enumerate(new):
        if size == full[a] and math.prod(new[:b]) == before:
            return b
    return None


def _dot(eqn, vals, axes, cut):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    la, ra = axes
    if (la is not None and la in lc) or (ra is not None and ra in rc):
        raise NotPerPosition(f"{_where(eqn)} contracts the blocked axis")
    lhs, rhs = vals
    lfree = [d for d in range(jnp.ndim(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(jnp.ndim(rhs)) if d not in rc and d not in rb]
    if la is not None and ra is not None:
        if la in lb and ra in rb and lb.index(la) == rb.index(ra):
            return _bind(eqn, vals), [lb.index(la)]
        raise NotPerPosition(f"{_where(eqn)} multiplies two blocked values on different axes (attention's scores)")
    if la is not None:
        if la in lb:
            i = lb.index(la)
            return _bind(eqn, [lhs, cut(1, rb[i])]), [i]
        return _bind(eqn, vals), [len(lb) + lfree.index(la)]
    if ra in rb:
        i = rb.index(ra)
        return _bind(eqn, [cut(0, lb[i]), rhs]), [i]
    return _bind(eqn, vals), [len(lb) + len(lfree) + rfree.index(ra)]


def _concat_split(eqn, vals, axes, cut):
    p = eqn.params
    along = p.get("dimension", p.get("axis"))
    carried = {a for a in axes if a is not None}
    if len(carried) != 1:
        raise NotPerPosition(f"{_where(eqn)} combines values blocked on different axes {sorted(carried)}")
    (a,) = carried
    if along == a:
        raise NotPerPosition(f"{_where(eqn)} joins or splits along the blocked axis")
    vals = [cut(i, a) if ax is None else v for i, (v, ax) in enumerate(zip(vals, axes, strict=True))]
    return _bind(eqn, vals), [a] * len(eqn.outvars)


# ---- the runner ------------------------------------------------------------------------------------------


def _length(closed, in_axes) -> int:
    lengths = {closed.in_avals[i].shape[a] for i, a in enumerate(in_axes) if a is not None}
    if len(lengths) != 1:
        raise ValueError(f"the blocked inputs must share one length, got {sorted(lengths) or 'none blocked'}")
    return lengths.pop()


def block_fn(closed, in_axes, length: int, size: int) -> Callable:
    """The program on one block of ``size`` positions: ``fn(start, *args) -> (outputs, their axes)``, the
    blocked args already cut to the block that starts at ``start`` (a traced int)."""

    def fn(start, *args):
        block = _Block(start, size, length)
        outs, out_axes = _eval(closed.jaxpr, closed.consts, list(args), list(in_axes), block)
        for o, a in zip(outs, out_axes, strict=True):
            if a is None:
                raise NotPerPosition(f"an output of shape {jnp.shape(o)} does not carry the blocked axis")
        return outs, out_axes

    return fn


def check(closed, in_axes: Sequence[int | None], blocks: int = 2) -> tuple[int, ...]:
    """Prove that ``closed`` may run ``blocks`` blocks at a time along ``in_axes``; the outputs' axes.

    Traces only (``jax.eval_shape``). Raises :class:`NotPerPosition` naming the first equation that mixes
    positions, or an output that does not carry the axis.

    >>> import jax, jax.numpy as jnp
    >>> try:
    ...     check(jax.make_jaxpr(lambda x: jnp.cumsum(x, axis=1))(jnp.ones((2, 4))), (1,))
    ... except NotPerPosition as e:
    ...     print(str(e).endswith("runs along the blocked axis"))
    True
    """
    length = _length(closed, in_axes)
    check_tiles(blocks, length, what="blocks")
    fn = block_fn(closed, in_axes, length, length // blocks)
    args = [
        jax.ShapeDtypeStruct(_resized(av.shape, a, length // blocks) if a is not None else av.shape, av.dtype)
        for av, a in zip(closed.in_avals, in_axes, strict=True)
    ]
    box: list[Any] = []
    jax.eval_shape(lambda *a: box.append(fn(jnp.int32(0), *a)[1]) or 0, *args)
    return tuple(box[0])


def blocked(closed, in_axes: Sequence[int | None], blocks: int) -> Callable:
    """``closed`` (a ``jax.make_jaxpr`` result) as a function run ``blocks`` blocks at a time along ``in_axes``.

    Checked first (:func:`check`). Each block runs under its own checkpoint inside a scan
    (:func:`remat_kit.policies.tiling.tiled`), so forward and backward hold one block's intermediates.

    Returns:
      ``f(*flat_args) -> list of outputs`` equal to ``jax.core.jaxpr_as_fun(closed)`` up to float rounding.
    """
    out_axes = check(closed, in_axes, blocks)
    length = _length(closed, in_axes)
    size = length // blocks
    fn = block_fn(closed, in_axes, length, size)

    def on_axis_1(pos, *args):
        # tiled's convention: every tiled input and output carries the axis at 1; move ours there and back.
        cut = [jnp.moveaxis(x, 1, a) if a is not None else x for x, a in zip(args, in_axes, strict=True)]
        outs, _ = fn(pos[0, 0], *cut)
        return [jnp.moveaxis(o, a, 1) for o, a in zip(outs, out_axes, strict=True)]

    def run(*args):
        moved = [jnp.moveaxis(x, a, 1) if a is not None else x for x, a in zip(args, in_axes, strict=True)]
        pos = jnp.arange(length, dtype=jnp.int32)[None]
        # The blocks' checkpoints are remat_kit's own (inside apply's block, not a model's that would override it).
        axes = (1, *(1 if a is not None else None for a in in_axes))
        outs = tiled(on_axis_1, blocks, in_axes=axes, policy=own_nothing_saveable)(pos, *moved)
        return [jnp.moveaxis(o, 1, a) for o, a in zip(outs, out_axes, strict=True)]

    return run


# ---- flat programs and attention regions --------------------------------------------------------------


def inline(closed) -> jcore.ClosedJaxpr:
    """``closed`` with its plain calls (``jit``, ``closed_call``, a model's own ``checkpoint``) flattened into one
    list of equations (custom derivatives kept), so a region can be found across function boundaries."""

    def ev(jaxpr, consts, args):
        env = dict(zip(jaxpr.constvars, consts, strict=True)) | dict(zip(jaxpr.invars, args, strict=True))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        for eqn in jaxpr.eqns:
            vals = [read(v) for v in eqn.invars]
            outs = ev(*body_of(eqn), vals) if _kind(eqn) in _PLAIN_CALLS else _bind(eqn, vals)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    return jax.make_jaxpr(lambda *a: ev(closed.jaxpr, closed.consts, a))(*args)


def users_of(eqns) -> dict[Any, list[int]]:
    """Each var -> the indices of the equations that read it."""
    users: dict[Any, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if not isinstance(v, jcore.Literal):
                users.setdefault(v, []).append(i)
    return users


def forward_of(eqns, users: dict[Any, list[int]], start: int) -> set[int]:
    """The indices of ``start`` and every equation that depends on it (:func:`users_of` gives ``users``)."""
    fwd, stack = {start}, [start]
    while stack:
        for v in eqns[stack.pop()].outvars:
            for u in users.get(v, ()):
                if u not in fwd:
                    fwd.add(u)
                    stack.append(u)
    return fwd


@dataclasses.dataclass(frozen=True)
class Region:
    """An attention region of a flat program: the equations it replaces, those it runs per block (they and
    what makes its ``[.., S, .., S]`` inputs, a mask, so that is made per block too), its inputs and outputs,
    the query input's axis."""

    eqns: tuple[int, ...]
    body: tuple[int, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    in_axes: tuple[int | None, ...]
    where: str


def _quadratic(var, length: int) -> bool:
    return sum(1 for d in getattr(var.aval, "shape", ()) if d == length) >= 2


def attention_regions(closed, length: int) -> list[Region]:
    """The ``scores -> softmax -> weighted sum`` regions of a flat program (:func:`inline`) over ``length``
    positions, each checked to be independent along its queries (:func:`check`).

    Raises:
      NotPerPosition: a region whose scores leave it (attention weights returned or reused), or that is not
        per-query on either operand of its scores matmul.
    """
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    users = users_of(eqns)
    starts = [
        i
        for i, e in enumerate(eqns)
        if e.primitive.name == "dot_general"
        and _quadratic(e.outvars[0], length)
        and not any(_quadratic(v, length) for v in e.invars)
    ]
    regions: list[Region] = []
    failed: list[tuple[set[int], NotPerPosition]] = []
    for s in starts:
        fwd = forward_of(eqns, users, s)
        ends = [
            i
            for i in sorted(fwd)
            if i != s
            and eqns[i].primitive.name == "dot_general"
            and not _quadratic(eqns[i].outvars[0], length)
            and any(_quadratic(v, length) for v in eqns[i].invars if not isinstance(v, jcore.Literal))
        ]
        if not ends:
            continue
        back, stack = set(ends), list(ends)
        while stack:
            for v in eqns[stack.pop()].invars:
                i = None if isinstance(v, jcore.Literal) else producer.get(v)
                if i is not None and i in fwd and i not in back:
                    back.add(i)
                    stack.append(i)
        inside = sorted(back | {s})
        try:
            regions.append(_region(closed, inside, s, set(ends), users, producer, length))
        except NotPerPosition as err:
            failed.append((set(inside), err))
    # A projection whose width happens to equal the length (2,048 heads x head_dim at 2,048 positions) starts a
    # region around the real one: keep disjoint regions, the larger first, and refuse a region that is not
    # per-query only where no kept region covers it.
    kept: list[Region] = []
    for r in sorted(regions, key=lambda r: -len(r.eqns)):
        if not any(set(r.eqns) & set(k.eqns) for k in kept):
            kept.append(r)
    for inside, err in failed:
        if not any(inside & set(k.eqns) for k in kept):
            raise err
    return sorted(kept, key=lambda r: r.eqns[0])


def program(eqns, inputs, outputs) -> jcore.ClosedJaxpr:
    """Some equations of a program as a program of their own over ``inputs`` (vars of the program), returning
    ``outputs``; traced anew, so JAX makes it whole (a hand-built Jaxpr lacks the debug info JAX now wants).

    >>> import jax, jax.numpy as jnp
    >>> j = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0).jaxpr
    >>> program(j.eqns[1:], [j.eqns[0].outvars[0]], j.outvars).in_avals[0].shape
    ()
    """

    def fn(*args):
        env = dict(zip(inputs, args, strict=True))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        for eqn in eqns:
            env.update(zip(eqn.outvars, _bind(eqn, [read(v) for v in eqn.invars]), strict=True))
        return [read(v) for v in outputs]

    return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs))


def inputs_of(eqns) -> list[Any]:
    """The vars ``eqns`` read that none of them makes, in the order first read."""
    defined = {v for e in eqns for v in e.outvars}
    inputs: list[Any] = []
    for e in eqns:
        for v in e.invars:
            if not isinstance(v, jcore.Literal) and v not in defined and v not in inputs:
                inputs.append(v)
    return inputs


def _region(closed, inside: list[int], start: int, ends: set[int], users, producer, length: int) -> Region:
    jaxpr, eqns = closed.jaxpr, closed.jaxpr.eqns
    # A mask made outside the region at [.., S, .., S] would be a whole copy per head: its making (iota,
    # compare, broadcast) runs inside, per block, instead; the outer program keeps its own copy if it uses one.
    body, todo = set(inside), [v for v in inputs_of([eqns[i] for i in inside]) if _quadratic(v, length)]
    while todo:
        i = producer.get(todo.pop())
        if i is not None and i not in body:
            body.add(i)
            todo.extend(v for v in eqns[i].invars if not isinstance(v, jcore.Literal) and _quadratic(v, length))
    body = sorted(body)
    inputs = inputs_of([eqns[i] for i in body])
    escaping = [
        v
        for i in inside
        for v in eqns[i].outvars
        if any(u not in inside for u in users.get(v, ())) or v in jaxpr.outvars
    ]
    where = _where(eqns[start])
    for v in escaping:
        if not any(v in eqns[e].outvars for e in ends):
            raise NotPerPosition(f"the attention at {where}: a value of shape {v.aval.shape} leaves its region")
    # The region's inputs (the outer program's constants among them) become the inputs of its own program.
    sub = program([eqns[i] for i in body], inputs, escaping)
    tried = []
    for operand in eqns[start].invars:
        if operand not in inputs:
            continue
        ax = [d for d, n in enumerate(operand.aval.shape) if n == length]
        if len(ax) != 1:
            continue
        in_axes = tuple(ax[0] if v is operand else None for v in inputs)
        try:
            check(sub, in_axes, 2 if length % 2 == 0 else 1)
        except NotPerPosition as e:
            tried.append(str(e))
            continue
        return Region(tuple(inside), tuple(body), tuple(inputs), tuple(escaping), in_axes, where)
    raise NotPerPosition(f"the attention at {where} is not independent along its queries: {'; '.join(tried)}")


def run_regions(closed, regions: Sequence[Region], blocks: int) -> Callable:
    """``closed`` as a function with each region run ``blocks`` query blocks at a time (:func:`blocked`)."""
    jaxpr = closed.jaxpr
    owner = {i: r for r in regions for i in r.eqns}
    runners = {
        id(r): blocked(
            program([jaxpr.eqns[i] for i in r.body], r.inputs, r.outputs),
            r.in_axes,
            blocks,
        )
        for r in regions
    }

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True)) | dict(zip(jaxpr.invars, args, strict=True))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        done: set[int] = set()
        pending = list(range(len(jaxpr.eqns)))
        while pending:
            rest = []
            for i in pending:
                if i in done:
                    continue
                r, eqn = owner.get(i), jaxpr.eqns[i]
                needs = r.inputs if r is not None else [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
                if any(v not in env for v in needs):
                    rest.append(i)
                    continue
                if r is None:
                    env.update(zip(eqn.outvars, _bind(eqn, [read(v) for v in eqn.invars]), strict=True))
                    done.add(i)
                else:
                    env.update(zip(r.outputs, runners[id(r)](*[read(v) for v in r.inputs]), strict=True))
                    done.update(r.eqns)
            if len(rest) == len(pending):
                raise NotPerPosition("the attention regions could not be ordered with the rest of the program")
            pending = rest
        return [read(v) for v in jaxpr.outvars]

    return run
