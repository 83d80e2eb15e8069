"""How a run stops on Ctrl-C or SIGTERM: a flag the loop reads between phases, never an exception inside JAX.

Imports no jax, so the command line installs it before JAX is imported: a signal at any moment, even
during ``import jax`` or inside XLA's compiler, only sets :attr:`StopOnSignal.requested` (and says so at
once). Raising ``KeyboardInterrupt`` from the handler would land wherever Python happens to be: inside
JAX's garbage-collection callback (where it is printed and swallowed, and the run goes on) or in the
middle of a compile (where unwinding crashed the process). The run checks the flag where stopping is
safe (:func:`check`): between start-up phases, and after each step, which it saves first.

A command with nothing to save (``plan``, ``bench``, ``tags``) uses :class:`ExitOnSignal` instead: the
signal ends the process at once, from any thread, after the :func:`on_exit` cleanups.

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


#: Called, most recent first, just before a signal ends the process at once (:func:`on_exit`).
_CLEANUPS: list[Callable[[], Any]] = []


@contextlib.contextmanager
def on_exit(cleanup: Callable[[], Any]):
    """Within the block, ``cleanup()`` runs if a signal ends the process at once (``os._exit`` skips ``finally``).

    For what must not outlive the process: a worker process to kill, a temporary folder to remove. It runs
    on whichever thread ends the process, so it must be quick and may not wait on the main thread.

    >>> with on_exit(lambda: None):
    ...     len(_CLEANUPS)
    1
    """
    _CLEANUPS.append(cleanup)
    try:
        yield
    finally:
        _CLEANUPS.remove(cleanup)


def exit_now(message: str) -> None:
    """Run the :func:`on_exit` cleanups, write ``message`` to stderr and end the process with status 130.

    Written with ``os.write``: the main thread may hold ``sys.stderr``'s lock, or sit inside XLA.
    """
    for cleanup in reversed(list(_CLEANUPS)):
        with contextlib.suppress(Exception):
            cleanup()
    with contextlib.suppress(OSError):
        os.write(2, f"{message}\n".encode())
    os._exit(EXIT_INTERRUPTED)


class _SignalWatch:
    """Handles SIGINT and SIGTERM from Python and from a thread reading the C-level wake-up writes.

    Python runs a signal handler only on the main thread, between bytecodes: not while that thread is
    inside XLA's compiler. The C-level handler also writes the signal to a wake-up socket
    (``signal.set_wakeup_fd``) that a thread watches, so a signal is seen at once wherever the main
    thread is. Subclasses say what a signal does: :meth:`_handle` (main thread) and :meth:`_seen` (watcher).
    """

    def __init__(self):
        self._old: dict[int, Any] = {}
        self._old_wakeup = None
        self._sockets = None
        self._watcher = None

    def _handle(self, signum, frame) -> None:
        raise NotImplementedError

    def _seen(self, count: int) -> None:
        raise NotImplementedError

    def _watch(self, sock) -> None:
        # Two signals that land while the main thread is inside XLA reach Python's handler as one (its
        # pending flag is a bool), so the watcher counts the wake-up bytes itself.
        seen = 0
        with contextlib.suppress(OSError):
            while byte := sock.recv(1):  # b"" once the writing end is closed on exit
                if byte[0] in (signal.SIGINT, signal.SIGTERM):
                    seen += 1
                    self._seen(seen)

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
        self._old = {}
        if self._sockets is not None:
            signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
            read, write = self._sockets
            write.close()  # the watcher reads EOF and returns; only then is its socket closed
            self._watcher.join(timeout=5)
            read.close()
            self._sockets = None
        return False


class ExitOnSignal(_SignalWatch):
    """Ctrl-C (SIGINT) or SIGTERM ends the process at once with status 130, even mid-compile: for a command
    with nothing to save (``plan``, ``bench``, ``tags``, ``policies``) and the command line's start-up.

    Raising ``KeyboardInterrupt`` instead would land wherever Python happens to be: inside JAX's
    garbage-collection callback (printed and swallowed: the command runs on to the end), halfway
    through importing a compiled extension (a crash), or on the main thread only after a compile
    returns, and behind a thread pool's queue of compiles. The :func:`on_exit` cleanups run first.

    Args:
      message: the one line written to stderr (settable later: the command is known after parsing).

    >>> with ExitOnSignal("remat-kit: interrupted") as guard:
    ...     guard.message = "remat-kit plan: interrupted"  # a Ctrl-C now would end the process with this line
    """

    def __init__(self, message: str):
        super().__init__()
        self.message = message
        self._once = threading.Lock()

    def _exit(self) -> None:
        if self._once.acquire(blocking=False):  # the main thread's handler and the watcher may both get here
            exit_now(self.message)

    def _handle(self, signum, frame) -> None:
        self._exit()

    def _seen(self, count: int) -> None:
        self._exit()


class StopOnSignal(_SignalWatch):
    """First Ctrl-C (SIGINT) or SIGTERM: stop at the next safe point, saving the current step; second: stop now.

    The first signal is acknowledged at once (:data:`MESSAGE`), even while the main thread is inside
    XLA's compiler (see :class:`_SignalWatch`). With ``exit_at_once`` the watcher also ends the process
    on the second signal, mid-compile too.

    Args:
      log: where the acknowledgement goes (default: stderr).
      exit_at_once: the second signal ends the process (``os._exit(130)``, the command line); otherwise
        it raises ``KeyboardInterrupt`` (a library caller's own loop).
    """

    MESSAGE = "stopping after this step… (press Ctrl-C again to stop at once, without saving)"
    AT_ONCE = "stopped at once (second Ctrl-C); nothing more was saved"

    def __init__(self, log: Callable[[str], None] = _stderr, *, exit_at_once: bool = False):
        super().__init__()
        self.requested = False
        self._log = log
        self._exit_at_once = exit_at_once
        self._acknowledged = threading.Event()

    def _acknowledge(self) -> None:
        if not self._acknowledged.is_set():
            self._acknowledged.set()
            self._log(self.MESSAGE)

    def _exit_now(self) -> None:
        exit_now(self.AT_ONCE)

    def _handle(self, signum, frame):
        if self.requested:
            if self._exit_at_once:
                self._exit_now()
            raise KeyboardInterrupt
        self.requested = True
        self._acknowledge()

    def _seen(self, count: int) -> None:
        self._acknowledge()
        if count >= 2 and self._exit_at_once:
            self._exit_now()

    def __enter__(self):
        global _ACTIVE
        super().__enter__()
        self._outer, _ACTIVE = _ACTIVE, self
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = self._outer
        return super().__exit__(*exc)


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
