"""LoRA over a quantized base on the 2b preset, compile-only: need per policy and the longest sequence fitting 24/16 GB.

Compile-only (abstract shapes; nothing is allocated). The 2b preset with rank-R adapters on every
Block projection and an int8 (or, ``--quantize nf4``, a 4-bit NF4) frozen base: per policy, the
compiled step's device bytes at batch 2 × 1,024 and the longest sequence that fits 24 GB and 16 GB
(with remat_kit.auto's 10% margin), and the policy :func:`remat_kit.auto` picks at 2 × 1,024 under 24 GB.

The longest sequence is found from two compiles per policy (bytes are affine in the sequence length
under chunked attention and a chunked loss, to within a few percent): the affine fit's answer,
rounded down to a multiple of ``--round``, is then compiled once more to verify it fits at 24 GB
(and, with ``--verify-16``, at 16 GB; otherwise the 16 GB column is the fit's estimate, marked ~),
and the next multiple of ``--round`` up is compiled to show it does not (the "edges" lines; where
it does fit, the answer moves up until the next one does not).
Usage::

    python benchmarks/lora_2b.py --policies none,dots,selective,full > benchmarks/results/lora_2b.txt
    python benchmarks/lora_2b.py --quantize nf4 --policies none,dots,selective,full \
        > benchmarks/results/lora_2b_nf4.txt
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from flax import traverse_util

from remat_kit import policies
from remat_kit.model import lora
from remat_kit.model.transformer import TransformerConfig, abstract_params
from remat_kit.planning import builtin, fit
from remat_kit.planning import planner as planner_lib
from remat_kit.units import fmt_bytes

GB = 10**9


def _longest(planner, policy, batch: int, est: int, budget: int, slope: float, args, margin: float):
    """The longest multiple of ``args.round`` that fits ``budget`` (with the margin), from the affine estimate
    ``est``: compiled there, stepped down while it does not fit, then up while the next length fits.

    Returns ``(length, fits, edge)``: ``edge`` is ``(its need, next length, the next one's need)``, the next
    length up compiled and shown not to fit (next length and need None when it would pass ``--max-seq``);
    ``(0, False, None)`` when nothing fits.
    """
    fits = lambda need: need * (1 + margin) <= budget
    got = planner.memory(policy, batch, est)[0]
    while not fits(got):  # the fit overshot: step down by the excess, then recheck
        over = got * (1 + margin) - budget
        est -= max(args.round, -(-int(over / (1 + margin) / slope) // args.round) * args.round)
        if est < args.round:
            return 0, False, None
        got = planner.memory(policy, batch, est)[0]
    while est + args.round <= args.max_seq:  # the fit undershot, or it is exact: the next length must not fit
        nxt = planner.memory(policy, batch, est + args.round)[0]
        if not fits(nxt):
            return est, True, (got, est + args.round, nxt)
        est, got = est + args.round, nxt
    return est, True, (got, None, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="2b")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="all")
    ap.add_argument("--quantize", default="int8", choices=[m for m in lora.QUANTIZE_MODES if m != "none"])
    ap.add_argument("--loss-chunks", type=int, default=64, help="chunked loss: the [b, s, V] logits never live at once")
    ap.add_argument("--policies", default="none,dots,selective,full")
    ap.add_argument("--probe-seq", type=int, default=4096, help="second point of the affine fit")
    ap.add_argument("--round", type=int, default=256, help="report sequence lengths in multiples of this")
    ap.add_argument("--max-seq", type=int, default=131072, help="max_seq_len override for planning")
    ap.add_argument("--verify-16", action="store_true", help="also verify the 16 GB answer with a compile")
    ap.add_argument("--no-verify", action="store_true", help="report the affine estimates without compiling them")
    ap.add_argument("--auto", action="store_true", help="also run remat_kit.auto at batch x seq under 24 GB")
    args = ap.parse_args(argv)

    cfg = TransformerConfig.preset(
        args.preset,
        lora_rank=args.rank,
        lora_targets=lora.parse_targets(args.targets),
        quantize=args.quantize,
        max_seq_len=args.max_seq,
    )
    full = TransformerConfig.preset(args.preset)
    pb = lora.param_bytes(cfg)
    kernels = sum(a * b for a, b in lora.kernel_shapes(cfg).values()) * cfg.num_layers
    matrices = sum(a * b for a, b in lora.matrix_shapes(cfg).values())  # the embedding (and an untied head)
    frozen = traverse_util.flatten_dict(lora.partition(abstract_params(cfg))[1])
    stored = lambda name: int(sum(np.prod(v.shape) * v.dtype.itemsize for k, v in frozen.items() if name in k))
    kernel_bytes = stored("kernel")
    matrix_bytes = stored("embedding") + stored("lm_head")
    norm_bytes = pb.frozen - kernel_bytes - matrix_bytes  # the norm scales, unquantized
    margin = planner_lib.DEFAULT_MARGIN
    planner = builtin.Planner(cfg, loss_chunks=args.loss_chunks)
    b = args.batch
    t0 = time.perf_counter()
    print(
        f"preset {args.preset} ({full.num_params() / 1e9:.2f} B params), LoRA rank {args.rank} on "
        f"{','.join(cfg.lora_targets)} ({lora.num_trainable(cfg) / 1e6:.1f} M trainable), base {args.quantize}, "
        f"AdamW on the adapters only, loss chunks {args.loss_chunks}, compute {cfg.dtype}, margin {margin:.0%}"
    )
    print(
        f"parameters: frozen base {fmt_bytes(pb.frozen)}, {pb.frozen / full.num_params():.3f} byte per base "
        f"parameter ({args.quantize} Block kernels {fmt_bytes(kernel_bytes)}, {kernel_bytes / kernels:.3f} byte per "
        f"weight; {args.quantize} embedding{'' if cfg.tie_embeddings else ' and output head'} "
        f"{fmt_bytes(matrix_bytes)}, {matrix_bytes / matrices:.3f} byte per weight; {cfg.param_dtype} norms "
        f"{fmt_bytes(norm_bytes)}), "
        f"adapters {fmt_bytes(pb.trainable)}; adapter gradients + AdamW state "
        f"{fmt_bytes(3 * pb.trainable)}. Full fine-tuning needs 39.33 GB at 2 x 1,024 under full remat "
        "(benchmarks/results/auto_budgets_2b.txt).\n"
    )
    rows = []
    for spec in args.policies.split(","):
        p = policies.parse(spec)
        need = planner.memory(p, b, args.seq)[0]
        need2 = planner.memory(p, b, args.probe_seq)[0]
        slope = (need2 - need) / (args.probe_seq - args.seq)
        intercept = need - slope * args.seq
        fits = {}
        for gb in (24, 16):
            target = gb * GB / (1 + margin)
            est = int((target - intercept) / slope) // args.round * args.round
            est = max(0, min(est, args.max_seq))
            verified, edge = None, None
            if est and not args.no_verify and (gb == 24 or args.verify_16):
                est, verified, edge = _longest(planner, p, b, est, gb * GB, slope, args, margin)
            fits[gb] = (est, verified, edge)
        flops = planner.flops(p, b, args.seq)
        rows.append((str(p), need, flops, slope, fits))
        print(
            f"  [{time.perf_counter() - t0:.0f} s, {planner.compiles} compiles] {p}: {fmt_bytes(need)} at "
            f"{args.seq}, {fmt_bytes(need2)} at {args.probe_seq}, max seq { {gb: f[:2] for gb, f in fits.items()} }",
            flush=True,
        )

    base_flops = planner.flops(policies.none(), b, args.seq)
    print(f"\nbatch {b}: need at seq {args.seq}, bytes per extra token, longest sequence that fits (+{margin:.0%})")
    head = (
        f"{'policy':12} {'recompute':>10} {'need @' + str(args.seq):>12} {'per pos.':>10} "
        f"{'max seq 24GB':>13} {'max seq 16GB':>13}"
    )
    print(head)
    print("-" * len(head))
    for spec, need, flops, slope, fits in rows:
        cells = []
        for gb in (24, 16):
            est, ok, _ = fits[gb]
            cells.append(f"{est:,}" + ("" if ok else " ~" if ok is None else " !"))
        print(
            f"{spec:12} {(flops - base_flops) / 1e9:8.0f} G {fmt_bytes(need):>12} {fmt_bytes(slope):>10} "
            f"{cells[0]:>13} {cells[1]:>13}"
        )
    print(
        f"\nthe edges, compiled: the longest sequence fits, the next multiple of {args.round} does not (+{margin:.0%})"
    )
    for spec, _, _, _, fits in rows:
        for gb in (24, 16):
            est, ok, edge = fits[gb]
            if not ok:
                continue
            need, nxt, nxt_need = edge
            line = f"  {spec:12} {gb} GB: {est:,} needs {fmt_bytes(need * (1 + margin))}"
            if nxt is None:
                line += f"; {est + args.round:,} is past --max-seq {args.max_seq:,}"
            else:
                line += f"; {nxt:,} needs {fmt_bytes(nxt_need * (1 + margin))}, over {gb} GB"
            print(line)
    best = {gb: max(r[4][gb][0] for r in rows) for gb in (24, 16)}
    worst = {gb: min(r[4][gb][0] for r in rows) for gb in (24, 16)}
    for gb in (24, 16):
        if worst[gb]:
            print(
                f"at {gb} GB the policy moves the longest sequence {best[gb] / worst[gb]:.1f}x "
                f"({worst[gb]:,} -> {best[gb]:,})"
            )
    print("~: affine estimate, not compiled; per pos.: bytes per extra sequence position (whole batch).")

    if args.auto:
        result = fit.auto(cfg, batch=b, seq=args.seq, budget_bytes=24 * GB, planner=planner)
        print(f"\nremat_kit.auto at {b} x {args.seq}, 24 GB: {result.chosen}")
        print(f"  {result.reason}")
    print(f"\n{planner.compiles} compiles, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
