"""One writer per checkpoint directory: a lock file held with ``fcntl.flock`` for the length of a run.

The kernel releases a ``flock`` when its holder dies, however it dies (``kill -9`` included), so a lock
is never left stuck: the file stays (with a killed holder's details, emptied by one that ends) but holds
nothing. A second run on
the same directory is refused at start, naming the holder. In a multi-process run, which shares one
directory by design, process 0 alone takes the lock (:func:`remat_kit.train.loop.train`).

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d, DirectoryLock(d) as lock:
...     lock.path.name
'.remat-kit.lock'
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

#: The lock file's name inside a checkpoint directory (orbax lists only numbered step folders).
LOCK_NAME = ".remat-kit.lock"


class DirectoryInUseError(OSError):
    """Another live process holds the directory's lock."""


class DirectoryLock:
    """An exclusive, non-blocking lock on ``directory`` (created if needed), released on exit or death.

    Args:
      directory: the folder to lock.

    Raises:
      DirectoryInUseError: on entering, when another process holds it (the message names its pid,
        host and start time).
    """

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory).absolute() / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        """Take the lock now or raise :class:`DirectoryInUseError`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise DirectoryInUseError(
                    f"checkpoint directory {str(self.path.parent)!r} is in use by another run ({holder}); wait for "
                    "it to finish, stop it, or choose another --checkpoint-dir"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # locked a file its holder removed (discard) after this open: take the one there now
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock back: the holder's details are cleared, so a run that ends leaves the file empty."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.ftruncate(fd, 0)  # a finished or refused run changes nothing in the directory it visited
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def discard(self) -> None:
        """Remove the lock file and give the lock back (a refused run leaves nothing behind).

        Removed while held, so a run waiting on the old file finds it gone and takes the new one.
        """
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self.release()

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
