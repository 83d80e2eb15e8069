"""Train a byte-level transformer LM on local text through remat_kit's API, then sample from it.

Runs on CPU in a few minutes with the defaults (Python's own standard library is the corpus;
nothing is downloaded). Interrupt it and run it again: it resumes from its last checkpoint.

    python examples/train_lm.py --steps 300 --policy selective --out runs/train_lm
"""

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from remat_kit import train
from remat_kit.model import Transformer, TransformerConfig
from remat_kit.train import data


def sample(config: train.TrainConfig, params, prompt: str, length: int) -> str:
    """Greedy byte-level continuation of ``prompt`` (no KV cache: fine for a tiny model)."""
    model = Transformer(config=config.model)
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t))
    window = config.seq_len
    tokens = list(data.encode(prompt)) or [ord("\n")]
    for _ in range(length):
        context = np.array(tokens[-window:], np.int32)
        padded = np.zeros(window, np.int32)
        padded[: context.size] = context  # fixed shape, so forward compiles once
        logits = forward(params, jnp.asarray(padded[None]))
        tokens.append(int(jnp.argmax(logits[0, context.size - 1])))
    return data.decode(tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--policy", default="selective", help="any remat_kit policy spec")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--loss-chunks", type=lambda s: s if s == "auto" else int(s), default="auto", help="auto, 0 (plain) or K"
    )
    parser.add_argument("--data", nargs="+", help="your own text files or folders (default: Python stdlib)")
    parser.add_argument("--out", type=Path, default=Path("runs/train_lm"))
    args = parser.parse_args(argv)

    config = train.TrainConfig(
        model=TransformerConfig.preset(args.preset),
        policy=args.policy,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        loss_chunks=args.loss_chunks,
        eval_every=max(1, args.steps // 5),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = train.train(
        config,
        data_paths=args.data,
        max_corpus_bytes=4 * 2**20,
        checkpoint_dir=args.out / "checkpoints",
        resume=True,  # continue where an earlier (interrupted) run stopped
        checkpoint_every=max(1, args.steps // 4),
        metrics_path=args.out / "metrics.jsonl",
        progress=True,
    )
    first, last = result.history[0], result.history[-1]
    print(f"policy {config.policy}: loss {first['loss']:.3f} at step 1 -> {last['loss']:.3f} at step {last['step']}")
    print(f"validation loss {last['val_loss']:.3f} nats/byte; curve in {args.out / 'metrics.png'}")
    print("sample:", repr(sample(config, result.state.params, "import ", 60)))


if __name__ == "__main__":
    main()
