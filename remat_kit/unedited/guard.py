"""The guard :func:`remat_kit.apply` runs on a model's first call: a policy that does nothing never passes in silence.

Wrapping the wrong modules (the embeddings instead of the blocks), a model's own ``jax.checkpoint`` around or
inside the blocks (whose policy wins where two nest), a name the policy keeps that the backward pass drops: each
leaves the model keeping what the plain model keeps, with no error. So on the first call per input signature
(traces only, nothing compiled) :func:`verify` looks at the applied forward pass and at what its backward pass
keeps, and raises a one-line ValueError when

* no block ran under remat_kit's checkpoint, or the blocks it wrapped carry none of the forward's matmul FLOPs;
* the model's own rematerialized call nests with remat_kit's inside a loop, where it cannot be seen through
  (outside loops it is seen through: remat_kit's policy replaces it, said in one warning line);
* the saved residuals equal the plain model's under a policy that should change them.

A name the policy keeps goes missing from JAX's saved residuals only where another rematerialized call nests with
remat_kit's (the model's own, whose policy wins): that is what the nesting check finds, and it is seen through
(the name is then kept) or refused. A name the backward pass never needs (a block's last matmul, added to the
residual stream) is absent from the residuals of the plain model too, and rightly so.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from remat_kit import _jax_internals
from remat_kit.policies import findings, tags

#: Per model family (the top package of the model's class), the switch that turns the model's own remat off.
OWN_REMAT_SWITCHES: dict[str, str] = {
    "transformers": "build it with gradient_checkpointing=False (HF Flax: model.disable_gradient_checkpointing())",
    "tunix": "set its config's remat_config=RematConfig.NONE",
    "MaxText": "set its config's remat_policy and scan_layers=False, or build the decoder without its checkpoint",
    "maxtext": "set its config's remat_policy and scan_layers=False, or build the decoder without its checkpoint",
    "recurrentgemma": "build it with gradient_checkpointing=False",
}


def own_switch(model_cls: type) -> str:
    """How to turn the model's own remat off, as one clause (its family's switch where known)."""
    family = (getattr(model_cls, "__module__", "") or "").split(".")[0]
    return OWN_REMAT_SWITCHES.get(family, "build the model without its own jax.checkpoint / nn.remat / nnx.remat")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found on one call signature.

    Attributes:
      see_through: the model's own rematerialized calls around the blocks must be evaluated inline at the call
        (:func:`remat_kit._jax_internals.without_foreign_remat`).
      seen_through: how many of the model's own rematerialized calls remat_kit's policy replaces.
      share: the blocks' share of the forward's matmul FLOPs (None when it has none).
      finding: what a report collected instead of an error (:mod:`remat_kit.policies.findings`); a verdict with
        one is not remembered, so every report that traces the model says it.
    """

    see_through: bool
    seen_through: int
    share: float | None
    finding: str | None = None


def _kept(residuals: Sequence[_jax_internals.RawResidual]) -> collections.Counter:
    """The activations a backward pass keeps, as a multiset of (shape, dtype, host, tag); arguments left out.

    The tag counts: keeping a named value in place of an unnamed one of the same shape is a change.
    """
    return collections.Counter((r.shape, r.dtype, r.host, r.tag) for r in residuals if not r.is_argument)


def residuals(fn: Callable, leaves: Sequence[Any]) -> list[_jax_internals.RawResidual]:
    """What the backward pass of ``sum(fn(*leaves))`` keeps (``leaves``: arrays or ShapeDtypeStructs).

    Only the floating-point leaves are differentiated (tokens, keys and masks are closed over, as traced values).
    """
    leaves = list(leaves)
    floats = [i for i, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.inexact)]
    found: list = []

    def outer(*all_leaves):
        def loss(*xs):
            full = list(all_leaves)
            for i, x in zip(floats, xs, strict=True):
                full[i] = x
            outs = [o for o in jax.tree.leaves(fn(*full)) if jnp.issubdtype(jnp.result_type(o), jnp.inexact)]
            return sum((jnp.sum(o.astype(jnp.float32)) for o in outs), jnp.float32(0))

        found.extend(_jax_internals.saved_residuals(loss, *[all_leaves[i] for i in floats]))

    jax.eval_shape(outer, *leaves)
    return found


#: plain_key -> what the plain model's backward pass keeps (:func:`_kept`), the newest few.
_PLAIN_KEPT: collections.OrderedDict = collections.OrderedDict()
_MAX_PLAIN_KEPT = 64


def _plain_kept(plain: Callable, leaves: Sequence[Any], key: Any) -> collections.Counter:
    key = tags.hashable(key)
    if key is None or key not in _PLAIN_KEPT:
        found = _kept(residuals(plain, leaves))
        if key is None:
            return found
        _PLAIN_KEPT[key] = found
        if len(_PLAIN_KEPT) > _MAX_PLAIN_KEPT:
            _PLAIN_KEPT.popitem(last=False)
    return _PLAIN_KEPT[key]


#: Inside :func:`verified_once`: plain_key -> the verdict of the first policy that rematerializes.
_ONCE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("remat_kit_guard_once", default=None)


@contextlib.contextmanager
def verified_once():
    """Within this context the guard verifies, per model and call signature, the first policy that rematerializes;
    later policies over the same blocks take its verdict instead of two more traces each, and other traces that do
    not depend on the policy (which modules a Linen call runs: :func:`session`) are shared.

    For a planner that builds many policies over one model and compiles each (``fit``): what a policy keeps then
    shows in its compiled need (so the comparison of saved residuals with the plain model's is left to those
    compiles), and the structural checks (blocks reached, the model's own remat) do not depend on the policy.
    Outside it every applied model's first call is traced and verified on its own (a Flax cache that hides blocks
    from a later call is then seen as such).
    """
    token = _ONCE.set({})
    try:
        yield
    finally:
        _ONCE.reset(token)


def session() -> dict | None:
    """The open :func:`verified_once` context's cache (None outside one): what its traces share."""
    return _ONCE.get()


def _found(verdict: Verdict, message: str) -> Verdict:
    """Report ``message`` (:func:`remat_kit.policies.findings.report`: raised, or collected by a report) and go on."""
    findings.report(message)
    return dataclasses.replace(verdict, finding=message)


def verify(
    plain: Callable,
    applied: Callable,
    leaves: Sequence[Any],
    policy: Any,
    model: str,
    blocks: str,
    switch: str,
    inside: Callable[[], int] = lambda: 0,
    plain_key: Any = None,
) -> Verdict:
    """Check that ``applied`` (the model under ``policy``) changes what the backward pass keeps (see the module doc).

    Args:
      plain, applied: the plain and the applied model's call, each a function of ``leaves`` (arrays).
      leaves: the call's array arguments, as ShapeDtypeStructs.
      policy: the policy apply was given.
      model: the model's class name; blocks: the blocks (``where=`` or the classes found), for messages.
      switch: how to turn the model's own remat off (:func:`own_switch`).
      inside: after ``applied`` was traced, how many of the model's own rematerialized calls inside the blocks
        the naming evaluated inline (:attr:`remat_kit.unedited.engine.Ledger.seen_through`).
      plain_key: a hashable name of the plain model and the call's signature: what its backward pass keeps is
        traced once per key (a model applied under several policies), not once per policy.

    Raises:
      ValueError: one line saying what did not take effect, and what to change.
    """
    once, key = _ONCE.get(), tags.hashable(plain_key)
    remats = getattr(policy, "remat", True)
    if once is not None and key is not None and remats and key in once:
        return once[key]
    # In a planner's session its compiles measure what each policy keeps: the residual comparison is theirs.
    verdict = _verify(plain, applied, leaves, policy, model, blocks, switch, inside, plain_key, compare=once is None)
    if once is not None and key is not None and remats and verdict.finding is None:
        once[key] = verdict
    return verdict


def _verify(plain, applied, leaves, policy, model, blocks, switch, inside, plain_key, *, compare: bool) -> Verdict:
    nesting = _jax_internals.remat_nesting(jax.make_jaxpr(applied)(*leaves))
    if nesting.nested_in_loops:
        return _found(
            Verdict(False, 0, None),
            f"remat_kit.apply cannot rematerialize {model}'s {blocks} under {policy}: the model's own remat (a "
            f"jax.checkpoint inside a loop) wraps or sits in them and its policy would win; {switch}",
        )
    see_through = nesting.nested > 0
    run = _jax_internals.without_foreign_remat(applied) if see_through else applied
    share = nesting.own_flops / nesting.total_flops if nesting.total_flops else None
    verdict = Verdict(see_through, nesting.nested + inside(), share)
    if verdict.seen_through:
        warnings.warn(
            f"remat_kit.apply: {model} runs {verdict.seen_through} jax.checkpoint call(s) of its own around or in its "
            f"{blocks}; {policy} replaces them",
            stacklevel=5,
        )
    if not getattr(policy, "remat", True):
        return verdict
    if not nesting.own:
        return _found(
            verdict,
            f"remat_kit.apply ran none of {model}'s {blocks} under {policy}: the call reached no block, so it would "
            "keep what the plain model keeps; pass where= the modules that run",
        )
    if share == 0:
        return _found(
            verdict,
            f"remat_kit.apply wrapped {model}'s {blocks}, which do none of the forward pass's matmuls, so {policy} "
            "would keep what the plain model keeps; pass where= the modules that carry the compute",
        )
    if not compare:
        return verdict
    kept = residuals(run, leaves)
    if _kept(kept) == _plain_kept(plain, leaves, plain_key):
        why = (
            f"the model's own remat around or in its {blocks} already keeps that; {switch} to compare"
            if nesting.nested
            else f"its {blocks} rematerialize nothing more; pass where= other blocks"
        )
        return _found(
            verdict,
            f"remat_kit.apply: under {policy} the backward pass of {model} keeps exactly what the plain model keeps "
            f"({why})",
        )
    return verdict
