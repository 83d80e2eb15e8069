"""A training run's settings and results, the optimizer they imply, and what a resumed run may change.

:class:`TrainConfig`, :class:`TrainState`, :func:`optimizer_for` and :func:`check_compatible`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax
import jax
import optax

from remat_kit import constants, policies
from remat_kit.model import loss
from remat_kit.model.transformer import PRESETS, TransformerConfig, resolve_tiles
from remat_kit.step import update as step_lib
from remat_kit.train import data
from remat_kit.units import check_int

#: Training settings a resumed run must share with its checkpoint: they decide the data order and
#: the optimizer state's structure. The policy, loss chunks and logging may change freely.
RESUME_MUST_MATCH = ("batch_size", "seq_len", "grad_accum", "seed", "val_fraction")


#: Settings that may change on resume (e.g. a lower learning rate after a divergence, or more
#: steps); the continuation is then no longer exact, and a note says so.
RESUME_MAY_CHANGE = ("steps", "learning_rate", "warmup_steps", "min_lr_ratio", "weight_decay", "clip_norm")


#: Model fields that choose an implementation, not the parameters: like the policy, they may
#: change on resume (results then agree to float rounding, not bit for bit).
MODEL_MAY_CHANGE = ("attention", "attention_block")


_DEFAULTS = constants.TRAIN_DEFAULTS

#: The least value of each integer setting of a run: :class:`TrainConfig`'s fields and
#: :func:`remat_kit.train.loop.train`'s own arguments (None: the setting may be None, "no limit").
INT_MINIMUMS: dict[str, int] = {
    "steps": 1,
    "batch_size": 1,
    "grad_accum": 1,
    "eval_batches": 1,
    "seq_len": 0,
    "seed": 0,
    "eval_every": 0,
    "warmup_steps": -1,
    "checkpoint_every": 1,
    "keep": 1,
    "max_corpus_bytes": 1,
}
#: The largest value of an integer setting that has one: a seed is a 32-bit PRNG key (JAX without x64 keeps
#: only the low 32 bits: 2**32 would be the run of seed 0, and 2**63 an OverflowError deep inside JAX).
INT_MAXIMUMS: dict[str, int] = {"seed": 2**32 - 1}
#: Integer settings that may also be None (no limit).
NONE_OK = ("max_corpus_bytes",)

#: What each float setting allows, in words and as a test (the value is also finite).
NUMBER_RANGES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "learning_rate": ("> 0", lambda v: v > 0),
    "clip_norm": ("> 0", lambda v: v > 0),
    "min_lr_ratio": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "weight_decay": (">= 0", lambda v: v >= 0),
    "val_fraction": ("in (0, 1)", lambda v: 0 < v < 1),
}


def check_setting(setting: str, value: Any, name: str | None = None) -> None:
    """Raise a one-line ValueError unless ``value`` is allowed for ``setting`` (a key of :data:`INT_MINIMUMS`
    or :data:`NUMBER_RANGES`); the message calls it ``name`` (default: the setting; the CLI gives its flag).

    >>> check_setting("learning_rate", 1e-3)
    >>> check_setting("learning_rate", -1.0, "--lr")
    Traceback (most recent call last):
    ...
    ValueError: --lr must be a finite number > 0, got -1.0
    """
    name = name or setting
    if setting in INT_MINIMUMS:
        if value is not None or setting not in NONE_OK:  # None: not given (no limit)
            check_int(name, value, INT_MINIMUMS[setting])
            high = INT_MAXIMUMS.get(setting)
            if high is not None and value > high:
                raise ValueError(f"{name} must be an integer in {INT_MINIMUMS[setting]}..{high}, got {value}")
        return
    allowed, ok = NUMBER_RANGES[setting]
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not number or not ok(value):
        raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")


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
      loss_chunks: ``"auto"``: the fused loss where the logits are large, the plain one elsewhere
        (:func:`remat_kit.model.loss.auto_chunks`; the plain loss on a mesh of several devices); 0: the
        plain loss; k > 0: logits, loss and their gradients in k chunks (the fused loss).
      seed: initialization, dropout and data-order seed.
      val_fraction: the tail of the corpus held out for validation.
      eval_every: steps between validation losses (and at the last step); 0: never.
      eval_batches: validation batches per evaluation.
    """

    model: TransformerConfig = PRESETS["tiny"]
    policy: str = "none"
    steps: int = _DEFAULTS["steps"]
    batch_size: int = _DEFAULTS["batch_size"]
    seq_len: int = _DEFAULTS["seq_len"]
    grad_accum: int = _DEFAULTS["grad_accum"]
    learning_rate: float = _DEFAULTS["learning_rate"]
    warmup_steps: int = _DEFAULTS["warmup_steps"]
    min_lr_ratio: float = 0.1
    weight_decay: float = _DEFAULTS["weight_decay"]
    clip_norm: float = _DEFAULTS["clip_norm"]
    loss_chunks: int | str = _DEFAULTS["loss_chunks"]
    seed: int = _DEFAULTS["seed"]
    val_fraction: float = _DEFAULTS["val_fraction"]
    eval_every: int = _DEFAULTS["eval_every"]
    eval_batches: int = _DEFAULTS["eval_batches"]

    def __post_init__(self):
        if not isinstance(self.model, TransformerConfig):
            raise TypeError(f"model must be a TransformerConfig, got {type(self.model).__name__}")
        if self.model.vocab_size < data.BYTE_VOCAB:
            raise ValueError(
                f"vocab_size={self.model.vocab_size} is smaller than the {data.BYTE_VOCAB} byte-level tokens"
            )
        # Canonical spec: "minimal" and "selective:q_proj,..." of the same policy compare equal.
        object.__setattr__(self, "policy", str(policies.parse(self.policy)))
        for field in ("steps", "batch_size", "grad_accum", "eval_batches", "seq_len", "seed", "eval_every"):
            check_setting(field, getattr(self, field))
        loss.check_chunks(self.loss_chunks)
        check_setting("warmup_steps", self.warmup_steps)
        if self.seq_len == 0:
            object.__setattr__(self, "seq_len", min(self.model.max_seq_len, 256))
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}")
        tokens = self.batch_size * self.seq_len
        if self.loss_chunks != "auto" and self.loss_chunks > tokens:  # chunks of no token: padding only
            raise ValueError(
                f"loss_chunks={self.loss_chunks} exceeds the {tokens} tokens of a micro-batch (batch_size × "
                f"seq_len); allowed: 0..{tokens} or 'auto'"
            )
        resolve_tiles(self.model.seq_tiles, self.batch_size, self.seq_len)  # tiles must divide seq_len
        if self.warmup_steps == -1:
            object.__setattr__(self, "warmup_steps", min(100, self.steps // 10))
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be smaller than steps={self.steps}")
        for field in NUMBER_RANGES:
            check_setting(field, getattr(self, field))

    @property
    def tokens_per_step(self) -> int:
        """Tokens seen per optimizer update."""
        return self.batch_size * self.seq_len * self.grad_accum

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the model config nested under ``model``)."""
        return {**dataclasses.asdict(self), "model": dataclasses.asdict(self.model)}


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


def optimizer_for(config: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
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
