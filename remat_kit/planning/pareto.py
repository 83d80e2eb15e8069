"""Pareto fronts of memory against cost, and the plot of :func:`remat_kit.auto`'s candidates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: budget imports this module for its mixed front
    from remat_kit.planning.budget import AutoResult


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better on both).

    >>> pareto_front([(1, 5), (2, 2), (3, 3), (5, 1)])
    [0, 1, 3]
    """
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((a <= x and b <= y) and (a, b) != (x, y) for a, b in points)
        if not dominated:
            front.append(i)
    return front


def plot_pareto(result: AutoResult, path: str) -> str:
    """Write a PNG of device memory against recompute FLOPs, the Pareto front drawn, the choice marked.

    Only compiled candidates have a memory figure; the budget is drawn as a horizontal line. The front's
    segments are the mixed front (mixes of two neighbours, :func:`remat_kit.planning.budget.best_mix`); mixes
    compiled are diamonds.

    Returns:
      ``path``.
    """
    import matplotlib  # late: an optional heavy dependency, only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [c for c in result.candidates if c.need_bytes is not None]
    xs = [c.recompute_flops / 1e9 for c in rows]
    ys = [c.need_bytes / 1e9 for c in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    one = [i for i, c in enumerate(rows) if "*" not in c.policy]  # single policies; mixes are drawn below
    colors = ["tab:green" if rows[i].fits else "tab:red" for i in one]
    ax.scatter([xs[i] for i in one], [ys[i] for i in one], c=colors, zorder=3)
    for c, x, y in zip(rows, xs, ys, strict=True):
        ax.annotate(
            c.policy if len(c.policy) < 28 else c.policy[:25] + "…",
            (x, y),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
        )
    front = sorted((one[j] for j in pareto_front([(xs[i], ys[i]) for i in one])), key=lambda i: xs[i])
    # Mixes of neighbours on the front lie (very nearly) on the segments between them: the mixed front.
    label = "mixed front (mixes of neighbouring policies)" if result.mixed_front else "Pareto front"
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="gray", label=label, zorder=2)
    mixed = [i for i, c in enumerate(rows) if "*" in c.policy]
    if mixed:
        ax.scatter([xs[i] for i in mixed], [ys[i] for i in mixed], marker="D", s=40, facecolors="none",
                   edgecolors=["tab:green" if rows[i].fits else "tab:red" for i in mixed], label="mixes compiled",
                   zorder=3)  # fmt: skip
    ax.axhline(
        result.budget_bytes / (1 + result.margin) / 1e9,
        color="tab:orange",
        label=f"budget / (1 + {result.margin:.0%} margin)",
    )
    if result.chosen is not None:
        win = next(i for i, c in enumerate(rows) if c.policy == str(result.chosen))
        ax.scatter(
            [xs[win]],
            [ys[win]],
            s=250,
            facecolors="none",
            edgecolors="black",
            linewidths=2,
            label=f"chosen: {result.chosen}",
            zorder=4,
        )
    ax.set_xlabel("recompute per step (GFLOP, matmuls beyond `none`)")
    ax.set_ylabel("compiled peak of the step (GB): arguments + outputs − aliased + temp")
    ax.set_title(f"policies at batch {result.batch} x seq {result.seq} (green fits, red does not)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
