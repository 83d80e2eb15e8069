"""Compile-only memory of an unedited model under remat_kit.apply: plain vs applied, Python loop vs scanned.

For each layout (Linen loop, Linen scanned, NNX loop, NNX scanned; "alt scanned": the blocks alternate local and
global attention, scanned as [local, global] periods) and policy (none, selective by module path, full) it prints
JAX's saved residual bytes and the compiled gradient's peak (arguments + outputs + temp), measured by
remat_kit.compare (nothing is run). "plain" is the model without remat_kit. On CPU the loop rows show XLA's CSE
at work: fewer residuals, the same peak; the scanned rows show the real saving.

    python benchmarks/unedited.py > benchmarks/results/unedited.txt
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import remat_kit
from remat_kit.analysis.inspection import inspect
from remat_kit.units import fmt_bytes
from tests import unedited_models as um

LAYERS, WIDTH, BATCH, SEQ = 4, 64, 8, 128
POLICIES = ["none", "selective:attn/q_einsum,attn/k_einsum,mlp/gating_einsum", "full"]


def main() -> None:
    start = time.perf_counter()
    shape = f"layers={LAYERS} width={WIDTH} batch={BATCH} seq={SEQ}"
    print(f"# command: python benchmarks/unedited.py  ({shape}, jax {jax.__version__}, {jax.default_backend()})")
    x = jax.ShapeDtypeStruct((BATCH, SEQ, WIDTH), jnp.float32)
    rows = []

    linen = um.InlineModel(LAYERS, WIDTH, alternate=False)  # identical blocks
    variables = jax.eval_shape(lambda: linen.init(jax.random.key(0), jnp.zeros(x.shape)))
    rows.append(("linen loop", "plain", inspect(lambda v, x: jnp.sum(linen.apply(v, x) ** 2), variables, x)))
    alternating = um.InlineModel(LAYERS, WIDTH)  # local/global per layer: the same variables
    for layout, scan, model in (
        ("linen loop", False, linen),
        ("linen scanned", True, linen),
        ("linen alt scanned", True, alternating),
    ):
        make = remat_kit.apply_factory(model, lambda m, v, x: jnp.sum(m.apply(v, x) ** 2), scan=scan)
        rows += [
            (layout, p, r)
            for p, r in zip(POLICIES, remat_kit.compare(make, POLICIES, variables, x).reports, strict=True)
        ]

    for layout, scan, alternate in (
        ("nnx loop", False, False),
        ("nnx scanned", True, False),
        ("nnx alt scanned", True, True),
    ):
        model = um.NnxModel(LAYERS, WIDTH, alternate=alternate, rngs=nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)
        if not scan:
            graphdef, _, rest = nnx.split(model, nnx.Param, ...)
            plain = lambda p, x, g=graphdef, r=rest: jnp.sum(
                nnx.merge(g, p, jax.tree.map(lambda a: a, r))(x, True) ** 2
            )
            rows.append((layout, "plain", inspect(plain, params, x)))
        make = remat_kit.apply_factory(model, lambda m, x: jnp.sum(m(x, True) ** 2), scan=scan)
        rows += [
            (layout, p, r) for p, r in zip(POLICIES, remat_kit.compare(make, POLICIES, params, x).reports, strict=True)
        ]

    print(f"{'layout':<18} {'policy':<58} {'saved':>10} {'peak':>10}")
    for layout, policy, r in rows:
        print(f"{layout:<18} {policy:<58} {fmt_bytes(r.saved_bytes):>10} {fmt_bytes(r.peak_bytes):>10}")
    print(f"# wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
