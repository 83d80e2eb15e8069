"""Names and defaults the command line shows in ``--help``, in a module that imports nothing heavy.

``remat-kit --help`` must answer at once, so the parser cannot import jax, flax or optax; the
library modules take these values from here, so each is defined once (the preset names alone are
repeated, as the keys of the model's ``PRESETS``; ``tests/test_cli.py`` checks they agree).
"""

from __future__ import annotations

#: Model presets (:data:`remat_kit.model.transformer.PRESETS` holds their configs).
PRESET_NAMES: tuple[str, ...] = ("tiny", "small", "2b")

#: (batch, seq) each preset is measured at by default (:data:`remat_kit.model.transformer.PRESET_SHAPES`).
PRESET_SHAPES: dict[str, tuple[int, int]] = {"tiny": (2, 32), "small": (4, 256), "2b": (2, 1024)}

#: Compute and parameter dtypes a model accepts (:data:`remat_kit.model.transformer.DTYPES`).
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

#: Attention implementations (:mod:`remat_kit.model.attention`).
ATTENTION_KINDS: tuple[str, ...] = ("auto", "xla", "chunked", "cudnn")

#: Layers a LoRA adapter can target, and the frozen base's storage modes (:mod:`remat_kit.model.lora`).
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "attn_out", "mlp_gate", "mlp_up", "mlp_out")
QUANTIZE_MODES: tuple[str, ...] = ("none", "int8", "nf4")

#: Devices a planner compiles for (:data:`remat_kit.target.TARGET_NAMES`; a GPU config file's path works too).
TARGET_NAMES: tuple[str, ...] = ("local", "cpu", "h100", "h200", "a100")

#: The policies ``plan`` compares by default: one of each kind.
PLAN_POLICIES: tuple[str, ...] = ("none", "full", "every_n:2", "selective", "offload", "segments:4", "sqrt_n", "dots")

#: The policies ``bench`` compares by default.
BENCH_POLICIES: tuple[str, ...] = ("none", "full", "every_n:2", "selective", "offload", "sqrt_n")

#: Candidates for a model given as ``--model MODULE:FACTORY`` (:data:`remat_kit.planning.budget.GENERIC_CANDIDATES`).
GENERIC_CANDIDATES: tuple[str, ...] = ("none", "dots", "full")

#: ``plan --budget``'s default safety margin (:data:`remat_kit.planning.budget.DEFAULT_MARGIN`).
DEFAULT_MARGIN = 0.10

#: ``remat-kit train``'s defaults, which are :class:`remat_kit.train.TrainConfig`'s (it reads them here).
TRAIN_DEFAULTS = {
    "steps": 100,
    "batch_size": 8,
    "seq_len": 0,
    "grad_accum": 1,
    "learning_rate": 3e-3,
    "warmup_steps": -1,
    "weight_decay": 0.01,
    "clip_norm": 1.0,
    "loss_chunks": "auto",
    "seed": 0,
    "val_fraction": 0.05,
    "eval_every": 50,
    "eval_batches": 4,
}

#: JAX's own defaults for joining a multi-process run and for its heartbeat, in seconds.
JAX_JOIN_TIMEOUT_S = 300
JAX_HEARTBEAT_TIMEOUT_S = 100
