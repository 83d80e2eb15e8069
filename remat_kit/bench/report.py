"""A bench measurement (:class:`BenchRecord`) and its reports.

The terminal table, Markdown, the plot, the Pareto front drawn over the measured noise, the one-line
recommendation, and the warning when step times are too noisy for their ratios to mean anything."""

from __future__ import annotations

import dataclasses

from remat_kit import policies
from remat_kit.analysis import memory
from remat_kit.units import fmt_bytes

#: Step-time spread, (max − min) / median, above which a policy's timing is too noisy for its ratio
#: to ``none`` to mean anything: ``bench`` then says so (run more --steps on a quieter machine).
NOISY_SPREAD = 0.25

#: Relative difference in measured step memory below which two policies count as equal. Memory is
#: measured once per policy (no spread to read), and a process's peak RSS moves by a few percent
#: between identical runs (allocator, thread stacks).
MEMORY_NOISE = 0.05


#: Relative gradient difference from ``none`` (worst leaf) up to which a policy's gradients are float32
#: rounding of ``none``'s; above it ``bench`` says where a larger difference comes from (:func:`grad_note`).
GRAD_RTOL = 1e-5

#: The check for a model with bfloat16 parts, which docs/planning.md and :func:`grad_note` give.
EXACT_BF16_FLAGS = "XLA_FLAGS=--xla_allow_excess_precision=false"


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
      warnings: the compiled step's guardrails (:mod:`remat_kit.analysis.explain`): offload that moves nothing, a peak
        mostly state no policy touches (estimated from the state's size: bench reads no XLA dump), a policy that
        compiles to ``none``'s peak and saved set.
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


def _faster(a: BenchRecord, b: BenchRecord) -> bool:
    """``a`` is faster than ``b`` beyond the noise: its slowest timed step beats ``b``'s fastest."""
    return a.step_time_max_s < b.step_time_min_s


def _smaller(a: BenchRecord, b: BenchRecord) -> bool:
    """``a`` needs less step memory than ``b`` by more than :data:`MEMORY_NOISE` of ``b``'s."""
    return a.step_bytes < b.step_bytes - MEMORY_NOISE * abs(b.step_bytes)


def _dominates(a: BenchRecord, b: BenchRecord) -> bool:
    """``a`` is clearly better than ``b`` on one measure and not clearly worse on the other."""
    return (_faster(a, b) and not _smaller(b, a)) or (_smaller(a, b) and not _faster(b, a))


def pareto_front(records: list[BenchRecord]) -> list[str]:
    """Policies no other policy beats on step time or measured step memory without losing on the other.

    Drawn over the noise: one policy is faster than another only when their min–max step times do not
    overlap, and needs less memory only by more than :data:`MEMORY_NOISE`; so a rerun of the same
    command, whose medians shuffle within the spread, draws the same front.
    """
    return [b.policy for b in records if not any(_dominates(a, b) for a in records if a is not b)]


#: Relative difference in compiled peak below which two policies count as needing the same memory (the compiled
#: figure is deterministic; this only keeps a few bytes of layout from deciding).
COMPILED_TIE = 0.01


def _offload_idle(r: BenchRecord, host_moves: bool) -> bool:
    """An offload policy on a backend where offload moves nothing: it saves no memory there."""
    if host_moves:
        return False
    try:
        parsed = policies.parse(r.policy)
    except ValueError:
        return False
    parts = parsed.policies if isinstance(parsed, policies.Mix) else (parsed,)
    return any(p.kind == "offload" for p in parts)


def recommend(records: list[BenchRecord], threshold: float = NOISY_SPREAD, host_moves: bool | None = None) -> str:
    """One line: the policy to use, why, and how sure the measurement makes it.

    One judgement with ``plan``, ``auto`` and ``fit``: memory is the compiled step's peak (deterministic, the figure
    they hold to a budget), never the process's RSS; time is the measured medians and their min–max spread. Among
    the policies as fast as the fastest within the spread (their min–max step times overlap its own), the one with
    the least compiled peak; a policy of the front with clearly less is named too, with its time cost. An offload
    policy is never credited where the backend moves nothing (``host_moves``: default, this backend's
    :func:`remat_kit.memory.host_offload`). "sure" only when the differences it rests on exceed the measured
    spread: the chosen policy's median lies within the fastest's min–max, no timing involved spreads more than
    ``threshold`` of its median, and its compiled peak is clearly below every other policy as fast.

    >>> def r(p, times, mem):
    ...     t = sorted(times)[1]
    ...     return BenchRecord(p, *[0] * 4, mem, 0, 0, "rss", 0, 0.0, t, times, 1.0, 0.0, 0.0, None, None)
    >>> recommend([r("none", (1.0, 1.02, 1.04), 300), r("full", (1.01, 1.03, 1.05), 100)], host_moves=False)
    'recommended: full (least compiled peak, 100 B, at the speed of the fastest within its 1000–1040 ms); sure'
    """
    if not records:
        return "recommended: nothing measured"
    host_moves = memory.host_offload().enforced if host_moves is None else host_moves
    credited = [r for r in records if not _offload_idle(r, host_moves)] or list(records)
    fastest = min(credited, key=lambda r: r.step_time_s)
    as_fast = [r for r in credited if not _faster(fastest, r)]
    pick = min(as_fast, key=lambda r: (r.xla_peak_bytes, r.step_time_s))
    line = (
        f"recommended: {pick.policy} (least compiled peak, {fmt_bytes(pick.xla_peak_bytes)}, at the speed of the "
        f"fastest within its {fastest.step_time_min_s * 1e3:.0f}–{fastest.step_time_max_s * 1e3:.0f} ms)"
    )
    clearly_less = lambda a, b: a.xla_peak_bytes < b.xla_peak_bytes * (1 - COMPILED_TIE)
    leaner = [r for r in credited if clearly_less(r, pick)]
    leaner = [r for r in leaner if not any(clearly_less(o, r) and not _faster(r, o) for o in leaner if o is not r)]
    if leaner:
        lean = min(leaner, key=lambda r: r.step_time_s)
        line += (
            f"; for less memory: {lean.policy} ({fmt_bytes(lean.xla_peak_bytes)}, "
            f"×{lean.step_time_s / pick.step_time_s:.2f} time)"
        )
    why = []
    if pick is not fastest and pick.step_time_s > fastest.step_time_max_s:
        why.append(
            f"its median is ×{pick.step_time_s / fastest.step_time_s:.2f} {fastest.policy}'s, beyond "
            f"{fastest.policy}'s own range"
        )
    noisy = [r.policy for r in as_fast if len(r.step_times_s) > 1 and r.step_time_spread > threshold]
    if noisy:
        why.append(f"step times of {', '.join(noisy)} spread over {threshold:.0%}")
    close = [r.policy for r in as_fast if r is not pick and not clearly_less(pick, r)]
    if close:
        why.append(f"{', '.join(close)} within {COMPILED_TIE:.0%} of its compiled peak")
    if not why:
        return line + "; sure"
    return line + f"; unsure: {'; '.join(why)} (rerun with more --steps on an idle machine)"


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


def peak_notes(records: list[BenchRecord]) -> dict[str, str]:
    """Per policy whose measured peak is above ``none``'s while its compiled peak is below: why, in one line.

    The measured peak is the process's (or device's) high-water mark over the whole run, not the step's buffers:
    it also holds the compiled executable and what the allocator kept from earlier steps and compiles, and a policy
    with more code (nested or several scans: ``sqrt_n``, ``segments``, mixes) or a different allocation order holds
    more of that; the compiled peak is the step's own device bytes, the figure a budget is held to.

    >>> none = BenchRecord("none", *[0] * 4, 100, 200, 0, "rss", 0, 0.0, 1.0, (1.0,), 1.0, 0.0, 0.0, None, None)
    >>> lean = dataclasses.replace(none, policy="sqrt_n", xla_peak_bytes=50, peak_bytes=300)
    >>> peak_notes([none, lean])["sqrt_n"].split(";")[0]
    "measured peak 300 B above none's 200 B while its compiled peak is lower (50 B vs 100 B)"
    """
    base = next((r for r in records if r.policy == "none"), None)
    if base is None:
        return {}
    return {
        r.policy: (
            f"measured peak {fmt_bytes(r.peak_bytes)} above none's {fmt_bytes(base.peak_bytes)} while its compiled "
            f"peak is lower ({fmt_bytes(r.xla_peak_bytes)} vs {fmt_bytes(base.xla_peak_bytes)}); the measured peak "
            f"({'device peak_bytes_in_use' if r.peak_source == 'device' else 'process peak RSS'}) is a high-water "
            "mark of the whole run, the compiled executable and the allocator's kept pages included, which grow with "
            "the code a policy compiles (nested or several scans); the compiled peak is the step's own bytes, what "
            "a budget is held to"
        )
        for r in records
        if r.policy != "none" and r.peak_bytes > base.peak_bytes and r.xla_peak_bytes < base.xla_peak_bytes
    }


def format_table(records: list[BenchRecord]) -> list[str]:
    """The terminal table; a row whose measured peak contradicts its compiled one (:func:`peak_notes`) is marked
    ``† peak``, the note printed below the table."""
    cells = [[name for name, _ in _COLUMNS]] + [[fn(r) for _, fn in _COLUMNS] for r in records]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    notes = peak_notes(records)
    marks = ["  † peak" if r.policy in notes else "" for r in records]
    lines = [lines[0]] + [line + mark for line, mark in zip(lines[1:], marks, strict=True)]
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


def grad_note(records: list[BenchRecord]) -> str | None:
    """What a gradient difference above float32 rounding means, when there is one (None otherwise).

    A float32 model's policies match ``none`` to float32 rounding. With bfloat16 parts (MaxText's RoPE
    runs in bfloat16 even in a float32 model) any two compilations of one forward differ by up to ~1e-2
    relative, remat or not: XLA keeps excess (float32) precision inside the fusions it forms, and the
    fusions differ. ``XLA_FLAGS=--xla_allow_excess_precision=false`` rounds every bfloat16 result.

    >>> r = BenchRecord("full", *[0] * 7, "rss", 0, 0.0, 1.0, (1.0,), 1.0, 0.0, 0.0, 0.1, 6e-3)
    >>> grad_note([r]).split(";")[0]
    "full: gradients differ from none's by up to 6.0e-03 relative, more than float32 rounding"
    """
    over = [r for r in records if r.max_grad_rel_diff is not None and r.max_grad_rel_diff > GRAD_RTOL]
    if not over:
        return None
    worst = max(r.max_grad_rel_diff for r in over)
    return (
        f"{', '.join(r.policy for r in over)}: gradients differ from none's by up to {worst:.1e} relative, more "
        "than float32 rounding; a model with bfloat16 parts (e.g. RoPE in bfloat16) differs this much between any "
        "two compilations of one forward, remat or not (XLA keeps excess precision where it fuses): rerun with "
        f"{EXACT_BF16_FLAGS} to round every bfloat16 result"
    )


def format_markdown(records: list[BenchRecord], header: str) -> str:
    """A Markdown report: the command and setting, then the table."""
    rows = [[name for name, _ in _COLUMNS]] + [[fn(r) for _, fn in _COLUMNS] for r in records]
    table = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    table += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    source = records[0].peak_source if records else "rss"
    notes = [
        "",
        f"Pareto front (step time vs peak−base memory, over the min–max spread): {', '.join(pareto_front(records))}.",
        "",
        recommend(records) + ".",
        "",
        "saved/host: residuals the backward pass keeps (JAX's residual analysis); XLA temp: compiled scratch;",
        "XLA peak: the compiled step's arguments + outputs − aliased + temp (what plan and auto hold to a budget);",
        f"peak: measured ({'device memory_stats peak_bytes_in_use' if source == 'device' else 'process peak RSS'}); "
        "peak−base: above the same measure just before the first (warm-up) step;",
        "GFLOPs: matmul FLOPs per step counted from the jaxpr (scan trip counts applied); step: median; min–max: ms;",
        "loss and gradients at the same initial parameters and tokens, compared with `none`.",
    ]
    note = grad_note(records)
    if note:
        notes += ["", f"Note: {note}."]
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
