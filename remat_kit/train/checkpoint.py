"""Training checkpoints on disk with orbax-checkpoint: save, keep the last N, restore safely.

Each step directory holds two orbax items: ``state`` (a pytree of arrays: parameters, optimizer
state, step, data position, RNG) and ``meta`` (JSON: model and training config, data fingerprint
and a SHA-256 of the state). Orbax writes each step to a temporary directory and renames it when
complete, so a killed run never leaves a half-written step behind. A step that still fails to
restore, or whose arrays do not match the recorded hash, is reported, moved aside (never
deleted) and the previous good step is used.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from remat_kit.units import check_int

#: Prefix of the folder a corrupt step is moved to (orbax does not list it as a step).
CORRUPT_PREFIX = "corrupt-step-"


class CheckpointWarning(UserWarning):
    """A checkpoint step could not be used and was skipped."""


#: What a failed orbax read echoes besides its own error: asyncio's report of each per-array future
#: whose failure nobody awaited (one traceback per array: 100-200 lines for a small model), and
#: tensorstore callbacks that reach the already closed event loop.
_ECHOES = ("exception was never retrieved", "Event loop is closed")


def _is_echo(text: str) -> bool:
    return any(e in text for e in _ECHOES)


class _Echoes:
    """While installed, drops the echoes of a failed orbax read or write (:data:`_ECHOES`) from asyncio's log
    and from the three hooks Python reports stray errors through (tensorstore's callbacks into a closed
    loop arrive through ``sys.unraisablehook``); everything else passes on to the hooks it replaced."""

    def install(self) -> _Echoes:
        self._logger, self._drop = logging.getLogger("asyncio"), logging.Filter()
        self._drop.filter = lambda record: not _is_echo(record.getMessage())
        self._hooks = hooks = sys.excepthook, sys.unraisablehook, threading.excepthook

        def excepthook(kind, value, tb):
            if not _is_echo(str(value)):
                hooks[0](kind, value, tb)

        def unraisablehook(unraisable):
            if not _is_echo(str(unraisable.exc_value)):
                hooks[1](unraisable)

        def thread_excepthook(args):
            if not _is_echo(str(args.exc_value)):
                hooks[2](args)

        self._logger.addFilter(self._drop)
        sys.excepthook, sys.unraisablehook, threading.excepthook = excepthook, unraisablehook, thread_excepthook
        return self

    def remove(self, *, collect: bool = True) -> None:
        """Put the hooks back (installs and removals nest); ``collect``: first collect the unretrieved
        futures of a failure, which report when garbage-collected."""
        if collect:
            gc.collect()
        sys.excepthook, sys.unraisablehook, threading.excepthook = self._hooks
        self._logger.removeFilter(self._drop)


@contextlib.contextmanager
def _quiet_failed_reads():
    """Drop the echoes of a failed read while a restore runs; the failure is reported once (CheckpointWarning)."""
    echoes = _Echoes().install()
    try:
        yield
    finally:
        echoes.remove()


class _DropOrbaxLogs(logging.Filter):
    """Orbax logs through absl (``WARNING:absl:``/``ERROR:absl:`` with tracebacks): remat_kit reports
    what matters itself, in one line (a failed save, a step moved aside)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"{os.sep}orbax{os.sep}" not in record.pathname


def prepare_directory(directory: str | os.PathLike) -> Path:
    """Create ``directory`` if needed and check it is writable, before anything is trained.

    Raises:
      OSError: naming the directory and why it cannot hold checkpoints.
    """
    path = Path(directory).absolute()
    if path.exists() and not path.is_dir():
        raise OSError(f"checkpoint directory {str(path)!r} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise OSError(f"checkpoint directory {str(path)!r} is not writable: {err.strerror or err}") from None
    return path


def tree_digest(tree: Any) -> str:
    """SHA-256 over every leaf's key path, dtype, shape and bytes (device arrays are fetched).

    The digest is of the global values, so it does not depend on how the arrays are sharded or
    over how many processes: a leaf spread over several processes is gathered first (every process
    must then call this, in the same order; each gets the same digest).
    """
    h = hashlib.sha256()
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = _global_value(leaf)
        h.update(f"{jax.tree_util.keystr(keypath)}|{arr.dtype}|{arr.shape}|".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def _global_value(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


def _all_processes_agree(ok: bool) -> bool:
    """True when ``ok`` holds in every process (a collective across processes; ``ok`` in one)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


class Checkpoints:
    """The checkpoints of one run in ``directory``; keeps the newest ``keep`` steps.

    Use it as a context manager (or call :meth:`close`) so pending saves finish. In a run over
    several JAX processes every process creates it on the same (shared) directory and makes the
    same calls: each writes its own shards into one checkpoint, process 0 the metadata.

    >>> import tempfile, numpy as np
    >>> state = {"w": np.arange(3.0), "step": np.asarray(7)}
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with Checkpoints(d, keep=2) as ckpts:
    ...         ckpts.save(7, state, {"note": "hi"})
    ...     with Checkpoints(d) as ckpts:
    ...         abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    ...         step, restored, meta = ckpts.restore_latest(abstract)
    >>> step, restored["w"].tolist(), meta["note"]
    (7, [0.0, 1.0, 2.0], 'hi')

    Args:
      directory: where step folders live (created if needed; must be writable).
      keep: how many of the newest steps to keep (older ones are deleted by orbax after a save).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3):
        check_int("keep", keep)
        self.directory = prepare_directory(directory)
        self.keep = keep
        self._quiet = _DropOrbaxLogs()
        logging.getLogger("absl").addFilter(self._quiet)
        self._manager = self._open()
        self._failed = False

    def _open(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True)
        return ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """Finished steps on disk, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Save ``state`` (a pytree of arrays) and ``meta`` (JSON) as ``step``, and wait until it is on disk.

        Orbax writes in background threads; waiting here reports a failed write (a full disk) at the
        save that failed, not at the next one.

        Raises:
          OSError: the step could not be written (one line, naming the last good step, which is kept).
        """
        meta = {**meta, "step": int(step), "state_sha256": tree_digest(state)}
        echoes = _Echoes().install()
        try:
            self._manager.save(
                int(step),
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
            self._manager.wait_until_finished()
        except Exception as err:  # orbax re-raises the writer's error (OSError, or tensorstore's ValueError)
            # ``echoes`` stays installed until the process exits: a failed array write echoes from orbax's
            # threads and from its futures as they are collected, during this save and long after it.
            self._failed = True
            kept = [s for s in self.steps() if s != int(step)]
            last = f"the last good checkpoint, step {kept[-1]}, is kept" if kept else "no checkpoint was saved"
            why = getattr(err, "strerror", None) or _os_error(err) or _describe(err)
            raise OSError(f"could not save step {step} in {self.directory}: {why}; {last}") from None
        echoes.remove(collect=False)

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release orbax's resources."""
        try:
            if self._failed:  # reported once, by save; orbax would raise it again here
                with contextlib.suppress(Exception):
                    self._manager.close()
            else:
                self._manager.wait_until_finished()
                self._manager.close()
        finally:
            if not self._failed:  # after a failure orbax's background threads may still log its echoes
                logging.getLogger("absl").removeFilter(self._quiet)

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata of ``step``."""
        return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def restore_latest(
        self, abstract_state: Any, check_meta: Callable[[dict[str, Any]], None] | None = None
    ) -> tuple[int, Any, dict[str, Any]] | None:
        """Restore the newest good step; ``None`` when there are no steps.

        Steps are tried newest first. One that cannot be read or fails its hash is reported with a
        :class:`CheckpointWarning`, renamed to ``corrupt-step-<N>-<time>`` (its files kept), and the
        previous step is tried.

        Args:
          abstract_state: the state's structure with ``jax.ShapeDtypeStruct`` leaves; the result
            has exactly this structure. Give the leaves shardings to read a checkpoint saved by
            another process count or mesh (orbax reshards it onto them).
          check_meta: called with each candidate's metadata before its arrays are read; a
            ValueError it raises (e.g. a different model) stops the search and propagates, with
            nothing on disk changed.

        Raises:
          ValueError: every step is unreadable, or ``check_meta`` rejected the checkpoint.
        """
        steps = self.steps()
        if not steps:
            return None
        with _quiet_failed_reads():
            return self._restore_latest(steps, abstract_state, check_meta)

    def _restore_latest(self, steps, abstract_state, check_meta):
        bad: list[tuple[int, str]] = []
        found = None
        for step in reversed(steps):
            try:
                meta = self.read_meta(step)
            except Exception as err:  # orbax/tensorstore raise many types for a damaged step
                meta, why = None, _describe(err)
            # Across processes, a step one process cannot read is skipped by all, so they stay in step.
            if not _all_processes_agree(meta is not None):
                bad.append((step, why if meta is None else "unreadable in another process"))
                continue
            if check_meta is not None:
                check_meta(meta)  # a config mismatch is the user's error, not corruption: no fallback
            state, why = None, ""
            try:
                state = self._restore_state(step, abstract_state)
            except Exception as err:
                why = _describe(err)
            if not _all_processes_agree(state is not None):
                state = None
            elif tree_digest(state) != meta.get("state_sha256"):  # the same global digest in every process
                state, why = None, "ValueError: its arrays do not match the SHA-256 recorded when it was saved"
            if state is None:
                bad.append((step, why or "unreadable in another process"))
                continue
            found = (step, state, meta)
            break
        if found is None:
            listing = "; ".join(f"step {s}: {why}" for s, why in bad)
            raise ValueError(f"no readable checkpoint in {self.directory} (nothing was changed): {listing}")
        for step, why in bad:
            moved = self._quarantine(step)  # process 0 moves it; the others wait for that
            warnings.warn(
                f"checkpoint step {step} in {self.directory} is unreadable ({why}); moved to {moved.name} "
                f"(its files are kept) and resuming from step {found[0]}",
                CheckpointWarning,
                stacklevel=2,
            )
        if bad:
            self._manager.reload()  # forget the moved steps
        return found

    def _restore_state(self, step: int, abstract_state: Any) -> Any:
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))[
            "state"
        ]
        # Orbax restores namedtuples (optax states) as plain tuples; put the leaves back into the
        # exact structure asked for, after checking they line up one to one.
        leaves = jax.tree.leaves(restored)
        want = jax.tree.leaves(abstract_state)
        if len(leaves) != len(want) or any(
            np.shape(a) != tuple(b.shape) or np.dtype(a.dtype) != b.dtype for a, b in zip(leaves, want, strict=True)
        ):
            raise ValueError("its arrays do not match the expected training state")
        return jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)

    def _quarantine(self, step: int) -> Path:
        src = self.directory / str(step)
        dst = self.directory / f"{CORRUPT_PREFIX}{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 0
        while dst.exists():
            n += 1
            dst = dst.with_name(f"{dst.name}-{n}")
        if jax.process_count() == 1:
            src.rename(dst)
            return dst
        from jax.experimental import multihost_utils

        # One process renames (the directory is shared); its new name is the one every process reports.
        if jax.process_index() == 0:
            src.rename(dst)
        name = np.zeros(256, np.uint8)
        raw = dst.name.encode()[:256]
        name[: len(raw)] = np.frombuffer(raw, np.uint8)
        name = multihost_utils.broadcast_one_to_all(name)
        return self.directory / bytes(np.asarray(name)).rstrip(b"\0").decode()


#: What tensorstore and pybind11 append to an error that says nothing to a user: the whole JSON spec of
#: the store, source locations, and reprs of bound C++ methods; orbax's "See full TensorStore details:"
#: and a ``<bound method ... of TensorStore({`` whose multi-line repr closes lines later run to the end.
_NOISE = re.compile(
    r"\s*\[(tensorstore_spec|source locations)=.*$|\s*<bound method [^<>]*(<[^<>]*>[^<>]*)*>"
    r"|\s*See full TensorStore details:.*$|\s*<bound method .*$"
)

#: The operating system's error number tensorstore quotes when a file operation fails.
_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")


def _describe(err: BaseException) -> str:
    """``"Type: first line of the message"``, without tensorstore's spec or pybind11's method reprs.

    >>> _describe(ValueError("NOT_FOUND: no file [tensorstore_spec='{\\"driver\\": \\"zarr\\"}']"))
    'ValueError: NOT_FOUND: no file'
    >>> _describe(TypeError("cannot read <bound method pybind11_object.read of <Store at 0x7f>> here"))
    'TypeError: cannot read here'
    >>> _describe(Exception("Could not read. See full TensorStore details: <bound method spec of TensorStore({\\n"))
    'Exception: Could not read.'
    """
    text = _NOISE.sub("", str(err).splitlines()[0] if str(err) else "")
    return f"{type(err).__name__}: {text[:200]}"


def _os_error(err: BaseException) -> str | None:
    """The operating system's words for the file error a tensorstore write ended in, if it quotes one.

    >>> _os_error(ValueError("RESOURCE_EXHAUSTED: Failed writing: ... [os_error_code='28']"))
    'No space left on device'
    """
    found = _OS_ERROR_CODE.search(str(err))
    return os.strerror(int(found.group(1))) if found else None
