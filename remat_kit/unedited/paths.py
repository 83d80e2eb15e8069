"""Names by module path: how an unedited model's blocks, and the values inside them, are found and named.

:func:`remat_kit.apply` names every submodule output inside a rematerialized block by its path
relative to the block (``attn/q_einsum``) and every matmul that consumes one of the block's own
parameters by that parameter's path (``mlp/gating_einsum``). This module holds the pieces both the
Linen and the NNX side share: joining paths, choosing the blocks (``where=``; the default, the blocks
found by their compute, is :mod:`remat_kit.unedited.blocks`), and the table :func:`remat_kit.names_of` returns.

>>> join(("attn", "q_einsum"))
'attn/q_einsum'
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from typing import Any

from remat_kit.names import join as join  # the one path naming rule, shared with the stacks
from remat_kit.names import state_keys as state_keys
from remat_kit.units import fmt_bytes


@dataclasses.dataclass(frozen=True)
class Where:
    """Which modules are the blocks to rematerialize: one of ``classes``, ``pattern``, ``predicate`` or ``any_of``.

    Attributes:
      classes: block classes (``isinstance``).
      pattern: a glob over the module path (``"layer_*"``, ``"blocks/*"``).
      predicate: ``predicate(module) -> bool``.
      any_of: several of these (the keys of a per-kind policy mapping).
    """

    classes: tuple[type, ...] = ()
    pattern: str | None = None
    predicate: Callable[[Any], bool] | None = None
    any_of: tuple[Where, ...] = ()

    def __call__(self, module: Any, path: str) -> bool:
        if self.any_of:
            return any(w(module, path) for w in self.any_of)
        if self.classes:
            return isinstance(module, self.classes)
        if self.pattern is not None:
            return fnmatch.fnmatchcase(path, self.pattern)
        return bool(self.predicate(module))

    def __str__(self) -> str:
        if self.any_of:
            return " or ".join(map(str, self.any_of))
        if self.classes:
            return " or ".join(c.__name__ for c in self.classes)
        if self.pattern is not None:
            return repr(self.pattern)
        return getattr(self.predicate, "__name__", repr(self.predicate))


def parse_where(where: Any, base: type) -> Where | None:
    """``where=`` as a :class:`Where`; None for the default (find the repeated block).

    Args:
      where: None, a class or tuple of classes (subclasses of ``base``), a glob string or a callable.
      base: the module base class of the model's library (``flax.linen.Module`` or ``flax.nnx.Module``).

    Raises:
      TypeError: anything else, naming what is allowed.
    """
    if where is None:
        return None
    if isinstance(where, str):
        return Where(pattern=where)
    classes = (where,) if isinstance(where, type) else where
    if isinstance(classes, tuple) and classes and all(isinstance(c, type) and issubclass(c, base) for c in classes):
        return Where(classes=classes)
    if callable(where) and not isinstance(where, (type, tuple)):
        return Where(predicate=where)
    raise TypeError(
        f"where={where!r}: give a {base.__module__}.{base.__name__} class (or a tuple of them), "
        "a module-path glob such as 'layer_*', or a predicate module -> bool"
    )


@dataclasses.dataclass(frozen=True)
class BlockName:
    """One name a rematerialized block emits, with what keeping it costs per block.

    Attributes:
      name: the tag (``attn/q_einsum``, ``mlp/gating_einsum``, or the model's own ``query_proj``).
      shape, dtype: the value's.
      nbytes: its size in bytes.
      source: ``"module"`` (a submodule's output), ``"param"`` (a matmul with the block's parameter),
        ``"tag"`` (the model's own ``checkpoint_name``), ``"input"`` (the block's input, ``layer_input``), or
        ``"traced"`` (read from a traced loss, ``remat-kit tags --model``: any of the others).
      blocks: the blocks that emit it when only some do (blocks of several kinds); empty: every block.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    source: str
    blocks: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class NameTable:
    """The names one block emits, in the order it computes them (what :func:`remat_kit.names_of` returns).

    Attributes:
      block: the block (class name and the path of the first one).
      rows: one :class:`BlockName` per name.
      why: how the blocks were found (which modules carry the compute), when ``where=`` was not given.
      parts: the block's direct submodules, each ``attention`` (``apply(..., query_blocks=)`` runs it in query
        blocks), ``per-token`` (``seq_tiles=`` runs it in tiles) or ``neither``, and why
        (:class:`remat_kit.unedited.long.Part`).
    """

    block: str
    rows: tuple[BlockName, ...]
    why: str = ""
    parts: tuple = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The names alone."""
        return tuple(r.name for r in self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        width = max([len(r.name) for r in self.rows] + [4])
        partial = any(r.blocks for r in self.rows)
        lines = [f"names emitted by {self.block}:"]
        if self.why:
            lines.insert(0, f"blocks: {self.why}")
        lines.append(
            f"{'name':<{width}}  {'shape':<18} {'dtype':<9} {'bytes':>10}  from" + ("    in" if partial else "")
        )
        for r in self.rows:
            shape = "[" + ", ".join(map(str, r.shape)) + "]"
            where = f"  {', '.join(r.blocks) or 'every block'}" if partial else ""
            lines.append(f"{r.name:<{width}}  {shape:<18} {r.dtype:<9} {fmt_bytes(r.nbytes):>10}  {r.source:<6}{where}")
        if self.parts:
            lines.append("submodules (attention: query_blocks=, per-token: seq_tiles=):")
            pw = max(len(p.path) for p in self.parts)
            lines += [f"  {p.path:<{pw}}  {p.kind:<9}  {p.why}" for p in self.parts]
        return "\n".join(lines)
