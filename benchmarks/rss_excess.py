"""Where a CPU training step's resident bytes above XLA's compiled need go: the small preset, measured.

For each policy and sequence length, a fresh process compiles the step (:func:`remat_kit.planning.analysis
.analyze_compiled`, the step ``bench`` and ``train`` run: parameters and optimizer state donated), checks that
donation took effect, and runs a few steps while a thread samples ``/proc/self/status`` every 0.5 ms: anonymous
memory (``RssAnon``: heap and mmapped buffers) and file-backed pages (``RssFile``: code, shared libraries) apart.
Printed per row: XLA's temp bytes (what the step needs beyond its donated arguments), the sampled peak of anonymous
memory above the baseline (parameters and optimizer state already live), the excess of the one over the other in
MB and per position, the file-backed growth, and the kernel's peak (VmHWM) above the baseline, which also catches
spikes shorter than a sample.

Usage::

    python benchmarks/rss_excess.py > benchmarks/results/rss_excess_small.txt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp

from remat_kit.bench.worker import _reset_peak_rss
from remat_kit.model.transformer import Transformer, TransformerConfig
from remat_kit.planning import analysis
from remat_kit.step import update as step_lib


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def _one(policy: str, batch: int, seq: int, steps: int, vocab: int | None) -> dict:
    extra = {} if vocab is None else {"vocab_size": vocab}
    cfg = TransformerConfig.preset("small", max_seq_len=max(seq, 128), **extra)
    a, compiled = analysis.analyze_compiled(cfg, policy, batch, seq)
    model = Transformer(config=cfg, policy=policy)
    key_params, key_tokens = jax.random.split(jax.random.key(0))
    tokens = jax.random.randint(key_tokens, (batch, seq), 0, cfg.vocab_size, dtype=jnp.int32)
    params = jax.jit(lambda k: model.init(k, tokens[:1])["params"])(key_params)
    opt_state = jax.jit(lambda p: step_lib.init_optimizer(analysis.optimizer(1e-3), p))(params)
    jax.block_until_ready((params, opt_state))
    time.sleep(0.1)
    _reset_peak_rss()
    base = _status()
    peak = dict(base)
    stop = False

    def sample():
        while not stop:
            for k, v in _status().items():
                peak[k] = max(peak[k], v)
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    donated = True
    for _ in range(steps):
        first = jax.tree.leaves(params)[0]
        params, opt_state, *_ = jax.block_until_ready(compiled(params, opt_state, tokens))
        donated = donated and first.is_deleted()
    time.sleep(0.05)
    stop = True
    thread.join()
    hwm = _status()["VmHWM"]
    return {
        "policy": policy,
        "seq": seq,
        "vocab": cfg.vocab_size,
        "need": a.memory.total,
        "temp": a.memory.temp,
        "donated": donated,
        "anon_over_base": peak["RssAnon"] - base["RssAnon"],
        "file_over_base": peak["RssFile"] - base["RssFile"],
        "hwm_over_base": hwm - base["VmRSS"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="full,none")
    ap.add_argument("--seqs", default="256,1280,2560")
    ap.add_argument("--vocabs", default="", help="extra rows at the longest length with these vocab sizes")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: one row as JSON
    args = ap.parse_args(argv)
    if args.one:
        policy, seq, vocab = json.loads(args.one)
        print(json.dumps(_one(policy, args.batch, seq, args.steps, vocab)))
        return 0
    seqs = [int(s) for s in args.seqs.split(",")]
    jobs = [(p, s, None) for p in args.policies.split(",") for s in seqs]
    jobs += [("none", seqs[-1], int(v)) for v in args.vocabs.split(",") if v]
    print(f"$ python benchmarks/rss_excess.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"small preset, batch {args.batch}, {args.steps} steps per row, each row a fresh process; MB = 1e6 bytes")
    head = (
        f"{'policy':7} {'seq':>6} {'vocab':>6} {'need':>8} {'temp':>8} {'anon peak':>10} {'excess':>8} "
        f"{'per pos.':>9} {'file':>6} {'VmHWM':>8} donated"
    )
    print(head + "\n" + "-" * len(head))
    rows = []
    for job in jobs:
        cmd = [sys.executable, __file__, "--one", json.dumps(job), "--batch", str(args.batch)]
        cmd += ["--steps", str(args.steps)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        rows.append(r)
        excess = r["anon_over_base"] - r["temp"]
        print(
            f"{r['policy']:7} {r['seq']:>6} {r['vocab']:>6} {r['need'] / 1e6:>8.1f} {r['temp'] / 1e6:>8.1f} "
            f"{r['anon_over_base'] / 1e6:>10.1f} {excess / 1e6:>8.1f} {excess / r['seq']:>7.0f} B "
            f"{r['file_over_base'] / 1e6:>6.1f} {r['hwm_over_base'] / 1e6:>8.1f} {r['donated']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
