"""The ``remat-kit`` command line: one subcommand per feature module.

Each module listed in :data:`COMMAND_MODULES` defines ``add_cli(subparsers)``, which registers its
subparser and sets ``func`` (``args -> exit code``). Bad input surfaces as one line on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Modules that contribute subcommands, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "remat_kit.cli.policies", "remat_kit.cli.train", "remat_kit.cli.plan", "remat_kit.cli.bench"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat-kit", description="Choose, apply and measure activation rematerialization."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 success, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "mesh"):
            from remat_kit.mesh import Processes, initialize_processes

            # Before any device query: joins a multi-process run when flags or the environment configure
            # one, and simulates the mesh's CPU devices (so a laptop can plan a multi-device mesh).
            processes = Processes.resolve(
                getattr(args, "coordinator", None),
                getattr(args, "num_processes", None),
                getattr(args, "process_id", None),
                getattr(args, "distributed_timeout", None),
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


if __name__ == "__main__":
    sys.exit(main())
