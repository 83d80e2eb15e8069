"""``remat-kit train``: the command line of :mod:`remat_kit.train`."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from remat_kit import mesh as mesh_lib
from remat_kit.cli.common import add_lora_args, lora_overrides
from remat_kit.model import PRESETS, TransformerConfig
from remat_kit.train import TrainConfig, train


def add_cli(subparsers) -> None:
    """Register ``remat-kit train``."""
    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train the LM on local text under a policy, with resumable checkpoints",
        description="Train the transformer LM on byte-level text (default: the Python standard library's "
        "sources; nothing is downloaded) under any rematerialization policy.",
    )
    p.add_argument("--preset", default="tiny", help=f"model preset: {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--policy", default="none", help="rematerialization policy spec (see `remat-kit policies`)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer updates (default {d.steps})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: max_seq_len, <= 256)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per update (gradient accumulation)")
    p.add_argument("--lr", type=float, default=d.learning_rate, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=-1, help="warm-up steps (default: 10%% of steps, <= 100)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, help="global gradient-norm clip")
    p.add_argument("--dropout", type=float, default=None, help="override the preset's dropout rate")
    add_lora_args(p)
    p.add_argument("--loss-chunks", type=int, default=0, help="compute logits/loss in K chunks (0: plain)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", nargs="+", metavar="PATH", help="text files or folders (default: Python stdlib)")
    p.add_argument("--max-corpus-bytes", type=int, default=None, help="read at most this many bytes of text")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction, help="held-out tail of the corpus")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validation losses (0: never)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save orbax checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=3, help="newest checkpoints to keep")
    p.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in DIR")
    p.add_argument("--metrics", metavar="FILE.jsonl", help="write one JSON line of metrics per step")
    p.add_argument("--plot", metavar="FILE.png", help="loss-curve PNG (default: beside --metrics)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
        f"(default: JAX's {mesh_lib.JAX_JOIN_TIMEOUT_S} s to join, {mesh_lib.JAX_HEARTBEAT_TIMEOUT_S} s heartbeat)",
    )
    p.set_defaults(func=_train_command)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``remat-kit train`` arguments."""
    overrides = {} if args.dropout is None else {"dropout": args.dropout}
    overrides.update(lora_overrides(args))
    return TrainConfig(
        model=TransformerConfig.preset(args.preset, **overrides),
        policy=args.policy,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
        loss_chunks=args.loss_chunks,
        seed=args.seed,
        val_fraction=args.val_fraction,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
    )


def _train_command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
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
    print(f"{mesh_lib.process_prefix()}trained {args.preset} under {config.policy} to step {int(result.state.step)}: "
          f"loss {last.get('loss', float('nan')):.4f}{val}{speed}")  # fmt: skip
    return 0

