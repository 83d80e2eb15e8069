"""Flax Linen: a policy on a Linen class (:mod:`~remat_kit.linen.wrap`) and the Linen stack (``scan``).

``remat_kit.stack`` is :func:`remat_kit.linen.stack`; ``policy(MyBlock)`` lands in
:func:`remat_kit.linen.wrap.remat_class` through :func:`remat_kit.remat`.
"""

from remat_kit.linen.scan import PeriodStack, Stack, stack

__all__ = ["PeriodStack", "Stack", "stack"]
