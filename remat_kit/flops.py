"""FLOPs of a training step: counted from the jaxpr (scan-aware) and estimated analytically.

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

import dataclasses
import math
from typing import TYPE_CHECKING

from remat_kit import _jax_internals

if TYPE_CHECKING:  # annotations only: the jaxpr counter must not import the model (inspection imports it)
    from remat_kit.model.transformer import TransformerConfig


def _dot_flops(eqn) -> int:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    rhs_free = [d for i, d in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch]
    return 2 * math.prod(lhs) * math.prod(rhs_free)


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


@dataclasses.dataclass(frozen=True)
class AnalyticFlops:
    """Textbook matmul FLOPs of one training step (forward + backward).

    Attributes:
      matmul_params: parameters that take part in matmuls (layers + output projection).
      tokens: batch · seq.
      dense: 6 · matmul_params · tokens (forward 2, backward 4).
      attention: 12 · L · b · s² · d, the scores and the weighted sum (full s², as XLA's default
        attention computes the masked half too), forward and backward.
      none: ``dense + attention``: the step with nothing recomputed.
      layer_forward: one forward pass of the layer stack, what ``full`` recomputes.
      full: ``none + layer_forward``, the most any layer-wise policy recomputes.
    """

    matmul_params: int
    tokens: int
    dense: int
    attention: int
    none: int
    layer_forward: int
    full: int


def analytic_flops(config: TransformerConfig, batch: int, seq: int) -> AnalyticFlops:
    """The analytic FLOP count of one step of ``config`` on ``[batch, seq]`` tokens.

    >>> from remat_kit.model.transformer import TransformerConfig
    >>> cfg = TransformerConfig.preset("tiny")
    >>> a = analytic_flops(cfg, 2, 32)
    >>> a.full > a.none and a.none == a.dense + a.attention
    True
    """
    d, f, hd, L = config.d_model, config.d_ff, config.head_dim, config.num_layers
    layer = d * hd * (2 * config.num_heads + 2 * config.num_kv_heads) + 3 * d * f
    matmul_params = L * layer + d * config.vocab_size
    tokens = batch * seq
    attn_fwd = 4 * batch * seq * seq * d * L
    dense = 6 * matmul_params * tokens
    none = dense + 3 * attn_fwd
    layer_forward = 2 * L * layer * tokens + attn_fwd
    return AnalyticFlops(
        matmul_params=matmul_params,
        tokens=tokens,
        dense=dense,
        attention=3 * attn_fwd,
        none=none,
        layer_forward=layer_forward,
        full=none + layer_forward,
    )
