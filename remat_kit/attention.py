"""Causal multi-head attention with grouped key/value heads, and rotary position embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from remat_kit import names

ATTENTION_KINDS: tuple[str, ...] = ("xla",)


def rope(x, base: float = 10_000.0):
    """Rotary position embedding over the sequence axis.

    Args:
      x: ``[batch, seq, heads, head_dim]`` with an even ``head_dim``.
      base: the RoPE frequency base.

    Returns:
      ``x`` rotated by position, same shape and dtype.
    """
    seq, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [half]
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq[None, :]  # [seq, half]
    sin = jnp.sin(angle)[None, :, None, :]
    cos = jnp.cos(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def causal_bias(seq: int):
    """``[seq, seq]`` float32: 0 where a query may attend, a large negative number elsewhere.

    An additive bias rather than ``jnp.where`` so the backward pass needs no saved mask.
    """
    allowed = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    return jnp.where(allowed, 0.0, 0.5 * jnp.finfo(jnp.float32).min).astype(jnp.float32)


def xla_attention(q, k, v):
    """Causal softmax attention, materializing the ``[b, h, s, s]`` probabilities (tagged).

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k, v: ``[batch, seq, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``.

    Returns:
      The context ``[batch, seq, heads, head_dim]``.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, s, kv, h // kv, d)  # query heads grouped by the kv head they share
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
    scores = scores + causal_bias(s)[None, None, None]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    probs = names.tag(probs.reshape(b, h, s, s), names.ATTN_PROBS).reshape(b, kv, h // kv, s, s)
    context = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return context.reshape(b, s, h, d)
