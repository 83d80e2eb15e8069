"""The built-in transformer LM, a user of the core: its layers, attention, loss and LoRA adapters.

``from remat_kit.model import Transformer, TransformerConfig, init_params`` loads only the model.
"""

from remat_kit._lazy import face

_LAZY = {
    name: ("remat_kit.model.transformer", name)
    for name in (
        "Block",
        "DTYPES",
        "PRESETS",
        "PRESET_SHAPES",
        "Transformer",
        "TransformerConfig",
        "abstract_params",
        "check_tokens",
        "init_params",
    )
}

__getattr__, __dir__ = face(__name__, _LAZY, globals())

__all__ = sorted(_LAZY)
