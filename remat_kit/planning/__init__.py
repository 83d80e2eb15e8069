"""Compile-only planning: what a step needs under each policy, and which policy fits a budget.

Nothing here allocates a model or runs a step; every figure comes from a compiled program.
"""

from remat_kit._lazy import face

_LAZY = {
    "auto": ("remat_kit.planning.fit", "auto"),
    "AutoResult": ("remat_kit.planning.budget", "AutoResult"),
    "analyze": ("remat_kit.planning.analysis", "analyze"),
    "Analysis": ("remat_kit.planning.analysis", "Analysis"),
    "max_fit": ("remat_kit.planning.builtin", "max_fit"),
}

__getattr__, __dir__ = face(__name__, _LAZY, globals())

__all__ = sorted(_LAZY)
