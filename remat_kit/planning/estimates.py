"""Textbook figures of a transformer step (FLOPs, Korthikanti's activations), to set beside the exact ones.

The compiled analysis (:mod:`remat_kit.planning.analysis`) measures; this module states what the usual
formulas predict, so ``plan`` can print both and say why they differ.
"""

from __future__ import annotations

import dataclasses

from remat_kit.model.transformer import TransformerConfig


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


@dataclasses.dataclass(frozen=True)
class Estimates:
    """The seed's analytic figures, for comparison with the exact ones (bytes).

    Attributes:
      korthikanti_per_layer: 34 · b · s · h, Korthikanti et al.'s activations per layer with 16-bit
        values, excluding the attention-score term.
      korthikanti: ``korthikanti_per_layer`` · L, "everything kept" by that formula.
      korthikanti_scores: 5 · a · s² · b · L, the attention-score term the 34 leaves out (scores,
        softmax and its dropout mask, 16-bit).
      layer_inputs: 2 · b · s · h · L, the 16-bit checkpointed layer inputs of full remat.
      logits: b · s · V · 4, the float32 logits.
    """

    korthikanti_per_layer: int
    korthikanti: int
    korthikanti_scores: int
    layer_inputs: int
    logits: int


def estimates(config: TransformerConfig, batch: int, seq: int) -> Estimates:
    """The seed's analytic figures for ``config`` at ``[batch, seq]``.

    >>> e = estimates(TransformerConfig.preset("2b"), 2, 1024)
    >>> round(e.layer_inputs / 1e9, 2), round(e.logits / 1e9, 1), round(e.korthikanti / 1e9, 1)
    (0.23, 2.0, 4.0)
    """
    b, s, h, L = batch, seq, config.d_model, config.num_layers
    per_layer = 34 * b * s * h
    return Estimates(
        korthikanti_per_layer=per_layer,
        korthikanti=per_layer * L,
        korthikanti_scores=5 * config.num_heads * s * s * b * L,
        layer_inputs=2 * b * s * h * L,
        logits=b * s * config.vocab_size * 4,
    )
