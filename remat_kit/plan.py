"""``remat-kit plan``: every policy's saved residuals, compiled memory and FLOPs, compile-only.

``remat-kit plan --preset 2b --batch 2 --seq 1024`` compares the policies on the seed's 2B-class
model without allocating it, checks the seed's figures (full remat's checkpointed layer inputs,
the float32 logits, Korthikanti's "everything kept") against the exact ones, and lists the largest
residuals of each policy: what to target next.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from remat_kit import analysis, budget, inspection, lora, policies
from remat_kit import mesh as mesh_lib
from remat_kit.attention import ATTENTION_KINDS
from remat_kit.model import DTYPES, PRESET_SHAPES, PRESETS, TransformerConfig
from remat_kit.units import fmt_bytes, fmt_flops

#: The policies ``plan`` compares by default: one of each kind.
DEFAULT_POLICIES: tuple[str, ...] = (
    "none",
    "full",
    "every_n:2",
    "selective",
    "offload",
    "segments:4",
    "sqrt_n",
    "dots",
)


# ---- shared by plan and bench ----------------------------------------------------------------------


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


def parse_policies(text: str, num_layers: int | None) -> list[policies.Policy]:
    """Comma-separated specs (``;`` options stay inside a spec) → policies valid for the depth (None: unchecked).

    ``every_n:2,selective:q_proj;strict=false`` is two specs: a comma splits specs only where the
    next piece starts a new policy kind.
    """
    pieces: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        starts_policy = piece.partition(":")[0] in policies.KINDS or piece in policies.MAXTEXT_ALIASES
        takes_tags = pieces and pieces[-1].partition(":")[0] in ("selective", "offload") and ":" in pieces[-1]
        if takes_tags and not starts_policy:
            pieces[-1] += "," + piece  # a tag list: selective:q_proj,k_proj
        elif piece:
            pieces.append(piece)
    if not pieces:
        raise ValueError(f"--policies {text!r} names no policy; e.g. none,full,selective")
    out = []
    for spec in pieces:
        p = policies.parse(spec)
        if num_layers is not None:
            p.validate_depth(num_layers)
        out.append(p)
    return out


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
    lora.add_cli_args(parser)


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
    overrides.update(lora.overrides_from_args(args))
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


# ---- plan ------------------------------------------------------------------------------------------


def plan_record(a: analysis.Analysis, top: int) -> dict[str, Any]:
    """One policy's JSON record: the analysis, its largest residuals and the layer breakdown."""
    record = a.to_dict(top=top)
    record["largest"] = record.pop("residuals")
    record["layers_breakdown"] = analysis.breakdown(a)
    return record


def seed_check(results: dict[str, analysis.Analysis]) -> list[str]:
    """Lines setting the exact figures beside the seed's estimates, and why they differ."""
    any_a = next(iter(results.values()))
    cfg, b, s, e = any_a.config, any_a.batch, any_a.seq, any_a.estimates
    L, d, item = cfg.num_layers, cfg.d_model, _itemsize(cfg.dtype)
    lines = []
    if "full" in results:
        exact = results["full"].layers_saved_bytes
        formula = L * b * s * d * item
        lines.append(
            f"full remat keeps the layer inputs: {fmt_bytes(exact)} measured; L·b·s·d·{item} B = {fmt_bytes(formula)} "
            f"({'equal to the byte' if exact == formula else f'differs by {exact - formula:+,} B'}); "
            f"seed's 2·b·s·h·L = {fmt_bytes(e.layer_inputs)}"
        )
    logits = [r for r in any_a.residuals if r.region == "head" and r.shape == (b, s, cfg.vocab_size)]
    if logits:
        lines.append(
            f"the loss keeps [b, s, V] logits-sized tensors: {fmt_bytes(sum(r.nbytes for r in logits))} "
            f"({', '.join(f'{r.label} {r.dtype}' for r in logits)}); seed's b·s·V·4 = {fmt_bytes(e.logits)} "
            f"(--loss-chunks K removes them; their gradient needs as much again in temp)"
        )
    elif any_a.loss_chunks:
        lines.append(
            f"--loss-chunks {any_a.loss_chunks}: no [b, s, V] logits are kept (seed's b·s·V·4 = {fmt_bytes(e.logits)})"
        )
    if "none" in results:
        none = results["none"]
        parts = analysis.breakdown(none)
        scores = parts.get("attention scores", 0)
        weights = parts.get("weight copies", 0)
        rest = none.layers_saved_bytes - scores - weights
        lines.append(
            f"everything kept (none), layer stack: {fmt_bytes(none.layers_saved_bytes)} measured vs Korthikanti's "
            f"34·b·s·h·L = {fmt_bytes(e.korthikanti)}. Of the measured: "
            + "; ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items())
            + "."
        )
        if scores:
            attn = (
                f"attention={cfg.attention} materializes the [b, h, s, s] probabilities ({fmt_bytes(scores)} here; "
                f"Korthikanti counts them apart as 5·a·s²·b·L = {fmt_bytes(e.korthikanti_scores)} at 16 bits and "
                f"leaves them out of the 34)"
            )
        else:
            attn = (
                f"attention={cfg.attention} keeps no [s, s] tensor (flash-style), so Korthikanti's separate "
                f"5·a·s²·b·L = {fmt_bytes(e.korthikanti_scores)} does not arise (--attention xla shows it)"
            )
        kv_width = 2 * cfg.num_kv_heads * cfg.head_dim
        floor = L * b * s * ((6 * d + kv_width + 3 * cfg.d_ff) * item + 4 * cfg.num_heads)
        copies = f"{fmt_bytes(weights)} are weight copies (compute-dtype casts or slices), not activations; "
        lines.append(
            f"  why they differ: {attn}; {copies if weights else ''}the lean block keeps per token and layer its "
            f"input, both norm outputs, q, k, v, the context and the post-attention residual stream (6·h + "
            f"2·kv·hd), gate, up and act (3·d_ff = {3 * cfg.d_ff / d:.0f}·h) in {cfg.dtype}, and attention's "
            f"float32 logsumexp (4·a bytes): L·b·s·((6·h + 2·kv·hd + 3·d_ff)·{item} + 4·a) = {fmt_bytes(floor)} "
            f"({'equal to the byte' if rest == floor else f'the rest differs by {rest - floor:+,} B'}); no "
            f"float32 norm or softmax intermediates. Korthikanti's 34 counts instead a GELU MLP of 4h, full-width "
            f"k and v and dropout masks (dropout={cfg.dropout} here)."
        )
    return lines


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def format_table(results: dict[str, analysis.Analysis]) -> list[str]:
    """The per-policy comparison table (plain text): the columns every policy table prints
    (:data:`remat_kit.inspection.TABLE_COLUMNS`), with the layer stack's and the head's saved bytes and
    XLA's raw FLOPs, then the notes."""
    base = results.get("none")
    extra = (("layers", 10), ("head", 10), ("XLA raw", 9))
    header = inspection.table_header(extra)
    rows = [header, "-" * len(header)]
    for name, a in results.items():
        cells = (
            (fmt_bytes(a.layers_saved_bytes), 10),
            (fmt_bytes(a.saved_bytes - a.layers_saved_bytes), 10),
            (f"{a.xla_flops / 1e9:.1f}", 9),
        )
        rows.append(
            inspection.table_row(name, a.saved_bytes, a.saved_host_bytes, a.memory.temp, a.peak_bytes, a.flops,
                                 base.flops if base else None, a.compile_s, cells)
        )  # fmt: skip
    rows += [f"note: {n}" for n in dict.fromkeys(n for a in results.values() for n in a.notes)]
    return rows


def run_plan(
    config: TransformerConfig,
    batch: int,
    seq: int,
    specs: list[policies.Policy],
    *,
    loss_chunks: int = 0,
    jobs: int = 1,
    progress=None,
    mesh=None,
) -> dict[str, analysis.Analysis]:
    """Analyze every policy in ``specs``, ``jobs`` at a time; ``progress(i, n, spec)`` is called before each.

    XLA compiles mostly on one core, so two jobs nearly halve the wall time on two cores; results
    do not depend on ``jobs`` (only each policy's ``compile_s`` does).
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")

    def one(i: int, p: policies.Policy) -> analysis.Analysis:
        if progress:
            progress(i, len(specs), str(p))
        return analysis.analyze(config, p, batch, seq, loss_chunks=loss_chunks, mesh=mesh)

    if jobs == 1:
        return {str(p): one(i, p) for i, p in enumerate(specs)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, i, p) for i, p in enumerate(specs)]
        return {str(p): f.result() for p, f in zip(specs, futures, strict=True)}


# ---- --model MODULE:FACTORY: any model -------------------------------------------------------------------

#: Options that shape the built-in model, meaningless with ``--model`` (whose factory gives the shapes).
PRESET_ONLY: tuple[str, ...] = ("batch", "seq", "layers", "dtype", "param_dtype", "attention", "loss_chunks", "mesh")


def load_factory(text: str) -> Callable:
    """``"package.module:factory"`` → the factory, imported (the working directory is importable).

    Raises:
      ValueError: the text is not ``MODULE:FACTORY``, the module cannot be imported or lacks the name.
      TypeError: the name is not callable.
    """
    module_name, sep, attr = str(text).partition(":")
    if not sep or not module_name or not attr or not all(p.isidentifier() for p in [*module_name.split("."), attr]):
        raise ValueError(f"--model {text!r} must be MODULE:FACTORY, e.g. mypkg.models:make_loss")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {text!r}: cannot import {module_name!r}: {err}") from None
    if not hasattr(module, attr):
        raise ValueError(f"--model {text!r}: module {module_name!r} has no {attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise TypeError(f"--model {text!r}: {attr!r} is a {type(factory).__name__}, not a callable")
    return factory


def model_from_factory(factory: Callable, where: str = "the factory") -> tuple[Callable, tuple]:
    """``(make_loss, example_args)`` from ``factory(policy) -> (loss_fn, example_args)``, checked on ``none``."""
    out = factory(policies.none())
    if not isinstance(out, tuple) or len(out) != 2 or not callable(out[0]) or not isinstance(out[1], (tuple, list)):
        raise TypeError(f"{where}(policy) must return (loss_fn, example_args), got {type(out).__name__}")
    return (lambda p: factory(p)[0]), tuple(out[1])


def parse_model_policies(text: str | None) -> list[policies.Policy]:
    """``--policies`` for ``--model`` (default :data:`remat_kit.budget.GENERIC_CANDIDATES`); the depth is
    the model's own business, so it is not checked here."""
    return parse_policies(text or ",".join(budget.GENERIC_CANDIDATES), num_layers=None)


def _model_command(args: argparse.Namespace) -> int:
    """``plan --model``: compare the policies on the factory's model, or (``--budget``) choose one."""
    given = [f"--{k.replace('_', '-')}" for k in PRESET_ONLY if getattr(args, k, None) not in (None, 0)]
    if given:
        raise ValueError(f"{', '.join(given)} shape the built-in model; with --model the factory gives the shapes")
    for flag in ("limits", "plot"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} is not available with --model (its shapes are fixed by the factory)")
    if args.margin is not None and args.budget is None:
        raise ValueError("--margin goes with --budget")
    check_writable(args.json, "--json")
    specs = parse_model_policies(args.policies)
    budget_bytes = budget.parse_bytes(args.budget) if args.budget is not None else None
    margin = budget.DEFAULT_MARGIN if args.margin is None else args.margin
    if budget_bytes is not None:
        budget.check_budget(budget_bytes, margin)
    make_loss, example = model_from_factory(load_factory(args.model), args.model)
    print(f"[plan] {args.model}: {len(specs)} policies ...", file=sys.stderr, flush=True)
    if budget_bytes is None:
        comparison = inspection.compare(make_loss, specs, *example)
        print(f"remat-kit plan --model {args.model}: value_and_grad of the loss (first argument)")
        print(
            "saved = values the backward pass keeps; peak = arguments + outputs − aliased + temp; GFLOPs = matmul "
            "FLOPs of the gradient with scans × trip count; ×none = over `none`.\n"
        )
        print(comparison.table())
        payload = {"command": command_line("plan", args), "model": args.model, **comparison.to_dict()}
    else:
        result = budget.auto(make_loss, *example, budget_bytes=budget_bytes, margin=margin, candidates=specs,
                             exhaustive=True, jobs=args.jobs)  # fmt: skip
        print(f"remat-kit plan --model {args.model} --budget {fmt_bytes(budget_bytes)}: clipped AdamW step, "
              f"margin {margin:.0%}")  # fmt: skip
        print(BUDGET_LEGEND)
        print("\n".join(format_budget_table(result)))
        print(f"\nchosen: {result.chosen if result.chosen is not None else '(nothing fits)'}")
        print(result.reason)
        payload = {"command": command_line("plan", args), "model": args.model, **result.to_dict()}
    if args.json:
        write_json(args.json, payload)
        print(f"\nwrote {args.json}")
    if budget_bytes is not None and payload["chosen"] is None:
        return 1
    return 0


def _plan_command(args: argparse.Namespace) -> int:
    if args.model:
        return _model_command(args)
    config, batch, seq = config_from_args(args)
    mesh = mesh_lib.make_mesh(args.mesh) if args.mesh else None
    if mesh is not None:
        mesh_lib.check_batch(batch, mesh)
    if args.budget is not None:
        return _budget_command(args, config, batch, seq, mesh)
    for flag in ("margin", "limits", "plot"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} goes with --budget")
    specs = parse_policies(args.policies or ",".join(DEFAULT_POLICIES), config.num_layers)
    if args.top < 0:
        raise ValueError(f"--top must be >= 0, got {args.top}")
    check_writable(args.json, "--json")

    def progress(i, n, spec):
        print(f"[{i + 1}/{n}] {spec}: tracing and compiling ...", file=sys.stderr, flush=True)

    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    results = run_plan(
        config, batch, seq, specs, loss_chunks=args.loss_chunks, jobs=args.jobs, progress=progress, mesh=mesh
    )
    a0 = next(iter(results.values()))
    print(
        f"remat-kit plan: preset {args.preset} ({config.num_params() / 1e9:.2f} B params, L={config.num_layers}, "
        f"d={config.d_model}, V={config.vocab_size}, {config.dtype} compute / {config.param_dtype} params), "
        f"batch {batch} × seq {seq}, AdamW step, loss_chunks={args.loss_chunks}"
        + (f", mesh {a0.mesh}: XLA figures per device" if a0.mesh else "")
    )
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
    print("\nseed check:")
    for line in seed_check(results):
        print("  " + line)
    if args.top:
        print(f"\nlargest residuals per policy (top {args.top}):")
        for name, a in results.items():
            print(f"  {name}:")
            for r in a.largest(args.top):
                where = "host" if r.host else r.region
                print(f"    {fmt_bytes(r.nbytes):>10}  {where:6} {r.dtype:9} {r.shape!s:28} {r.label}")
    if args.json:
        payload = {
            "command": command_line("plan", args),
            "preset": args.preset,
            "config": dataclasses.asdict(config),
            "batch": batch,
            "seq": seq,
            "loss_chunks": args.loss_chunks,
            "estimates": dataclasses.asdict(a0.estimates),
            "seed_check": seed_check(results),
            "records": [plan_record(a, args.top) for a in results.values()],
        }
        write_json(args.json, payload)
        print(f"\nwrote {args.json}")
    return 0


def add_cli(subparsers) -> None:
    """Register ``remat-kit plan``."""
    p = subparsers.add_parser(
        "plan", help="compare every policy's saved residuals, compiled memory and FLOPs (compile-only)"
    )
    add_model_args(p, default_preset="2b")
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated policy specs (default: {','.join(DEFAULT_POLICIES)}; with --budget: every candidate)",
    )
    p.add_argument("--top", type=int, default=3, help="largest residuals listed per policy")
    p.add_argument("--mesh", default=None, help="plan per device over a mesh, e.g. data=4 or data=2,fsdp=2")
    p.add_argument("--budget", default=None, help="device memory budget (any unit: 80GB, 24GiB): choose a policy")
    p.add_argument("--margin", type=float, default=None, help="with --budget: safety margin (default 0.10)")
    p.add_argument(
        "--limits",
        choices=("pareto", "all", "chosen", "none"),
        default=None,
        help="with --budget: find the largest batch and longest sequence that fit for the chosen policy "
        "(default: chosen), the Pareto-optimal policies (pareto; a dominated one is never the best choice), "
        "every policy, or none",
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="with --budget: Pareto plot of memory vs recompute")
    p.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="policies compiled at once (default: 2)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.set_defaults(func=_plan_command)


# ---- plan --budget: the least-recompute policy that fits -----------------------------------------------


BUDGET_LEGEND = (
    "peak = the compiled step's device bytes at its peak, arguments + outputs − aliased + temp (weights, gradients, "
    "optimizer state, activations and the recompute working set): what must fit; recompute = matmul FLOPs beyond "
    "`none`.\n"
)


def format_budget_table(result: budget.AutoResult, fit: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """``plan --budget``'s table: each candidate's recompute, peak, peak with the margin, whether it fits
    and (``fit``) the largest batch and sequence that fit; the chosen one marked ``*``; then the notes."""
    fit = fit or {}
    margin = result.margin
    width = max(len(c.policy) for c in result.candidates) + 1
    head = f"{'policy':{width + 1}} {'recompute':>10} {'peak':>10} {'+margin':>10} {'host':>10} {'fits':>5}"
    if fit:
        head += f" {'max batch @seq ' + str(result.seq):>18} {'max seq @batch ' + str(result.batch):>18}"
    rows = [head, "-" * len(head)]
    for c in result.candidates:
        mark = "*" if result.chosen is not None and c.policy == str(result.chosen) else " "
        compiled = c.need_bytes is not None
        fits = "-" if c.fits is None else "yes" if c.fits else "no"
        row = (
            f"{mark}{c.policy:{width}} {fmt_flops(c.recompute_flops):>10} "
            f"{fmt_bytes(c.need_bytes) if compiled else '-':>10} "
            f"{fmt_bytes(c.need_bytes * (1 + margin)) if compiled else '-':>10} "
            f"{fmt_bytes(c.host_bytes) if compiled else '-':>10} {fits:>5}"
        )
        if fit:
            row += "".join(f" {fit[c.policy][k] if c.policy in fit else '-':>18}" for k in (0, 1))
        rows.append(row)
    if result.mixed_front:
        pairs = ", ".join(f"{a} → {b}" for a, b, *_ in result.mixed_front)
        rows.append(f"mixed front (mixes of neighbours, policies.mix): {pairs}; rows with '*COUNT' are mixes compiled.")
    note = inspection.offload_note()
    if note and any(policies.parse(c.policy).kind == "offload" for c in result.candidates):
        rows.append(f"note: {note}.")
    return rows


def compile_progress(done: int, total: int, what: str) -> None:
    """Progress on stderr: compiles done, out of those done and expected, and how many are left."""
    print(f"[plan] compiled {done}/{total} ({total - done} left): {what}", file=sys.stderr, flush=True)


def _budget_command(args: argparse.Namespace, config: TransformerConfig, batch: int, seq: int, mesh) -> int:
    """``plan --budget``: every candidate's need against the budget, the choice, and the limits that fit."""
    budget_bytes = budget.parse_bytes(args.budget)
    margin = budget.DEFAULT_MARGIN if args.margin is None else args.margin
    budget.check_budget(budget_bytes, margin)
    # Only the chosen policy's limits by default: each policy's search costs a few compiles, and the
    # chosen one answers "how far can I push this run"; the others are one flag away.
    limits = args.limits or "chosen"
    check_writable(args.json, "--json")
    check_writable(args.plot, "--plot")
    pool = parse_policies(args.policies, config.num_layers) if args.policies else list(budget.candidates(config))
    planner = budget.Planner(config, loss_chunks=args.loss_chunks, mesh=mesh, progress=compile_progress)
    print(f"[plan] compiling {len(pool)} candidates, {args.jobs} at a time ...", file=sys.stderr, flush=True)
    result = budget.auto(
        config, batch=batch, seq=seq, budget_bytes=budget_bytes, margin=margin, candidates=pool,
        exhaustive=True, planner=planner, jobs=args.jobs,
    )  # fmt: skip
    wanted = [c.policy for c in result.candidates] if limits == "all" else []
    if limits == "pareto":  # a dominated policy is never the best answer at any budget: skip its searches
        points = [(c.recompute_flops, c.need_bytes) for c in result.candidates]
        wanted = [result.candidates[i].policy for i in budget.pareto_front(points)]
    if limits == "chosen" and result.chosen is not None:
        wanted = [str(result.chosen)]
    fit = {}
    if wanted and mesh is None:
        # The searches' first compiles are known in advance (the batch line's two points, the sequence
        # limit): compile them together, args.jobs at a time; each search then needs about two more.
        planner.expect(2 * len(wanted))
        first = max(batch, 2)
        shapes = [(policies.parse(s), b, q) for s in wanted for b, q in ((first, seq), (2 * first, seq),
                                                                       (batch, config.max_seq_len))]  # fmt: skip
        print(f"[plan] largest batch and sequence that fit for {len(wanted)} policies ...", file=sys.stderr,
              flush=True)  # fmt: skip
        planner.precompile(shapes, jobs=args.jobs)
    for spec in wanted:
        kw = {"batch": batch, "seq": seq, "budget_bytes": budget_bytes, "margin": margin, "planner": planner}
        fit[spec] = (budget.max_fit(config, spec, dim="batch", **kw), budget.max_fit(config, spec, dim="seq", **kw))

    where = f", mesh {args.mesh} (bytes per device)" if mesh is not None else ""
    print(
        f"remat-kit plan --budget {fmt_bytes(budget_bytes)}: preset {args.preset} ({config.num_params() / 1e9:.2f} B "
        f"params), batch {batch} × seq {seq}, clipped AdamW step, loss_chunks={args.loss_chunks}, "
        f"margin {margin:.0%}{where}"
    )
    print(BUDGET_LEGEND)
    print("\n".join(format_budget_table(result, fit)))
    print(f"\nchosen: {result.chosen if result.chosen is not None else '(nothing fits)'}")
    print(result.reason)
    if args.plot:
        budget.plot_pareto(result, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        payload = {"command": command_line("plan", args), "preset": args.preset, "config": dataclasses.asdict(config),
                   "mesh": args.mesh, **result.to_dict()}  # fmt: skip
        for row in payload["candidates"]:
            row["max_batch"], row["max_seq"] = fit.get(row["policy"], (None, None))
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    if result.chosen is None:
        print(f"remat-kit plan: {result.reason}", file=sys.stderr)
        return 1
    return 0
