"""Rematerialization policies: small frozen, hashable values that say what a layer keeps.

One job, over 400 lines: what a policy is. The Policy value, its spec parser, the constructors,
the layer grouping the scan reads and the per-layer-range mix all read the same fields; split
apart, each would re-derive them.

A :class:`Policy` is data. The scan core (:mod:`remat_kit.linen.scan`) reads its :meth:`Policy.plan` to
decide how layers are grouped, and :meth:`Policy.checkpoint` to wrap one layer or group; applied to a
plain function, a Flax Linen module class or a Flax NNX module instance it wraps that directly
(:mod:`remat_kit.wrap`, :mod:`remat_kit.nnx.wrap`). Building a policy queries no backend and imports
no Flax: it is plain, hashable data.

>>> import jax, jax.numpy as jnp
>>> p = parse("every_n:2")
>>> str(p), p == every_n(2)
('every_n:2', True)
>>> f = full()(lambda x: jnp.sin(jnp.sin(x)))
>>> float(jax.grad(f)(0.0))
1.0
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, Literal

import jax

from remat_kit import _jax_internals
from remat_kit import names as _names
from remat_kit.units import check_int

Kind = Literal["none", "full", "every_n", "selective", "offload", "segments", "sqrt_n", "dots", "jax"]
KINDS: tuple[str, ...] = ("none", "full", "every_n", "selective", "offload", "segments", "sqrt_n", "dots", "jax")

#: The constructor of each kind, where it is not named like the kind (``jax`` is the JAX module here).
CONSTRUCTORS: dict[str, str] = {"jax": "from_jax"}

#: The ``jax.checkpoint_policies`` that :func:`from_jax` names (``jax:NAME``) and :func:`parse` rebuilds,
#: each tested for what it saves (tests/test_policies.py). An alias of one (``checkpoint_dots``) is
#: named by its first entry here. ``save_anything_except_these_names`` is refused: in jax 0.10-0.12 it
#: saves everything.
JAX_POLICIES: tuple[str, ...] = (
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
)

#: The ``jax.checkpoint_policies`` factories :func:`from_jax` names with their tags (``jax:NAME(a,b)``).
JAX_POLICY_FACTORIES: tuple[str, ...] = ("save_only_these_names",)

#: Kinds that group the layers of a stack; they have no meaning for one function or module.
GROUPING_KINDS: tuple[str, ...] = ("every_n", "segments", "sqrt_n")

#: How the scan core groups layers for a policy.
#:   ``"layer"``: one layer per scan step, each wrapped by :meth:`Policy.checkpoint`;
#:   ``"first"``: groups of ``size`` layers, only the first of each group rematerialized;
#:   ``"group"``: groups of ``size`` layers rematerialized together, only group inputs kept.
GroupMode = Literal["layer", "first", "group"]

DEFAULT_OFFLOAD_DST = "pinned_host"

#: The memory kinds ``jax.checkpoint`` really offloads residuals to. JAX's remat maps only
#: ``pinned_host`` to host memory; any other kind (``unpinned_host`` included) silently keeps the
#: residual on the device, so it is refused. Whether the backend has that memory is known only when
#: compiling (XLA:CPU accepts it and moves nothing; tests/test_policies.py checks this list against
#: the running JAX's residual analysis).
OFFLOAD_DESTINATIONS: tuple[str, ...] = ("pinned_host",)

# The default selective preset: keep the outputs of weight matmuls, recompute the attention core,
# norms and activations (Korthikanti et al. 2022, Megatron's selective recompute).
SELECTIVE_DEFAULT: tuple[str, ...] = _names.MATMUL_OUTPUTS

# A mix part ends in "*COUNT"; any other "*" is a glob pattern in a tag ("selective:mlp/*").
_MIX_COUNT = re.compile(r"\*\s*\d+\s*$")

_MAXTEXT_MINIMAL = ("q_proj", "k_proj", "v_proj", "attn_out", "mlp_gate", "mlp_up", "mlp_out")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How the scan core runs ``num_layers`` layers under a policy.

    Attributes:
      size: layers per scan step (a trailing remainder group of ``num_layers % size`` is run after).
      mode: see :data:`GroupMode`.
    """

    size: int
    mode: GroupMode


@dataclasses.dataclass(frozen=True)
class Policy:
    """One rematerialization policy. Build it with the constructors below, not directly.

    Attributes:
      kind: which policy, one of :data:`KINDS`.
      period: ``every_n`` only: layers 0, period, 2·period, … are rematerialized; 0 otherwise.
      group_size: ``segments`` only: layers rematerialized together per group; 0 otherwise.
      save: tags kept on the device (``selective``, ``offload``).
      offload: tags kept in host memory instead of recomputed (``offload``).
      dst: the memory kind offloaded tags go to, one of :data:`OFFLOAD_DESTINATIONS`.
      strict: wherever the policy is applied, check at trace time that the wrapped code emits every
        tag in :attr:`tags` (a ValueError naming the missing ones and the nearest emitted name).
        Turn it off only for one policy shared by blocks that emit different tags.
      upstream: ``jax`` only: the JAX policy's name (one of :data:`JAX_POLICIES` or
        :data:`JAX_POLICY_FACTORIES`), or an arbitrary callable's qualified name.
      names: ``jax`` only: the tags given to a factory (``save_only_these_names``); JAX's policy is
        opaque, so they are not checked against the code (they name fused and unfused spellings alike).
      fn: ``jax`` only: the callable itself when it is none of JAX's named policies (it cannot be
        rebuilt from the spec); None otherwise.
    """

    kind: Kind
    period: int = 0
    group_size: int = 0
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    dst: str = DEFAULT_OFFLOAD_DST
    strict: bool = True
    upstream: str = ""
    names: tuple[str, ...] = ()
    fn: Callable[..., Any] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown policy kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        _check_upstream(self)
        for field, owner in (("period", "every_n"), ("group_size", "segments")):
            value = getattr(self, field)
            if self.kind == owner:
                check_int(f"{owner}({field})", value)
            elif value != 0:
                raise ValueError(f"policy {self.kind!r} takes no {field}, got {field}={value!r}")
        if (self.save or self.offload) and self.kind not in ("selective", "offload"):
            raise ValueError(f"policy {self.kind!r} takes no save/offload tags")
        for field in ("save", "offload"):
            value = getattr(self, field)
            if not isinstance(value, tuple) or not all(isinstance(t, str) for t in value):
                raise TypeError(f"Policy.{field} must be a tuple of tag strings, got {value!r}")
            for t in value:
                # The spec string separates tags with "," and options with ";" and "="; a mix's parts
                # with "+" and "*" (see mix).
                # A "*" is a glob (see remat_kit.policies.tags.resolve); only a trailing "*COUNT" marks a mix part.
                if not t or t != t.strip() or any(c in t for c in ",;=+") or _MIX_COUNT.search(t):
                    raise ValueError(f"tag {t!r}: a tag is a non-empty name without spaces around it or ',;=+'")
        if not isinstance(self.strict, bool):
            raise TypeError(f"Policy.strict must be True or False, got {self.strict!r}")
        both = sorted(set(self.save) & set(self.offload))
        if both:
            raise ValueError(f"tags {both} are both saved and offloaded; a tag can be one or the other")
        if self.kind == "offload":
            if not self.offload:
                raise ValueError("offload(names=...) needs at least one tag to offload")
            _check_offload_dst(self.dst)

    # ---- identity -----------------------------------------------------------------------------

    def __str__(self) -> str:
        if self.kind == "jax":
            args = f"({','.join(self.names)})" if self.upstream in JAX_POLICY_FACTORIES else ""
            return f"jax:{self.upstream}{args}"
        if self.kind == "every_n":
            return f"every_n:{self.period}"
        if self.kind == "segments":
            return f"segments:{self.group_size}"
        opts = [] if self.strict else ["strict=false"]
        if self.kind == "selective":
            if self.save == SELECTIVE_DEFAULT and self.strict:
                return "selective"
            return "selective:" + ";".join([",".join(self.save), *opts])
        if self.kind == "offload":
            if (self.offload, self.save, self.dst, self.strict) == (
                (_names.LAYER_INPUT,),
                (),
                DEFAULT_OFFLOAD_DST,
                True,
            ):
                return "offload"
            parts = [",".join(self.offload)]
            if self.save:
                parts.append("save=" + ",".join(self.save))
            if self.dst != DEFAULT_OFFLOAD_DST:
                parts.append("dst=" + self.dst)
            return "offload:" + ";".join(parts + opts)
        return self.kind

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag the policy refers to (saved, then offloaded)."""
        return self.save + self.offload

    # ---- what JAX sees --------------------------------------------------------------------------

    @property
    def policies(self) -> tuple[Policy, ...]:
        """``(self,)``: a policy is a one-part :class:`Mix`, so ``p.policies`` walks either.

        >>> full().policies == (full(),)
        True
        """
        return (self,)

    @property
    def remat(self) -> bool:
        """Whether the policy rematerializes anything (False only for ``none``)."""
        return self.kind != "none"

    @property
    def jax_policy(self) -> Callable[..., Any]:
        """The ``jax.checkpoint`` policy for one rematerialized layer (or group) of this policy."""
        cp = jax.checkpoint_policies
        if self.kind == "jax":
            if self.fn is not None:
                return self.fn
            if self.upstream in JAX_POLICY_FACTORIES:
                return getattr(cp, self.upstream)(*self.names)
            return getattr(cp, self.upstream)
        patterns = [t for t in self.tags if any(c in t for c in "*?[")]
        if patterns:
            # JAX matches exact names: a pattern must be expanded first, or it would silently keep nothing.
            raise ValueError(
                f"policy {self} names patterns {patterns}: remat_kit.apply expands them against the names a "
                "block emits; elsewhere name the tags themselves"
            )
        if self.kind == "none":
            return cp.everything_saveable
        # Each tag under every spelling the code may emit it (MaxText's query_proj for q_proj, ...), so an
        # alias never decides what is kept, whatever strict says.
        if self.kind == "selective":
            return cp.save_only_these_names(*_names.spellings(self.save))
        if self.kind == "offload":
            return cp.save_and_offload_only_these_names(
                names_which_can_be_saved=list(_names.spellings(self.save)),
                names_which_can_be_offloaded=list(_names.spellings(self.offload)),
                offload_src="device",
                offload_dst=self.dst,
            )
        if self.kind == "dots":
            return cp.dots_with_no_batch_dims_saveable
        # full, every_n, segments, sqrt_n: the rematerialized unit keeps nothing but its inputs.
        return cp.nothing_saveable

    def checkpoint(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """Wrap a function with ``jax.checkpoint`` under :attr:`jax_policy` (identity for ``none``)."""
        if not self.remat:
            return fn
        return _jax_internals.own_checkpoint(fn, self.jax_policy, prevent_cse=prevent_cse)

    def __call__(self, target, *, static_argnums: int | tuple[int, ...] = (), methods=None, prevent_cse: bool = True):
        """Apply the policy to one function, one Flax Linen module class or one Flax NNX module instance.

        Wherever it is applied, a :attr:`strict` policy checks once per input signature, at trace
        time, that the code emits every tag it names (see :mod:`remat_kit.policies.tags`).

        Args:
          target: a callable; a ``flax.linen.Module`` subclass; or an ``flax.nnx.Module`` instance.
          static_argnums: positional arguments that are Python values (flags), not arrays. For a
            function they index its arguments (``jax.checkpoint``'s meaning); for a Linen class
            they count ``self`` as 0 (``flax.linen.remat``'s meaning: ``__call__(self, x, train)``
            takes ``static_argnums=(2,)``), and so for an NNX instance (``__call__(self, x, train)``:
            ``(2,)``). A negative index counts from the end of the positional arguments of each call
            (``-1``: the last), as Python and ``jax.checkpoint`` count (MaxText passes ``(-1, ..., -5)``).
          methods: Linen classes only: the methods to rematerialize (default ``["__call__"]``).
          prevent_cse: passed to ``jax.checkpoint``; keep True outside scans.

        Returns:
          The function under ``jax.checkpoint``, the class under ``flax.linen.remat``, or an
          ``nnx.Module`` owning the instance (``target`` itself for ``none`` on a function or class).

        Raises:
          ValueError: a grouping policy (``every_n``, ``segments``, ``sqrt_n``): it applies to a stack.
          TypeError: a target of another kind (a Linen instance, an NNX class, a non-callable).
        """
        # Imported here: a policy is data and must not need Flax to be built (Flax adds ~0.35 s to
        # `import remat_kit.policies`); remat_kit.remat is the one dispatcher, this its alias.
        from remat_kit import wrap

        return wrap.remat(target, self, static_argnums=static_argnums, methods=methods, prevent_cse=prevent_cse)

    def to_maxtext(self) -> dict[str, str]:
        """This policy as MaxText's ``remat_policy: custom`` settings (see :func:`to_maxtext`)."""
        return to_maxtext(self)

    # ---- how the scan core groups layers ----------------------------------------------------------

    def validate_depth(self, num_layers: int) -> None:
        """Raise ValueError if the policy cannot apply to a stack of ``num_layers`` layers."""
        check_int("num_layers", num_layers)
        for field in ("period", "group_size"):
            value = getattr(self, field)
            if value > num_layers:
                raise ValueError(
                    f"{self}: {field}={value} is greater than the depth ({num_layers} layers); "
                    f"allowed: 1 <= {field} <= {num_layers}"
                )

    def plan(self, num_layers: int) -> LayerPlan:
        """How the scan core groups ``num_layers`` layers under this policy."""
        self.validate_depth(num_layers)
        if self.kind == "every_n":
            return LayerPlan(self.period, "first")
        if self.kind == "segments":
            return LayerPlan(self.group_size, "group")
        if self.kind == "sqrt_n":
            return LayerPlan(sqrt_n_group_size(num_layers), "group")
        return LayerPlan(1, "layer")


#: Primitives whose outputs are views or casts: free to recompute from their inputs.
_VIEW_PRIMITIVES = frozenset(
    {
        "dynamic_slice",
        "slice",
        "squeeze",
        "reshape",
        "expand_dims",
        "broadcast_in_dim",
        "convert_element_type",
        "transpose",
        "copy",
    }
)


def keep_activations(prim, *_, **__) -> bool:
    """A ``jax.checkpoint`` policy: save every value except views and casts (recomputed for free).

    The scan core runs ``every_n``'s non-rematerialized layers under it: they keep all their
    activations, as without remat, but not the slices (and casts) of the stacked weights, which JAX
    would otherwise save as residuals because a scan cannot forward a slice of its input.
    """
    return prim.name not in _VIEW_PRIMITIVES


def sqrt_n_group_size(num_layers: int) -> int:
    """Chen et al.'s group size k ≈ √L, at least 1.

    >>> [sqrt_n_group_size(L) for L in (1, 4, 8, 28)]
    [1, 2, 3, 5]
    """
    return max(1, round(math.sqrt(num_layers)))


# ---- constructors ------------------------------------------------------------------------------------


def none() -> Policy:
    """Keep every activation; nothing is recomputed.

    >>> str(none())
    'none'
    """
    return Policy("none")


def full() -> Policy:
    """Rematerialize every layer: only each layer's input is kept.

    >>> str(full())
    'full'
    """
    return Policy("full")


def every_n(n: int) -> Policy:
    """Hugging Face's ``every_n_layers``: layers 0, n, 2n, … are rematerialized, the rest keep all.

    Args:
      n: the period, a positive integer no larger than the depth.

    >>> every_n(2).period, str(every_n(2))
    (2, 'every_n:2')
    """
    _check_count("every_n(period)", n)
    return Policy("every_n", period=n)


def selective(save=SELECTIVE_DEFAULT, *, strict: bool = True) -> Policy:
    """Named-save: every layer rematerialized except the tagged values listed in ``save``.

    The default keeps the weight-matmul outputs and recomputes attention softmax, norms and
    activations, as Megatron's selective recompute does.

    Args:
      save: tags to keep: remat_kit's (:mod:`remat_kit.names`, MaxText aliases expanded) or your own
        code's ``checkpoint_name`` tags.
      strict: check at trace time that the wrapped code emits every tag in ``save`` (see
        :attr:`Policy.strict`).

    Raises:
      ValueError: ``save`` is empty (that would be :func:`full` under another name).

    >>> str(selective(["query_proj", "key_proj"])), str(selective(["my_tag"]))
    ('selective:q_proj,k_proj', 'selective:my_tag')
    """
    tags = _names.resolve(save, "selective(save=...)")
    if not tags:
        raise ValueError(f"selective(save={save!r}) names no tag to keep; name at least one, or use full()")
    return Policy("selective", save=tags, strict=strict)


def offload(names=(_names.LAYER_INPUT,), save=(), dst: str = DEFAULT_OFFLOAD_DST, *, strict: bool = True) -> Policy:
    """Keep the tagged values ``names`` in host memory instead of recomputing them.

    The default offloads each layer's input (the checkpoints), like Hugging Face ``offload=True``.

    Args:
      names: tags copied to ``dst`` in the forward pass and back in the backward pass.
      save: tags kept on the device; everything else is recomputed.
      dst: the memory kind offloaded to, one of :data:`OFFLOAD_DESTINATIONS` (``"pinned_host"``).
        On CPU no memory moves: XLA:CPU lowers the transfer to nothing.
      strict: check at trace time that the wrapped code emits every tag named.

    >>> str(offload()), str(offload(["q_proj"], save=["mlp_up"]))
    ('offload', 'offload:q_proj;save=mlp_up')
    """
    return Policy(
        "offload",
        save=_names.resolve(save, "offload(save=...)"),
        offload=_names.resolve(names, "offload(names=...)"),
        dst=dst,
        strict=strict,
    )


def segments(k: int) -> Policy:
    """Chen et al. 2016: keep only every k-th layer boundary; recompute k layers together.

    >>> str(segments(4))
    'segments:4'
    """
    _check_count("segments(group_size)", k)
    return Policy("segments", group_size=k)


def sqrt_n() -> Policy:
    """:func:`segments` with k ≈ √L, chosen from the depth when stacked (memory O(√L)).

    >>> str(sqrt_n())
    'sqrt_n'
    """
    return Policy("sqrt_n")


def dots() -> Policy:
    """JAX's heuristic: keep matmul outputs that have no batch dimensions, recompute the rest.

    >>> str(dots())
    'dots'
    """
    return Policy("dots")


def from_jax(policy: str | Callable[..., Any], *names: str) -> Policy:
    """A JAX ``jax.checkpoint`` policy as a remat_kit policy: every layer under it, as MaxText, Levanter or
    Equinox code passes it.

    Its spec says what it is: ``jax:dots_saveable`` for one of :data:`JAX_POLICIES` (by name or as the
    object, aliases such as ``checkpoint_dots`` included), ``jax:save_only_these_names(a,b)`` for that
    factory (its names given here, or read from the policy it built), ``jax:<qualified name>`` for any
    other callable. The first two round-trip through :func:`parse`; the last cannot (a callable is not
    rebuilt from a string): parsing it is a ValueError, so pass the Policy itself (``auto``,
    ``compare``, the stacks take it; ``remat-kit`` commands take specs). JAX's policy is opaque: the tag
    rule does not check it (MaxText's lists name fused and unfused spellings alike); use
    :func:`selective` for checked names.

    Args:
      policy: a ``jax.checkpoint`` policy (a callable ``policy(prim, *args, **params) -> bool``), or the
        name of one of :data:`JAX_POLICIES` / :data:`JAX_POLICY_FACTORIES`.
      *names: the tags, with the factory's name only.

    Raises:
      ValueError: an unknown name, ``save_anything_except_these_names`` (a stub saving everything in
        jax 0.10-0.12), names with a plain policy.
      TypeError: neither a name nor a callable (or a class).

    >>> import jax
    >>> str(from_jax(jax.checkpoint_policies.checkpoint_dots)), str(from_jax("save_only_these_names", "a", "b"))
    ('jax:dots_saveable', 'jax:save_only_these_names(a,b)')
    >>> parse(str(from_jax(jax.checkpoint_policies.save_only_these_names("q", "k")))).names  # read back, sorted
    ('k', 'q')
    """
    cp = jax.checkpoint_policies
    if isinstance(policy, str):
        if policy in JAX_POLICY_FACTORIES:
            return Policy("jax", upstream=policy, names=tuple(names))
        if names:
            raise ValueError(f"jax policy {policy!r} takes no names; only {', '.join(JAX_POLICY_FACTORIES)} does")
        if policy in JAX_POLICIES or getattr(cp, policy, None) in [getattr(cp, n) for n in JAX_POLICIES]:
            return Policy("jax", upstream=_jax_name(getattr(cp, policy)))
        _refuse_stub(policy)
        raise ValueError(
            f"unknown JAX policy {policy!r}; allowed: {', '.join(JAX_POLICIES + JAX_POLICY_FACTORIES)} "
            f"(or pass the callable itself)"
        )
    if isinstance(policy, type) or not callable(policy):
        raise TypeError(f"a JAX policy is a callable policy(prim, *args, **params), got {policy!r}")
    if names:
        raise ValueError("names go with the factory's name: from_jax('save_only_these_names', 'a', 'b')")
    name = _jax_name(policy)
    if name:
        return Policy("jax", upstream=name)
    saved = _jax_internals.save_only_names(policy)
    if saved is not None:
        return Policy("jax", upstream="save_only_these_names", names=tuple(sorted(saved)))
    qualname = getattr(policy, "__qualname__", None) or type(policy).__qualname__
    _refuse_stub(qualname.split(".", 1)[0])
    return Policy("jax", upstream=qualname, fn=policy)


def _jax_name(fn) -> str:
    """The name in :data:`JAX_POLICIES` of the JAX policy object ``fn`` (aliases alike), else ""."""
    cp = jax.checkpoint_policies
    return next((n for n in JAX_POLICIES if getattr(cp, n) is fn), "")


def _refuse_stub(name: str) -> None:
    if name == "save_anything_except_these_names":
        raise ValueError(
            "jax.checkpoint_policies.save_anything_except_these_names saves everything (a stub in jax 0.10-0.12); "
            "use selective or jax:save_only_these_names(...) for the names to keep"
        )


def _check_upstream(p: Policy) -> None:
    """Policy.__post_init__'s rule for the ``jax`` kind's fields (and their absence elsewhere)."""
    if p.kind != "jax":
        if p.upstream or p.names or p.fn is not None:
            raise ValueError(f"policy {p.kind!r} takes no upstream/names/fn (those are the jax kind's)")
        return
    if not isinstance(p.upstream, str) or not p.upstream:
        raise ValueError("a jax policy needs its upstream name; build it with policies.from_jax(policy)")
    if not isinstance(p.names, tuple) or not all(isinstance(n, str) and n for n in p.names):
        raise TypeError(f"Policy.names must be a tuple of tag strings, got {p.names!r}")
    for n in p.names:
        if n != n.strip() or any(c in n for c in ",;=+*()"):
            raise ValueError(f"tag {n!r}: a tag is a non-empty name without spaces around it or ',;=+*()'")
    if p.names and p.upstream not in JAX_POLICY_FACTORIES:
        raise ValueError(f"jax policy {p.upstream!r} takes no names")
    if p.fn is None and p.upstream not in JAX_POLICIES + JAX_POLICY_FACTORIES:
        raise ValueError(f"jax policy {p.upstream!r} is not one of JAX's named policies; pass the callable (fn=)")
    if p.fn is not None and not callable(p.fn):
        raise TypeError(f"Policy.fn must be a callable JAX policy, got {p.fn!r}")
    if p.save or p.offload or p.period or p.group_size or p.dst != DEFAULT_OFFLOAD_DST or not p.strict:
        raise ValueError("a jax policy takes none of the other kinds' fields")


@dataclasses.dataclass(frozen=True)
class Mix:
    """Consecutive runs of layers under different policies: a point between two presets.

    A stack runs each part as its own scan (or the grouping its policy needs) over its slice of the
    layers, in order, so XLA still compiles one block per part. The parameters stay one tree stacked
    over all the layers, as under any policy. Build it with :func:`mix` or :func:`parse`.

    Attributes:
      parts: ``((policy, count), ...)``: the first ``count`` layers under the first policy, the next
        ones under the second, ...; at least two parts, every count >= 1, no part itself a mix.
    """

    parts: tuple[tuple[Policy, int], ...]

    def __post_init__(self):
        if not isinstance(self.parts, tuple) or len(self.parts) < 2:
            raise ValueError(f"a mix needs at least two (policy, count) parts, got {self.parts!r}")
        for part in self.parts:
            if not isinstance(part, tuple) or len(part) != 2:
                raise TypeError(f"a mix part is a (policy, count) pair, got {part!r}")
            policy, count = part
            if isinstance(policy, Mix):
                raise ValueError(f"mixes do not nest: part {policy} is itself a mix; list its parts instead")
            if not isinstance(policy, Policy):
                raise TypeError(f"a mix part's policy must be a Policy, got {policy!r}")
            check_int(f"mix count of {policy}", count)

    @property
    def kind(self) -> str:
        """Always ``"mix"`` (not one of :data:`KINDS`: a mix is made of policies of those kinds)."""
        return "mix"

    @property
    def num_layers(self) -> int:
        """The depth the mix is for: the sum of its counts."""
        return sum(count for _, count in self.parts)

    @property
    def policies(self) -> tuple[Policy, ...]:
        """The parts' policies, in order."""
        return tuple(p for p, _ in self.parts)

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag some part refers to, in order of first mention."""
        return tuple(dict.fromkeys(t for p in self.policies for t in p.tags))

    @property
    def strict(self) -> bool:
        """Whether every part checks its tags (a stack checks each part on its own)."""
        return all(p.strict for p in self.policies)

    @property
    def remat(self) -> bool:
        """Whether some part rematerializes anything."""
        return any(p.remat for p in self.policies)

    def __str__(self) -> str:
        return "+".join(f"{p}*{count}" for p, count in self.parts)

    def validate_depth(self, num_layers: int) -> None:
        """Raise ValueError unless the counts sum to ``num_layers`` and every part fits its own count."""
        check_int("num_layers", num_layers)
        if self.num_layers != num_layers:
            raise ValueError(
                f"mix {self}: the counts sum to {self.num_layers} layers but the stack has {num_layers}; "
                f"the counts must sum to the depth"
            )
        for policy, count in self.parts:
            try:
                policy.validate_depth(count)
            except ValueError as e:
                raise ValueError(f"mix {self}: part {policy}*{count} does not fit its {count} layers: {e}") from None

    def segments(self, num_layers: int) -> tuple[tuple[Policy, int, int], ...]:
        """``((policy, first layer, count), ...)`` after :meth:`validate_depth`: what a stack runs.

        >>> [(str(p), first, count) for p, first, count in mix([(full(), 2), (none(), 3)]).segments(5)]
        [('full', 0, 2), ('none', 2, 3)]
        """
        self.validate_depth(num_layers)
        out, first = [], 0
        for policy, count in self.parts:
            out.append((policy, first, count))
            first += count
        return tuple(out)

    def __call__(self, target, **_):
        raise ValueError(
            f"mix {self} runs the layers of a stack under several policies; apply it with remat_kit.stack or "
            f"the Transformer's policy, not to one function or module; for one function or module use full, "
            f"selective, offload, dots or none"
        )


def mix(parts) -> Mix:
    """Run the first layers of a stack under one policy and the rest under another (or more).

    A budget between two presets' needs fits a mix of the two: ``k`` layers under the cheaper-to-run
    policy and the rest under the leaner one trade memory for recompute about linearly in ``k``.

    Args:
      parts: ``[(policy, count), ...]``, in layer order; policies as :class:`Policy` or spec strings,
        counts positive integers summing to the depth of the stack the mix is applied to.

    Returns:
      A :class:`Mix`; its spec string is ``"POLICY*COUNT+POLICY*COUNT..."`` (see :func:`parse`).

    Raises:
      ValueError/TypeError: fewer than two parts, a count below 1, a part that is itself a mix.

    >>> m = mix([("selective", 20), (full(), 8)])
    >>> str(m), parse(str(m)) == m, m.num_layers
    ('selective*20+full*8', True, 28)
    >>> str(mix([(every_n(2), 4), ("offload:q_proj;save=mlp_up", 4)]))
    'every_n:2*4+offload:q_proj;save=mlp_up*4'
    """
    try:
        items = list(parts)
    except TypeError:
        raise TypeError(f"mix takes a list of (policy, count) pairs, got {parts!r}") from None
    out = []
    for part in items:
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise TypeError(f"a mix part is a (policy, count) pair, got {part!r}")
        policy, count = part
        if isinstance(policy, Mix) or (isinstance(policy, str) and "*" in policy):
            raise ValueError(f"mixes do not nest: part {policy} is itself a mix; list its parts instead")
        out.append((parse(policy), count))
    return Mix(tuple(out))


#: MaxText's ``remat_policy`` presets, accepted by :func:`parse`.
MAXTEXT_ALIASES: dict[str, Callable[[], Policy]] = {
    "full": full,
    "minimal": lambda: selective(_MAXTEXT_MINIMAL),
    "minimal_with_context": lambda: selective((*_MAXTEXT_MINIMAL, _names.CONTEXT)),
    "minimal_flash": lambda: selective((*_MAXTEXT_MINIMAL, _names.CONTEXT)),  # MaxText's deprecated name
    # MaxText's quantized layers also tag their quantized operands "quantization"; other code emits no such
    # value, so these keep it where it exists (strict=false, as MaxText ignores a name nothing emits).
    "minimal_with_quantization": lambda: selective((*_MAXTEXT_MINIMAL, "quantization"), strict=False),
    "minimal_with_context_and_quantization": lambda: selective(
        (*_MAXTEXT_MINIMAL, _names.CONTEXT, "quantization"), strict=False
    ),
    "save_dot_with_context_except_mlp": lambda: selective(("q_proj", "k_proj", "v_proj", _names.CONTEXT, "attn_out")),
    "save_dot_except_mlpwi": lambda: selective(("q_proj", "k_proj", "v_proj", "attn_out", "mlp_out")),
    "save_dot_except_mlp": lambda: selective(("q_proj", "k_proj", "v_proj", "attn_out")),
    "save_qkv_proj": lambda: selective(("q_proj", "k_proj", "v_proj")),
    "save_out_proj": lambda: selective(("attn_out",)),
    "qkv_proj_offloaded": lambda: offload(("q_proj", "k_proj", "v_proj")),
    "minimal_offloaded": lambda: offload(_MAXTEXT_MINIMAL),
}

#: The largest every_n period or segments size a spec may give: the scan's trip counts are int32.
MAX_COUNT = 2**31 - 1

#: The options each tag-taking kind accepts after ``;``, with the value each shows in the grammar.
#: The one table of the spec grammar: :func:`parse` reads it, and :data:`SPEC_GRAMMAR` is made from it.
SPEC_OPTIONS: dict[str, dict[str, str]] = {
    "selective": {"strict": "false"},
    "offload": {"save": "TAG,...", "dst": "KIND", "strict": "false"},
}

#: Kinds that take no argument, and those that take one integer (with its name in the grammar).
_PLAIN_KINDS = ("none", "full", "dots", "sqrt_n")
_COUNT_KINDS = {"every_n": "N", "segments": "K"}

#: The spec grammar, one line, as the errors and ``remat-kit policies`` print it.
SPEC_GRAMMAR = (
    ", ".join([*_PLAIN_KINDS, *(f"{k}:{n}" for k, n in _COUNT_KINDS.items())])
    + ", "
    + ", ".join(f"{k}[:TAG,...]" + "".join(f"[;{o}={v}]" for o, v in opts.items()) for k, opts in SPEC_OPTIONS.items())
    + ", jax:NAME, jax:save_only_these_names(TAG,...)"
    + ", or a MaxText preset ("
    + ", ".join(MAXTEXT_ALIASES)
    + "); or a mix SPEC*COUNT+SPEC*COUNT..."
)


def _check_count(what: str, value) -> None:
    """The every_n period or segments size: an integer 1 <= value <= :data:`MAX_COUNT`."""
    check_int(what, value)
    if value > MAX_COUNT:
        raise ValueError(f"{what} must be 1 <= n <= {MAX_COUNT} (and at most the depth), got {value!r}")


def parse(spec: str | Policy | Mix | Callable[..., Any], num_layers: int | None = None) -> Policy | Mix:
    """Build a policy from its spec string; the inverse of ``str(policy)``.

    A JAX policy (``jax.checkpoint_policies.dots_saveable``, ``save_only_these_names(...)``, any callable)
    becomes the ``jax`` kind (:func:`from_jax`); so do the specs ``jax:NAME`` and
    ``jax:save_only_these_names(TAG,...)``. An arbitrary callable's spec ``jax:<name>`` cannot be parsed.

    Args:
      spec: e.g. ``"full"``, ``"every_n:2"``, ``"selective:q_proj,k_proj"``, ``"offload"``,
        ``"offload:q_proj;save=mlp_up;dst=pinned_host"``, ``"selective:my_tag;strict=false"``,
        ``"segments:4"``, ``"sqrt_n"``, or a MaxText preset name such as ``"minimal"``; or a mix
        (:func:`mix`), ``"SPEC*COUNT+SPEC*COUNT..."``: parts split at ``+``, each part's count after
        its last ``*`` (tags may contain neither), e.g. ``"selective*20+full*8"`` or
        ``"every_n:2*4+offload:q_proj;save=mlp_up*4"``. A Policy or Mix is returned unchanged.
      num_layers: when given, the result is also checked against this depth
        (:meth:`Policy.validate_depth`: a mix's counts must sum to it).

    Raises:
      ValueError: an unknown or malformed spec, naming it and the allowed forms.

    >>> parse("minimal") == selective(["q_proj", "k_proj", "v_proj", "attn_out", "mlp_gate", "mlp_up", "mlp_out"])
    True
    >>> str(parse("every_n:3"))
    'every_n:3'
    >>> parse("selective*20+full*8", num_layers=28).num_layers
    28
    """
    if num_layers is not None:
        policy = parse(spec)
        policy.validate_depth(num_layers)
        return policy
    if isinstance(spec, (Policy, Mix)):
        return spec
    if callable(spec) and not isinstance(spec, type):
        return from_jax(spec)  # a jax.checkpoint policy, as MaxText, Levanter and Equinox carry them
    if not isinstance(spec, str):
        raise TypeError(f"a policy spec must be a string, a Policy or a jax.checkpoint policy, got {spec!r}")
    text = spec.strip()
    if "+" in text or _MIX_COUNT.search(text):
        return _parse_mix(spec)
    # The kind ends at the first ":" (tags follow) or ";" (options follow, the default tags kept).
    cut = min((i for i in (text.find(":"), text.find(";")) if i >= 0), default=len(text))
    kind, sep, rest = text[:cut], text[cut : cut + 1], text[cut + 1 :]
    if kind == "jax" and sep == ":":
        return _parse_jax(spec, rest.strip())
    if not sep and kind in MAXTEXT_ALIASES:
        return MAXTEXT_ALIASES[kind]()
    if kind in _PLAIN_KINDS and not sep:
        return {"none": none, "dots": dots, "sqrt_n": sqrt_n, "full": full}[kind]()
    if kind in _COUNT_KINDS and sep == ":":
        try:
            n = int(rest)
        except ValueError:
            raise ValueError(f"policy spec {spec!r}: {kind} needs an integer, e.g. {kind}:2") from None
        if not 1 <= n <= MAX_COUNT:
            raise ValueError(
                f"policy spec {spec!r}: {kind}:{_COUNT_KINDS[kind]} must be 1 <= {_COUNT_KINDS[kind]} "
                f"<= {MAX_COUNT} (and at most the depth), got {n}"
            )
        return every_n(n) if kind == "every_n" else segments(n)
    if kind in SPEC_OPTIONS:
        if sep == ":" and not rest.split(";")[0].strip():
            raise ValueError(f"policy spec {spec!r}: no tag after ':'; name one (e.g. {kind}:q_proj), or drop the ':'")
        positional, opts = _split_options(spec, rest if sep == ":" else sep + rest, allowed=tuple(SPEC_OPTIONS[kind]))
        strict = opts.get("strict", "true") != "false"
        if kind == "selective":
            return selective(positional or SELECTIVE_DEFAULT, strict=strict)
        return offload(
            positional or (_names.LAYER_INPUT,),
            save=_tag_list(spec, opts["save"], empty_ok=False) if "save" in opts else (),
            dst=opts.get("dst", DEFAULT_OFFLOAD_DST),
            strict=strict,
        )
    raise ValueError(f"unknown policy spec {spec!r}; allowed: {SPEC_GRAMMAR}")


def _parse_jax(spec: str, rest: str) -> Policy:
    name, paren, args = rest.partition("(")
    if paren:
        if not args.endswith(")") or name not in JAX_POLICY_FACTORIES:
            raise ValueError(
                f"policy spec {spec!r}: write jax:NAME for one of {', '.join(JAX_POLICIES)} or "
                f"jax:FACTORY(TAG,...) for one of {', '.join(JAX_POLICY_FACTORIES)}"
            )
        return from_jax(name, *_tag_list(spec, args[:-1], empty_ok=False))
    if name in JAX_POLICY_FACTORIES:
        raise ValueError(f"policy spec {spec!r}: {name} needs its tags, e.g. jax:{name}(query_proj,mlpwo)")
    if name not in JAX_POLICIES and not hasattr(jax.checkpoint_policies, name):
        raise ValueError(
            f"policy spec {spec!r}: a JAX policy that is not one of {', '.join(JAX_POLICIES + JAX_POLICY_FACTORIES)} "
            f"cannot be rebuilt from its spec; pass the callable itself (or the Policy from_jax made)"
        )
    return from_jax(name)


def _parse_mix(spec: str) -> Mix:
    parts = []
    for piece in spec.split("+"):
        head, star, count = piece.strip().rpartition("*")
        if not star:
            raise ValueError(f"mix spec {spec!r}: part {piece!r} has no *COUNT; a mix is POLICY*COUNT+POLICY*COUNT...")
        if _MIX_COUNT.search(head):
            raise ValueError(f"mix spec {spec!r}: part {piece!r} has two counts; mixes do not nest")
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"mix spec {spec!r}: part {piece!r}: the count {count!r} is not an integer") from None
        parts.append((parse(head), n))
    if len(parts) < 2:
        raise ValueError(f"mix spec {spec!r}: a mix needs at least two parts joined by '+'")
    return Mix(tuple(parts))


def _tag_list(spec: str, text: str, *, empty_ok: bool = True) -> tuple[str, ...]:
    """The comma-separated tags of ``text`` (empty: none, if ``empty_ok``); an empty item is refused, not dropped."""
    if not text.strip():
        if empty_ok:
            return ()
        raise ValueError(f"policy spec {spec!r}: an option names no tag; give at least one or drop the option")
    tags = tuple(t.strip() for t in text.split(","))
    if not all(tags):
        raise ValueError(f"policy spec {spec!r}: an empty tag in {text.strip()!r}; tags are separated by one ','")
    return tags


def _split_options(spec: str, rest: str, allowed: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    head, *options = rest.split(";")
    opts: dict[str, str] = {}
    for option in options:
        key, eq, value = option.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise ValueError(
                f"policy spec {spec!r}: bad option {option!r}; allowed: {', '.join(k + '=...' for k in allowed)}"
            )
        opts[key] = value.strip().lower() if key == "strict" else value.strip()
    if opts.get("strict", "true") not in ("true", "false"):
        raise ValueError(f"policy spec {spec!r}: strict must be true or false")
    return _tag_list(spec, head), opts


def _check_offload_dst(dst: str) -> None:
    if not isinstance(dst, str):
        raise TypeError(f"offload dst must be a memory-kind string, got {dst!r}")
    if dst not in OFFLOAD_DESTINATIONS:
        raise ValueError(
            f"offload destination {dst!r} is not a memory kind jax.checkpoint offloads to "
            f"(jax {jax.__version__}); allowed: {', '.join(OFFLOAD_DESTINATIONS)}"
        )


# ---- MaxText's per-tensor settings (remat_policy: custom) -------------------------------------------

#: MaxText's ``custom`` remat settings: each named tensor is recomputed, kept on the device or offloaded.
MAXTEXT_SETTINGS: tuple[str, ...] = ("remat", "device", "offload")

#: How much each setting keeps: where several MaxText names stand for one remat_kit tag (a fused group and its
#: members, ``context`` and ``attention_out``), :func:`from_maxtext` takes the most kept of their settings.
_MAXTEXT_KEEPS = {"remat": 0, "offload": 1, "device": 2}

#: Every tensor MaxText's ``custom`` remat names, in the order of its ``configs/base.yml`` (MaxText main, 2026).
MAXTEXT_TENSOR_NAMES: tuple[str, ...] = (
    "decoder_layer_input",
    "indexer_cutoff_threshold",
    "context",
    "mlpwi",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
    "moe_mlpwi_0",
    "moe_mlpwi_1",
    "moe_mlpwo",
    "query_proj",
    "key_proj",
    "value_proj",
    "kv_proj",
    "qkv_proj",
    "out_proj",
    "query_wa_proj",
    "kv_wa_proj",
    "mla_q",
    "mla_kv",
    "attention_out",
    "engram",
)

#: Each MaxText tensor and the remat_kit tags it stands for (:data:`remat_kit.names.ALIASES`; ``context`` is
#: its own name): one tag, a fused group's members, or () for a value remat_kit's block does not compute
#: (MoE experts, MLA's projections, Engram, the sparse-attention indexer), which only ``remat`` may name.
MAXTEXT_TENSORS: dict[str, tuple[str, ...]] = {
    n: _names.ALIASES.get(n, (n,) if n in _names.VOCABULARY else ()) for n in MAXTEXT_TENSOR_NAMES
}

#: The remat_kit tags MaxText's ``custom`` remat can name: what :func:`to_maxtext` can say.
MAXTEXT_TAGS: frozenset[str] = frozenset(t for tags in MAXTEXT_TENSORS.values() for t in tags)

#: MaxText's ``remat_policy`` values: its presets (:data:`MAXTEXT_ALIASES`), ``none`` and ``custom``.
MAXTEXT_REMAT_POLICIES: tuple[str, ...] = ("none", *MAXTEXT_ALIASES, "custom")


def from_maxtext(settings: dict[str, str]) -> Policy:
    """A policy from MaxText's remat settings: its ``remat_policy`` and the per-tensor ``custom`` ones.

    Each MaxText name is a separate value in MaxText (whether ``qkv_proj`` or ``query_proj`` is emitted
    depends on ``fused_qkv``; ``context`` and ``attention_out`` on the attention kernel), while remat_kit's block
    has one value per tag. Where several names stand for one tag, the most kept setting wins (``device``
    over ``offload`` over ``remat``): whichever value the model emits, MaxText would keep it. So MaxText's
    full settings (every name present, as in its base.yml) with ``query_proj: device`` keep q on the device
    whatever ``qkv_proj`` says.

    Args:
      settings: ``{maxtext_tensor: "remat" | "device" | "offload"}`` for tensors of :data:`MAXTEXT_TENSORS`, and
        optionally ``remat_policy`` (one of :data:`MAXTEXT_REMAT_POLICIES`): any value but ``custom`` is that
        preset, the tensor settings ignored as MaxText ignores them. A tensor not named is recomputed.
        ``decoder_layer_input`` is kept by every rematerialized layer (``device``, or ``offload``). A tensor
        remat_kit's block does not compute (MoE, MLA, Engram, the indexer) may only be ``remat``.

    Returns:
      ``selective`` of the ``device`` tensors (``full`` when there are none), or ``offload`` of the
      ``offload`` tensors saving the ``device`` ones, tags in block order; or the named preset.

    Raises:
      ValueError/TypeError: an unknown tensor, setting or ``remat_policy``, or a kept tensor remat_kit has no
        equivalent for, naming the allowed ones.

    >>> str(from_maxtext({"query_proj": "offload", "mlpwo": "device", "mlpwi": "remat"}))
    'offload:q_proj;save=mlp_out'
    >>> str(from_maxtext({"remat_policy": "custom", "qkv_proj": "remat", "query_proj": "device"}))
    'selective:q_proj'
    >>> from_maxtext(parse("save_qkv_proj").to_maxtext()) == parse("save_qkv_proj")
    True
    """
    if not isinstance(settings, dict):
        raise TypeError(f"from_maxtext takes a dict of tensor name -> setting, got {type(settings).__name__}")
    settings = dict(settings)
    name = settings.pop("remat_policy", "custom")
    if name not in MAXTEXT_REMAT_POLICIES:
        raise ValueError(f"unknown MaxText remat_policy {name!r}; allowed: {', '.join(MAXTEXT_REMAT_POLICIES)}")
    chosen: dict[str, str] = {}
    for tensor, setting in settings.items():
        if tensor not in MAXTEXT_TENSORS:
            raise ValueError(f"unknown MaxText tensor {tensor!r}; allowed: remat_policy, {', '.join(MAXTEXT_TENSORS)}")
        if setting not in MAXTEXT_SETTINGS:
            raise ValueError(f"MaxText tensor {tensor!r}: setting {setting!r}; allowed: {', '.join(MAXTEXT_SETTINGS)}")
        if not MAXTEXT_TENSORS[tensor] and setting != "remat":
            raise ValueError(
                f"MaxText tensor {tensor!r} is a value remat_kit's block does not compute (MoE, MLA, Engram or "
                f"the sparse-attention indexer), so it cannot be kept ({setting!r}); allowed: 'remat', or keep "
                f"one of {', '.join(n for n, tags in MAXTEXT_TENSORS.items() if tags)}"
            )
        for t in MAXTEXT_TENSORS[tensor]:
            if _MAXTEXT_KEEPS[setting] >= _MAXTEXT_KEEPS[chosen.get(t, "remat")]:
                chosen[t] = setting
    if name != "custom":
        return none() if name == "none" else MAXTEXT_ALIASES[name]()
    order = [t for t in _names.VOCABULARY if t in chosen]
    save = tuple(t for t in order if chosen[t] == "device" and t != _names.LAYER_INPUT)
    out = tuple(t for t in order if chosen[t] == "offload")
    if out:
        return offload(out, save=save)
    return selective(save) if save else full()


def to_maxtext(policy: Policy | Mix | str) -> dict[str, str]:
    """MaxText's remat settings for a policy: ``{"remat_policy": "none"}`` for ``none``, else
    ``remat_policy: custom`` and ``{tensor: "remat" | "device" | "offload"}`` for every tensor of
    :data:`MAXTEXT_TENSORS` (ready to paste over MaxText's base.yml).

    ``decoder_layer_input`` is ``device`` unless offloaded; a fused group (``qkv_proj``, ``kv_proj``,
    ``mlpwi``) takes its members' setting when they agree, else ``remat`` (a fused value cannot be split);
    ``attention_out`` takes ``context``'s; a tensor remat_kit's block does not compute is ``remat``.
    ``none`` is MaxText's own ``none``, not ``custom`` with every tensor on the device (under which MaxText
    still recomputes the values it does not name: norms, activations). A policy MaxText cannot say per
    tensor is refused: a mix or a grouping policy (MaxText applies one setting to every layer), ``dots``
    or a JAX policy (use MaxText's own policy names), or one that saves or offloads a tag MaxText has no
    name for (norms, ``attn_probs``, ``mlp_act``).

    Raises:
      ValueError: the policy has no MaxText equivalent, saying why.

    >>> s = to_maxtext("save_dot_except_mlp")
    >>> s["remat_policy"], s["query_proj"], s["qkv_proj"], s["out_proj"], s["mlpwo"]
    ('custom', 'device', 'device', 'device', 'remat')
    >>> to_maxtext("none")
    {'remat_policy': 'none'}
    """
    policy = parse(policy)
    if isinstance(policy, Mix):
        raise ValueError(
            f"mix {policy} runs layers under different policies; MaxText's custom remat applies one "
            f"setting per tensor to every layer: convert each part on its own"
        )
    if policy.kind in ("every_n", "segments", "sqrt_n", "dots", "jax"):
        raise ValueError(
            f"policy {policy} has no per-tensor MaxText equivalent; allowed: none, full, selective "
            f"or offload of MaxText-named tensors"
        )
    if policy.kind == "none":
        return {"remat_policy": "none"}
    tags = {t: "device" for t in policy.save} | {t: "offload" for t in policy.offload}
    unknown = [t for t in tags if t not in MAXTEXT_TAGS]
    if unknown:
        raise ValueError(
            f"policy {policy}: MaxText has no tensor name for {unknown}; allowed tags: {sorted(MAXTEXT_TAGS)}"
        )
    tags.setdefault(_names.LAYER_INPUT, "device")  # every rematerialized layer keeps its input
    out = {"remat_policy": "custom"}
    for tensor, members in MAXTEXT_TENSORS.items():
        found = {tags.get(t, "remat") for t in members}
        out[tensor] = found.pop() if len(found) == 1 else "remat"
    return out
