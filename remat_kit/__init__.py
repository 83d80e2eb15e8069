"""remat_kit: choose, apply and measure activation rematerialization in JAX/Flax.

The core (this folder) chooses, applies and inspects a policy; the wings above it are the built-in
model (``model/``), its training (``train/``), compile-only planning (``planning/``), the benchmark
runner (``bench/``) and the command line (``cli/``). The public names load on first use, so
``import remat_kit`` (and the command line's ``--help``) imports neither jax nor any wing.
"""

from remat_kit._lazy import face

__version__ = "0.1.0"

#: Public name -> (module, attribute); an attribute of None means the module itself.
_LAZY = {
    "names": ("remat_kit.names", None),
    "policies": ("remat_kit.policies", None),
    "nnx": ("remat_kit.nnx", None),
    "Policy": ("remat_kit.policies", "Policy"),
    "parse": ("remat_kit.policies", "parse"),
    "linen": ("remat_kit.linen", None),
    "remat": ("remat_kit.wrap", "remat"),
    "Stack": ("remat_kit.linen.scan", "Stack"),
    "stack": ("remat_kit.linen.scan", "stack"),
    "inspect": ("remat_kit.analysis.inspection", "inspect"),
    "compare": ("remat_kit.analysis.inspection", "compare"),
    "auto": ("remat_kit.planning.fit", "auto"),
    "fit": ("remat_kit.planning.fit", "fit"),
    "max_seq": ("remat_kit.planning.max_seq", "max_seq"),
    "tiled": ("remat_kit.policies.tiling", "tiled"),
    "apply": ("remat_kit.unedited.entry", "apply"),
    "names_of": ("remat_kit.unedited.entry", "names_of"),
    "apply_factory": ("remat_kit.unedited.entry", "apply_factory"),
    "head_loss": ("remat_kit.unedited.head", "head_loss"),
}

__getattr__, __dir__ = face(__name__, _LAZY, globals())

__all__ = [
    "Policy",
    "Stack",
    "apply",
    "apply_factory",
    "auto",
    "compare",
    "fit",
    "head_loss",
    "inspect",
    "linen",
    "max_seq",
    "names",
    "names_of",
    "nnx",
    "parse",
    "policies",
    "remat",
    "stack",
    "tiled",
]
