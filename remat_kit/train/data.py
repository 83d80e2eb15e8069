"""Offline training text: byte-level tokens from local files, shuffled deterministically by seed.

Nothing is downloaded. The default corpus is real text every Python install has: the standard
library's own source files (found through :mod:`sysconfig`). ``paths`` takes your own text files
or folders instead. Tokens are bytes (ids 0..255), so any model with ``vocab_size >= 256`` fits
and no tokenizer has to be trained or stored.

>>> c = corpus_from_bytes(b"hello world, " * 40)
>>> train, val = c.split(0.1)
>>> batches = Batches(train, batch_size=2, seq_len=16, seed=0)
>>> batches.batch(0).shape, decode(encode("héllo"))
((2, 16), 'héllo')
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from remat_kit.units import check_int

#: Byte-level vocabulary size: token ids are the bytes 0..255.
BYTE_VOCAB = 256

#: How much of the standard library the default corpus reads (enough text for CPU runs).
DEFAULT_MAX_BYTES = 8 * 2**20

# A file whose first block holds a NUL byte is treated as binary and skipped.
_SNIFF_BYTES = 8192


def encode(text: str | bytes) -> np.ndarray:
    """Byte-level token ids ``uint8 [n]`` of ``text`` (UTF-8 for ``str``)."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(raw, dtype=np.uint8).copy()


def decode(ids: Iterable[int]) -> str:
    """Text of byte-level token ids (invalid UTF-8 is replaced, never raised)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Token ids of a text corpus and where they came from.

    Attributes:
      tokens: ``uint8 [n]`` byte-level token ids.
      source: a short description (paths, file count) for messages and checkpoint metadata.
      num_files: how many files were read.
    """

    tokens: np.ndarray
    source: str
    num_files: int

    def __post_init__(self):
        if self.tokens.ndim != 1 or self.tokens.dtype != np.uint8:
            raise TypeError(f"Corpus.tokens must be a uint8 [n] array, got {self.tokens.dtype} {self.tokens.shape}")
        if self.tokens.size == 0:
            raise ValueError(f"the corpus {self.source} is empty: no text to train on")

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the token ids: a resumed run must see the same data."""
        return hashlib.sha256(self.tokens.tobytes()).hexdigest()

    def split(self, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """``(train, validation)`` token arrays: the last ``val_fraction`` of the corpus is held out.

        Raises:
          ValueError: ``val_fraction`` outside (0, 1).
        """
        if not (isinstance(val_fraction, (int, float)) and 0.0 < val_fraction < 1.0):
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        cut = round(self.tokens.size * (1.0 - val_fraction))
        return self.tokens[:cut], self.tokens[cut:]


def corpus_from_bytes(raw: bytes, source: str = "<bytes>") -> Corpus:
    """A corpus of the given bytes (for tests and notebooks)."""
    return Corpus(encode(raw), source=source, num_files=1)


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted (third-party ``site-packages`` excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return files


def load_corpus(paths: Sequence[str | os.PathLike] | None = None, *, max_bytes: int | None = None) -> Corpus:
    """Read a corpus from text files and folders (recursively, in sorted order).

    Args:
      paths: files or folders; ``None`` or empty reads the Python standard library's sources.
      max_bytes: stop after this many bytes (default: :data:`DEFAULT_MAX_BYTES` for the standard
        library, everything for your own paths).

    Returns:
      A :class:`Corpus`; files are joined with a newline and binary files (NUL bytes) are skipped.

    Raises:
      FileNotFoundError: a path that does not exist.
      ValueError: no text at all in the given paths, or a bad ``max_bytes``.
    """
    check_int("max_bytes", max_bytes, none_ok=True)
    if paths:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        files = []
        for p in map(Path, paths):
            if not p.exists():
                raise FileNotFoundError(f"data path {str(p)!r} does not exist")
            files.extend(sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p])
        source = ", ".join(str(p) for p in paths)
    else:
        files = stdlib_files()
        source = f"Python standard library sources ({sysconfig.get_paths()['stdlib']})"
        max_bytes = max_bytes or DEFAULT_MAX_BYTES
    chunks, total, used, binary = [], 0, 0, []
    for f in files:
        raw = f.read_bytes()
        if raw and b"\0" in raw[:_SNIFF_BYTES]:
            binary.append(f)
        if not raw or b"\0" in raw[:_SNIFF_BYTES]:
            continue
        if max_bytes is not None:
            raw = raw[: max_bytes - total]
        chunks.append(raw)
        total += len(raw)
        used += 1
        if max_bytes is not None and total >= max_bytes:
            break
    if not chunks and binary and len(binary) == len(files):
        which = str(binary[0]) if len(binary) == 1 else f"all {len(binary)} files"
        raise ValueError(f"data {which} at {source} is not text (binary: it holds NUL bytes); give text files")
    if not chunks:
        raise ValueError(f"the corpus at {source} is empty: no text in {len(files)} file(s)")
    return Corpus(encode(b"\n".join(chunks)), source=f"{source}: {used} file(s), {total:,} bytes", num_files=used)


@dataclasses.dataclass(frozen=True, eq=False)
class Batches:
    """Deterministic ``[batch, seq]`` windows of a token array, reshuffled every epoch by ``seed``.

    Batch ``i`` is a pure function of ``(tokens, batch_size, seq_len, seed, i)``, so a run that
    saves its position ``i`` resumes on exactly the batches it would have seen.

    Attributes:
      tokens: ``uint8 [n]`` training tokens.
      batch_size: windows per batch.
      seq_len: tokens per window.
      seed: shuffling seed.
    """

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self):
        for field in ("batch_size", "seq_len"):
            check_int(field, getattr(self, field))
        if self.tokens.size < self.seq_len:
            raise ValueError(
                f"sequence length {self.seq_len} is longer than the text it is cut from "
                f"({self.tokens.size} tokens); use a shorter --seq-len or more data"
            )

    @property
    def windows_per_epoch(self) -> int:
        """Non-overlapping windows in one pass over the tokens."""
        return (self.tokens.size - self.seq_len) // self.seq_len + 1

    @functools.lru_cache(maxsize=2)  # noqa: B019 - the instance is frozen and lives as long as the run
    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        # A fresh window offset and order per epoch, both from (seed, epoch) only.
        rng = np.random.default_rng([self.seed, epoch])
        slack = self.tokens.size - self.windows_per_epoch * self.seq_len
        return int(rng.integers(0, slack + 1)), rng.permutation(self.windows_per_epoch)

    def batch(self, position: int, rows: slice | None = None) -> np.ndarray:
        """The ``int32 [batch_size, seq_len]`` batch at ``position`` (0, 1, 2, ...).

        Args:
          position: the batch's index in the run.
          rows: only these rows of the batch (e.g. the part one process of a multi-process run
            feeds); only their windows are read. ``batch(p, rows=r)`` equals ``batch(p)[r]``.
        """
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
            raise ValueError(f"batch position must be a non-negative integer, got {position!r}")
        first, last, stride = (rows or slice(None)).indices(self.batch_size)
        if stride != 1:
            raise ValueError(f"rows must be a contiguous slice of the batch, got {rows!r}")
        base = int(position) * self.batch_size
        out = []
        for g in range(base + first, base + max(first, last)):
            epoch, index = divmod(g, self.windows_per_epoch)
            offset, order = self._epoch(epoch)
            start = offset + int(order[index]) * self.seq_len
            out.append(self.tokens[start : start + self.seq_len])
        return np.stack(out).astype(np.int32) if out else np.zeros((0, self.seq_len), np.int32)


def eval_windows(tokens: np.ndarray, *, batch_size: int, seq_len: int, num_batches: int) -> np.ndarray:
    """Fixed validation batches ``int32 [num_batches, batch_size, seq_len]`` from held-out tokens.

    Windows are taken in order without shuffling; if the held-out text is short they repeat, so
    the validation loss is always over the same, full-sized batches.

    Raises:
      ValueError: the held-out text is shorter than one window.
    """
    if tokens.size < seq_len:
        raise ValueError(
            f"the validation split has {tokens.size} tokens, fewer than one sequence of {seq_len}; "
            "use a shorter --seq-len, a larger --val-fraction or more data"
        )
    count = (tokens.size - seq_len) // seq_len + 1
    need = num_batches * batch_size
    starts = (np.arange(need) % count) * seq_len
    rows = np.stack([tokens[s : s + seq_len] for s in starts]).astype(np.int32)
    return rows.reshape(num_batches, batch_size, seq_len)
