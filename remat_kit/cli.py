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
COMMAND_MODULES: tuple[str, ...] = ("remat_kit.cli", "remat_kit.train", "remat_kit.plan", "remat_kit.bench")


def _policies_command(args: argparse.Namespace) -> int:
    from remat_kit import names, policies

    rows = [
        ("none", "every activation", "nothing", "-"),
        ("full", "each layer's input", "the whole layer", "-"),
        ("every_n:N", "all of layers not in 0, N, 2N, ...", "layers 0, N, 2N, ...", "-"),
        ("selective[:TAGS]", "layer inputs + TAGS (default: matmul outputs)", "the rest (softmax, norms, act.)", "-"),
        ("offload[:TAGS]", "save=TAGS on device", "the rest", "TAGS (default: layer inputs)"),
        ("segments:K", "every K-th layer boundary", "K layers at a time", "-"),
        ("sqrt_n", "every ~sqrt(L)-th layer boundary", "~sqrt(L) layers at a time", "-"),
        ("dots", "matmul outputs without batch dims", "the rest", "-"),
    ]
    print(f"{'policy':18} {'keeps':48} {'recomputes':34} offloads")
    for row in rows:
        print(f"{row[0]:18} {row[1]:48} {row[2]:34} {row[3]}")
    print("\nMaxText presets: " + ", ".join(policies.MAXTEXT_ALIASES))
    print("default selective keeps: " + ",".join(policies.SELECTIVE_DEFAULT))
    print("\ncheckpoint tags: " + ", ".join(names.VOCABULARY))
    print("aliases: " + ", ".join(f"{a}={'+'.join(t)}" for a, t in names.ALIASES.items()))
    if args.spec:
        p = policies.parse(args.spec)
        print(f"\n{args.spec!r} -> {p!s}: {p!r}")
    return 0


def add_cli(subparsers) -> None:
    """Register the ``policies`` subcommand (a reference card of policies and tags)."""
    p = subparsers.add_parser("policies", help="list the policies, MaxText presets and checkpoint tags")
    p.add_argument("spec", nargs="?", help="a policy spec to parse and show")
    p.set_defaults(func=_policies_command)


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
