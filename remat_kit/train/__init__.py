"""Training the built-in model: config, the trainer, the loop, checkpoints and data (the step: ``remat_kit.step``).

``from remat_kit import train`` then ``train.train(train.TrainConfig(...), corpus)``; each name loads
its module on first use.
"""

from remat_kit._lazy import face

_LAZY = {
    "train": ("remat_kit.train.loop", "train"),
    "Trainer": ("remat_kit.train.trainer", "Trainer"),
    **{
        name: ("remat_kit.train.config", name)
        for name in (
            "MODEL_MAY_CHANGE",
            "RESUME_MAY_CHANGE",
            "RESUME_MUST_MATCH",
            "DivergedError",
            "RetraceError",
            "TrainConfig",
            "TrainResult",
            "TrainState",
            "check_compatible",
            "optimizer_for",
            "schedule_changes",
        )
    },
    "write_loss_plot": ("remat_kit.train.progress", "write_loss_plot"),
}

__getattr__, __dir__ = face(__name__, _LAZY, globals())

__all__ = sorted(_LAZY)
