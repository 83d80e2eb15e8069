"""Strict JAX settings for the suite, and shared helpers."""

import os

# The suite compiles about two thousand small programs, and on CPU half of each compile is LLVM optimizing the
# machine code. What the tests check is decided before that, by XLA's HLO passes (what is saved, recomputed,
# fused and live, and the numbers both sides of a comparison compute alike), so the suite runs at LLVM's -O0:
# about half the CPU time. Set before jax is imported (XLA reads the flags once); subprocesses inherit it,
# and test_multiprocess passes it to the processes it compares with this one.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")
# Four simulated CPU devices so the mesh tests run in CI; unsharded tests use device 0.
jax.config.update("jax_num_cpu_devices", 4)

#: Every policy kind, as spec strings, with readable test ids.
ALL_SPECS = ["none", "full", "every_n:2", "selective", "offload", "segments:2", "sqrt_n", "dots"]

#: Relative tolerance for float32 gradients (never loosened to pass).
RTOL_F32 = 1e-5


def max_rel_err(a, b) -> float:
    """Max over leaves of ||a - b||_inf / ||b||_inf (a leaf of zeros compares absolutely)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape
        scale = max(np.max(np.abs(y)), 1e-30)
        worst = max(worst, float(np.max(np.abs(x - y)) / scale))
    return worst


@pytest.fixture
def tokens():
    return jax.random.randint(jax.random.key(1), (2, 16), 0, 256, dtype=jnp.int32)
