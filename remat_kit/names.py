"""The vocabulary of ``checkpoint_name`` tags emitted by remat_kit's transformer block.

A selective or offload policy refers to values inside a block by these tags. Every tag below is
attached by :class:`remat_kit.model.transformer.Block`; your own code may emit any of them, or its own tags (any
``checkpoint_name``): a policy may name either, and wherever it is applied the tags it names are
checked against those the code really emits (:mod:`remat_kit.policies.tags`).

====================  =========================================  ==========================  ===========
tag                   value (shape)                              MaxText alias               kind
====================  =========================================  ==========================  ===========
``layer_input``       block input, the residual stream [b, s, d]  ``decoder_layer_input``     checkpoint
``attn_norm``         RMSNorm before attention [b, s, d]                                      cheap
``q_proj``            query projection [b, s, h, hd]             ``query_proj``              matmul
``k_proj``            key projection [b, s, kv, hd]              ``key_proj``                matmul
``v_proj``            value projection [b, s, kv, hd]            ``value_proj``              matmul
``attn_probs``        softmax of the scores [b, h, s, s] (xla)                                cheap, big
``context``           attention output before the out projection  ``context``,                matmul
                                                                 ``attention_out``
``attn_out``          attention out projection [b, s, d]         ``out_proj``                matmul
``mlp_norm``          RMSNorm before the MLP [b, s, d]                                        cheap
``mlp_gate``          SwiGLU gate projection [b, s, f]           ``mlpwi_0``                 matmul
``mlp_up``            SwiGLU up projection [b, s, f]             ``mlpwi_1``                 matmul
``mlp_act``           silu(gate) * up [b, s, f]                                               cheap
``mlp_out``           MLP down projection [b, s, d]              ``mlpwo``                   matmul
====================  =========================================  ==========================  ===========

Group aliases expand to several tags: ``qkv_proj`` → q/k/v projections, ``kv_proj`` → k/v,
``mlpwi`` → gate and up.

An alias is a second spelling, both ways: a policy keeps a tag under whichever spelling the code
emits (:func:`spellings`), so ``selective:query_proj`` (stored as ``q_proj``) keeps MaxText's
``query_proj`` on a MaxText layer and ``q_proj`` on remat_kit's block, and a group is kept as the one
fused value MaxText emits (``qkv_proj``, ``mlpwi``) when the policy keeps all of its members.

``attn_probs`` exists only under ``attention="xla"``. Under ``chunked`` attention ``context`` also
tags the per-query logsumexp ``[b, kv, h/kv, s]`` (float32) that its backward pass needs, so keeping
``context`` spares the backward pass a re-run of attention's forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jax.ad_checkpoint import checkpoint_name

LAYER_INPUT = "layer_input"
ATTN_NORM = "attn_norm"
Q_PROJ = "q_proj"
K_PROJ = "k_proj"
V_PROJ = "v_proj"
ATTN_PROBS = "attn_probs"
CONTEXT = "context"
ATTN_OUT = "attn_out"
MLP_NORM = "mlp_norm"
MLP_GATE = "mlp_gate"
MLP_UP = "mlp_up"
MLP_ACT = "mlp_act"
MLP_OUT = "mlp_out"

#: Every tag the transformer block emits, in the order they are computed.
VOCABULARY: tuple[str, ...] = (
    LAYER_INPUT,
    ATTN_NORM,
    Q_PROJ,
    K_PROJ,
    V_PROJ,
    ATTN_PROBS,
    CONTEXT,
    ATTN_OUT,
    MLP_NORM,
    MLP_GATE,
    MLP_UP,
    MLP_ACT,
    MLP_OUT,
)

#: Tags whose values are outputs of weight matmuls: expensive to recompute, what selective keeps.
MATMUL_OUTPUTS: tuple[str, ...] = (Q_PROJ, K_PROJ, V_PROJ, CONTEXT, ATTN_OUT, MLP_GATE, MLP_UP, MLP_OUT)

#: MaxText's names (and groups of them) mapped onto the vocabulary.
ALIASES: dict[str, tuple[str, ...]] = {
    "decoder_layer_input": (LAYER_INPUT,),
    "query_proj": (Q_PROJ,),
    "key_proj": (K_PROJ,),
    "value_proj": (V_PROJ,),
    "qkv_proj": (Q_PROJ, K_PROJ, V_PROJ),
    "kv_proj": (K_PROJ, V_PROJ),
    "out_proj": (ATTN_OUT,),
    "attention_out": (CONTEXT,),  # MaxText's attention output before its out projection (not attn_out)
    "mlpwi_0": (MLP_GATE,),
    "mlpwi_1": (MLP_UP,),
    "mlpwi": (MLP_GATE, MLP_UP),
    "mlpwo": (MLP_OUT,),
}


def resolve(names, what: str = "tag names") -> tuple[str, ...]:
    """Canonicalize tag names: expand MaxText aliases, drop duplicates, keep first-seen order.

    Any other name passes through unchanged: your own code's tags need no flag. Whether the code
    really emits a name is checked where the policy is applied (:func:`remat_kit.policies.tags.check`),
    which also suggests the nearest emitted tag for a typo.

    Args:
      names: an iterable of tag names or aliases (a single string is rejected, to catch
        ``save="q_proj"`` meaning ``save=("q_proj",)``).
      what: how messages name ``names`` (the caller's argument, e.g. ``"selective(save=...)"``).

    Returns:
      A tuple of canonical tags.

    Raises:
      TypeError: ``names`` is a string, not iterable (None) or holds a non-string (or an empty string).

    >>> resolve(["query_proj", "mlpwi", "q_proj", "my_tag"])
    ('q_proj', 'mlp_gate', 'mlp_up', 'my_tag')
    >>> resolve(None, "selective(save=...)")
    Traceback (most recent call last):
    ...
    TypeError: selective(save=...) must be a sequence of tag names (strings), got None
    """
    if isinstance(names, str):
        raise TypeError(f"{what} must be a sequence of strings, got the string {names!r}; write ({names!r},)")
    if not isinstance(names, Iterable):
        raise TypeError(f"{what} must be a sequence of tag names (strings), got {names!r}")
    out: list[str] = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{what} must be non-empty strings, got {name!r} ({type(name).__name__})")
        expanded = ALIASES.get(name, (name,))
        out.extend(t for t in expanded if t not in out)
    return tuple(out)


def spelled(tag: str, within=()) -> tuple[str, ...]:
    """Every name under which code may emit the value canonical ``tag`` stands for.

    ``tag`` itself, the MaxText names aliased to it alone, and each group alias holding it whose
    members are all in ``within`` (the other tags of the same policy: a fused value is one value).

    >>> spelled("q_proj"), spelled("q_proj", within=("q_proj", "k_proj", "v_proj"))
    (('q_proj', 'query_proj'), ('q_proj', 'query_proj', 'qkv_proj'))
    """
    within = frozenset(within)
    out = [tag]
    for alias, members in ALIASES.items():
        if alias != tag and tag in members and (members == (tag,) or frozenset(members) <= within):
            out.append(alias)
    return tuple(out)


def spellings(tags) -> tuple[str, ...]:
    """The names a policy keeping canonical ``tags`` hands to JAX: each tag under every spelling.

    >>> spellings(("mlp_gate", "mlp_up", "mlp_out"))
    ('mlp_gate', 'mlpwi_0', 'mlpwi', 'mlp_up', 'mlpwi_1', 'mlp_out', 'mlpwo')
    """
    return tuple(dict.fromkeys(name for t in tags for name in spelled(t, tags)))


def tag(x, name: str):
    """Attach a ``checkpoint_name`` tag (thin alias of :func:`jax.ad_checkpoint.checkpoint_name`)."""
    return checkpoint_name(x, name)


# ---- names by module path (remat_kit.apply and the stacks: one naming rule) ----------------------------


def join(path: Any) -> str:
    """A module path as a ``/``-joined string (list indices become their digits): the name a value inside a
    block gets from :func:`remat_kit.apply` and the stacks (``attn/q_einsum``).

    >>> join(("attn", "q_einsum"))
    'attn/q_einsum'
    """
    return "/".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def state_keys(keypath) -> list:
    """The keys of a jax key path into an ``nnx.State`` (the trailing ``.value`` of a Variable dropped)."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in keypath]
    return keys[:-1] if keys and keys[-1] == "value" else keys
