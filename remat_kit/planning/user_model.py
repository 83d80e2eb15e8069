"""A model the user wrote, given as ``MODULE:FACTORY``: the factory loaded and its ``(loss_fn, inputs)`` checked.

``factory(policy) -> (loss_fn, example_args)`` is the one contract ``plan``, ``bench``, ``tags`` and
``auto`` need for a model remat_kit did not build: ``loss_fn(*example_args)`` is the scalar loss of the
model under ``policy`` (for an unedited model, ``remat_kit.apply_factory(model, loss)(policy)``), and
``example_args`` are its arguments (arrays or ``jax.ShapeDtypeStruct``: nothing needs allocating).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from remat_kit import _jax_internals, policies
from remat_kit.unedited.paths import BlockName, NameTable


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


def _called(factory: Callable, policy, where: str) -> tuple[Callable, tuple]:
    out = factory(policy)
    if not isinstance(out, tuple) or len(out) != 2 or not callable(out[0]) or not isinstance(out[1], (tuple, list)):
        raise TypeError(f"{where}(policy) must return (loss_fn, example_args), got {type(out).__name__}")
    return out[0], tuple(out[1])


def model_from_factory(factory: Callable, where: str = "the factory") -> tuple[Callable, tuple]:
    """``(make_loss, example_args)`` from ``factory(policy) -> (loss_fn, example_args)``, checked on ``none``."""
    _, example = _called(factory, policies.none(), where)
    return (lambda p: factory(p)[0]), example


def names_from_factory(factory: Callable, where: str = "the factory") -> NameTable:
    """The names the factory's loss emits under ``full`` (what a policy can keep), with shape, dtype and bytes.

    ``full`` rematerializes every block, so every name a block emits is in the traced loss: the paths
    ``remat_kit.apply`` gives an unedited model's values (``attn/q_einsum``), a stack's ``layer_input``
    and the model's own ``checkpoint_name`` tags. Traces only (``jax.make_jaxpr``): nothing is compiled.

    Args:
      factory: ``factory(policy) -> (loss_fn, example_args)``.
      where: how to name the factory in messages (``MODULE:FACTORY``).

    Returns:
      A :class:`remat_kit.unedited.paths.NameTable` (source ``"traced"``: read from the loss, not a block).

    Raises:
      TypeError: the factory returns something else.
      ValueError: the loss emits no name (nothing rematerialized under ``full``).

    >>> import jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> f = lambda p: (lambda x: p(lambda x: checkpoint_name(x * 2, "h").sum())(x), (jnp.ones(3),))
    >>> names_from_factory(f).names
    ('h',)
    """
    import jax

    loss_fn, example = _called(factory, policies.full(), where)
    rows = _jax_internals.jaxpr_tags(jax.make_jaxpr(loss_fn)(*example))
    if not rows:
        raise ValueError(
            f"{where}: its loss emits no names under policy full; rematerialize its blocks in the factory "
            "(remat_kit.apply_factory(model, loss), remat_kit.stack, or the model's own checkpoint_name tags)"
        )
    return NameTable(f"the loss of {where} under full", tuple(BlockName(*r, "traced") for r in rows))
