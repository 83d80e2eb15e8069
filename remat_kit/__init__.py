"""remat_kit: choose, apply and measure activation rematerialization in JAX/Flax.

The public names load on first use (a module ``__getattr__``), so ``import remat_kit`` (and the
command line's ``--help``) imports neither jax nor the model, optax or the planner.
"""

import importlib

__version__ = "0.1.0"

#: Public name -> (module, attribute); an attribute of None means the module itself.
_LAZY = {
    "names": ("remat_kit.names", None),
    "policies": ("remat_kit.policies", None),
    "Policy": ("remat_kit.policies", "Policy"),
    "parse": ("remat_kit.policies", "parse"),
    "Stack": ("remat_kit.scan", "Stack"),
    "stack": ("remat_kit.scan", "stack"),
    "inspect": ("remat_kit.inspection", "inspect"),
    "compare": ("remat_kit.inspection", "compare"),
    "auto": ("remat_kit.budget", "auto"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'remat_kit' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = ["Policy", "Stack", "auto", "compare", "inspect", "names", "parse", "policies", "stack"]
