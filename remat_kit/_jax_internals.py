"""The one place remat_kit touches private or unstable JAX API.

Everything here is tested directly (tests/test_jax_internals.py) so that a JAX upgrade that moves
these names breaks one module, loudly, rather than skewing figures elsewhere.

JAX has two representations of checkpoint names and rematerialized calls, and remat_kit reads both:

- the classic one (``jax_remat3`` off, the default up to jax 0.12): ``checkpoint_name`` binds the
  ``name`` primitive (``params["name"]``) and ``jax.checkpoint`` binds ``remat2`` (``params["jaxpr"]``);
- remat3 (``JAX_REMAT3=true``, on jax >= 0.10.2): both are ``call_hi_primitive`` equations whose
  ``params["_prim"]`` is a private object, ``CheckpointName`` (its ``params["name"]``) or
  ``RematTraced`` (its ``params["jaxpr"]``, a ``core.Jaxpr``).

JAX offers no public API for either walk, nor for the structured residual list
(``jax.ad_checkpoint.print_saved_residuals`` only prints), so the private reads stay here. So do
the reads of equation structure the FLOP counter needs (``dot_general``'s ``dimension_numbers``, a
scan's ``length``): :mod:`remat_kit.analysis.flops` sees only :func:`eqns`, :func:`dot_shapes` and friends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

# Private module: saved_residuals and the remat3 name classes live here (jax 0.10.2 .. 0.12.x).
from jax._src import ad_checkpoint as _ad_checkpoint

# Private module: where in the user's code an equation was made (user_frame skips JAX's own frames).
from jax._src import source_info_util as _source_info_util

# jax._src.ad_checkpoint.saved_residuals: the exact list of values the backward pass keeps. It
# names a residual kept from checkpoint_name in either representation ("named 'h' from ...").
_saved_residuals = _ad_checkpoint.saved_residuals

# Classic representation: the primitive behind jax.ad_checkpoint.checkpoint_name is named "name".
_NAME_PRIMITIVE = "name"
# remat3 representation: a "higher" primitive whose params["_prim"] is the object that does the work.
_HI_PRIMITIVE = "call_hi_primitive"
_HI_PRIM_PARAM = "_prim"
# The remat3 classes of a checkpoint_name equation (CheckpointNameFwd is jax >= 0.11's
# checkpoint_name_fwd). Looked up, not imported, so that remat_kit still imports on a JAX that
# renames them; tests/test_jax_internals.py then fails and names the JAX version.
_REMAT3_NAME_CLASS_NAMES = ("CheckpointName", "CheckpointNameFwd")
_REMAT3_NAME_CLASSES = tuple(
    getattr(_ad_checkpoint, n) for n in _REMAT3_NAME_CLASS_NAMES if isinstance(getattr(_ad_checkpoint, n, None), type)
)


def under_transform() -> bool:
    """Whether a JAX transform (grad, jit, vmap, ...) is tracing the running Python code.

    Private: ``jax._src.core.trace_state_clean`` (JAX has no public query for it).

    >>> under_transform(), jax.jit(lambda x: (under_transform(), x)[1])(1.0) is not None
    (False, True)
    """
    from jax._src import core as _core

    return not _core.trace_state_clean()


def remat3_enabled() -> bool:
    """Whether ``jax.checkpoint`` currently runs JAX's remat3 implementation (``JAX_REMAT3=true``)."""
    return bool(getattr(jax.config, "jax_remat3", False))


def offload_supported() -> bool:
    """Whether ``jax.checkpoint`` can offload a named value to ``pinned_host`` under the current settings.

    False for remat3 on jax 0.10.x: its ``CheckpointName`` rule knows saveable names only and
    recomputes an offloadable one. Probed by tracing a tiny function (nothing is compiled). The
    package's host-offload rule (:func:`remat_kit.analysis.memory.host_offload`) is the one reader of it.
    """
    return _offload_supported(remat3_enabled())


@functools.cache
def _offload_supported(remat3: bool) -> bool:
    del remat3  # the cache key: the probe's answer depends on the flag, read inside JAX
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["x"], offload_src="device", offload_dst="pinned_host"
    )
    fn = jax.checkpoint(lambda x: jnp.sum(jnp.sin(jax.ad_checkpoint.checkpoint_name(jnp.sin(x), "x"))), policy=policy)
    return any(r.host for r in saved_residuals(fn, jax.ShapeDtypeStruct((2,), jnp.float32)))


@dataclasses.dataclass(frozen=True)
class RawResidual:
    """One value the backward pass keeps, as JAX reports it (before :mod:`remat_kit.analysis.inspection` labels it).

    Attributes:
      shape: the residual's shape (stacked residuals of a scan carry the layer axis first).
      dtype: its dtype name, e.g. ``"float32"``.
      host: True when it lives in a host memory kind (offloaded).
      source: JAX's description of where it comes from.
      nbytes: its size in bytes (PRNG keys count their underlying key data).
      is_argument: True when it is one of the function's own arguments (e.g. parameters), which
        live anyway and cost no activation memory.
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    host: bool
    source: str
    is_argument: bool

    @property
    def tag(self) -> str | None:
        """The checkpoint_name tag, when JAX reports one (``named 'q_proj' from ...``).

        An offloaded residual reports the host copy (``output of device_put``), so it has no tag.
        """
        prefix = "named '"
        if self.source.startswith(prefix):
            return self.source[len(prefix) :].split("'", 1)[0]
        return None


def saved_residuals(fn: Callable, *args: Any) -> list[RawResidual]:
    """List what the backward pass of ``fn(*args)`` keeps (args may be ShapeDtypeStructs)."""
    out = []
    for aval, source in _saved_residuals(fn, *args):
        # MemorySpace.Host when offloaded (only the "pinned_host" memory kind maps there).
        space = str(getattr(aval, "memory_space", "")).lower()
        out.append(
            RawResidual(
                shape=tuple(int(d) for d in aval.shape),
                dtype=str(aval.dtype),
                nbytes=_nbytes(aval),
                host="host" in space,
                source=str(source),
                # "from the argument w" (remat3 on jax 0.10.2: "from the argument args[0]").
                is_argument=str(source).startswith("from the argument"),
            )
        )
    return out


def _nbytes(aval) -> int:
    size = 1
    for d in aval.shape:
        size *= int(d)
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        # An extended key dtype has no itemsize; its data is a uint32 array per key.
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), aval.dtype))
        return size * data.size * data.dtype.itemsize
    return size * aval.dtype.itemsize


def _param_values(eqn) -> Iterator[Any]:
    """An equation's parameter values; for a remat3 ``call_hi_primitive``, those of its ``_prim``."""
    for key, value in eqn.params.items():
        if key == _HI_PRIM_PARAM and eqn.primitive.name == _HI_PRIMITIVE:
            yield from getattr(value, "params", {}).values()
        else:
            yield value


def subjaxprs(eqn) -> Iterator[Any]:
    """The jaxprs nested in one equation's parameters (scan/cond/remat/pjit bodies, both remats)."""
    for value in _param_values(eqn):
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner


def iter_eqns(jaxpr) -> Iterator[Any]:
    """Every equation of a (closed) jaxpr, recursing into scans, remats, pjits and the like."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in subjaxprs(eqn):
            yield from iter_eqns(sub)


def checkpoint_name_of(eqn) -> str | None:
    """The tag a ``checkpoint_name`` equation attaches (either representation), else None."""
    name = eqn.primitive.name
    if name == _NAME_PRIMITIVE:
        return eqn.params["name"]
    if name == _HI_PRIMITIVE and isinstance(eqn.params.get(_HI_PRIM_PARAM), _REMAT3_NAME_CLASSES):
        return eqn.params[_HI_PRIM_PARAM].params["name"]
    return None


def emitted_tags(fn: Callable, *args: Any) -> frozenset[str]:
    """The checkpoint_name tags ``fn(*args)`` attaches (args may be ShapeDtypeStructs)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return frozenset(t for t in map(checkpoint_name_of, iter_eqns(jaxpr)) if t is not None)


def closure_convert_all(fn: Callable, *example: Any) -> tuple[Callable, list]:
    """``jax.closure_convert`` that hoists every closed-over value, integer tracers included.

    ``jax.closure_convert`` leaves values that cannot carry a tangent (integer tracers: NF4 codes, loop
    indices) closed over; a ``jax.custom_vjp`` rule traced later, inside another scan, then finds a tracer of a
    finished trace and lowering fails (``No constant handler for type: DynamicJaxprTracer``). Here the
    function is traced once and each constant of its jaxpr becomes an explicit argument.

    Private: ``jax.core.eval_jaxpr``.

    >>> import jax.numpy as jnp
    >>> k = jnp.int32(3)
    >>> f, consts = closure_convert_all(lambda x: x * k, 2.0)
    >>> float(f(2.0, *consts))
    6.0
    """
    closed = jax.make_jaxpr(fn, return_shape=True)(*example)
    closed, shapes = closed
    in_tree = jax.tree.structure(example)
    out_tree = jax.tree.structure(shapes)

    def converted(*args_consts):
        args, consts = args_consts[: len(example)], args_consts[len(example) :]
        leaves, tree = jax.tree.flatten(tuple(args))
        if tree != in_tree:
            raise TypeError(f"closure_convert_all: arguments {tree} where {in_tree} was traced")
        return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, list(consts), *leaves))

    return converted, list(closed.consts)


def eqns(jaxpr) -> list[Any]:
    """The top-level equations of a jaxpr or closed jaxpr (no recursion; see :func:`iter_eqns`)."""
    return list(getattr(jaxpr, "jaxpr", jaxpr).eqns)


def primitive_name(eqn) -> str:
    """The name of an equation's primitive (``"dot_general"``, ``"scan"``, ``"cond"``, ...)."""
    return eqn.primitive.name


@dataclasses.dataclass(frozen=True)
class DotShapes:
    """The operand shapes of one ``dot_general`` and the dimensions of ``rhs`` it contracts or batches.

    Attributes:
      lhs, rhs: the two operands' shapes.
      rhs_contracting, rhs_batch: axes of ``rhs`` that are contracted, and batch axes.
    """

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    rhs_batch: tuple[int, ...]


def dot_shapes(eqn) -> DotShapes | None:
    """What a ``dot_general`` equation multiplies (its params' ``dimension_numbers``); None for others."""
    if eqn.primitive.name != "dot_general":
        return None
    lhs, rhs = (tuple(int(d) for d in v.aval.shape) for v in eqn.invars[:2])
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    return DotShapes(lhs, rhs, tuple(int(d) for d in rhs_contract), tuple(int(d) for d in rhs_batch))


def matmul_flops(eqn) -> int:
    """FLOPs of one ``dot_general`` equation (2 · M · N · K, batch dimensions included); 0 for any other.

    >>> import jax, jax.numpy as jnp
    >>> matmul_flops(eqns(jax.make_jaxpr(jnp.matmul)(jnp.ones((2, 3)), jnp.ones((3, 4))))[0])
    48
    """
    dot = dot_shapes(eqn)
    if dot is None:
        return 0
    rhs_free = [d for i, d in enumerate(dot.rhs) if i not in dot.rhs_contracting and i not in dot.rhs_batch]
    size = 1
    for d in (*dot.lhs, *rhs_free):
        size *= d
    return 2 * size


def scan_length(eqn) -> int | None:
    """The trip count of a ``scan`` equation (its ``length`` param); None for other equations."""
    if eqn.primitive.name != "scan":
        return None
    return int(eqn.params["length"])


def count_primitive(jaxpr, name: str, *, top_level: bool = False) -> int:
    """How many equations of primitive ``name`` a jaxpr holds (recursively unless ``top_level``).

    A remat3 rematerialized call counts as ``call_hi_primitive``; its body is walked like a
    ``remat2`` body.
    """
    found = eqns(jaxpr) if top_level else iter_eqns(jaxpr)
    return sum(1 for e in found if e.primitive.name == name)


def weighted_leaf_eqns(jaxpr, times: int = 1) -> Iterator[tuple[Any, int]]:
    """Every leaf equation of a (closed) jaxpr with how many times one run executes it.

    A ``scan`` body counts ``length`` times per run of the scan; remat/checkpoint bodies (both
    representations), pjit and custom-derivative calls are walked once per call; every ``cond``
    branch is walked (an upper bound), a ``while`` body once (its trip count is unknown). Container
    equations (those holding sub-jaxprs) are not yielded themselves.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        subs = list(subjaxprs(eqn))
        if not subs:
            yield eqn, times
            continue
        inner = times * int(eqn.params["length"]) if eqn.primitive.name == "scan" else times
        for sub in subs:
            yield from weighted_leaf_eqns(sub, inner)


def loop_trips(jaxpr, times: int = 1) -> int:
    """How many scan trips one run of a (closed) jaxpr executes, nested scans multiplied out (a ``while``: once).

    >>> import jax, jax.numpy as jnp
    >>> inner = lambda c, _: (c + 1.0, None)
    >>> outer = lambda c, _: (jax.lax.scan(inner, c, None, length=3)[0], None)
    >>> loop_trips(jax.make_jaxpr(lambda x: jax.lax.scan(outer, x, None, length=2)[0])(0.0))
    8
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        inner = times * int(eqn.params["length"]) if eqn.primitive.name == "scan" else times
        if eqn.primitive.name == "scan":
            total += inner
        for sub in subjaxprs(eqn):
            total += loop_trips(sub, inner)
    return total


def aval_nbytes(var) -> int:
    """Bytes of one jaxpr variable's (or literal's) abstract value; 0 for tokens and other non-arrays."""
    aval = getattr(var, "aval", None)
    if aval is None or not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
        return 0
    try:
        return _nbytes(aval)
    except (TypeError, AttributeError):
        return 0


def is_host_transfer(eqn) -> bool:
    """Whether an equation copies between device and host memory (an offload's ``device_put`` either way).

    Remat's offload binds ``device_put`` with ``devices=(MemorySpace.Host,)`` going out and
    ``(MemorySpace.Device,)`` coming back; a plain ``device_put`` names devices or shardings instead.
    """
    if eqn.primitive.name != "device_put":
        return False
    return any(type(d).__name__ == "MemorySpace" for d in eqn.params.get("devices", ()))


# The rematerialized-call primitives whose params["jaxpr"] is the body: classic remat ("checkpoint" is
# jax.checkpoint's public name for the same primitive in some versions) and remat3's RematTraced.
_REMAT_PRIMITIVES = ("remat2", "checkpoint")
_REMAT3_CALL_CLASS_NAME = "RematTraced"


def first_remat_body(jaxpr):
    """The body of the first rematerialized call in a (closed) jaxpr, as a ClosedJaxpr, or None.

    Either representation: a ``remat2`` equation's ``params["jaxpr"]`` or a remat3
    ``call_hi_primitive`` whose ``_prim`` is ``RematTraced``.
    """
    for eqn in iter_eqns(jaxpr):
        body = _remat_body(eqn)
        if body is not None:
            return body
    return None


def _remat_body(eqn):
    """The body of a rematerialized-call equation (either representation) as a ClosedJaxpr; None for others."""
    from jax.extend import core as _core  # ClosedJaxpr: public in jax.extend, its constructor is not

    name = eqn.primitive.name
    body = None
    if name in _REMAT_PRIMITIVES:
        body = eqn.params["jaxpr"]
    elif name == _HI_PRIMITIVE and type(eqn.params.get(_HI_PRIM_PARAM)).__name__ == _REMAT3_CALL_CLASS_NAME:
        body = eqn.params[_HI_PRIM_PARAM].params["jaxpr"]
    if body is None:
        return None
    return body if hasattr(body, "consts") else _core.ClosedJaxpr(body, ())


remat_body = _remat_body  # public: positions evaluates a checkpoint's body inline, either representation


# Loops: XLA does not merge a loop body's recompute with the forward pass (they run in different loops).
_LOOPS = frozenset({"scan", "while"})


def remat_outside_loops(jaxpr) -> bool:
    """Whether a (closed) jaxpr rematerializes anything outside a loop (scan, while), where XLA may CSE the
    recompute with the forward pass (XLA:CPU does in a Python loop of blocks).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda x: jnp.sum(jax.checkpoint(jnp.sin)(x))
    >>> remat_outside_loops(jax.make_jaxpr(f)(1.0))
    True
    >>> g = lambda x: jnp.sum(jax.lax.scan(lambda c, _: (jax.checkpoint(jnp.sin)(c), None), x, None, 2)[0])
    >>> remat_outside_loops(jax.make_jaxpr(g)(1.0))
    False
    """
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if _remat_body(eqn) is not None:
            return True
        if eqn.primitive.name not in _LOOPS and any(remat_outside_loops(sub) for sub in subjaxprs(eqn)):
            return True
    return False


def without_remat(fn: Callable) -> Callable:
    """``fn`` with every rematerialized call outside a loop evaluated inline: the same values and gradient, as
    ``fn`` computes them without those remats (the ``none`` of the same function; remats inside a loop stay).

    ``fn`` takes and returns pytrees of arrays.

    >>> import jax, jax.numpy as jnp
    >>> f = lambda x: jnp.sum(jax.checkpoint(jnp.sin)(x))
    >>> remat_outside_loops(jax.make_jaxpr(without_remat(f))(1.0)), float(without_remat(f)(0.0))
    (False, 0.0)
    """

    def stripped(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _eval_inline_remat(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return stripped


def _eval_inline_remat(jaxpr, consts, args, *, keep_own: bool = False) -> list[Any]:
    from jax.extend import core as jex_core

    outside_loops = _foreign_outside_loops if keep_own else remat_outside_loops

    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        body = _remat_body(eqn)
        inner = eqn.params.get("jaxpr")
        if body is not None and not (keep_own and is_own_remat(eqn)):
            outs = _eval_inline_remat(body.jaxpr, body.consts, invals, keep_own=keep_own)
        elif eqn.primitive.name in _INLINE_CALLS and hasattr(inner, "consts") and outside_loops(inner):
            outs = _eval_inline_remat(inner.jaxpr, inner.consts, invals, keep_own=keep_own)
        else:
            outs = rebind(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def rebind(eqn, invals: list[Any], **params: Any) -> list[Any]:
    """Bind ``eqn``'s primitive again on ``invals``, with ``params`` replacing some of its own (a shape at a
    new size); remat_kit's own remat keeps its mark. Private: ``eqn.ctx`` and ``get_bind_params`` (how
    ``jax.core.eval_jaxpr`` re-binds; JAX has no public re-bind of an equation).

    >>> eqn = jax.make_jaxpr(lambda x: jnp.broadcast_to(x, (3,)))(1.0).eqns[0]
    >>> rebind(eqn, [2.0], shape=(2,))[0].tolist()
    [2.0, 2.0]
    """
    own = jax.named_scope(OWN_SCOPE) if is_own_remat(eqn) else contextlib.nullcontext()
    # The equation keeps its user frame (error messages name the model's line, not this one).
    with eqn.ctx.manager, _source_info_util.user_context(eqn.source_info.traceback), own:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params({**eqn.params, **params}))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def eqn_source(eqn) -> str:
    """``file.py:line`` of the user's code that made ``eqn`` (JAX's own frames skipped), or ``""``.
    Private: ``jax._src.source_info_util.user_frame``.

    >>> eqn_source(jax.make_jaxpr(jnp.sin)(1.0).eqns[0])  # a doctest has no file of its own
    ''
    """
    frame = _source_info_util.user_frame(eqn.source_info.traceback)
    return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}" if frame else ""


# ---- remat_kit's own checkpoints beside the model's (issue 45: a model's own remat seen through) ---------
#
# A rematerialized call remat_kit makes is bound inside a named scope of this name, so its equation's name stack
# ends with it (either representation; the policy object stays JAX's): every other rematerialized call in a
# model's jaxpr is the model's own, which would keep or override remat_kit's policy where the two nest.
OWN_SCOPE = "remat_kit_policy"


def own_checkpoint(fn: Callable, policy: Callable | None, *, prevent_cse: bool = True) -> Callable:
    """``jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)`` with its equation marked as remat_kit's.

    >>> import jax, jax.numpy as jnp
    >>> f = own_checkpoint(jnp.sin, None)
    >>> [is_own_remat(e) for e in iter_eqns(jax.make_jaxpr(f)(1.0)) if _remat_body(e) is not None]
    [True]
    """
    checkpointed = jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)

    @functools.wraps(fn)
    def run(*args):
        with jax.named_scope(OWN_SCOPE):
            return checkpointed(*args)

    return run


def own_nothing_saveable(*_: Any, **__: Any) -> bool:
    """``nothing_saveable`` that marks its checkpoint as remat_kit's (:func:`is_own_remat`) where no named scope
    can: a checkpoint made inside a scan body (a tile's, :func:`remat_kit.policies.positions.blocked`), whose
    equation's name stack starts afresh in the body.

    >>> f = jax.checkpoint(jnp.sin, policy=own_nothing_saveable)
    >>> [is_own_remat(e) for e in jax.make_jaxpr(f)(1.0).eqns]
    [True]
    """
    return False


def is_own_remat(eqn) -> bool:
    """Whether a rematerialized-call equation is one :func:`own_checkpoint` made (or a tile's, marked by its
    policy :func:`own_nothing_saveable`)."""
    params = eqn.params
    if eqn.primitive.name == _HI_PRIMITIVE and hasattr(params.get(_HI_PRIM_PARAM), "params"):
        params = params[_HI_PRIM_PARAM].params  # remat3: the policy sits on the RematTraced object
    if params.get("policy") is own_nothing_saveable:
        return True
    return str(eqn.source_info.name_stack).rsplit("/", 1)[-1] == OWN_SCOPE


@dataclasses.dataclass(frozen=True)
class RematNesting:
    """Where a model's own rematerialized calls sit beside remat_kit's, in one traced forward pass.

    Attributes:
      own: remat_kit's rematerialized calls (:func:`own_checkpoint`), per run (scan bodies once).
      own_flops: matmul FLOPs inside them, scan trips counted.
      total_flops: matmul FLOPs of the whole forward pass, scan trips counted.
      foreign: the model's own rematerialized calls (``jax.checkpoint``, ``nn.remat``, ``nnx.remat``).
      nested: of those, the ones that enclose one of remat_kit's or sit inside one (they decide what is kept).
      nested_in_loops: of ``nested``, those inside a loop body (a scan's), which cannot be seen through.
    """

    own: int
    own_flops: int
    total_flops: int
    foreign: int
    nested: int
    nested_in_loops: int


def remat_nesting(jaxpr) -> RematNesting:
    """Count remat_kit's and the model's own rematerialized calls in a (closed) jaxpr, and how they nest.

    >>> import jax, jax.numpy as jnp
    >>> inner = own_checkpoint(lambda x: x @ x, None)
    >>> n = remat_nesting(jax.make_jaxpr(jax.checkpoint(inner))(jnp.ones((2, 2))))
    >>> n.own, n.foreign, n.nested, n.own_flops
    (1, 1, 1, 16)
    """
    counts = dict.fromkeys(("own", "own_flops", "total_flops", "foreign", "nested", "nested_in_loops"), 0)

    def walk(jx, times: int, in_own: bool, in_loop: bool) -> bool:
        contains_own = False
        for eqn in getattr(jx, "jaxpr", jx).eqns:
            flops = matmul_flops(eqn) * times
            counts["total_flops"] += flops
            counts["own_flops"] += flops if in_own else 0
            body = _remat_body(eqn)
            if body is not None:
                if is_own_remat(eqn):
                    counts["own"] += 1
                    walk(body, times, True, in_loop)
                    contains_own = True
                else:
                    counts["foreign"] += 1
                    inner_own = walk(body, times, in_own, in_loop)
                    if inner_own or in_own:
                        counts["nested"] += 1
                        counts["nested_in_loops"] += int(in_loop)
                    contains_own |= inner_own
                continue
            loop = eqn.primitive.name in _LOOPS
            inner_times = times * int(eqn.params["length"]) if eqn.primitive.name == "scan" else times
            for sub in subjaxprs(eqn):
                contains_own |= walk(sub, inner_times, in_own, in_loop or loop)
        return contains_own

    walk(jaxpr, 1, False, False)
    return RematNesting(**counts)


def scoped_flops(jaxpr, prefix: str) -> dict[int, int]:
    """Matmul FLOPs (scan trips counted) under each named scope ``f"{prefix}{i}"`` of a (closed) jaxpr: ``{i: FLOPs}``.

    A matmul counts for every such scope it sits in (a module's and its submodules'). Nested jaxprs carry their
    name stacks relative to the equation that holds them, so the walk joins them.

    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     with jax.named_scope("m0"):
    ...         with jax.named_scope("m1"):
    ...             x = x @ x
    ...         return jax.jit(lambda y: y @ y)(x)
    >>> scoped_flops(jax.make_jaxpr(f)(jnp.ones((2, 2))), "m")
    {0: 32, 1: 16}
    """
    out: dict[int, int] = {}

    def scopes(stack: str) -> set[int]:
        found = set()
        for part in stack.split("/"):
            for piece in re.findall(re.escape(prefix) + r"(\d+)", part):
                found.add(int(piece))
        return found

    def walk(jx, outer: str, times: int) -> None:
        for eqn in getattr(jx, "jaxpr", jx).eqns:
            stack = f"{outer}/{eqn.source_info.name_stack}"
            flops = matmul_flops(eqn) * times
            if flops:
                for i in scopes(stack):
                    out[i] = out.get(i, 0) + flops
            inner = times * int(eqn.params["length"]) if eqn.primitive.name == "scan" else times
            for sub in subjaxprs(eqn):
                walk(sub, stack, inner)

    walk(jaxpr, "", 1)
    return dict(sorted(out.items()))


def own_remat_bodies(jaxpr, times: int = 1, scan: int | None = None) -> Iterator[tuple[Any, int, int | None]]:
    """remat_kit's rematerialized calls in a (closed) jaxpr: ``(body, runs, scan)`` each, outermost only.

    ``runs``: how many times one run of the jaxpr executes the call (scan trips multiplied out); ``scan``: the
    length of the innermost scan holding it (None outside scans).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda x: jax.lax.scan(lambda c, _: (own_checkpoint(jnp.sin, None)(c), None), x, None, 3)[0]
    >>> [(runs, scan) for _, runs, scan in own_remat_bodies(jax.make_jaxpr(f)(1.0))]
    [(3, 3)]
    """
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        body = _remat_body(eqn)
        if body is not None and is_own_remat(eqn):
            yield body, times, scan
            continue
        length = scan_length(eqn)
        for sub in subjaxprs(eqn):
            yield from own_remat_bodies(sub, times * (length or 1), length or scan)


def _foreign_outside_loops(jaxpr) -> bool:
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if _remat_body(eqn) is not None and not is_own_remat(eqn):
            return True
        if eqn.primitive.name not in _LOOPS and any(_foreign_outside_loops(sub) for sub in subjaxprs(eqn)):
            return True
    return False


def without_foreign_remat(fn: Callable) -> Callable:
    """``fn`` with the code's own rematerialized calls outside loops evaluated inline, remat_kit's kept.

    The values and gradients are ``fn``'s; only what the backward pass keeps changes: remat_kit's policy
    replaces the model's own ``jax.checkpoint`` where the two nest. ``fn`` takes and returns pytrees of arrays.

    >>> import jax, jax.numpy as jnp
    >>> f = jax.checkpoint(own_checkpoint(jnp.sin, None))
    >>> n = remat_nesting(jax.make_jaxpr(without_foreign_remat(f))(1.0))
    >>> n.own, n.foreign
    (1, 0)
    """

    def stripped(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _eval_inline_remat(closed.jaxpr, closed.consts, jax.tree.leaves(args), keep_own=True)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return stripped


def vjp_jaxpr(body, policy: Callable | None):
    """The jaxpr of the forward and backward pass of ``body`` (a ClosedJaxpr) under ``jax.checkpoint(policy)``
    (no checkpoint for None): ``jax.vjp`` of the body with its outputs as cotangents."""
    from jax.extend import core as _core

    fn = _core.jaxpr_as_fun(body)
    if policy is not None:
        fn = jax.checkpoint(fn, policy=policy)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]

    def forward_backward(*args):
        out, pull = jax.vjp(fn, *args)
        return pull(out)

    return jax.make_jaxpr(forward_backward)(*avals)


@dataclasses.dataclass(frozen=True)
class ScanBody:
    """What one trip of a ``scan`` body keeps for its backward pass (:func:`scan_body_residuals`).

    Attributes:
      lengths: the trip counts of the scans around it and its own, outermost first: a residual the body keeps
        comes out of the scans stacked on (a suffix of) these axes.
      residuals: :func:`saved_residuals` of the body alone that are no input of it, every floating input
        differentiated (the scan's own policy, inside its body, applies).
      carried: the loop-carried inputs it keeps (a layer's input, in a stack of layers).
    """

    lengths: tuple[int, ...]
    residuals: tuple[RawResidual, ...]
    carried: tuple[RawResidual, ...]


def scan_body_residuals(jaxpr, lengths: tuple[int, ...] = ()) -> list[ScanBody]:
    """:class:`ScanBody` of every ``scan`` in a (closed) jaxpr, nested ones included, outermost first.

    JAX reports a scan's residuals stacked and untagged (``output of scan``); its body analysed alone names them
    (``named 'mlp_up'``). Private reads: a ``scan`` equation's ``jaxpr`` and how its inputs split into consts,
    carry and xs (jax 0.10's ``num_consts``/``num_carry``, jax 0.12's ``ft_in``).
    A body whose residuals cannot be traced alone (an input of a dtype with no zeros, such as a PRNG key) is
    left out: its residuals keep JAX's own description.
    """
    from jax.extend import core as _core

    out = []
    for eqn in eqns(jaxpr):
        n = scan_length(eqn)
        if n is None:
            for sub in subjaxprs(eqn):
                out += scan_body_residuals(sub, lengths)
            continue
        body = eqn.params["jaxpr"]
        consts, carry = _scan_split(eqn)
        try:
            kept = _body_residuals(body if hasattr(body, "consts") else _core.ClosedJaxpr(body, ()))
        except Exception:  # labels only: a body JAX cannot linearize alone keeps JAX's own descriptions
            kept = None
        if kept is not None:
            carried = tuple(r for k, r in kept if k is not None and consts <= k < consts + carry)
            out.append(ScanBody((*lengths, n), tuple(r for k, r in kept if not r.is_argument), carried))
        out += scan_body_residuals(body, (*lengths, n))
    return out


def _scan_split(eqn) -> tuple[int, int]:
    """``(consts, carry)`` input counts of a ``scan`` equation: jax 0.10's ``num_consts``/``num_carry`` params, or
    jax 0.12's ``ft_in`` (consts, carry, xs)."""
    if "num_consts" in eqn.params:
        return int(eqn.params["num_consts"]), int(eqn.params["num_carry"])
    consts, carry, _ = (len(part) for part in eqn.params["ft_in"].unpack())
    return consts, carry


def _body_residuals(body) -> list[tuple[int | None, RawResidual]]:
    """saved_residuals of a ClosedJaxpr as a function of its floating inputs (the others held at zero), each with
    the position of the body input it is (None for one computed in the body)."""
    from jax.extend import core as _core

    fn = _core.jaxpr_as_fun(body)
    avals = [v.aval for v in body.jaxpr.invars]
    floats = [i for i, a in enumerate(avals) if jnp.issubdtype(a.dtype, jnp.inexact)]

    def f(*xs):
        full = [None if i in floats else jnp.zeros(a.shape, a.dtype) for i, a in enumerate(avals)]
        for i, x in zip(floats, xs, strict=True):
            full[i] = x
        return [o for o in fn(*full) if jnp.issubdtype(o.dtype, jnp.inexact)]

    found = saved_residuals(f, *(jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype) for i in floats))
    # "from the argument xs[3]": the position among the floating inputs, back to the body's own.
    out = []
    for r in found:
        k = _argument_index(r.source) if r.is_argument else None
        out.append((floats[k] if k is not None and k < len(floats) else None, r))
    return out


def _argument_index(source: str) -> int | None:
    """The flat position in ``"from the argument xs[3]"`` / ``"... args[3]"`` (JAX's descriptions), else None."""
    import re

    m = re.search(r"\[(\d+)\]$", source)
    return int(m.group(1)) if m and source.startswith("from the argument") else None


def save_only_names(policy: Any) -> frozenset[str] | None:
    """The names a policy built by ``jax.checkpoint_policies.save_only_these_names`` saves, else None.

    JAX keeps them privately: jax 0.10 returns a ``SaveOnlyTheseNames`` dataclass (its field
    ``saveable_names``), jax 0.12 a closure ``save_only_these_names.<locals>.policy`` over a set.

    >>> sorted(save_only_names(jax.checkpoint_policies.save_only_these_names("k", "q")))
    ['k', 'q']
    >>> save_only_names(jax.checkpoint_policies.dots_saveable) is None
    True
    """
    names = getattr(policy, "saveable_names", None)
    if type(policy).__name__ == "SaveOnlyTheseNames" and isinstance(names, (set, frozenset)):
        return frozenset(names)
    closure = getattr(policy, "__closure__", None) or ()
    if getattr(policy, "__qualname__", "").startswith("save_only_these_names."):
        for cell in closure:
            value = cell.cell_contents
            if isinstance(value, (set, frozenset)) and all(isinstance(n, str) for n in value):
                return frozenset(value)
    return None


# ---- naming matmuls by the parameter they consume ---------------------------------------------------

# Equations whose output is still "the parameter" for naming purposes (a cast to the compute dtype, a
# reshape or transpose of the weight before its matmul).
_WEIGHT_VIEWS = frozenset(
    {"convert_element_type", "reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "copy"}
)
# Call equations whose body is evaluated inline, so a matmul inside jnp.einsum's jit is reached.
_INLINE_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})


def name_param_matmuls(fn: Callable, leaf_names: list[str | None], *args: Any) -> tuple[Callable, Any]:
    """``fn`` traced once at ``args``, with each ``dot_general`` that consumes a named input leaf tagged.

    ``fn`` is traced to a jaxpr (``jax.make_jaxpr``) and evaluated again equation by equation; a
    matmul whose operand is a named input (or a cast, reshape or transpose of one) has its output
    wrapped in ``checkpoint_name(out, name)``. Every other equation (the code's own tags included) is
    bound unchanged, so values and gradients are those of ``fn``. Tracing once matters: ``fn`` may
    have side effects on trace (Flax counts RNG draws), which a second trace would repeat.

    Args:
      fn: a function of pytrees; its non-array input and output leaves are Python constants.
      leaf_names: one name or None per leaf of ``args`` (flattened).
      *args: the arguments (arrays or tracers) the result will be called with.

    Returns:
      ``(run, jaxpr)``: ``run(*args)`` computes ``fn(*args)`` with the names (it evaluates ``jaxpr``,
      touching nothing of ``fn``'s); ``jaxpr`` is the named closed jaxpr (for :func:`jaxpr_tags`). The code's
      own rematerialized calls (outside loops) are evaluated inline, so a policy around ``fn`` decides what
      its backward pass keeps; ``run.seen_through`` counts them.
    """
    leaves, treedef = jax.tree.flatten(args)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    statics: dict[str, Any] = {}

    def flat(*arrays):
        full = list(leaves)
        for i, a in zip(at, arrays, strict=True):
            full[i] = a
        out_leaves, out_tree = jax.tree.flatten(fn(*jax.tree.unflatten(treedef, full)))
        statics["tree"], statics["leaves"] = out_tree, out_leaves
        return [o for o in out_leaves if isinstance(o, jax.Array)]

    arrays = [leaves[i] for i in at]
    closed = jax.make_jaxpr(flat)(*arrays)
    names = [leaf_names[i] for i in at]
    named = jax.make_jaxpr(lambda *a: _eval_naming(closed.jaxpr, closed.consts, a, names))(*arrays)

    def run(*call_args):
        call_leaves = jax.tree.leaves(call_args)
        outs = iter(_eval_naming(named.jaxpr, named.consts, [call_leaves[i] for i in at], [None] * len(at)))
        rebuilt = [next(outs) if isinstance(o, jax.Array) else o for o in statics["leaves"]]
        return jax.tree.unflatten(statics["tree"], rebuilt)

    run.seen_through = _count_inlined(closed)  # the code's own remats the naming evaluated inline
    return run, named


def _count_inlined(jaxpr) -> int:
    """How many of the code's own rematerialized calls :func:`_eval_naming` evaluates inline (outside loops)."""
    total = 0
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        body = _remat_body(eqn)
        if body is not None and not is_own_remat(eqn):
            total += 1 + _count_inlined(body)
        elif eqn.primitive.name in _INLINE_CALLS and hasattr(eqn.params.get("jaxpr"), "consts"):
            total += _count_inlined(eqn.params["jaxpr"])
    return total


def jaxpr_tags(jaxpr) -> list[tuple[str, tuple[int, ...], str, int]]:
    """``(tag, shape, dtype, bytes)`` of each ``checkpoint_name`` in a jaxpr, in order, once per tag."""
    found: dict[str, tuple[str, tuple[int, ...], str, int]] = {}
    for eqn in iter_eqns(jaxpr):
        tag = checkpoint_name_of(eqn)
        if tag is not None and tag not in found:
            aval = eqn.outvars[0].aval
            found[tag] = (tag, tuple(int(d) for d in aval.shape), str(aval.dtype), _nbytes(aval))
    return list(found.values())


def _eval_naming(jaxpr, consts, args, names) -> list[Any]:
    from jax.ad_checkpoint import checkpoint_name
    from jax.extend import core as jex_core

    env: dict[Any, Any] = {}
    source: dict[Any, str] = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    for v, a, n in zip(jaxpr.invars, args, names, strict=True):
        env[v] = a
        if n:
            source[v] = n
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        insrc = [None if isinstance(v, jex_core.Literal) else source.get(v) for v in eqn.invars]
        prim = eqn.primitive.name
        inner = eqn.params.get("jaxpr")
        body = _remat_body(eqn)
        if body is not None and not is_own_remat(eqn):  # the code's own remat: remat_kit's policy replaces it
            outs = _eval_naming(body.jaxpr, body.consts, invals, insrc)
        elif prim in _INLINE_CALLS and hasattr(inner, "consts") and (any(insrc) or _foreign_outside_loops(inner)):
            outs = _eval_naming(inner.jaxpr, inner.consts, invals, insrc)
        else:
            outs = rebind(eqn, invals)
            if prim == "dot_general" and (insrc[1] or insrc[0]):
                outs = [checkpoint_name(outs[0], insrc[1] or insrc[0])]
            elif prim in _WEIGHT_VIEWS and insrc and insrc[0]:
                source[eqn.outvars[0]] = insrc[0]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


# ---- Linen RNG keys of layer i inside one scan (flax.core.scope.LazyRng, private) -------------------
#
# Flax Linen derives a module's key from the root key and its whole path, hashed at once when drawn
# (``LazyRng.as_jax_rng``: one SHA-1 over the suffix ``(layer_3, Dropout_0, 1)``): no per-layer key
# can be folded on by the layer. remat_kit's unedited Linen scan (remat_kit.unedited.linen) runs layer i of a
# run of identical blocks as one functional ``apply`` whose RNG streams carry a marker instead of the
# layer's name; while :func:`linen_layer_rngs` is active, drawing from such a stream computes every
# layer's plain key (the suffix with each layer's name) and picks layer i's, so the draws equal the
# plain model's.


class _LayerMarker:
    """The first suffix item of a layer-indexed stream (never hashed: it is replaced before)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<remat_kit layer>"


_LAYER_MARK = _LayerMarker()
_LAYER_RNG: Any = None  # (prefixes, index) while a layer's apply traces; set by linen_layer_rngs


def linen_block_rngs(scope: Any, names: list[str]) -> tuple[dict, list[tuple] | None]:
    """The RNG streams of a Linen block's scope, marked for :func:`linen_layer_rngs`, and each layer's prefix.

    Args:
      scope: the bound scope of the first block of a run (``module.scope``).
      names: the names of the run's blocks (siblings under one parent), in order.

    Returns:
      ``(rngs, prefixes)``: ``rngs`` to pass to the layer's ``apply``; ``prefixes[k]``: the path suffix
      of block ``k``'s streams (None when there are no streams).

    Raises:
      ValueError: the streams are not the plain per-path ones (the block already drew from one, or
        its streams carry different paths), so the plain keys cannot be reproduced.
    """
    from flax.core import scope as flax_scope

    rngs, suffixes = {}, set()
    for stream, rng in dict(scope.rngs).items():
        lazy = flax_scope.LazyRng.create(rng)
        if not lazy.suffix or lazy.suffix[-1] != names[0] or scope.rng_counters.get(stream, 0):
            raise ValueError(
                f"scan=True: the RNG stream {stream!r} of block {names[0]} is not derived from its path alone "
                "(it was drawn from, or the block runs inside another transform); use scan=False"
            )
        suffixes.add(lazy.suffix[:-1])
        rngs[stream] = flax_scope.LazyRng(lazy.rng, (_LAYER_MARK,))
    if len(suffixes) > 1:
        raise ValueError(f"scan=True: the RNG streams of block {names[0]} carry different paths; use scan=False")
    if not suffixes:
        return rngs, None
    prefix = next(iter(suffixes))
    return rngs, [(*prefix, name) for name in names]


class linen_layer_rngs:
    """Context: a stream from :func:`linen_block_rngs` draws layer ``index``'s plain key (a traced int).

    Re-entrant; Flax's ``LazyRng.as_jax_rng`` is wrapped only while one is active.
    """

    _depth = 0
    _original: Any = None

    def __init__(self, prefixes: list[tuple] | None, index: Any):
        self.value = (prefixes, index)

    def __enter__(self):
        global _LAYER_RNG
        from flax.core import scope as flax_scope

        cls = type(self)
        if cls._depth == 0:
            cls._original = original = flax_scope.LazyRng.as_jax_rng

            def as_jax_rng(lazy):
                if not lazy.suffix or lazy.suffix[0] is not _LAYER_MARK:
                    return original(lazy)
                prefixes, index = _LAYER_RNG
                keys = [original(flax_scope.LazyRng(lazy.rng, (*p, *lazy.suffix[1:]))) for p in prefixes]
                return jnp.stack(keys)[index]

            flax_scope.LazyRng.as_jax_rng = as_jax_rng
        cls._depth += 1
        self.outer, _LAYER_RNG = _LAYER_RNG, self.value
        return self

    def __exit__(self, *exc):
        global _LAYER_RNG
        from flax.core import scope as flax_scope

        cls = type(self)
        _LAYER_RNG = self.outer
        cls._depth -= 1
        if cls._depth == 0:
            flax_scope.LazyRng.as_jax_rng = cls._original


# ---- Flax lifted transforms already on an unedited model (remat_kit.apply) --------------------------


def _linen_transforms_file() -> str:
    from flax.linen import transforms

    return transforms.__file__


def linen_transform(fn: Any) -> str | None:
    """The Flax lifted transform a Linen method is wrapped in (``"jit"``, ``"checkpoint"``, ``"vmap"`` ...), or None.

    ``nn.jit``/``nn.remat``/``nn.vmap`` on a method (or on a class, for its ``__call__``) replace it by a
    ``wrapped_fn`` of :mod:`flax.linen.transforms` that holds the transform in its closure; Flax offers no
    public way to ask.
    """
    code = getattr(fn, "__code__", None)
    if code is None or code.co_filename != _linen_transforms_file() or code.co_name != "wrapped_fn":
        return None
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True))
    transform = cells["transform"].cell_contents if "transform" in cells else None
    return getattr(transform, "__name__", "transform")


def linen_see_through_jit(fn: Callable) -> Callable:
    """``fn``, an ``nn.jit``-wrapped Linen method, as a plain method: ``method(module, *args, **kwargs)``.

    ``nn.jit`` caches its trace by the module and the arguments' shapes, not by the method interceptors
    active while it traced, so a model traced once plainly replays the plain trace (and one traced under
    :func:`remat_kit.apply` would replay that). Under an outer ``jax.jit`` (a training step) the inner jit
    compiles nothing of its own, so running the method unjitted changes no value; its RNG streams are forked
    as ``nn.jit`` forks them, so dropout draws the same keys.
    """
    from flax.linen import transforms

    inner = fn.__wrapped__

    def method(module, *args, **kwargs):
        with transforms.fork_rngs(module):
            return inner(module, *args, **kwargs)

    method.__name__ = inner.__name__
    return method


def linen_transforms_around() -> list[tuple[str, str]]:
    """``(transform, "Class.method")`` of each Flax lifted transform the running Python call is inside,
    innermost first (read from the call stack: Flax keeps no record of it); remat_kit's own are left out."""
    import sys

    found, path = [], _linen_transforms_file()
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == path and code.co_name == "wrapped_fn":
            local = frame.f_locals
            transform = local.get("transform")
            if not getattr(transform, "__module__", "").startswith("remat_kit"):
                module = local.get("self")
                fns = local.get("prewrapped_fns") or [local.get("fn")]
                method = local.get("fn_name") or getattr(fns[0], "__name__", "?")
                found.append((getattr(transform, "__name__", "transform"), f"{type(module).__name__}.{method}"))
        frame = frame.f_back
    return found


#: NNX's wrappers around every transform (argument plumbing), not a transform of their own.
_NNX_PLUMBING = ("resolve_kwargs", "update_context_manager", "split_inputs", "merge_inputs")


def nnx_transform(fn: Any) -> str | None:
    """The Flax NNX transform a method is decorated with (``"jit"``, ``"remat"``, ``"vmap"`` ...), or None.

    ``nnx.jit`` leaves a ``JitWrapped`` object; the others a wrapper function of :mod:`flax.nnx` whose
    closures end in ``<transform>_wrapper``. Flax offers no public way to ask.
    """
    import os

    from flax import nnx

    if type(fn).__name__ == "JitWrapped":
        return "jit"
    root = os.path.dirname(nnx.__file__)
    code = getattr(fn, "__code__", None)
    if code is None or not code.co_filename.startswith(root) or not hasattr(fn, "__wrapped__"):
        return None
    todo, seen = [fn], set()
    while todo:
        f = todo.pop(0)
        if id(f) in seen or len(seen) > 32:
            continue
        seen.add(id(f))
        name = getattr(getattr(f, "__code__", None), "co_name", "")  # __name__ is the method's (functools.wraps)
        if name.endswith("_wrapper") and name[: -len("_wrapper")] not in _NNX_PLUMBING:
            return name[: -len("_wrapper")].removeprefix("simple_")
        for cell in getattr(f, "__closure__", None) or ():
            value = cell.cell_contents
            if callable(value) and getattr(getattr(value, "__code__", None), "co_filename", "").startswith(root):
                todo.append(value)
    return "transform"
