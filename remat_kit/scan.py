"""The scan-over-layers core: N copies of one Flax block under ``lax.scan``, remat per policy.

Parameters are created stacked on axis 0 (``[num_layers, ...]``) under the name ``layers``, the
same tree for every policy, so a checkpoint trained under one policy loads under any other. The
policy only decides how the scan groups the layers (see :meth:`remat_kit.policies.Policy.plan`):

* ``"layer"`` (none, full, selective, offload, dots): one scan step per layer, each wrapped by the
  policy's ``jax.checkpoint``;
* ``"first"`` (every_n): one scan step per group of n layers whose first layer is rematerialized;
* ``"group"`` (segments, sqrt_n): one scan step per group of k layers rematerialized together, so
  only group inputs are kept (Chen et al. 2016).

A depth not divisible by the group size runs its remainder as one more (length-1) scan.

Because the layers run under a scan, XLA compiles one block whatever the depth, and the recompute
survives XLA:CPU's CSE (which strips it from unrolled code).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat_kit import _jax_internals
from remat_kit.policies import Policy, parse


class Stack(nn.Module):
    """Runs ``num_layers`` copies of ``block`` under one scan. Build it with :func:`stack`.

    Attributes:
      block: a Flax module class (or ``functools.partial`` of one) whose ``__call__(x, *args,
        **kwargs)`` returns a value shaped like ``x``.
      num_layers: the depth.
      policy: the rematerialization policy.
    """

    block: Callable[..., nn.Module]
    num_layers: int
    policy: Policy

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        """Apply the layers in order. ``args``/``kwargs`` reach every layer unchanged.

        Returns:
          The output of the last layer, shaped like ``x``.
        """
        layer = self.block(parent=None)
        num_layers = self.num_layers
        stream = "dropout"
        base_key = self.make_rng(stream) if self.has_rng(stream) else None

        def init_one(key):
            return layer.init({"params": key, stream: key}, x, *args, **kwargs)["params"]

        params = self.param("layers", lambda rng: jax.vmap(init_one)(jax.random.split(rng, num_layers)))

        def run_layer(p, h, i):
            rngs = {} if base_key is None else {stream: jax.random.fold_in(base_key, i)}
            return layer.apply({"params": p}, h, *args, rngs=rngs, **kwargs)

        if self.policy.strict and self.policy.tags:
            one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
            _check_tags(
                self.policy,
                type(layer).__name__,
                lambda p, h: run_layer(p, h, jnp.int32(0)),
                one,
                jax.ShapeDtypeStruct(x.shape, x.dtype),
            )

        plan = self.policy.plan(num_layers)
        index = jnp.arange(num_layers, dtype=jnp.int32)
        if plan.mode == "layer":
            step = self.policy.checkpoint(run_layer, prevent_cse=False)
            out, _ = jax.lax.scan(lambda h, xs: (step(xs[0], h, xs[1]), None), x, (params, index))
            return out

        # Grouped plans index the full stacked parameters inside each step instead of scanning over
        # reshaped slices: a slice taken outside a checkpoint would be saved as a residual (a copy
        # of the weights), while the stacked parameters themselves are forwarded for free.
        group = functools.partial(_run_group, self.policy, plan.mode, run_layer, params)
        full_groups, rest = divmod(num_layers, plan.size)
        starts = jnp.arange(full_groups, dtype=jnp.int32) * plan.size
        out, _ = jax.lax.scan(lambda h, start: (group(plan.size, h, start), None), x, starts)
        if rest:
            tail = jnp.full((1,), full_groups * plan.size, dtype=jnp.int32)
            out, _ = jax.lax.scan(lambda h, start: (group(rest, h, start), None), out, tail)
        return out


def _layer_at(params, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), params)


def _scan_from(run_layer, params, h, first, count):
    """Run layers ``first .. first+count-1`` plainly under an inner scan."""

    def body(c, i):
        return run_layer(_layer_at(params, i), c, i), None

    out, _ = jax.lax.scan(body, h, first + jnp.arange(count, dtype=jnp.int32))
    return out


def _run_group(policy: Policy, mode: str, run_layer, params, size: int, h, start):
    """One scan step of a grouped plan: layers ``start .. start+size-1``."""
    if mode == "group":
        whole = functools.partial(_scan_from, run_layer, count=size)
        return policy.checkpoint(lambda p, c, s: whole(p, c, s), prevent_cse=False)(params, h, start)
    # "first": rematerialize the group's first layer, keep everything of the others. JAX cannot
    # forward a slice of the stacked weights through the scan, so the non-rematerialized layers
    # keep their weight slices as residuals ((n-1)/n of the stack's weights; the analysis shows them).
    first = policy.checkpoint(lambda p, c, i: run_layer(_layer_at(p, i), c, i), prevent_cse=False)
    h = first(params, h, start)
    if size > 1:
        h = _scan_from(run_layer, params, h, start + 1, size - 1)
    return h


def _check_tags(policy: Policy, block_name: str, fn, *abstract_args) -> None:
    emitted = _jax_internals.emitted_tags(fn, *abstract_args)
    missing = [t for t in policy.tags if t not in emitted]
    if missing:
        raise ValueError(
            f"policy {policy} names tags that {block_name} never emits: {', '.join(missing)}; "
            f"it emits: {', '.join(sorted(emitted)) or '(none)'}. Tag them with "
            f"jax.ad_checkpoint.checkpoint_name, or build the policy with strict=False to skip this check"
        )


def stack(
    block: Callable[..., nn.Module], num_layers: int, policy: Policy | str | None = None, **module_kwargs: Any
) -> Stack:
    """Stack ``num_layers`` copies of a Flax block under one scan, rematerialized per ``policy``.

    Args:
      block: a Flax module class, or ``functools.partial(BlockClass, **fields)``; its ``__call__``
        takes ``(x, *args, **kwargs)`` and returns a value shaped like ``x``.
      num_layers: the depth (a positive integer).
      policy: a :class:`~remat_kit.policies.Policy` or a spec string (default ``none``).
      **module_kwargs: passed to the :class:`Stack` module (e.g. ``name=``).

    Returns:
      A :class:`Stack` module; its parameters are ``{"layers": <block params stacked on axis 0>}``.

    Raises:
      ValueError/TypeError: a bad depth, policy, or a policy that does not fit the depth.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + nn.Dense(x.shape[-1])(jnp.tanh(x))
    >>> layers = stack(Block, 6, "every_n:2")
    >>> params = layers.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> params["params"]["layers"]["Dense_0"]["kernel"].shape
    (6, 8, 8)
    """
    if not callable(block):
        raise TypeError(f"block must be a Flax module class or a partial of one, got {block!r}")
    policy = parse("none" if policy is None else policy)
    policy.validate_depth(num_layers)
    return Stack(block=block, num_layers=num_layers, policy=policy, **module_kwargs)
