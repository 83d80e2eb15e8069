"""What a training loop shows and how it stops: the progress bar, Ctrl-C handling and the loss plot."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np


def _any_process(flag: bool) -> bool:
    """``flag`` or-ed over all processes (every process must call it; free in one process)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


class _StopOnSignal:
    """First Ctrl-C (SIGINT) or SIGTERM: finish and save the current step, then stop; second: stop now.

    The first signal is acknowledged at once ("stopping after this step…"), even while the main thread
    is inside XLA's compiler, where Python runs no signal handler until the compile returns: the C-level
    handler writes the signal to a wake-up socket (``signal.set_wakeup_fd``) that a thread watches.
    """

    MESSAGE = "stopping after this step… (press Ctrl-C again to stop at once, without saving)"

    def __init__(self, log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)):
        self.requested = False
        self._log = log
        self._acknowledged = threading.Event()
        self._old: dict[int, Any] = {}
        self._old_wakeup = None
        self._sockets = None

    def _acknowledge(self) -> None:
        if not self._acknowledged.is_set():
            self._acknowledged.set()
            self._log(self.MESSAGE)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._acknowledge()

    def _watch(self, sock) -> None:
        with contextlib.suppress(OSError):
            while byte := sock.recv(1):  # b"" once the writing end is closed on exit
                if byte[0] in (signal.SIGINT, signal.SIGTERM):
                    self._acknowledge()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
            import socket

            read, write = socket.socketpair()
            write.setblocking(False)
            self._sockets = (read, write)
            self._old_wakeup = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
            self._watcher = threading.Thread(target=self._watch, args=(read,), daemon=True, name="remat-kit-signal")
            self._watcher.start()
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._sockets is not None:
            signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
            read, write = self._sockets
            write.close()  # the watcher reads EOF and returns; only then is its socket closed
            self._watcher.join(timeout=5)
            read.close()
        return False


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

