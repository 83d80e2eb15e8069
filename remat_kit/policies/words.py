"""16-bit floats read by a loop as integer words: the one rule behind every "as words" in remat_kit.

XLA:CPU (jax 0.10) converts a loop-invariant bfloat16 or float16 operand of a loop (a scan's closed-over or
stacked input whose slices the body reads) to float32 whole, before the loop: its slices and matmuls run in
float32 there. At long context that is a whole-sequence float32 copy of every such array, twice its bytes,
live beside the original. Integer words cannot be widened: a loop that reads the ``uint16`` words of the
array and turns each slice back into the float dtype inside its body holds no copy, and its values are
bit for bit the same. Three loops read this way: the layer stack's kept inputs under ``full``
(:func:`remat_kit.policies.layers.run_packed`), a sequence tile's inputs (:func:`remat_kit.policies.tiling.tiled`)
and chunked attention's block pairs (:mod:`remat_kit.model.attention`).

>>> import jax.numpy as jnp
>>> x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
>>> w = pack(x)
>>> str(w.dtype), bool(jnp.array_equal(at(w, 1, 2, 1, x.dtype), x[:, 1:]))
('uint16', True)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

#: Floating dtypes stored as 16-bit words.
PACKED_DTYPES = ("bfloat16", "float16")


def packable(x: Any) -> bool:
    """Whether ``x`` is an array of a :data:`PACKED_DTYPES` dtype.

    >>> packable(jnp.zeros(2, jnp.bfloat16)), packable(jnp.zeros(2))
    (True, False)
    """
    return hasattr(x, "dtype") and jnp.dtype(x.dtype).name in PACKED_DTYPES


def pack(x):
    """``x`` as its ``uint16`` words when :func:`packable`, else ``x`` itself.

    >>> str(pack(jnp.ones(2, jnp.float16)).dtype), str(pack(jnp.ones(2)).dtype)
    ('uint16', 'float32')
    """
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if packable(x) else x


def at(words, start, size: int, axis: int, dtype):
    """The slice ``[start, start + size)`` on ``axis`` of a :func:`pack` ed array, in ``dtype`` (bit for bit the
    unpacked slice).

    >>> x = jnp.arange(4, dtype=jnp.float16)
    >>> bool(jnp.array_equal(at(pack(x), 2, 2, 0, x.dtype), x[2:]))
    True
    """
    return unpack(jax.lax.dynamic_slice_in_dim(words, start, size, axis=axis), dtype)


def unpack(words, dtype):
    """A :func:`pack` ed array (or slice) back in ``dtype``, bit for bit; an unpacked one as it is.

    >>> x = jnp.ones(2, jnp.bfloat16)
    >>> bool(jnp.array_equal(unpack(pack(x), x.dtype), x))
    True
    """
    return jax.lax.bitcast_convert_type(words, dtype) if words.dtype != dtype else words
