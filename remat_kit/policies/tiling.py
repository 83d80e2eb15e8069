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
(which exists anyway), not a stacked copy of the slices.

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

        body_fn = jax.checkpoint(one, policy=jax_policy, prevent_cse=False)  # under a scan: no CSE to prevent
        shapes = jax.eval_shape(one, whole, jnp.int32(0))
        for leaf in jax.tree.leaves(shapes):
            if leaf.ndim <= axis or leaf.shape[axis] != size:
                raise ValueError(
                    f"tiled: fn must return arrays with the sequence on axis {axis}; got shape {leaf.shape} "
                    f"for a tile of {size} positions"
                )
        out0 = jax.tree.map(lambda s: jnp.zeros((*s.shape[:axis], tiles, *s.shape[axis:]), s.dtype), shapes)

        def body(out, i):
            y = body_fn(whole, i)
            put = lambda o, t: jax.lax.dynamic_update_index_in_dim(o, t.astype(o.dtype), i, axis)
            return jax.tree.map(put, out, y), None

        out, _ = jax.lax.scan(body, out0, jnp.arange(tiles))
        merge = lambda o: o.reshape((*o.shape[:axis], length, *o.shape[axis + 2 :]))
        return jax.tree.map(merge, out)

    return run


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
