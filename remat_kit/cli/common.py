"""Command-line helpers shared by the subcommands: model/shape options, output files, the command line."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from remat_kit import analysis, lora
from remat_kit.attention import ATTENTION_KINDS
from remat_kit.model import DTYPES, PRESET_SHAPES, PRESETS, TransformerConfig


def check_writable(path: str | None, what: str) -> None:
    """Raise OSError now (before minutes of compiling) if ``path`` cannot be written."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OSError(f"{what} {path!r} is a directory; give a file path")
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise OSError(f"{what} {path!r}: {parent!r} is not a directory")
    if not os.path.isdir(parent):
        raise OSError(f"{what} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise OSError(f"{what} {path!r} is not writable")


def add_model_args(parser: argparse.ArgumentParser, default_preset: str) -> None:
    """The model and shape options plan and bench share."""
    parser.add_argument("--preset", default=default_preset, help=f"model preset: {', '.join(PRESETS)}")
    parser.add_argument(
        "--model",
        default=None,
        metavar="MODULE:FACTORY",
        help="your own model instead of a preset: FACTORY(policy) returns (loss_fn, example_args), "
        "loss_fn(params, *batch) -> scalar, example_args arrays or jax.ShapeDtypeStructs",
    )
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the preset's)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: the preset's)")
    parser.add_argument("--param-dtype", choices=DTYPES, default=None, help="parameter dtype (default: the preset's)")
    parser.add_argument(
        "--attention", choices=ATTENTION_KINDS, default=None, help="attention implementation (default: the preset's)"
    )
    parser.add_argument(
        "--loss-chunks", type=int, default=0, help="0: plain loss over full logits; K: chunked cross-entropy"
    )
    add_lora_args(parser)


def config_from_args(args: argparse.Namespace) -> tuple[TransformerConfig, int, int]:
    """The config and ``(batch, seq)`` the options ask for, validated before anything is traced."""
    overrides: dict[str, Any] = {}
    if args.dtype:
        overrides["dtype"] = args.dtype
    if args.param_dtype:
        overrides["param_dtype"] = args.param_dtype
    if args.attention:
        overrides["attention"] = args.attention
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    overrides.update(lora_overrides(args))
    config = TransformerConfig.preset(args.preset, **overrides)
    default_batch, default_seq = PRESET_SHAPES.get(args.preset, (1, min(128, config.max_seq_len)))
    batch = default_batch if args.batch is None else args.batch
    seq = default_seq if args.seq is None else args.seq
    analysis.check_shape(config, batch, seq, args.loss_chunks)
    return config, batch, seq


def command_line(name: str, args: argparse.Namespace) -> str:
    """The canonical command that reproduces a run (every option spelled out), for results files."""
    skip = {"func", "command", "json", "markdown", "plot"}
    parts = [f"remat-kit {name}"]
    for key, value in sorted(vars(args).items()):
        if key in skip or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts)


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")



def add_lora_args(parser) -> None:
    """Add ``--lora-rank/--lora-alpha/--lora-targets/--quantize`` to an argparse parser (train, plan, bench)."""
    parser.add_argument("--lora-rank", type=int, default=None, help="LoRA: train rank-R adapters on a frozen base")
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA: adapter scale alpha/R (default 16)")
    parser.add_argument(
        "--lora-targets",
        default=None,
        help=f"LoRA: comma-separated layers, or all (default q_proj,v_proj; allowed: {','.join(lora.TARGETS)})",
    )
    parser.add_argument("--quantize", choices=lora.QUANTIZE_MODES, default=None, help="store the frozen base as int8")


def lora_overrides(args) -> dict[str, Any]:
    """TransformerConfig overrides of the flags :func:`add_lora_args` adds (only those given)."""
    out: dict[str, Any] = {}
    if getattr(args, "lora_rank", None) is not None:
        out["lora_rank"] = args.lora_rank
    if getattr(args, "lora_alpha", None) is not None:
        out["lora_alpha"] = args.lora_alpha
    if getattr(args, "lora_targets", None) is not None:
        out["lora_targets"] = lora.parse_targets(args.lora_targets)
    if getattr(args, "quantize", None) is not None:
        out["quantize"] = args.quantize
    return out

