"""The QLoRA NF4 storage format: 4-bit NormalFloat codes in 64-blocks with double-quantized absmax scales.

Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs" (2023), sections 3 and appendix E:

- **NF4 codes** (:data:`TABLE`): 16 values, the quantiles of a standard normal normalized to
  ``[-1, 1]``, asymmetric (8 positive, 7 negative) so that zero is represented exactly: with
  ``δ = ½ (1/30 + 1/32)`` the positive half is ``Φ⁻¹`` at 8 of 9 evenly spaced probabilities in
  ``[1 - δ, ½]``, the negative half ``-Φ⁻¹`` at 7 of 8 in the same range, plus 0, all divided by
  ``Φ⁻¹(1 - δ)``. The published float32 values are used as they are; :func:`_table` derives them with
  :class:`statistics.NormalDist`, equal to 1e-6.
- **Blocks of 64 weights** (:data:`BLOCK`), consecutive in the row-major flattening of each kernel
  (as bitsandbytes flattens it), each with its absmax as scale: a weight is stored as the index of
  the nearest table value to ``w / absmax``.
- **Double quantization**: the float32 absmax scales of one kernel are centred by their mean (one
  float32 per kernel, ``absmax_offset``) and quantized again in blocks of 256 (:data:`SCALE_BLOCK`).
  The paper uses 8-bit floats for that second step; this module uses **symmetric linear int8**
  (round-to-nearest of ``c / (max|c| / 127)``) with a float32 absmax per 256-block
  (``absmax_scale``): also 8 bits, simpler, and its error on the centred scales is at most half a
  step (the scales of Gaussian weights are tightly clustered, so linear steps suit them). The last
  256-block is padded with zeros when a kernel's block count is not a multiple of 256.
- **Packing**: two 4-bit codes per ``uint8``, the first (even) element of each pair in the high
  nibble, as bitsandbytes packs them.

Storage per weight: 0.5 byte (codes) + 1/64 byte (int8 scale) + 4/(64·256) byte (second-level
scale), i.e. 4.127 bits, the paper's figure. A kernel ``[..., d_in, d_out]`` (leading axes, e.g.
the stacked layers of the scan, are batch axes: each kernel is quantized on its own) becomes::

    {"codes": uint8 [..., d_in, d_out // 2], "absmax_q": int8 [..., nb],
     "absmax_scale": float32 [..., nb // 256], "absmax_offset": float32 [..., 1]}

with ``nb`` the number of 64-blocks rounded up to a multiple of 256. Kernels whose size
``d_in · d_out`` is not a multiple of 64 (or with an odd ``d_out``) are **refused** with a
``ValueError`` (:func:`check_shape`), not padded: every Block kernel of a model whose widths are
multiples of 8 qualifies, and refusing keeps the stored shapes those of the kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np

#: Weights per absmax block, and scales per block of the second (double) quantization (QLoRA's sizes).
BLOCK = 64
SCALE_BLOCK = 256

#: The leaf names of an NF4 kernel, in the order :func:`dequantize` reads them.
LEAVES: tuple[str, ...] = ("codes", "absmax_q", "absmax_scale", "absmax_offset")


#: The 16 NF4 values as published (QLoRA appendix E; bitsandbytes' NF4 map), float32, ascending
#: (``TABLE[7] == 0``, ``TABLE[0] == -1``, ``TABLE[15] == 1``): a checkpoint's codes mean exactly these.
#: :func:`_table` derives them from the normal quantiles (tests/test_nf4.py: equal to 1e-6).
TABLE: np.ndarray = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)


def _table() -> np.ndarray:
    """The NF4 values from their definition (the module docstring), float32: :data:`TABLE` to 1e-6."""
    delta = 0.5 * (1 / 30 + 1 / 32)
    inv = NormalDist().inv_cdf
    positive = [inv(p) for p in np.linspace(1 - delta, 0.5, 9)[:-1]]
    negative = [-inv(p) for p in np.linspace(1 - delta, 0.5, 8)[:-1]]
    values = np.sort(np.array(positive + negative + [0.0]))
    return (values / values.max()).astype(np.float32)


# Decision boundaries of round-to-nearest: the midpoints between neighbouring table values.
_MIDPOINTS: np.ndarray = ((TABLE[1:] + TABLE[:-1]) / 2).astype(np.float32)


def check_shape(shape: tuple[int, ...]) -> None:
    """Raise a one-line ValueError unless a kernel of ``shape [..., d_in, d_out]`` can be stored as NF4.

    >>> check_shape((64, 2))
    >>> check_shape((3, 5))
    Traceback (most recent call last):
    ...
    ValueError: nf4 needs kernels whose size d_in*d_out is a multiple of 64 and d_out even, got shape (3, 5)
    """
    if len(shape) < 2 or (shape[-1] * shape[-2]) % BLOCK or shape[-1] % 2:
        raise ValueError(
            f"nf4 needs kernels whose size d_in*d_out is a multiple of {BLOCK} and d_out even, got shape {tuple(shape)}"
        )


def num_scales(shape: tuple[int, ...]) -> int:
    """Stored first-level scales of one kernel: its 64-block count rounded up to a multiple of 256."""
    blocks = shape[-1] * shape[-2] // BLOCK
    return -(-blocks // SCALE_BLOCK) * SCALE_BLOCK


def pack(codes: jax.Array) -> jax.Array:
    """Two 4-bit codes (``uint8`` in 0..15, last axis even) per byte, the even element in the high nibble.

    >>> pack(jnp.array([1, 2, 15, 0], jnp.uint8)).tolist()
    [18, 240]
    """
    codes = jnp.asarray(codes, jnp.uint8)
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def unpack(packed: jax.Array) -> jax.Array:
    """The inverse of :func:`pack`: ``uint8 [..., n]`` → codes ``uint8 [..., 2n]``.

    >>> unpack(jnp.array([18, 240], jnp.uint8)).tolist()
    [1, 2, 15, 0]
    """
    packed = jnp.asarray(packed, jnp.uint8)
    return jnp.stack([packed >> 4, packed & 15], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def encode(x: jax.Array) -> jax.Array:
    """Index (``uint8``, 0..15) of the table value nearest to each entry of ``x`` (values in ``[-1, 1]``).

    >>> encode(jnp.array([-1.0, 0.0, 0.01, 1.0])).tolist()
    [0, 7, 7, 15]
    """
    return jnp.searchsorted(jnp.asarray(_MIDPOINTS), jnp.asarray(x, jnp.float32)).astype(jnp.uint8)


def quantize(kernel: jax.Array) -> dict[str, jax.Array]:
    """A float kernel ``[..., d_in, d_out]`` in NF4 with double-quantized scales (the module docstring's leaves).

    Args:
      kernel: float weights; leading axes are batch axes (each ``[d_in, d_out]`` is quantized alone).

    Returns:
      ``{"codes", "absmax_q", "absmax_scale", "absmax_offset"}``; :func:`dequantize` inverts it.

    Raises:
      ValueError: the kernel's shape cannot be stored as NF4 (:func:`check_shape`).

    >>> q = quantize(jax.random.normal(jax.random.key(0), (64, 8)))
    >>> {k: (v.dtype.name, v.shape) for k, v in q.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'codes': ('uint8', (64, 4)), 'absmax_q': ('int8', (256,)), 'absmax_scale': ('float32', (1,)),
     'absmax_offset': ('float32', (1,))}
    """
    kernel = jnp.asarray(kernel, jnp.float32)
    check_shape(kernel.shape)
    lead, (d_in, d_out) = kernel.shape[:-2], kernel.shape[-2:]
    blocks = kernel.reshape(*lead, d_in * d_out // BLOCK, BLOCK)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)  # [..., blocks]
    # An all-zero block keeps scale 0 (not to widen the second level's range); its codes are 7, exact 0.
    codes = encode(blocks / jnp.where(absmax > 0, absmax, 1.0)[..., None]).reshape(*lead, d_in, d_out)
    # Double quantization: centre the (positive) scales, then symmetric int8 per 256 of them.
    offset = jnp.mean(absmax, axis=-1, keepdims=True)  # [..., 1]
    centred = absmax - offset
    pad = num_scales(kernel.shape) - centred.shape[-1]
    centred = jnp.pad(centred, [(0, 0)] * len(lead) + [(0, pad)]).reshape(*lead, -1, SCALE_BLOCK)
    amax2 = jnp.max(jnp.abs(centred), axis=-1, keepdims=True)
    step = jnp.where(amax2 > 0, amax2 / 127.0, 1.0)
    absmax_q = jnp.clip(jnp.round(centred / step), -127, 127).astype(jnp.int8).reshape(*lead, -1)
    return {"codes": pack(codes), "absmax_q": absmax_q, "absmax_scale": step[..., 0], "absmax_offset": offset}


def _block_scale(absmax_q: jax.Array, absmax_scale: jax.Array, absmax_offset: jax.Array) -> jax.Array:
    # The double dequantization, in one place: a block's int8 code times its group's scale, plus the offset.
    return absmax_q.astype(jnp.float32) * absmax_scale + absmax_offset


def scales(q: Mapping[str, jax.Array]) -> jax.Array:
    """The double-dequantized per-block scales ``float32 [..., d_in·d_out/64]`` of an NF4 kernel."""
    absmax_q = q["absmax_q"]
    lead = absmax_q.shape[:-1]
    grouped = absmax_q.reshape(*lead, -1, SCALE_BLOCK)
    per = _block_scale(grouped, q["absmax_scale"][..., None], q["absmax_offset"][..., None])
    blocks = q["codes"].shape[-2] * q["codes"].shape[-1] * 2 // BLOCK
    return per.reshape(*lead, -1)[..., :blocks]


def dequantize(q: Mapping[str, jax.Array], dtype=jnp.float32) -> jax.Array:
    """The float kernel ``[..., d_in, d_out]`` an NF4 kernel stands for: ``TABLE[code] · scale`` per 64-block.

    >>> w = jax.random.normal(jax.random.key(0), (64, 8))
    >>> err = jnp.abs(dequantize(quantize(w)) - w).max() / jnp.abs(w).max()
    >>> bool(0 < err < 0.15)  # at most half the widest gap between table values, 0.15, of the block's absmax
    True
    """
    packed = q["codes"]
    lead, d_in, d_out = packed.shape[:-2], packed.shape[-2], 2 * packed.shape[-1]
    values = jnp.asarray(TABLE)[unpack(packed)].reshape(*lead, -1, BLOCK)
    return (values * scales(q)[..., None]).reshape(*lead, d_in, d_out).astype(dtype)


def dequantize_rows(q: Mapping[str, jax.Array], rows: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``dequantize(q, dtype)[rows]`` of a 2-D NF4 matrix (an embedding table), dequantizing only those rows.

    The gathered rows' packed codes, and each entry's first- and second-level scale (its 64-block
    may straddle two rows when the width is not a multiple of 64), with :func:`scales`' arithmetic,
    so the result equals the whole table's dequantization gathered, exactly.

    Args:
      q: an NF4 matrix ``[n, d]`` (:func:`quantize` of a 2-D array).
      rows: integer row ids ``[...]``.
      dtype: the output dtype.

    Returns:
      ``[..., d]`` in ``dtype``.

    >>> q = quantize(jax.random.normal(jax.random.key(0), (16, 8)))
    >>> rows = jnp.array([[3, 0], [15, 3]])
    >>> bool(jnp.all(dequantize_rows(q, rows) == dequantize(q)[rows]))
    True
    """
    packed = q["codes"]
    if packed.ndim != 2:
        raise ValueError(f"dequantize_rows needs a 2-D NF4 matrix, got codes of shape {tuple(packed.shape)}")
    d = 2 * packed.shape[-1]
    i = jnp.asarray(rows, jnp.int32)[..., None]
    c = jnp.arange(d, dtype=jnp.int32).reshape((1,) * (i.ndim - 1) + (d,))
    # Entry (i, c) is flat entry i*d + c, in block (i*d + c) // 64, split so no product overflows int32.
    block = i * (d // BLOCK) + (i * (d % BLOCK) + c) // BLOCK
    scale = _block_scale(q["absmax_q"][block], q["absmax_scale"][block // SCALE_BLOCK], q["absmax_offset"][0])
    values = jnp.asarray(TABLE)[unpack(jnp.take(packed, rows, axis=0))]
    return (values * scale).astype(dtype)
