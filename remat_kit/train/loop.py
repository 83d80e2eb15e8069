"""Train the transformer LM under any rematerialization policy, with resumable checkpoints.

The policy changes memory and time, never the result: the same seed gives the same losses under
``none``, ``full`` or ``selective`` up to float rounding. :func:`train` runs optax AdamW
(warm-up + cosine schedule, gradient clipping, optional gradient accumulation through
``optax.MultiSteps``) on byte-level text (:mod:`remat_kit.train.data`), logs JSON lines, validates
periodically and saves orbax checkpoints (:mod:`remat_kit.train.checkpoint`) that resume exactly.

>>> cfg = TrainConfig(steps=2, batch_size=2, seq_len=16, eval_every=2, eval_batches=1)
>>> corpus = data.corpus_from_bytes(b"the quick brown fox jumps over the lazy dog. " * 20)
>>> result = train(cfg, corpus)
>>> [r["step"] for r in result.history], "val_loss" in result.history[-1]
([1, 2], True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from remat_kit import __version__
from remat_kit.step import mesh as mesh_lib
from remat_kit.train import data, distributed, interrupt, outputs
from remat_kit.train.checkpoint import Checkpoints, prepare_directory
from remat_kit.train.config import (
    DivergedError,
    TrainConfig,
    TrainResult,
    TrainState,
    check_compatible,
    check_setting,
    schedule_changes,
)
from remat_kit.train.interrupt import stop_requests
from remat_kit.train.lock import DirectoryInUseError, DirectoryLock
from remat_kit.train.progress import _any_process, _progress, write_loss_plot
from remat_kit.train.trainer import Trainer

# ---- the training loop --------------------------------------------------------------------------------


def train(
    config: TrainConfig,
    corpus: data.Corpus | None = None,
    *,
    data_paths: Sequence[str | os.PathLike] | None = None,
    max_corpus_bytes: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    checkpoint_every: int = 50,
    keep: int = 3,
    metrics_path: str | os.PathLike | None = None,
    plot_path: str | os.PathLike | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    callbacks: Sequence[Callable[[int, dict[str, Any]], None]] = (),
    mesh=None,
) -> TrainResult:
    """Train ``config`` on a corpus; optionally checkpoint, resume, log metrics and plot.

    Every input is checked before anything is compiled or written.

    Args:
      config: the run.
      corpus: the text; default :func:`remat_kit.train.data.load_corpus` of ``data_paths``.
      data_paths: files/folders to read when ``corpus`` is None (None: the standard library).
      max_corpus_bytes: cap on the bytes read.
      checkpoint_dir: where checkpoints go (None: no checkpoints).
      resume: continue from the newest good checkpoint in ``checkpoint_dir`` (a fresh start if
        there is none). Without it, a directory that already holds checkpoints is an error.
      checkpoint_every: steps between checkpoints (the last step is always saved).
      keep: how many newest checkpoints to keep.
      metrics_path: JSON-lines file, one record per step (``step``, ``loss``, ``lr``,
        ``grad_norm``, ``tokens_per_s``, ``step_s``, and ``val_loss`` on evaluation steps).
      plot_path: loss-curve PNG written at the end (default: beside ``metrics_path``).
      progress: show a progress bar on stderr.
      log: where one-line messages go (default: stderr).
      callbacks: called as ``fn(step, record)`` after each step.
      mesh: train over a device mesh (see :class:`Trainer`).

    Returns:
      A :class:`TrainResult`.

    Raises:
      ValueError / OSError: bad data, directory, or a checkpoint from a different model or run.
      DivergedError: a non-finite loss (the last good checkpoint is kept).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    prefix = distributed.process_prefix()
    if prefix:  # another process than 0 of a multi-process run: its lines say which process they are from
        log = functools.partial(lambda inner, msg: inner(prefix + msg), log)
    for setting, value in (
        ("checkpoint_every", checkpoint_every),
        ("keep", keep),
        ("max_corpus_bytes", max_corpus_bytes),
    ):
        check_setting(setting, value)
    if resume and checkpoint_dir is None:
        raise ValueError("resume needs a checkpoint directory")
    metrics_path = Path(metrics_path) if metrics_path is not None else None
    if plot_path is None and metrics_path is not None:
        plot_path = metrics_path.with_suffix(".png")
    outputs.check_output(metrics_path, "metrics file")
    outputs.check_output(plot_path, "plot", suffixes=outputs.PLOT_SUFFIXES)
    if not distributed.is_main_process():  # process 0 alone writes metrics, the plot and progress
        metrics_path = plot_path = None
        progress = False
    # A signal from here on only sets a flag (never an exception inside JAX), read where stopping is safe.
    with stop_requests(log) as stop:
        where = _Run(corpus, data_paths, max_corpus_bytes, checkpoint_dir, resume, checkpoint_every, keep)
        report = _Outputs(metrics_path, plot_path, progress, log, tuple(callbacks))
        return _train(config, where, report, mesh, stop)


@contextlib.contextmanager
def _claim(checkpoint_dir):
    """Create ``checkpoint_dir`` if needed and hold it: one writer per directory, process 0 holds the lock,
    every process learns if it was refused.

    A run that ends in an error before its first save (a step too big for the memory, a checkpoint of
    another model, Ctrl-C before step 1) takes back what it made: the lock file and the folders it created.
    """
    path = Path(checkpoint_dir).absolute()
    made = []  # the folders prepare_directory creates, deepest first
    while not path.exists() and path != path.parent:
        made.append(path)
        path = path.parent
    prepare_directory(checkpoint_dir)
    lock, refused = DirectoryLock(checkpoint_dir), None
    if distributed.is_main_process():
        try:
            lock.acquire()
        except DirectoryInUseError as err:
            refused = err
    if _any_process(refused is not None):
        raise refused or DirectoryInUseError(f"process 0 could not lock the checkpoint directory {checkpoint_dir}")
    try:
        yield lock
    except BaseException:
        if distributed.is_main_process() and [p.name for p in lock.path.parent.iterdir()] == [lock.path.name]:
            lock.discard()
            for folder in made:
                with contextlib.suppress(OSError):  # another run may have claimed it in between: it stays
                    folder.rmdir()
        raise
    finally:
        lock.release()


def _stop_if_asked(stop, log, where: str) -> None:
    # Across processes all stop together, when any of them was signalled.
    interrupt.check(_any_process(stop.requested), log, where)


@dataclasses.dataclass(frozen=True)
class _Run:
    """Where :func:`train` reads from and checkpoints to, once checked."""

    corpus: data.Corpus | None
    data_paths: Sequence[str | os.PathLike] | None
    max_corpus_bytes: int | None
    checkpoint_dir: str | os.PathLike | None
    resume: bool
    checkpoint_every: int
    keep: int


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """What :func:`train` reports to, once checked (None/False on processes other than 0)."""

    metrics_path: Path | None
    plot_path: str | os.PathLike | None
    progress: bool
    log: Callable[[str], None]
    callbacks: tuple[Callable[[int, dict[str, Any]], None], ...]


def _train(config: TrainConfig, run: _Run, report: _Outputs, mesh, stop):
    corpus, checkpoint_dir, resume, keep = run.corpus, run.checkpoint_dir, run.resume, run.keep
    metrics_path, plot_path, log = report.metrics_path, report.plot_path, report.log
    nothing = "before step 1 (nothing to save)"
    if corpus is None:
        corpus = data.load_corpus(run.data_paths, max_bytes=run.max_corpus_bytes)
    _stop_if_asked(stop, log, nothing)
    meta = {
        "format": 1,
        "remat_kit": __version__,
        "config": config.to_json(),
        "data": {"source": corpus.source, "fingerprint": corpus.fingerprint, "tokens": int(corpus.tokens.size)},
    }
    meta = json.loads(json.dumps(meta))  # compare with saved metadata as it comes back from JSON
    # Before anything is compiled or saved: processes started with different flags would train
    # different models on one mesh, or deadlock in a collective that only some of them reach.
    # The data is compared by content: hosts may mount it under different paths.
    same_run = {**meta, "data": {k: v for k, v in meta["data"].items() if k != "source"}}
    distributed.check_same_across_processes(
        {
            "run": same_run,
            "mesh": mesh if isinstance(mesh, (str, type(None))) else dict(mesh.shape),
            "checkpoints": checkpoint_dir is not None,
            "resume": resume,
            "checkpoint_every": run.checkpoint_every,
            "keep": keep,
        },
        "run configuration",
    )
    trainer = Trainer(config, mesh)  # refuses a mesh the devices or the batch cannot make: before any folder
    note = mesh_lib.simulated_note(trainer.mesh) if trainer.mesh is not None else None
    if note and distributed.is_main_process():
        log(note)
    with contextlib.ExitStack() as held:
        ckpts = None
        if checkpoint_dir is not None:
            held.enter_context(_claim(checkpoint_dir))
            ckpts = held.enter_context(Checkpoints(checkpoint_dir, keep=keep))
        if ckpts is not None and ckpts.steps() and not resume:
            raise ValueError(
                f"{ckpts.directory} already holds checkpoints (steps {ckpts.steps()}); pass --resume to continue "
                "that run or choose another --checkpoint-dir"
            )
        _check_memory(trainer)  # compiles the step (nothing allocated): before the batches and the state
        _stop_if_asked(stop, log, nothing)
        train_tokens, val_tokens = corpus.split(config.val_fraction)
        batches = data.Batches(train_tokens, config.batch_size, config.seq_len, config.seed)
        val_windows = data.eval_windows(
            val_tokens, batch_size=config.batch_size, seq_len=config.seq_len, num_batches=config.eval_batches
        )
        state, resumed_from = None, None
        if ckpts is not None and resume:
            # Shapes only (nothing allocated), so a mismatched checkpoint is reported at once.
            found = ckpts.restore_latest(trainer.abstract_state(), lambda m: check_compatible(m, meta, ckpts.directory))
            if found is None:
                log(f"no checkpoint in {ckpts.directory}; starting from step 0")
            else:
                resumed_from, restored, saved_meta = found
                changed = schedule_changes(saved_meta, meta)
                if changed:
                    log(f"note: {changed}; the continuation is not the exact original run")
                state = TrainState(**restored)
                if int(state.data_position) != int(state.step) * config.grad_accum:
                    raise ValueError(f"checkpoint step {resumed_from} has an inconsistent data position")
                log(f"resumed from step {resumed_from} in {ckpts.directory}")
        if state is None:
            state = trainer.init_state()
        state = trainer.place(state)
        _stop_if_asked(stop, log, f"before step {int(state.step) + 1} (nothing new to save)")
        val_windows = val_windows[:, trainer.local_rows]  # each process feeds only its rows
        for out in (metrics_path, plot_path):
            outputs.make_parent(out)
        history = _start_metrics(metrics_path, resumed_from or 0)
        state, history = _loop(
            trainer,
            state,
            batches,
            val_windows,
            ckpts,
            meta,
            run.checkpoint_every,
            metrics_path,
            history,
            report.progress,
            log,
            report.callbacks,
            stop,
        )
    if plot_path is not None and history:
        write_loss_plot(history, plot_path, title=_title(config))
    return TrainResult(
        state=state, history=tuple(history), resumed_from=resumed_from, step_traces=trainer.traces["step"]
    )


def _check_memory(trainer: Trainer) -> None:
    # Every process checks its own host or devices; all refuse together, so none waits in a collective.
    refused = None
    try:
        trainer.check_memory()
    except ValueError as err:
        refused = err
    if _any_process(refused is not None):
        raise refused or ValueError("another process of this run has too little memory for the training step")


def _title(config: TrainConfig) -> str:
    m = config.model
    shape = f"batch {config.batch_size}x{config.seq_len}"
    return f"d_model {m.d_model} x {m.num_layers} layers, policy {config.policy}, {shape}"


def _start_metrics(path: Path | None, resume_step: int) -> list[dict[str, Any]]:
    """Earlier records of a resumed run; lines past the checkpoint (to be redone) are dropped."""
    if path is None:
        return []
    records = []
    if resume_step and path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
                record = json.loads(line)
                if isinstance(record, dict) and record.get("step", math.inf) <= resume_step:
                    records.append(record)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)
    return records


def _loop(
    trainer,
    state,
    batches,
    val_windows,
    ckpts,
    meta,
    checkpoint_every,
    metrics_path,
    history,
    progress,
    log,
    callbacks,
    stop,
):
    config = trainer.config
    first = int(state.step) + 1
    metrics_file = open(metrics_path, "a") if metrics_path is not None else None  # noqa: SIM115
    bar = _progress(progress, config.steps, first - 1, log)
    try:
        with bar:
            for step in range(first, config.steps + 1):
                t0 = time.perf_counter()
                pos = int(state.data_position)
                micro = [batches.batch(pos + i, rows=trainer.local_rows) for i in range(config.grad_accum)]
                new_state, out = trainer.step(state, micro)
                if not (math.isfinite(out["loss"]) and out["params_finite"]):
                    last = ckpts.steps()[-1] if ckpts is not None and ckpts.steps() else None
                    what = (
                        f"loss is {out['loss']}" if not math.isfinite(out["loss"]) else "parameters became non-finite"
                    )
                    saved = f"nothing saved after step {last}" if last is not None else "no checkpoint was saved"
                    raise DivergedError(f"{what} at step {step}; {saved}. Lower --lr (or --clip-norm) and resume")
                state = new_state
                dt = time.perf_counter() - t0
                record = {
                    "step": step,
                    "loss": out["loss"],
                    "lr": float(trainer.schedule(step - 1)),
                    "grad_norm": out["grad_norm"],
                    "tokens_per_s": config.tokens_per_step / dt,
                    "step_s": dt,
                }
                if config.eval_every and (step % config.eval_every == 0 or step == config.steps):
                    record["val_loss"] = trainer.evaluate(state.params, val_windows)
                history.append(record)
                if metrics_file is not None:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                bar.advance(record)
                if "val_loss" in record:
                    bar.print(
                        f"step {step}/{config.steps}  loss {record['loss']:.4f}  val {record['val_loss']:.4f}  "
                        f"{record['tokens_per_s']:,.0f} tok/s"
                    )
                for fn in callbacks:
                    fn(step, record)
                # Decided last, so a Ctrl-C that arrives at any point of the step still saves it. Across
                # processes all stop together (a save is collective), when any of them was signalled.
                stopping = _any_process(stop.requested)
                if ckpts is not None and (step % checkpoint_every == 0 or step == config.steps or stopping):
                    ckpts.save(step, trainer.place(state).to_dict(), meta)
                if stopping:
                    saved = f"; saved step {step} in {ckpts.directory / str(step)}" if ckpts is not None else ""
                    log(f"interrupted after step {step}{saved}")
                    raise KeyboardInterrupt
    finally:
        if metrics_file is not None:
            metrics_file.close()
    return state, history
