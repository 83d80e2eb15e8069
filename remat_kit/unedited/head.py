"""The loss at the head of a model the user installed, in chunks: :func:`head_loss`.

A model's own loss materializes ``[batch, seq, vocab]`` logits and their gradient; at a long sequence and a large
vocabulary those outweigh the layers' kept inputs. :func:`head_loss` runs the model with its head's input
marked (a Linen method interceptor; on NNX a subclass swapped into the traced copy of the head's module), traces
it, and splits the traced program at the mark: everything up to the head's input runs as the model wrote it;
the rest (the head's matmul and whatever the model does after it, a soft-cap, a scale) is proven per-position
(:func:`remat_kit.policies.positions.check`) and runs with the cross-entropy a chunk of positions at a time
through :func:`remat_kit.policies.loss_chunks.chunked_mean`, the built-in model's chunked loss.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from remat_kit import _jax_internals
from remat_kit.policies import loss_chunks, positions
from remat_kit.policies.tiling import check_tiles
from remat_kit.unedited.linen import Applied
from remat_kit.units import check_int

_IN, _OUT = "remat_kit.head_in/", "remat_kit.head_out/"
#: Calls flattened to reach the head's marks: a jit (an NNX ``nnx.jit`` method, a helper) changes no value inside
#: the caller's trace; a checkpoint or scan around the head would, and is left alone.
_JITS = frozenset({"jit", "pjit", "closed_call", "core_call"})
#: "auto" chunks aim at about this many bytes of float32 logits a chunk (the built-in loss's figure).
CHUNK_BYTES = 128 * 2**20


@dataclasses.dataclass(frozen=True)
class _Call:
    """A module method call the trace marked: its path as written (``embedder.decode``) and its shapes."""

    name: str
    shape_in: tuple[int, ...]
    shape_out: tuple[int, ...]


def head_loss(
    model: Any,
    *args: Any,
    labels: Any,
    mask: Any = None,
    head: str | None = None,
    chunks: int | str = "auto",
    method: Any = None,
    **kwargs: Any,
) -> jax.Array:
    """The mean next-token cross-entropy of ``model``'s logits against ``labels``, the head run in chunks.

    The full ``[..., positions, vocab]`` logits and their gradient never exist: the head and the loss run
    ``chunks`` slices of positions at a time, each slice's gradients taken as it runs
    (:mod:`remat_kit.policies.loss_chunks`). Equal to the plain loss over the model's logits, and its
    gradients, up to float rounding. Other outputs of the model (a cache) are dropped. State an NNX call updates
    (dropout's RNG counts) is written back to the module as its own call would; Linen's mutable collections are
    not (``apply`` runs without ``mutable``).

    Args:
      model: a Linen module (then ``args[0]`` is its variables) or an NNX module, or what
        :func:`remat_kit.apply` made of either (its policy then applies to the layers).
      *args, **kwargs: the model's call arguments (Linen: after the variables).
      labels: integer ids shaped as the logits without their vocabulary axis (``[batch, seq]``); the
        positions are its last axis.
      mask: 1 where a position counts (default: all); the loss is the mean over those.
      head: the head's module path and method: ``"lm_head"``, ``"embedder.decode"``, ``"transformer/wte.attend"``.
        None: found, the last module call from hidden states to vocabulary-wide outputs. A Linen path is
        checked against the variables before tracing, so a head holding none of its own (Hugging Face GPT-2's
        tied ``lm_head``, applied with the embedding) is left to be found.
      chunks: the slices of positions, a divisor of the sequence length, or ``"auto"`` (about
        :data:`CHUNK_BYTES` of float32 logits a slice).
      method: Linen only, the method to apply (as ``Module.apply``'s).

    Raises:
      TypeError/ValueError: a bad argument, named with what is allowed, before tracing; a head that is not
        found, called more than once on the way to the logits, or followed by anything that mixes
        positions, in one line once traced.

    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> class LM(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, tokens):
    ...         return nn.Dense(32, name="lm_head")(nn.Embed(32, 8)(tokens))
    >>> tokens = jnp.arange(16).reshape(2, 8) % 32
    >>> model = LM(); variables = model.init(jax.random.key(0), tokens)
    >>> got = head_loss(model, variables, tokens, labels=tokens, head="lm_head", chunks=4)
    >>> want = jnp.mean(jax.nn.logsumexp(model.apply(variables, tokens), -1)
    ...                 - jnp.take_along_axis(model.apply(variables, tokens), tokens[..., None], -1)[..., 0])
    >>> bool(jnp.allclose(got, want, rtol=1e-5))
    True
    """
    from flax import linen as nn
    from flax import nnx

    labels = _check_labels(labels)
    mask = jnp.ones(labels.shape, jnp.float32) if mask is None else _check_mask(mask, labels)
    if isinstance(chunks, str) and chunks != "auto":
        raise TypeError(f"chunks must be 'auto' or a positive integer dividing the sequence length, got {chunks!r}")
    if chunks != "auto":
        check_int("chunks", chunks)
        check_tiles(chunks, labels.shape[-1], what="chunks")
    if head is not None and (not isinstance(head, str) or not head.strip("./")):
        raise TypeError(f"head must be a module path such as 'lm_head' or 'embedder.decode', or None, got {head!r}")
    if isinstance(model, nnx.Module):
        if method is not None:
            raise TypeError(f"method is for a Linen module; call an NNX module's method yourself, got {method!r}")
        spec = _split_head(head, _nnx_paths(model)) if head is not None else None
        graphdef, state = nnx.split(model)
        run = lambda st, a, kw, marks: _nnx_call(graphdef, st, a, kw, marks)
        bound = state
        write_back = lambda new: nnx.update(model, new)
    elif isinstance(model, (nn.Module, Applied)):
        if not args or not isinstance(args[0], Mapping):
            raise TypeError(
                f"a Linen model takes its variables first (a mapping), got {type(args[0] if args else None)}"
            )
        bound, args = args[0], args[1:]
        spec = _split_head(head, _linen_paths(bound)) if head is not None else None
        run = lambda v, a, kw, marks: (_linen_call(model, v, a, kw, marks, method), None)
        write_back = None
    else:
        raise TypeError(f"model must be a Linen module (with its variables) or an NNX module, got {type(model)}")
    return _loss(run, bound, args, kwargs, labels, mask, spec, head, chunks, write_back)


# ---- checks ------------------------------------------------------------------------------------------------


def _check_labels(labels):
    if not hasattr(labels, "shape") or not hasattr(labels, "dtype"):
        raise TypeError(f"labels must be an integer array [batch, seq], got {type(labels)}")
    if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.ndim < 1:
        raise ValueError(f"labels must be an integer array [batch, seq], got {labels.dtype} {labels.shape}")
    return jnp.asarray(labels)


def _check_mask(mask, labels):
    if not hasattr(mask, "shape") or tuple(mask.shape) != tuple(labels.shape):
        raise ValueError(f"mask must be shaped as labels {labels.shape}, got {getattr(mask, 'shape', type(mask))}")
    return jnp.asarray(mask, jnp.float32)


def _split_head(head: str, paths: Sequence[str]) -> tuple[str, str]:
    """``head`` as ``(module path, method)`` against the model's module paths, or a ValueError listing them."""
    parts = [p for p in re.split(r"[./]", head) if p]
    whole = "/".join(parts)
    if whole in paths:
        return whole, "__call__"
    if len(parts) > 1 and "/".join(parts[:-1]) in paths:
        return "/".join(parts[:-1]), parts[-1]
    shown = ", ".join(sorted(p for p in paths if p)[:12]) or "none"
    raise ValueError(f"head={head!r} names no module of the model; its modules with parameters: {shown}")


def _linen_paths(variables: Mapping) -> set[str]:
    """Every module path holding variables (``a/b`` for ``{"params": {"a": {"b": {...}}}}``)."""
    out: set[str] = set()

    def walk(tree, prefix):
        for k, v in tree.items():
            if isinstance(v, Mapping):
                out.add("/".join((*prefix, str(k))))
                walk(v, (*prefix, str(k)))

    for collection in variables.values():
        if isinstance(collection, Mapping):
            walk(collection, ())
    return out


def _nnx_paths(model) -> set[str]:
    from flax import nnx

    return {"/".join(map(str, path)) for path, node in nnx.graph.iter_graph(model) if isinstance(node, nnx.Module)}


# ---- marking the head ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Marks:
    """What to mark (a ``(path, method)``, or None: every hidden-states-to-array call) and what was marked."""

    spec: tuple[str, str] | None
    lead: tuple[int, ...]  # the labels' shape: a hidden-state input starts with it
    calls: list[_Call] = dataclasses.field(default_factory=list)
    depth: int = 0

    def wrap(self, name: str, fn: Callable, args: tuple, kwargs: dict):
        x = args[0] if args else None
        hidden = (
            isinstance(x, jax.Array)
            and jnp.issubdtype(x.dtype, jnp.floating)
            and x.ndim == len(self.lead) + 1
            and tuple(x.shape[:-1]) == self.lead
        )
        if not hidden or self.depth:
            return fn(*args, **kwargs)
        k = len(self.calls)
        self.depth += self.spec is not None  # a named head: not its own inner calls
        try:
            out = fn(checkpoint_name(x, f"{_IN}{k}"), *args[1:], **kwargs)
        finally:
            self.depth -= self.spec is not None
        if not isinstance(out, jax.Array):
            return out
        self.calls.append(_Call(name, tuple(x.shape), tuple(out.shape)))
        return checkpoint_name(out, f"{_OUT}{k}")

    def wanted(self, path: str, method: str) -> bool:
        return self.spec is None or self.spec == (path, method)


def _linen_call(model, variables, args, kwargs, marks: _Marks, method):
    from flax import linen as nn

    def interceptor(next_fun, a, kw, context):
        module = context.module
        path = "/".join(module.path) if module.path else (module.name or "")
        if not path or not marks.wanted(path, context.method_name):
            return next_fun(*a, **kw)
        name = path if context.method_name == "__call__" else f"{path}.{context.method_name}"
        return marks.wrap(name, next_fun, a, kw)

    # nn.jit (gm.nn's __call__) replays a trace cached before the interceptor was set: run the method plainly,
    # which inside the caller's jit changes no value (as remat_kit.apply does).
    plain = model.module if isinstance(model, Applied) else model  # remat_kit.apply's: its apply, the model's methods
    fn = getattr(type(plain), method or "__call__", None) if method is None or isinstance(method, str) else method
    if _jax_internals.linen_transform(fn) == "jit":
        method = _jax_internals.linen_see_through_jit(fn)
    with nn.intercept_methods(interceptor):
        return model.apply(variables, *args, method=method, **kwargs)


def _nnx_call(graphdef, state, args, kwargs, marks: _Marks):
    from flax import nnx

    copy = nnx.merge(graphdef, state)
    for path, node in list(nnx.graph.iter_graph(copy)):
        path = "/".join(map(str, path))
        if not path or not isinstance(node, nnx.Module):
            continue
        methods = [marks.spec[1]] if marks.spec is not None else ["__call__", *_own_methods(type(node))]
        methods = [m for m in methods if marks.wanted(path, m) and callable(getattr(type(node), m, None))]
        if methods:
            _swap(node, path, methods, marks)
    out = copy(*args, **kwargs)
    return out, nnx.state(copy)  # what the call updated (RNG counts), written back as the model's call would


def _own_methods(cls) -> list[str]:
    """Public plain functions of the module's classes (``attend``, ``decode``), not those every module has."""
    from flax import nnx

    base = set(dir(nnx.Module))
    names = {
        n
        for c in cls.__mro__
        for n, v in vars(c).items()
        if not n.startswith("_") and n not in base and callable(v) and not isinstance(v, (staticmethod, classmethod))
    }
    return sorted(names)


def _swap(node, path: str, methods: list[str], marks: _Marks) -> None:
    """The traced copy's module gets a subclass whose ``methods`` mark their input and output (special methods
    such as ``__call__`` are looked up on the class, so patching the instance would not do)."""
    cls = type(node)

    def wrapped(name):
        original = getattr(cls, name)
        label = path if name == "__call__" else f"{path}.{name}"
        return lambda self, *a, **kw: marks.wrap(label, lambda *a_, **kw_: original(self, *a_, **kw_), a, kw)

    sub = type(cls.__name__, (cls,), {m: wrapped(m) for m in methods})
    object.__setattr__(node, "__class__", sub)


# ---- the split and the loss -----------------------------------------------------------------------------


def _arrays(out) -> list:
    """The array leaves of a model's output: a tuple, a mapping (HF's ModelOutput), a dataclass, a pytree."""
    if isinstance(out, (jax.Array, np.ndarray)):
        return [out]
    if out is None:
        return []
    if isinstance(out, Mapping):
        return [a for v in out.values() for a in _arrays(v)]
    if isinstance(out, (tuple, list)):
        return [a for v in out for a in _arrays(v)]
    if dataclasses.is_dataclass(out):
        return [a for f in dataclasses.fields(out) for a in _arrays(getattr(out, f.name))]
    return [a for a in jax.tree.leaves(out) if isinstance(a, (jax.Array, np.ndarray))]


def _loss(run, bound, args, kwargs, labels, mask, spec, head, chunks, write_back):
    leaves, tree = jax.tree.flatten((bound, args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
    marks = _Marks(spec, tuple(labels.shape))
    state_tree: list = []  # the structure of the state the call updates (NNX), set while tracing
    n_out: list[int] = []  # how many of the traced outputs are the model's, before that state

    def traced(*values):
        full = list(leaves)
        for i, v in zip(dynamic, values, strict=True):
            full[i] = v
        b, a, kw = jax.tree.unflatten(tree, full)
        out, new = run(b, a, kw, marks)
        outs = _arrays(out)
        state, structure = jax.tree.flatten(new)
        state_tree.append(structure)
        n_out.append(len(outs))
        return outs + state

    avals = [jax.ShapeDtypeStruct(jnp.shape(leaves[i]), jnp.result_type(leaves[i])) for i in dynamic]
    closed = jax.make_jaxpr(traced)(*avals)
    what = repr(head) if head is not None else "found automatically"
    if not marks.calls:
        raise ValueError(
            f"head={head!r}: no call of it took hidden states shaped {(*labels.shape, 'd')} and returned an array"
            if head is not None
            else f"no module call takes hidden states shaped {(*labels.shape, 'd')}: pass head="
        )
    names = {f"{_IN}{k}" for k in range(len(marks.calls))} | {f"{_OUT}{k}" for k in range(len(marks.calls))}
    flat = _lift(closed, names)
    k, logits_at, tail, inputs = _tail(flat, marks, labels.shape, head, what, n_out[-1])
    updated = flat.jaxpr.outvars[n_out[-1] :]
    axis = labels.ndim - 1
    length = labels.shape[-1]
    vocab = flat.jaxpr.outvars[logits_at].aval.shape[-1]
    if chunks == "auto":
        chunks = auto_chunks(int(np.prod(labels.shape)) * vocab * 4, length)
    in_axes = (axis,) + (None,) * (len(inputs) - 1)
    try:
        out_axes = positions.check(tail, in_axes, chunks)
    except positions.NotPerPosition as e:
        raise ValueError(
            f"the head {marks.calls[k].name!r} ({what}) and what follows it to the logits are not per-position: {e}"
        ) from None
    if out_axes != (axis,):
        raise ValueError(f"the logits after the head {marks.calls[k].name!r} carry the positions on {out_axes}")
    front_in = [*flat.jaxpr.constvars, *flat.jaxpr.invars]
    front = positions.program(_front_eqns(flat.jaxpr, [*inputs, *updated]), front_in, [*inputs, *updated])
    size = length // chunks
    block = positions.block_fn(tail, in_axes, length, size)
    chunk = loss_chunks.Chunk(lambda i, blocked, whole: block(i * size, blocked[0], *whole)[0][0])
    given = [leaves[i] for i in dynamic]
    values = jcore.jaxpr_as_fun(front)(*flat.consts, *given)
    h, *whole = values[: len(inputs)]
    new = values[len(inputs) :]
    # Written back only when the call changed some state (dropout's RNG counts), as the plain call would
    # mutate it; an unchanged leaf comes back as the very input it was.
    seen = {id(g) for g in given}
    if write_back is not None and any(id(n) not in seen for n in new):
        write_back(jax.tree.unflatten(state_tree[-1], new))
    return loss_chunks.chunked_mean(chunk, (h,), tuple(whole), labels, mask, chunks, axis=axis)


def auto_chunks(logit_bytes: int, length: int) -> int:
    """The fewest chunks dividing ``length`` that bring a chunk's float32 logits to about :data:`CHUNK_BYTES`.

    >>> auto_chunks(2 * 8192 * 128_256 * 4, 8192), auto_chunks(1000, 6)
    (64, 1)
    """
    need = max(1, -(-logit_bytes // CHUNK_BYTES))
    return next(k for k in range(min(need, length), length + 1) if length % k == 0)


def _contains(jaxpr, names: set[str]) -> bool:
    for eqn in jaxpr.eqns:
        if _jax_internals.checkpoint_name_of(eqn) in names:
            return True
        for sub in _jax_internals.subjaxprs(eqn):
            if _contains(sub, names):
                return True
    return False


def _lift(closed, names: set[str]):
    """``closed`` with the jit calls that hold a mark flattened into it, so the marks stand in its top level;
    checkpoints and scans (the layers', a policy's) are kept as they are, their memory savings with them, and
    a mark inside one is not reached."""

    def ev(jaxpr, consts, args):
        env = dict(zip(jaxpr.constvars, consts, strict=True)) | dict(zip(jaxpr.invars, args, strict=True))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        for eqn in jaxpr.eqns:
            vals = [read(v) for v in eqn.invars]
            lift = eqn.primitive.name in _JITS and _contains(positions.body_of(eqn)[0], names)
            outs = ev(*positions.body_of(eqn), vals) if lift else _jax_internals.rebind(eqn, vals)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    if not any(_contains(positions.body_of(e)[0], names) for e in closed.jaxpr.eqns if e.primitive.name in _JITS):
        return closed
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    return jax.make_jaxpr(lambda *a: ev(closed.jaxpr, closed.consts, a))(*args)


def _tail(flat, marks: _Marks, lead, head, what, n_out: int):
    """The marked call whose output reaches the logits, and the program from its input to them."""
    jaxpr = flat.jaxpr
    eqns = jaxpr.eqns
    at: dict[str, int] = {}
    for i, e in enumerate(eqns):
        tag = _jax_internals.checkpoint_name_of(e)  # either representation (JAX_REMAT3)
        if tag is not None and str(tag).startswith("remat_kit.head_"):
            at[tag] = i
    users = positions.users_of(eqns)
    hits = []
    for k, call in enumerate(marks.calls):
        if f"{_IN}{k}" not in at or f"{_OUT}{k}" not in at:
            continue
        reach = positions.forward_of(eqns, users, at[f"{_OUT}{k}"])
        produced = {v for i in reach for v in eqns[i].outvars} | set(eqns[at[f"{_OUT}{k}"]].outvars)
        # A logits-shaped output it reaches, its own output as wide (the layers before the head reach the
        # logits too, but give hidden states).
        outs = [
            j
            for j, v in enumerate(jaxpr.outvars[:n_out])
            if v in produced
            and tuple(v.aval.shape[:-1]) == tuple(lead)
            and v.aval.ndim == len(lead) + 1
            and call.shape_out == tuple(v.aval.shape)
        ]
        if outs:
            hits.append((at[f"{_IN}{k}"], k, outs))
    if not hits:
        seen = ", ".join(sorted({c.name for c in marks.calls})[:8])
        raise ValueError(
            f"the head ({what}) reaches no output shaped as logits {(*lead, 'vocab')} from the model's top level "
            f"(not inside a checkpoint or scan); calls: {seen}"
        )
    if head is not None and len(hits) > 1:
        names = ", ".join(marks.calls[k].name for _, k, _ in hits)
        raise ValueError(f"head={head!r} is called {len(hits)} times on the way to the logits ({names})")
    start, k, outs = max(hits)  # the last such call in program order: the innermost, the head itself
    if len(outs) != 1:
        raise ValueError(f"the head {marks.calls[k].name!r} reaches {len(outs)} outputs shaped as logits")
    logits = jaxpr.outvars[outs[0]]
    h = eqns[start].outvars[0]
    fwd = positions.forward_of(eqns, users, start)
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    back, stack = set(), [producer[logits]] if logits in producer else []
    while stack:
        i = stack.pop()
        if i in back or i not in fwd or i == start:  # the mark itself stays in front: its output is the input
            continue
        back.add(i)
        stack.extend(producer[v] for v in eqns[i].invars if not isinstance(v, jcore.Literal) and v in producer)
    inside = sorted(back)
    body = [eqns[i] for i in inside]
    inputs = [h, *(v for v in positions.inputs_of(body) if v is not h)]
    tail = positions.program(body, inputs, [logits])
    return k, outs[0], tail, inputs


def _front_eqns(jaxpr, outputs) -> list:
    """The equations that compute ``outputs`` (the tail's inputs), in order."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    need, stack = set(), [producer[v] for v in outputs if not isinstance(v, jcore.Literal) and v in producer]
    while stack:
        i = stack.pop()
        if i in need:
            continue
        need.add(i)
        stack.extend(producer[v] for v in jaxpr.eqns[i].invars if not isinstance(v, jcore.Literal) and v in producer)
    return [jaxpr.eqns[i] for i in sorted(need)]
