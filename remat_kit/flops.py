"""Matmul FLOPs of a traced step, counted from its jaxpr with every scan body once per trip.

XLA's ``Compiled.cost_analysis()`` counts a while-loop body once, not once per trip, so for a
scanned layer stack it reports roughly one layer's FLOPs. :func:`jaxpr_flops` instead walks the
step's jaxpr, multiplies every ``scan`` body by its length, and counts matrix-multiply FLOPs
(``dot_general``: 2 · M · N · K); the elementwise work (norms, softmax, optimizer) is left out,
as in the usual 6 · params · tokens accounting.

>>> import jax, jax.numpy as jnp
>>> def f(x):
...     out, _ = jax.lax.scan(lambda c, _: (c @ jnp.ones((8, 8)), None), x, None, length=5)
...     return out
>>> jaxpr_flops(jax.make_jaxpr(f)(jnp.ones((4, 8))))
2560
"""

from __future__ import annotations

import math

from remat_kit import _jax_internals


def _dot_flops(eqn) -> int:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    rhs_free = [d for i, d in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch]
    return 2 * math.prod(lhs) * math.prod(rhs_free)


def eqn_matmul_flops(eqn) -> int:
    """FLOPs of one ``dot_general`` equation (2 · M · N · K, batch dimensions included); 0 for any other."""
    return _dot_flops(eqn) if eqn.primitive.name == "dot_general" else 0


def jaxpr_flops(jaxpr) -> int:
    """Matmul FLOPs of a (closed) jaxpr, with every ``scan`` body counted ``length`` times.

    ``cond`` counts its most expensive branch; a ``while`` loop (unknown trip count) counts its
    body once, as XLA does.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
            continue
        subs = [jaxpr_flops(sub) for sub in _jax_internals.subjaxprs(eqn)]
        if not subs:
            continue
        if name == "cond":
            total += max(subs)
        elif name == "scan":
            total += int(eqn.params["length"]) * sum(subs)
        else:
            total += sum(subs)
    return total
