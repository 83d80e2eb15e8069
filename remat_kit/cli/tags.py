"""``remat-kit tags --model MODULE:FACTORY``: the names a model's blocks emit, so a policy can name them.

The factory is the one ``plan``/``bench`` take (:mod:`remat_kit.planning.user_model`):
``factory(policy) -> (loss_fn, example_args)``. ``tags`` calls it with ``full``, traces the loss
(nothing is compiled) and lists every name it emits with its shape, dtype and bytes: for an unedited
model built with ``remat_kit.apply_factory``, each submodule output by its path in the block
(``attn/q_einsum``) and each matmul with a block parameter by the parameter (``mlp/gating_einsum``),
beside the model's own ``checkpoint_name`` tags.
"""

from __future__ import annotations

import argparse
import json

from remat_kit.cli.common import add_parser, factory_errors


def _tags_command(args: argparse.Namespace) -> int:
    from remat_kit.planning.user_model import load_factory, names_from_factory

    with factory_errors():
        table = names_from_factory(load_factory(args.model), args.model)
    if args.json:
        rows = [{"name": r.name, "shape": list(r.shape), "dtype": r.dtype, "bytes": r.nbytes} for r in table]
        print(json.dumps({"model": args.model, "names": rows}, indent=1))
        return 0
    print(table)
    print("\nname them in a policy, e.g. selective:" + ",".join(table.names[:2]) + " (globs allowed: attn/*)")
    return 0


def add_cli(subparsers) -> None:
    """Register ``remat-kit tags``."""
    p = add_parser(
        subparsers,
        "tags",
        help="list the names a model's blocks emit (path, shape, dtype, bytes), to choose what a policy keeps",
        description=(
            "List the names a model's blocks emit, with shape, dtype and bytes (traced only, nothing compiled). "
            "MODULE:FACTORY is the factory plan and bench take: factory(policy) -> (loss_fn, example_args); "
            "tags calls it with policy full. For an unedited Flax model, return "
            "(remat_kit.apply_factory(model, loss)(policy), example_args)."
        ),
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="the model: an importable MODULE (the working directory is on the path) and its FACTORY",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_tags_command)
