"""Flax NNX: a policy on an NNX instance (the owning wrapper, :mod:`~remat_kit.nnx.wrap`) and the NNX stack.

``remat_kit.nnx.stack(make_block, L, policy, rngs=rngs)`` builds ``L`` blocks stacked on axis 0 and
runs them under one scan (:mod:`~remat_kit.nnx.scan`); ``policy(instance)`` returns a
:class:`~remat_kit.nnx.wrap.Remat` that owns the instance (a captured module gets no gradients).
"""

from remat_kit.nnx.scan import PeriodStack, Stack, stack
from remat_kit.nnx.wrap import Remat

__all__ = ["PeriodStack", "Remat", "Stack", "stack"]
