"""What a training loop shows and how it stops: the progress bar, Ctrl-C handling and the loss plot."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from remat_kit.train.interrupt import StopOnSignal


def _any_process(flag: bool) -> bool:
    """``flag`` or-ed over all processes (every process must call it; free in one process)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


#: Kept under its old name: the loop's Ctrl-C handling lives in :mod:`remat_kit.train.interrupt` (no jax).
_StopOnSignal = StopOnSignal


class _NoBar:
    def __init__(self, log: Callable[[str], None]):
        self._log = log

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, record):
        pass

    def print(self, msg):
        self._log(msg)


class _RichBar(_NoBar):
    def __init__(self, total: int, done: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[speed]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task = self._progress.add_task("train", total=total, completed=done, loss="-", speed="")

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self._progress.__exit__(*exc)

    def advance(self, record):
        self._progress.update(
            self._task, advance=1, loss=f"{record['loss']:.4f}", speed=f"{record['tokens_per_s']:,.0f} tok/s"
        )

    def print(self, msg):
        self._progress.console.print(msg)


def _progress(enabled: bool, total: int, done: int, log: Callable[[str], None]):
    return _RichBar(total, done) if enabled else _NoBar(log)


def write_loss_plot(history: Sequence[dict[str, Any]], path: str | os.PathLike, title: str = "") -> Path:
    """Save the training (and validation) loss curve of metrics records as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], label="train loss", lw=1)
    val = [r for r in history if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
