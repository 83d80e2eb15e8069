"""``remat-kit plan``: every policy's saved residuals, compiled memory and FLOPs, compile-only.

``remat-kit plan --preset 2b --batch-size 2 --seq-len 1024`` compares the policies on a 2B-class
model without allocating it, checks the textbook estimates (full remat's checkpointed layer inputs,
the float32 logits, Korthikanti's "everything kept") against the exact ones, and lists the largest
residuals of each policy: what to target next.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from remat_kit import constants, inspection, policies
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning import analysis, budget
from remat_kit.units import check_int, fmt_bytes, fmt_flops

#: The policies ``plan`` compares by default: one of each kind.
DEFAULT_POLICIES: tuple[str, ...] = constants.PLAN_POLICIES


# ---- shared by plan and bench ----------------------------------------------------------------------


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


# ---- plan ------------------------------------------------------------------------------------------


def plan_record(a: analysis.Analysis, top: int) -> dict[str, Any]:
    """One policy's JSON record: the analysis, its largest residuals and the layer breakdown."""
    record = a.to_dict(top=top)
    record["largest"] = record.pop("residuals")
    record["layers_breakdown"] = analysis.breakdown(a)
    return record


def seed_check(results: dict[str, analysis.Analysis]) -> list[str]:
    """Lines setting the exact figures beside the textbook estimates ("against the theory"), and why they differ."""
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
            f"the usual estimate 2·b·s·h·L = {fmt_bytes(e.layer_inputs)}"
        )
    logits = [r for r in any_a.residuals if r.region == "head" and r.shape == (b, s, cfg.vocab_size)]
    if logits:
        lines.append(
            f"the loss keeps [b, s, V] logits-sized tensors: {fmt_bytes(sum(r.nbytes for r in logits))} "
            f"({', '.join(f'{r.label} {r.dtype}' for r in logits)}); the usual b·s·V·4 = {fmt_bytes(e.logits)} "
            f"(--loss-chunks K removes them; their gradient needs as much again in temp)"
        )
    elif any_a.loss_chunks:
        grads = [r for r in any_a.residuals if r.region == "head" and "(fused loss)" in r.label]
        lines.append(
            f"--loss-chunks {any_a.loss_chunks}: no [b, s, V] logits are kept (the usual b·s·V·4 = "
            f"{fmt_bytes(e.logits)}); the fused loss takes its gradients in the forward pass and keeps them: "
            f"{fmt_bytes(sum(r.nbytes for r in grads))} (the output matrix's and the hidden states' gradients, "
            f"which the backward pass would hold from its first step anyway)"
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
    check_int("jobs", jobs)

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
    """``--policies`` for ``--model`` (default :data:`remat_kit.planning.budget.GENERIC_CANDIDATES`); the depth is
    the model's own business, so it is not checked here."""
    return parse_policies(text or ",".join(budget.GENERIC_CANDIDATES), num_layers=None)


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

