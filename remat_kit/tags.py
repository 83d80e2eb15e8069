"""The one tag rule, shared by every place a policy is applied.

A selective or offload policy names ``checkpoint_name`` tags. A name the wrapped code never emits
would silently turn into "recompute it" (MaxText's silent failure), so wherever a policy is applied
(a function, a Linen class, a Linen or NNX stack, an NNX instance) the wrapper traces the code once
per input signature and calls :func:`check` with the tags actually emitted.

>>> import jax, jax.numpy as jnp
>>> from remat_kit import policies
>>> from remat_kit.names import tag
>>> f = lambda x: tag(jnp.sin(x), "mlp_up")
>>> emitted = emitted_tags(f, jax.ShapeDtypeStruct((2,), jnp.float32))
>>> sorted(emitted)
['mlp_up']
>>> check(policies.selective(["mlp_upp"]), emitted, "f")
Traceback (most recent call last):
...
ValueError: policy selective:mlp_upp names tags that f never emits: mlp_upp (did you mean 'mlp_up'?); it emits: mlp_up
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

from remat_kit import _jax_internals


def emitted_tags(fn: Callable, *args: Any) -> frozenset[str]:
    """The ``checkpoint_name`` tags ``fn(*args)`` attaches; ``args`` may be ShapeDtypeStructs.

    Traces only (``jax.make_jaxpr``): nothing is compiled or allocated.
    """
    return _jax_internals.emitted_tags(fn, *args)


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (difflib ratio ≥ 0.6), or None.

    >>> nearest("mlp_upp", ["mlp_up", "mlp_gate"])
    'mlp_up'
    """
    found = difflib.get_close_matches(name, sorted(candidates), n=1)
    return found[0] if found else None


def missing(policy, emitted: Iterable[str]) -> tuple[str, ...]:
    """The tags ``policy`` names that are not in ``emitted``, in the policy's order."""
    emitted = frozenset(emitted)
    return tuple(t for t in policy.tags if t not in emitted)


def check(policy, emitted: Iterable[str], where: str) -> None:
    """Raise ValueError if ``policy`` names a tag that the code called ``where`` never emits.

    Args:
      policy: a :class:`remat_kit.policies.Policy`.
      emitted: the tags the wrapped code attaches (see :func:`emitted_tags`).
      where: what was wrapped, for the message (``"MyBlock"``, ``"function f"``).

    Raises:
      ValueError: naming the missing tags, the nearest emitted name for each, and every emitted tag.
    """
    emitted = frozenset(emitted)
    gone = missing(policy, emitted)
    if not gone:
        return
    described = []
    for t in gone:
        near = nearest(t, emitted)
        described.append(f"{t} (did you mean {near!r}?)" if near else t)
    raise ValueError(
        f"policy {policy} names tags that {where} never emits: {', '.join(described)}; "
        f"it emits: {', '.join(sorted(emitted)) or '(no tags)'}"
    )
