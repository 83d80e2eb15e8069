"""``remat-kit train``: the command line of :mod:`remat_kit.train.loop`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from remat_kit import constants
from remat_kit.cli.common import (
    add_lora_args,
    add_parser,
    add_seq_tiles_arg,
    add_shape_args,
    check_seq_tiles_flag,
    float_arg,
    lora_overrides,
    loss_chunks_arg,
)
from remat_kit.train.outputs import PLOT_SUFFIXES, check_output

#: The flags whose values the library checks, and the setting each sets (a key of
#: :data:`remat_kit.train.config.INT_MINIMUMS` or ``NUMBER_RANGES``): the rule is the library's, the error
#: names the flag. Each flag's argparse ``dest`` is its name without dashes.
CHECKED_FLAGS: dict[str, str] = {
    "--steps": "steps",
    "--batch-size": "batch_size",
    "--seq-len": "seq_len",
    "--grad-accum": "grad_accum",
    "--lr": "learning_rate",
    "--warmup-steps": "warmup_steps",
    "--weight-decay": "weight_decay",
    "--clip-norm": "clip_norm",
    "--seed": "seed",
    "--val-fraction": "val_fraction",
    "--eval-every": "eval_every",
    "--eval-batches": "eval_batches",
    "--checkpoint-every": "checkpoint_every",
    "--keep": "keep",
    "--max-corpus-bytes": "max_corpus_bytes",
}


def add_cli(subparsers) -> None:
    """Register ``remat-kit train``."""
    d = constants.TRAIN_DEFAULTS
    p = add_parser(
        subparsers,
        "train",
        help="train the LM on local text under a policy, with resumable checkpoints",
        description="Train the transformer LM on byte-level text (default: the Python standard library's "
        "sources; nothing is downloaded) under any rematerialization policy.",
    )
    p.add_argument("--preset", default="tiny", help=f"model preset: {', '.join(constants.PRESET_NAMES)}")
    p.add_argument(
        "--policy",
        default="none",
        help="rematerialization policy spec (see `remat-kit policies`), or auto (with --budget)",
    )
    p.add_argument(
        "--budget",
        default=None,
        metavar="SIZE",
        help="device memory the step must fit (16GB, 512MiB): the policy is chosen before the first step, as "
        "remat_kit.fit and plan --budget choose it, and recorded in --checkpoint-dir so --resume keeps it",
    )
    p.add_argument("--steps", type=int, default=d["steps"], help="optimizer updates")
    add_shape_args(
        p,
        batch_size=d["batch_size"],
        seq_len=d["seq_len"],
        batch_help="sequences per micro-batch",
        seq_help="tokens per sequence (0: the preset's max_seq_len, at most 256)",
    )
    p.add_argument("--grad-accum", type=int, default=d["grad_accum"], help="micro-batches per update")
    p.add_argument("--lr", type=float_arg, default=d["learning_rate"], help="peak learning rate")
    p.add_argument(
        "--warmup-steps", type=int, default=d["warmup_steps"], help="warm-up steps (-1: 10%% of steps, <= 100)"
    )
    p.add_argument("--weight-decay", type=float_arg, default=d["weight_decay"], help="AdamW weight decay")
    p.add_argument("--clip-norm", type=float_arg, default=d["clip_norm"], help="global gradient-norm clip")
    p.add_argument("--dropout", type=float_arg, default=None, help="override the preset's dropout rate")
    add_lora_args(p)
    p.add_argument(
        "--loss-chunks",
        type=loss_chunks_arg,
        default=d["loss_chunks"],
        help="K: logits, loss and gradients in K chunks (the fused loss); 0: the plain loss; "
        "auto (default): fused where the float32 logits reach 256 MiB",
    )
    add_seq_tiles_arg(p)
    p.add_argument("--seed", type=int, default=d["seed"], help="initialization, dropout and data-order seed")
    p.add_argument("--data", nargs="+", metavar="PATH", help="text files or folders (default: Python stdlib)")
    p.add_argument("--max-corpus-bytes", type=int, default=None, help="read at most this many bytes of text")
    p.add_argument("--val-fraction", type=float_arg, default=d["val_fraction"], help="held-out tail of the corpus")
    p.add_argument("--eval-every", type=int, default=d["eval_every"], help="steps between validation losses (0: never)")
    p.add_argument("--eval-batches", type=int, default=d["eval_batches"], help="validation batches per evaluation")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save orbax checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=3, help="newest checkpoints to keep")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest good checkpoint in --checkpoint-dir (which must exist), appending to --metrics",
    )
    p.add_argument(
        "--metrics",
        metavar="FILE.jsonl",
        help="write one JSON line of metrics per step to this file ('-' is refused: a file, not stdout)",
    )
    p.add_argument(
        "--plot", metavar="FILE.png", help="loss-curve PNG, a path ending in .png (default: beside --metrics)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing --metrics file and its plot (a fresh run)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the final summary as one JSON object on stdout")
    p.add_argument("--mesh", default=None, help="train over a device mesh, e.g. data=4 or data=2,fsdp=2")
    g = p.add_argument_group(
        "many processes (one per host)",
        "Start one process per host with the same flags and its own --process-id; default: JAX_COORDINATOR_ADDRESS, "
        "JAX_NUM_PROCESSES, JAX_PROCESS_ID, or REMAT_KIT_DISTRIBUTED=1 to let JAX detect SLURM / Open MPI.",
    )
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordination service")
    g.add_argument("--num-processes", type=int, default=None, help="processes taking part")
    g.add_argument("--process-id", type=int, default=None, help="this process's index (0 writes metrics)")
    g.add_argument(
        "--distributed-timeout",
        type=int,
        default=None,
        metavar="S",
        help="seconds to wait for all processes to join, and for a process that stopped sending heartbeats "
        "(JAX's heartbeat timeout: then every other process aborts), before exiting with an error "
        f"(default: JAX's {constants.JAX_JOIN_TIMEOUT_S} s to join, {constants.JAX_HEARTBEAT_TIMEOUT_S} s heartbeat)",
    )
    p.set_defaults(func=_train_command, check=_check)


def config_from_args(args: argparse.Namespace):
    """The :class:`remat_kit.train.loop.TrainConfig` of parsed ``remat-kit train`` arguments."""
    from remat_kit.model.transformer import TransformerConfig
    from remat_kit.train.loop import TrainConfig

    overrides = {} if args.dropout is None else {"dropout": float(args.dropout)}
    overrides.update(lora_overrides(args))
    overrides.update(check_seq_tiles_flag(args.seq_tiles))
    return TrainConfig(
        model=TransformerConfig.preset(args.preset, **overrides),
        policy="none" if args.policy == "auto" else args.policy,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        learning_rate=float(args.lr),
        warmup_steps=args.warmup_steps,
        weight_decay=float(args.weight_decay),
        clip_norm=float(args.clip_norm),
        loss_chunks=args.loss_chunks,
        seed=args.seed,
        val_fraction=float(args.val_fraction),
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
    )


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before anything is compiled, to clobber an earlier run's metrics or resume from nowhere."""
    for flag in ("checkpoint_dir", "metrics", "plot"):
        if getattr(args, flag) == "":  # else taken for "not given" (or the working directory)
            raise ValueError(f"--{flag.replace('_', '-')} '' is empty; give a path")
    if args.metrics == "-":
        raise ValueError("--metrics '-': metrics are written to a file (one JSON line per step); give a file path")
    if args.metrics is not None and os.path.isdir(args.metrics):
        raise ValueError(
            f"--metrics {args.metrics!r} is a directory; give a file path, e.g. {args.metrics}/metrics.jsonl"
        )
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir DIR (the run to continue)")
    if args.resume and not os.path.exists(args.checkpoint_dir):
        raise ValueError(f"--resume: checkpoint directory {args.checkpoint_dir!r} does not exist (nothing to resume)")
    if (
        args.checkpoint_dir is not None
        and os.path.exists(args.checkpoint_dir)
        and not os.path.isdir(args.checkpoint_dir)
    ):
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file, not a directory")
    if args.resume and args.overwrite:
        raise ValueError("--resume appends to --metrics and --overwrite replaces it; give one of them")
    if args.dropout is not None and not math.isfinite(args.dropout):  # its range is the model's (dropout)
        raise ValueError(f"--dropout must be a finite number, got {args.dropout!r}")
    plot = args.plot or (str(Path(args.metrics).with_suffix(".png")) if args.metrics else None)
    check_output(args.metrics, "--metrics")
    check_output(plot, "--plot", suffixes=PLOT_SUFFIXES)
    if args.metrics is None or args.resume or args.overwrite:
        return
    outputs = [args.metrics, plot]
    existing = [p for p in outputs if os.path.exists(p)]
    if existing:
        raise ValueError(
            f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; pass --resume to continue "
            "that run (appending), --overwrite to replace, or choose another --metrics"
        )


#: Options that only act together with another: ``{option: (what it needs, why)}``; typed without it, refused.
NEEDS: dict[str, tuple[str, str]] = {
    "keep": ("checkpoint_dir", "it counts the checkpoints kept there"),
    "checkpoint_every": ("checkpoint_dir", "it spaces the checkpoints saved there"),
    "overwrite": ("metrics", "it replaces an existing metrics file and its plot"),
}


def check_values(args: argparse.Namespace) -> None:
    """Refuse a value the library would refuse, naming the flag as typed (``--keep must be …, got 0``), and an
    option that would be ignored."""
    from remat_kit.cli.common import typed
    from remat_kit.train.config import check_setting

    for flag, setting in CHECKED_FLAGS.items():
        check_setting(setting, getattr(args, flag[2:].replace("-", "_")), flag)
    for option, (needed, why) in NEEDS.items():
        if typed(args, option) and getattr(args, needed) is None:
            raise ValueError(f"--{option.replace('_', '-')} needs --{needed.replace('_', '-')}: {why}")
    if typed(args, "eval_batches") and args.eval_every == 0:
        raise ValueError("--eval-batches needs --eval-every N > 0: with --eval-every 0 nothing is evaluated")
    if args.distributed_timeout is not None and args.distributed_timeout < 1:
        raise ValueError(
            f"--distributed-timeout must be a whole number of seconds >= 1, got {args.distributed_timeout}"
        )


def _check(args: argparse.Namespace) -> None:
    """Every check of the options that needs no device: run before a multi-process run is joined."""
    check_outputs(args)
    check_values(args)


#: The file in --checkpoint-dir that records a --budget run's plan (what --resume reuses).
PLAN_FILE = "remat_plan.json"


def read_plan(checkpoint_dir: str) -> dict | None:
    """The plan a --budget run recorded in ``checkpoint_dir``, or None."""
    path = Path(checkpoint_dir) / PLAN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def plan_budget(args: argparse.Namespace, config) -> tuple[str, int]:
    """``--budget``: the policy and sequence tiles the engine chooses (remat_kit.fit's, plan --budget's), printed in
    a few lines and recorded in --checkpoint-dir; on --resume the recorded ones, and a different budget refused in
    one line. Returns ``(policy spec, seq_tiles)``: the tiles are the config's own unless nothing fit untiled."""
    from remat_kit.model import loss as loss_lib
    from remat_kit.planning import fit as fit_lib
    from remat_kit.planning import tensors
    from remat_kit.planning.builtin import Planner
    from remat_kit.planning.planner import DEFAULT_MARGIN, Budget
    from remat_kit.train import distributed
    from remat_kit.units import fmt_bytes

    if args.budget is None:
        raise ValueError("--policy auto chooses the policy that fits --budget SIZE; give --budget (e.g. 16GB)")
    if args.policy not in ("none", "auto"):
        raise ValueError(f"--budget chooses the policy; give --policy auto or leave it out, not {args.policy!r}")
    if args.mesh:
        raise ValueError("--budget plans one device's step; with --mesh give --policy (plan --budget --mesh helps)")
    budget = Budget(fit_lib.budget_bytes_of(args.budget), DEFAULT_MARGIN)
    recorded = read_plan(args.checkpoint_dir) if args.resume and args.checkpoint_dir else None
    if recorded is not None:
        if recorded["budget_bytes"] != budget.bytes:
            raise ValueError(
                f"--resume: this run was planned for --budget {fmt_bytes(recorded['budget_bytes'])} "
                f"(policy {recorded['policy']}), not {fmt_bytes(budget.bytes)}; resume with that budget or start a "
                "new --checkpoint-dir"
            )
        print(f"[train] --budget {fmt_bytes(budget.bytes)}: resuming under the recorded plan {_plan_text(recorded)}")
        return recorded["policy"], recorded.get("seq_tiles", config.model.seq_tiles)
    chunks = loss_lib.resolve_chunks(config.loss_chunks, config.batch_size * config.seq_len, config.model.vocab_size, 1)
    planner = Planner(config.model, loss_chunks=chunks, grad_accum=config.grad_accum)
    choice = tensors.config_choice(
        config.model, budget, batch=config.batch_size, seq=config.seq_len, planner=planner, loss_chunks=chunks
    )
    if choice.chosen is None:
        raise ValueError(choice.reason)
    tiles = f" in {choice.seq_tiles} sequence tiles (nothing fits untiled)" if choice.seq_tiles > 1 else ""
    print(
        f"[train] --budget {fmt_bytes(budget.bytes)} (margin {budget.margin:.0%}): policy {choice.chosen}{tiles}\n"
        f"[train]   compiled need {fmt_bytes(choice.need_bytes)}, estimated step "
        f"{choice.est_step_time_s * 1e3:.3g} ms; {choice.compiles} compiles, {choice.seconds:.1f} s"
    )
    if args.checkpoint_dir and distributed.is_main_process():
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        record = {
            "budget_bytes": budget.bytes,
            "margin": budget.margin,
            "policy": str(choice.chosen),
            "seq_tiles": choice.seq_tiles if choice.seq_tiles > 1 else config.model.seq_tiles,
            "need_bytes": choice.need_bytes,
            "est_step_time_s": choice.est_step_time_s,
        }
        (Path(args.checkpoint_dir) / PLAN_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return str(choice.chosen), choice.seq_tiles if choice.seq_tiles > 1 else config.model.seq_tiles


def _plan_text(recorded: dict) -> str:
    """A recorded plan in words: its policy, and its sequence tiles when it runs tiled."""
    tiles = recorded.get("seq_tiles", 1)
    return recorded["policy"] + ("" if tiles == 1 else f" in {tiles} sequence tiles")


def _with_plan(config, policy: str, seq_tiles):
    """``config`` under a plan: its policy, and the model's sequence tiles."""
    if seq_tiles != config.model.seq_tiles:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, seq_tiles=seq_tiles))
    return dataclasses.replace(config, policy=policy)


def _train_command(args: argparse.Namespace) -> int:
    import numpy as np

    from remat_kit.train import distributed
    from remat_kit.train.loop import train

    config = config_from_args(args)
    if args.budget is not None or args.policy == "auto":
        config = _with_plan(config, *plan_budget(args, config))
    elif args.resume and args.checkpoint_dir and args.policy == "none":
        recorded = read_plan(args.checkpoint_dir)
        if recorded is not None:  # a budgeted run resumes under its plan (tiles too), never silently under `none`
            print(f"[train] resuming under the recorded plan {_plan_text(recorded)}", file=sys.stderr)
            config = _with_plan(config, recorded["policy"], recorded.get("seq_tiles", config.model.seq_tiles))
    result = train(
        config,
        data_paths=args.data,
        max_corpus_bytes=args.max_corpus_bytes,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        metrics_path=args.metrics,
        plot_path=args.plot,
        progress=not args.no_progress and sys.stderr.isatty(),
        mesh=args.mesh,
    )
    last = result.history[-1] if result.history else {}
    val = f", val_loss {last['val_loss']:.4f}" if "val_loss" in last else ""
    # The first step of a process includes compilation; leave it out of the throughput.
    speeds = [r["tokens_per_s"] for r in result.history[1:]]
    speed = f", {np.median(speeds):,.0f} tokens/s" if speeds else ""
    if args.json:
        summary = {
            "preset": args.preset,
            "policy": config.policy,
            "step": int(result.state.step),
            "loss": last.get("loss"),
            "val_loss": last.get("val_loss"),
            "tokens_per_s": float(np.median(speeds)) if speeds else None,
            "resumed_from": result.resumed_from,
            "checkpoint_dir": args.checkpoint_dir,
            "metrics": args.metrics,
        }
        if distributed.is_main_process():
            print(json.dumps(summary))
        return 0
    print(
        f"{distributed.process_prefix()}trained {args.preset} under {config.policy} to step "
        f"{int(result.state.step)}: loss {last.get('loss', float('nan')):.4f}{val}{speed}"
    )
    return 0
