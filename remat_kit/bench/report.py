"""A bench measurement (:class:`BenchRecord`) and its reports.

The terminal table, Markdown, the plot, the Pareto front and the warning when step times are too
noisy for their ratios to mean anything."""

from __future__ import annotations

import dataclasses

from remat_kit.planning.pareto import pareto_front as _front_of_points
from remat_kit.units import fmt_bytes

#: Step-time spread, (max − min) / median, above which a policy's timing is too noisy for its ratio
#: to ``none`` to mean anything: ``bench`` then says so (run more --steps on a quieter machine).
NOISY_SPREAD = 0.25


@dataclasses.dataclass(frozen=True)
class BenchRecord:
    """One policy's measurement.

    Attributes:
      policy: the spec.
      saved_bytes, saved_host_bytes, layers_saved_bytes: from :func:`remat_kit.planning.analysis.analyze`.
      temp_bytes: XLA's compiled temp bytes for the step.
      xla_peak_bytes: the compiled step's peak (arguments + outputs − aliased + temp), the figure
        ``plan`` and ``auto`` compare with a budget.
      peak_bytes: measured peak memory during the timed steps (device bytes, or process RSS).
      baseline_bytes: the same measure just before the first step (parameters and optimizer
        state live); ``peak_bytes - baseline_bytes`` is what the step itself needs.
      peak_source: ``"device"`` (``memory_stats()["peak_bytes_in_use"]``) or ``"rss"``.
      flops: matmul FLOPs per step (scan-aware jaxpr count).
      compile_s: seconds to lower and compile the step.
      step_time_s: median wall time of the timed steps; step_times_s: each of them.
      step_time_ratio: ``step_time_s`` over ``none``'s.
      loss: the loss at the initial parameters; loss_diff: its difference from ``none``'s.
      max_grad_diff: max |g − g_none| over every parameter; max_grad_rel_diff: the same over
        each leaf's max |g_none|, worst leaf (None when the gradient check was skipped).
      warnings: the compiled step's guardrails (:mod:`remat_kit.explain`): offload that moves nothing, a
        policy that compiles to ``none``'s peak and saved set.
    """

    policy: str
    saved_bytes: int
    saved_host_bytes: int
    layers_saved_bytes: int
    temp_bytes: int
    xla_peak_bytes: int
    peak_bytes: int
    baseline_bytes: int
    peak_source: str
    flops: int
    compile_s: float
    step_time_s: float
    step_times_s: tuple[float, ...]
    step_time_ratio: float
    loss: float
    loss_diff: float
    max_grad_diff: float | None
    max_grad_rel_diff: float | None
    warnings: tuple[str, ...] = ()

    @property
    def step_bytes(self) -> int:
        """Measured memory the step needs above the baseline."""
        return self.peak_bytes - self.baseline_bytes

    @property
    def step_time_min_s(self) -> float:
        """The fastest timed step."""
        return min(self.step_times_s)

    @property
    def step_time_max_s(self) -> float:
        """The slowest timed step."""
        return max(self.step_times_s)

    @property
    def step_time_spread(self) -> float:
        """(max − min) / median of the timed steps: 0 for perfectly steady timings."""
        return (self.step_time_max_s - self.step_time_min_s) / self.step_time_s


#: Keys every JSON record carries (the schema tests and downstream scripts rely on): the record's fields.
RECORD_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(BenchRecord))


def pareto_front(records: list[BenchRecord]) -> list[str]:
    """Policies no other policy beats on both step time and measured step memory."""
    return [records[i].policy for i in _front_of_points([(r.step_time_s, r.step_bytes) for r in records])]


_COLUMNS = (
    ("policy", lambda r: r.policy),
    ("saved", lambda r: fmt_bytes(r.saved_bytes)),
    ("host", lambda r: fmt_bytes(r.saved_host_bytes)),
    ("XLA temp", lambda r: fmt_bytes(r.temp_bytes)),
    ("XLA peak", lambda r: fmt_bytes(r.xla_peak_bytes)),
    ("peak", lambda r: fmt_bytes(r.peak_bytes)),
    ("peak−base", lambda r: fmt_bytes(r.step_bytes)),
    ("GFLOPs", lambda r: f"{r.flops / 1e9:.2f}"),
    ("step", lambda r: f"{r.step_time_s * 1e3:.0f} ms"),
    ("min–max", lambda r: f"{r.step_time_min_s * 1e3:.0f}–{r.step_time_max_s * 1e3:.0f}"),
    ("×none", lambda r: f"{r.step_time_ratio:.2f}"),
    ("loss", lambda r: f"{r.loss:.5f}"),
    ("max|Δgrad|", lambda r: "-" if r.max_grad_diff is None else f"{r.max_grad_diff:.1e}"),
)


def format_table(records: list[BenchRecord]) -> list[str]:
    """The terminal table."""
    cells = [[name for name, _ in _COLUMNS]] + [[fn(r) for _, fn in _COLUMNS] for r in records]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def noise_warnings(records: list[BenchRecord], threshold: float = NOISY_SPREAD) -> list[str]:
    """One line per policy whose step times spread more than ``threshold`` of their median.

    >>> r = BenchRecord("none", *[0] * 7, "rss", 0, 0.0, 1.0, (0.8, 1.0, 1.5), 1.0, 0.0, 0.0, None, None)
    >>> [line.split(";")[0] for line in noise_warnings([r])]
    ['none: step times 800–1500 ms spread 70% of the median']
    """
    return [
        f"{r.policy}: step times {r.step_time_min_s * 1e3:.0f}–{r.step_time_max_s * 1e3:.0f} ms spread "
        f"{r.step_time_spread:.0%} of the median; its ×none ratio is within the noise (try more --steps on an "
        "idle machine)"
        for r in records
        if len(r.step_times_s) > 1 and r.step_time_spread > threshold
    ]


def format_markdown(records: list[BenchRecord], header: str) -> str:
    """A Markdown report: the command and setting, then the table."""
    rows = [[name for name, _ in _COLUMNS]] + [[fn(r) for _, fn in _COLUMNS] for r in records]
    table = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    table += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    source = records[0].peak_source if records else "rss"
    notes = [
        "",
        f"Pareto front (step time vs peak−base memory): {', '.join(pareto_front(records))}.",
        "",
        "saved/host: residuals the backward pass keeps (JAX's residual analysis); XLA temp: compiled scratch;",
        "XLA peak: the compiled step's arguments + outputs − aliased + temp (what plan and auto hold to a budget);",
        f"peak: measured ({'device memory_stats peak_bytes_in_use' if source == 'device' else 'process peak RSS'}); "
        "peak−base: above the same measure just before the first (warm-up) step;",
        "GFLOPs: matmul FLOPs per step counted from the jaxpr (scan trip counts applied); step: median; min–max: ms;",
        "loss and gradients at the same initial parameters and tokens, compared with `none`.",
    ]
    return "\n".join([header, "", *table, *notes]) + "\n"


def plot(records: list[BenchRecord], path: str, title: str) -> None:
    """PNG: measured step memory against step time, the Pareto front joined and marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    front = set(pareto_front(records))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in records:
        on = r.policy in front
        ax.scatter(r.step_time_s * 1e3, r.step_bytes / 1e6, s=60 if on else 35, c="tab:red" if on else "tab:blue")
        ax.annotate(r.policy, (r.step_time_s * 1e3, r.step_bytes / 1e6), textcoords="offset points", xytext=(5, 4))
    pts = sorted((r.step_time_s * 1e3, r.step_bytes / 1e6) for r in records if r.policy in front)
    if pts:
        ax.plot(*zip(*pts, strict=True), "--", c="tab:red", lw=1, label="Pareto front")
        ax.legend()
    source = records[0].peak_source if records else "rss"
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel(f"peak {'device memory' if source == 'device' else 'RSS'} above baseline (MB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

