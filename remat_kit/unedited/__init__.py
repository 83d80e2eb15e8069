"""Rematerialize an existing Flax model, Linen or NNX, without editing its code: :func:`apply` and :func:`names_of`.

:mod:`~remat_kit.unedited.entry` holds the public calls, :mod:`~remat_kit.unedited.linen` the Linen half and
:mod:`~remat_kit.unedited.nnx` the NNX half (each with its scan of repeated blocks),
:mod:`~remat_kit.unedited.scan` the conversion of repeated blocks into one scan that both halves share,
:mod:`~remat_kit.unedited.engine` what both halves share besides (the plan, static arguments, checking), and
:mod:`~remat_kit.unedited.paths` naming by module path. Each half imports the shared modules, which import
neither half: no callbacks across halves.
"""

from remat_kit.unedited.entry import Applied, apply, apply_factory, names_of

__all__ = ["Applied", "apply", "apply_factory", "names_of"]
