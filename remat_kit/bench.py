"""``remat-kit bench``: real AdamW training steps under each policy, measured side by side.

Per policy: the compile-only figures of :mod:`remat_kit.analysis` (saved bytes, XLA temp bytes,
FLOPs), the measured peak memory (the device's ``memory_stats()`` where the backend has it; on
CPU, the peak resident set of a fresh subprocess per policy, its high-water mark reset just
before the first step, beside the resident set at that moment), the median step time over the timed
steps after warm-up and its ratio to ``none``, and the loss and gradient differences against
``none`` at the same parameters and tokens.

Output: a terminal table (progress on stderr), ``--json`` (one record per policy), ``--markdown``
and ``--plot`` (memory against step time with the Pareto front marked).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from remat_kit import analysis, constants
from remat_kit import mesh as mesh_lib
from remat_kit.model import TransformerConfig
from remat_kit.units import fmt_bytes

#: The policies ``bench`` compares by default.
DEFAULT_POLICIES: tuple[str, ...] = constants.BENCH_POLICIES

#: Step-time spread, (max − min) / median, above which a policy's timing is too noisy for its ratio
#: to ``none`` to mean anything: ``bench`` then says so (run more --steps on a quieter machine).
NOISY_SPREAD = 0.25


@dataclasses.dataclass(frozen=True)
class BenchRecord:
    """One policy's measurement.

    Attributes:
      policy: the spec.
      saved_bytes, saved_host_bytes, layers_saved_bytes: from :func:`remat_kit.analysis.analyze`.
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


# ---- memory probes -----------------------------------------------------------------------------------


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux ≥ 4.0), so the peak covers only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    peak = _proc_status("VmHWM")
    if peak is None:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return peak


class _MemoryProbe:
    """Device memory stats where the backend has them, else this process's resident set."""

    def __init__(self, device):
        self.device = device
        self.source = "device" if device.memory_stats() else "rss"
        self._baseline = 0

    def baseline(self) -> int:
        if self.source == "device":
            return int(self.device.memory_stats().get("bytes_in_use", 0))
        _reset_peak_rss()
        self._baseline = _proc_status("VmRSS") or _peak_rss()
        return self._baseline

    def peak(self) -> int:
        if self.source == "device":
            return int(self.device.memory_stats().get("peak_bytes_in_use", 0))
        # The kernel raises VmHWM lazily (on unmap and exit), so it can trail the resident set read
        # just after the reset; the peak since then is at least each of them.
        return max(_peak_rss(), _proc_status("VmRSS") or 0, self._baseline)


# ---- one policy ----------------------------------------------------------------------------------------


def measure(
    config: TransformerConfig,
    policy: str,
    batch: int,
    seq: int,
    *,
    steps: int = 5,
    warmup: int = 1,
    loss_chunks: int = 0,
    seed: int = 0,
    learning_rate: float = 1e-3,
    grads_path: str | None = None,
    log: Callable[[str], None] = lambda _: None,
    mesh: str | None = None,
) -> dict[str, Any]:
    """Compile, check and time one policy in this process; returns a partial record.

    With ``mesh`` (a spec such as ``"data=2,fsdp=2"``) the step runs sharded over that mesh and
    XLA's figures are per device (the process's peak RSS still covers every local device).

    The gradients at the initial parameters are written to ``grads_path`` (``.npz``) when given,
    so the caller can compare policies (None skips that check and its extra compile). Ratios and
    differences against ``none`` are left to the caller.
    """
    import jax
    import numpy as np

    from remat_kit import lora
    from remat_kit import step as step_lib
    from remat_kit.loss import lm_loss
    from remat_kit.model import Transformer

    log("compiling")
    mesh_obj = mesh_lib.make_mesh(mesh) if mesh else None
    a, compiled = analysis.analyze_compiled(
        config, policy, batch, seq, loss_chunks=loss_chunks, learning_rate=learning_rate, mesh=mesh_obj
    )
    model = Transformer(config=config, policy=policy)
    key_params, key_tokens = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(key_tokens, (batch, seq), 0, config.vocab_size, dtype=jax.numpy.int32)
    params = jax.jit(lambda k: model.init(k, tokens[:1])["params"])(key_params)
    opt_state = jax.jit(lambda p: step_lib.init_optimizer(analysis.optimizer(learning_rate), p))(params)
    if mesh_obj is not None:  # the compiled step takes its inputs laid out as it was compiled for
        params = jax.device_put(params, mesh_lib.tree_shardings(params, mesh_obj))
        opt_state = jax.device_put(opt_state, mesh_lib.tree_shardings(opt_state, mesh_obj))
        tokens = jax.device_put(tokens, mesh_lib.batch_sharding(mesh_obj))

    # Keep a host copy of the initial parameters for the gradient check, which runs after the
    # timed steps so that its own buffers cannot inflate (or pre-pay) the measured peak.
    initial = jax.device_get(params) if grads_path else None
    probe = _MemoryProbe(jax.devices()[0])
    baseline = probe.baseline()  # parameters and optimizer state live; the peak covers warm-up on
    first_loss = None
    times = []
    for i in range(warmup + steps):
        log(f"warm-up {i + 1}/{warmup}" if i < warmup else f"step {i + 1 - warmup}/{steps}")
        start = time.perf_counter()
        params, opt_state, loss, *_ = jax.block_until_ready(compiled(params, opt_state, tokens))
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if first_loss is None:
            first_loss = float(loss)  # the loss at the initial parameters, the same for every policy
    peak = probe.peak()
    del params, opt_state

    if grads_path:
        log("gradient check")
        trainable, frozen = lora.partition(initial)  # LoRA: the adapters' gradients (an int8 base has none)
        grad_fn = jax.value_and_grad(lambda t: lm_loss(model, lora.combine(t, frozen), tokens, loss_chunks=loss_chunks))
        grads = jax.jit(grad_fn)(trainable)[1]
        np.savez(grads_path, *[np.asarray(g, np.float32) for g in jax.tree.leaves(grads)])
        del grads
    return {
        "policy": a.policy,
        "saved_bytes": a.saved_bytes,
        "saved_host_bytes": a.saved_host_bytes,
        "layers_saved_bytes": a.layers_saved_bytes,
        "temp_bytes": a.memory.temp,
        "xla_peak_bytes": a.peak_bytes,
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        "peak_source": probe.source,
        "flops": a.flops,
        "compile_s": a.compile_s,
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "loss": first_loss,
    }


def measure_model(
    model: str,
    policy: str,
    *,
    steps: int = 5,
    warmup: int = 1,
    seed: int = 0,
    learning_rate: float = 1e-3,
    grads_path: str | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """:func:`measure` for ``--model MODULE:FACTORY``: the shared step (:mod:`remat_kit.step`) of
    ``FACTORY(policy)``'s loss on its example inputs (ShapeDtypeStructs are drawn from ``seed``:
    floats normal × 0.02, integers zero), timed, its peak measured, its gradients written."""
    import jax
    import numpy as np

    from remat_kit import inspection, policies
    from remat_kit import step as step_lib
    from remat_kit.plan import load_factory, model_from_factory

    make_loss, example = model_from_factory(load_factory(model), model)
    loss_fn = make_loss(policies.parse(policy))
    log("compiling")
    report = inspection.inspect(loss_fn, *example)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(example))))

    def real(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return jax.numpy.asarray(x)
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            return (0.02 * jax.random.normal(next(keys), x.shape)).astype(x.dtype)
        return jax.numpy.zeros(x.shape, x.dtype)

    params, *batch = jax.tree.map(real, tuple(example))
    opt = step_lib.make_optimizer(learning_rate)
    opt_state = jax.jit(lambda p: step_lib.init_optimizer(opt, p))(params)
    start = time.perf_counter()
    compiled = jax.jit(step_lib.make_step(loss_fn, opt), **step_lib.jit_kwargs(params, opt_state)).trace(
        params, opt_state, *batch).lower().compile()  # fmt: skip
    compile_s = time.perf_counter() - start
    xla_peak = analysis.CompiledMemory.from_compiled(compiled).total
    initial = jax.device_get(params) if grads_path else None
    probe = _MemoryProbe(jax.devices()[0])
    baseline = probe.baseline()
    first_loss, times = None, []
    for i in range(warmup + steps):
        log(f"warm-up {i + 1}/{warmup}" if i < warmup else f"step {i + 1 - warmup}/{steps}")
        start = time.perf_counter()
        params, opt_state, loss, *_ = jax.block_until_ready(compiled(params, opt_state, *batch))
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if first_loss is None:
            first_loss = float(loss)
    peak = probe.peak()
    del params, opt_state
    if grads_path:
        log("gradient check")
        grads = jax.jit(jax.grad(loss_fn))(initial, *batch)
        np.savez(grads_path, *[np.asarray(g, np.float32) for g in jax.tree.leaves(grads)])
    return {
        "policy": str(policies.parse(policy)),
        "saved_bytes": report.saved_bytes,
        "saved_host_bytes": report.saved_host_bytes,
        "layers_saved_bytes": report.saved_bytes,
        "temp_bytes": report.temp_bytes,
        "xla_peak_bytes": xla_peak,
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        "peak_source": probe.source,
        "flops": report.flops,
        "compile_s": compile_s,
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "loss": first_loss,
    }


def _run_worker(job: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """Run :func:`measure` for ``job`` in a fresh Python process (its own peak RSS)."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    # stdout goes to a file, not a pipe: only stderr (progress) is read live, so a chatty worker
    # can never fill a pipe the parent is not reading.
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "remat_kit.bench", "--worker", json.dumps(job)],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        tail: list[str] = []
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip("\n")
            if line.startswith("progress: "):
                log(line[len("progress: ") :])
            elif line.strip():
                tail = [*tail[-20:], line]
        if proc.wait() != 0:
            raise RuntimeError(f"bench worker for {job['policy']} failed (exit {proc.returncode}):\n" + "\n".join(tail))
        out.seek(0)
        lines = out.read().strip().splitlines()
    return json.loads(lines[-1])


def _worker_main(job_text: str) -> int:
    job = json.loads(job_text)
    log = lambda m: print("progress: " + m, file=sys.stderr, flush=True)
    if "model" in job:
        record = measure_model(job.pop("model"), log=log, **job)
        print(json.dumps(record))
        return 0
    mesh_lib.ensure_cpu_devices(job.get("mesh"))  # a fresh process: simulate the mesh's CPU devices
    config = TransformerConfig(**job.pop("config"))
    record = measure(config, log=log, **job)
    print(json.dumps(record))
    return 0


# ---- all policies ------------------------------------------------------------------------------------


def _grad_diffs(path: str, reference: str) -> tuple[float, float]:
    import numpy as np

    with np.load(path) as got, np.load(reference) as ref:
        worst_abs = worst_rel = 0.0
        for name in ref.files:
            a, b = got[name].astype(np.float64), ref[name].astype(np.float64)
            diff = float(np.max(np.abs(a - b))) if a.size else 0.0
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-30))
    return worst_abs, worst_rel


def run_bench(
    config: TransformerConfig,
    batch: int,
    seq: int,
    specs: list[str],
    *,
    steps: int = 5,
    warmup: int = 1,
    loss_chunks: int = 0,
    seed: int = 0,
    learning_rate: float = 1e-3,
    subprocesses: bool = True,
    grad_check: bool = True,
    progress: Callable[[str], None] = lambda _: None,
    mesh: str | None = None,
    model: str | None = None,
) -> list[BenchRecord]:
    """Measure every policy in ``specs`` (``none`` is run first as the reference if missing).

    Args:
      config, batch, seq: the model and token shape.
      specs: policy specs.
      steps: timed steps per policy (the median is reported); warmup: untimed steps before them.
      loss_chunks: 0 for the plain loss, k for the chunked one.
      seed: parameters and tokens are drawn from it, the same for every policy.
      learning_rate: AdamW's.
      subprocesses: run each policy in a fresh process (its own peak RSS); False runs them here.
      grad_check: compare gradients with ``none`` (one more compile per policy); False reports None.
      progress: called with one line per stage.
      mesh: run every step sharded over this mesh spec (e.g. ``"data=2,fsdp=2"``).
      model: ``"MODULE:FACTORY"`` to measure that model instead (``config``, ``batch``, ``seq``,
        ``loss_chunks`` and ``mesh`` are then unused; see :func:`measure_model`).

    Returns:
      One :class:`BenchRecord` per policy, ``none`` first.
    """
    if model is None:
        analysis.check_shape(config, batch, seq, loss_chunks)
    for what, value, low in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    specs = [str(s) for s in specs]
    if "none" not in specs:
        specs = ["none", *specs]
    specs = ["none", *[s for s in specs if s != "none"]]
    raw, paths = {}, {}
    with tempfile.TemporaryDirectory(prefix="remat-kit-bench-") as tmp:
        for i, spec in enumerate(specs):
            paths[spec] = os.path.join(tmp, f"grads{i}.npz")
            job = {
                "policy": spec,
                "batch": batch,
                "seq": seq,
                "steps": steps,
                "warmup": warmup,
                "loss_chunks": loss_chunks,
                "seed": seed,
                "learning_rate": learning_rate,
                "grads_path": paths[spec] if grad_check else None,
                "mesh": mesh,
            }
            log = lambda m, i=i, spec=spec: progress(f"[{i + 1}/{len(specs)}] {spec}: {m}")
            if model is not None:
                for key in ("batch", "seq", "loss_chunks", "mesh"):
                    job.pop(key)
                job["model"] = model
                raw[spec] = _run_worker(job, log) if subprocesses else measure_model(log=log, **job)
            elif subprocesses:
                raw[spec] = _run_worker({**job, "config": dataclasses.asdict(config)}, log)
            else:
                raw[spec] = measure(config, log=log, **job)
        base = raw["none"]
        records = []
        for spec in specs:
            r = raw[spec]
            grad_abs, grad_rel = _grad_diffs(paths[spec], paths["none"]) if grad_check else (None, None)
            records.append(
                BenchRecord(
                    **{k: r[k] for k in r if k in RECORD_KEYS and k != "step_times_s"},
                    step_times_s=tuple(r["step_times_s"]),
                    step_time_ratio=r["step_time_s"] / base["step_time_s"],
                    loss_diff=abs(r["loss"] - base["loss"]),
                    max_grad_diff=grad_abs,
                    max_grad_rel_diff=grad_rel,
                )
            )
    return records


# ---- reports -------------------------------------------------------------------------------------------


def pareto_front(records: list[BenchRecord]) -> list[str]:
    """Policies no other policy beats on both step time and measured step memory."""
    from remat_kit.budget import pareto_front as front

    return [records[i].policy for i in front([(r.step_time_s, r.step_bytes) for r in records])]


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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2]))
    from remat_kit.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
