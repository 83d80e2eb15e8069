"""The benchmark runner: real training steps per policy, each in a fresh worker process, and its report."""

from remat_kit._lazy import face

_LAZY = {"run_bench": ("remat_kit.bench.run", "run_bench")}

__getattr__, __dir__ = face(__name__, _LAZY, globals())

__all__ = sorted(_LAZY)
