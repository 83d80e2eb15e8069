"""LoRA fine-tuning over an int8 base and over an NF4 base from the same full checkpoint: loss curves, the gap.

The ``small`` preset is first trained briefly in full (``--base-steps`` on the Python standard
library's sources, as ``examples/lora_finetune.py`` does); from those same parameters
:func:`remat_kit.model.lora.from_base` builds two adapted models, one with an int8 base and one
with an NF4 base, with the same adapter initialization, and both are fine-tuned on the same
batches of remat_kit's own sources under the same policy. Prints the losses, the validation loss
before and after, and the final gap; ``--plot`` draws the two curves side by side.

``--seeds N`` repeats the two fine-tunings over the same base with seeds 0..N-1 (the adapters'
initialization and the batch order; both bases share them within a seed) and reports each seed's gap
and the gaps' mean ± standard deviation: the seed-to-seed noise the int8-vs-NF4 gap is measured
against. The loss table and the plot are seed 0's. Usage::

    python benchmarks/nf4_finetune.py --seeds 3 --plot benchmarks/results/nf4_finetune.png \\
        > benchmarks/results/nf4_finetune.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import remat_kit
from remat_kit import train
from remat_kit.model import TransformerConfig, lora
from remat_kit.train import data
from remat_kit.train.checkpoint import Checkpoints


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--policy", default="full")
    ap.add_argument("--base-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--smooth", type=int, default=20, help="moving-average window of the plotted curves")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--seeds", type=int, default=1, help="fine-tune both bases with seeds 0..N-1; report the spread")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    t0 = time.perf_counter()

    base_config = train.TrainConfig(
        model=TransformerConfig.preset(args.preset),
        policy=args.policy,
        steps=args.base_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        eval_every=0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        train.train(base_config, max_corpus_bytes=2 * 2**20, checkpoint_dir=Path(tmp) / "base")
        abstract = jax.eval_shape(lambda: train.Trainer(base_config).init_state().to_dict())
        with Checkpoints(Path(tmp) / "base") as ckpts:
            step, state, _ = ckpts.restore_latest(abstract)
    base_params = jax.tree.map(np.asarray, state["params"])  # host copies: each run's step donates its inputs
    print(
        f"base: {args.preset} trained in full for {step} steps on the standard library "
        f"[{time.perf_counter() - t0:.0f} s]"
    )

    corpus = data.load_corpus([Path(remat_kit.__file__).parent])
    runs = {}  # (seed, quantize) -> (per-step losses, validation before, validation after)
    for seed in range(args.seeds):
        for quantize in ("int8", "nf4"):
            runs[seed, quantize] = _finetune(args, base_config, base_params, corpus, quantize, seed, t0)
    curves = {q: runs[0, q][0] for q in ("int8", "nf4")}
    vals = {q: runs[0, q][1:] for q in ("int8", "nf4")}

    print("\nstep   int8 loss   nf4 loss" + ("   (seed 0)" if args.seeds > 1 else ""))
    for i in range(0, args.steps, max(1, args.steps // 15)):
        print(f"{i + 1:4d}   {curves['int8'][i]:9.4f}  {curves['nf4'][i]:9.4f}")
    gap_train = np.mean(curves["nf4"][-20:]) - np.mean(curves["int8"][-20:])
    gap_val = vals["nf4"][1] - vals["int8"][1]
    print(
        f"\nfinal gap (nf4 - int8){' of seed 0' if args.seeds > 1 else ''}: training loss (mean of the last 20 "
        f"steps) {gap_train:+.4f}, validation loss {gap_val:+.4f} ({vals['int8'][1]:.4f} vs {vals['nf4'][1]:.4f}); "
        f"at the start (validation, before fine-tuning) {vals['nf4'][0] - vals['int8'][0]:+.4f}"
    )
    over_seeds = _seed_summary(runs, args.seeds) if args.seeds > 1 else None
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        k = max(1, args.smooth)
        for ax, quantize, color in zip(axes, ("int8", "nf4"), ("tab:blue", "tab:orange"), strict=True):
            raw = np.asarray(curves[quantize])
            smooth = np.convolve(raw, np.ones(k) / k, mode="valid")
            ax.plot(np.arange(1, len(raw) + 1), raw, color=color, alpha=0.25, lw=0.8, label="per step")
            ax.plot(np.arange(k, len(raw) + 1), smooth, color=color, lw=2, label=f"mean of {k} steps")
            other = "nf4" if quantize == "int8" else "int8"
            ax.plot(
                np.arange(k, len(raw) + 1),
                np.convolve(curves[other], np.ones(k) / k, mode="valid"),
                color="gray",
                lw=1,
                ls="--",
                label=f"{other} (mean of {k})",
            )
            before, after = vals[quantize]
            ax.set_title(f"LoRA r={args.rank} over an {quantize} base: val {before:.3f} → {after:.3f}")
            ax.set_xlabel("fine-tuning step")
            ax.grid(alpha=0.3)
            ax.legend()
        axes[0].set_ylabel("training loss (nats/byte)")
        fig.suptitle(
            f"{args.preset} preset, base trained {args.base_steps} steps in full, then LoRA on every projection, "
            f"policy {args.policy}\nfinal val gap nf4 - int8 = {gap_val:+.4f}"
            + (f" (seed 0; over {args.seeds} seeds {over_seeds})" if over_seeds else ""),
            fontsize=10,
        )
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


def _finetune(args, base_config, base_params, corpus, quantize: str, seed: int, t0: float):
    """LoRA on every projection over a ``quantize`` base: (per-step losses, validation before, after)."""
    model = dataclasses.replace(base_config.model, lora_rank=args.rank, lora_targets=lora.TARGETS, quantize=quantize)
    config = train.TrainConfig(
        model=model,
        policy=args.policy,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        learning_rate=args.lr,
        eval_every=0,
        weight_decay=0.0,
        seed=seed,
    )
    train_tokens, val_tokens = corpus.split(config.val_fraction)
    batches = data.Batches(train_tokens, config.batch_size, config.seq_len, config.seed)
    val = data.eval_windows(val_tokens, batch_size=config.batch_size, seq_len=config.seq_len, num_batches=4)
    trainer = train.Trainer(config)
    params = lora.from_base(base_params, model, jax.random.key(config.seed))  # same adapters for both bases
    state = dataclasses.replace(
        trainer.init_state(), params=params, opt_state=lora.init_optimizer(trainer.optimizer, params)
    )
    before = trainer.evaluate(state.params, val)
    losses = []
    for i in range(config.steps):
        state, out = trainer.step(state, [batches.batch(i)])
        losses.append(float(out["loss"]))
    after = trainer.evaluate(state.params, val)
    pb = lora.param_bytes(model)
    print(
        f"{quantize}{f' seed {seed}' if args.seeds > 1 else ''}: frozen base {pb.frozen / 1e6:.2f} MB; step 1 loss "
        f"{losses[0]:.4f}, last-20 mean {np.mean(losses[-20:]):.4f}; validation {before:.4f} -> {after:.4f} "
        f"[{time.perf_counter() - t0:.0f} s]",
        flush=True,
    )
    return losses, before, after


def _seed_summary(runs, seeds: int) -> str:
    """Print each seed's nf4 - int8 gaps, then their mean ± sample standard deviation and range; returns the
    validation gap's ``mean ± std`` for the plot's title."""
    print("\nper seed (nf4 - int8; same base, adapters and batches within a seed):")
    print("seed   val int8   val nf4   val gap   train gap (last 20)")
    val_gaps, train_gaps = [], []
    for seed in range(seeds):
        (int8_losses, _, int8_val), (nf4_losses, _, nf4_val) = runs[seed, "int8"], runs[seed, "nf4"]
        val_gaps.append(nf4_val - int8_val)
        train_gaps.append(np.mean(nf4_losses[-20:]) - np.mean(int8_losses[-20:]))
        print(f"{seed:4d}   {int8_val:8.4f}  {nf4_val:8.4f}  {val_gaps[-1]:+8.4f}  {train_gaps[-1]:+8.4f}")
    for what, gaps in (("validation", val_gaps), ("training (last 20)", train_gaps)):
        gaps = np.asarray(gaps)
        print(
            f"{what} gap over {seeds} seeds: mean {gaps.mean():+.4f} ± {gaps.std(ddof=1):.4f} (sample std), "
            f"range {gaps.min():+.4f} .. {gaps.max():+.4f}"
        )
    for quantize in ("int8", "nf4"):
        final = np.asarray([runs[seed, quantize][2] for seed in range(seeds)])
        print(f"{quantize} validation after, seed to seed: {final.mean():.4f} ± {final.std(ddof=1):.4f}")
    val_gaps = np.asarray(val_gaps)
    return f"{val_gaps.mean():+.4f} ± {val_gaps.std(ddof=1):.4f}"


if __name__ == "__main__":
    raise SystemExit(main())
