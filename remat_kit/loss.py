"""Next-token cross-entropy, plain or chunked so the full ``[batch, seq, vocab]`` logits never live.

Checkpointing the layers does not shrink the logits: on the 2B-class preset they are ≈ 2 GB in
float32, and their gradient as much again. :func:`chunked_cross_entropy` computes logits and loss
for ``chunks`` slices of the tokens in turn under ``jax.checkpoint``, so the backward pass keeps
only the hidden states and recomputes one chunk's logits at a time. The output matrix enters as
stored (parameter dtype and layout) and is cast inside each chunk, so no compute-dtype copy of it
(1 GB on the 2B preset) is kept either; the price is one cast of it per chunk, forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from remat_kit.units import check_int


def shift_targets(tokens):
    """Targets and mask for next-token prediction: position t predicts token t+1; the last is masked.

    Returns:
      ``(targets [b, s] int32, mask [b, s] float32)``.
    """
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    mask = jnp.ones(tokens.shape, jnp.float32).at[:, -1].set(0.0)
    return targets.astype(jnp.int32), mask


def cross_entropy(logits, targets, mask):
    """Mean cross-entropy over unmasked positions, in float32.

    Args:
      logits: ``[b, s, vocab]``.
      targets: ``[b, s]`` integer ids.
      mask: ``[b, s]``, 1 where the position counts.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((lse - picked) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def chunked_cross_entropy(hidden, w_out, targets, mask, chunks: int, *, vocab_axis: int = 1):
    """:func:`cross_entropy` of ``hidden @ w_out`` computed ``chunks`` token-slices at a time.

    Equal to the plain loss (and its gradients) up to float rounding; peak logits memory falls to
    one chunk's ``[tokens / chunks, vocab]``, and the backward pass keeps only ``hidden`` (padded to
    a multiple of ``chunks``): ``w_out`` is cast to ``hidden``'s dtype inside each chunk, so no
    cast of it is kept.

    Args:
      hidden: ``[b, s, d]`` final hidden states (the logits are computed in their dtype, accumulated
        in float32).
      w_out: the output projection in any dtype: ``[d, vocab]``, or ``[vocab, d]`` with ``vocab_axis=0``
        (a tied embedding, used without a transpose).
      targets, mask: as for :func:`cross_entropy`.
      chunks: how many slices (a positive integer; the token count is padded up to a multiple).
      vocab_axis: which axis of ``w_out`` is the vocabulary, 1 or 0.

    >>> h = jnp.ones((2, 6, 4)); w = jnp.eye(4, 10); t = jnp.zeros((2, 6), jnp.int32); m = jnp.ones((2, 6))
    >>> bool(jnp.allclose(chunked_cross_entropy(h, w, t, m, 5), cross_entropy(h @ w, t, m)))
    True
    >>> bool(jnp.allclose(chunked_cross_entropy(h, w.T, t, m, 5, vocab_axis=0), cross_entropy(h @ w, t, m)))
    True
    """
    check_int("loss chunks", chunks)
    if vocab_axis not in (0, 1) or isinstance(vocab_axis, bool):
        raise ValueError(f"vocab_axis must be 0 ([vocab, d]) or 1 ([d, vocab]), got {vocab_axis!r}")
    b, s, d = hidden.shape
    n = b * s
    size = -(-n // chunks)
    pad = size * chunks - n
    h = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0))).reshape(chunks, size, d)
    t = jnp.pad(targets.reshape(n), (0, pad)).reshape(chunks, size)
    m = jnp.pad(mask.reshape(n).astype(jnp.float32), (0, pad)).reshape(chunks, size)
    spec = "nd,dv->nv" if vocab_axis == 1 else "nd,vd->nv"

    @jax.checkpoint  # keep nothing of a chunk: its logits (and the cast of w) are recomputed in the backward pass
    def chunk_loss(w, h_c, t_c, m_c):
        logits = jnp.einsum(spec, h_c, w.astype(h_c.dtype), preferred_element_type=jnp.float32)  # [size, vocab]
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0]
        return jnp.sum((lse - picked) * m_c)

    def body(total, xs):
        return total + chunk_loss(w_out, *xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h, t, m))
    return total / jnp.maximum(jnp.sum(mask), 1.0)


def lm_loss(model, params, tokens, *, loss_chunks: int = 0, deterministic: bool = True, rngs=None):
    """Next-token loss of a :class:`remat_kit.model.Transformer` on ``tokens [b, s]``.

    Args:
      model: the Transformer (its policy decides the layers' remat).
      params: its ``params`` collection (the inner dict, not ``{"params": ...}``).
      tokens: ``[batch, seq]`` integer ids.
      loss_chunks: 0 for the plain loss over full logits; k > 0 for :func:`chunked_cross_entropy`.
      deterministic: False to apply dropout (then pass ``rngs={"dropout": key}``).
      rngs: Flax rngs for ``apply``.
    """
    targets, mask = shift_targets(tokens)
    variables = {"params": params}
    kwargs = {"deterministic": deterministic, "rngs": rngs or {}}
    if loss_chunks:
        hidden, w_out, vocab_axis = model.apply(variables, tokens, method=model.features, **kwargs)
        return chunked_cross_entropy(hidden, w_out, targets, mask, loss_chunks, vocab_axis=vocab_axis)
    return cross_entropy(model.apply(variables, tokens, **kwargs), targets, mask)
