"""Rematerialize an existing Flax model, Linen or NNX, without editing its code: :func:`apply` and :func:`names_of`.

:mod:`~remat_kit.unedited.entry` holds the public calls and the Linen half, :mod:`~remat_kit.unedited.nnx`
the NNX half, :mod:`~remat_kit.unedited.scan` the conversion of repeated blocks into one scan,
:mod:`~remat_kit.unedited.engine` what both halves share (the plan, static arguments, checking), and
:mod:`~remat_kit.unedited.paths` naming by module path.
"""

from remat_kit.unedited.entry import Applied, apply, apply_factory, names_of

__all__ = ["Applied", "apply", "apply_factory", "names_of"]
