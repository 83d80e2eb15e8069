"""A language-model loss a chunk of positions at a time, fused: the full logits and their gradient never live.

A model's head turns ``[.., positions, d]`` hidden states into ``[.., positions, vocab]`` logits; at a long
sequence and a large vocabulary those logits (and their gradient, as large again) outweigh every layer's kept
input. :func:`chunked_mean` computes the masked mean cross-entropy ``chunks`` slices of positions at a time and
takes each slice's gradients right there, in the forward pass (a *fused* linear cross-entropy, as
Liger-Kernel's): a slice's logits and their gradient live only while that slice runs, nothing is recomputed,
and the backward pass only scales the gradients it was handed. It keeps the gradients of the blocked inputs
(the hidden states) and of the whole ones (the head's weights), which the backward pass would hold anyway.

How a slice's logits are computed is the caller's (:class:`Chunk`): the built-in model's output projection
(:func:`remat_kit.model.loss.chunked_cross_entropy`), or the traced tail of a model the user installed
(:func:`remat_kit.unedited.head.head_loss`). This module is that one implementation for both.

>>> import jax, jax.numpy as jnp
>>> h, w = jnp.ones((2, 6, 4)), jnp.eye(4, 10)
>>> t, m = jnp.zeros((2, 6), jnp.int32), jnp.ones((2, 6))
>>> spec = Chunk(lambda i, blocked, w: blocked[0] @ w)
>>> plain = jnp.mean(token_losses(h @ w, t))
>>> bool(jnp.allclose(chunked_mean(spec, (h,), w, t, m, 3, axis=1), plain))
True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from remat_kit.units import check_int


def token_losses(logits, labels):
    """Each position's cross-entropy ``logsumexp(logits) - logits[label]``, in float32.

    Args:
      logits: ``[..., vocab]``.
      labels: ``[...]`` integer ids.

    >>> float(token_losses(jnp.zeros((1, 4)), jnp.array([2]))[0]) == float(jnp.log(4.0))
    True
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse - picked


@dataclasses.dataclass(frozen=True)
class Chunk:
    """How one chunk of positions is computed.

    Attributes:
      logits: ``(index, blocked, whole) -> logits``: chunk ``index``'s logits ``[..., size, vocab]`` (the
        positions on the chunked axis, as in ``blocked``) from its slices of the blocked inputs (a tuple) and
        the whole inputs (a pytree, as given).
      frozen: optional, for when no whole input is differentiated: ``(index, blocked, whole, labels, mask, count,
        grad) -> (value, gradients of blocked or None)``, the chunk's summed masked loss divided by ``count``
        (and with ``grad``, its gradient with respect to each blocked input). None: :attr:`logits` under
        autodiff, as when the whole inputs are differentiated.
    """

    logits: Callable
    frozen: Callable | None = None


def chunked_mean(spec: Chunk, blocked: tuple, whole: Any, labels, mask, chunks: int, *, axis: int = 0):
    """The mean of :func:`token_losses` over the positions where ``mask`` is 1, ``chunks`` slices at a time.

    Equal to the plain loss over the full logits (and its gradients) up to float rounding; peak logits
    memory falls to one chunk's. Not differentiable twice.

    Args:
      spec: how a chunk's logits are computed (:class:`Chunk`).
      blocked: a tuple of arrays sliced along ``axis`` (the hidden states), each as long there as ``labels``.
      whole: a pytree of arrays each chunk reads whole (the head's weights).
      labels: integer ids, positions on ``axis``; ``mask``: the same shape, 1 where a position counts.
      chunks: a positive integer dividing the length of ``axis``.
      axis: the positions' axis of ``blocked``, ``labels`` and ``mask``.

    Raises:
      ValueError/TypeError: a bad ``chunks`` or ``axis``, blocked inputs of another length, named.

    >>> h, w, t = jnp.ones((8, 4)), jnp.eye(4, 6), jnp.arange(8) % 6
    >>> spec = Chunk(lambda i, blocked, w: blocked[0] @ w)
    >>> g = jax.grad(lambda h, w: chunked_mean(spec, (h,), w, t, jnp.ones(8), 4), (0, 1))(h, w)
    >>> want = jax.grad(lambda h, w: jnp.mean(token_losses(h @ w, t)), (0, 1))(h, w)
    >>> all(bool(jnp.allclose(a, b)) for a, b in zip(g, want))
    True
    """
    check_int("chunks", chunks)
    check_int("axis", axis, 0)
    if not isinstance(spec, Chunk):
        raise TypeError(f"spec must be a loss_chunks.Chunk, got {spec!r}")
    labels, mask = jnp.asarray(labels), jnp.asarray(mask)
    if labels.shape != mask.shape or labels.ndim <= axis:
        raise ValueError(f"labels {labels.shape} and mask {mask.shape} must share one shape with axis {axis}")
    length = labels.shape[axis]
    for x in blocked:
        if x.ndim <= axis or x.shape[axis] != length:
            raise ValueError(f"a blocked input of shape {x.shape} is not {length} long on axis {axis}")
    if length % chunks:
        raise ValueError(f"chunks={chunks} does not divide the {length} positions")
    size = length // chunks
    # [.., L, ..] -> [K, .., L/K, ..]: the scan's slices (a free reshape when axis is 0).
    split = lambda x: jnp.moveaxis(x.reshape((*x.shape[:axis], chunks, size, *x.shape[axis + 1 :])), axis, 0)
    xs = tuple(split(x) for x in blocked)
    return _fused(spec, xs, whole, split(labels), split(mask.astype(jnp.float32)))


def _value(spec: Chunk, i, b, w, t, m, count):
    return jnp.sum(token_losses(spec.logits(i, b, w), t) * m) / count


def _values(spec: Chunk, b, w, t, m):
    """The mean loss, one chunk at a time, no gradient taken."""
    count = jnp.maximum(jnp.sum(m), 1.0)

    def body(total, xs):
        i, b_c, t_c, m_c = xs
        if spec.frozen is not None:
            return total + spec.frozen(i, b_c, w, t_c, m_c, count, False)[0], None
        return total + _value(spec, i, b_c, w, t_c, m_c, count), None

    index = jnp.arange(t.shape[0], dtype=jnp.int32)
    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (index, b, t, m))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(spec: Chunk, b, w, t, m):
    # Not differentiated (an evaluation): the losses alone, no gradient matmuls.
    return _values(spec, b, w, t, m)


def _fused_fwd(spec: Chunk, b, w, t, m):
    # symbolic_zeros: each primal comes with whether it is differentiated; gradients are taken only for those
    # (a frozen head, a LoRA base's, gets none computed, and :attr:`Chunk.frozen` may read it its own way).
    bv, wv, tv, mv = (jax.tree.map(lambda p: p.value, x) for x in (b, w, t, m))
    b_on = [p.perturbed for p in b]
    w_leaves, w_tree = jax.tree.flatten(w)
    w_on = [p.perturbed for p in w_leaves]
    wv_leaves = [p.value for p in w_leaves]
    count = jnp.maximum(jnp.sum(mv), 1.0)
    index = jnp.arange(tv.shape[0], dtype=jnp.int32)

    if not any(w_on) and spec.frozen is not None:

        def frozen(total, xs):
            i, b_c, t_c, m_c = xs
            value, db = spec.frozen(i, b_c, wv, t_c, m_c, count, any(b_on))
            return total + value, db

        total, db = jax.lax.scan(frozen, jnp.zeros((), jnp.float32), (index, bv, tv, mv))
        db = tuple(d if on else None for d, on in zip(db, b_on, strict=True)) if db is not None else None
        return total, (db, None)

    def body(carry, xs):
        i, b_c, t_c, m_c = xs

        def chunk(b_diff, w_diff):
            # The chunk's loss already divided by the count, so the backward pass's usual cotangent of 1
            # hands these gradients on unchanged (no second rounding).
            it = iter(b_diff)
            b_ = tuple(next(it) if on else x for x, on in zip(b_c, b_on, strict=True))
            it = iter(w_diff)
            w_ = jax.tree.unflatten(w_tree, [next(it) if on else x for x, on in zip(wv_leaves, w_on, strict=True)])
            return _value(spec, i, b_, w_, t_c, m_c, count)

        b_diff = [x for x, on in zip(b_c, b_on, strict=True) if on]
        w_diff = [x for x, on in zip(wv_leaves, w_on, strict=True) if on]
        value, (db, dw) = jax.value_and_grad(chunk, (0, 1))(b_diff, w_diff)
        total, acc = carry
        return (total + value, [a + d.astype(jnp.float32) for a, d in zip(acc, dw, strict=True)]), db

    acc0 = [jnp.zeros(x.shape, jnp.float32) for x, on in zip(wv_leaves, w_on, strict=True) if on]
    (total, acc), db = jax.lax.scan(body, (jnp.zeros((), jnp.float32), acc0), (index, bv, tv, mv))
    it_b, it_w = iter(db), iter(acc)
    db = tuple(next(it_b) if on else None for on in b_on)
    dw = [next(it_w).astype(x.dtype) if on else None for x, on in zip(wv_leaves, w_on, strict=True)]
    # None where a leaf is not differentiated: a symbolic zero, in the whole inputs' own structure.
    return total, (db, jax.tree.unflatten(w_tree, dw))


def _fused_bwd(spec, residuals, g):
    db, dw = residuals
    scale = lambda x: None if x is None or not jnp.issubdtype(x.dtype, jnp.floating) else (x * g).astype(x.dtype)
    db = None if db is None else tuple(scale(x) for x in db)
    return db, jax.tree.map(scale, dw), None, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
