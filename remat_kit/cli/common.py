"""Command-line helpers shared by the subcommands: model/shape options, output files, the command line.

Nothing here imports jax, flax or optax at module level: building the parser (``--help``) must be
instant, so the library is imported inside the functions that run a command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from remat_kit import constants
from remat_kit.train.outputs import PLOT_SUFFIXES, check_output, make_parent


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except where there is none to show (None, off) or the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return text
        if "default" in text:
            return text
        return super()._get_help_string(action)


def add_parser(subparsers, name: str, *, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand parser with the shared help formatter (defaults shown)."""
    return subparsers.add_parser(
        name, help=help, description=description or help[:1].upper() + help[1:] + ".", formatter_class=HelpFormatter
    )


def add_shape_args(
    parser: argparse.ArgumentParser, *, batch_size: int | None, seq_len: int | None, batch_help: str, seq_help: str
) -> None:
    """``--batch-size``/``--seq-len`` (every command's spelling), with ``--batch``/``--seq`` as hidden aliases."""
    parser.add_argument("--batch-size", type=int, default=batch_size, metavar="B", help=batch_help)
    parser.add_argument("--seq-len", type=int, default=seq_len, metavar="S", help=seq_help)
    # Older spellings (plan and bench used them): still accepted, no longer shown.
    parser.add_argument("--batch", dest="batch_size", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument("--seq", dest="seq_len", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


#: Where ``--json -`` writes: the real stdout, while the command's text goes to stderr (set by ``main``).
JSON_STDOUT = None


def say(line: str) -> None:
    """A progress line on stderr, in one write: a Ctrl-C's line, written from another thread as the process
    ends, then never lands inside it (``print`` writes the text and its newline apart when unbuffered).

    >>> import contextlib, io, sys
    >>> with contextlib.redirect_stderr(io.StringIO()) as err:
    ...     say("[1/8] none: tracing and compiling ...")
    >>> err.getvalue()
    '[1/8] none: tracing and compiling ...\\n'
    """
    import sys

    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def add_json_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json PATH`` writes ``what`` as JSON; ``--json`` alone (or ``-``) prints it on stdout, the text on stderr."""
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help=f"write {what} as JSON to PATH; without PATH, print it on stdout (and the text on stderr)",
    )


def check_writable(path: str | None, what: str, *, suffixes: tuple[str, ...] | None = None) -> None:
    """Raise now (before minutes of compiling) if ``path`` could not be written at the end (``-``: stdout).

    The rule is :func:`remat_kit.train.outputs.check_output`'s, the one ``train`` applies: a folder that does
    not exist yet is created when the file is written (:func:`write_json`, :func:`made`).
    """
    if path == "":  # else taken for "not given", and nothing written
        raise ValueError(f"{what} '' is empty; give a file path")
    if path and path != "-":
        check_output(path, what, suffixes=suffixes)


def check_plot(path: str | None, what: str = "--plot") -> None:
    """Raise now, before any work, unless a plot can be written at ``path`` (a picture suffix, a writable place)."""
    check_writable(path, what, suffixes=PLOT_SUFFIXES)


def made(path: str) -> str:
    """``path``, its folder created if missing (a file checked by :func:`check_writable` is about to be written)."""
    make_parent(path)
    return path


def typed(args: argparse.Namespace, *dests: str) -> list[str]:
    """The options among ``dests`` the command line set (as ``--flag-name``), even to their default values.

    Without the command line's record (a namespace parsed directly), those not at None, 0 or False.

    >>> typed(argparse.Namespace(keep=3, typed=frozenset({"keep"})), "keep", "overwrite")
    ['--keep']
    """
    if hasattr(args, "typed"):
        return [f"--{d.replace('_', '-')}" for d in dests if d in args.typed]
    return [f"--{d.replace('_', '-')}" for d in dests if getattr(args, d, None) not in (None, 0, False)]


@contextlib.contextmanager
def factory_errors():
    """A ``--model`` factory's own exception: its traceback (the user's code), then one line naming the factory
    (a ValueError, which the command line prints as its error line)."""
    import traceback

    from remat_kit.planning.user_model import FactoryError

    try:
        yield
    except FactoryError as err:
        traceback.print_exception(err.__cause__)
        raise ValueError(f"{err} (the traceback above is the model's)") from None


def check_jobs(jobs: int) -> None:
    """``--jobs``: at least one compile at a time."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")


def add_model_args(parser: argparse.ArgumentParser, default_preset: str) -> None:
    """The model and shape options plan and bench share."""
    parser.add_argument("--preset", default=default_preset, help=f"model preset: {', '.join(constants.PRESET_NAMES)}")
    parser.add_argument(
        "--model",
        default=None,
        metavar="MODULE:FACTORY",
        help="your own model instead of a preset: FACTORY(policy) returns (loss_fn, example_args), "
        "loss_fn(params, *batch) -> scalar, example_args arrays or jax.ShapeDtypeStructs",
    )
    shapes = ", ".join(f"{k} {b}" for k, (b, _) in constants.PRESET_SHAPES.items())
    add_shape_args(
        parser,
        batch_size=None,
        seq_len=None,
        batch_help=f"batch size (default: the preset's: {shapes})",
        seq_help="sequence length (default: the preset's: "
        + ", ".join(f"{k} {s}" for k, (_, s) in constants.PRESET_SHAPES.items())
        + ")",
    )
    parser.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--dtype", choices=constants.DTYPES, default=None, help="compute dtype (default: the preset's)")
    parser.add_argument(
        "--param-dtype", choices=constants.DTYPES, default=None, help="parameter dtype (default: the preset's)"
    )
    parser.add_argument(
        "--attention",
        choices=constants.ATTENTION_KINDS,
        default=None,
        help="attention implementation (default: the preset's)",
    )
    parser.add_argument(
        "--loss-chunks",
        type=loss_chunks_arg,
        default=DefaultChunks(0),
        help="0: plain loss over full logits; K: the fused chunked cross-entropy; auto: as `train` picks "
        "(default 0; plan --max-seq: auto, the longest sequence is what the levers give)",
    )
    add_seq_tiles_arg(parser)
    add_lora_args(parser)


class TypedFloat(float):
    """argparse type of a float option that remembers how it was typed: its repr, which error messages
    show, is the text (``--lr 1e309`` is refused as ``got 1e309``, not ``got inf``).

    >>> value = TypedFloat("1e309")
    >>> value == float("inf"), repr(value), repr(float(value))
    (True, '1e309', 'inf')
    """

    text: str

    def __new__(cls, text: str) -> TypedFloat:
        value = super().__new__(cls, text)
        value.text = text.strip()
        return value

    def __repr__(self) -> str:
        return self.text


def float_arg(text: str) -> TypedFloat:
    """argparse type of a float option: a :class:`TypedFloat`, else argparse's own "invalid float value"."""
    try:
        return TypedFloat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None


class DefaultChunks(int):
    """``--loss-chunks``'s default, 0, told apart from a 0 typed: ``plan --max-seq`` then uses ``auto`` (a flag
    given, ``0`` included, opts out).

    >>> DefaultChunks(0) == 0, type(DefaultChunks(0)).__name__
    (True, 'DefaultChunks')
    """


def loss_chunks_arg(text: str) -> int | str:
    """argparse type of ``--loss-chunks``: ``auto`` or an integer (checked later, with the shape)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {text!r}") from None


def seq_tiles_arg(text: str) -> int | str:
    """argparse type of ``--seq-tiles``: ``auto`` or an integer (checked by :func:`check_seq_tiles_flag`)."""
    return loss_chunks_arg(text)


def add_seq_tiles_arg(parser: argparse.ArgumentParser) -> None:
    """``--seq-tiles K|auto`` (train, plan, bench): the block's per-token parts in K sequence tiles."""
    parser.add_argument(
        "--seq-tiles",
        type=seq_tiles_arg,
        default=None,
        metavar="K|auto",
        help="run the block's per-token parts (norms, projections, MLP) over the sequence in K tiles, each under "
        "its own checkpoint, so a layer's recompute never holds their whole-sequence intermediates; K divides "
        "the sequence; auto: tiles of about 4,096 tokens once a step has more (default: 1, untiled; plan --max-seq: "
        "auto)",
    )


def check_seq_tiles_flag(value) -> dict[str, Any]:
    """The TransformerConfig override of ``--seq-tiles`` (empty when not given), refused in the flag's words."""
    if value is None:
        return {}
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"--seq-tiles must be 'auto' or an integer >= 1 (1: untiled), got {value!r}")
    return {"seq_tiles": value}


def config_from_args(args: argparse.Namespace):
    """The ``(TransformerConfig, batch, seq)`` the options ask for, validated before anything is traced."""
    from remat_kit.model.transformer import TransformerConfig
    from remat_kit.planning import analysis

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
    overrides.update(check_seq_tiles_flag(getattr(args, "seq_tiles", None)))
    config = TransformerConfig.preset(args.preset, **overrides)
    default_batch, default_seq = constants.PRESET_SHAPES.get(args.preset, (1, min(128, config.max_seq_len)))
    batch = default_batch if args.batch_size is None else args.batch_size
    seq = default_seq if args.seq_len is None else args.seq_len
    if args.loss_chunks == "auto":  # the count goes into headers and JSON, as an explicit one would
        from remat_kit.model.loss import auto_chunks
        from remat_kit.step.mesh import MeshSpec

        devices = MeshSpec.parse(getattr(args, "mesh", None)).size
        args.loss_chunks = auto_chunks(batch * seq, config.vocab_size, devices)
    analysis.check_shape(config, batch, seq, args.loss_chunks)
    return config, batch, seq


def command_line(name: str, args: argparse.Namespace) -> str:
    """The canonical command that reproduces a run (every option spelled out), for results files."""
    skip = {"func", "command", "json", "markdown", "plot", "no_progress", "typed", "check"}
    parts = [f"remat-kit {name}"]
    for key, value in sorted(vars(args).items()):
        if key in skip or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON at ``path`` (``-``: the real stdout, see :data:`JSON_STDOUT`)."""
    if path == "-":
        import sys

        out = JSON_STDOUT or sys.stdout
        json.dump(payload, out, indent=1)
        out.write("\n")
        return
    with open(made(path), "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")


def add_lora_args(parser) -> None:
    """Add ``--lora-rank/--lora-alpha/--lora-targets/--quantize`` to an argparse parser (train, plan, bench)."""
    parser.add_argument("--lora-rank", type=int, default=None, help="LoRA: train rank-R adapters on a frozen base")
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA: adapter scale alpha/R (default 16)")
    parser.add_argument(
        "--lora-targets",
        default=None,
        help="LoRA: comma-separated layers, or all (default q_proj,v_proj; allowed: "
        + ",".join(constants.LORA_TARGETS)
        + ")",
    )
    parser.add_argument(
        "--quantize",
        choices=constants.QUANTIZE_MODES,
        default=None,
        help="store the frozen base as int8 (per channel) or nf4 (QLoRA's 4-bit NormalFloat); needs --lora-rank",
    )


def lora_overrides(args) -> dict[str, Any]:
    """TransformerConfig overrides of the flags :func:`add_lora_args` adds (only those given)."""
    out: dict[str, Any] = {}
    for flag in ("lora_alpha", "lora_targets"):
        value = getattr(args, flag, None)
        if value is not None and not getattr(args, "lora_rank", None):  # else the full model trains, no word
            raise ValueError(
                f"--{flag.replace('_', '-')} {value} needs --lora-rank R > 0: it sets the LoRA adapters, and "
                "without a rank there are none (the full model would train)"
            )
    if getattr(args, "lora_rank", None) is not None:
        out["lora_rank"] = args.lora_rank
    if getattr(args, "lora_alpha", None) is not None:
        out["lora_alpha"] = args.lora_alpha
    if getattr(args, "lora_targets", None) is not None:
        from remat_kit.model import lora

        out["lora_targets"] = lora.parse_targets(args.lora_targets)
    if getattr(args, "quantize", None) is not None:
        if not out.get("lora_rank"):  # the flags' names, before the config's own check words it in its fields
            raise ValueError(
                f"--quantize {args.quantize} needs --lora-rank R > 0: a quantized base is frozen, and only LoRA "
                "adapters train over it"
            )
        out["quantize"] = args.quantize
    return out
