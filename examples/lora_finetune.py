"""Fine-tune a saved model with LoRA adapters on an int8 base, under rematerialization.

Step 1 trains the ``small`` preset briefly on the Python standard library's sources and saves a full
checkpoint. Step 2 restores it, freezes (and int8-quantizes) the base, adds rank-R adapters and
fine-tunes only those on another local corpus, remat_kit's own sources, under a remat policy: the
loss on the new text falls while the base weights stay untouched. Nothing is downloaded.

    python examples/lora_finetune.py --base-steps 200 --steps 100 --out runs/lora
"""

import argparse
import dataclasses
from pathlib import Path

import jax
import numpy as np

import remat_kit
from remat_kit import train
from remat_kit.model import TransformerConfig, lora
from remat_kit.train import data
from remat_kit.train.checkpoint import Checkpoints


def restore_params(config: train.TrainConfig, directory: Path):
    """The parameters of the newest checkpoint in ``directory`` (a full, non-LoRA training run)."""
    abstract = jax.eval_shape(lambda: train.Trainer(config).init_state().to_dict())
    with Checkpoints(directory) as ckpts:
        step, state, _ = ckpts.restore_latest(abstract)
    return step, state["params"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--policy", default="full", help="any remat_kit policy spec")
    parser.add_argument("--base-steps", type=int, default=200, help="steps of the full (base) training")
    parser.add_argument("--steps", type=int, default=100, help="LoRA fine-tuning steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="all", help="comma-separated Block layers, or all")
    parser.add_argument("--quantize", default="int8", choices=lora.QUANTIZE_MODES)
    parser.add_argument("--lr", type=float, default=1e-2, help="adapter learning rate")
    parser.add_argument("--out", type=Path, default=Path("runs/lora_finetune"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    # 1. A full training run, saved as an ordinary checkpoint.
    base_config = train.TrainConfig(
        model=TransformerConfig.preset(args.preset),
        policy=args.policy,
        steps=args.base_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        eval_every=0,
    )
    base_dir = args.out / "base"
    train.train(base_config, max_corpus_bytes=2 * 2**20, checkpoint_dir=base_dir, resume=True)
    step, base_params = restore_params(base_config, base_dir)
    print(f"base: {args.preset} trained {step} steps on the standard library, restored from {base_dir}")

    # 2. LoRA on the frozen (int8) base, fine-tuned on remat_kit's own sources.
    model = dataclasses.replace(
        base_config.model, lora_rank=args.rank, lora_targets=lora.parse_targets(args.targets), quantize=args.quantize
    )
    config = train.TrainConfig(
        model=model,
        policy=args.policy,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        learning_rate=args.lr,
        eval_every=0,
        weight_decay=0.0,
    )
    corpus = data.load_corpus([Path(remat_kit.__file__).parent])
    train_tokens, val_tokens = corpus.split(config.val_fraction)
    batches = data.Batches(train_tokens, config.batch_size, config.seq_len, config.seed)
    val = data.eval_windows(val_tokens, batch_size=config.batch_size, seq_len=config.seq_len, num_batches=2)

    trainer = train.Trainer(config)
    params = lora.from_base(base_params, model, jax.random.key(config.seed))
    state = dataclasses.replace(
        trainer.init_state(), params=params, opt_state=lora.init_optimizer(trainer.optimizer, params)
    )
    pb = lora.param_bytes(model)
    print(
        f"LoRA rank {args.rank} on {','.join(model.lora_targets)}, base {args.quantize}: "
        f"{lora.num_trainable(model):,} trainable parameters ({pb.trainable:,} B), frozen base {pb.frozen:,} B"
    )
    frozen_before = jax.tree.map(np.asarray, lora.partition(params)[1])  # the step donates (deletes) its inputs
    before = trainer.evaluate(state.params, val)
    losses = []
    for i in range(config.steps):
        state, out = trainer.step(state, [batches.batch(i)])
        losses.append(out["loss"])
        if (i + 1) % max(1, config.steps // 5) == 0 or i == 0:
            print(f"step {i + 1:4d}  loss {out['loss']:.4f}")
    after = trainer.evaluate(state.params, val)
    frozen_after = lora.partition(state.params)[1]
    unchanged = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen_after), strict=True)
    )
    print(f"fine-tune loss {losses[0]:.4f} -> {losses[-1]:.4f}; validation {before:.4f} -> {after:.4f}")
    print(f"base weights unchanged: {unchanged}")


if __name__ == "__main__":
    main()
