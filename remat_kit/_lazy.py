"""The lazy face of a package: public names that import their module on first use.

``import remat_kit`` (and ``remat-kit --help``) must not import jax, Flax or optax, and a wing's face
(``remat_kit.model``, ``remat_kit.train``) must not import the whole wing to give one name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def face(package: str, lazy: Mapping[str, tuple[str, str | None]], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for a package whose ``lazy`` maps a public name to ``(module, attribute)``.

    An attribute of None means the module itself. The value is cached in the package's ``namespace``.

    >>> ns = {}
    >>> getattr_, dir_ = face("pkg", {"sqrt": ("math", "sqrt")}, ns)
    >>> getattr_("sqrt")(4.0), "sqrt" in ns, dir_()
    (2.0, True, ['sqrt'])
    """

    def __getattr__(name: str):
        if name in lazy:
            module_name, attr = lazy[name]
            module = importlib.import_module(module_name)
            value = module if attr is None else getattr(module, attr)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted({*(k for k in namespace if not k.startswith("__")), *lazy})

    return __getattr__, __dir__
