"""The baseline users would otherwise write: ``nn.remat`` blocks in a Python loop (no scan).

Same embedding, block, head and policy semantics as :class:`remat_kit.model.transformer.Transformer`; only the
layer stack differs: ``num_layers`` separately traced blocks instead of one scanned block, so the
trace, the HLO and XLA's compile time grow with the depth.
"""

from __future__ import annotations

import flax.linen as nn

from remat_kit import policies
from remat_kit.model.transformer import Block, Transformer, TransformerConfig


class _Group(nn.Module):
    """``size`` consecutive blocks (the unit ``segments``/``sqrt_n`` rematerialize together)."""

    config: TransformerConfig
    size: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.size):
            x = Block(self.config, name=f"block_{i}")(x)
        return x


class UnrolledLayers(nn.Module):
    """The layer stack as a Python loop of ``policy``-wrapped blocks (or groups of blocks)."""

    config: TransformerConfig
    policy: policies.Policy

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        del deterministic  # the benchmark models have no dropout
        cfg, policy = self.config, self.policy
        plan = policy.plan(cfg.num_layers)
        if plan.mode == "layer":
            block = policy(Block)
            for i in range(cfg.num_layers):
                x = block(cfg, name=f"layer_{i}")(x)
        elif plan.mode == "first":  # every_n: layers 0, n, 2n, ... rematerialized
            for i in range(cfg.num_layers):
                block = policy(Block) if i % plan.size == 0 else Block
                x = block(cfg, name=f"layer_{i}")(x)
        else:  # segments / sqrt_n: groups rematerialized whole
            group = policy(_Group)
            start = 0
            while start < cfg.num_layers:
                size = min(plan.size, cfg.num_layers - start)
                x = group(cfg, size, name=f"group_{start}")(x)
                start += size
        return x


class UnrolledTransformer(Transformer):
    """:class:`remat_kit.model.transformer.Transformer` with :class:`UnrolledLayers` in place of the scan."""

    def make_layers(self) -> nn.Module:
        return UnrolledLayers(self.config, self.policy, name="layers")
