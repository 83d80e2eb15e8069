"""Interleaved A/B timing of the training step: variants compiled in one process, run ABAB…, medians.

Each variant is the project's own step (:func:`remat_kit.step.update.make_step`, clipped AdamW, donated
state) with one thing changed: chunked attention's implementation (``attention.py`` as of a git
revision against the working tree's), its block size, or XLA_FLAGS. Runs alternate between the
variants so that a shared machine's load falls on all of them alike; the median of ``--repeats``
runs per variant is reported (wall time, and the process's CPU time, which a shared machine's load
disturbs less), with every run.

    PYTHONPATH=. python benchmarks/ab_step.py --what attention --before HEAD~1 --shape peer1k
    PYTHONPATH=. python benchmarks/ab_step.py --what block --shape small
    PYTHONPATH=. python benchmarks/ab_step.py --what flags --flags ";--xla_cpu_experimental_ynn_fusion_type="

``--what flags`` runs each XLA_FLAGS variant in its own worker process (flags are read once per process),
compiled once and stepped on demand, so those runs interleave too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import jax

from remat_kit.model import attention
from remat_kit.model import loss as loss_lib
from remat_kit.model.transformer import PRESET_SHAPES, Transformer, TransformerConfig
from remat_kit.step import update as step_lib

#: ``small``: the preset at its default shape; ``peer1k``: benchmarks/peer_hf.py's model (vocabulary
#: 32,000, hidden 512) at batch 1 × 1,024, where the logits are the largest tensor of the step;
#: ``peer``: the same model at peer_hf.py's own batch, 4 × 1,024 (the shape its ratios are measured at).
_PEER_MODEL = TransformerConfig(
    vocab_size=32_000, d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, d_ff=1408, max_seq_len=1024
)
SHAPES = {
    "small": (TransformerConfig.preset("small"), PRESET_SHAPES["small"]),
    "peer1k": (_PEER_MODEL, (1, 1024)),
    "peer": (_PEER_MODEL, (4, 1024)),
}


def compile_variant(cfg, shape, policy: str):
    """The compiled step and its state for ``cfg`` (traced now, so a patch around this call applies)."""
    model = Transformer(config=cfg, policy=policy)
    tokens = jax.random.randint(jax.random.key(1), shape, 0, cfg.vocab_size)
    params = jax.jit(lambda k: model.init(k, tokens[:1, :8])["params"])(jax.random.key(0))
    opt = step_lib.make_optimizer(1e-3)
    opt_state = step_lib.init_optimizer(opt, params)
    fn = step_lib.make_step(lambda p, t: loss_lib.lm_loss(model, p, t), opt)
    compiled = jax.jit(fn, **step_lib.jit_kwargs(params, opt_state)).lower(params, opt_state, tokens).compile()
    return compiled, [params, opt_state], tokens


def attention_from(revision: str):
    """``remat_kit/model/attention.py`` as of a git revision, imported as a separate module (for A/B)."""
    import importlib.util
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(
        ["git", "show", f"{revision}:remat_kit/model/attention.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "attention_before.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("attention_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_process(compiled, state, tokens):
    """A ``run()`` for a step compiled here: one step, its (wall, CPU time, loss)."""

    def run():
        start, start_cpu = time.perf_counter(), time.process_time()
        state[0], state[1], loss, _, _ = jax.block_until_ready(compiled(state[0], state[1], tokens))
        return time.perf_counter() - start, time.process_time() - start_cpu, float(loss)

    return run


def in_worker(shape: str, policy: str, xla_flags: str):
    """A ``run()`` served by a worker process started with ``XLA_FLAGS=xla_flags`` (flags are per process)."""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip())
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps([shape, policy])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"worker with XLA_FLAGS={xla_flags!r} failed to start")

    def run():
        proc.stdin.write("go\n")
        proc.stdin.flush()
        return tuple(json.loads(proc.stdout.readline()))

    run.close = lambda: (proc.stdin.close(), proc.wait())
    return run


def _worker(job: str) -> int:
    shape, policy = json.loads(job)
    cfg, batch = SHAPES[shape]
    run = in_process(*compile_variant(cfg, batch, policy))
    run()  # warm-up
    print("ready", flush=True)
    for _ in sys.stdin:
        print(json.dumps(run()), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("attention", "block", "flags"))
    parser.add_argument("--shape", choices=tuple(SHAPES), default="small")
    parser.add_argument("--policy", default="none")
    parser.add_argument("--blocks", default="64,128,256", help="block sizes for --what block")
    parser.add_argument(
        "--flags",
        default=";--xla_cpu_experimental_ynn_fusion_type=",
        help="';'-separated XLA_FLAGS variants for --what flags (the first empty: the default)",
    )
    parser.add_argument("--before", default="HEAD~1", help="git revision of attention.py for --what attention")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    if args.what is None:
        parser.error("--what is required")
    cfg, shape = SHAPES[args.shape]
    if args.what == "flags":
        runs = {f"XLA_FLAGS={f or '(default)'}": in_worker(args.shape, args.policy, f) for f in args.flags.split(";")}
    else:
        if args.what == "attention":
            variants = None
            old = attention_from(args.before)
            runs = {}
            pairs = (
                (f"attention.py of {args.before}", old.chunked_attention),
                ("attention.py now", attention.chunked_attention),
            )
            for name, impl in pairs:
                # attend() looks chunked_attention up at trace time; the old one runs on its own module's helpers.
                saved, attention.chunked_attention = attention.chunked_attention, impl
                try:
                    runs[name] = in_process(*compile_variant(cfg, shape, args.policy))
                finally:
                    attention.chunked_attention = saved
        else:
            variants = {f"block {b}": dataclasses.replace(cfg, attention_block=int(b)) for b in args.blocks.split(",")}
        if variants is not None:
            runs = {name: in_process(*compile_variant(c, shape, args.policy)) for name, c in variants.items()}
        for run in runs.values():  # one warm-up step each
            run()
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():  # interleaved: A B C A B C ...
            results[name].append(run())
    for run in runs.values():
        getattr(run, "close", lambda: None)()
    base = statistics.median(r[0] for r in next(iter(results.values())))
    base_cpu = statistics.median(r[1] for r in next(iter(results.values())))
    print(
        f"{args.what} A/B, shape {args.shape} (vocab {cfg.vocab_size}, d_model {cfg.d_model}, batch {shape}), "
        f"policy {args.policy}, {args.repeats} interleaved repeats, measured under shared load"
    )
    print("| variant | median wall | vs first | median CPU time | vs first | loss | wall runs (s) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, rs in results.items():
        med, med_cpu = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        runs_text = ", ".join(f"{r[0]:.3f}" for r in rs)
        print(
            f"| {name} | {med:.3f} s | {med / base:.3f} | {med_cpu:.3f} s | {med_cpu / base_cpu:.3f} "
            f"| {rs[0][2]:.5f} | {runs_text} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
