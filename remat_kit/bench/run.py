"""``remat-kit bench``: real AdamW training steps under each policy, measured side by side.

Per policy: the compile-only figures of :mod:`remat_kit.planning.analysis` (saved bytes, XLA temp bytes,
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
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from remat_kit import constants
from remat_kit.analysis import explain
from remat_kit.bench.report import (
    EXACT_BF16_FLAGS,
    NOISY_SPREAD,
    RECORD_KEYS,
    BenchRecord,
    format_markdown,
    format_table,
    grad_note,
    noise_warnings,
    pareto_front,
    peak_notes,
    plot,
    recommend,
)
from remat_kit.bench.worker import _MemoryProbe, measure, measure_model
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning import analysis
from remat_kit.train import interrupt
from remat_kit.train.config import check_setting
from remat_kit.units import check_int

__all__ = [
    "DEFAULT_POLICIES",
    "EXACT_BF16_FLAGS",
    "NOISY_SPREAD",
    "RECORD_KEYS",
    "BenchRecord",
    "_MemoryProbe",
    "format_markdown",
    "format_table",
    "grad_note",
    "measure",
    "measure_model",
    "noise_warnings",
    "pareto_front",
    "peak_notes",
    "plot",
    "recommend",
    "run_bench",
]

#: The policies ``bench`` compares by default.
DEFAULT_POLICIES: tuple[str, ...] = constants.BENCH_POLICIES


# ---- one policy per worker process -----------------------------------------------------------------------


def _run_worker(job: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """Run :func:`measure` for ``job`` in a fresh Python process (its own peak RSS)."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    # stdout goes to a file, not a pipe: only stderr (progress) is read live, so a chatty worker
    # can never fill a pipe the parent is not reading.
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "remat_kit.bench.worker", "--worker", json.dumps(job)],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        tail: list[str] = []
        assert proc.stderr is not None
        # A Ctrl-C that ends this process at once (the command line's) ends the worker too; the
        # terminal's reaches it anyway, a `kill -INT` of this process alone would not.
        with interrupt.on_exit(proc.kill):
            for line in proc.stderr:
                line = line.rstrip("\n")
                if line.startswith("progress: "):
                    log(line[len("progress: ") :])
                elif line.strip():
                    tail = [*tail[-20:], line]
            code = proc.wait()
        if code != 0:
            raise RuntimeError(f"bench worker for {job['policy']} failed (exit {proc.returncode}):\n" + "\n".join(tail))
        out.seek(0)
        lines = out.read().strip().splitlines()
    return json.loads(lines[-1])


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
    check_int("steps", steps)
    check_int("warmup", warmup, 0)
    check_setting("seed", seed)
    specs = ["none", *[s for s in map(str, specs) if s != "none"]]  # none first: every ratio is over it
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
                    **{k: r[k] for k in r if k in RECORD_KEYS and k not in ("step_times_s", "warnings")},
                    step_times_s=tuple(r["step_times_s"]),
                    warnings=_noop(spec, r, base) + tuple(r.get("warnings", ())),
                    step_time_ratio=r["step_time_s"] / base["step_time_s"],
                    loss_diff=abs(r["loss"] - base["loss"]),
                    max_grad_diff=grad_abs,
                    max_grad_rel_diff=grad_rel,
                )
            )
    return records


def _noop(spec: str, r: dict, base: dict) -> tuple[str, ...]:
    """The no-op guardrail for one benchmarked policy: its compiled peak and saved bytes equal ``none``'s."""
    w = explain.noop_warning(spec, r["xla_peak_bytes"], r["saved_bytes"], base["xla_peak_bytes"], base["saved_bytes"])
    return (w,) if w else ()
