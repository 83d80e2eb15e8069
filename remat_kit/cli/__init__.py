"""The ``remat-kit`` command line: one module per subcommand (``remat_kit/cli/<command>.py``).

Each module listed in :data:`COMMAND_MODULES` defines ``add_cli(subparsers)``, which registers its
subparser and sets ``func`` (``args -> exit code``). Only ``func`` imports the library (jax, flax,
optax), so building the parser, and so ``--help``, is instant; an optional ``check`` (``args -> None``) reads
the options before a multi-process run is joined. Bad input surfaces as one line on stderr and exit status 2,
never a traceback; a mistyped option is argparse's one line and a ``--help`` hint. Ctrl-C at any moment exits
130 with one line: at once, or for ``train`` after saving what it has (:mod:`remat_kit.train.interrupt`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

#: Modules that contribute subcommands, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "remat_kit.cli.policies",
    "remat_kit.cli.train",
    "remat_kit.cli.plan",
    "remat_kit.cli.bench",
    "remat_kit.cli.tags",
)


def version() -> str:
    """The installed distribution's version (the package's own when it runs from a source tree)."""
    from importlib import metadata

    try:
        return metadata.version("remat-kit")
    except metadata.PackageNotFoundError:
        from remat_kit import __version__

        return __version__


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and a pointer to ``--help``, as git's and cargo's are,
    instead of the 14–20 lines of usage above the error. The subcommands' parsers are of this class too
    (argparse makes them of their parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole parser. Imports no jax, flax or optax: ``--help`` answers at once (tests/test_cli.py)."""
    parser = Parser(
        prog="remat-kit",
        description="Choose, apply and measure activation rematerialization (gradient checkpointing) in JAX/Flax.",
        epilog="`remat-kit COMMAND --help` describes each command and its options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_cli(subparsers)
    return parser


#: Options whose value may start with "-" (argparse would read "-5GB" as an option and say only
#: "expected one argument"); ``main`` joins them as ``--budget=-5GB`` so the value's own check speaks.
_SIGNED_VALUES = ("--budget", "--margin")


def _join_signed(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _SIGNED_VALUES and i + 1 < len(argv) and argv[i + 1][:2].lstrip("-")[:1].isdigit():
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def _typed(argv: list[str]) -> frozenset[str]:
    """The options ``argv`` sets (their ``dest``), told apart from those left at their defaults: the commands
    refuse an option that would be ignored (``--keep`` without ``--checkpoint-dir``) even at its default value."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = set()
    for sub in subparsers.choices.values():
        for action in sub._actions:
            if action.option_strings:
                action.default = argparse.SUPPRESS
                options.add(action.dest)
    return frozenset(vars(parser.parse_args(argv))) & options


#: Options whose empty value the command's own check words (what is allowed there): the rest share one message.
_OWN_EMPTY_CHECK = frozenset(
    {"policies", "budget", "json", "markdown", "plot", "timeline", "metrics", "checkpoint_dir"}
)


def _refuse_empty(args: argparse.Namespace) -> None:
    """An option typed with an empty value (``--mesh ''``, ``--data ''``) is refused: read as "not given", it
    would be ignored without a word."""
    for dest in sorted(args.typed - _OWN_EMPTY_CHECK):
        value = getattr(args, dest, None)
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError(
                f"--{dest.replace('_', '-')} '' is empty; give a value (see `remat-kit {args.command} --help`)"
            )


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    # A warning a user should read (a damaged checkpoint moved aside), without the source line under it.
    print(f"warning: {message}", file=file or sys.stderr)


def _on_signal(command: str, guard):
    """What Ctrl-C does while ``command`` runs, in place of the start-up ``guard`` (an ExitOnSignal).

    ``train`` saves what it has: its first Ctrl-C sets a flag the loop reads between phases and steps
    (remat_kit.train.interrupt.StopOnSignal, in place before JAX is imported). Every other command has
    nothing to save, so Ctrl-C ends it at once, even mid-compile: the guard stays, saying which command stopped.
    """
    if command != "train":
        guard.message = f"remat-kit {command}: interrupted"
        return contextlib.nullcontext()
    from remat_kit.train.interrupt import StopOnSignal

    return StopOnSignal(exit_at_once=True)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 success, 1 nothing fits, 2 bad input, 130 interrupted)."""
    from remat_kit.train.interrupt import ExitOnSignal

    # From the first line: a Ctrl-C while the parser is built (which imports every command's module) or the
    # arguments are read ends the process with one line, as it does later (the `except` is for a caller
    # on another thread, where no handler can be installed, and for a KeyboardInterrupt raised by code).
    try:
        with ExitOnSignal("remat-kit: interrupted") as guard:
            return _main(argv, guard)
    except KeyboardInterrupt:
        print("remat-kit: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _private_tempdir():
    """Temporary files of the command (XLA's dumps) go under one folder, removed on exit and on Ctrl-C,
    which ends the process without running ``finally`` blocks."""
    import shutil
    import tempfile

    from remat_kit.train.interrupt import on_exit

    folder = tempfile.mkdtemp(prefix="remat-kit-")
    remove = lambda: shutil.rmtree(folder, ignore_errors=True)
    before, tempfile.tempdir = tempfile.tempdir, folder
    try:
        with on_exit(remove):
            yield folder
    finally:
        tempfile.tempdir = before
        remove()


def _main(argv: list[str] | None, guard) -> int:
    import warnings

    from remat_kit.cli import common

    parser = build_parser()
    argv = _join_signed(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    args.typed = _typed(argv)
    # --json without a path: the JSON is the only thing on stdout; the text report goes to stderr.
    to_stderr = getattr(args, "json", None) == "-" and args.command in ("plan", "bench")
    common.JSON_STDOUT = sys.stdout if to_stderr else None
    try:
        redirect = contextlib.redirect_stdout(sys.stderr) if to_stderr else contextlib.nullcontext()
        # train keeps its checkpoints' temporary files beside them (orbax): the private folder is for the others.
        scratch = contextlib.nullcontext() if args.command == "train" else _private_tempdir()
        with redirect, warnings.catch_warnings(), scratch, _on_signal(args.command, guard):
            warnings.showwarning = _one_line_warning
            _refuse_empty(args)
            if hasattr(args, "check"):  # the options alone, before a multi-process run is joined
                args.check(args)
            if hasattr(args, "mesh"):
                from remat_kit.train.distributed import Processes, initialize_processes

                # Before any device query: joins a multi-process run when flags or the environment
                # configure one, and simulates the mesh's CPU devices (so a laptop can plan a mesh).
                processes = Processes.resolve(
                    getattr(args, "coordinator", None),
                    getattr(args, "num_processes", None),
                    getattr(args, "process_id", None),
                    getattr(args, "distributed_timeout", None),
                )
                if processes is None and getattr(args, "distributed_timeout", None) is not None:
                    raise ValueError(
                        "--distributed-timeout goes with a run of several processes (--coordinator, "
                        "JAX_COORDINATOR_ADDRESS or REMAT_KIT_DISTRIBUTED=1); one process joins nothing"
                    )
                initialize_processes(args.mesh, processes)
            return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError) as err:
        # Bad input is reported as one line; anything else is a bug and keeps its traceback.
        print(f"remat-kit {args.command}: error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"remat-kit {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        common.JSON_STDOUT = None


if __name__ == "__main__":
    sys.exit(main())
