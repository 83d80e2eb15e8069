"""Next-token cross-entropy, plain or chunked so the full ``[batch, seq, vocab]`` logits never live.

Checkpointing the layers does not shrink the logits: on the 2B-class preset they are ≈ 2 GB in
float32, and their gradient as much again. :func:`chunked_cross_entropy` runs the output projection
and the loss ``chunks`` token-slices at a time and takes each slice's gradients right there, in the
forward pass (a *fused* linear cross-entropy, as Liger-Kernel's): a slice's logits and their
gradient live only while that slice runs, nothing is recomputed, and the backward pass only scales
the gradients it was handed. What it keeps for the backward pass is the gradient of the hidden
states (``[b, s, d]``) and of the output matrix (its shape, in its dtype; not computed when the
matrix is not differentiated, as a frozen LoRA base), which the backward pass would hold from its
first step anyway: the step's compiled peak is no higher than with the logits recomputed, its
matmul FLOPs are the plain loss's (``benchmarks/results/plan_2b_loss_chunks8.txt``), and on CPU it
spares the page faults of two ``[b·s, V]`` float32 buffers per step (``benchmarks/results/profile_notes.md``).
The chunks, the fused gradients and the scaling are :func:`remat_kit.policies.loss_chunks.chunked_mean`, the
one implementation :func:`remat_kit.head_loss` runs a model the user installed through; this module gives it
the output projection (and, for a frozen matrix, its reading by vocabulary slice).

``loss_chunks="auto"`` (:func:`auto_chunks`, the training default) picks the fused loss once the full
float32 logits reach :data:`AUTO_FUSED_FROM`, about :data:`AUTO_CHUNK_BYTES` of logits a chunk, and
the plain loss below that, where on CPU it is as fast or faster and the logits are small anyway.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from remat_kit.model import lora_layer
from remat_kit.model.ops import matmul, project
from remat_kit.policies import loss_chunks
from remat_kit.units import check_int

#: ``loss_chunks="auto"`` uses the fused loss from this many bytes of full float32 logits on. Below
#: it the plain loss is as fast (value and gradients of head + loss alone, 2-core CPU, interleaved:
#: fused 1.04-1.07x at 125 MiB, 0.97x at 250 MiB, 0.89x at 500 MiB, 0.85x at 1,000 MiB).
AUTO_FUSED_FROM = 256 * 2**20

#: ... and cuts them into chunks of about this many bytes (4 chunks at benchmarks/peer_hf.py's
#: 4 × 1,024 tokens × 32,000; 8 chunks were no faster than 4 at 1,000 MiB).
AUTO_CHUNK_BYTES = 128 * 2**20


def auto_chunks(tokens: int, vocab: int, devices: int = 1) -> int:
    """The chunk count ``loss_chunks="auto"`` picks for ``tokens`` positions over a ``vocab``-wide head.

    Args:
      tokens, vocab: the step's token count (batch × seq) and the vocabulary size.
      devices: the devices the batch is spread over. On more than one, "auto" is the plain loss: the
        fused loss's chunks are slices of the flattened tokens, which a batch-sharded mesh holds on
        different devices.

    Returns:
      0 (the plain loss) while the float32 logits ``tokens × vocab × 4`` bytes stay under
      :data:`AUTO_FUSED_FROM` (or ``devices > 1``), else one chunk per :data:`AUTO_CHUNK_BYTES` of
      them (at most ``tokens``).

    >>> auto_chunks(4 * 256, 4096), auto_chunks(4 * 1024, 32000), auto_chunks(2 * 1024, 248000)
    (0, 4, 16)
    """
    check_int("tokens", tokens, 1)
    check_int("vocab", vocab, 1)
    check_int("devices", devices, 1)
    logits = tokens * vocab * 4
    if logits < AUTO_FUSED_FROM or devices > 1:
        return 0
    return min(tokens, -(-logits // AUTO_CHUNK_BYTES))


def check_chunks(loss_chunks) -> int | str:
    """``loss_chunks`` as given, once it is ``"auto"`` or an integer >= 0.

    Raises:
      ValueError: anything else, named in the message with what is allowed.
    """
    if isinstance(loss_chunks, str) and loss_chunks == "auto":
        return loss_chunks
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 0:
        raise ValueError(
            f"loss_chunks must be 'auto', 0 (the plain loss) or a positive integer (the fused loss's chunks), "
            f"got {loss_chunks!r}"
        )
    return loss_chunks


def resolve_chunks(loss_chunks, tokens: int, vocab: int, devices: int = 1) -> int:
    """``loss_chunks`` as a count: ``"auto"`` becomes :func:`auto_chunks`, a count is checked and kept."""
    loss_chunks = check_chunks(loss_chunks)
    return auto_chunks(tokens, vocab, devices) if loss_chunks == "auto" else loss_chunks


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
    return jnp.sum(loss_chunks.token_losses(logits, targets) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def chunked_cross_entropy(
    hidden, w_out, targets, mask, chunks: int, *, vocab_axis: int = 1, vocab_blocks: int | None = None
):
    """:func:`cross_entropy` of ``hidden @ w_out`` computed ``chunks`` token-slices at a time, fused.

    Equal to the plain loss (and its gradients) up to float rounding; peak logits memory falls to
    one chunk's ``[tokens / chunks, vocab]``. Each chunk's gradients are taken in the forward pass
    (see the module docstring), so the logits are never recomputed; the backward pass keeps the
    gradients of ``hidden`` and ``w_out``. ``w_out`` is cast to ``hidden``'s dtype inside each chunk
    (:func:`remat_kit.model.ops.project`), so no cast of it is kept. Not differentiable twice.

    A frozen ``w_out`` (not differentiated: a LoRA base) is cast, or dequantized, ``vocab_blocks`` slices of
    its vocabulary at a time inside each chunk, so no whole-matrix copy of it is ever made (on the 2B
    preset: its bfloat16 dequantization, 1 GB, and the float32 copy XLA:CPU makes of it for a bfloat16
    matmul, 2 GB); the matmul FLOPs stay the plain loss's, and each chunk dequantizes the matrix anew.

    Args:
      hidden: ``[b, s, d]`` final hidden states (the logits are computed in their dtype, accumulated
        in float32).
      w_out: the output projection in any dtype: ``[d, vocab]``, or ``[vocab, d]`` with ``vocab_axis=0``
        (a tied embedding, used without a transpose); or a quantized one (int8 or NF4, a frozen
        LoRA base's), dequantized inside the loss (:func:`remat_kit.model.lora_layer.lookup` by vocabulary
        slice when ``vocab_axis=0``, :func:`remat_kit.model.lora_layer.dequantize_matrix` whole otherwise):
        no dequantized copy is kept for the backward pass.
      targets, mask: as for :func:`cross_entropy`.
      chunks: how many slices (a positive integer; the token count is padded up to a multiple).
      vocab_axis: which axis of ``w_out`` is the vocabulary, 1 or 0.
      vocab_blocks: the vocabulary slices of a frozen ``w_out``, a divisor of the vocabulary size; None
        (default): :func:`auto_vocab_blocks` of its shape (one slice for a small matrix).

    >>> h = jnp.ones((2, 6, 4)); w = jnp.eye(4, 10); t = jnp.zeros((2, 6), jnp.int32); m = jnp.ones((2, 6))
    >>> bool(jnp.allclose(chunked_cross_entropy(h, w, t, m, 5), cross_entropy(h @ w, t, m)))
    True
    >>> bool(jnp.allclose(chunked_cross_entropy(h, w.T, t, m, 5, vocab_axis=0), cross_entropy(h @ w, t, m)))
    True
    >>> bool(jnp.allclose(chunked_cross_entropy(h, w, t, m, 5, vocab_blocks=5), cross_entropy(h @ w, t, m)))
    True
    """
    check_int("loss chunks", chunks)
    if vocab_axis not in (0, 1) or isinstance(vocab_axis, bool):
        raise ValueError(f"vocab_axis must be 0 ([vocab, d]) or 1 ([d, vocab]), got {vocab_axis!r}")
    if lora_layer.is_quantized(w_out) and not _rows_of(w_out, vocab_axis):
        w_out = lora_layer.dequantize_matrix(w_out, hidden.dtype)
    b, s, d = hidden.shape
    vocab = _vocab_size(w_out, vocab_axis)
    if vocab_blocks is None:
        vocab_blocks = auto_vocab_blocks(vocab, d)
    check_int("vocab_blocks", vocab_blocks)
    if vocab % vocab_blocks:
        raise ValueError(f"vocab_blocks={vocab_blocks} does not divide the vocabulary size {vocab}")
    n = b * s
    size = -(-n // chunks)
    pad = size * chunks - n
    h = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0)))
    t = jnp.pad(targets.reshape(n), (0, pad))
    m = jnp.pad(mask.reshape(n).astype(jnp.float32), (0, pad))
    return loss_chunks.chunked_mean(_head(vocab_axis, vocab_blocks, vocab), (h,), w_out, t, m, chunks)


@functools.cache
def _head(vocab_axis: int, blocks: int, vocab: int) -> loss_chunks.Chunk:
    """The output projection as the shared chunked loss's chunk (cached: one spec, one trace, per layout)."""

    def logits(i, blocked, w):
        (h_c,) = blocked
        if lora_layer.is_quantized(w):  # a differentiated quantized matrix: its float leaves' gradient, through
            w = lora_layer.dequantize_matrix(w, h_c.dtype)
        return project(h_c, w, 1 - vocab_axis, h_c.dtype, jnp.float32)  # [size, vocab]

    def frozen(i, blocked, w, t_c, m_c, count, grad):
        return _frozen_chunk(blocked[0], w, t_c, m_c, count, vocab_axis, blocks, vocab, grad)

    return loss_chunks.Chunk(logits, frozen)


#: A frozen output matrix is cast (or dequantized) in vocabulary slices of about this many float32 bytes.
VOCAB_BLOCK_BYTES = 64 * 2**20


def auto_vocab_blocks(vocab: int, d: int) -> int:
    """The vocabulary slices :func:`chunked_cross_entropy` casts a frozen ``[vocab, d]`` output matrix in.

    The fewest that divide ``vocab`` and bring a slice's float32 copy to at most :data:`VOCAB_BLOCK_BYTES`;
    1 (the whole matrix at once) when it is that small already, or when no divisor up to four times the
    fewest would do (a prime vocabulary: slices of a row or two would cost more than they save).

    >>> auto_vocab_blocks(248_000, 2048), auto_vocab_blocks(32_000, 2048), auto_vocab_blocks(4096, 256)
    (31, 4, 1)
    """
    check_int("vocab", vocab)
    check_int("d", d)
    need = -(-vocab * d * 4 // VOCAB_BLOCK_BYTES)
    if need <= 1:
        return 1
    return next((k for k in range(need, min(vocab, 4 * need) + 1) if vocab % k == 0), 1)


def _vocab_size(w, vocab_axis: int) -> int:
    if lora_layer.is_quantized(w):
        leaf = w["codes"] if "codes" in w else w["qvalue"]
        return leaf.shape[0]  # a quantized matrix reaches the loss whole only by rows (_rows_of)
    return w.shape[vocab_axis]


def _rows_of(w, vocab_axis: int) -> bool:
    """Whether a quantized ``w`` can be dequantized by vocabulary rows (:func:`lora_layer.lookup`): ``[vocab, d]``
    NF4, or int8 with one scale per row."""
    if vocab_axis != 0:
        return False
    if "codes" in w:
        return w["codes"].ndim == 2
    return w["qvalue"].ndim == 2 and w["scale"].shape == (w["qvalue"].shape[0], 1)


def _w_block(w, vocab_axis: int, blocks: int, dtype):
    """``j -> `` the ``j``-th vocabulary slice of the frozen ``w`` in ``dtype`` (``[rows, d]`` or ``[d, cols]``)."""
    if blocks == 1 and not lora_layer.is_quantized(w):
        return lambda j: w.astype(dtype)
    size = _vocab_size(w, vocab_axis) // blocks
    if lora_layer.is_quantized(w):
        return lambda j: lora_layer.lookup(w, j * size + jnp.arange(size, dtype=jnp.int32), dtype)
    return lambda j: jax.lax.dynamic_slice_in_dim(w, j * size, size, axis=vocab_axis).astype(dtype)


def _frozen_chunk(h_c, w, t_c, m_c, count, vocab_axis: int, blocks: int, vocab: int, grad: bool):
    """One chunk's ``(summed loss / count, (dh,) or None)`` with ``w`` frozen, by vocabulary slice.

    The slices' logits ``[blocks, size, vocab / blocks]`` are one chunk's logits (as many bytes); each slice
    of ``w`` is cast/dequantized where a matmul reads it, once for the logits and once for ``dh``.
    """
    w_block = _w_block(w, vocab_axis, blocks, h_c.dtype)
    width = vocab // blocks
    index = jnp.arange(blocks, dtype=jnp.int32)
    z = jax.lax.scan(lambda _, j: (None, matmul(h_c, w_block(j), 1 - vocab_axis, jnp.float32)), None, index)[1]
    lse = jax.nn.logsumexp(z, axis=(0, 2))  # [size]
    rows = jnp.arange(h_c.shape[0])
    picked = z[t_c // width, rows, t_c % width]
    total = jnp.sum((lse - picked) * m_c) / count
    if not grad:
        return total, None
    # d(lse - picked)/dz = softmax - onehot, per token weighted by its mask over the count.
    hot = (index[:, None, None] * width + jnp.arange(width)[None, None, :]) == t_c[None, :, None]
    dz = (jnp.exp(z - lse[None, :, None]) - hot) * (m_c / count)[None, :, None]

    def back(acc, xs):
        j, dz_j = xs
        return acc + matmul(dz_j, w_block(j), vocab_axis, jnp.float32), None

    dh = jax.lax.scan(back, jnp.zeros(h_c.shape, jnp.float32), (index, dz))[0]
    return total, (dh.astype(h_c.dtype),)


def lm_loss(model, params, tokens, *, loss_chunks: int | str = 0, deterministic: bool = True, rngs=None):
    """Next-token loss of a :class:`remat_kit.model.transformer.Transformer` on ``tokens [b, s]``.

    Args:
      model: the Transformer (its policy decides the layers' remat).
      params: its ``params`` collection (the inner dict, not ``{"params": ...}``).
      tokens: ``[batch, seq]`` integer ids.
      loss_chunks: 0 for the plain loss over full logits; k > 0 for :func:`chunked_cross_entropy`;
        ``"auto"`` for :func:`auto_chunks` of ``tokens``' shape and the model's vocabulary on one
        device (over a mesh, pass ``loss_chunks=resolve_chunks("auto", tokens, vocab, mesh.size)``,
        as the trainer does).
      deterministic: False to apply dropout (then pass ``rngs={"dropout": key}``).
      rngs: Flax rngs for ``apply``.
    """
    loss_chunks = resolve_chunks(loss_chunks, tokens.shape[0] * tokens.shape[1], model.config.vocab_size)
    targets, mask = shift_targets(tokens)
    variables = {"params": params}
    kwargs = {"deterministic": deterministic, "rngs": rngs or {}}
    if loss_chunks:
        hidden, w_out, vocab_axis = model.apply(variables, tokens, method=model.features, **kwargs)
        return chunked_cross_entropy(hidden, w_out, targets, mask, loss_chunks, vocab_axis=vocab_axis)
    return cross_entropy(model.apply(variables, tokens, **kwargs), targets, mask)
