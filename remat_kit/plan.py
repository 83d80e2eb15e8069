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
import json
import os
import sys
from typing import Any

from remat_kit import analysis, budget, lora, policies
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


def parse_policies(text: str, num_layers: int) -> list[policies.Policy]:
    """Comma-separated specs (``;`` options stay inside a spec) → policies valid for the depth.

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
        p.validate_depth(num_layers)
        out.append(p)
    return out


def add_model_args(parser: argparse.ArgumentParser, default_preset: str) -> None:
    """The model and shape options plan and bench share."""
    parser.add_argument("--preset", default=default_preset, help=f"model preset: {', '.join(PRESETS)}")
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
        lines.append(
            f"  why they differ: {attn}; {fmt_bytes(weights)} are weight copies (compute-dtype casts or slices), "
            f"not activations; the other {fmt_bytes(rest)} ({rest / max(e.korthikanti, 1):.2f}× the 34·b·s·h·L) "
            f"reflect this block: SwiGLU (d_ff={cfg.d_ff} = {cfg.d_ff / d:.1f}·h, three [b, s, d_ff] tensors), "
            f"{cfg.dtype} activations with float32 norm and softmax intermediates, RoPE, and no dropout masks "
            f"(dropout={cfg.dropout})."
        )
    return lines


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def format_table(results: dict[str, analysis.Analysis]) -> list[str]:
    """The per-policy comparison table (plain text)."""
    base = results.get("none")
    header = (
        f"{'policy':14} {'saved':>10} {'host':>10} {'layers':>10} {'head':>10} {'XLA temp':>10} "
        f"{'GFLOPs':>9} {'×none':>6} {'XLA raw':>9} {'compile':>8}"
    )
    rows = [header, "-" * len(header)]
    for name, a in results.items():
        ratio = f"{a.flops / base.flops:.3f}" if base and base.flops else "-"
        rows.append(
            f"{name:14} {fmt_bytes(a.saved_bytes):>10} {fmt_bytes(a.saved_host_bytes):>10} "
            f"{fmt_bytes(a.layers_saved_bytes):>10} {fmt_bytes(a.saved_bytes - a.layers_saved_bytes):>10} "
            f"{fmt_bytes(a.memory.temp):>10} {a.flops / 1e9:>9.1f} {ratio:>6} {a.xla_flops / 1e9:>9.1f} "
            f"{a.compile_s:>7.1f}s"
        )
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


def _plan_command(args: argparse.Namespace) -> int:
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
        "(activations + gradients + workspace); GFLOPs = matmul FLOPs counted from the jaxpr with scans × trip "
        "count; XLA raw = cost_analysis(), which counts a scan body once.\n"
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
        help="with --budget: find the largest batch and longest sequence that fit for the Pareto-optimal "
        "policies (default; a dominated one is never the best choice), every policy, only the chosen one, or none",
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="with --budget: Pareto plot of memory vs recompute")
    p.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="policies compiled at once (default: 2)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.set_defaults(func=_plan_command)


# ---- plan --budget: the least-recompute policy that fits -----------------------------------------------


def _budget_command(args: argparse.Namespace, config: TransformerConfig, batch: int, seq: int, mesh) -> int:
    """``plan --budget``: every candidate's need against the budget, the choice, and the limits that fit."""
    budget_bytes = budget.parse_bytes(args.budget)
    margin = budget.DEFAULT_MARGIN if args.margin is None else args.margin
    budget.check_budget(budget_bytes, margin)
    limits = args.limits or "pareto"
    check_writable(args.json, "--json")
    check_writable(args.plot, "--plot")
    pool = parse_policies(args.policies, config.num_layers) if args.policies else list(budget.candidates(config))
    planner = budget.Planner(config, loss_chunks=args.loss_chunks, mesh=mesh)
    print(f"[plan] compiling {len(pool)} candidates ...", file=sys.stderr, flush=True)
    result = budget.auto(
        config, batch=batch, seq=seq, budget_bytes=budget_bytes, margin=margin, candidate_policies=pool,
        exhaustive=True, planner=planner,
    )  # fmt: skip
    wanted = [c.policy for c in result.candidates] if limits == "all" else []
    if limits == "pareto":  # a dominated policy is never the best answer at any budget: skip its searches
        points = [(c.recompute_flops, c.need_bytes) for c in result.candidates]
        wanted = [result.candidates[i].policy for i in budget.pareto_front(points)]
    if limits == "chosen" and result.chosen is not None:
        wanted = [str(result.chosen)]
    fit = {}
    for i, spec in enumerate(wanted):
        print(f"[plan] {i + 1}/{len(wanted)} {spec}: largest batch and sequence that fit ...", file=sys.stderr,
              flush=True)  # fmt: skip
        kw = {"batch": batch, "seq": seq, "budget_bytes": budget_bytes, "margin": margin, "planner": planner}
        fit[spec] = (budget.max_fit(config, spec, dim="batch", **kw), budget.max_fit(config, spec, dim="seq", **kw))

    where = f", mesh {args.mesh} (bytes per device)" if mesh is not None else ""
    print(
        f"remat-kit plan --budget {fmt_bytes(budget_bytes)}: preset {args.preset} ({config.num_params() / 1e9:.2f} B "
        f"params), batch {batch} × seq {seq}, AdamW, loss_chunks={args.loss_chunks}, margin {margin:.0%}{where}"
    )
    print("need = compiled step's device bytes (weights + gradients + optimizer state + activations); "
          "recompute = matmul FLOPs beyond `none`.\n")  # fmt: skip
    width = max(len(c.policy) for c in result.candidates) + 1
    head = f"{'policy':{width + 1}} {'recompute':>10} {'need':>10} {'+margin':>10} {'fits':>5}"
    if fit:
        head += f" {'max batch @seq ' + str(seq):>18} {'max seq @batch ' + str(batch):>18}"
    print(head)
    print("-" * len(head))
    for c in result.candidates:
        mark = "*" if result.chosen is not None and c.policy == str(result.chosen) else " "
        row = (
            f"{mark}{c.policy:{width}} {fmt_flops(c.recompute_flops):>10} {fmt_bytes(c.need_bytes):>10} "
            f"{fmt_bytes(c.need_bytes * (1 + margin)):>10} {'yes' if c.fits else 'no':>5}"
        )
        if fit:
            row += "".join(f" {fit[c.policy][k] if c.policy in fit else '-':>18}" for k in (0, 1))
        print(row)
    if any(policies.parse(c.policy).kind == "offload" for c in result.candidates) and not any(
        c.host_bytes for c in result.candidates
    ):
        print("note: this backend reports offloaded bytes as device bytes (XLA:CPU); a GPU/TPU separates them.")
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
