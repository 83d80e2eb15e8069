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

from remat_kit import _jax_internals


def eqn_matmul_flops(eqn) -> int:
    """FLOPs of one ``dot_general`` equation (2 · M · N · K, batch dimensions included); 0 for any other."""
    return _jax_internals.matmul_flops(eqn)


def jaxpr_flops(jaxpr) -> int:
    """Matmul FLOPs of a (closed) jaxpr, with every ``scan`` body counted ``length`` times.

    ``cond`` counts its most expensive branch; a ``while`` loop (unknown trip count) counts its
    body once, as XLA does.
    """
    total = 0
    for eqn in _jax_internals.eqns(jaxpr):
        if _jax_internals.dot_shapes(eqn) is not None:
            total += _jax_internals.matmul_flops(eqn)
            continue
        subs = [jaxpr_flops(sub) for sub in _jax_internals.subjaxprs(eqn)]
        if not subs:
            continue
        length = _jax_internals.scan_length(eqn)
        if _jax_internals.primitive_name(eqn) == "cond":
            total += max(subs)
        elif length is not None:
            total += length * sum(subs)
        else:
            total += sum(subs)
    return total
