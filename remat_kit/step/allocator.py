"""Host memory that follows the plan on CPU: freed step buffers go back to the OS.

On CPU, XLA's buffers come from the C allocator. glibc's ``malloc`` serves a large request by ``mmap`` and gives
it back when freed, but its threshold for that is dynamic: after the first large buffer is freed, the threshold
rises to that buffer's size (up to 32 MB), and later buffers of that size come from the heap, where freed memory
stays resident. A training step frees and reallocates its temporaries every step, so the process's resident
memory drifts above XLA's compiled need by what the heap kept: 5-63 MB run to run on the small preset
(``benchmarks/results/rss_excess_small.txt``), 12 % over the plan at a 300 MB budget. Fixing the threshold
(``mallopt(M_MMAP_THRESHOLD, ...)``, what the ``MALLOC_MMAP_THRESHOLD_`` variable does at start-up) keeps every
buffer of that size or more mmapped, so what a step frees leaves the process. ``train`` and ``bench``'s measuring
workers call :func:`return_freed_buffers` before their first step; on another backend, or a C library without
``mallopt``, nothing changes.

>>> isinstance(return_freed_buffers(), bool)
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import jax

from remat_kit.units import check_int

#: The fixed mmap threshold: buffers of this many bytes or more are mmapped and unmapped when freed.
MMAP_THRESHOLD = 1 << 16

# glibc's <malloc.h>: the mallopt parameter for the mmap threshold, and the most it takes (64-bit).
_M_MMAP_THRESHOLD = -3
_MAX_THRESHOLD = 32 * 2**20


def return_freed_buffers(threshold: int = MMAP_THRESHOLD, *, platform: str | None = None) -> bool:
    """Fix the C allocator's mmap threshold so freed buffers of ``threshold`` bytes or more leave the process.

    Args:
      threshold: bytes, at least 1 and at most glibc's 32 MB cap.
      platform: the JAX backend the steps run on (default: ``jax.default_backend()``); only a CPU backend's
        buffers come from the C allocator.

    Returns:
      Whether it took effect: True on a CPU backend with glibc on Linux; False otherwise (nothing is changed then).

    Raises:
      ValueError: a threshold that is not an integer in 1 .. 32 MB, naming it.

    >>> return_freed_buffers(1 << 16, platform="gpu")
    False
    """
    check_int("threshold", threshold)
    if threshold > _MAX_THRESHOLD:
        raise ValueError(f"threshold must be at most {_MAX_THRESHOLD} bytes (glibc's cap), got {threshold}")
    if (platform or jax.default_backend()) != "cpu" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1
