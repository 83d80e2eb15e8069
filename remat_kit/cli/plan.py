"""``remat-kit plan``: the command line of compile-only policy comparison and ``--budget``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from remat_kit import constants
from remat_kit.cli.common import (
    add_json_arg,
    add_model_args,
    add_parser,
    check_jobs,
    check_plot,
    check_writable,
    command_line,
    config_from_args,
    factory_errors,
    made,
    say,
    seq_tiles_arg,
    typed,
    write_json,
)
from remat_kit.units import fmt_bytes, fmt_count

#: Options that shape the built-in model, meaningless with ``--model`` (whose factory gives the shapes).
PRESET_ONLY: tuple[str, ...] = (
    "preset",
    "batch_size",
    "seq_len",
    "layers",
    "dtype",
    "param_dtype",
    "attention",
    "loss_chunks",
    "seq_tiles",
    "mesh",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "quantize",
)

DESCRIPTION = (
    "Compare rematerialization policies without running anything: for each policy, trace and compile one "
    "training step and report what its backward pass keeps (saved residuals), XLA's compiled memory and the "
    "matmul FLOPs. With --budget, choose the policy with the least recompute that fits that much device memory, "
    "and find the largest batch and sequence that fit. Shapes default to the preset's (tiny 2 x 32, small "
    "4 x 256, 2b 2 x 1024); pass --batch-size/--seq-len to plan the shape you will train."
)


def _model_command(args: argparse.Namespace) -> int:
    """``plan --model``: compare the policies on the factory's model, or (``--budget``) choose one."""
    from remat_kit.analysis import inspection
    from remat_kit.cli.plan_report import format_explain, parse_model_policies
    from remat_kit.planning import budget, planner
    from remat_kit.planning import fit as fit_lib
    from remat_kit.planning.user_model import load_factory, model_from_factory

    for flag in ("limits", "plot"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} is not available with --model (its shapes are fixed by the factory)")
    if typed(args, "top"):
        raise ValueError(
            "--top lists the built-in model's largest residuals; with --model, --explain shows what is live"
        )
    if typed(args, "jobs") and args.budget is None:
        raise ValueError("--jobs compiles --budget's candidates at once; with --model alone they compile one at a time")
    if args.margin is not None and args.budget is None:
        raise ValueError("--margin goes with --budget")
    if args.per_tensor or args.maxtext:
        raise ValueError(
            "--per-tensor chooses per tag of the built-in Transformer's block; with --model give --budget alone "
            "(or selective specs of your model's tags in --policies)"
        )
    if args.calibrate and args.budget is None:
        raise ValueError("--calibrate goes with --budget")
    if args.calibrate and args.target not in (None, "local"):
        raise ValueError(f"--calibrate times this machine; it does not go with --target {args.target}")
    check_writable(args.json, "--json")
    check_plot(args.timeline, "--timeline")
    specs = parse_model_policies(args.policies)
    budget_bytes = budget.parse_bytes(args.budget) if args.budget is not None else None
    margin = planner.DEFAULT_MARGIN if args.margin is None else args.margin
    if budget_bytes is not None:
        planner.Budget(budget_bytes, margin)  # checked before anything is loaded or compiled
    make_loss, example = model_from_factory(load_factory(args.model), args.model)
    if not args.no_progress:
        say(f"[plan] {args.model}: {len(specs)} policies ...")
    hardware = None
    if args.calibrate:
        from remat_kit.planning import cost

        hardware = cost.calibrate()
    if budget_bytes is None:
        explain = args.explain or args.timeline is not None
        comparison = inspection.compare(make_loss, specs, *example, explain=explain, target=args.target)
        print(f"remat-kit plan --model {args.model}: value_and_grad of the loss (first argument)")
        print(
            "saved = values the backward pass keeps; peak = arguments + outputs − aliased + temp; GFLOPs = matmul "
            "FLOPs of the gradient with scans × trip count; ×none = over `none`.\n"
        )
        print(comparison.table())
        if args.explain:
            print()
            print("\n".join(format_explain(dict(zip(comparison.policies, comparison.reports, strict=True)))))
        if args.timeline:
            comparison.plot_timeline(args.timeline, f"{args.model}: live device memory per policy")
            print(f"\nwrote {args.timeline}")
        payload = {"command": command_line("plan", args), "model": args.model, **comparison.to_dict()}
    else:
        result = fit_lib.auto(
            make_loss,
            *example,
            budget_bytes=budget_bytes,
            margin=margin,
            candidates=specs,
            exhaustive=True,
            jobs=args.jobs,
            hardware=hardware,
            target=args.target,
        )
        print(
            f"remat-kit plan --model {args.model} --budget {fmt_bytes(budget_bytes)}: clipped AdamW step, "
            f"margin {margin:.0%}"
        )
        print(budget.BUDGET_LEGEND)
        print("\n".join(result.table()))
        print(f"\nchosen: {result.chosen}" if result.chosen is not None else "")
        print(result.reason)  # when nothing fits, it says so (once)
        payload = {"command": command_line("plan", args), "model": args.model, **result.to_dict()}
    if args.json:
        write_json(args.json, payload)
        if args.json != "-":
            print(f"\nwrote {args.json}")
    if budget_bytes is not None and payload["chosen"] is None:
        return 1
    return 0


def start_for_target(name: str | None) -> None:
    """Before JAX starts: a GPU target is compiled for on this machine's CPU (``JAX_PLATFORMS=cpu`` unless set),
    so the CUDA plugin serves its deviceless compiler instead of failing to find a GPU. An unknown target, or a GPU
    target without the plugin, is a ValueError (one line: what to install) before anything is traced."""
    from remat_kit import target

    if name is not None and target.parse(name).compile_only:
        if not target.cuda_plugin_installed():
            raise ValueError(f"--target {name} compiles for a GPU with JAX's CUDA plugin: {target.INSTALL_HINT}")
        import jax  # loaded already (by the signal handling), its backends not yet started

        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")


def target_line(target, config) -> str:
    """What the step was compiled for (a :class:`remat_kit.target.Target`) and the attention kernel its trace took."""
    from remat_kit.model import attention

    platform = "gpu" if target.compile_only else target.devices()[0].platform
    kernel = attention.resolve(config.attention, config.dtype, config.head_dim, platform=platform)
    return f"target: {target.label}; attention: {kernel}"


def _plan_command(args: argparse.Namespace) -> int:
    start_for_target(args.target)
    from remat_kit.cli.plan_report import (
        DEFAULT_POLICIES,
        against_theory,
        format_explain,
        format_table,
        format_warnings,
        parse_policies,
        plan_record,
    )
    from remat_kit.planning.analysis import analyze_policies
    from remat_kit.step import mesh as mesh_lib

    check_jobs(args.jobs)
    if args.seq_step is not None and args.max_seq is None:
        raise ValueError("--seq-step goes with --max-seq")
    # --max-seq --model runs remat_kit.max_seq, whose levers these two set on the user's model too.
    levers = ("loss_chunks", "seq_tiles") if args.max_seq is not None else ()
    if args.model and (given := typed(args, *(f for f in PRESET_ONLY if f not in levers))):
        verb = "shapes" if len(given) == 1 else "shape"
        raise ValueError(f"{', '.join(given)} {verb} the built-in model; with --model the factory gives the shapes")
    if args.max_seq is not None:
        from remat_kit.cli import plan_max_seq

        args.seq_step = plan_max_seq.DEFAULT_STEP if args.seq_step is None else args.seq_step
        if args.model:
            with factory_errors():
                return plan_max_seq.run_model(args)
        if args.query_blocks is not None:
            raise ValueError("--query-blocks goes with --max-seq --model (the built-in model's attention is chunked)")
        return plan_max_seq.run_preset(args)
    if args.query_blocks is not None:
        raise ValueError("--query-blocks goes with --max-seq --model")
    check_plot(args.plot)
    if args.budget is not None and (args.explain or args.timeline is not None):
        raise ValueError("--explain and --timeline compare policies at their peaks; they do not go with --budget")
    if args.model:
        with factory_errors():
            return _model_command(args)
    config, batch, seq = config_from_args(args)
    from remat_kit import target

    compile_only = target.parse(args.target).elsewhere  # its planner makes the mesh of the target's devices
    mesh = mesh_lib.make_mesh(args.mesh) if args.mesh and not compile_only else None
    if mesh is not None:
        mesh_lib.check_batch(batch, mesh)
    if args.budget is not None:
        return _budget_command(args, config, batch, seq, args.mesh if compile_only else mesh)
    for flag in ("margin", "limits", "plot"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} goes with --budget")
    for flag in ("calibrate", "per_tensor", "maxtext"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} goes with --budget")
    check_plot(args.timeline, "--timeline")
    explain = args.explain or args.timeline is not None
    specs = parse_policies(",".join(DEFAULT_POLICIES) if args.policies is None else args.policies, config.num_layers)
    if args.top < 0:
        raise ValueError(f"--top must be >= 0, got {args.top}")
    check_writable(args.json, "--json")

    def progress(i, n, spec):
        if not args.no_progress:
            say(f"[{i + 1}/{n}] {spec}: tracing and compiling ...")

    results = analyze_policies(
        config,
        batch,
        seq,
        specs,
        loss_chunks=args.loss_chunks,
        jobs=args.jobs,
        progress=progress,
        mesh=args.mesh if compile_only else mesh,
        explain=explain,
        target=args.target,
    )
    a0 = next(iter(results.values()))
    print(
        f"remat-kit plan: preset {args.preset} ({fmt_count(config.num_params())} params, L={config.num_layers}, "
        f"d={config.d_model}, V={config.vocab_size}, {config.dtype} compute / {config.param_dtype} params), "
        f"batch {batch} × seq {seq}{_shape_note(args)}, AdamW step, loss_chunks={args.loss_chunks}"
        + (f", mesh {a0.mesh}: XLA figures per device" if a0.mesh else "")
    )
    print(target_line(target.parse(args.target), config))
    print(
        "saved = activations the backward pass keeps (device; host = offloaded); XLA temp = compiled scratch "
        "(activations + gradients + workspace); peak = arguments + outputs − aliased + temp, the step's device "
        "bytes (what must fit); GFLOPs = matmul FLOPs counted from the jaxpr with scans × trip count; "
        "XLA raw = cost_analysis(), which counts a scan body once.\n"
    )
    print("\n".join(format_table(results)))
    print(
        f"\nanalytic FLOPs: none = 6·params·tokens + attention = {a0.analytic.none / 1e9:.1f} G; "
        f"+ one forward of the layers = {a0.analytic.full / 1e9:.1f} G"
    )
    print("\nagainst the theory (full remat keeps L·b·s·h; the loss b·s·V·4; none Korthikanti's 34·b·s·h·L):")
    for line in against_theory(results):
        print("  " + line)
    if args.top:
        print(f"\nlargest residuals per policy (top {args.top}):")
        for name, a in results.items():
            print(f"  {name}:")
            for r in a.largest(args.top):
                where = "host" if r.host else r.region
                print(f"    {fmt_bytes(r.nbytes):>10}  {where:6} {r.dtype:9} {r.shape!s:28} {r.label}")
    if args.explain:
        print()
        print("\n".join(format_explain(results)))
    warnings = format_warnings(results)
    if warnings:
        print()
        print("\n".join(warnings))
    if args.timeline:
        from remat_kit.analysis import explain as explain_lib

        title = f"preset {args.preset}, batch {batch} × seq {seq}: live device memory per policy"
        explain_lib.plot_timelines({n: a.timeline for n, a in results.items()}, args.timeline, title)
        print(f"\nwrote {args.timeline}")
    if args.json:
        payload = {
            "command": command_line("plan", args),
            "preset": args.preset,
            "config": dataclasses.asdict(config),
            "batch": batch,
            "seq": seq,
            "loss_chunks": args.loss_chunks,
            "estimates": dataclasses.asdict(a0.estimates),
            "seed_check": against_theory(results),
            "records": [plan_record(a, args.top) for a in results.values()],
        }
        write_json(args.json, payload)
        if args.json != "-":
            print(f"\nwrote {args.json}")
    return 0


def _shape_note(args: argparse.Namespace) -> str:
    """Says where the shape came from when the user did not give it (train's default shape differs)."""
    if args.batch_size is not None and args.seq_len is not None:
        return ""
    return f" (preset {args.preset}'s default shape; --batch-size/--seq-len to plan yours)"


def add_cli(subparsers) -> None:
    """Register ``remat-kit plan``."""
    p = add_parser(
        subparsers,
        "plan",
        help="compare every policy's saved residuals, compiled memory and FLOPs (compile-only)",
        description=DESCRIPTION,
    )
    add_model_args(p, default_preset="2b")
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated policy specs (default: {','.join(constants.PLAN_POLICIES)}; with --budget: every "
        "candidate)",
    )
    p.add_argument("--top", type=int, default=3, help="largest residuals listed per policy")
    p.add_argument(
        "--explain",
        action="store_true",
        help="what is live at each policy's compiled peak (groups summing to it, the ten largest buffers)",
    )
    p.add_argument(
        "--timeline",
        default=None,
        metavar="PNG",
        help="plot live device memory over the step, one line per policy (implies reading XLA's dump)",
    )
    p.add_argument("--mesh", default=None, help="plan per device over a mesh, e.g. data=4 or data=2,fsdp=2")
    p.add_argument(
        "--target",
        default=None,
        metavar="TARGET",
        help=f"the device planned for: {', '.join(constants.TARGET_NAMES)} (default local: the backend here) or the "
        "path of an XLA GpuTargetConfigProto text file; a GPU target compiles XLA:GPU's own step without a GPU "
        "(needs pip install 'remat-kit[gpu-target]')",
    )
    p.add_argument(
        "--host-ram",
        default=None,
        metavar="SIZE",
        help="with --max-seq: the planned machine's host memory, which offloaded bytes are stated against "
        "(default: this machine's)",
    )
    p.add_argument("--budget", default=None, help="device memory budget (any unit: 80GB, 24GiB): choose a policy")
    p.add_argument(
        "--max-seq",
        nargs="?",
        type=int,
        const=131_072,
        default=None,
        metavar="LIMIT",
        help="with --budget (one size or several, 16GB,24GB,80GB): per policy, the longest sequence whose compiled "
        "step fits, found at its edge (that length fits, the next --seq-step does not), with the cost of one more "
        "position beside the floor the policy keeps; lengths up to LIMIT (default 131,072). With --model "
        "MODULE:FACTORY, FACTORY() returns (model, loss_fn, args_at), remat_kit.max_seq's arguments, and every "
        "lever is on (--policies, --query-blocks, --seq-tiles, --loss-chunks set one or opt out)",
    )
    p.add_argument(
        "--seq-step", type=int, default=None, help="with --max-seq: lengths tried in multiples of this (default 256)"
    )
    p.add_argument(
        "--query-blocks",
        type=seq_tiles_arg,
        default=None,
        metavar="K|auto",
        help="with --max-seq --model: attention in K blocks of queries (remat_kit.apply's query_blocks; default auto, "
        "1: whole)",
    )
    p.add_argument(
        "--margin", type=float, default=None, help=f"with --budget: safety margin (default {constants.DEFAULT_MARGIN})"
    )
    p.add_argument(
        "--limits",
        choices=("pareto", "all", "chosen", "none"),
        default=None,
        help="with --budget: find the largest batch and longest sequence that fit for the chosen policy "
        "(default: chosen), the Pareto-optimal policies (pareto; a dominated one is never the best choice), "
        "every policy, or none",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="with --budget: Pareto plot of memory vs recompute (PNG ends in .png)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="with --budget: price recompute with this machine's measured FLOP/s and bandwidth (a timed "
        "matmul and copy, a few hundred ms) instead of the backend's defaults",
    )
    p.add_argument(
        "--per-tensor",
        action="store_true",
        help="with --budget: also choose save/recompute/offload per tag of the block and per layer range "
        "(remat_kit.planning.tensors), compiled to check",
    )
    p.add_argument(
        "--maxtext",
        action="store_true",
        help="with --per-tensor: decide only the tensors MaxText's custom remat can name, and print the answer as "
        "MaxText settings (per part for a mix)",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="policies compiled at once (>= 1)")
    add_json_arg(p, "the figures")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_plan_command)


def limit_policies(candidates, limits: str, chosen) -> list[str]:
    """The specs whose largest batch and sequence ``--limits`` asks for: every candidate (``all``), the chosen
    one (``chosen``), none, or (``pareto``) those no other beats on both the estimated cost (what ranks them) and
    the compiled need: a dominated policy is never the best answer at any budget."""
    if limits == "all":
        return [c.policy for c in candidates]
    if limits == "pareto":
        from remat_kit.planning import pareto

        # By estimated cost, not FLOPs: none and selective both recompute 0 matmul FLOPs, so by FLOPs selective
        # (less memory) would drop none.
        compiled = [c for c in candidates if c.need_bytes is not None]
        return [compiled[i].policy for i in pareto.pareto_front([(c.cost_s, c.need_bytes) for c in compiled])]
    if limits == "chosen" and chosen is not None:
        return [str(chosen)]
    return []


def _budget_command(args: argparse.Namespace, config, batch: int, seq: int, mesh) -> int:
    """``plan --budget``: every candidate's need against the budget, the choice, and the limits that fit."""
    from remat_kit import policies
    from remat_kit.cli import plan_max_seq
    from remat_kit.cli.plan_report import compile_progress, format_per_tensor, maxtext_settings, parse_policies
    from remat_kit.model import lora
    from remat_kit.planning import budget, builtin, cost, tensors
    from remat_kit.planning import fit as fit_lib
    from remat_kit.planning.builtin import Planner
    from remat_kit.planning.planner import DEFAULT_MARGIN, Budget

    budget_bytes = budget.parse_bytes(args.budget)
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    Budget(budget_bytes, margin)  # checked before anything is compiled
    if args.maxtext and not args.per_tensor:
        raise ValueError("--maxtext goes with --per-tensor")
    if typed(args, "top"):
        raise ValueError("--top lists the largest residuals of a comparison; it does not go with --budget")
    # Only the chosen policy's limits by default: each policy's search costs a few compiles, and the
    # chosen one answers "how far can I push this run"; the others are one flag away.
    limits = args.limits or "chosen"
    check_writable(args.json, "--json")
    check_plot(args.plot)
    planner = Planner(
        config,
        loss_chunks=args.loss_chunks,
        mesh=mesh,
        progress=None if args.no_progress else compile_progress,
        target=args.target,
    )
    if args.calibrate and planner.target.compile_only:
        raise ValueError(f"--calibrate times this machine; it does not go with --target {args.target}")
    if args.policies is None:  # a GPU target moves offloaded bytes to the host: its offload candidates count
        pool = list(builtin.candidates_for(config, offload=True if planner.target.compile_only else None))
    else:
        pool = parse_policies(args.policies, config.num_layers)
    floor = planner.state_bytes()
    if not Budget(budget_bytes, margin).fits(floor):  # no policy can fit: say so before compiling any
        per = " per device" if mesh is not None else ""
        print(
            f"remat-kit plan: nothing fits --budget {args.budget}: the parameters and optimizer state alone take "
            f"{fmt_bytes(floor)}{per} ({fmt_bytes(floor * (1 + margin))} with the {margin:.0%} margin), before any "
            "activation; raise --budget, train LoRA adapters over a 4- or 8-bit base (--lora-rank R --quantize "
            "nf4 or int8) or shard over a mesh "
            "(--mesh fsdp=N)",
            file=sys.stderr,
        )
        return 1
    if not args.no_progress:
        say(f"[plan] compiling {len(pool)} candidates, {args.jobs} at a time ...")
    hardware = cost.calibrate(mesh.devices.flat[0].platform if mesh is not None else None) if args.calibrate else None
    # One call: the presets compiled side by side (the table) and, without --policies, the plan that fits chosen by
    # the engine of remat_kit.fit (per tensor, mixes, sequence tiles when nothing fits untiled); with --policies, the
    # best of that pool.
    result = fit_lib.auto(
        config,
        batch=batch,
        seq=seq,
        budget_bytes=budget_bytes,
        margin=margin,
        candidates=None if args.policies is None else pool,
        exhaustive=True,
        planner=planner,
        jobs=args.jobs,
        hardware=hardware,
    )
    per = None
    if args.per_tensor:
        if not args.no_progress:
            say("[plan] per-tensor search ...")
        per = tensors.per_tensor(
            config,
            batch=batch,
            seq=seq,
            budget_bytes=budget_bytes,
            margin=margin,
            loss_chunks=args.loss_chunks,
            planner=planner,
            hardware=result.hardware,
            pool=pool,
            maxtext=args.maxtext,
        )
    # The largest batch is the planned step's (untiled: max_fit grows the shape, and a tile count must divide every
    # length tried); the longest sequence is plan --max-seq's own computation (the levers by default), so the two
    # commands print the same length for the same preset and budget.
    untiled = [c for c in result.candidates if c.seq_tiles == 1]
    wanted = limit_policies(untiled, limits, result.chosen if result.seq_tiles == 1 else None)
    fit = {}
    if wanted and mesh is None:
        # The batch searches' first compiles are known in advance (the line's two points): compile them together,
        # args.jobs at a time; each search then needs about two more.
        planner.expect(2 * len(wanted))
        first = max(batch, 2)
        shapes = [(policies.parse(s), b, seq) for s in wanted for b in (first, 2 * first)]
        if not args.no_progress:
            say(f"[plan] largest batch and sequence that fit for {len(wanted)} policies ...")
        planner.precompile(shapes, jobs=args.jobs)
        seq_config, chunks = plan_max_seq.lever_config(args, config, plan_max_seq.DEFAULT_LIMIT)
        seq_planner = Planner(seq_config, loss_chunks=chunks, progress=planner.progress, target=args.target)
        step, limit = plan_max_seq.DEFAULT_STEP, plan_max_seq.DEFAULT_LIMIT
        edge = {"batch": batch, "ref_seq": seq, "budget_bytes": budget_bytes, "margin": margin, "step": step}
        edge.update(limit=limit, first=plan_max_seq.first_unit(chunks, batch, step))
    for spec in wanted if mesh is None else ():
        kw = {"batch": batch, "seq": seq, "budget_bytes": budget_bytes, "margin": margin, "planner": planner}
        longest = plan_max_seq.longest(seq_planner, policies.parse(spec), **edge).seq
        fit[spec] = (builtin.max_fit(config, spec, dim="batch", **kw), longest)

    where = f", mesh {args.mesh} (bytes per device)" if mesh is not None else ""
    print(
        f"remat-kit plan --budget {fmt_bytes(budget_bytes)}: preset {args.preset} ({fmt_count(config.num_params())} "
        f"params), batch {batch} × seq {seq}{_shape_note(args)}, clipped AdamW step, loss_chunks={args.loss_chunks}, "
        f"margin {margin:.0%}{where}"
    )
    print(target_line(planner.target, config))
    if config.lora_rank:  # what the frozen base takes as stored (a quantized base: its embedding too)
        pb = lora.param_bytes(config)
        print(
            f"LoRA: frozen base {fmt_bytes(pb.frozen)} (quantize={config.quantize}, "
            f"{pb.frozen / config.num_params():.3f} byte per base parameter), adapters {fmt_bytes(pb.trainable)}"
        )
    print(budget.BUDGET_LEGEND)
    # A sequence at --max-seq's limit is where the search stopped, not what memory allows.
    cap = plan_max_seq.DEFAULT_LIMIT
    shown = {k: (b, f"{s:,} (limit)" if s == cap else f"{s:,}") for k, (b, s) in fit.items()}
    print("\n".join(result.table(shown)))
    if fit:
        note = (
            f"max seq: plan --max-seq's longest sequence (multiples of {plan_max_seq.DEFAULT_STEP}, the chunked loss "
            "and sequence tiles by default; --loss-chunks 0 --seq-tiles 1 opt out)"
        )
        if any(s == cap for _, s in fit.values()):
            note += f"; (limit): --max-seq's limit ({cap:,}), memory would allow more"
        print(note)
    tiles = f" in {result.seq_tiles} sequence tiles (--seq-tiles {result.seq_tiles})" if result.seq_tiles > 1 else ""
    print(f"\nchosen: {result.chosen}{tiles}" if result.chosen is not None else "")
    print(result.reason)  # when nothing fits, it says so (once)
    if per is not None:
        for line in format_per_tensor(per):
            print(line)
    if args.plot:
        result.plot(made(args.plot))
        print(f"wrote {args.plot}")
    if args.json:
        payload = {
            "command": command_line("plan", args),
            "preset": args.preset,
            "config": dataclasses.asdict(config),
            "mesh": args.mesh,
            **result.to_dict(),
        }
        for row in payload["candidates"]:
            row["max_batch"], row["max_seq"] = fit.get(row["policy"], (None, None))
        if per is not None:
            payload["per_tensor"] = {
                "chosen": None if per.chosen is None else str(per.chosen),
                "cost_s": per.cost_s,
                "need_bytes": per.need_bytes,
                "source": per.source,
                "maxtext": maxtext_settings(per.chosen) if per.chosen is not None else None,
                "groups": [list(g) for g in per.groups],
                "compiled": [list(c) for c in per.compiled],
            }
        write_json(args.json, payload)
        if args.json != "-":
            print(f"wrote {args.json}")
    if result.chosen is None:
        return 1
    return 0
