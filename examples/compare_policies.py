"""Train the same LM under ``none``, ``full`` and ``selective``: the loss curves coincide, memory differs.

Each policy trains from the same seed on the same batches. The script overlays the loss curves,
plots their difference from ``none`` (float rounding only), and reports what each policy keeps
for the backward pass (compile-only, :func:`remat_kit.planning.analysis.analyze`) and its step time.

    python examples/compare_policies.py --steps 150 --out runs/compare_policies.png
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from remat_kit import train
from remat_kit.model import TransformerConfig
from remat_kit.planning import analysis
from remat_kit.train import data


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=["none", "full", "selective"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("runs/compare_policies.png"))
    args = parser.parse_args(argv)

    model = TransformerConfig.preset(args.preset)
    corpus = data.load_corpus(max_bytes=2**20)
    runs = {}
    for spec in args.policies:
        cfg = train.TrainConfig(
            model=model, policy=spec, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len
        )
        result = train.train(cfg, corpus, log=lambda msg: None)
        kept = analysis.analyze(model, spec, args.batch_size, args.seq_len)
        losses = np.array([r["loss"] for r in result.history])
        step_s = np.median([r["step_s"] for r in result.history[1:]] or [result.history[0]["step_s"]])
        runs[cfg.policy] = (losses, kept.saved_bytes, kept.memory.temp, step_s)

    base_name = next(iter(runs))  # the first policy is the reference
    base = runs[base_name][0]
    print(f"{'policy':12} {'max rel. loss diff':>18} {'kept for backward':>18} {'XLA temp':>10} {'step':>9}")
    for name, (losses, saved, temp, step_s) in runs.items():
        diff = np.max(np.abs(losses - base) / np.abs(base))
        print(f"{name:12} {diff:18.1e} {saved / 2**20:15.2f} MiB {temp / 2**20:6.2f} MiB {step_s * 1e3:6.1f} ms")

    fig, (ax_loss, ax_diff, ax_mem) = plt.subplots(1, 3, figsize=(15, 4))
    steps = np.arange(1, len(base) + 1)
    for i, (name, (losses, *_rest)) in enumerate(runs.items()):
        ax_loss.plot(steps, losses, label=name, lw=1)
        if i:  # steps with identical losses have no point on the log scale
            rel = np.abs(losses - base) / np.abs(base)
            ax_diff.semilogy(steps[rel > 0], rel[rel > 0], "o", ms=3, label=f"{name} ({np.sum(rel == 0)} steps equal)")
    ax_diff.axhline(np.finfo(np.float32).eps, color="gray", ls="--", label="float32 epsilon")
    ax_loss.set(xlabel="step", ylabel="training loss (nats/byte)", title="loss curves (overlaid)")
    ax_diff.set(xlabel="step", ylabel=f"|loss - loss({base_name})| / loss", title="relative difference")
    names = list(runs)
    ax_mem.bar(names, [runs[n][1] / 2**20 for n in names], color="tab:blue")
    ax_mem.set(ylabel="MiB kept for the backward pass", title="memory and step time")
    ax_mem.set_ylim(0, 1.2 * max(runs[n][1] for n in names) / 2**20)
    for i, n in enumerate(names):
        ax_mem.annotate(f"{runs[n][3] * 1e3:.1f} ms/step", (i, runs[n][1] / 2**20), ha="center", va="bottom")
    for ax in (ax_loss, ax_diff):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{args.preset} preset, batch {args.batch_size} x {args.seq_len}: same result, different memory")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
