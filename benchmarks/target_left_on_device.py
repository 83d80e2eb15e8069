"""What stays on a GPU target's device at the step's peak, per position: the 2B long-context step, compile-only.

The step of ``plan --max-seq --target h100`` (2B preset, LoRA 16 on every projection, NF4 base, batch 2, loss
chunks and sequence tiles auto) is compiled for the target at a few lengths with XLA's dump read
(:meth:`remat_kit.planning.planner.StepPlanner.explanation`): the groups live at the peak and the largest buffers,
device and host apart. Needs ``pip install 'remat-kit[gpu-target]'``; no GPU.

Usage::

    python benchmarks/target_left_on_device.py --target h100 --policy offload --seqs 65536,131072
"""

from __future__ import annotations

import argparse

import jax

from remat_kit import policies
from remat_kit.model import lora
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning.builtin import Planner
from remat_kit.units import fmt_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--policy", default="offload")
    ap.add_argument("--seqs", default="65536,131072")
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args(argv)
    if not jax.config.jax_platforms:  # the CUDA plugin's deviceless compiler, on this machine's CPU
        jax.config.update("jax_platforms", "cpu")
    seqs = [int(s) for s in args.seqs.split(",")]
    config = TransformerConfig.preset(
        "2b",
        max_seq_len=max(seqs),
        lora_rank=16,
        lora_targets=lora.parse_targets("all"),
        quantize="nf4",
        seq_tiles="auto",
    )
    planner = Planner(config, loss_chunks="auto", target=args.target)
    policy = policies.parse(args.policy)
    print(f"target {planner.target.label}; 2B, LoRA 16 all, NF4, batch {args.batch}, policy {policy}")
    for seq in seqs:
        m = planner.compiled_memory(policy, args.batch, seq)
        found = planner.explanation(policy, args.batch, seq)
        print(
            f"\nseq {seq:,}: device {fmt_bytes(m.total)} ({fmt_bytes(m.total / seq)} per position), "
            f"host {fmt_bytes(m.host)} ({fmt_bytes(m.host / seq)} per position)"
        )
        print("  at the peak: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in found.at_peak.items()))
        for b in found.largest_at_peak:
            where = "host" if b.host else "device"
            per = fmt_bytes(b.nbytes / seq)
            print(f"  {fmt_bytes(b.nbytes):>10} {per:>9}/pos {where:6} {b.dtype:9} {b.shape!s:26} {b.producer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
