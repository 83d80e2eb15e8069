"""The one place remat_kit touches private or unstable JAX API.

Everything here is tested directly (tests/test_jax_internals.py) so that a JAX upgrade that moves
these names breaks one module, loudly, rather than skewing figures elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

# jax._src.ad_checkpoint.saved_residuals: the exact list of values the backward pass keeps.
from jax._src.ad_checkpoint import saved_residuals as _saved_residuals


def _tag_of(eqn) -> str | None:
    """The ``checkpoint_name`` tag an equation attaches, or None.

    JAX 0.10 (and 0.11+ by default) binds a primitive named ``name``; under 0.11+'s
    ``JAX_REMAT3=true`` the equation is a ``call_hi_primitive`` whose ``_prim`` is a ``CheckpointName``.
    """
    hi = eqn.params.get("_prim")
    if hi is not None:
        return hi.params.get("name") if type(hi).__name__ == "CheckpointName" else None
    return eqn.params["name"] if eqn.primitive.name == "name" else None


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value the backward pass keeps.

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
        """The checkpoint_name tag, when JAX reports one (``named 'q_proj' from ...``)."""
        prefix = "named '"
        if self.source.startswith(prefix):
            return self.source[len(prefix) :].split("'", 1)[0]
        return None


def saved_residuals(fn: Callable, *args: Any) -> list[Residual]:
    """List what the backward pass of ``fn(*args)`` keeps (args may be ShapeDtypeStructs)."""
    out = []
    for aval, source in _saved_residuals(fn, *args):
        space = str(getattr(aval, "memory_space", "")).lower()
        out.append(
            Residual(
                shape=tuple(int(d) for d in aval.shape),
                dtype=str(aval.dtype),
                nbytes=_nbytes(aval),
                host="host" in space,
                source=str(source),
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


def subjaxprs(eqn) -> Iterator[Any]:
    """The jaxprs nested in one equation's parameters (scan/cond/remat/pjit bodies)."""
    for value in eqn.params.values():
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


def emitted_tags(fn: Callable, *args: Any) -> frozenset[str]:
    """The checkpoint_name tags ``fn(*args)`` attaches (args may be ShapeDtypeStructs)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return frozenset(t for t in map(_tag_of, iter_eqns(jaxpr)) if t is not None)


def count_primitive(jaxpr, name: str, *, top_level: bool = False) -> int:
    """How many equations of primitive ``name`` a jaxpr holds (recursively unless ``top_level``)."""
    eqns = getattr(jaxpr, "jaxpr", jaxpr).eqns if top_level else iter_eqns(jaxpr)
    return sum(1 for e in eqns if e.primitive.name == name)
