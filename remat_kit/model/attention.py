"""Causal attention with grouped key/value heads, three implementations, and rotary embeddings.

The three implementations share their checks and the backend choice (``auto``); chunked
attention's forward/backward ``custom_vjp`` is most of the module.

``TransformerConfig.attention`` picks one of :data:`ATTENTION_KINDS`:

* ``"xla"`` materializes the ``[b, h, s, s]`` probabilities (tagged ``attn_probs``): simple, and what
  a selective policy can keep or recompute piece by piece, but O(s²) memory per layer.
* ``"chunked"`` is flash-style attention in pure JAX: queries and keys/values in blocks of
  ``block`` positions, an online softmax over key blocks, and a ``jax.custom_vjp`` whose backward
  recomputes each block's probabilities from the saved per-query logsumexp. Neither pass keeps a
  ``seq × seq`` tensor; the backward keeps q, k, v, the output and the logsumexp. Each pass is one
  ``lax.scan`` over the causal block pairs only: fully masked (future) key blocks are skipped, which
  halves the work of causal attention, and compile time does not grow with the sequence. Runs on
  any backend.
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
import itertools

import jax
import jax.numpy as jnp

from remat_kit import names
from remat_kit import target as target_lib
from remat_kit.constants import ATTENTION_KINDS
from remat_kit.policies import words
from remat_kit.units import check_int

#: Block size (positions) of ``chunked`` attention per backend when the config leaves it unset.
#: CPU: 128 measured fastest (fwd+bwd, b=4, s=1024, h=8, d=64 on 2 cores: 64 → 0.52 s, 128 → 0.35 s,
#: 256 → 0.37 s, 512 → 0.52 s; ``xla`` 1.3 s), measured when the blocks were unrolled; the scan over
#: block pairs that replaced them ran as fast or faster side by side (on a loaded machine); re-measured
#: interleaved after the head-major layout (s=1024, CPU time: 64 → 0.53 s, 128 → 0.49 s, 256 → 0.50 s;
#: ``benchmarks/results/profile_notes.md``), and after the chains, the whole step under ``full`` at
#: benchmarks/peer_hf.py's shape: 256 ran 1.01x of 128's time; accelerators want larger tiles.
DEFAULT_BLOCKS: dict[str, int] = {"cpu": 128}
DEFAULT_BLOCK = 512
#: Independent chains ``chunked`` attention is cut into per backend (see :func:`default_chains`).
DEFAULT_CHAINS: dict[str, int] = {"cpu": 2}

#: Compute dtypes cuDNN's flash attention accepts.
CUDNN_DTYPES: tuple[str, ...] = ("bfloat16", "float16")

# A large negative score for masked positions: finite, so exp() underflows to 0 without NaNs.
_MASKED = 0.5 * float(jnp.finfo(jnp.float32).min)


def _rotate(x, base: float, sign: float, positions=None):
    seq, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [half]
    pos = jnp.arange(seq, dtype=jnp.float32) if positions is None else positions.reshape(seq).astype(jnp.float32)
    angle = pos[:, None] * freq[None, :]  # [seq, half]
    # The angles in float32, the rotation in x's dtype (as Transformers does): the last op is then a
    # multiply-add, not a cast, so a layer run under a keep-everything checkpoint (every_n's plain layers)
    # keeps the rotated q and k in the compute dtype rather than their float32 pre-cast values.
    sin = (sign * jnp.sin(angle)[None, :, None, :]).astype(x.dtype)
    cos = jnp.cos(angle)[None, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rope(x, base: float = 10_000.0, positions=None):
    """Rotary position embedding over the sequence axis.

    A rotation is orthogonal, so its backward pass is the rotation by the opposite angle: it keeps
    no residual at all (autodiff would keep the float32 sines and cosines of every layer). With
    ``positions``, ``x`` may be a slice of the sequence (a sequence tile): the transformer rotates q and k
    inside its q/k/v tiles, so no whole-sequence rotation (whose elementwise halves XLA:CPU computes and
    keeps in float32) ever exists.

    Args:
      x: ``[batch, seq, heads, head_dim]`` with an even ``head_dim``.
      base: the RoPE frequency base.
      positions: the integer position of each of ``x``'s ``seq`` rows (``[seq]`` or ``[1, seq]``); None:
        ``0 .. seq - 1``.

    Returns:
      ``x`` rotated by position, same shape and dtype.

    >>> x = jnp.ones((1, 4, 1, 2))
    >>> bool(jnp.array_equal(rope(x)[:, 2:], rope(x[:, 2:], positions=jnp.arange(2, 4))))
    True
    """
    return _rotate(x, base, 1.0, positions)


def _rope_fwd(x, base, positions):
    return _rotate(x, base, 1.0, positions), positions


def _rope_bwd(base, positions, g):
    return _rotate(g, base, -1.0, positions), None


rope.defvjp(_rope_fwd, _rope_bwd)


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
    0.28 s against 0.61 s, interleaved; ``benchmarks/results/profile_notes.md`` has whole-step figures).

    Args:
      kind: one of :data:`ATTENTION_KINDS`.
      dtype: the compute dtype name.
      head_dim: size of one head.
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``; default: the backend traced for,
        :func:`remat_kit.target.traced_platform` (a planner's target, else ``jax.default_backend()``).

    Raises:
      ValueError: as :func:`check_kind`, or ``cudnn`` on a backend other than a CUDA GPU.

    >>> resolve("auto", "float32", 64, platform="cpu"), resolve("auto", "bfloat16", 64, platform="gpu")
    ('chunked', 'cudnn')
    """
    check_kind(kind, dtype, head_dim)
    platform = platform or target_lib.traced_platform()
    live = platform == jax.default_backend()  # else a compile-only target: a GPU one is CUDA (remat_kit.target)
    cuda = platform == "gpu" and (not live or _has_cuda())
    if kind == "cudnn" and not cuda:
        raise ValueError(
            f"attention='cudnn' needs an NVIDIA GPU, but the JAX backend is {platform!r}; "
            "use attention='chunked' (any backend) or 'auto' (cuDNN on a GPU, chunked elsewhere)"
        )
    if kind != "auto":
        return kind
    return "cudnn" if cuda and _cudnn_unsupported(dtype, head_dim) is None else "chunked"


def default_chains(platform: str | None = None) -> int:
    """How many independent chains ``chunked`` attention runs on a backend (default: the live one).

    On a single CPU device the batch is cut into 2 chains that XLA:CPU runs on separate cores: one
    chain's block pairs (small matmuls and a softmax) keep little more than one core busy (fwd+bwd
    alone at b=4, s=1,024, h=8, d=64: 1.27x faster on 2 cores than on 1). The whole step at
    benchmarks/peer_hf.py's shape, interleaved (``benchmarks/results/profile_notes.md``): 2 chains
    with a scan each 0.92-0.94x of one chain's time, 4 chains 0.99x, cutting the heads instead of the
    batch 1.04x (so a batch of one runs one chain); the forward's chains then moved into one scan,
    0.94x again. Accelerators, and processes with several devices, run one chain.
    Chains give the same results to float rounding, not bit for bit (the matmuls' batch differs), so
    a run resumed with another device count matches the uninterrupted one to rounding only.

    >>> default_chains("gpu")
    1
    """
    if jax.device_count() > 1:
        # Several devices (a mesh, or simulated CPU devices) already share the cores, and the batch
        # may be sharded over them: cutting it would move rows between devices.
        return 1
    return DEFAULT_CHAINS.get(platform or target_lib.traced_platform(), 1)


def default_block(platform: str | None = None) -> int:
    """The ``chunked`` block size for a backend (default: the live one).

    >>> default_block("cpu"), default_block("tpu")
    (128, 512)
    """
    return DEFAULT_BLOCKS.get(platform or target_lib.traced_platform(), DEFAULT_BLOCK)


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

    Queries and keys/values are split into blocks of ``block`` positions (the sequence is padded to
    a multiple; padded keys are masked, padded queries dropped); an online softmax runs over the
    key blocks at or before each query block, so fully masked key blocks cost nothing. The backward
    pass (a ``jax.custom_vjp``) keeps q, k, v, the output and the per-query logsumexp, and
    recomputes each block's probabilities. The output and the logsumexp carry the ``context`` tag,
    so a policy that keeps ``context`` avoids re-running the forward in the backward pass.

    Both passes are one ``lax.scan`` over the n(n+1)/2 causal block pairs (see :func:`_pair_scan`),
    so the traced program is the same size at any sequence length (compile time is flat; see
    ``benchmarks/attention_compile.py``), the masked half of the block pairs is never computed,
    and the scans' static trip count lets :mod:`remat_kit.analysis.flops` count their matmuls exactly. The
    trade-off: a ragged last block is computed at full size (at most ``block - 1`` padded positions),
    and every block pair applies the causal mask (an elementwise select, cheap beside its matmuls).

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k, v: ``[batch, seq, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``.
      block: block size in positions, a positive integer (capped at ``seq``).
      flat: return ``[batch, seq, heads * head_dim]``, the very array the backward pass keeps: a
        caller that feeds it to the out projection then keeps it once, not twice (a reshape of it
        would be a second residual).

    Returns:
      The context ``[batch, seq, heads, head_dim]`` (or flat) in ``q``'s dtype.
    """
    check_int("attention block", block)
    _check_qkv(q, k, v)
    out = _flash(q, k, v, min(block, q.shape[1]), default_chains())
    return out if flat else out.reshape(q.shape)


def _pair_scan(step, init, num_blocks: int):
    """``lax.scan`` of ``step(carry, (i, j)) -> carry`` over the causal block pairs ``j <= i``, i then j.

    The pair is counted in the loop rather than read from an index array, so no constant of the
    loop becomes a residual. The trip count, n(n+1)/2, is static, so the matmuls are counted exactly.

    >>> int(_pair_scan(lambda total, ij: total + 10 * ij[0] + ij[1], jnp.int32(0), 3))  # 00 10 11 20 21 22
    84
    """

    def body(state, _):
        carry, i, j = state
        carry = step(carry, (i, j))
        last = j == i
        return (carry, jnp.where(last, i + 1, i), jnp.where(last, 0, j + 1)), None

    zero = jnp.zeros((), jnp.int32)
    (out, _, _), _ = jax.lax.scan(body, (init, zero, zero), None, length=num_blocks * (num_blocks + 1) // 2)
    return out


def _pad_seq(x, size: int, value: float = 0.0):
    """Pad axis 1 of ``x`` to ``size`` with ``value``."""
    extra = size - x.shape[1]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _block_scores(q_blk, k_blk, q0, k0, scale: float):
    """Scaled, causally masked scores ``[b, kv, g, bq, bk]`` (float32) of one block pair at offsets q0, k0.

    Head-major blocks (``q_blk [b, kv, g, bq, d]``, ``k_blk [b, kv, bk, d]``): a batched matmul whose
    operands need no transpose inside the loop.
    """
    # The offsets pass a barrier with the block: the mask then depends on the data. Alone it depends only on the
    # pair index, and JAX's scan partial evaluation hoists such loop-invariant work out of an enclosing scan (the
    # layers'), precomputing every pair's mask at once: [pairs, b, kv, g, block, block] bool, quadratic in seq.
    q0, k0, q_blk = jax.lax.optimization_barrier((q0, k0, q_blk))
    scores = jnp.einsum("bkgqd,bksd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    bq, bk = q_blk.shape[3], k_blk.shape[2]
    allowed = (q0 + jnp.arange(bq))[:, None] >= (k0 + jnp.arange(bk))[None, :]
    return jnp.where(allowed, scores, _MASKED)


def _at(x, start, size: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _add_at(buf, start, update, axis: int):
    """``buf`` with ``update`` added to its slice at ``start`` along ``axis`` (in place inside a loop)."""
    return jax.lax.dynamic_update_slice_in_dim(buf, _at(buf, start, update.shape[axis], axis) + update, start, axis)


def _head_major(q, k, v, sp: int):
    """``q [b, s, h, d]`` → ``[b, kv, g, sp, d]``; ``k``, ``v [b, s, kv, d]`` → ``[b, kv, sp, d]`` (padded to sp).

    Transposed once here rather than in every block pair: on CPU the per-pair transposes of the
    sequence-major blocks cost as much as a block's matmul (``benchmarks/results/profile_notes.md``).
    """
    kv = k.shape[2]
    kh, vh = (jnp.transpose(_pad_seq(x, sp), (0, 2, 1, 3)) for x in (k, v))
    return _query_major(q, kv, q.shape[-1], sp), kh, vh


def _query_major(x, kv: int, d: int, sp: int):
    """A query-shaped ``[b, s, h, d]`` (or flat ``[b, s, h * d]``) array as ``[b, kv, g, sp, d]``, padded to ``sp``."""
    b, s = x.shape[:2]
    return jnp.transpose(_pad_seq(x.reshape(b, s, kv, -1, d), sp), (0, 2, 3, 1, 4))


def _chain_slices(batch: int, chains: int) -> list[slice]:
    """The batch rows of each independent chain: ``chains`` runs of near-equal size (fewer for a small batch).

    >>> _chain_slices(4, 2)
    [slice(0, 2, None), slice(2, 4, None)]
    >>> _chain_slices(3, 2), _chain_slices(1, 2)
    ([slice(0, 1, None), slice(1, 3, None)], [slice(0, 1, None)])
    """
    count = max(1, min(chains, batch))
    bounds = [batch * i // count for i in range(count + 1)]
    return [slice(lo, hi) for lo, hi in itertools.pairwise(bounds)]


def _forward(q, k, v, block: int, chains: int):
    """Returns ``(out [b, s, h * d], lse [b, kv, g, s] float32)``, computed in independent ``chains``.

    One scan over the block pairs advances every chain (a slice of the batch each) by separate ops,
    which XLA:CPU's executor runs side by side on separate cores; one chain's block-pair matmuls and
    softmax keep little more than one core busy. (The forward alone at b=4, s=1,024, h=8, d=64, 2
    chains, interleaved: 0.93x of one chain's time this way, 1.12x as one scan per chain; the
    backward pass, :func:`_flash_bwd`, is faster with one scan per chain.)
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    n = -(-s // block)
    sp = n * block
    scale = 1.0 / float(d) ** 0.5
    parts = _chain_slices(b, chains)
    # per chain: qh, kh, vh, as 16-bit words (remat_kit.policies.words)
    heads = [tuple(map(words.pack, _head_major(q[p], k[p], v[p], sp))) for p in parts]

    def advance(qh, kh, vh, state, q0, k0):
        # The online softmax state of every query row lives in full-length buffers; each block pair
        # reads and updates its query block's rows. Pairs come in (i, then j) order, as FlashAttention.
        m_all, total_all, acc_all = state  # [rows, kv, g, sp], same, [rows, kv, g, sp, d]
        q_blk, k_blk = words.at(qh, q0, block, 3, q.dtype), words.at(kh, k0, block, 2, k.dtype)
        scores = _block_scores(q_blk, k_blk, q0, k0, scale)
        m, total, acc = _at(m_all, q0, block, 3), _at(total_all, q0, block, 3), _at(acc_all, q0, block, 3)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        pv = jnp.einsum(
            "bkgqs,bksd->bkgqd",
            p.astype(v.dtype),
            words.at(vh, k0, block, 2, v.dtype),
            preferred_element_type=jnp.float32,
        )
        corr = jnp.exp(m - m_new)  # 0 on a row's first block: its state starts at (_MASKED, 0, 0)
        total = total * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + pv
        put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, q0, axis=3)
        return put(m_all, m_new), put(total_all, total), put(acc_all, acc)

    def step(states, ij):
        q0, k0 = ij[0] * block, ij[1] * block
        return tuple(advance(*x, state, q0, k0) for x, state in zip(heads, states, strict=True))

    init = tuple(
        (
            jnp.full((p.stop - p.start, kv, g, sp), _MASKED, jnp.float32),
            jnp.zeros((p.stop - p.start, kv, g, sp), jnp.float32),
            jnp.zeros((p.stop - p.start, kv, g, sp, d), jnp.float32),
        )
        for p in parts
    )
    outs, lses = [], []
    for (m, total, acc), p in zip(_pair_scan(step, init, n), parts, strict=True):
        out = (acc / total[..., None])[:, :, :, :s]  # [rows, kv, g, s, d]
        # Flat (see chunked_attention): [rows, s, h * d].
        outs.append(jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(p.stop - p.start, s, h * d).astype(q.dtype))
        lses.append((m + jnp.log(total))[..., :s])
    return jnp.concatenate(outs), jnp.concatenate(lses)


def _flash(q, k, v, block: int, chains: int):
    """The flat attention output, differentiated by :func:`_flash_bwd` (FlashAttention's backward pass).

    The forward runs outside the ``custom_vjp``, behind ``stop_gradient``, and its output and logsumexp are
    tagged ``context`` there; the ``custom_vjp`` receives them as inputs and keeps them as its residuals. So
    both of JAX's remat implementations see the tag: the classic one, and remat3 (which treats a
    ``custom_vjp`` as one unit and would not see a tag inside its forward rule). A policy that keeps
    ``context`` saves them; one that does not recomputes this forward in the backward pass.
    """
    # stop_gradient on the inputs too, not only on the output: a tangent entering the pair scan makes JAX
    # linearize it and keep its per-pair masks ([pairs, b, kv, g, block, block] bool, quadratic in the sequence)
    # even though the output's tangent is then dropped.
    qs, ks, vs = (jax.lax.stop_gradient(x) for x in (q, k, v))
    out, lse = names.tag(jax.lax.stop_gradient(_forward(qs, ks, vs, block, chains)), names.CONTEXT)
    return _flash_grad(q, k, v, out, lse, block, chains)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash_grad(q, k, v, out, lse, block: int, chains: int):
    del q, k, v, lse, block, chains  # the output is computed already; this unit only defines the gradient
    return out


def _flash_fwd(q, k, v, out, lse, block: int, chains: int):
    # The output and logsumexp are kept (once, as computed), never the chains' pieces.
    return out, (q, k, v, out, lse)


def _flash_bwd(block: int, chains: int, residuals, d_out):
    q, k, v, out, lse = residuals
    return (*_flash_qkv_grads(block, chains, q, k, v, out, lse, d_out), None, None)  # out, lse: behind stop_gradient


def _flash_qkv_grads(block: int, chains: int, q, k, v, out, lse, d_out):
    parts = _chain_slices(q.shape[0], chains)
    if len(parts) == 1:
        return _backward_chain(block, q, k, v, out, lse, d_out)
    # One scan per chain here (unlike the forward): the backward alone at b=4, s=1,024, h=8, d=64,
    # interleaved, ran 0.91x of one chain's time this way and 0.95x as one scan over both chains.
    grads = [_backward_chain(block, q[p], k[p], v[p], out[p], lse[p], d_out[p]) for p in parts]
    return tuple(jnp.concatenate(x) for x in zip(*grads, strict=True))


def _backward_chain(block: int, q, k, v, out, lse, d_out):
    """The gradients ``(dq, dk, dv)`` of one chain of :func:`_forward` (FlashAttention's backward pass)."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    n = -(-s // block)
    sp = n * block
    scale = 1.0 / float(d) ** 0.5
    qh, kh, vh = map(words.pack, _head_major(q, k, v, sp))  # as 16-bit words (remat_kit.policies.words)
    # dO and the output head-major too ([b, kv, g, sp, d]): D_i = rowsum(dO ∘ O), the softmax backward's correction
    # term, is summed per query block inside the loop (a whole-sequence D would need float32 copies of O and dO).
    doh, oh = (words.pack(_query_major(x, kv, d, sp)) for x in (d_out, out))
    # Padded query rows get an infinite logsumexp, so their probabilities are exactly 0.
    lse = jnp.swapaxes(_pad_seq(jnp.swapaxes(lse, 1, 3), sp, jnp.inf), 1, 3)

    def step(grads, ij):
        # Head-major float32 accumulators: dk and dv [b, kv, sp, d], summed over the query blocks. A query block's
        # dq sums over its pairs alone, which come one after another (i, then j): it is summed in a block-sized
        # float32 carry reset at j == 0 and written to the full-length dq in q's dtype after each pair (the
        # write at j == i is final): no full-length float32 dq.
        dq_blk, dq_all, dk_all, dv_all = grads
        q0, k0 = ij[0] * block, ij[1] * block
        dq_blk = jnp.where(k0 == 0, 0.0, dq_blk)
        q_blk, do_blk = words.at(qh, q0, block, 3, q.dtype), words.at(doh, q0, block, 3, d_out.dtype)
        k_blk, v_blk = words.at(kh, k0, block, 2, k.dtype), words.at(vh, k0, block, 2, v.dtype)
        o_blk = words.at(oh, q0, block, 3, out.dtype)
        delta_blk = jnp.einsum("bkgqd,bkgqd->bkgq", do_blk, o_blk, preferred_element_type=jnp.float32)[..., None]
        lse_blk = _at(lse, q0, block, 3)[..., None]
        p = jnp.exp(_block_scores(q_blk, k_blk, q0, k0, scale) - lse_blk)  # [b, kv, g, bq, bk]
        dv = jnp.einsum("bkgqs,bkgqd->bksd", p.astype(v.dtype), do_blk, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgqd,bksd->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_blk) * scale).astype(q.dtype)
        dq = jnp.einsum("bkgqs,bksd->bkgqd", ds, k_blk, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bkgqs,bkgqd->bksd", ds, q_blk, preferred_element_type=jnp.float32)
        dq_blk = dq_blk + dq
        dq_all = jax.lax.dynamic_update_slice_in_dim(dq_all, dq_blk.astype(dq_all.dtype), q0, axis=3)
        return dq_blk, dq_all, _add_at(dk_all, k0, dk, 2), _add_at(dv_all, k0, dv, 2)

    init = (
        jnp.zeros((b, kv, g, block, d), jnp.float32),
        jnp.zeros((b, kv, g, sp, d), q.dtype),
        jnp.zeros((b, kv, sp, d), jnp.float32),
        jnp.zeros((b, kv, sp, d), jnp.float32),
    )
    _, dq, dk, dv = _pair_scan(step, init, n)
    dq = jnp.transpose(dq[:, :, :, :s], (0, 3, 1, 2, 4)).reshape(b, s, h, d)
    dk, dv = (jnp.transpose(x[:, :, :s], (0, 2, 1, 3)) for x in (dk, dv))
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


_flash_grad.defvjp(_flash_fwd, _flash_bwd)
