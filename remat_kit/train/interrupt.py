"""How a run stops on Ctrl-C or SIGTERM: a flag the loop reads between phases, never an exception inside JAX.

Imports no jax, so the command line installs it before JAX is imported: a signal at any moment, even
during ``import jax`` or inside XLA's compiler, only sets :attr:`StopOnSignal.requested` (and says so at
once). Raising ``KeyboardInterrupt`` from the handler would land wherever Python happens to be: inside
JAX's garbage-collection callback (where it is printed and swallowed, and the run goes on) or in the
middle of a compile (where unwinding crashed the process). The run checks the flag where stopping is
safe (:func:`check`): between start-up phases, and after each step, which it saves first.

>>> stop = StopOnSignal(log=print)
>>> stop.requested
False
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

#: The exit status of a run stopped by a signal (128 + SIGINT), as shells report Ctrl-C.
EXIT_INTERRUPTED = 130


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class StopOnSignal:
    """First Ctrl-C (SIGINT) or SIGTERM: stop at the next safe point, saving the current step; second: stop now.

    The first signal is acknowledged at once (:data:`MESSAGE`), even while the main thread is inside
    XLA's compiler, where Python runs no signal handler until the compile returns: the C-level handler
    writes the signal to a wake-up socket (``signal.set_wakeup_fd``) that a thread watches. With
    ``exit_at_once`` that thread also ends the process on the second signal, mid-compile too.

    Args:
      log: where the acknowledgement goes (default: stderr).
      exit_at_once: the second signal ends the process (``os._exit(130)``, the command line); otherwise
        it raises ``KeyboardInterrupt`` (a library caller's own loop).
    """

    MESSAGE = "stopping after this step… (press Ctrl-C again to stop at once, without saving)"
    AT_ONCE = "stopped at once (second Ctrl-C); nothing more was saved"

    def __init__(self, log: Callable[[str], None] = _stderr, *, exit_at_once: bool = False):
        self.requested = False
        self._log = log
        self._exit_at_once = exit_at_once
        self._acknowledged = threading.Event()
        self._old: dict[int, Any] = {}
        self._old_wakeup = None
        self._sockets = None
        self._watcher = None

    def _acknowledge(self) -> None:
        if not self._acknowledged.is_set():
            self._acknowledged.set()
            self._log(self.MESSAGE)

    def _exit_now(self) -> None:
        _stderr(self.AT_ONCE)
        os._exit(EXIT_INTERRUPTED)

    def _handle(self, signum, frame):
        if self.requested:
            if self._exit_at_once:
                self._exit_now()
            raise KeyboardInterrupt
        self.requested = True
        self._acknowledge()

    def _watch(self, sock) -> None:
        # Two signals that land while the main thread is inside XLA reach Python's handler as one (its
        # pending flag is a bool), so the watcher counts the wake-up bytes and ends the process itself.
        seen = 0
        with contextlib.suppress(OSError):
            while byte := sock.recv(1):  # b"" once the writing end is closed on exit
                if byte[0] in (signal.SIGINT, signal.SIGTERM):
                    seen += 1
                    self._acknowledge()
                    if seen >= 2 and self._exit_at_once:
                        self._exit_now()

    def __enter__(self):
        global _ACTIVE
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
        self._outer, _ACTIVE = _ACTIVE, self
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = self._outer
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._sockets is not None:
            signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
            read, write = self._sockets
            write.close()  # the watcher reads EOF and returns; only then is its socket closed
            self._watcher.join(timeout=5)
            read.close()
        return False


#: The innermost installed :class:`StopOnSignal` (the command line's, or a run's own).
_ACTIVE: StopOnSignal | None = None


@contextlib.contextmanager
def stop_requests(log: Callable[[str], None] = _stderr):
    """The installed :class:`StopOnSignal` if there is one (the command line's), else one installed for the block."""
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    with StopOnSignal(log) as stop:
        yield stop


def check(requested: bool, log: Callable[[str], None], where: str) -> None:
    """Raise ``KeyboardInterrupt`` (a plain Python exception, here where unwinding is safe) if a stop was asked.

    Args:
      requested: :attr:`StopOnSignal.requested` (or-ed over the processes of a multi-process run).
      log: where the one line saying where the run stopped goes.
      where: what the run had reached, e.g. "before step 1 (nothing to save)".
    """
    if requested:
        log(f"interrupted {where}")
        raise KeyboardInterrupt
