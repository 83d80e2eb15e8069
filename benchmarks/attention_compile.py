"""Compile time of chunked attention (forward + backward) at two sequence lengths, and their ratio.

Chunked attention runs its causal block pairs as one ``lax.scan`` per pass, so the traced program
and XLA's compile time should not grow with the sequence (issue 13: seq 8,192 within 1.5× of 1,024).
Compile-only: nothing is allocated. Timings are wall-clock and noisy on a loaded machine; run it
on an idle one.

    PYTHONPATH=. python benchmarks/attention_compile.py [--seqs 1024 8192] [--block 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from remat_kit.model import attention


def compile_seconds(seq: int, block: int, batch: int, heads: int, kv_heads: int, head_dim: int, dtype: str) -> float:
    """Seconds to lower and compile ``grad`` of chunked attention for one shape (a fresh jit each time)."""
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.dtype(dtype))

    def loss(q, k, v):
        return jnp.sum(attention.chunked_attention(q, k, v, block=block).astype(jnp.float32))

    start = time.perf_counter()
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs=2, default=(1024, 8192), metavar=("SHORT", "LONG"))
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeat", type=int, default=3, help="compiles per length; the minimum is reported")
    args = p.parse_args(argv)
    shape = (args.block, args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype)
    best = {}
    for seq in args.seqs:
        best[seq] = min(compile_seconds(seq, *shape) for _ in range(args.repeat))
        print(f"seq {seq:>6}: {best[seq]:.2f} s to compile fwd+bwd (block {args.block}, {jax.default_backend()})")
    short, long = args.seqs
    print(f"ratio seq {long} / seq {short}: {best[long] / best[short]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
