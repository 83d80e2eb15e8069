"""The layer driver both stacks share: run stacked layers in order under a policy's plan or a mix's parts.

The Linen stack (:mod:`remat_kit.linen.scan`) and the NNX stack (:mod:`remat_kit.nnx`) hand :func:`run` the
same three things: ``step(layer_variables, h, i) -> (h, ys)`` running layer ``i``, the variables of
every layer stacked on axis 0, and the input. How the layers are grouped follows
:meth:`remat_kit.policies.Policy.plan`:

* ``"layer"``: one scan step per layer, under the policy's ``jax.checkpoint``;
* ``"first"`` (every_n): one scan step per group; its first layer is rematerialized, the others run
  under :func:`keep_all`;
* ``"group"`` (segments, sqrt_n): one scan step per group, the group rematerialized as a whole.

A depth not divisible by the group size runs its remainder as one more (length-1) scan. A
:class:`~remat_kit.policies.Mix` runs its parts one after the other, each over its slice of the layers.

Layers that repeat a *period* of block types (Gemma 3's local/global) run through :func:`run_periods`,
one scan step per period; the two period stacks and ``remat_kit.apply(..., scan=True)`` share it.

Grouped plans and mix parts index the *full* stacked variables inside each (checkpointed) step
(:func:`layer_at`) instead of scanning over slices: a slice taken outside a checkpoint is saved as a
residual (a copy of the weights), while the stacked variables themselves are forwarded for free.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from remat_kit import _jax_internals
from remat_kit import names as _names
from remat_kit.policies import Mix, Policy, keep_activations, none, tags, tiling, words
from remat_kit.units import check_int

#: ``step(layer_variables, h, i) -> (h, ys)``: one layer; ``h`` keeps its type, ``ys`` is stacked.
Step = Callable[[Any, Any, jax.Array], tuple[Any, Any]]


def tag_input(h: Any) -> Any:
    """Tag a layer's input ``layer_input`` (every array of it): a stack owns what enters each layer, so
    ``offload`` (default: the layer inputs) and a ``selective`` naming ``layer_input`` apply to a block
    that tags nothing. A block that tags its input too names the same value twice; only one is kept.

    >>> import jax, jax.numpy as jnp
    >>> from remat_kit.policies import tags
    >>> sorted(tags.emitted_tags(tag_input, jax.ShapeDtypeStruct((2,), jnp.float32)))
    ['layer_input']
    """
    return jax.tree.map(lambda a: checkpoint_name(a, _names.LAYER_INPUT), h)


def layer_at(tree: Any, i: jax.Array) -> Any:
    """Layer ``i`` of a tree stacked on axis 0 (a traced index: one compiled body serves every layer).

    >>> import jax.numpy as jnp
    >>> layer_at({"w": jnp.arange(6).reshape(3, 2)}, jnp.int32(1))["w"].tolist()
    [2, 3]
    """
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def init_stacked(inits: Sequence[Callable[[jax.Array], Any]], key: jax.Array, num_layers: int) -> list:
    """Every layer's variables, made under ``jax.vmap`` and stacked on axis 0, one stack per position of a period.

    The layers repeat ``len(inits)`` block types; layer ``i`` is position ``i % len(inits)`` and is made by
    that position's init from ``jax.random.split(key, num_layers)[i]``, so its values depend on its index
    alone (the same for one block type, ``len(inits) == 1``, and for a period).

    Args:
      inits: ``inits[j](key) -> variables`` makes one layer of position ``j``.
      key: the stack's key.
      num_layers: the depth, a multiple of ``len(inits)``.

    Returns:
      ``[position j's variables, stacked over its num_layers // len(inits) layers]``.

    >>> import jax, jax.numpy as jnp
    >>> made = init_stacked([lambda k: jax.random.uniform(k)] * 2, jax.random.key(0), 6)
    >>> [a.shape for a in made]
    [(3,), (3,)]
    >>> bool(made[1][0] == jax.random.uniform(jax.random.split(jax.random.key(0), 6)[1]))
    True
    """
    keys = jax.random.split(key, num_layers)
    return [jax.vmap(init)(keys[j :: len(inits)]) for j, init in enumerate(inits)]


def fold_keys(keys: dict[str, jax.Array], i: jax.Array) -> dict[str, jax.Array]:
    """Layer ``i``'s RNG streams: each of the stack's keys folded with the layer index.

    >>> import jax
    >>> key = jax.random.key(0)
    >>> bool(fold_keys({"dropout": key}, 3)["dropout"] == jax.random.fold_in(key, 3))
    True
    """
    return {stream: jax.random.fold_in(k, i) for stream, k in keys.items()}


def one_layer(stacked: Any) -> Any:
    """What one layer of ``stacked`` (every leaf stacked on axis 0) looks like: a tree of ``ShapeDtypeStruct``.

    >>> import jax.numpy as jnp
    >>> one_layer({"w": jnp.ones((4, 2, 3))})["w"].shape
    (2, 3)
    """
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)


def stack_names(
    policy: Policy | Mix, where: str, make_step: Callable[[bool], Step], one: Any, x: Any, key: Any = None
) -> tuple[Policy | Mix, bool]:
    """A stack's policy with its names resolved against one layer (:func:`remat_kit.policies.tags.stack_policy`).

    The layer is traced (nothing compiled) as layer 0 on abstract values, plainly and, only where the policy
    names what the plain layer does not emit, with its module paths named.

    Args:
      policy: the stack's policy.
      where: the block (or the period's blocks), for messages.
      make_step: ``make_step(named) -> step(variables, h, i)``: one layer (a period for a period stack), its
        paths named or not.
      one: one layer's variables, abstract (:func:`one_layer`); x: its input, abstract.
      key: a hashable name for the layer and its input signature (the answer is remembered under it), or None.

    Returns:
      ``(policy, named)``: as :func:`remat_kit.policies.tags.stack_policy`.

    >>> import jax, jax.numpy as jnp
    >>> from remat_kit import policies
    >>> from remat_kit.names import tag
    >>> make_step = lambda named: lambda w, h, i: (tag(h * w, "mlp/up"), None)
    >>> one = x = jax.ShapeDtypeStruct((2,), jnp.float32)
    >>> policy, named = stack_names(policies.parse("selective:mlp/*"), "Block", make_step, one, x)
    >>> str(policy), named
    ('selective:mlp/up', False)
    """

    def emitted(named: bool) -> frozenset[str]:
        return tags.emitted_tags(lambda v, h: make_step(named)(v, h, jnp.int32(0)), one, x)

    return tags.stack_policy(policy, where, lambda: emitted(False), lambda: emitted(True), key)


def per_layer(policy: Policy | Mix, depth: int) -> bool:
    """Whether ``policy`` wraps each layer on its own over ``depth`` layers (periods): a policy whose plan is
    ``"layer"`` (none, full, selective, offload, dots), not a grouping one nor a mix.

    >>> from remat_kit import policies
    >>> per_layer(policies.parse("full"), 4), per_layer(policies.parse("every_n:2"), 4)
    (True, False)
    """
    return isinstance(policy, Policy) and policy.plan(depth).mode == "layer"


def period_policies(
    policy: Policy | Mix, periods: int, emitted: Sequence[frozenset[str]], where: Sequence[str]
) -> tuple[Policy | Mix, list[Policy] | None]:
    """A period's policies with their names resolved: ``(policy, position_policies)`` for :func:`run_periods`.

    A per-layer policy wraps each block of the period on its own, so each position's names are its own
    (``position_policies[j]`` resolved against ``emitted[j]``); a grouping policy or a mix wraps whole
    periods, so its names are resolved against every position's (``position_policies`` None).

    >>> from remat_kit import policies
    >>> p, positions = period_policies(policies.parse("selective:*up"), 2, [{"a/up"}, {"b/up"}], ["A", "B"])
    >>> [str(q) for q in positions]
    ['selective:a/up', 'selective:b/up']
    >>> p, positions = period_policies(policies.parse("every_n:2"), 2, [{"a/up"}, {"b/up"}], ["A", "B"])
    >>> str(p), positions
    ('every_n:2', None)
    """
    anywhere = frozenset().union(*emitted)
    if per_layer(policy, periods):
        # A name is a tensor where it exists: checked against every position's names, kept where it is emitted.
        if policy.strict:
            tags.check(policy, anywhere, where[0] if len(set(where)) == 1 else f"any of {', '.join(where)}")
        return policy, [tags.resolved(tags.present(policy, e), e, w) for e, w in zip(emitted, where, strict=True)]
    return tags.resolved(policy, anywhere, where[0]), None


def keep_all(fn: Callable) -> Callable:
    """How a stack runs layers it does not rematerialize: activations kept, no weight copy.

    Under :func:`remat_kit.policies.keep_activations` the layers keep everything but the views and
    casts of the stacked weights. JAX's remat3 (``JAX_REMAT3=true``) asks a plain-callable policy only
    at names, matmuls and control flow and recomputes the rest, so there these layers keep their matmul
    outputs and recompute only elementwise work (no matmul FLOPs): a little less memory than classic
    ``every_n``, still no weight copy. Running them unwrapped instead would keep (n-1)/n of the stack's
    weights.

    Args:
      fn: the function running the layers (its arguments include the full stacked weights).

    Returns:
      ``fn`` under ``jax.checkpoint`` with :func:`~remat_kit.policies.keep_activations`.

    >>> import jax, jax.numpy as jnp
    >>> f = keep_all(lambda w, x: jnp.sum(jnp.sin(x * w[0])))
    >>> float(jax.grad(f, argnums=1)(jnp.ones((2, 1)), 0.0))
    1.0
    """
    return _jax_internals.own_checkpoint(fn, keep_activations, prevent_cse=False)


def run(policy: Policy | Mix, num_layers: int, step: Step, variables: Any, x: Any) -> tuple[Any, Any]:
    """Run ``num_layers`` stacked layers on ``x`` in order, rematerialized per ``policy``.

    Args:
      policy: a :class:`~remat_kit.policies.Policy` or a :class:`~remat_kit.policies.Mix` (already
        checked against the depth).
      num_layers: the depth.
      step: ``step(layer_variables, h, i) -> (h, ys)`` runs layer ``i`` (an int32 scalar) on ``h``.
      variables: every layer's variables, stacked on axis 0 (``[num_layers, ...]`` leaves).
      x: the first layer's input.

    Returns:
      ``(output of the last layer, every layer's ys stacked on axis 0)``.

    >>> import jax.numpy as jnp
    >>> from remat_kit import policies
    >>> step = lambda w, h, i: (h * w, i)
    >>> h, ys = run(policies.parse("every_n:2"), 5, step, jnp.full((5, 3), 2.0), jnp.ones(3))
    >>> h.tolist(), ys.tolist()
    ([32.0, 32.0, 32.0], [0, 1, 2, 3, 4])
    >>> h, ys = run(policies.parse("full*2+none*3"), 5, step, jnp.full((5, 3), 2.0), jnp.ones(3))
    >>> h.tolist(), ys.tolist()
    ([32.0, 32.0, 32.0], [0, 1, 2, 3, 4])
    """
    if isinstance(policy, Mix):
        out, pieces = x, []
        for part, first, count in policy.segments(num_layers):
            out, ys = _run_part(part, first, count, step, variables, out)
            pieces.append(ys)
        return out, jax.tree.map(lambda *a: jnp.concatenate(a), *pieces)
    plan = policy.plan(num_layers)
    if plan.mode == "layer":
        index = jnp.arange(num_layers, dtype=jnp.int32)
        body = policy.checkpoint(step, prevent_cse=False)
        return jax.lax.scan(lambda h, xs: body(xs[0], h, xs[1]), x, (variables, index))
    return _run_grouped(policy, plan.size, plan.mode, 0, num_layers, step, variables, x)


def _run_part(policy: Policy, first: int, count: int, step: Step, variables, x):
    """One part of a mix: layers ``first .. first+count-1`` under ``policy``; (output, ys)."""
    plan = policy.plan(count)
    if plan.mode != "layer":
        return _run_grouped(policy, plan.size, plan.mode, first, count, step, variables, x)
    # Scanning over a slice of the stacked variables would keep that slice (a copy of the part's
    # weights) for the backward pass; index the full stack inside the checkpoint instead. Without
    # remat (none) the step keeps every activation but the weight views (keep_all).
    body = lambda v, h, i: step(layer_at(v, i), h, i)
    body = policy.checkpoint(body, prevent_cse=False) if policy.remat else keep_all(body)
    return jax.lax.scan(lambda h, i: body(variables, h, i), x, first + jnp.arange(count, dtype=jnp.int32))


def _run_grouped(policy: Policy, size: int, mode: str, first: int, count: int, step: Step, variables, x):
    """Layers ``first .. first+count-1`` in groups of ``size`` (a remainder group after); (output, ys)."""
    group = functools.partial(_run_group, policy, mode, step, variables)
    full_groups, rest = divmod(count, size)
    starts = jnp.arange(full_groups, dtype=jnp.int32) * size
    if first:
        starts = starts + first
    out, ys = jax.lax.scan(lambda h, start: group(size, h, start), x, starts)  # ys: [groups, size, ...]
    ys = jax.tree.map(lambda a: a.reshape(full_groups * size, *a.shape[2:]), ys)
    if rest:
        tail = jnp.full((1,), first + full_groups * size, dtype=jnp.int32)
        out, tail_ys = jax.lax.scan(lambda h, start: group(rest, h, start), out, tail)
        ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b[0]]), ys, tail_ys)
    return out, ys


def _scan_from(step: Step, variables, h, first, count: int):
    """Run layers ``first .. first+count-1`` plainly under an inner scan; (output, per-layer ys)."""

    def body(c, i):
        return step(layer_at(variables, i), c, i)

    return jax.lax.scan(body, h, first + jnp.arange(count, dtype=jnp.int32))


def _run_group(policy: Policy, mode: str, step: Step, variables, size: int, h, start):
    """One scan step of a grouped plan: layers ``start .. start+size-1``; (output, ys [size, ...])."""
    if mode == "group":
        whole = functools.partial(_scan_from, step, count=size)
        return policy.checkpoint(lambda v, c, s: whole(v, c, s), prevent_cse=False)(variables, h, start)
    # "first": rematerialize the group's first layer, keep every activation of the others. Those run
    # under keep_all: without it JAX would keep their weight slices as residuals, (n-1)/n of the
    # stack's weights, since a scan cannot forward a slice of its input; recomputing a slice is free.
    first = policy.checkpoint(lambda v, c, i: step(layer_at(v, i), c, i), prevent_cse=False)
    h, y0 = first(variables, h, start)
    ys = jax.tree.map(lambda a: a[None], y0)
    if size > 1:
        others = keep_all(functools.partial(_scan_from, step, count=size - 1))
        h, rest = others(variables, h, start + 1)
        ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ys, rest)
    return h, ys


def periods_of(num_layers: int, period: int, blocks: str = "") -> int:
    """How many times a period of ``period`` block types repeats over ``num_layers`` layers (a period stack's depth).

    Raises:
      ValueError/TypeError: ``num_layers`` not a positive integer, or not a multiple of ``period`` (``blocks``,
        where given, names the period's blocks in the message).

    >>> periods_of(6, 2)
    3
    >>> periods_of(5, 2, "Local, Global")
    Traceback (most recent call last):
    ...
    ValueError: num_layers=5 is not a multiple of the period of 2 blocks (Local, Global); allowed: 2, 4, 6, ...
    """
    check_int("num_layers", num_layers)
    if num_layers % period:
        named = f" ({blocks})" if blocks else ""
        raise ValueError(
            f"num_layers={num_layers} is not a multiple of the period of {period} blocks{named}; allowed: "
            f"{period}, {2 * period}, {3 * period}, ..."
        )
    return num_layers // period


def period_step(steps: list[Step]) -> Step:
    """One step over a period of layers: ``steps[j](variables[j], h, i)`` runs position ``j`` as layer ``i``.

    The result takes ``(variables, h, u)`` (``variables`` a sequence, one entry per position; ``u`` the
    period) and returns ``(h, ys)``, ``ys[j]`` position ``j``'s; layer ``i`` is ``u * len(steps) + j``.

    >>> step = period_step([lambda w, h, i: (h + w, i), lambda w, h, i: (h * w, i)])
    >>> h, ys = step((1.0, 3.0), 1.0, 2)
    >>> h, ys
    (6.0, (4, 5))
    """
    size = len(steps)

    def step(variables, h, u):
        ys = []
        for j, (one, v) in enumerate(zip(steps, variables, strict=True)):
            h, y = one(v, h, u * size + j)
            ys.append(y)
        return h, tuple(ys)

    return step


def run_periods(
    policy: Policy | Mix,
    periods: int,
    steps: list[Step],
    variables: Any,
    x: Any,
    position_policies: list[Policy] | None = None,
) -> tuple[Any, tuple]:
    """Run ``periods`` repeats of a period of layers on ``x`` under one scan, rematerialized per ``policy``.

    A per-layer policy (none, full, selective, offload, dots) wraps each block of the period on its own,
    exactly as for one block type (``position_policies[j]``, where given, is position ``j``'s: the policy
    resolved against that block's names); grouping policies (every_n, segments, sqrt_n) and a mix's
    counts count *periods* (``every_n:2`` rematerializes every other period as a whole).

    Args:
      policy: the policy (checked against ``periods``).
      periods: how many times the period repeats.
      steps: ``steps[j](variables_j, h, i) -> (h, ys)``: position ``j`` of the period as layer ``i``.
      variables: one entry per position, each stacked over the periods on axis 0.
      x: the first layer's input.

    Returns:
      ``(output of the last layer, ys)``: ``ys[j]`` position ``j``'s ys stacked over the periods.

    >>> import jax.numpy as jnp
    >>> from remat_kit import policies
    >>> steps = [lambda w, h, i: (h + w, i), lambda w, h, i: (h * w, i)]
    >>> h, ys = run_periods(policies.parse("every_n:2"), 2, steps, (jnp.ones(2), jnp.full(2, 2.0)), 0.0)
    >>> float(h), ys[1].tolist()
    (6.0, [1, 3])
    """
    each = per_layer(policy, periods)
    if each:
        wrap = position_policies or [policy] * len(steps)
        steps = [p.checkpoint(one, prevent_cse=False) for p, one in zip(wrap, steps, strict=True)]
    # Per-layer policies wrap each block above; the scan over periods then adds nothing (none).
    return run(none() if each else policy, periods, period_step(steps), tuple(variables), x)


def packable(policy: Policy | Mix, x: Any) -> bool:
    """Whether :func:`run_packed` applies: ``full`` (one layer per step, keeping only its input) over one
    16-bit floating array (:func:`remat_kit.policies.words.packable`)."""
    return isinstance(policy, Policy) and policy.kind == "full" and words.packable(x)


def run_packed(num_layers: int, step: Step, variables: Any, x: jax.Array) -> jax.Array:
    """``full`` over ``num_layers`` layers, its kept layer inputs stored as 16-bit integer words.

    The same values and gradients as :func:`run` under ``full`` (each layer recomputed from its input in the
    backward pass); the difference is the dtype of the stack of kept inputs. XLA:CPU (jax 0.10) converts a
    scan's stacked bfloat16 input to float32 whole before the loop that reads it (its dynamic slices run in
    float32 there), so ``full``'s kept layer inputs cost three times their bytes at the start of the backward
    pass (the bfloat16 stack and its float32 copy); integer words are never converted. A ``jax.custom_vjp``
    over the whole scan: its forward saves ``bitcast(input, uint16)`` per layer, its backward recomputes each
    layer from the bitcast back and takes its vector-Jacobian product, only for the inputs JAX differentiates.

    Args:
      step: ``step(layer_variables, h, i) -> (h, ys)`` with ``ys`` empty (no aux, no mutated collections).
    """
    index = jnp.arange(num_layers, dtype=jnp.int32)
    layer = lambda v, h, i: step(v, h, i)[0]
    converted, consts = jax.closure_convert(layer, layer_at(variables, 0), x, index[0])
    return _packed(converted, num_layers, variables, x, *consts)


def _scan_layers(fn, num_layers, variables, x, consts, keep: bool):
    def body(h, xs):
        v, i = xs
        return fn(v, h, i, *consts), (words.pack(h) if keep else None)

    return jax.lax.scan(body, x, (variables, jnp.arange(num_layers, dtype=jnp.int32)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _packed(fn, num_layers, variables, x, *consts):
    return _scan_layers(fn, num_layers, variables, x, consts, keep=False)[0]


def _packed_fwd(fn, num_layers, variables, x, *consts):
    out, stack = _scan_layers(fn, num_layers, variables, x, consts, keep=True)
    return out, (variables, stack, tuple(consts))


def _packed_bwd(fn, num_layers, residuals, g):
    variables, stack, consts = residuals
    # Every floating input is differentiated (codes, counters and keys have no cotangent); the cotangents JAX
    # drops (a frozen base's) are dead code, removed with the work that makes them.
    floating = lambda a: jnp.issubdtype(a.dtype, jnp.inexact)
    v_leaves, v_tree = jax.tree.flatten(variables)
    v_diff = [i for i, a in enumerate(v_leaves) if floating(a)]
    c_diff = [i for i, a in enumerate(consts) if floating(a)]

    def body(carry, xs):
        gh, gc = carry
        v, packed, i = xs
        h = words.unpack(packed, g.dtype)
        leaves = jax.tree.leaves(v)

        def f(dv, dc, h):
            full_v, full_c = list(leaves), list(consts)
            for k, a in zip(v_diff, dv, strict=True):
                full_v[k] = a
            for k, a in zip(c_diff, dc, strict=True):
                full_c[k] = a
            return fn(jax.tree.unflatten(v_tree, full_v), h, i, *full_c)

        _, vjp = jax.vjp(f, [leaves[k] for k in v_diff], [consts[k] for k in c_diff], h)
        dv, dc, dh = vjp(gh)
        return (dh, [a + b for a, b in zip(gc, dc, strict=True)]), dv

    zeros = [jnp.zeros_like(consts[k]) for k in c_diff]
    xs = (variables, stack, jnp.arange(num_layers, dtype=jnp.int32))
    (dx, dcs), dvs = jax.lax.scan(body, (g, zeros), xs, reverse=True)
    out_v = [tiling.zero_cotangent(a) for a in v_leaves]
    for k, a in zip(v_diff, dvs, strict=True):
        out_v[k] = a
    out_c = [tiling.zero_cotangent(a) for a in consts]
    for k, a in zip(c_diff, dcs, strict=True):
        out_c[k] = a
    return (jax.tree.unflatten(v_tree, out_v), dx, *out_c)


_packed.defvjp(_packed_fwd, _packed_bwd)
