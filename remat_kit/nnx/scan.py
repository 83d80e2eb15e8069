"""Flax NNX layers under one scan, rematerialized per policy: :func:`stack`.

``stack(make_block, L, policy, rngs=rngs)`` builds ``L`` blocks with ``nnx.split_rngs`` over
``nnx.vmap`` (Flax's recipe), so every variable is stacked on a leading axis of ``L`` and the values
depend on ``rngs`` only, never on the policy. The layers then run under one scan, so XLA compiles one
block whatever the depth. How the scan groups the layers follows :meth:`remat_kit.policies.Policy.plan`:

* ``"layer"`` (none, full, selective, offload, dots): ``nnx.scan`` over the layers, each under
  ``nnx.remat(policy=...)`` — Flax's own pattern. Both run with ``graph_updates=False``: the scan then
  returns only the variables a layer changed (BatchNorm statistics, RNG counts), not a second stacked
  copy of every parameter (the "scan body returns the whole nnx.state" trap).
* ``"first"`` (every_n) and ``"group"`` (segments, sqrt_n): ``nnx.scan`` slices one layer per step and
  cannot give a checkpoint the *full* stacked parameters to index, which is what keeps a group's weights
  out of the saved residuals (a slice taken outside the checkpoint is saved as a copy). These modes
  therefore ``nnx.split`` the layers into graphdef / parameters / other state and hand them to the
  driver the Linen stack runs too (:func:`remat_kit.policies.layers.run`), whose steps index the stacked state
  inside each checkpoint and ``nnx.merge`` one layer at a time. The other state a layer returns is
  stacked and written back with ``nnx.update``.

A :class:`~remat_kit.policies.Mix` runs the same way, each part over its slice of the layers under its own
policy, exactly as in :mod:`remat_kit.linen.scan` (the parameters stay one stacked tree).

Every variable type is carried (``nnx.Param``, ``nnx.BatchStat``, your own ``nnx.Variable`` subclasses,
RNG keys and counts): parameters are treated as read-only inside the forward pass, everything else is
written back after it. RNG streams held by the blocks (e.g. ``nnx.Dropout(rate, rngs=rngs)``) are split
per layer at construction, so layer ``i`` draws the same numbers under every policy.

Given a list of ``make_block`` callables, :func:`stack` builds a :class:`PeriodStack`: layers repeating
that period of block types (Gemma 3's local/global), one scan step per period.

A depth not divisible by the group size runs its remainder as one more group. ``offload`` runs in the
"layer" mode; on CPU, XLA lowers the host transfer to nothing (no memory moves there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from remat_kit.nnx import wrap as wrap_nnx
from remat_kit.nnx.paths import run_named
from remat_kit.nnx.wrap import captured_nnx_modules
from remat_kit.policies import Mix, Policy, parse
from remat_kit.policies import layers as _layers
from remat_kit.policies import tags as _tags


class Stack(nnx.Module):
    """``num_layers`` NNX blocks stacked on axis 0, run under one scan. Build it with :func:`stack`.

    Attributes:
      layers: the blocks, one module whose variables all carry a leading ``num_layers`` axis.
      num_layers: the depth.
      policy: the rematerialization policy.
      block_name: the block's class name (for messages).
    """

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], num_layers: int, policy: Policy | Mix, *, rngs):
        self.layers = _stacked(make_block, num_layers)(rngs)
        self.num_layers = num_layers
        self.policy = policy
        self.block_name = type(self.layers).__name__

    def __call__(self, x, *args, **kwargs):
        """Apply the layers in order; ``args``/``kwargs`` reach every layer unchanged.

        Arrays among ``args``/``kwargs`` are traced and broadcast to every layer; other values
        (``train=True``) are static. An ``nnx.Rngs`` among them (the NNX Gemma example's
        ``model(x, rngs=nnx.Rngs(dropout=key))``) is split per layer, as construction-time streams are:
        each of its streams is drawn once (``key = rngs[stream]()``) and layer ``i`` gets an
        ``nnx.Rngs`` holding ``jax.random.split(key, num_layers)[i]`` for it, under every policy.

        Returns:
          The last layer's output, shaped like ``x``.

        Raises:
          TypeError: an NNX object other than ``nnx.Rngs`` among ``args``/``kwargs``, or a block whose
            output is not shaped like ``x``.
          ValueError: the policy names a tag the block never emits (checked once per input signature).
        """
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=nnx.graph.is_graph_node)
        keys = _call_keys(leaves, self.num_layers, "stack's")
        dynamic = [leaf if j not in keys and not wrap_nnx.is_static(leaf) else None for j, leaf in enumerate(leaves)]
        static = [leaf if j not in keys and wrap_nnx.is_static(leaf) else None for j, leaf in enumerate(leaves)]

        def call(layer, h, dyn, layer_keys, named=False):
            merged = [d if s is None else s for d, s in zip(dyn, static, strict=True)]
            return _run_layer(layer, h, merged, treedef, layer_keys, named)

        policy, named = self._check_once(call, x, dynamic, static, _layers.layer_at(keys, jnp.int32(0)))
        call = functools.partial(call, named=named)
        if _layers.per_layer(policy, self.num_layers):
            return self._scan_layers(policy, call, x, dynamic, keys)
        return self._scan_stacked(policy, call, x, dynamic, keys)

    # ---- "layer": nnx.scan + nnx.remat -----------------------------------------------------------

    def _scan_layers(self, policy, call, x, dynamic, keys):
        step = call
        if policy.remat:
            # prevent_cse is not needed under a scan (XLA does not CSE across loop iterations).
            step = nnx.remat(call, policy=policy.jax_policy, prevent_cse=False, graph_updates=False)

        @nnx.scan(in_axes=(0, nnx.Carry, None, 0), out_axes=nnx.Carry, graph_updates=False)
        def body(layer, h, dyn, layer_keys):
            return step(layer, h, dyn, layer_keys)

        return body(self.layers, x, dynamic, keys)

    # ---- "first" / "group" / a mix: the shared driver over the split layers -------------------------

    def _scan_stacked(self, policy, call, x, dynamic, keys):
        graphdef, params, other = nnx.split(self.layers, nnx.Param, ...)

        def step(variables, h, i):
            layer = nnx.merge(graphdef, *variables)
            h = call(layer, h, dynamic, _layers.layer_at(keys, i))
            return h, nnx.split(layer, nnx.Param, ...)[2]

        h, updated = _layers.run(policy, self.num_layers, step, (params, other), x)  # updated: [L, ...]
        nnx.update(self.layers, updated)
        return h

    # ---- the tag rule and the output shape, once per input signature -----------------------------

    def _check_once(self, call, x, dynamic, static, layer_keys) -> tuple[Policy | Mix, bool]:
        """The output's shape, once per input signature; the policy's names resolved against one layer's
        (:func:`remat_kit.policies.tags.stack_policy`): ``(policy, whether the layer runs with its paths named)``."""
        graphdef, state = nnx.split(self.layers)
        one_layer = _layers.one_layer(state)
        abstract_x, abstract_dyn = wrap_nnx.abstract((x, dynamic))
        key = ("stack", graphdef, abstract_x, tuple(jax.tree.leaves(abstract_dyn)), tuple(static))
        shapes = []

        def traced(state, h, dyn, named=False):
            out = call(nnx.merge(graphdef, state), h, dyn, layer_keys, named)
            shapes.append(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), out))
            return out

        def run_check():
            expected = jax.ShapeDtypeStruct(abstract_x.shape, abstract_x.dtype)
            if not shapes:
                _tags.emitted_tags(traced, one_layer, abstract_x, abstract_dyn)
            if shapes[0] != expected:
                raise TypeError(
                    f"{self.block_name} must return one array shaped like its input ({expected.shape}, "
                    f"{expected.dtype}) to be stacked; it returns {shapes[0]}"
                )

        # The call's arrays travel with the input: (h, dyn) traced together.
        make_step = lambda named: lambda v, hd, i: traced(v, *hd, named=named)
        policy, named = _layers.stack_names(
            self.policy, self.block_name, make_step, one_layer, (abstract_x, abstract_dyn), key
        )
        _tags.once(key, run_check)
        return policy, named


class PeriodStack(nnx.Module):
    """Layers repeating a period of NNX block types (Gemma 3's local/global), under one scan over periods.

    Build it with :func:`stack` given a list of ``make_block`` callables. ``positions[j]`` holds the
    blocks of position ``j`` of the period, every variable stacked over the periods (axis 0), built as
    :class:`Stack` builds its layers. Per-layer policies wrap each block on its own; grouping policies
    and a mix's counts count periods (as :class:`remat_kit.linen.scan.PeriodStack`). Extra call arguments are
    arrays, Python values or call-time ``nnx.Rngs`` (split per layer, as :class:`Stack` splits them).
    """

    def __init__(self, makers, num_layers: int, policy: Policy | Mix, *, rngs):
        periods = num_layers // len(makers)
        self.positions = nnx.List([_stacked(make_block, periods)(rngs) for make_block in makers])
        self.num_layers = num_layers
        self.policy = policy

    def __call__(self, x, *args, **kwargs):
        """Apply the layers in order: period by period, position by position. Returns the last output.

        Extra call arguments reach every layer as :meth:`Stack.__call__` passes them: arrays traced,
        other values static, and an ``nnx.Rngs`` (the NNX Gemma example's dropout keys) split per
        layer: each stream is drawn once and layer ``l`` (period ``l // P``, position ``l % P``) gets
        ``jax.random.split(key, num_layers)[l]``, under every policy.

        Raises:
          TypeError: an NNX object other than ``nnx.Rngs`` among ``args``/``kwargs``.
          ValueError: the policy names a tag the blocks never emit.
        """
        periods = self.num_layers // len(self.positions)
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=nnx.graph.is_graph_node)
        keys = _call_keys(leaves, self.num_layers, "a period stack's")
        splits = [nnx.split(layers, nnx.Param, ...) for layers in self.positions]

        def block(graphdef, variables, h, i, named=False):
            layer = nnx.merge(graphdef, *variables)
            h = _run_layer(layer, h, leaves, treedef, _layers.layer_at(keys, i), named)
            return h, nnx.split(layer, nnx.Param, ...)[2]

        variables = tuple((p, o) for _, p, o in splits)
        make_step = lambda named: _layers.period_step([functools.partial(block, g, named=named) for g, _, _ in splits])
        names = "+".join(type(layers).__name__ for layers in self.positions)
        one = _layers.one_layer(variables)
        policy, named = _layers.stack_names(self.policy, names, make_step, one, wrap_nnx.abstract(x))
        steps = [functools.partial(block, g, named=named) for g, _, _ in splits]
        h, updated = _layers.run_periods(policy, periods, steps, variables, x)
        for layers, rest in zip(self.positions, updated, strict=True):
            nnx.update(layers, rest)
        return h


def _call_keys(leaves: list, num_layers: int, what: str) -> dict[int, dict[str, jax.Array]]:
    """Call-time RNG streams: {leaf position: {stream: [num_layers] keys}}, one key per layer; any other NNX object
    among the call's arguments is a TypeError (``what`` names the stack in it)."""
    keys = {}
    for j, leaf in enumerate(leaves):
        if isinstance(leaf, nnx.Rngs):
            keys[j] = {name: jax.random.split(stream(), num_layers) for name, stream in leaf.items()}
        elif nnx.graph.is_graph_node(leaf):
            raise TypeError(
                f"{what} extra call arguments must be arrays, Python values or nnx.Rngs, got "
                f"{type(leaf).__name__}; give the blocks their modules in make_block(rngs)"
            )
    return keys


def _run_layer(layer: nnx.Module, h, leaves: list, treedef, layer_keys: dict, named: bool):
    """``layer(h, *args, **kwargs)``: the call's extra arguments from ``leaves`` of ``(args, kwargs)``, each call-time
    ``nnx.Rngs`` among them (at ``layer_keys``' positions) made of this layer's keys.

    The stack owns the layer input: it is tagged ``layer_input``, so a policy may keep or offload it. ``named``:
    module-path names (``attn/q_einsum``), as ``remat_kit.apply`` gives them, where the policy needs them.
    """
    h = _layers.tag_input(h)
    merged = list(leaves)
    for j, streams in layer_keys.items():
        merged[j] = nnx.Rngs(**streams)
    a, kw = jax.tree.unflatten(treedef, merged)
    if named:
        return run_named(layer, lambda b, h: b(h, *a, **kw), h)
    return layer(h, *a, **kw)


def _stacked(make_block, count: int):
    """``create(rngs)``: ``count`` blocks from ``make_block``, every variable stacked on axis 0 (Flax's recipe)."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        block = make_block(rngs)
        if not isinstance(block, nnx.Module):
            raise TypeError(f"make_block(rngs) must return an nnx.Module instance, got {block!r}")
        return block

    return create


def stack(
    make_block: Callable[[nnx.Rngs], nnx.Module], num_layers: int, policy: Policy | Mix | str, *, rngs: nnx.Rngs
) -> Stack:
    """Stack ``num_layers`` NNX blocks under one scan, rematerialized per ``policy``.

    Args:
      make_block: ``make_block(rngs) -> nnx.Module``; called once under ``nnx.vmap`` with per-layer
        RNG streams. The block's ``__call__(x, *args, **kwargs)`` returns an array shaped like ``x``.
      num_layers: the depth, a positive integer.
      policy: a :class:`~remat_kit.policies.Policy`, a :class:`~remat_kit.policies.Mix` (its counts
        summing to ``num_layers``) or a spec string such as ``"every_n:2"`` or ``"full*2+none*4"``.
      rngs: the ``nnx.Rngs`` the blocks are initialized from (same values under every policy).

    Returns:
      A :class:`Stack`; ``stack.layers`` holds the blocks' variables stacked on axis 0.

    Raises:
      TypeError/ValueError: a bad ``make_block``, depth, policy or ``rngs``, before anything is traced.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> class Block(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.lin = nnx.Linear(8, 8, rngs=rngs)
    ...     def __call__(self, x):
    ...         return x + self.lin(jnp.tanh(x))
    >>> layers = stack(Block, 6, "every_n:2", rngs=nnx.Rngs(0))
    >>> layers.layers.lin.kernel.shape
    (6, 8, 8)
    >>> grads = nnx.grad(lambda m: m(jnp.ones((2, 8))).sum())(layers)
    >>> grads["layers"]["lin"]["kernel"].shape
    (6, 8, 8)
    """
    if isinstance(make_block, (list, tuple)):
        makers = tuple(make_block)
        if not makers or not all(callable(m) and not isinstance(m, nnx.Module) for m in makers):
            raise TypeError(f"a period of blocks is a non-empty list of make_block(rngs) callables, got {make_block!r}")
        return _checked(PeriodStack, makers, num_layers, _layers.periods_of(num_layers, len(makers)), policy, rngs)
    if isinstance(make_block, nnx.Module):
        name = type(make_block).__name__
        raise TypeError(
            f"make_block: pass the class (or a factory such as lambda rngs: {name}(..., rngs=rngs)), "
            f"not an instance: got {name}(...); stack builds each layer's own"
        )
    if not callable(make_block):
        raise TypeError(f"make_block must be a callable make_block(rngs) -> nnx.Module, got {make_block!r}")
    held = captured_nnx_modules(make_block)
    if held:  # one module built outside is not L layers: Flax fails deep in nnx.vmap ("different trace level")
        name = type(held[0]).__name__
        raise TypeError(
            f"make_block closes over the NNX module {name}; stack builds each layer's own inside nnx.vmap: "
            f"pass a factory that builds it, e.g. lambda rngs: {name}(..., rngs=rngs)"
        )
    return _checked(Stack, make_block, num_layers, num_layers, policy, rngs)


def _checked(cls: type, make, num_layers: int, depth: int, policy, rngs):
    """``cls(make, num_layers, policy, rngs=rngs)`` once the policy fits ``depth`` (layers, or periods) and ``rngs``
    is an ``nnx.Rngs``."""
    policy = parse(policy)
    policy.validate_depth(depth)
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs, e.g. rngs=nnx.Rngs(0), got {rngs!r}")
    return cls(make, num_layers, policy, rngs=rngs)
