"""Causal attention with grouped key/value heads, three implementations, and rotary embeddings.

``TransformerConfig.attention`` picks one of :data:`ATTENTION_KINDS`:

* ``"xla"`` materializes the ``[b, h, s, s]`` probabilities (tagged ``attn_probs``): simple, and what
  a selective policy can keep or recompute piece by piece, but O(s²) memory per layer.
* ``"chunked"`` is flash-style attention in pure JAX: queries and keys/values in blocks of
  ``block`` positions, an online softmax over key blocks, and a ``jax.custom_vjp`` whose backward
  recomputes each block's probabilities from the saved per-query logsumexp. Neither pass keeps a
  ``seq × seq`` tensor; the backward keeps q, k, v, the output and the logsumexp. Fully masked
  (future) key blocks are skipped, which halves the work of causal attention. Runs on any backend.
* ``"cudnn"`` is ``jax.nn.dot_product_attention(implementation="cudnn")``: fused flash attention on
  NVIDIA GPUs, float16/bfloat16 only.
* ``"auto"`` resolves per backend when the model is traced: cuDNN on a GPU when the compute dtype
  and head size allow it, ``chunked`` everywhere else (see :func:`resolve`).

>>> import jax.numpy as jnp
>>> q = k = v = jnp.ones((1, 10, 2, 8))
>>> attend(q, k, v, kind="chunked", block=4).shape
(1, 10, 2, 8)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from remat_kit import names

ATTENTION_KINDS: tuple[str, ...] = ("auto", "xla", "chunked", "cudnn")

#: Block size (positions) of ``chunked`` attention per backend when the config leaves it unset.
#: CPU: 128 measured fastest (fwd+bwd, b=4, s=1024, h=8, d=64 on 2 cores: 64 → 0.52 s, 128 → 0.35 s,
#: 256 → 0.37 s, 512 → 0.52 s; ``xla`` 1.3 s); accelerators want larger tiles.
DEFAULT_BLOCKS: dict[str, int] = {"cpu": 128}
DEFAULT_BLOCK = 512

#: The block grows beyond the requested size when a sequence would need more blocks than this:
#: the blocks are unrolled at trace time, and compile time grows with their square.
MAX_BLOCKS = 16

#: Compute dtypes cuDNN's flash attention accepts.
CUDNN_DTYPES: tuple[str, ...] = ("bfloat16", "float16")

# A large negative score for masked positions: finite, so exp() underflows to 0 without NaNs.
_MASKED = 0.5 * float(jnp.finfo(jnp.float32).min)


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
    return jnp.where(allowed, 0.0, _MASKED).astype(jnp.float32)


# ---- choosing an implementation ---------------------------------------------------------------------


def check_kind(kind: str, dtype: str, head_dim: int) -> None:
    """Raise a clear error for a kind that cannot run with this compute dtype and head size.

    Backend-independent, so a config can check it when built; :func:`resolve` adds the backend.

    Raises:
      ValueError: an unknown kind, or ``cudnn`` with float32 or a head size cuDNN does not take.

    >>> check_kind("cudnn", "float32", 64)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: attention='cudnn': cuDNN flash attention takes compute dtype bfloat16 or float16, got float32; ...
    """
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention={kind!r}; allowed: {', '.join(ATTENTION_KINDS)}")
    reason = _cudnn_unsupported(dtype, head_dim) if kind == "cudnn" else None
    if reason:
        raise ValueError(f"attention='cudnn': {reason}; use attention='chunked' or 'auto'")


def _cudnn_unsupported(dtype: str, head_dim: int) -> str | None:
    if dtype not in CUDNN_DTYPES:
        return f"cuDNN flash attention takes compute dtype {' or '.join(CUDNN_DTYPES)}, got {dtype}"
    if head_dim % 8 or head_dim > 128:
        # 256 on Hopper and later; 128 is safe on every GPU cuDNN supports.
        return f"cuDNN flash attention needs head_dim a multiple of 8 and <= 128, got {head_dim}"
    return None


def _has_cuda() -> bool:
    # ROCm also reports the platform "gpu", but has no cuDNN.
    try:
        return "cuda" in jax.devices()[0].client.platform_version.lower()
    except Exception:  # a backend without platform_version cannot run cuDNN
        return False


def resolve(kind: str, dtype: str, head_dim: int, platform: str | None = None) -> str:
    """The implementation ``kind`` stands for on a backend; ``"auto"`` becomes a concrete kind.

    ``auto`` picks ``cudnn`` on a CUDA GPU when the dtype and head size allow it, else ``chunked``:
    on CPU ``chunked`` is both smaller (no ``[b, h, s, s]`` residual) and faster than ``xla``, as
    it skips the masked half of causal attention (fwd+bwd at b=4, s=1024, h=8, d=64 on 2 cores:
    0.35 s against 1.3 s; ``benchmarks/results/peer_hf*`` has whole-step figures).

    Args:
      kind: one of :data:`ATTENTION_KINDS`.
      dtype: the compute dtype name.
      head_dim: size of one head.
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``; default: the live backend, ``jax.default_backend()``.

    Raises:
      ValueError: as :func:`check_kind`, or ``cudnn`` on a backend other than a CUDA GPU.

    >>> resolve("auto", "float32", 64, platform="cpu"), resolve("auto", "bfloat16", 64, platform="gpu")
    ('chunked', 'cudnn')
    """
    check_kind(kind, dtype, head_dim)
    live = platform is None or platform == jax.default_backend()
    platform = platform or jax.default_backend()
    cuda = platform == "gpu" and (not live or _has_cuda())
    if kind == "cudnn" and not cuda:
        raise ValueError(
            f"attention='cudnn' needs an NVIDIA GPU, but the JAX backend is {platform!r}; "
            "use attention='chunked' (any backend) or 'auto' (cuDNN on a GPU, chunked elsewhere)"
        )
    if kind != "auto":
        return kind
    return "cudnn" if cuda and _cudnn_unsupported(dtype, head_dim) is None else "chunked"


def default_block(platform: str | None = None) -> int:
    """The ``chunked`` block size for a backend (default: the live one).

    >>> default_block("cpu"), default_block("tpu")
    (128, 512)
    """
    return DEFAULT_BLOCKS.get(platform or jax.default_backend(), DEFAULT_BLOCK)


def attend(q, k, v, *, kind: str = "auto", block: int | None = None, flat: bool = False):
    """Causal attention by ``kind``; the output (and, for ``chunked``, its logsumexp) is tagged ``context``.

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k, v: ``[batch, seq, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``.
      kind: one of :data:`ATTENTION_KINDS`.
      block: block size of ``chunked`` attention; None for :func:`default_block`.
      flat: return ``[batch, seq, heads * head_dim]`` (see :func:`chunked_attention`).

    Returns:
      The context ``[batch, seq, heads, head_dim]`` (or flat) in ``q``'s dtype.
    """
    _check_qkv(q, k, v)
    block = default_block() if block is None else block
    kind = resolve(kind, jnp.dtype(q.dtype).name, q.shape[-1])
    if kind == "chunked":
        return chunked_attention(q, k, v, block=block, flat=flat)
    out = cudnn_attention(q, k, v) if kind == "cudnn" else xla_attention(q, k, v)
    b, s, h, d = q.shape
    return names.tag(out.reshape(b, s, h * d) if flat else out, names.CONTEXT)


def _check_qkv(q, k, v) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim], got shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    b, s, h, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"k/v shape {k.shape} does not match q shape {q.shape} in batch, seq or head_dim")
    if h % k.shape[2]:
        raise ValueError(f"query heads {h} must be a multiple of key/value heads {k.shape[2]}")


# ---- xla: the reference ---------------------------------------------------------------------------------


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


# ---- cudnn -------------------------------------------------------------------------------------------------


def cudnn_attention(q, k, v):
    """Causal attention by cuDNN's fused flash kernel (NVIDIA GPUs, float16/bfloat16).

    Grouped key/value heads are passed through as is: ``jax.nn.dot_product_attention`` takes
    ``k``/``v`` with fewer heads than ``q``. cuDNN keeps its own residuals (output and softmax
    statistics) inside its ``custom_vjp``; a policy that does not keep everything recomputes the
    cuDNN forward in the backward pass.

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k, v: ``[batch, seq, kv_heads, head_dim]``.
    """
    resolve("cudnn", jnp.dtype(q.dtype).name, q.shape[-1])
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


# ---- chunked: flash-style attention in pure JAX -------------------------------------------------------------


def chunked_attention(q, k, v, *, block: int = DEFAULT_BLOCK, flat: bool = False):
    """Causal flash-style attention that never holds a ``seq × seq`` tensor.

    Queries and keys/values are split into blocks of ``block`` positions (the last may be shorter);
    each query block runs an online softmax over the key blocks at or before it, so fully masked
    key blocks cost nothing. The backward pass (a ``jax.custom_vjp``) keeps q, k, v, the output and
    the per-query logsumexp, and recomputes each block's probabilities. The output and the
    logsumexp carry the ``context`` tag, so a policy that keeps ``context`` avoids re-running the
    forward in the backward pass.

    The blocks are unrolled at trace time, (seq / block)² / 2 block pairs per pass; so that compile
    time stays bounded, a sequence longer than :data:`MAX_BLOCKS` blocks uses blocks of
    ``ceil(seq / MAX_BLOCKS)`` instead.

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k, v: ``[batch, seq, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``.
      block: block size in positions, a positive integer.
      flat: return ``[batch, seq, heads * head_dim]``, the very array the backward pass keeps: a
        caller that feeds it to the out projection then keeps it once, not twice (a reshape of it
        would be a second residual).

    Returns:
      The context ``[batch, seq, heads, head_dim]`` (or flat) in ``q``'s dtype.
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"attention block must be a positive integer, got {block!r}")
    _check_qkv(q, k, v)
    out = _flash(q, k, v, block)
    return out if flat else out.reshape(q.shape)


def _spans(seq: int, block: int) -> list[tuple[int, int]]:
    block = max(block, -(-seq // MAX_BLOCKS))
    return [(start, min(start + block, seq)) for start in range(0, seq, block)]


def _block_scores(q_blk, k_blk, q0: int, k0: int, scale: float):
    """Scaled, causally masked scores ``[b, kv, g, bq, bk]`` (float32) of one block pair."""
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    bq, bk = q_blk.shape[1], k_blk.shape[1]
    if k0 + bk - 1 <= q0:  # every key of the block precedes every query: nothing to mask
        return scores
    allowed = (q0 + jnp.arange(bq))[:, None] >= (k0 + jnp.arange(bk))[None, :]
    return jnp.where(allowed, scores, _MASKED)


def _forward(q, k, v, block: int):
    """Returns ``(out [b, s, h * d], lse [b, kv, g, s] float32)``."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    scale = 1.0 / float(d) ** 0.5
    qg = q.reshape(b, s, kv, g, d)
    spans = _spans(s, block)
    outs, lses = [], []
    for q0, q1 in spans:
        q_blk = qg[:, q0:q1]
        m = total = acc = None
        for k0, k1 in spans:
            if k0 >= q1:  # the whole key block is in the future of every query
                break
            scores = _block_scores(q_blk, k[:, k0:k1], q0, k0, scale)
            block_max = jnp.max(scores, axis=-1)
            m_new = block_max if m is None else jnp.maximum(m, block_max)
            p = jnp.exp(scores - m_new[..., None])
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v[:, k0:k1], preferred_element_type=jnp.float32)
            if m is None:
                total, acc = jnp.sum(p, axis=-1), pv
            else:
                corr = jnp.exp(m - m_new)
                total = total * corr + jnp.sum(p, axis=-1)
                acc = acc * corr[..., None] + pv
            m = m_new
        outs.append(acc / total[..., None])  # [b, kv, g, bq, d]
        lses.append(m + jnp.log(total))
    out = jnp.concatenate(outs, axis=3)  # [b, kv, g, s, d]
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h * d).astype(q.dtype)  # flat: see chunked_attention
    return out, jnp.concatenate(lses, axis=3)


def _tagged_forward(q, k, v, block: int):
    # Tag inside the custom_vjp so the tagged values are the very residuals the backward reads.
    return names.tag(_forward(q, k, v, block), names.CONTEXT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, block: int):
    return _tagged_forward(q, k, v, block)[0]


def _flash_fwd(q, k, v, block: int):
    out, lse = _tagged_forward(q, k, v, block)
    return out, (q, k, v, out, lse)


def _flash_bwd(block: int, residuals, d_out):
    q, k, v, out, lse = residuals
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    scale = 1.0 / float(d) ** 0.5
    qg = q.reshape(b, s, kv, g, d)
    dog = d_out.reshape(b, s, kv, g, d)
    # D_i = rowsum(dO ∘ O): the softmax backward's correction term, [b, kv, g, s].
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", dog.astype(jnp.float32), out.reshape(b, s, kv, g, d).astype(jnp.float32))
    spans = _spans(s, block)
    dq_blocks = []
    dk_acc: list = [None] * len(spans)
    dv_acc: list = [None] * len(spans)
    for q0, q1 in spans:
        q_blk, do_blk = qg[:, q0:q1], dog[:, q0:q1]
        lse_blk, delta_blk = lse[..., q0:q1, None], delta[..., q0:q1, None]
        dq = None
        for j, (k0, k1) in enumerate(spans):
            if k0 >= q1:
                break
            k_blk, v_blk = k[:, k0:k1], v[:, k0:k1]
            p = jnp.exp(_block_scores(q_blk, k_blk, q0, k0, scale) - lse_blk)  # [b, kv, g, bq, bk]
            dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(v.dtype), do_blk, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_blk) * scale).astype(q.dtype)
            dq_j = jnp.einsum("bkgqs,bskd->bqkgd", ds, k_blk, preferred_element_type=jnp.float32)
            dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q_blk, preferred_element_type=jnp.float32)
            dq = dq_j if dq is None else dq + dq_j
            dk_acc[j] = dk if dk_acc[j] is None else dk_acc[j] + dk
            dv_acc[j] = dv if dv_acc[j] is None else dv_acc[j] + dv
        dq_blocks.append(dq)
    dq = jnp.concatenate(dq_blocks, axis=1).reshape(b, s, h, d).astype(q.dtype)
    dk = jnp.concatenate(dk_acc, axis=1).astype(k.dtype)
    dv = jnp.concatenate(dv_acc, axis=1).astype(v.dtype)
    return dq, dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)
