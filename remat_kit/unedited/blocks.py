"""Which modules of an unedited model are its blocks: the repeated modules that carry the step's compute.

A model is more than one block class repeated in a loop: a GPT-2 keeps two ``Embed`` (token, position) beside
its collection of blocks, a Griffin model alternates recurrent and attention blocks, a vision-language model
has a vision tower and a text stack. The shallowest repeated class is often the wrong one (the embeddings),
and wrapping it rematerializes nothing. So a candidate is a module class repeated (at least twice) under one
parent, and the blocks are the candidate whose outermost instances carry the most of the forward pass's
matmul FLOPs (or, where nothing was traced, parameters; an embedding table does no matmul and counts 0).
Composite modules (with submodules of their own) are preferred over leaves (a ``Dense`` repeated inside a
block is no block); between two that carry the same compute, the one with more instances wins (the layers,
not the two stacks that hold them). A second kind of block that carries a large share of its own (dense and
MoE layers, a vision tower beside a text stack) is rematerialized too, and :class:`Choice` says so in a line.

>>> mods = [(("wte",), "Embed", False), (("wpe",), "Embed", False),
...         (("h", "0"), "Block", True), (("h", "0", "up"), "Dense", False), (("h", "0", "down"), "Dense", False),
...         (("h", "1"), "Block", True), (("h", "1", "up"), "Dense", False), (("h", "1", "down"), "Dense", False)]
>>> flops = {("h", "0"): 40, ("h", "1"): 40, ("h", "0", "up"): 20, ("h", "0", "down"): 20,
...          ("h", "1", "up"): 20, ("h", "1", "down"): 20}
>>> choose(mods, flops, 100, "matmul FLOPs").classes
('Block',)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Mapping, Sequence

from remat_kit.unedited.paths import join

#: A second kind of block is rematerialized beside the first when it carries at least this share of the compute.
SECOND_KIND_SHARE = 0.10
#: Two candidates whose compute differs by less than this fraction count as carrying the same compute.
SAME_COMPUTE = 0.01


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A module class repeated under one parent, with what its outermost instances carry.

    Attributes:
      cls: the class (any hashable key: a type, or a name in tests).
      paths: the paths of its outermost instances, in model order.
      weight: the compute they carry (FLOPs, or parameters).
      composite: whether its instances hold submodules.
    """

    cls: Hashable
    paths: tuple[tuple, ...]
    weight: int
    composite: bool

    def label(self, total: int) -> str:
        name = getattr(self.cls, "__name__", str(self.cls))
        where = join(self.paths[0]) if len(self.paths) == 1 else f"{join(self.paths[0])} … {join(self.paths[-1])}"
        share = f"{100 * self.weight / total:.0f}%" if total else "?"
        return f"{name} ×{len(self.paths)} ({where}, {share})"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The block classes :func:`choose` found, and why.

    Attributes:
      classes: the block classes (one, or several kinds).
      why: one line: what the blocks carry and the runner-up.
      several: one line when a second kind of block is rematerialized beside the first, else None.
    """

    classes: tuple
    why: str
    several: str | None = None


def candidates(modules: Sequence[tuple[tuple, Hashable, bool]], weights: Mapping[tuple, int]) -> list[Candidate]:
    """Every class repeated (>= 2 times) under one parent, with its outermost instances' weight.

    Args:
      modules: ``(path, class, composite)`` of every module (the root's path is ``()``).
      weights: path -> the compute the module at that path carries (its submodules' included).
    """
    under: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for path, cls, _ in modules:
        if path:
            under[tuple(path[:-1])][cls] += 1
    repeated = {cls for counts in under.values() for cls, n in counts.items() if n >= 2}
    out = []
    for cls in dict.fromkeys(c for _, c, _ in modules if c in repeated):
        paths = [tuple(p) for p, c, _ in modules if c == cls and p]
        outer = tuple(p for p in paths if not any(q != p and p[: len(q)] == q for q in paths))
        composite = any(comp for p, c, comp in modules if c == cls)
        out.append(Candidate(cls, outer, sum(weights.get(p, 0) for p in outer), composite))
    return out


def _overlap(a: Candidate, b: Candidate) -> bool:
    return any(p[: len(q)] == q or q[: len(p)] == p for p in a.paths for q in b.paths)


def choose(
    modules: Sequence[tuple[tuple, Hashable, bool]], weights: Mapping[tuple, int], total: int, unit: str
) -> Choice:
    """The block classes of a model: the repeated modules that carry its compute (see the module doc).

    Args:
      modules: ``(path, class, composite)`` of every module, in model order.
      weights: path -> what the module carries (its submodules' included), in ``unit``.
      total: what the whole forward pass carries, in ``unit`` (for the shares in messages).
      unit: ``"matmul FLOPs"`` or ``"parameters"``.

    Raises:
      ValueError: no class is repeated under any parent, listing the modules.
    """
    found = candidates(modules, weights)
    if not found:
        listed = ", ".join(sorted({getattr(c, "__name__", str(c)) for _, c, _ in modules})) or "(none)"
        raise ValueError(
            f"no repeated block found (no module has two children of one class); its modules: {listed}; "
            "pass where= (a block class, a path glob such as 'layer_*', or a predicate)"
        )
    pool = [c for c in found if c.composite] or found
    if not any(c.weight for c in pool):  # nothing measured: the shallowest repeated class, as a reader would
        pool = sorted(pool, key=lambda c: (min(len(p) for p in c.paths), -len(c.paths)))
        return Choice((pool[0].cls,), f"{pool[0].label(0)}: the shallowest repeated module (no {unit} to weigh)")
    best_weight = max(c.weight for c in pool)

    def rank(c: Candidate) -> tuple:
        if c.weight >= best_weight * (1 - SAME_COMPUTE):  # the same compute: the finer blocks (more of them)
            return (0, -len(c.paths), -c.weight)
        return (1, -c.weight, -len(c.paths))

    ranked = sorted(pool, key=rank)
    chosen = [ranked[0]]
    for c in ranked[1:]:
        if c.weight >= SECOND_KIND_SHARE * max(total, 1) and not any(_overlap(c, k) for k in chosen):
            chosen.append(c)
    rest = [c for c in found if c not in chosen and not any(_overlap(c, k) for k in chosen)]
    runner = max(rest, key=lambda c: c.weight, default=None)
    why = f"{', '.join(c.label(total) for c in chosen)} of the forward's {unit}"
    if runner is not None:
        why += f"; next: {runner.label(total)}"
    several = None
    if len(chosen) > 1:
        several = (
            f"blocks of {len(chosen)} kinds carry the compute: {' and '.join(c.label(total) for c in chosen)}; "
            "all are rematerialized (pass where= to choose)"
        )
    return Choice(tuple(c.cls for c in chosen), why, several)
