"""Train the transformer LM under any rematerialization policy, with resumable checkpoints.

The policy changes memory and time, never the result: the same seed gives the same losses under
``none``, ``full`` or ``selective`` up to float rounding. :func:`train` runs optax AdamW
(warm-up + cosine schedule, gradient clipping, optional gradient accumulation through
``optax.MultiSteps``) on byte-level text (:mod:`remat_kit.data`), logs JSON lines, validates
periodically and saves orbax checkpoints (:mod:`remat_kit.checkpoint`) that resume exactly.

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
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from remat_kit import __version__, data, policies
from remat_kit import mesh as mesh_lib
from remat_kit import step as step_lib
from remat_kit.checkpoint import Checkpoints
from remat_kit.loss import lm_loss
from remat_kit.model import PRESETS, Transformer, TransformerConfig, init_params

#: Training settings a resumed run must share with its checkpoint: they decide the data order and
#: the optimizer state's structure. The policy, loss chunks and logging may change freely.
RESUME_MUST_MATCH = ("batch_size", "seq_len", "grad_accum", "seed", "val_fraction")

#: Settings that may change on resume (e.g. a lower learning rate after a divergence, or more
#: steps); the continuation is then no longer exact, and a note says so.
RESUME_MAY_CHANGE = ("steps", "learning_rate", "warmup_steps", "min_lr_ratio", "weight_decay", "clip_norm")

#: Model fields that choose an implementation, not the parameters: like the policy, they may
#: change on resume (results then agree to float rounding, not bit for bit).
MODEL_MAY_CHANGE = ("attention", "attention_block")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run's result (and, for ``policy``, its memory/time).

    Attributes:
      model: the model shape (e.g. ``TransformerConfig.preset("tiny")``); vocab must be >= 256.
      policy: rematerialization policy spec (see :func:`remat_kit.policies.parse`).
      steps: optimizer updates to run in total.
      batch_size: sequences per micro-batch.
      seq_len: tokens per sequence (0: the model's ``max_seq_len``, at most 256).
      grad_accum: micro-batches averaged per update (``optax.MultiSteps``); memory stays that of
        one micro-batch, so it combines with checkpointing to reach large effective batches.
      learning_rate: peak AdamW learning rate.
      warmup_steps: linear warm-up length (-1: 10% of ``steps``, at most 100).
      min_lr_ratio: the cosine schedule ends at ``learning_rate * min_lr_ratio``.
      weight_decay: AdamW decay, applied to matrices, not to norm scales.
      clip_norm: global gradient-norm clip.
      loss_chunks: 0 for the plain loss; k > 0 computes logits and loss in k chunks.
      seed: initialization, dropout and data-order seed.
      val_fraction: the tail of the corpus held out for validation.
      eval_every: steps between validation losses (and at the last step); 0: never.
      eval_batches: validation batches per evaluation.
    """

    model: TransformerConfig = PRESETS["tiny"]
    policy: str = "none"
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 0
    grad_accum: int = 1
    learning_rate: float = 3e-3
    warmup_steps: int = -1
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    loss_chunks: int = 0
    seed: int = 0
    val_fraction: float = 0.05
    eval_every: int = 50
    eval_batches: int = 4

    def __post_init__(self):
        if not isinstance(self.model, TransformerConfig):
            raise TypeError(f"model must be a TransformerConfig, got {type(self.model).__name__}")
        if self.model.vocab_size < data.BYTE_VOCAB:
            raise ValueError(
                f"vocab_size={self.model.vocab_size} is smaller than the {data.BYTE_VOCAB} byte-level tokens"
            )
        # Canonical spec: "minimal" and "selective:q_proj,..." of the same policy compare equal.
        object.__setattr__(self, "policy", str(policies.parse(self.policy)))
        for field in ("steps", "batch_size", "grad_accum", "eval_batches"):
            _check_int(field, getattr(self, field), 1)
        for field in ("seq_len", "loss_chunks", "seed", "eval_every"):
            _check_int(field, getattr(self, field), 0)
        _check_int("warmup_steps", self.warmup_steps, -1)
        if self.seq_len == 0:
            object.__setattr__(self, "seq_len", min(self.model.max_seq_len, 256))
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}")
        if self.warmup_steps == -1:
            object.__setattr__(self, "warmup_steps", min(100, self.steps // 10))
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be smaller than steps={self.steps}")
        for field, allowed, ok in (
            ("learning_rate", "> 0", lambda v: v > 0),
            ("clip_norm", "> 0", lambda v: v > 0),
            ("min_lr_ratio", "in [0, 1]", lambda v: 0 <= v <= 1),
            ("weight_decay", ">= 0", lambda v: v >= 0),
            ("val_fraction", "in (0, 1)", lambda v: 0 < v < 1),
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"{field} must be a number {allowed}, got {value!r}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens seen per optimizer update."""
        return self.batch_size * self.seq_len * self.grad_accum

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the model config nested under ``model``)."""
        return {**dataclasses.asdict(self), "model": dataclasses.asdict(self.model)}


def _check_int(field: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{field} must be an integer >= {low}, got {value!r}")


@flax.struct.dataclass
class TrainState:
    """Everything a resumed run needs (a pytree; saved whole in each checkpoint).

    Attributes:
      params: model parameters.
      opt_state: optax state.
      step: updates done so far (int32 scalar).
      data_position: micro-batches consumed so far (``step * grad_accum``).
      rng: the run's base PRNG key data (uint32); step keys are ``fold_in(rng, step)``.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    data_position: jax.Array
    rng: jax.Array

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What :func:`train` returns.

    Attributes:
      state: the final :class:`TrainState`.
      history: one metrics record per step (from the metrics file when resuming, so the whole run).
      resumed_from: the checkpoint step the run resumed from, or None.
      step_traces: how many times the jitted micro-step was traced (1: it never retraced).
    """

    state: TrainState
    history: tuple[dict[str, Any], ...]
    resumed_from: int | None
    step_traces: int


class DivergedError(ValueError):
    """The loss became NaN or infinite; the state was not saved."""


class RetraceError(AssertionError):
    """The jitted training step was traced more than once (its input structure changed)."""


def make_optimizer(config: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with warm-up + cosine decay and global-norm clipping; MultiSteps if ``grad_accum > 1``.

    Returns:
      ``(optimizer, schedule)``; the schedule maps an update count to its learning rate.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=config.steps,
        end_value=config.learning_rate * config.min_lr_ratio,
    )
    optimizer = step_lib.make_optimizer(
        schedule,
        clip_norm=config.clip_norm,
        weight_decay=config.weight_decay,
        mask=_decay_mask,
        grad_accum=config.grad_accum,
    )
    return optimizer, schedule


def _decay_mask(params):
    # Norm scales ([layers, d] once stacked, so not recognizable by rank) are not decayed.
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) != "scale", params)


# Compiled once per model config for the whole process (the policy does not change parameters),
# instead of hundreds of eagerly dispatched initializer ops per run.
_init_params = jax.jit(init_params, static_argnums=0)


class Trainer:
    """The jitted training and evaluation steps for one :class:`TrainConfig`.

    Args:
      config: the run's configuration.
      mesh: a ``jax.sharding.Mesh`` or spec (``"data=2,fsdp=2"``, see :mod:`remat_kit.mesh`):
        batches split over ``data`` × ``fsdp``, parameters and optimizer state sharded over
        ``fsdp``. None: one device. Like the policy, it may change on resume.
    """

    def __init__(self, config: TrainConfig, mesh=None):
        self.config = config
        self.model = Transformer(config=config.model, policy=config.policy)
        self.optimizer, self.schedule = make_optimizer(config)
        self.traces = {"step": 0, "eval": 0}
        self.mesh = mesh_lib.make_mesh(mesh) if isinstance(mesh, (str, mesh_lib.MeshSpec)) else mesh
        step_kw, eval_kw = {"donate_argnums": (0, 1)}, {}
        self._shardings = None
        #: The rows of each global batch this process feeds (all of them in one process).
        self.local_rows = slice(0, config.batch_size)
        if self.mesh is None and jax.process_count() > 1:
            raise ValueError(
                f"a run over {jax.process_count()} processes needs a mesh over all {jax.device_count()} devices "
                f"(e.g. --mesh data={jax.device_count()})"
            )
        if self.mesh is not None:
            mesh_lib.check_batch(config.batch_size, self.mesh)
            self.local_rows = mesh_lib.local_rows(config.batch_size, self.mesh)
            abstract = jax.eval_shape(self.init_state)
            params = mesh_lib.tree_shardings(abstract.params, self.mesh)
            opt_state = mesh_lib.tree_shardings(abstract.opt_state, self.mesh)
            tokens = mesh_lib.batch_sharding(self.mesh)
            self._shardings = (params, opt_state, tokens)
            step_kw = step_lib.jit_kwargs(abstract.params, abstract.opt_state, self.mesh, batch_args=2)
            eval_kw = {"in_shardings": (params, tokens)}
        # The step plan, auto and bench compile (remat_kit.step); parameters and optimizer state donated.
        micro_step = step_lib.make_step(self._loss, self.optimizer, on_trace=lambda: self._count_trace("step"))
        self._micro_step = jax.jit(micro_step, **step_kw)
        self._eval = jax.jit(self._eval_impl, **eval_kw)

    def state_shardings(self) -> dict[str, Any] | None:
        """Shardings of :meth:`TrainState.to_dict`'s leaves on the mesh (None without a mesh).

        Parameters and optimizer state are FSDP-sharded; the step, data position and RNG are
        replicated, so that every process holds them and a checkpoint stores them once.
        """
        if self._shardings is None:
            return None
        params, opt_state, _ = self._shardings
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return {"params": params, "opt_state": opt_state, "step": replicated, "data_position": replicated,
                "rng": replicated}  # fmt: skip

    def abstract_state(self) -> dict[str, Any]:
        """:meth:`TrainState.to_dict` of a fresh state as ``jax.ShapeDtypeStruct`` leaves (with the mesh's
        shardings), nothing allocated: what a checkpoint is restored into, resharded as needed."""
        abstract = jax.eval_shape(lambda: self.init_state().to_dict())
        # Without a mesh: one device. Orbax needs a target sharding to read a checkpoint that
        # another process count wrote.
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = self.state_shardings() or jax.tree.map(lambda _: one, abstract)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    def place(self, state: TrainState) -> TrainState:
        """Put a state on the mesh (:meth:`state_shardings`; a no-op without one)."""
        shardings = self.state_shardings()
        if shardings is None:
            return state
        multi = jax.process_count() > 1

        def put(x, sharding):
            # Across processes, a process-local array (the same in every process: a fresh state,
            # or the step counter) goes to the global mesh from host memory.
            if multi and getattr(x, "is_fully_addressable", True):
                x = np.asarray(x)
            return jax.device_put(x, sharding)

        return TrainState(**jax.tree.map(put, state.to_dict(), shardings))

    def _tokens(self, tokens) -> jax.Array:
        if self._shardings is None:
            return jnp.asarray(tokens)
        tokens = np.asarray(tokens)
        if tokens.shape[0] == self.config.batch_size:  # a whole global batch: keep this process's rows
            tokens = tokens[self.local_rows]
        return mesh_lib.global_batch(tokens, self.config.batch_size, self.mesh)

    def _count_trace(self, name: str) -> None:
        # Runs only while tracing. Per instance, unlike chex.assert_max_traces, whose counter is
        # keyed by source code and call stack and so is shared by every Trainer in the process.
        self.traces[name] += 1
        if self.traces[name] > 1:
            raise RetraceError(f"the jitted {name} function was traced {self.traces[name]} times; it must trace once")

    def _loss(self, params, tokens, key):
        dropout = self.config.model.dropout > 0
        return lm_loss(
            self.model,
            params,
            tokens,
            loss_chunks=self.config.loss_chunks,
            deterministic=not dropout,
            rngs={"dropout": key} if dropout else None,
        )

    def _eval_impl(self, params, tokens):
        self._count_trace("eval")
        return lm_loss(self.model, params, tokens, loss_chunks=self.config.loss_chunks)

    def init_state(self) -> TrainState:
        """A fresh state from ``config.seed``."""
        key = jax.random.key(self.config.seed)
        params = _init_params(self.config.model, jax.random.fold_in(key, 0))
        return TrainState(
            params=params,
            opt_state=step_lib.init_optimizer(self.optimizer, params),
            step=jnp.asarray(0, jnp.int32),
            data_position=jnp.asarray(0, jnp.int32),
            rng=jax.random.key_data(jax.random.fold_in(key, 1)),
        )

    def step(self, state: TrainState, batches: Sequence[np.ndarray]) -> tuple[TrainState, dict[str, float]]:
        """One optimizer update over ``grad_accum`` micro-batches (``int32 [batch, seq]`` each).

        Returns:
          The new state and ``{"loss", "grad_norm"}`` averaged over the micro-batches, with
          ``params_finite``: whether every new parameter is finite.
        """
        if len(batches) != self.config.grad_accum:
            raise ValueError(f"step needs {self.config.grad_accum} micro-batches, got {len(batches)}")
        step = int(state.step) + 1
        base = jax.random.wrap_key_data(state.rng)
        params, opt_state = state.params, state.opt_state
        losses, norms, finite = [], [], []
        for micro, tokens in enumerate(batches):
            key = jax.random.fold_in(jax.random.fold_in(base, step), micro)
            params, opt_state, loss, norm, ok = self._micro_step(params, opt_state, self._tokens(tokens), key)
            losses.append(loss)
            norms.append(norm)
            finite.append(ok)
        new = TrainState(
            params=params,
            opt_state=opt_state,
            step=jnp.asarray(step, jnp.int32),
            data_position=jnp.asarray(int(state.data_position) + len(batches), jnp.int32),
            rng=state.rng,
        )
        return new, {
            "loss": float(np.mean(jax.device_get(losses))),
            "grad_norm": float(np.mean(norms)),
            "params_finite": bool(np.all(finite)),
        }

    def evaluate(self, params, windows: np.ndarray) -> float:
        """Mean loss over validation batches ``[num_batches, batch, seq]`` (no dropout).

        Across processes ``windows`` may hold only this process's rows (``[:, local_rows]``).
        """
        return float(np.mean([float(self._eval(params, self._tokens(w))) for w in windows]))


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
      corpus: the text; default :func:`remat_kit.data.load_corpus` of ``data_paths``.
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
    prefix = mesh_lib.process_prefix()
    if prefix:  # another process than 0 of a multi-process run: its lines say which process they are from
        log = functools.partial(lambda inner, msg: inner(prefix + msg), log)
    _check_int("checkpoint_every", checkpoint_every, 1)
    if resume and checkpoint_dir is None:
        raise ValueError("resume needs a checkpoint directory")
    if corpus is None:
        corpus = data.load_corpus(data_paths, max_bytes=max_corpus_bytes)
    train_tokens, val_tokens = corpus.split(config.val_fraction)
    batches = data.Batches(train_tokens, config.batch_size, config.seq_len, config.seed)
    val_windows = data.eval_windows(
        val_tokens, batch_size=config.batch_size, seq_len=config.seq_len, num_batches=config.eval_batches
    )
    metrics_path = Path(metrics_path) if metrics_path is not None else None
    if plot_path is None and metrics_path is not None:
        plot_path = metrics_path.with_suffix(".png")
    for out in (metrics_path, plot_path):
        if out is not None and not Path(out).absolute().parent.is_dir():
            raise OSError(f"cannot write {str(out)!r}: folder {str(Path(out).absolute().parent)!r} does not exist")
    if not mesh_lib.is_main_process():  # process 0 alone writes metrics, the plot and progress
        metrics_path = plot_path = None
        progress = False

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
    mesh_lib.check_same_across_processes(
        {"run": same_run, "mesh": mesh if isinstance(mesh, (str, type(None))) else dict(mesh.shape),
         "checkpoints": checkpoint_dir is not None, "resume": resume, "checkpoint_every": checkpoint_every,
         "keep": keep},
        "run configuration",
    )  # fmt: skip
    ckpts = Checkpoints(checkpoint_dir, keep=keep) if checkpoint_dir is not None else None
    try:
        if ckpts is not None and ckpts.steps() and not resume:
            raise ValueError(
                f"{ckpts.directory} already holds checkpoints (steps {ckpts.steps()}); pass --resume to continue "
                "that run or choose another --checkpoint-dir"
            )
        trainer = Trainer(config, mesh)
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
        val_windows = val_windows[:, trainer.local_rows]  # each process feeds only its rows
        history = _start_metrics(metrics_path, resumed_from or 0)
        state, history = _loop(
            trainer, state, batches, val_windows, ckpts, meta, checkpoint_every, metrics_path, history, progress,
            log, callbacks,
        )  # fmt: skip
    finally:
        if ckpts is not None:
            ckpts.close()
    if plot_path is not None and history:
        write_loss_plot(history, plot_path, title=_title(config))
    return TrainResult(
        state=state, history=tuple(history), resumed_from=resumed_from, step_traces=trainer.traces["step"]
    )


def _title(config: TrainConfig) -> str:
    m = config.model
    shape = f"batch {config.batch_size}x{config.seq_len}"
    return f"d_model {m.d_model} x {m.num_layers} layers, policy {config.policy}, {shape}"


def check_compatible(saved: dict[str, Any], current: dict[str, Any], where: Any = "the checkpoint") -> None:
    """Raise ValueError naming every field where a checkpoint's run differs from this one."""
    old, new = saved.get("config", {}), current["config"]
    old_model = old.get("model", {})
    diffs = [
        f"model.{k}: {old_model.get(k)!r} (checkpoint) vs {v!r} (now)"
        for k, v in new["model"].items()
        if old_model.get(k) != v and k not in MODEL_MAY_CHANGE
    ]
    if diffs:
        raise ValueError(f"checkpoint in {where} is for a different model config: {'; '.join(diffs)}")
    diffs = [f"{k}: {old.get(k)!r} (checkpoint) vs {new[k]!r} (now)" for k in RESUME_MUST_MATCH if old.get(k) != new[k]]
    if saved.get("data", {}).get("fingerprint") != current["data"]["fingerprint"]:
        diffs.append(f"data: {saved.get('data', {}).get('source')!r} (checkpoint) vs {current['data']['source']!r}")
    if diffs:
        raise ValueError(f"cannot resume exactly from {where}; the run differs in {'; '.join(diffs)}")


def schedule_changes(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """Which of :data:`RESUME_MAY_CHANGE` differ between a checkpoint and this run ('' if none)."""
    old, new = saved.get("config", {}), current["config"]
    pairs = [(k, old.get(k), new[k]) for k in RESUME_MAY_CHANGE]
    pairs += [(f"model.{k}", old.get("model", {}).get(k), new["model"].get(k)) for k in MODEL_MAY_CHANGE]
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in pairs if a != b)


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


def _loop(trainer, state, batches, val_windows, ckpts, meta, checkpoint_every, metrics_path, history, progress,
          log, callbacks):  # fmt: skip
    config = trainer.config
    first = int(state.step) + 1
    metrics_file = open(metrics_path, "a") if metrics_path is not None else None  # noqa: SIM115
    bar = _progress(progress, config.steps, first - 1, log)
    try:
        with _StopOnSignal(log) as stop, bar:
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
                    raise DivergedError(
                        f"{what} at step {step}; nothing saved after step {last}. "
                        "Lower --lr (or --clip-norm) and resume"
                    )
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


def _any_process(flag: bool) -> bool:
    """``flag`` or-ed over all processes (every process must call it; free in one process)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


class _StopOnSignal:
    """First Ctrl-C (SIGINT) or SIGTERM: finish and save the current step, then stop; second: stop now.

    The first signal is acknowledged at once ("stopping after this step…"), even while the main thread
    is inside XLA's compiler, where Python runs no signal handler until the compile returns: the C-level
    handler writes the signal to a wake-up socket (``signal.set_wakeup_fd``) that a thread watches.
    """

    MESSAGE = "stopping after this step… (press Ctrl-C again to stop at once, without saving)"

    def __init__(self, log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)):
        self.requested = False
        self._log = log
        self._acknowledged = threading.Event()
        self._old: dict[int, Any] = {}
        self._old_wakeup = None
        self._sockets = None

    def _acknowledge(self) -> None:
        if not self._acknowledged.is_set():
            self._acknowledged.set()
            self._log(self.MESSAGE)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._acknowledge()

    def _watch(self, sock) -> None:
        with contextlib.suppress(OSError):
            while byte := sock.recv(1):  # b"" once the writing end is closed on exit
                if byte[0] in (signal.SIGINT, signal.SIGTERM):
                    self._acknowledge()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
            import socket

            read, write = socket.socketpair()
            write.setblocking(False)
            self._sockets = (read, write)
            self._old_wakeup = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
            self._watcher = threading.Thread(target=self._watch, args=(read,), daemon=True, name="remat-kit-signal")
            self._watcher.start()
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._sockets is not None:
            signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
            read, write = self._sockets
            write.close()  # the watcher reads EOF and returns; only then is its socket closed
            self._watcher.join(timeout=5)
            read.close()
        return False


class _NoBar:
    def __init__(self, log: Callable[[str], None]):
        self._log = log

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, record):
        pass

    def print(self, msg):
        self._log(msg)


class _RichBar(_NoBar):
    def __init__(self, total: int, done: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[speed]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task = self._progress.add_task("train", total=total, completed=done, loss="-", speed="")

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self._progress.__exit__(*exc)

    def advance(self, record):
        self._progress.update(
            self._task, advance=1, loss=f"{record['loss']:.4f}", speed=f"{record['tokens_per_s']:,.0f} tok/s"
        )

    def print(self, msg):
        self._progress.console.print(msg)


def _progress(enabled: bool, total: int, done: int, log: Callable[[str], None]):
    return _RichBar(total, done) if enabled else _NoBar(log)


def write_loss_plot(history: Sequence[dict[str, Any]], path: str | os.PathLike, title: str = "") -> Path:
    """Save the training (and validation) loss curve of metrics records as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], label="train loss", lw=1)
    val = [r for r in history if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
