"""A model the user wrote, given as ``MODULE:FACTORY``: the factory loaded and its ``(loss_fn, inputs)`` checked.

``factory(policy) -> (loss_fn, example_args)`` is the one contract ``plan``, ``bench`` and ``auto`` need
for a model remat_kit did not build.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from remat_kit import policies


def load_factory(text: str) -> Callable:
    """``"package.module:factory"`` → the factory, imported (the working directory is importable).

    Raises:
      ValueError: the text is not ``MODULE:FACTORY``, the module cannot be imported or lacks the name.
      TypeError: the name is not callable.
    """
    module_name, sep, attr = str(text).partition(":")
    if not sep or not module_name or not attr or not all(p.isidentifier() for p in [*module_name.split("."), attr]):
        raise ValueError(f"--model {text!r} must be MODULE:FACTORY, e.g. mypkg.models:make_loss")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {text!r}: cannot import {module_name!r}: {err}") from None
    if not hasattr(module, attr):
        raise ValueError(f"--model {text!r}: module {module_name!r} has no {attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise TypeError(f"--model {text!r}: {attr!r} is a {type(factory).__name__}, not a callable")
    return factory


def model_from_factory(factory: Callable, where: str = "the factory") -> tuple[Callable, tuple]:
    """``(make_loss, example_args)`` from ``factory(policy) -> (loss_fn, example_args)``, checked on ``none``."""
    out = factory(policies.none())
    if not isinstance(out, tuple) or len(out) != 2 or not callable(out[0]) or not isinstance(out[1], (tuple, list)):
        raise TypeError(f"{where}(policy) must return (loss_fn, example_args), got {type(out).__name__}")
    return (lambda p: factory(p)[0]), tuple(out[1])
