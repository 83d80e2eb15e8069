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


class FactoryError(Exception):
    """The user's factory, or the loss it returned, raised an exception of its own (not a TypeError or
    ValueError: those are bad values, said in one line). The exception is the ``__cause__``: its traceback
    is the user's to read (the command line prints it above this one line)."""


def _called(factory: Callable, policy, where: str) -> tuple[Callable, tuple]:
    try:
        out = factory(policy)
    except Exception as err:
        message = f"{where}(policy {policy}) raised {type(err).__name__}: {_first_line(err)}"
        if _bad_value(err):
            raise (TypeError if isinstance(err, TypeError) else ValueError)(message) from None
        raise FactoryError(message) from err
    if not isinstance(out, tuple) or len(out) != 2 or not callable(out[0]) or not isinstance(out[1], (tuple, list)):
        raise TypeError(f"{where}(policy) must return (loss_fn, example_args), got {type(out).__name__}")
    return out[0], tuple(out[1])


def _bad_value(err: BaseException) -> bool:
    """Whether ``err`` says the values were wrong (a TypeError or ValueError, or JAX's or Flax's own errors: a
    parameter of another shape) rather than being the user's own exception (which keeps its traceback)."""
    library = type(err).__module__.split(".")[0] in ("jax", "jaxlib", "flax")
    return library or isinstance(err, (TypeError, ValueError))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def describe_args(args: tuple) -> str:
    """Each argument's dtype and shape (a pytree: its leaf count), as messages show them.

    >>> import jax, jax.numpy as jnp
    >>> describe_args((jax.ShapeDtypeStruct((3, 4), jnp.float32), {"w": jnp.ones(2), "b": jnp.ones(1)}, 7))
    'float32[3,4], a pytree of 2 arrays, int'
    """
    import jax

    def one(x) -> str:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return f"{x.dtype}[{','.join(map(str, x.shape))}]"
        leaves = jax.tree.leaves(x)
        if len(leaves) == 1 and leaves[0] is x:
            return type(x).__name__
        return f"a pytree of {len(leaves)} arrays"

    return ", ".join(one(x) for x in args)


def check_traces(loss_fn: Callable, example: tuple, where: str, policy="none") -> None:
    """Trace ``loss_fn(*example)`` (``jax.eval_shape``: nothing computed) and refuse, in one line naming the
    factory and the arguments' shapes, inputs it cannot take (a TypeError or ValueError, or JAX's or Flax's own).

    Raises:
      ValueError: the loss cannot take the example arguments (shapes, dtypes) or returns no float scalar.
      FactoryError: the loss raised an exception of its own (its traceback is the cause).

    >>> import jax.numpy as jnp
    >>> check_traces(lambda w, x: (x @ w).sum(), (jnp.ones((3, 2)), jnp.ones((4, 3))), "m:f")
    >>> try:
    ...     check_traces(lambda w, x: (x @ w).sum(), (jnp.ones((3, 2)), jnp.ones((4, 5))), "m:f")
    ... except ValueError as err:
    ...     print(str(err).split(" under ")[0])
    m:f: its loss_fn cannot take its example_args (float32[3,2], float32[4,5])
    """
    import jax

    try:
        out = jax.eval_shape(loss_fn, *example)
    except Exception as err:
        if _bad_value(err):
            raise ValueError(
                f"{where}: its loss_fn cannot take its example_args ({describe_args(example)}) under policy "
                f"{policy}: {_first_line(err)}"
            ) from None
        raise FactoryError(f"{where}: its loss_fn raised {type(err).__name__}: {_first_line(err)}") from err
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != () or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        got = type(out).__name__ if shape is None else f"{dtype}[{','.join(map(str, shape))}]"
        raise ValueError(
            f"{where}: its loss_fn must return a floating-point scalar (the loss), got {got} from example_args "
            f"({describe_args(example)})"
        )


def model_from_factory(factory: Callable, where: str = "the factory") -> tuple[Callable, tuple]:
    """``(make_loss, example_args)`` from ``factory(policy) -> (loss_fn, example_args)``, checked on ``none``:
    the loss is traced once on its example arguments (nothing is compiled), so a shape the loss cannot take
    is one line naming the factory before anything else runs.

    Raises:
      TypeError/ValueError: the factory returns something else, or its loss cannot take its arguments.
      FactoryError: the factory or its loss raised an exception of its own (its traceback is the cause).
    """
    loss_fn, example = _called(factory, policies.none(), where)
    check_traces(loss_fn, example, where)
    return (lambda p: _called(factory, p, where)[0]), example


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
      ValueError: the loss emits no name (nothing rematerialized under ``full``), or cannot take its arguments.
      FactoryError: the factory or its loss raised an exception of its own (its traceback is the cause).

    >>> import jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> f = lambda p: (lambda x: p(lambda x: checkpoint_name(x * 2, "h").sum())(x), (jnp.ones(3),))
    >>> names_from_factory(f).names
    ('h',)
    """
    import jax

    loss_fn, example = _called(factory, policies.full(), where)
    check_traces(loss_fn, example, where, "full")
    rows = _jax_internals.jaxpr_tags(jax.make_jaxpr(loss_fn)(*example))
    if not rows:
        raise ValueError(
            f"{where}: its loss emits no names under policy full; rematerialize its blocks in the factory "
            "(remat_kit.apply_factory(model, loss), remat_kit.stack, or the model's own checkpoint_name tags)"
        )
    return NameTable(f"the loss of {where} under full", tuple(BlockName(*r, "traced") for r in rows))
