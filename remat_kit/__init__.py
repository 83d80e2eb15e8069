"""remat_kit: choose, apply and measure activation rematerialization in JAX/Flax."""

import importlib

from remat_kit import names, policies
from remat_kit.policies import Policy, parse
from remat_kit.scan import Stack, stack

# Loaded on first use, so that ``import remat_kit`` does not pull in optax, the model or the planner.
_LAZY = {
    "inspect": ("remat_kit.inspection", "inspect"),
    "compare": ("remat_kit.inspection", "compare"),
    "auto": ("remat_kit.budget", "auto"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'remat_kit' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = ["Policy", "Stack", "auto", "compare", "inspect", "names", "parse", "policies", "stack"]
__version__ = "0.1.0"
