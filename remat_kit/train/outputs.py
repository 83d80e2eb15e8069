"""Where a run writes its metrics and plot: checked before any work, their folders made when it starts.

Imports no jax, so the command line checks a path before JAX is even imported.

>>> check_output("runs/metrics.jsonl", "--metrics")
>>> check_output("plot.txt", "--plot", suffixes=PLOT_SUFFIXES)
Traceback (most recent call last):
...
ValueError: --plot 'plot.txt': cannot write a .txt picture; give a path ending in .png, .pdf or .svg
"""

from __future__ import annotations

import os
from pathlib import Path

#: The picture formats a loss plot is written in (matplotlib picks the format from the suffix).
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def _nearest_existing(path: Path) -> Path:
    for parent in path.parents:
        if parent.exists():
            return parent
    return Path(path.anchor)


def check_output(path: str | os.PathLike | None, what: str, *, suffixes: tuple[str, ...] | None = None) -> None:
    """Raise now, before anything is computed, if ``path`` could not be written at the end.

    A folder that does not exist yet is fine (:func:`make_parent` creates it) where the nearest one that
    does is writable.

    Args:
      path: the file (None: nothing to check).
      what: how the message names it (e.g. ``"--metrics"``).
      suffixes: the allowed file suffixes (None: any).

    Raises:
      ValueError: a suffix not in ``suffixes``.
      OSError: a directory, or a file or folder this process may not write.
    """
    if path is None:
        return
    path = Path(path).absolute()
    if suffixes is not None and path.suffix.lower() not in suffixes:
        kind = f"a {path.suffix} picture" if path.suffix else "a picture without a suffix"
        allowed = ", ".join(suffixes[:-1]) + f" or {suffixes[-1]}"
        raise ValueError(f"{what} {_shown(path)!r}: cannot write {kind}; give a path ending in {allowed}")
    if path.is_dir():
        raise OSError(f"{what} {_shown(path)!r} is a directory; give a file path")
    folder = _nearest_existing(path)
    if not folder.is_dir():
        raise OSError(f"{what} {_shown(path)!r}: {_shown(folder)!r} is a file, not a folder")
    if path.exists() and not os.access(path, os.W_OK):
        raise OSError(f"{what} {_shown(path)!r} is not writable")
    if not path.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(f"{what} {_shown(path)!r}: folder {_shown(folder)!r} is not writable")


def _shown(path: Path) -> str:
    # The path as the user gave it where it lies below the working directory, absolute elsewhere.
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def make_parent(path: str | os.PathLike | None) -> None:
    """Create ``path``'s folder (and its parents) if missing; a no-op for None."""
    if path is not None:
        Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
