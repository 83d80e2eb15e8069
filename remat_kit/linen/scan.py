"""The Linen stack: N copies of one Flax Linen block under one scan, rematerialized per policy.

Every variable collection of the block (``params``, ``batch_stats``, …) is created stacked on axis 0
(``[num_layers, ...]``) under the name ``layers``, the same tree for every policy, so a checkpoint
trained under one policy loads under any other; mutable collections are updated layer by layer.
Every RNG stream reaches every layer. The stack owns each layer's input, so it tags it ``layer_input``
(a policy may keep or offload it on a block that tags nothing). The policy only decides how the scan
groups the layers (see
:meth:`remat_kit.policies.Policy.plan`; the driver, :func:`remat_kit.policies.layers.run`, is shared with the
NNX stack):

* ``"layer"`` (none, full, selective, offload, dots): one scan step per layer, each wrapped by the
  policy's ``jax.checkpoint``;
* ``"first"`` (every_n): one scan step per group of n layers whose first layer is rematerialized;
  the others keep every activation but no slice of the stacked weights
  (:func:`remat_kit.policies.keep_activations`);
* ``"group"`` (segments, sqrt_n): one scan step per group of k layers rematerialized together, so
  only group inputs are kept (Chen et al. 2016).

A depth not divisible by the group size runs its remainder as one more (length-1) scan.

A :class:`~remat_kit.policies.Mix` runs its parts one after the other, each over its slice of the
layers as above (one scan, or one per group size, per part). The parameters stay the one ``layers``
tree: every part indexes the full stacked variables inside its (checkpointed) step, so no slice of
the weights is kept for the backward pass; a ``none`` part therefore runs under
:func:`remat_kit.policies.layers.keep_all` (every activation kept, views of the weights recomputed). The
price: each part's backward scan accumulates a gradient buffer as large as the whole stack's
weights, so a compiled step holds one more such buffer per extra part while the earlier parts run
backward (``auto`` compiles every mix it answers, so this is measured, never assumed away).

Because the layers run under a scan, XLA compiles one block whatever the depth, and the recompute
survives XLA:CPU's CSE (which strips it from unrolled code).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import subtract_filters

from remat_kit.linen.paths import apply_named
from remat_kit.policies import Mix, Policy, parse, tags
from remat_kit.policies import layers as _layers


class Stack(nn.Module):
    """Runs ``num_layers`` copies of ``block`` under one scan. Build it with :func:`stack`.

    Every variable collection of the block is stacked on axis 0 under the name ``layers``
    (``params``, ``batch_stats``, …); mutable collections are updated layer by layer and written back,
    exactly as the blocks would without remat. Every RNG stream given to ``apply`` reaches every layer,
    folded with the layer index.

    Attributes:
      block: a Flax module class (or ``functools.partial`` of one) whose ``__call__(x, *args,
        **kwargs)`` returns a value shaped like ``x``, or a pair ``(x, aux)``.
      num_layers: the depth.
      policy: the rematerialization policy.
      pack: under ``full`` with a 16-bit floating ``x``, keep the layer inputs as 16-bit integer words
        (:func:`remat_kit.policies.layers.run_packed`: same values and gradients; XLA:CPU does not widen them
        to float32). Applies to blocks returning ``x`` alone with no mutable collection; elsewhere ignored.
    """

    block: Callable[..., nn.Module]
    num_layers: int
    policy: Policy | Mix
    pack: bool = False

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        """Apply the layers in order. ``args``/``kwargs`` reach every layer unchanged (broadcast).

        Returns:
          The output of the last layer, shaped like ``x``; or ``(x, aux)`` when the block returns
          a pair, ``aux`` stacked over the layers on axis 0.
        """
        layer = self.block(parent=None)
        num_layers = self.num_layers
        # Every stream the caller gave (flax keeps them on the scope).
        streams = sorted(self.scope.rngs)
        if self.is_initializing():
            _declare(self, _init_layers(self, [layer], streams, x, args, kwargs)[0])
        variables = {col: tree["layers"] for col, tree in self.variables.items() if "layers" in tree}
        # Parameters are read-only inside a layer; every other collection the caller made mutable is
        # mutable there too (BatchNorm's batch_stats, sow'n intermediates).
        mutable = subtract_filters(self.scope.mutable, "params")
        apply = _layer_apply(self, streams, mutable, args, kwargs)

        def run_layer(v, h, i, named=False):
            y, mutated = apply(layer, v, h, i, named)
            h, aux = _split_output(y, h, type(layer).__name__)
            return h, (aux, mutated)

        make_step = lambda named: functools.partial(run_layer, named=named)
        policy, named = _names(self, type(layer).__name__, self.block, make_step, variables, x, streams, args, kwargs)
        one = _layers.one_layer(variables)
        step = functools.partial(run_layer, named=named)
        if self.pack and not mutable and not self.is_initializing() and _layers.packable(policy, x):
            extra = jax.eval_shape(lambda v, h: step(v, h, jnp.int32(0))[1], one, x)
            if not jax.tree.leaves(extra):  # no aux, nothing mutated: the block returns x alone
                return _layers.run_packed(num_layers, step, variables, x)
        out, (aux, mutated) = _layers.run(policy, num_layers, step, variables, x)
        if not self.is_initializing():  # flax's init does not update statistics either
            for col, tree in mutated.items():
                self.put_variable(col, "layers", tree)
        return out if aux is None else (out, aux)


def _declare(module: nn.Module, created: dict) -> None:
    """Declare each collection of ``created`` (stacked over the layers) as ``module``'s variable ``layers``."""
    for col, tree in created.items():
        if col == "params":
            module.param("layers", lambda _, t=tree: t)
        else:
            module.variable(col, "layers", lambda t=tree: t)


def _init_layers(module: nn.Module, layers: list[nn.Module], streams: list[str], x, args, kwargs) -> list[dict]:
    """Each position's variables for every layer of ``module`` (a stack), stacked on axis 0.

    Layer ``i`` is initialized from ``jax.random.split(make_rng("params"), num_layers)[i]``
    (:func:`remat_kit.policies.layers.init_stacked`), that key seeding every stream: "dropout" always, as
    before, so parameter values do not depend on which streams an init passes.
    """

    def init(layer):
        return lambda k: layer.init({"params": k, "dropout": k, **{s: k for s in streams}}, x, *args, **kwargs)

    return _layers.init_stacked([init(layer) for layer in layers], module.make_rng("params"), module.num_layers)


def _layer_apply(module: nn.Module, streams: list[str], mutable, args, kwargs) -> Callable:
    """``apply(layer, v, h, i, named=False) -> (y, mutated)``: layer ``i`` of ``module`` (a stack) on ``h``.

    The stack owns each layer's input, so it tags it ``layer_input``; every stream of ``module`` reaches the
    layer folded with ``i``; ``mutable`` collections come back written (``{}`` when none is). ``named``: run
    with module-path names (``attn/q_einsum``), as ``remat_kit.apply`` gives them, where the policy needs them.
    """
    keys = {s: module.make_rng(s) for s in streams}

    def apply(layer, v, h, i, named=False):
        h = _layers.tag_input(h)
        rngs = _layers.fold_keys(keys, i)
        if mutable is False:
            call = lambda v, h: (layer.apply(v, h, *args, rngs=rngs, **kwargs), {})
        else:
            call = lambda v, h: layer.apply(v, h, *args, rngs=rngs, mutable=mutable, **kwargs)
        return apply_named(call, v, h) if named else call(v, h)

    return apply


def _names(module, where: str, blocks, make_step, variables, x, streams, args, kwargs) -> tuple[Policy | Mix, bool]:
    """``module``'s policy with its names resolved against one layer (one period): ``(policy, named)``.

    Each part of a mix by its own rule (one may be ``strict=False``); remembered per block code and input
    signature (:func:`remat_kit.policies.layers.stack_names`).
    """
    one, abstract_x = _layers.one_layer(variables), jax.ShapeDtypeStruct(x.shape, x.dtype)
    key = (_block_key(blocks, streams, args, kwargs), tags.signature((one, abstract_x)))
    return _layers.stack_names(module.policy, where, make_step, one, abstract_x, key)


def _split_output(y, h, block_name: str):
    """A block's output as (next carry, aux): ``y`` shaped like ``h``, or a pair ``(like h, aux)``."""
    if _same_type(y, h):
        return y, None
    if isinstance(y, tuple) and len(y) == 2 and _same_type(y[0], h):
        return y
    raise ValueError(
        f"{block_name} returns {_describe(y)} for an input {_describe(h)}; a stacked block must return a value "
        f"with its input's shape and dtype, or a pair (x, aux) whose aux is then stacked over the layers"
    )


def _same_type(a, b) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(
        hasattr(u, "shape") and u.shape == v.shape and u.dtype == v.dtype for u, v in zip(la, lb, strict=True)
    )


def _describe(tree) -> str:
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}" if hasattr(a, "shape") else repr(a), tree))


def _block_key(block, streams, args, kwargs):
    """A hashable name for the code a stack runs (a partial's fields by value), or None."""
    if isinstance(block, functools.partial):
        block = (block.func, block.args, tuple(sorted(block.keywords.items())))
    return tags.hashable((block, tuple(streams), tags.signature((args, kwargs))))


class PeriodStack(nn.Module):
    """Runs ``num_layers`` layers that repeat a period of block types under one scan; build it with :func:`stack`.

    Gemma 3's pattern (five local sliding-window blocks, then one global) is ``blocks = (Local,) * 5 +
    (Global,)``: layer ``i`` is ``blocks[i % len(blocks)]``. The scan runs ``num_layers // len(blocks)``
    steps, each one period; the variables of position ``j`` of the period are stacked over the periods
    under ``layers/<j>`` (``{"layers": {"0": [periods, ...], "1": ...}}`` per collection). Layer ``i``
    draws its RNG streams folded with ``i``, as in :class:`Stack`.

    The policy's unit: per-layer policies (none, full, selective, offload, dots, jax) wrap each block of
    the period on its own, exactly as for one block type; grouping policies (``every_n:N``,
    ``segments:K``, ``sqrt_n``) and a mix's counts count *periods* (``every_n:2`` rematerializes every
    other period as a whole).

    Attributes:
      blocks: the block types of one period, in order (classes or partials).
      num_layers: the depth, a multiple of ``len(blocks)``.
      policy: the rematerialization policy.
    """

    blocks: tuple[Callable[..., nn.Module], ...]
    num_layers: int
    policy: Policy | Mix

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        """Apply the layers in order; ``args``/``kwargs`` reach every layer. Returns the last layer's output."""
        layers = [b(parent=None) for b in self.blocks]
        period = len(layers)
        periods = self.num_layers // period
        streams = sorted(self.scope.rngs)
        if self.is_initializing():
            created: dict[str, dict[str, Any]] = {}
            for j, made in enumerate(_init_layers(self, layers, streams, x, args, kwargs)):
                for col, tree in made.items():
                    created.setdefault(col, {})[str(j)] = tree
            _declare(self, created)
        variables = {col: tree["layers"] for col, tree in self.variables.items() if "layers" in tree}
        apply = _layer_apply(self, streams, subtract_filters(self.scope.mutable, "params"), args, kwargs)

        def one(layer, mine, h, i, named=False):
            y, mutated = apply(layer, mine, h, i, named)
            if not _same_type(y, h):
                raise ValueError(
                    f"{type(layer).__name__} returns {_describe(y)} for an input {_describe(h)}; a block of a "
                    f"period stack must return a value with its input's shape and dtype"
                )
            return y, mutated

        # Position j's variables: {col: tree["j"]}, each stacked over the periods.
        positions = tuple(
            {col: tree[str(j)] for col, tree in variables.items() if str(j) in tree} for j in range(period)
        )
        make_step = lambda named: _layers.period_step([functools.partial(one, layer, named=named) for layer in layers])
        where = "+".join(type(layer).__name__ for layer in layers)
        policy, named = _names(self, where, tuple(self.blocks), make_step, positions, x, streams, args, kwargs)
        steps = [functools.partial(one, layer, named=named) for layer in layers]
        out, mutated = _layers.run_periods(policy, periods, steps, positions, x)
        if not self.is_initializing():
            for col in {c for m in mutated for c in m}:
                self.put_variable(col, "layers", {str(j): m[col] for j, m in enumerate(mutated) if col in m})
        return out


def stack(
    block: Callable[..., nn.Module] | Sequence[Callable[..., nn.Module]],
    num_layers: int,
    policy: Policy | str | None = None,
    **module_kwargs: Any,
) -> Stack | PeriodStack:
    """Stack ``num_layers`` copies of a Flax block under one scan, rematerialized per ``policy``.

    Args:
      block: a Flax module class, or ``functools.partial(BlockClass, **fields)``; its ``__call__``
        takes ``(x, *args, **kwargs)`` and returns a value shaped like ``x``. Or a list of them: the
        period of block types the layers repeat (Gemma 3's local/global pattern), run by a
        :class:`PeriodStack` (each block then returns a value shaped like ``x``, no aux).
      num_layers: the depth (a positive integer; a multiple of the period for a list).
      policy: a :class:`~remat_kit.policies.Policy`, a :class:`~remat_kit.policies.Mix` (its counts
        summing to ``num_layers``) or a spec string (default ``none``).
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
    if isinstance(block, nn.Module):  # an instance is callable too; it would fail deep in Flax ("parent")
        raise TypeError(
            f"block: pass the class (or a factory such as functools.partial({type(block).__name__}, ...)), "
            f"not an instance: got {type(block).__name__}(...)"
        )
    policy = parse("none" if policy is None else policy)
    if isinstance(block, (list, tuple)):
        blocks = tuple(block)
        if not blocks or not all(callable(b) for b in blocks):
            raise TypeError(f"a period of blocks must be a non-empty list of Flax module classes, got {block!r}")
        names = ", ".join(getattr(b, "__name__", repr(b)) for b in blocks)
        policy.validate_depth(_layers.periods_of(num_layers, len(blocks), names))
        return PeriodStack(blocks=blocks, num_layers=num_layers, policy=policy, **module_kwargs)
    if not callable(block):
        raise TypeError(f"block must be a Flax module class or a partial of one, got {block!r}")
    policy.validate_depth(num_layers)
    return Stack(block=block, num_layers=num_layers, policy=policy, **module_kwargs)
