"""Rematerialization policies: small frozen, hashable values that say what a layer keeps.

A :class:`Policy` is data. The scan core (:mod:`remat_kit.scan`) reads its :meth:`Policy.plan` to
decide how layers are grouped, and :meth:`Policy.checkpoint` to wrap one layer or group; applied to a
plain function or a Flax module class it wraps that directly.

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
from collections.abc import Callable
from typing import Any, Literal

import flax.linen as nn
import jax
from flax import nnx

from remat_kit import names as _names
from remat_kit import wrap_nnx

Kind = Literal["none", "full", "every_n", "selective", "offload", "segments", "sqrt_n", "dots"]
KINDS: tuple[str, ...] = ("none", "full", "every_n", "selective", "offload", "segments", "sqrt_n", "dots")

#: How the scan core groups layers for a policy.
#:   ``"layer"``: one layer per scan step, each wrapped by :meth:`Policy.checkpoint`;
#:   ``"first"``: groups of ``size`` layers, only the first of each group rematerialized;
#:   ``"group"``: groups of ``size`` layers rematerialized together, only group inputs kept.
GroupMode = Literal["layer", "first", "group"]

DEFAULT_OFFLOAD_DST = "pinned_host"

# The default selective preset: keep the outputs of weight matmuls, recompute the attention core,
# norms and activations (Korthikanti et al. 2022, Megatron's selective recompute).
SELECTIVE_DEFAULT: tuple[str, ...] = _names.MATMUL_OUTPUTS

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
      n: the period of ``every_n`` or the group size of ``segments``; 0 otherwise.
      save: tags kept on the device (``selective``, ``offload``).
      offload: tags kept in host memory instead of recomputed (``offload``).
      dst: the host memory kind offloaded tags go to.
      strict: check tags against :data:`remat_kit.names.VOCABULARY` at construction and against the
        tags the block really emits when stacked. Turn off for your own modules' tags.
    """

    kind: Kind
    n: int = 0
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    dst: str = DEFAULT_OFFLOAD_DST
    strict: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown policy kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.kind in ("every_n", "segments"):
            check_positive_int(f"{self.kind}(n)", self.n)
        elif self.n != 0:
            raise ValueError(f"policy {self.kind!r} takes no n, got n={self.n!r}")
        if (self.save or self.offload) and self.kind not in ("selective", "offload"):
            raise ValueError(f"policy {self.kind!r} takes no save/offload tags")
        for field in ("save", "offload"):
            value = getattr(self, field)
            if not isinstance(value, tuple) or not all(isinstance(t, str) for t in value):
                raise TypeError(f"Policy.{field} must be a tuple of tag strings, got {value!r}")
        both = sorted(set(self.save) & set(self.offload))
        if both:
            raise ValueError(f"tags {both} are both saved and offloaded; a tag can be one or the other")
        if self.kind == "offload":
            if not self.offload:
                raise ValueError("offload(names=...) needs at least one tag to offload")
            _check_memory_kind(self.dst)

    # ---- identity -----------------------------------------------------------------------------

    def __str__(self) -> str:
        if self.kind in ("every_n", "segments"):
            return f"{self.kind}:{self.n}"
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
    def remat(self) -> bool:
        """Whether the policy rematerializes anything (False only for ``none``)."""
        return self.kind != "none"

    @property
    def jax_policy(self) -> Callable[..., Any]:
        """The ``jax.checkpoint`` policy for one rematerialized layer (or group) of this policy."""
        cp = jax.checkpoint_policies
        if self.kind == "none":
            return cp.everything_saveable
        if self.kind == "selective":
            return cp.save_only_these_names(*self.save)
        if self.kind == "offload":
            return cp.save_and_offload_only_these_names(
                names_which_can_be_saved=list(self.save),
                names_which_can_be_offloaded=list(self.offload),
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
        return jax.checkpoint(fn, policy=self.jax_policy, prevent_cse=prevent_cse)

    def __call__(self, target, *, prevent_cse: bool = True):
        """Apply the policy to one function or one Flax module class.

        A single function or module is one layer: ``every_n``, ``segments`` and ``sqrt_n`` then
        rematerialize it whole (their layer-grouping shows only in :func:`remat_kit.stack`).

        Args:
          target: a callable, or a ``flax.linen.Module`` subclass.
          prevent_cse: passed to ``jax.checkpoint`` / ``nn.remat``; keep True outside scans.

        Returns:
          The function under ``jax.checkpoint`` or the class under ``flax.linen.remat``
          (``target`` itself for ``none``).
        """
        if isinstance(target, type) and issubclass(target, nn.Module):
            if not self.remat:
                return target
            return nn.remat(target, policy=self.jax_policy, prevent_cse=prevent_cse)
        if isinstance(target, nnx.Module):
            return wrap_nnx.remat(self, target, prevent_cse=prevent_cse)
        if isinstance(target, nn.Module):
            raise TypeError(
                f"apply a policy to a Module class, not an instance ({type(target).__name__}(...)); "
                f"write policy({type(target).__name__})"
            )
        if not callable(target):
            raise TypeError(f"a policy applies to a function or a flax.linen.Module class, got {target!r}")
        return self.checkpoint(target, prevent_cse=prevent_cse)

    # ---- how the scan core groups layers ----------------------------------------------------------

    def validate_depth(self, num_layers: int) -> None:
        """Raise ValueError if the policy cannot apply to a stack of ``num_layers`` layers."""
        check_positive_int("num_layers", num_layers)
        if self.kind in ("every_n", "segments") and self.n > num_layers:
            raise ValueError(
                f"{self}: n={self.n} is greater than the depth ({num_layers} layers); allowed: 1 <= n <= {num_layers}"
            )

    def plan(self, num_layers: int) -> LayerPlan:
        """How the scan core groups ``num_layers`` layers under this policy."""
        self.validate_depth(num_layers)
        if self.kind == "every_n":
            return LayerPlan(self.n, "first")
        if self.kind == "segments":
            return LayerPlan(self.n, "group")
        if self.kind == "sqrt_n":
            return LayerPlan(sqrt_n_group_size(num_layers), "group")
        return LayerPlan(1, "layer")


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

    >>> every_n(2)
    Policy(kind='every_n', n=2, save=(), offload=(), dst='pinned_host', strict=True)
    """
    return Policy("every_n", n=n)


def selective(save=SELECTIVE_DEFAULT, *, strict: bool = True) -> Policy:
    """Named-save: every layer rematerialized except the tagged values listed in ``save``.

    The default keeps the weight-matmul outputs and recomputes attention softmax, norms and
    activations, as Megatron's selective recompute does.

    Args:
      save: tags (or MaxText aliases) to keep; see :mod:`remat_kit.names`.
      strict: reject tags outside the vocabulary; set False for your own module's tags.

    >>> str(selective(["query_proj", "key_proj"]))
    'selective:q_proj,k_proj'
    """
    return Policy("selective", save=_names.resolve(save, strict=strict), strict=strict)


def offload(names=(_names.LAYER_INPUT,), save=(), dst: str = DEFAULT_OFFLOAD_DST, *, strict: bool = True) -> Policy:
    """Keep the tagged values ``names`` in host memory instead of recomputing them.

    The default offloads each layer's input (the checkpoints), like Hugging Face ``offload=True``.

    Args:
      names: tags copied to ``dst`` in the forward pass and back in the backward pass.
      save: tags kept on the device; everything else is recomputed.
      dst: a host memory kind of the backend, e.g. ``"pinned_host"`` or ``"unpinned_host"``.
      strict: reject tags outside the vocabulary.

    >>> str(offload()), str(offload(["q_proj"], save=["mlp_up"]))
    ('offload', 'offload:q_proj;save=mlp_up')
    """
    return Policy(
        "offload",
        save=_names.resolve(save, strict=strict),
        offload=_names.resolve(names, strict=strict),
        dst=dst,
        strict=strict,
    )


def segments(k: int) -> Policy:
    """Chen et al. 2016: keep only every k-th layer boundary; recompute k layers together.

    >>> str(segments(4))
    'segments:4'
    """
    return Policy("segments", n=k)


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


#: MaxText's ``remat_policy`` presets, accepted by :func:`parse`.
MAXTEXT_ALIASES: dict[str, Callable[[], Policy]] = {
    "full": full,
    "minimal": lambda: selective(_MAXTEXT_MINIMAL),
    "minimal_with_context": lambda: selective((*_MAXTEXT_MINIMAL, _names.CONTEXT)),
    "save_dot_except_mlp": lambda: selective(("q_proj", "k_proj", "v_proj", "attn_out")),
    "save_qkv_proj": lambda: selective(("q_proj", "k_proj", "v_proj")),
    "save_out_proj": lambda: selective(("attn_out",)),
    "qkv_proj_offloaded": lambda: offload(("q_proj", "k_proj", "v_proj")),
    "minimal_offloaded": lambda: offload(_MAXTEXT_MINIMAL),
}

_SPEC_HELP = (
    "none, full, dots, sqrt_n, every_n:N, segments:K, selective[:TAG,...], "
    "offload[:TAG,...[;save=TAG,...][;dst=KIND]], or a MaxText preset (" + ", ".join(MAXTEXT_ALIASES) + ")"
)


def parse(spec: str | Policy) -> Policy:
    """Build a policy from its spec string; the inverse of ``str(policy)``.

    Args:
      spec: e.g. ``"full"``, ``"every_n:2"``, ``"selective:q_proj,k_proj"``, ``"offload"``,
        ``"offload:q_proj;save=mlp_up;dst=unpinned_host"``, ``"segments:4"``, ``"sqrt_n"``,
        or a MaxText preset name such as ``"minimal"``. A Policy is returned unchanged.

    Raises:
      ValueError: an unknown or malformed spec, naming it and the allowed forms.

    >>> parse("minimal") == selective(["q_proj", "k_proj", "v_proj", "attn_out", "mlp_gate", "mlp_up", "mlp_out"])
    True
    >>> str(parse("every_n:3"))
    'every_n:3'
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a policy spec must be a string, got {spec!r}")
    text = spec.strip()
    kind, sep, rest = text.partition(":")
    if not sep and kind in MAXTEXT_ALIASES:
        return MAXTEXT_ALIASES[kind]()
    if kind in ("none", "dots", "sqrt_n") and not sep:
        return {"none": none, "dots": dots, "sqrt_n": sqrt_n}[kind]()
    if kind in ("every_n", "segments") and sep:
        try:
            n = int(rest)
        except ValueError:
            raise ValueError(f"policy spec {spec!r}: {kind} needs an integer, e.g. {kind}:2") from None
        return every_n(n) if kind == "every_n" else segments(n)
    if kind == "selective":
        if not sep:
            return selective()
        positional, opts = _split_options(spec, rest, allowed=("strict",))
        return selective(positional, strict=opts.get("strict", "true") != "false")
    if kind == "offload":
        if not sep:
            return offload()
        positional, opts = _split_options(spec, rest, allowed=("save", "dst", "strict"))
        return offload(
            positional,
            save=_tag_list(opts.get("save", "")),
            dst=opts.get("dst", DEFAULT_OFFLOAD_DST),
            strict=opts.get("strict", "true") != "false",
        )
    raise ValueError(f"unknown policy spec {spec!r}; allowed: {_SPEC_HELP}")


def _tag_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


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
    return _tag_list(head), opts


def check_positive_int(what: str, value) -> None:
    """Raise TypeError for a non-integer (or bool) and ValueError for one below 1, naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a positive integer, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{what} must be a positive integer (>= 1), got {value}")


def _check_memory_kind(dst: str) -> None:
    if not isinstance(dst, str):
        raise TypeError(f"offload dst must be a memory-kind string, got {dst!r}")
    device = jax.devices()[0]
    kinds = [m.kind for m in device.addressable_memories()]
    host_kinds = [k for k in kinds if k != device.default_memory().kind]
    if dst not in host_kinds:
        raise ValueError(
            f"offload destination {dst!r} is not a host memory kind of {device.platform} device "
            f"{device.id}; allowed: {', '.join(host_kinds) or '(none: this backend cannot offload)'} "
            f"(addressable memories: {', '.join(kinds)})"
        )
