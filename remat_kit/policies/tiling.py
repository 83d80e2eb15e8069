"""Sequence tiles: run a per-token function over the sequence in K tiles, each under its own checkpoint.

Rematerializing a block keeps only its input, but the recompute itself holds the block's whole-sequence
intermediates (an MLP's ``[tokens, d_ff]`` gate, up and product, and their gradients) while that layer runs
backward: at long sequences that working set, not what is kept, decides what fits. :func:`tiled` runs a
per-token function ``K`` sequence slices at a time under a scan, each slice under its own ``jax.checkpoint``,
so forward and backward alike hold one slice's intermediates at a time (the MLP tiling of Unsloth and of
Arctic long-sequence training). The gradients are the untiled function's, up to float rounding.

What can be tiled: any function whose output at a position depends only on its inputs at that position
(norms, projections, MLPs, residual adds, rotary embeddings once given their offsets). What cannot:
attention, which mixes positions (a query reads every earlier key), and anything normalizing over the
sequence. Attention's memory is handled apart, by chunked (flash-style) attention, which already never
holds an ``[s, s]`` tensor; its whole-sequence q, k, v and context remain, as attention needs them whole.

The tiles run under a scan, not a Python loop: XLA:CPU's CSE merges an unrolled recompute with the
forward pass (and so would drop the savings); a scan's body survives. Each tile's slice is cut inside its
checkpoint, from the whole input the scan closes over, so what the backward pass keeps is that input
(which exists anyway), not a stacked copy of the slices. Tiles that keep nothing (``full``, or ``offload``
of names they do not emit) take their own backward pass (:func:`_tiles_in_place`): each tile recomputed and
its input gradient written in place, over the output gradient's buffer where a tile of each is the same
bytes, with no whole-size zero buffer added to per tile.

>>> import jax, jax.numpy as jnp
>>> w = jnp.ones((4, 8))
>>> mlp = lambda x: jnp.tanh(x @ w)
>>> x = jnp.arange(2 * 6 * 4, dtype=jnp.float32).reshape(2, 6, 4) / 48
>>> bool(jnp.allclose(tiled(mlp, 3)(x), mlp(x)))
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from remat_kit import _jax_internals
from remat_kit import names as _names
from remat_kit.policies import words
from remat_kit.units import check_int


def check_tiles(tiles: Any, length: int | None = None, *, what: str = "tiles") -> int:
    """``tiles`` as an int once it is a positive integer that divides ``length`` (when given).

    Raises:
      TypeError/ValueError: not a positive integer, or it does not divide ``length``; one line naming both.

    >>> check_tiles(4, 1024)
    4
    """
    check_int(what, tiles, 1)
    if length is not None and length % tiles:
        divisors = [k for k in range(2, min(length, 64) + 1) if length % k == 0][:8]
        raise ValueError(
            f"{what}={tiles} does not divide the sequence length {length}; divisors of {length}: "
            f"{', '.join(map(str, divisors)) or 'none but 1'}"
        )
    return tiles


def _jax_policy(policy: Any) -> Callable | None:
    """A ``jax.checkpoint`` policy from a remat_kit Policy (its :attr:`jax_policy`), a JAX policy, or None
    (keep nothing but the tile's inputs)."""
    if policy is None:
        return jax.checkpoint_policies.nothing_saveable
    if hasattr(policy, "jax_policy"):
        return policy.jax_policy
    if callable(policy):
        return policy
    raise TypeError(f"policy must be a remat_kit Policy, a jax.checkpoint policy or None, got {policy!r}")


def tiled(
    fn: Callable,
    tiles: int,
    *,
    axis: int = 1,
    in_axes: int | Sequence[int | None] | None = None,
    policy: Any = None,
) -> Callable:
    """``fn`` run over ``tiles`` slices of the sequence axis, one at a time, each under its own checkpoint.

    Args:
      fn: a per-token function: position i of each output depends only on position i of the tiled inputs
        (see the module docstring for what cannot be tiled). Its outputs (a pytree of arrays) carry the
        sequence on ``axis`` too.
      tiles: the number of slices K; must divide the sequence length (checked when called, before tracing
        ``fn``). 1 calls ``fn`` once, unchanged.
      axis: the sequence axis of the tiled inputs and of every output.
      in_axes: per positional argument, ``axis`` (tiled) or None (passed whole: weights, constants); one
        value for all. Default: every argument tiled.
      policy: what each tile's checkpoint keeps for the backward pass: None (nothing but its inputs), a
        remat_kit Policy (its ``jax_policy``, so tags it saves are saved per tile) or a ``jax.checkpoint``
        policy.

    Returns:
      A function of the same arguments as ``fn`` returning what ``fn`` returns on the whole sequence.

    Raises:
      ValueError/TypeError: bad ``tiles``/``axis``/``in_axes``, at once; tiles that do not divide the
        sequence, or tiled inputs of different lengths, when called.

    >>> import jax, jax.numpy as jnp
    >>> w = jnp.full((4, 4), 0.1)
    >>> f = lambda x, w: jnp.sum(jnp.sin(x @ w) ** 2)
    >>> x = jnp.ones((2, 8, 4))
    >>> g1 = jax.grad(lambda x: f(x, w))(x)
    >>> g4 = jax.grad(lambda x: jnp.sum(tiled(lambda x, w: jnp.sin(x @ w) ** 2, 4, in_axes=(1, None))(x, w)))(x)
    >>> bool(jnp.allclose(g1, g4, rtol=1e-5))
    True
    """
    check_tiles(tiles)
    check_int("axis", axis, 0)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    jax_policy = _jax_policy(policy)

    def run(*args):
        axes = _axes(in_axes, len(args), axis)
        lengths = {a.shape[axis] for arg, ax in zip(args, axes, strict=True) if ax is not None for a in _leaves(arg)}
        if not lengths:
            raise ValueError("tiled: no argument is tiled (in_axes names none); pass the sequence as an argument")
        if len(lengths) > 1:
            raise ValueError(f"tiled: the tiled inputs have different lengths on axis {axis}: {sorted(lengths)}")
        (length,) = lengths
        check_tiles(tiles, length)
        if tiles == 1:
            return fn(*args)
        size = length // tiles
        # [..., s, ...] -> [..., K, s/K, ...]: a free reshape (no transpose); a tile is an index on axis.
        split = lambda a: a.reshape((*a.shape[:axis], tiles, size, *a.shape[axis + 1 :]))
        whole = tuple(jax.tree.map(split, a) if ax is not None else a for a, ax in zip(args, axes, strict=True))

        def one(whole, i):
            # The slice is cut inside the checkpoint: what it keeps is the whole input, not a copy of the slice.
            cut = lambda a: _cut(a, i, axis, tiles)
            tile = [jax.tree.map(cut, a) if ax is not None else a for a, ax in zip(whole, axes, strict=True)]
            return fn(*tile)

        shapes = jax.eval_shape(one, whole, jnp.int32(0))
        for leaf in jax.tree.leaves(shapes):
            if leaf.ndim <= axis or leaf.shape[axis] != size:
                raise ValueError(
                    f"tiled: fn must return arrays with the sequence on axis {axis}; got shape {leaf.shape} "
                    f"for a tile of {size} positions"
                )
        merge = lambda o: o.reshape((*o.shape[:axis], length, *o.shape[axis + 2 :]))
        if _keeps_nothing(policy, jax_policy, one, whole):
            return jax.tree.map(merge, _tiles_in_place(fn, tiles, axis, axes, whole))
        body_fn = jax.checkpoint(one, policy=jax_policy, prevent_cse=False)  # under a scan: no CSE to prevent
        out0 = jax.tree.map(lambda s: jnp.zeros((*s.shape[:axis], tiles, *s.shape[axis:]), s.dtype), shapes)

        def body(out, i):
            y = body_fn(whole, i)
            put = lambda o, t: jax.lax.dynamic_update_index_in_dim(o, t.astype(o.dtype), i, axis)
            return jax.tree.map(put, out, y), None

        out, _ = jax.lax.scan(body, out0, jnp.arange(tiles))
        return jax.tree.map(merge, out)

    return run


def _keeps_nothing(policy: Any, jax_policy: Callable, one: Callable, whole) -> bool:
    """Whether a tile's checkpoint keeps nothing but its inputs: ``policy`` None, a policy that saves nothing
    (``full``), or one whose names (``offload``'s layer input) the tile does not emit."""
    if policy is None or jax_policy is jax.checkpoint_policies.nothing_saveable:
        return True
    if getattr(policy, "kind", None) not in ("offload", "selective"):
        return False
    emitted = _jax_internals.emitted_tags(one, whole, jnp.int32(0))
    return not emitted & set(_names.spellings(policy.tags))


def _tiles_in_place(fn: Callable, tiles: int, axis: int, axes: tuple, whole: tuple):
    """``fn`` over the tiles, stacked ``[..., tiles, size, ...]``, with its own backward pass (for tiles that keep
    nothing): each tile is recomputed and its input gradients are written into one buffer per tiled input, in place.

    Under JAX's transpose of the scan, the gradient of an input the scan closes over is a whole-size carry that
    every tile adds a zero-padded slice to, started from a zero buffer that XLA shares between loops (and so
    copies and keeps alive): on the 2B step compiled for an H100, 8 kB per position beyond the gradients. Here a
    tiled input's gradient takes over an output gradient's buffer where a tile of each is the same bytes (a tile
    reads its output gradient before it writes its input gradient there), else it gets a buffer of its own.
    """
    leaves, tree = jax.tree.flatten(whole)
    mask = tuple(ax is not None for a, ax in zip(whole, axes, strict=True) for _ in jax.tree.leaves(a))
    call = lambda *t: fn(*jax.tree.unflatten(tree, list(t)))
    converted, consts = _jax_internals.closure_convert_all(call, *_tile(leaves, mask, jnp.int32(0), axis, tiles))
    return _in_place(converted, tiles, axis, mask, len(leaves), *leaves, *consts)


def _tile(leaves, mask, i, axis: int, tiles: int) -> list:
    """Tile ``i`` of the tiled leaves (``mask``), the others whole."""
    return [_cut(a, i, axis, tiles) if tiled else a for a, tiled in zip(leaves, mask, strict=True)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _in_place(fn, tiles, axis, mask, n, *leaves_consts):
    leaves, consts = leaves_consts[:n], leaves_consts[n:]
    shapes = jax.eval_shape(lambda *a: fn(*_tile(a[:n], mask, 0, axis, tiles), *a[n:]), *leaves_consts)
    out0 = jax.tree.map(lambda s: jnp.zeros((*s.shape[:axis], tiles, *s.shape[axis:]), s.dtype), shapes)

    def body(out, i):
        y = fn(*_tile(leaves, mask, i, axis, tiles), *consts)
        put = lambda o, t: jax.lax.dynamic_update_index_in_dim(o, t.astype(o.dtype), i, axis)
        return jax.tree.map(put, out, y), None

    return jax.lax.scan(body, out0, jnp.arange(tiles))[0]


def _in_place_fwd(fn, tiles, axis, mask, n, *primals):
    # Symbolic zeros: only what the caller differentiates is differentiated here (a frozen NF4 base's scales may
    # be closed over by a custom_vjp inside fn, which JAX refuses to differentiate); the indices of those inputs
    # travel as the residuals' structure (dictionary keys), which is static.
    values = [p.value for p in primals]
    diff = {str(k): None for k, p in enumerate(primals) if p.perturbed and jnp.issubdtype(p.value.dtype, jnp.inexact)}
    return _in_place(fn, tiles, axis, mask, n, *values), (values, diff)


def _in_place_bwd(fn, tiles, axis, mask, n, residuals, g):
    values, diff = residuals
    diff = sorted(int(k) for k in diff)
    g_leaves, g_tree = jax.tree.flatten(jax.tree.map(_materialize, g, is_leaf=_is_symbolic_zero))
    tiled = [k for k in diff if k < n and mask[k]]
    summed = [k for k in diff if not (k < n and mask[k])]
    # A tiled input's gradient claims an output gradient whose tile is the same bytes: the rows before the tile
    # axis alike, as many elements of one dtype per tile (reshaped, row-major); each is claimed once.
    fits = lambda o, a: o.dtype == a.dtype and o.shape[: axis + 1] == a.shape[: axis + 1] and o.size == a.size
    owner, free = {}, list(range(len(g_leaves)))
    for k in tiled:
        j = next((j for j in free if fits(g_leaves[j], values[k])), None)
        if j is not None:
            owner[j] = k
            free.remove(j)
    claimed = {k: j for j, k in owner.items()}
    own = lambda k: g_leaves[claimed[k]].reshape(values[k].shape) if k in claimed else jnp.zeros_like(values[k])
    bufs0 = [own(k) for k in tiled]
    sums0 = [jnp.zeros_like(values[k]) for k in summed]
    at = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, axis, keepdims=False)

    def body(carry, i):
        bufs, sums = carry
        slot = dict(zip(tiled, bufs, strict=True))
        g_i = [
            at(slot[owner[j]], i).reshape(_drop(g.shape, axis)) if j in owner else at(g, i)
            for j, g in enumerate(g_leaves)
        ]
        args = _tile(values[:n], mask, i, axis, tiles) + list(values[n:])

        def f(*d):
            full = list(args)
            for k, a in zip(diff, d, strict=True):
                full[k] = a
            return fn(*full)

        _, vjp = jax.vjp(f, *(args[k] for k in diff))
        grads = dict(zip(diff, vjp(jax.tree.unflatten(g_tree, g_i)), strict=True))
        put = lambda buf, d: jax.lax.dynamic_update_index_in_dim(buf, d.astype(buf.dtype), i, axis)
        bufs = [put(b, grads[k]) for b, k in zip(bufs, tiled, strict=True)]
        sums = [s + grads[k] for s, k in zip(sums, summed, strict=True)]
        return (bufs, sums), None

    (bufs, sums), _ = jax.lax.scan(body, (bufs0, sums0), jnp.arange(tiles), reverse=True)
    out = [zero_cotangent(a) for a in values]
    for k, d in [*zip(tiled, bufs, strict=True), *zip(summed, sums, strict=True)]:
        out[k] = d
    return tuple(out)


_in_place.defvjp(_in_place_fwd, _in_place_bwd, symbolic_zeros=True)


def _is_symbolic_zero(x) -> bool:
    return isinstance(x, jax.custom_derivatives.SymbolicZero)


def _materialize(g):
    return jnp.zeros(g.aval.shape, g.aval.dtype) if _is_symbolic_zero(g) else g


def _drop(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1 :]


def zero_cotangent(a):
    """The cotangent of an input no gradient reaches: zeros of a floating input, ``float0`` zeros of an
    integer (or key) one, as ``jax.custom_vjp`` rules must return."""
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)


def _cut(a, i, axis: int, tiles: int):
    """Tile ``i`` of ``a`` (split as ``[..., tiles, size, ...]`` on ``axis``); a 16-bit float array is read
    through its words (:mod:`remat_kit.policies.words`), so XLA:CPU makes no whole float32 copy of it."""
    if words.packable(a):
        return _cut_words(a, i, axis, tiles)
    return jax.lax.dynamic_index_in_dim(a, i, axis, keepdims=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cut_words(a, i, axis: int, tiles: int):
    # The words are integers, so the cut is differentiated here: its gradient is the plain slice's.
    return words.at(words.pack(a), i, 1, axis, a.dtype).squeeze(axis)


def _cut_words_fwd(a, i, axis, tiles):
    return _cut_words(a, i, axis, tiles), i


def _cut_words_bwd(axis, tiles, i, g):
    whole = jnp.zeros((*g.shape[:axis], tiles, *g.shape[axis:]), g.dtype)
    return jax.lax.dynamic_update_index_in_dim(whole, g, i, axis), None


_cut_words.defvjp(_cut_words_fwd, _cut_words_bwd)


def _leaves(tree) -> list:
    return jax.tree.leaves(tree)


def _axes(in_axes, nargs: int, axis: int) -> tuple[int | None, ...]:
    if in_axes is None:
        return (axis,) * nargs
    if isinstance(in_axes, int) and not isinstance(in_axes, bool):
        in_axes = (in_axes,) * nargs
    in_axes = tuple(in_axes)
    if len(in_axes) != nargs:
        raise ValueError(f"tiled: in_axes has {len(in_axes)} entries for {nargs} arguments")
    bad = [a for a in in_axes if a is not None and a != axis]
    if bad:
        raise ValueError(f"tiled: in_axes entries must be axis={axis} (tiled) or None (whole), got {list(in_axes)}")
    return in_axes
