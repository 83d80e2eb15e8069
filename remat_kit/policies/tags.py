"""The one tag rule, shared by every place a policy is applied.

A selective or offload policy names ``checkpoint_name`` tags. A name the wrapped code never emits
would silently turn into "recompute it" (MaxText's silent failure), so wherever a policy is applied
(a function, a Linen class, a Linen or NNX stack, an NNX instance) the wrapper traces the code once
per input signature and calls :func:`check` with the tags actually emitted (:func:`check_traced`
does both). Every wrapper remembers what passed in the one bounded cache of :func:`once`. A policy
built with ``strict=False`` skips the check; it has no other meaning.

>>> import jax, jax.numpy as jnp
>>> from remat_kit import policies
>>> from remat_kit.names import tag
>>> f = lambda x: tag(jnp.sin(x), "mlp_up")
>>> emitted = emitted_tags(f, jax.ShapeDtypeStruct((2,), jnp.float32))
>>> sorted(emitted)
['mlp_up']
>>> check(policies.selective(["mlp_upp"]), emitted, "f")
Traceback (most recent call last):
...
ValueError: policy selective:mlp_upp names tags that f never emits: mlp_upp (did you mean 'mlp_up'?); it emits: mlp_up
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import fnmatch
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from remat_kit import _jax_internals
from remat_kit import names as _names
from remat_kit.policies.policy import Mix

# Keys of checks that passed (policy, code, input signature), oldest first; bounded so long sessions
# do not grow it (the oldest is dropped: at worst it is traced once more).
_CHECKED: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
_MAX_CHECKED = 4096


def emitted_tags(fn: Callable, *args: Any) -> frozenset[str]:
    """The ``checkpoint_name`` tags ``fn(*args)`` attaches; ``args`` may be ShapeDtypeStructs.

    Traces only (``jax.make_jaxpr``): nothing is compiled or allocated.
    """
    return _jax_internals.emitted_tags(fn, *args)


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (difflib ratio ≥ 0.6), or None.

    >>> nearest("mlp_upp", ["mlp_up", "mlp_gate"])
    'mlp_up'
    """
    found = difflib.get_close_matches(name, sorted(candidates), n=1)
    return found[0] if found else None


def is_pattern(tag: str) -> bool:
    """Whether ``tag`` is a glob pattern (``"mlp/*"``, ``"attn/?_einsum"``) rather than one name."""
    return any(c in tag for c in "*?[")


def matching(tag: str, emitted: Iterable[str]) -> tuple[str, ...]:
    """The emitted names ``tag`` stands for: itself if emitted, else those its glob pattern matches.

    >>> matching("mlp/*", ["mlp/up", "attn/q", "mlp/down"])
    ('mlp/down', 'mlp/up')
    """
    emitted = frozenset(emitted)
    if tag in emitted:
        return (tag,)
    return tuple(sorted(n for n in emitted if fnmatch.fnmatchcase(n, tag))) if is_pattern(tag) else ()


def missing(policy, emitted: Iterable[str]) -> tuple[str, ...]:
    """The tags (or patterns) ``policy`` names that match nothing in ``emitted``, in the policy's order.

    A MaxText alias counts both ways (:func:`remat_kit.names.spelled`): ``q_proj`` is emitted when the
    code emits ``query_proj``, or the fused ``qkv_proj`` beside a policy naming all of q/k/v.
    """
    emitted = frozenset(emitted)
    return tuple(
        t for t in policy.tags if not matching(t, emitted) and emitted.isdisjoint(_names.spelled(t, policy.tags))
    )


def resolve(policy, emitted: Iterable[str], where: str):
    """``policy`` with each glob pattern replaced by the emitted names it matches (after :func:`check`).

    JAX's name policies match exact names, so a pattern is expanded against what the code emits before
    the policy reaches ``jax.checkpoint``. A non-strict policy drops a pattern that matches nothing.
    A name that is not a pattern stays as it is, whatever the code emits: the policy keeps it under
    every spelling (:func:`remat_kit.names.spellings`: ``q_proj`` keeps MaxText's ``query_proj``).

    >>> from remat_kit import policies
    >>> str(resolve(policies.selective(["mlp/*", "query_proj"]), ["mlp/up", "query_proj"], "Block"))
    'selective:mlp/up,q_proj'
    """
    if not any(is_pattern(t) for t in policy.tags):
        return policy
    check(policy, emitted, where)
    emitted = frozenset(emitted)

    def expand(tags_):
        return tuple(dict.fromkeys(n for t in tags_ for n in (matching(t, emitted) if is_pattern(t) else (t,))))

    offload = expand(policy.offload)
    save = tuple(n for n in expand(policy.save) if n not in offload)
    return dataclasses.replace(policy, save=save, offload=offload)


def present(policy, emitted: Iterable[str]):
    """``policy`` without the names (or patterns) that match nothing in ``emitted``: a name is a tensor where it
    exists. A model with blocks of several kinds applies one policy to each; the names one kind lacks are dropped
    there (it recomputes what it has), and :func:`check` against every kind's names says when *no* block emits one.

    >>> from remat_kit import policies
    >>> str(present(policies.parse("selective:attn,mlp"), ["rec", "mlp"]))
    'selective:mlp'
    """
    if isinstance(policy, Mix):
        return Mix(tuple((present(p, emitted), n) for p, n in policy.parts))
    gone = set(missing(policy, emitted))
    if not gone:
        return policy
    save = tuple(t for t in policy.save if t not in gone)
    offload = tuple(t for t in policy.offload if t not in gone)
    if policy.kind == "offload" and not offload:  # nothing of this block goes to the host: keep the rest here
        return dataclasses.replace(policy, kind="selective", save=save, offload=(), dst=policy.__class__.dst)
    return dataclasses.replace(policy, save=save, offload=offload)


def needs_check(policy) -> bool:
    """Whether applying ``policy`` calls for a tag check (it is strict and names tags)."""
    return bool(policy.strict and policy.tags)


def check(policy, emitted: Iterable[str], where: str) -> None:
    """Raise ValueError if ``policy`` names a tag that the code called ``where`` never emits.

    Does nothing for a policy built with ``strict=False``.

    Args:
      policy: a :class:`remat_kit.policies.Policy` (duck-typed: ``.tags``, ``.strict``).
      emitted: the tags the wrapped code attaches (see :func:`emitted_tags`).
      where: what was wrapped, for the message (``"MyBlock"``, ``"function f"``).

    Raises:
      ValueError: naming the missing tags, the nearest emitted name for each, and every emitted tag.
    """
    if not policy.strict:
        return
    emitted = frozenset(emitted)
    gone = missing(policy, emitted)
    if not gone:
        return
    described = []
    for t in gone:
        near = nearest(t, emitted)
        described.append(f"{t} (did you mean {near!r}?)" if near else t)
    raise ValueError(
        f"policy {policy} names tags that {where} never emits: {', '.join(described)}; "
        f"it emits: {', '.join(sorted(emitted)) or '(no tags)'}"
    )


def signature(tree: Any) -> Hashable | None:
    """A hashable key for the abstract value of ``tree``: structure, shapes and dtypes of its arrays,
    and the values of its other leaves (Python flags); None when a leaf is unhashable.

    >>> import jax.numpy as jnp
    >>> signature((jnp.ones((2, 3)), True)) == signature((jnp.zeros((2, 3)), True))
    True
    """
    leaves, treedef = jax.tree.flatten(tree)
    key = []
    for leaf in leaves:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):  # tracers are jax.Arrays
            key.append(("array", tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False))))
        elif hashable(leaf) is None:  # flattening drops None, so None here means unhashable
            return None
        else:
            key.append((type(leaf), leaf))
    return treedef, tuple(key)


def hashable(key: Any) -> Hashable | None:
    """``key`` itself when it can be hashed, else None (a key that cannot be remembered).

    >>> hashable(("f", 1)), hashable(("f", [1]))
    (('f', 1), None)
    """
    try:
        hash(key)
    except TypeError:
        return None
    return key


def once(key: Hashable | None, run_check: Callable[[], None]) -> None:
    """Run ``run_check()`` unless a check under ``key`` already passed; remember ``key`` once it passes.

    A check that raises is not remembered (it runs again next time); a ``key`` of None, or one that
    cannot be hashed, is never remembered: that check runs every time.

    >>> calls = []
    >>> for _ in range(3):
    ...     once(("doc", "once"), lambda: calls.append(1))
    >>> len(calls)
    1
    """
    key = hashable(key)
    if key is not None and key in _CHECKED:
        return
    run_check()
    if key is not None:
        _CHECKED[key] = None
        if len(_CHECKED) > _MAX_CHECKED:
            _CHECKED.popitem(last=False)


def check_traced(policy, where: str, fn: Callable, *args: Any, key: Hashable | None = None) -> None:
    """Trace ``fn(*args)`` (nothing compiled) and :func:`check` the tags it emits, once per input signature.

    Args:
      policy: the policy being applied.
      where: what was wrapped, for the message.
      fn: the code the policy wraps; ``args`` may be arrays, tracers or ShapeDtypeStructs.
      key: a hashable name for ``fn``'s code; with it, a second call with the same policy, key and
        input signature returns at once. Without it (or with an unhashable argument), every call traces.

    Raises:
      ValueError: see :func:`check`.
    """
    if not needs_check(policy):
        return
    sig = signature(args) if key is not None else None
    once(None if sig is None else (policy, key, sig), lambda: check(policy, emitted_tags(fn, *args), where))


def name_tree(tree: Any, name: str) -> Any:
    """``checkpoint_name`` every array leaf of ``tree`` with ``name`` (other leaves unchanged)."""
    return jax.tree.map(lambda x: checkpoint_name(x, name) if isinstance(x, jax.Array) else x, tree)


# ---- names by module path where a policy is applied: apply and the stacks alike ---------------------

#: (policy, block key, input signature) -> the resolved policy and whether the block runs with paths named.
_STACK_NAMES: collections.OrderedDict = collections.OrderedDict()
_MAX_STACK_NAMES = 1024


def resolved(policy: Any, emitted: Iterable[str], where: str) -> Any:
    """``policy`` (each part of a mix) checked (:func:`check`) and its patterns expanded (:func:`resolve`) against
    ``emitted``: the names a block emits, ``where`` naming it in messages.

    >>> from remat_kit import policies
    >>> str(resolved(policies.parse("selective:mlp/**2+full*1"), ["mlp/up", "attn"], "Block"))
    'selective:mlp/up*2+full*1'
    """
    if isinstance(policy, Mix):
        return Mix(tuple((resolved(p, emitted, where), n) for p, n in policy.parts))
    if not policy.tags:
        return policy
    check(policy, emitted, where)
    return resolve(policy, emitted, where)


def stack_policy(policy: Any, where: str, plain: Callable, named: Callable, key: Any = None) -> tuple[Any, bool]:
    """A stack's policy with its names resolved against one layer, and whether the layer must run named.

    The one naming rule wherever a policy is applied: a name the block does not emit as a tag may be a module
    path (``attn/q_einsum``), a parameter path (``mlp/gating_einsum``) or a glob over them, as with
    ``remat_kit.apply``. Only when the policy names something the plain block does not emit does the
    layer run with its submodule outputs and parameter matmuls named (a policy of the block's own tags runs
    the stack exactly as before).

    Args:
      policy: the stack's :class:`~remat_kit.policies.Policy` or :class:`~remat_kit.policies.Mix`.
      where: the block, for messages.
      plain, named: ``() -> frozenset`` of the names one layer emits, plainly / with its paths named (traced).
      key: a hashable name for the block and its input signature: the answer is remembered under it.

    Returns:
      ``(policy, named)``: patterns expanded, every part checked (a strict one raises ValueError naming the
      nearest names); ``named``: run the layer with its paths named.
    """
    parts = policy.policies if isinstance(policy, Mix) else (policy,)
    if not any(p.tags for p in parts):
        return policy, False
    cache = hashable((policy, key)) if key is not None else None
    if cache is not None and cache in _STACK_NAMES:
        return _STACK_NAMES[cache]
    emitted = plain()
    naming = any(missing(p, emitted) for p in parts)
    out = (resolved(policy, named() if naming else emitted, where), naming)
    if cache is not None:
        _STACK_NAMES[cache] = out
        if len(_STACK_NAMES) > _MAX_STACK_NAMES:
            _STACK_NAMES.popitem(last=False)
    return out
