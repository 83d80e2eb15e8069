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


def _dot_flops(dot: _jax_internals.DotShapes) -> int:
    rhs_free = [d for i, d in enumerate(dot.rhs) if i not in dot.rhs_contracting and i not in dot.rhs_batch]
    return 2 * math.prod(dot.lhs) * math.prod(rhs_free)


def jaxpr_flops(jaxpr) -> int:
    """Matmul FLOPs of a (closed) jaxpr, with every ``scan`` body counted ``length`` times.

    ``cond`` counts its most expensive branch; a ``while`` loop (unknown trip count) counts its
    body once, as XLA does.
    """
    total = 0
    for eqn in _jax_internals.eqns(jaxpr):
        dot = _jax_internals.dot_shapes(eqn)
        if dot is not None:
            total += _dot_flops(dot)
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
