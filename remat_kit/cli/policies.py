"""``remat-kit policies``: a reference card of the policies, MaxText presets and checkpoint tags."""

from __future__ import annotations

import argparse


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

