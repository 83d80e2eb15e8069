"""What ``plan`` prints: the policy table, the figures against the theory, JSON records and progress.

The command line is the only code that writes to stdout or stderr; the planning wing returns data
(:class:`remat_kit.planning.analysis.Analysis`) and this module turns it into lines.
"""

from __future__ import annotations

from typing import Any

from remat_kit import constants, policies
from remat_kit.analysis import explain, inspection
from remat_kit.cli.common import say
from remat_kit.planning import analysis
from remat_kit.units import fmt_bytes

#: The policies ``plan`` compares by default: one of each kind.
DEFAULT_POLICIES: tuple[str, ...] = constants.PLAN_POLICIES


def parse_policies(text: str, num_layers: int | None) -> list[policies.Policy]:
    """Comma-separated specs (``;`` options stay inside a spec) → policies valid for the depth (None: unchecked).

    ``every_n:2,selective:q_proj;strict=false`` is two specs: a comma splits specs only where the
    next piece starts a new policy kind (and never inside ``jax:save_only_these_names(a,b)``). An empty list
    or an empty item (``none,,full``) is refused.
    """
    if not text.replace(",", "").strip():
        raise ValueError(f"--policies {text!r} names no policy; e.g. none,full,selective (omit it for the defaults)")
    pieces: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            raise ValueError(f"--policies {text!r} has an empty item; separate the specs with one ','")
        starts_policy = _kind(piece) in policies.KINDS or piece in policies.MAXTEXT_ALIASES
        takes_tags = pieces and _kind(pieces[-1]) in policies.SPEC_OPTIONS and ":" in pieces[-1]
        # jax:save_only_these_names(a,b): its tag list runs to the closing parenthesis.
        takes_tags = takes_tags or (pieces and "(" in pieces[-1] and not pieces[-1].endswith(")"))
        if takes_tags and not starts_policy:
            pieces[-1] += "," + piece  # a tag list: selective:q_proj,k_proj
        else:
            pieces.append(piece)
    return [policies.parse(spec, num_layers=num_layers) for spec in pieces]


def _kind(spec: str) -> str:
    """The kind a spec starts with: up to its first ``:`` (tags) or ``;`` (options)."""
    return spec.split(":")[0].split(";")[0]


def parse_model_policies(text: str | None) -> list[policies.Policy]:
    """``--policies`` for ``--model`` (default :data:`remat_kit.planning.constants.GENERIC_CANDIDATES`); the depth is
    the model's own business, so it is not checked here."""
    return parse_policies(",".join(constants.GENERIC_CANDIDATES) if text is None else text, num_layers=None)


def plan_record(a: analysis.Analysis, top: int) -> dict[str, Any]:
    """One policy's JSON record: the analysis, its largest residuals and the layer breakdown."""
    record = a.to_dict(top=top)
    record["largest"] = record.pop("residuals")
    record["layers_breakdown"] = analysis.breakdown(a)
    return record


def against_theory(results: dict[str, analysis.Analysis]) -> list[str]:
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
    (:data:`remat_kit.analysis.inspection.TABLE_COLUMNS`), with the layer stack's and the head's saved bytes and
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
            inspection.table_row(
                name,
                a.saved_bytes,
                a.saved_host_bytes,
                a.memory.temp,
                a.peak_bytes,
                a.flops,
                base.flops if base else None,
                a.compile_s,
                cells,
            )
        )
    rows += [f"note: {n}" for n in dict.fromkeys(n for a in results.values() for n in a.notes)]
    return rows


def format_explain(results: dict[str, Any]) -> list[str]:
    """``plan --explain``: per policy, the groups live at the compiled peak (summing to it) and the largest buffers.

    ``results``: policy -> :class:`remat_kit.planning.analysis.Analysis` or
    :class:`remat_kit.analysis.inspection.Inspection` (``plan --model``), read with ``explain=True``.
    """
    lines = [
        "what is live at each policy's compiled peak (XLA's buffer assignment and live ranges, compile-only; "
        "'reserved' = bytes XLA holds but no value uses at that instruction, so the device groups sum to the peak):"
    ]
    for name, a in results.items():
        if not a.at_peak:
            continue
        lines.append(f"  {name}: peak in {a.peak_at}")
        table = explain.format_at_peak(a.at_peak, a.largest_at_peak, a.peak_bytes, a.host_at_peak)
        lines += ["    " + line for line in table.splitlines()]
        live = a.peak_bytes - a.at_peak.get("reserved", 0)
        lines.append(
            f"    groups without 'reserved': {fmt_bytes(live)} = {100 * live / max(a.peak_bytes, 1):.2f}% "
            "of the compiled peak"
        )
    return lines


def format_warnings(results: dict[str, Any]) -> list[str]:
    """The policies' guardrails (:mod:`remat_kit.analysis.explain`), each said once for the policies it names
    (:func:`remat_kit.analysis.explain.warning_lines`)."""
    return explain.warning_lines([(name, a.warnings) for name, a in results.items()])


# ---- --model MODULE:FACTORY: any model -------------------------------------------------------------------


# ---- plan --budget: the least-recompute policy that fits -----------------------------------------------


def maxtext_settings(policy: policies.Policy | policies.Mix) -> list[dict[str, Any]] | str:
    """MaxText's remat settings of ``policy``, one record per part (``layers``: first and last layer, ``settings``:
    :func:`remat_kit.policies.to_maxtext`'s); or, as a string, why MaxText cannot say it."""
    parts = policy.parts if isinstance(policy, policies.Mix) else ((policy, None),)
    out, first = [], 0
    try:
        for part, count in parts:
            layers = None if count is None else [first, first + count - 1]
            out.append({"layers": layers, "settings": policies.to_maxtext(part)})
            first += count or 0
    except ValueError as e:
        return str(e)
    return out


def _settings_line(settings: dict[str, str]) -> str:
    # What differs from MaxText's base.yml (every tensor 'remat', decoder_layer_input 'device').
    if settings["remat_policy"] != "custom":
        return f"remat_policy: {settings['remat_policy']}"
    shown = {k: v for k, v in settings.items() if v != "remat" and (k, v) != ("decoder_layer_input", "device")}
    return ", ".join(f"{k}: {v}" for k, v in shown.items()) + " (every other tensor as in MaxText's base.yml)"


def format_per_tensor(per) -> list[str]:
    """``plan --per-tensor``'s lines: the search, its answer and where it came from, and its MaxText settings."""
    groups = ", ".join("+".join(g) for g in per.groups)
    lines = [
        f"\nper tensor: every one of the {per.traces} subsets of {groups} priced on one layer "
        f"({len(per.options)} Pareto-optimal), every option and two-part mix of them scored, the cheapest predicted "
        "to fit compiled; auto's compiled presets and mix are seeds"
        + (" (MaxText-named tensors and policies only)" if per.maxtext else "")
        + ":"
    ]
    if per.chosen is None:
        return [*lines, "  nothing fits"]
    won = {"per-tensor": "the per-tensor search's own plan", "preset": "a preset", "mix": "auto's mix"}[per.source]
    lines.append(
        f"  {per.chosen}: est. {per.cost_s * 1e3:.3g} ms over none, needs {fmt_bytes(per.need_bytes)} "
        f"(compiled, fits; {won})"
    )
    settings = maxtext_settings(per.chosen)
    if isinstance(settings, str):
        return [*lines, f"  no MaxText equivalent: {settings} (--maxtext keeps to what MaxText can name)"]
    for record in settings:
        where = "" if record["layers"] is None else " layers {}-{}".format(*record["layers"])
        lines.append(f"  as MaxText settings{where}: {_settings_line(record['settings'])}")
    if len(settings) > 1:
        lines.append("  (MaxText applies one setting to every layer it scans: one layer range per scanned stack)")
    return lines


def compile_progress(done: int, total: int, what: str) -> None:
    """Progress on stderr: compiles done, out of those done and expected, and how many are left."""
    say(f"[plan] compiled {done}/{total} ({total - done} left): {what}")
