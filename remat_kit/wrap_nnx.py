"""Apply a policy to a Flax NNX module instance (placeholder: the NNX helper replaces this)."""

from __future__ import annotations

from typing import Any


def remat(policy: Any, module: Any, *, static_argnums: tuple[int, ...] = (), prevent_cse: bool = True) -> Any:
    """Return an ``nnx.Module`` that owns ``module`` and runs its ``__call__`` under ``nnx.remat``.

    ``policy`` is a :class:`remat_kit.policies.Policy` (duck-typed: this module never imports
    policies, which imports it).
    """
    raise NotImplementedError("remat_kit.wrap_nnx.remat is not written yet")
