"""``remat-kit bench``: the command line of :mod:`remat_kit.bench.run` (real training steps per policy)."""

from __future__ import annotations

import argparse
import dataclasses

from remat_kit import constants
from remat_kit.cli.common import (
    add_json_arg,
    add_model_args,
    add_parser,
    check_plot,
    check_writable,
    command_line,
    config_from_args,
    factory_errors,
    made,
    say,
    typed,
    write_json,
)

DESCRIPTION = (
    "Run real AdamW training steps under each policy and measure them side by side: the compile-only figures "
    "of `plan`, the measured peak memory (device memory_stats, or on CPU a fresh process's peak RSS), the "
    "min/median/max step time and its ratio to `none`, and the loss and gradient differences against `none`. "
    "Each policy runs in its own process unless --in-process."
)


def _progress(args: argparse.Namespace):
    return (lambda line: None) if args.no_progress else say


def _bench_command(args: argparse.Namespace) -> int:
    if args.model:
        with factory_errors():
            return _bench_model_command(args)
    from remat_kit.bench.run import DEFAULT_POLICIES, run_bench
    from remat_kit.cli.plan_report import parse_policies
    from remat_kit.step import mesh as mesh_lib
    from remat_kit.train.config import check_setting

    check_plot(args.plot)
    config, batch, seq = config_from_args(args)
    text = ",".join(DEFAULT_POLICIES) if args.policies is None else args.policies
    specs = [str(p) for p in parse_policies(text, config.num_layers)]
    if args.mesh:
        mesh_lib.check_batch(batch, mesh_lib.make_mesh(args.mesh))
    for path, what in ((args.json, "--json"), (args.markdown, "--markdown")):
        check_writable(path, what)
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    check_setting("seed", args.seed, "--seed")
    command = command_line("bench", args)
    _progress(args)(f"{command}\n")
    records = run_bench(
        config,
        batch,
        seq,
        specs,
        steps=args.steps,
        warmup=args.warmup,
        loss_chunks=args.loss_chunks,
        seed=args.seed,
        subprocesses=not args.in_process,
        grad_check=not args.no_grad_check,
        progress=_progress(args),
        mesh=args.mesh,
    )
    setting = (
        f"preset {args.preset} (L={config.num_layers}, d={config.d_model}, V={config.vocab_size}, "
        f"{config.dtype}, attention={config.attention}), batch {batch} × seq {seq}, AdamW, "
        f"{args.steps} timed steps after {args.warmup} warm-up, loss_chunks={args.loss_chunks}"
    )
    import jax

    device = jax.devices()[0]
    setting += f", device {device.platform}:{device.device_kind}"
    if args.mesh:
        setting += f", mesh {args.mesh} (XLA temp per device)"
    return _report(args, command, setting, records, f"{args.preset}, batch {batch} × seq {seq} ({device.platform})")


def _report(args: argparse.Namespace, command: str, setting: str, records: list, title: str) -> int:
    """Print the table and write the ``--json``/``--markdown``/``--plot`` files both bench forms offer."""
    from remat_kit.analysis import explain
    from remat_kit.bench.report import (
        format_markdown,
        format_table,
        grad_note,
        noise_warnings,
        pareto_front,
        peak_notes,
        plot,
        recommend,
    )

    print(setting)
    print("\n".join(format_table(records)))
    for policy, line in peak_notes(records).items():
        print(f"† {policy}: {line}")
    print(f"Pareto front (time vs measured memory, over the min–max spread): {', '.join(pareto_front(records))}")
    for line in noise_warnings(records):
        print(f"warning: {line}")
    for line in explain.warning_lines([(r.policy, r.warnings) for r in records]):
        print(line)
    note = grad_note(records)
    if note:
        print(f"note: {note}")
    print(recommend(records))
    if args.json:
        write_json(
            args.json,
            {"command": command, "setting": setting, "records": [dataclasses.asdict(r) for r in records]},
        )
        if args.json != "-":
            print(f"wrote {args.json}")
    if args.markdown:
        with open(made(args.markdown), "w") as f:
            f.write(format_markdown(records, f"# remat-kit bench\n\n`{command}`\n\n{setting}"))
        print(f"wrote {args.markdown}")
    if args.plot:
        plot(records, made(args.plot), title)
        print(f"wrote {args.plot}")
    return 0


def _bench_model_command(args: argparse.Namespace) -> int:
    """``bench --model MODULE:FACTORY``: the same table and JSON for the factory's model."""
    from remat_kit.bench.run import run_bench
    from remat_kit.cli.plan import PRESET_ONLY
    from remat_kit.cli.plan_report import parse_model_policies
    from remat_kit.planning.user_model import load_factory, model_from_factory
    from remat_kit.train.config import check_setting

    given = typed(args, *PRESET_ONLY)
    if given:
        verb = "shapes" if len(given) == 1 else "shape"
        raise ValueError(f"{', '.join(given)} {verb} the built-in model; with --model the factory gives the shapes")
    check_plot(args.plot)
    specs = [str(p) for p in parse_model_policies(args.policies)]
    for path, what in ((args.json, "--json"), (args.markdown, "--markdown")):
        check_writable(path, what)
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    check_setting("seed", args.seed, "--seed")
    model_from_factory(load_factory(args.model), args.model)  # a bad factory fails here, before any compile
    command = command_line("bench", args)
    _progress(args)(f"{command}\n")
    records = run_bench(
        None,
        0,
        0,
        specs,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        subprocesses=not args.in_process,
        grad_check=not args.no_grad_check,
        progress=_progress(args),
        model=args.model,
    )
    import jax

    device = jax.devices()[0]
    setting = (
        f"model {args.model}, clipped AdamW step, {args.steps} timed steps after {args.warmup} warm-up, "
        f"device {device.platform}:{device.device_kind}"
    )
    return _report(args, command, setting, records, f"{args.model} ({device.platform})")


def add_cli(subparsers) -> None:
    """Register ``remat-kit bench``."""
    p = add_parser(
        subparsers,
        "bench",
        help="run real training steps under each policy: memory, time, exactness",
        description=DESCRIPTION,
    )
    add_model_args(p, default_preset="small")
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated policy specs (default: {','.join(constants.BENCH_POLICIES)}; with --model: "
        f"{','.join(constants.GENERIC_CANDIDATES)})",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per policy (min/median/max reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--seed", type=int, default=0, help="parameters and tokens seed")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="measure all policies in this process: faster, but their RSS peaks share one process",
    )
    p.add_argument(
        "--no-grad-check", action="store_true", help="skip the gradient comparison with none (saves a compile)"
    )
    p.add_argument("--mesh", default=None, help="run sharded over a device mesh, e.g. data=4 or data=2,fsdp=2")
    add_json_arg(p, "one record per policy")
    p.add_argument("--markdown", default=None, metavar="PATH", help="write a Markdown report")
    p.add_argument(
        "--plot", default=None, metavar="PATH", help="write a PNG of memory against step time (PATH ends in .png)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_bench_command)
