"""``remat-kit plan --max-seq``: per policy, the longest sequence whose compiled step fits each budget.

Each answer is found at its edge by compiling (:func:`remat_kit.planning.limits.longest_seq`): the longest
multiple of ``--seq-step`` that fits, and the next one, which does not. Beside it: the need at the reference
length, the cost of one more position (the slope from the reference to the longest edge, whole batch) and the
floor under it, what the policy's layer stack keeps per position (trace-only), with offloaded bytes counted on
the device where offload moves nothing (XLA:CPU, :func:`remat_kit.analysis.memory.host_offload`).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect as pyinspect
import os
import sys
from typing import Any

from remat_kit.cli.common import check_writable, command_line, write_json
from remat_kit.units import fmt_bytes, fmt_bytes_beside, fmt_count

#: ``--max-seq`` without a value tries sequences up to this length (and ``plan --budget``'s max seq column).
DEFAULT_LIMIT = 131_072

#: ``--seq-step``'s default: lengths tried in multiples of this (``plan --budget``'s max seq column too).
DEFAULT_STEP = 256

#: ``--max-seq`` compares these by default on a preset (one of each kind that changes what a layer keeps).
DEFAULT_POLICIES: tuple[str, ...] = ("none", "dots", "selective", "offload", "full")


def budgets_arg(text: str) -> list[int]:
    """``--budget`` with ``--max-seq``: one size or several, comma-separated (``16GB,24GB,80GB``)."""
    from remat_kit.units import parse_bytes

    return [parse_bytes(part) for part in text.split(",")]


def host_ram(stated: str | None = None) -> int | None:
    """The host memory offloaded bytes are stated against: ``--host-ram`` when given, else this machine's
    physical memory in bytes (None where the OS does not say)."""
    if stated is not None:
        from remat_kit.units import parse_bytes

        return parse_bytes(stated)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_args(args: argparse.Namespace) -> tuple[list[int], float, int, int]:
    """``(budgets, margin, step, limit)`` of ``--max-seq``, refused in one line before anything is compiled."""
    from remat_kit.planning.planner import DEFAULT_MARGIN, Budget

    if args.budget is None:
        raise ValueError("--max-seq needs --budget (one size or several: 16GB,24GB,80GB)")
    for flag in ("explain", "per_tensor", "maxtext", "calibrate"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} does not go with --max-seq")
    for flag in ("timeline", "plot", "limits", "mesh"):
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--{flag} does not go with --max-seq")
    budgets = budgets_arg(args.budget)
    host_ram(args.host_ram)  # a bad --host-ram is refused before anything is compiled
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    for b in budgets:
        Budget(b, margin)
    step, limit = args.seq_step, args.max_seq
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"--seq-step must be an integer >= 1, got {step!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < step or limit % step:
        raise ValueError(f"--max-seq {limit!r} must be a positive multiple of --seq-step {step}")
    tiles = getattr(args, "seq_tiles", None)
    if isinstance(tiles, int) and not isinstance(tiles, bool) and tiles > 0 and step % tiles:
        raise ValueError(f"--seq-step {step} must be a multiple of --seq-tiles {tiles}: every length tried is tiled")
    check_writable(args.json, "--json")
    return budgets, margin, step, limit


@dataclasses.dataclass(frozen=True)
class PolicyReach:
    """One policy's row: the reference need, the per-position cost and floor, and the edge at each budget."""

    policy: str
    ref_seq: int
    ref_need_bytes: int
    per_position_bytes: float | None
    floor_per_position_bytes: float
    floor_host_per_position_bytes: float
    edges: tuple[Any, ...]  # remat_kit.planning.limits.SeqEdge, one per budget

    def to_dict(self) -> dict[str, Any]:
        row = {k: v for k, v in dataclasses.asdict(self).items() if k != "edges"}
        row["edges"] = [dataclasses.asdict(e) for e in self.edges]
        return row


def lever_config(args: argparse.Namespace, config, limit: int) -> tuple[Any, int | str]:
    """``(config, loss_chunks)`` of the step whose longest sequence ``plan --max-seq`` and ``plan --budget``'s max
    seq column both report, so the two agree: ``config`` up to ``limit`` positions with the levers by default, the
    chunked loss (``auto`` unless ``--loss-chunks`` is typed) and sequence tiles (``auto`` unless ``--seq-tiles``
    is given); flags opt out."""
    from remat_kit.cli.common import DefaultChunks, check_seq_tiles_flag

    tiles = check_seq_tiles_flag("auto" if getattr(args, "seq_tiles", None) is None else args.seq_tiles)
    chunks = "auto" if type(args.loss_chunks) is DefaultChunks else args.loss_chunks
    return dataclasses.replace(config, max_seq_len=limit, **tiles), chunks


def first_unit(chunks, batch: int | None, step: int) -> int:
    """The shortest length tried, in units of ``step``: a chunked loss's count may not exceed the token count."""
    if isinstance(chunks, int) and chunks and batch:
        return max(1, -(-chunks // (batch * step)))
    return 1


def longest(
    planner, policy, *, batch, ref_seq: int, budget_bytes: int, margin: float, step: int, limit: int, first: int
):
    """The one computation of the longest sequence a policy fits at a budget (a
    :class:`remat_kit.planning.limits.SeqEdge`), for ``--max-seq``'s rows and ``plan --budget``'s max seq column."""
    from remat_kit.planning import limits

    return limits.longest_seq(
        planner,
        policy,
        batch=batch,
        budget_bytes=budget_bytes,
        margin=margin,
        step=step,
        limit=limit,
        first=first,
        probes=(ref_seq, 4 * ref_seq),
    )


def reach(planner, policy, *, batch, ref_seq: int, budgets, margin, step, limit, first, floor) -> PolicyReach:
    """A policy's :class:`PolicyReach` (compiles the reference shape and each budget's edge)."""
    ref_need = planner.memory(policy, batch, ref_seq)[0]
    kw = {"batch": batch, "ref_seq": ref_seq, "margin": margin, "step": step, "limit": limit, "first": first}
    edges = tuple(longest(planner, policy, budget_bytes=b, **kw) for b in budgets)
    longest_edge = max(edges, key=lambda e: e.seq)
    per = None
    if longest_edge.seq > ref_seq:
        per = (longest_edge.need_bytes - ref_need) / (longest_edge.seq - ref_seq)
    elif longest_edge.next_seq is not None and longest_edge.next_seq != ref_seq:
        per = (longest_edge.next_need_bytes - ref_need) / (longest_edge.next_seq - ref_seq)
    device, host = floor
    return PolicyReach(str(policy), ref_seq, ref_need, per, device, host, edges)


def format_rows(rows: list[PolicyReach], budgets: list[int]) -> list[str]:
    """The table: need at the reference, cost per position, floor (device; host where offload moves bytes), × floor
    (the device floor: none where the layers keep nothing on the device), and the longest sequence per budget."""
    ref = rows[0].ref_seq
    cols = "".join(f"{'max seq ' + fmt_bytes(b):>17}" for b in budgets)
    head = (
        f"{'policy':12} {'need @' + format(ref, ','):>13} {'per pos.':>10} {'floor':>10} {'host/pos.':>10} "
        f"{'x floor':>8}{cols}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        per = "-" if r.per_position_bytes is None else fmt_bytes(r.per_position_bytes)
        ratio = (
            "-"
            if r.per_position_bytes is None or r.floor_per_position_bytes < 1  # nothing per position on the device
            else f"{r.per_position_bytes / r.floor_per_position_bytes:.2f}"
        )
        cells = "".join(f"{format(e.seq, ','):>17}" for e in r.edges)
        lines.append(
            f"{r.policy:12} {fmt_bytes(r.ref_need_bytes):>13} {per:>10} {fmt_bytes(r.floor_per_position_bytes):>10} "
            f"{fmt_bytes(r.floor_host_per_position_bytes):>10} {ratio:>8}{cells}"
        )
    return lines


def format_edges(rows: list[PolicyReach]) -> list[str]:
    """The compiled edges: the longest length fits, the next does not (or it is the limit)."""
    lines = []
    for r in rows:
        for e in r.edges:
            where = f"  {r.policy:12} {fmt_bytes(e.budget_bytes)}: "
            if not e.seq:
                over = fmt_bytes_beside(e.next_need_bytes * (1 + e.margin), e.budget_bytes)
                lines.append(where + f"nothing fits: {e.step:,} needs {over}")
                continue
            line = where + f"{e.seq:,} needs {fmt_bytes_beside(e.need_bytes * (1 + e.margin), e.budget_bytes)}"
            if e.next_seq is None:
                line += f"; {e.seq + e.step:,} is past --max-seq {e.limit:,}"
            else:
                over = fmt_bytes_beside(e.next_need_bytes * (1 + e.margin), e.budget_bytes)
                line += f"; {e.next_seq:,} needs {over}, over"
            if e.host_bytes:
                line += f"; host {fmt_bytes(e.host_bytes)}"
            lines.append(line)
    return lines


def host_lines(rows: list[PolicyReach], enforced: bool, platform: str, ram: int | None = None) -> list[str]:
    """What offload does here, and the host bytes offloading policies need against the host's memory ``ram``."""
    lines = []
    offloading = [r for r in rows if r.floor_host_per_position_bytes or any(e.host_bytes for e in r.edges)]
    if not enforced:
        lines.append(
            f"offload on {platform}: not modelled here (XLA:CPU's device-to-host copy moves nothing: offloaded layer "
            "inputs count as device bytes above); --target h100 compiles the GPU's step, where they leave the device"
        )
        return lines
    for r in offloading:
        for e in r.edges:
            if not e.seq:
                continue
            holds = "unknown" if ram is None else ("yes" if e.host_bytes <= ram else "no")
            lines.append(
                f"{r.policy} at {e.seq:,} ({fmt_bytes(e.budget_bytes)}): host {fmt_bytes(e.host_bytes)} "
                f"({fmt_bytes(r.floor_host_per_position_bytes)} per position); the host has "
                f"{'?' if ram is None else fmt_bytes(ram)}: holds them: {holds}"
            )
    return lines


def run_preset(args: argparse.Namespace) -> int:
    """``plan --max-seq`` on the built-in model (a preset)."""
    from remat_kit import constants
    from remat_kit.analysis import memory
    from remat_kit.cli.common import lora_overrides
    from remat_kit.cli.plan_report import compile_progress, parse_policies
    from remat_kit.model.transformer import TransformerConfig
    from remat_kit.planning import analysis
    from remat_kit.planning.builtin import Planner

    budgets, margin, step, limit = check_args(args)
    overrides: dict[str, Any] = {}
    for flag, field in (("dtype", "dtype"), ("param_dtype", "param_dtype"), ("attention", "attention")):
        if getattr(args, flag):
            overrides[field] = getattr(args, flag)
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    overrides.update(lora_overrides(args))
    # The levers by default: the longest sequence is what the chunked loss and sequence tiles give (flags opt out).
    config, chunks = lever_config(args, TransformerConfig.preset(args.preset, **overrides), limit)
    batch, ref = constants.PRESET_SHAPES.get(args.preset, (1, min(128, config.max_seq_len)))
    batch = batch if args.batch_size is None else args.batch_size
    ref = ref if args.seq_len is None else args.seq_len
    ref_chunks = chunks
    if chunks == "auto":
        from remat_kit.model.loss import auto_chunks

        ref_chunks = auto_chunks(batch * ref, config.vocab_size)
    analysis.check_shape(config, batch, ref, ref_chunks)
    specs = parse_policies(",".join(DEFAULT_POLICIES) if args.policies is None else args.policies, config.num_layers)
    planner = Planner(
        config, loss_chunks=chunks, progress=None if args.no_progress else compile_progress, target=args.target
    )
    first = first_unit(chunks, batch, step)
    rule = memory.host_offload(planner.device)
    rows = []
    for p in specs:
        if not args.no_progress:
            print(f"[plan] {p}: longest sequence at {len(budgets)} budget(s) ...", file=sys.stderr, flush=True)
        with planner.target.tracing():  # what the target's kernels keep (cuDNN's attention on a GPU)
            device, host = analysis.layer_stack_bytes(config, p, batch, ref, rule.enforced)
        if not rule.enforced:
            device, host = device + host, 0
        rows.append(
            reach(
                planner,
                p,
                batch=batch,
                ref_seq=ref,
                budgets=budgets,
                margin=margin,
                step=step,
                limit=limit,
                first=first,
                floor=(device / ref, host / ref),
            )
        )
    tiles = config.seq_tiles
    print(
        f"remat-kit plan --max-seq: preset {args.preset} ({fmt_count(config.num_params())} params, "
        f"L={config.num_layers}, d={config.d_model}), batch {batch}, loss_chunks={chunks}, seq_tiles={tiles}, "
        f"{config.dtype} compute, clipped AdamW step, margin {margin:.0%}, lengths in multiples of {step:,} up to "
        f"{limit:,}, compile-only"
        + (f", LoRA rank {config.lora_rank} ({config.quantize} base)" if config.lora_rank else "")
    )
    from remat_kit.cli.plan import target_line

    print(target_line(planner.target, config))
    head = {"preset": args.preset, "config": dataclasses.asdict(config), "loss_chunks": chunks}
    return _report(args, rows, budgets, rule, head, batch)


def run_model(args: argparse.Namespace) -> int:
    """``plan --max-seq --model MODULE:FACTORY``: :func:`remat_kit.max_seq` on the factory's model, every lever on.

    ``FACTORY()`` returns ``(model, loss_fn, args_at)``, :func:`remat_kit.max_seq`'s arguments; ``--policies`` (one
    policy), ``--seq-tiles``, ``--query-blocks`` and ``--loss-chunks`` set a lever or opt out of it.
    """
    from remat_kit.cli.common import DefaultChunks
    from remat_kit.planning import max_seq as max_seq_lib
    from remat_kit.planning.user_model import FactoryError, load_factory

    budgets, margin, step, limit = check_args(args)
    policy = "full" if args.policies is None else args.policies
    if "," in policy:
        raise ValueError(f"--policies {policy}: --max-seq with --model takes one policy (default full)")
    factory = load_factory(args.model)
    required = [
        p
        for p in pyinspect.signature(factory).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise ValueError(
            f"--max-seq with --model {args.model}: the factory must take no argument and return (model, loss_fn, "
            f"args_at), remat_kit.max_seq's arguments; it takes ({', '.join(p.name for p in required)})"
        )
    try:
        made = factory()
    except (TypeError, ValueError) as err:
        raise ValueError(f"--model {args.model}: FACTORY() raised {type(err).__name__}: {err}") from None
    except Exception as err:
        raise FactoryError(f"--model {args.model}: FACTORY() raised {type(err).__name__}: {err}") from err
    if not isinstance(made, tuple) or len(made) != 3:
        raise TypeError(f"--model {args.model}: FACTORY() must return (model, loss_fn, args_at), got {made!r:.80}")
    chunks = "auto" if type(args.loss_chunks) is DefaultChunks else args.loss_chunks
    say = None if args.no_progress else (lambda line: print(line, file=sys.stderr, flush=True))
    search = max_seq_lib.prepare(
        *made,
        step=step,
        limit=limit,
        policy=policy,
        query_blocks="auto" if getattr(args, "query_blocks", None) is None else args.query_blocks,
        seq_tiles="auto" if args.seq_tiles is None else args.seq_tiles,
        loss_chunks=chunks,
        target=args.target,
        progress=say,
    )
    edges = [search.edge(b, margin) for b in budgets]
    print(
        f"remat-kit plan --max-seq --model {args.model}: clipped AdamW step, margin {margin:.0%}, lengths in "
        f"multiples of {step:,} up to {limit:,}, compile-only"
    )
    print(f"levers: {search.levers.describe()}")
    for line in search.unavailable:
        print(f"not used: {line}")
    for e in edges:
        line = f"  {fmt_bytes(e.budget_bytes)}: "
        if not e.seq:
            line += f"nothing fits: {e.step:,} needs {fmt_bytes(e.next_need_bytes * (1 + e.margin))}"
        else:
            line += f"longest {e.seq:,} needs {fmt_bytes(e.need_bytes * (1 + e.margin))}"
            if e.next_seq is None:
                line += f"; {e.seq + e.step:,} is past --max-seq {e.limit:,}"
            else:
                over = fmt_bytes_beside(e.next_need_bytes * (1 + e.margin), e.budget_bytes)
                line += f"; {e.next_seq:,} needs {over}, over"
        print(line)
    print(f"{search.planner.compiles} compiles (each the whole step at one length)")
    if args.json:
        payload = {
            "command": command_line("plan", args),
            "model": args.model,
            "levers": dataclasses.asdict(search.levers),
            "unavailable": list(search.unavailable),
            "edges": [
                {k: v for k, v in dataclasses.asdict(e).items() if k not in ("levers", "unavailable")} for e in edges
            ],
            "target": args.target or "local",
        }
        write_json(args.json, payload)
        if args.json != "-":
            print(f"\nwrote {args.json}")
    return 0 if all(e.seq for e in edges) else 1


def _report(args, rows: list[PolicyReach], budgets: list[int], rule, head: dict, batch) -> int:
    print(
        "need: the compiled step's device bytes at the reference length; per pos.: bytes of one more position "
        "(whole batch), from the reference to the longest edge; floor: what the layers keep per position "
        "(trace-only; the layer inputs under full); max seq: the longest multiple of --seq-step that fits "
        "(with the margin), compiled, the next one compiled and over\n"
    )
    for line in format_rows(rows, budgets):
        print(line)
    print("\nthe edges, compiled (needs with the margin):")
    for line in format_edges(rows):
        print(line)
    ram = host_ram(args.host_ram)
    for line in host_lines(rows, rule.enforced, rule.platform, ram):
        print(line)
    if args.json:
        payload = {
            "command": command_line("plan", args),
            **head,
            "batch": batch,
            "budgets": budgets,
            "margin": rows[0].edges[0].margin if rows else None,
            "offload_moves_memory": rule.enforced,
            "host_ram_bytes": ram,
            "target": args.target or "local",
            "policies": [r.to_dict() for r in rows],
        }
        write_json(args.json, payload)
        if args.json != "-":
            print(f"\nwrote {args.json}")
    return 0 if all(e.seq for r in rows for e in r.edges) else 1
