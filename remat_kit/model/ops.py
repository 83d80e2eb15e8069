"""The lean block's primitives: three ``jax.custom_vjp`` functions whose backward pass keeps what we choose.

Autodiff of a mixed-precision layer keeps more than its backward pass needs (a compute-dtype copy of
every weight, float32 norm statistics, silu's intermediates). Each function here computes exactly
autodiff's forward and backward (up to float rounding; ``tests/test_model.py`` compares them with
Flax's ``Dense``/``RMSNorm`` and ``silu``) but keeps only:

* :func:`project` (every weight matmul): ``x`` and the *stored* weight, cast again in the backward pass
  (whose weight gradient, :func:`weight_grad`, is contracted in the weight's own layout);
* :func:`rms_norm`: its input and scale, the float32 statistics recomputed;
* :func:`swiglu`: gate and up.

Being ``custom_vjp`` functions, they are transparent to ``jax.checkpoint`` policies: every tag and
every dot stays visible to them. :mod:`remat_kit.model.transformer` and :mod:`remat_kit.model.lora_layer` build on
them; this module imports nothing of remat_kit, so both can.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def project(x, w, w_in_axis: int, dtype, out_dtype=None):
    """``x @ w.astype(dtype)`` (over ``x``'s last axis) whose backward pass keeps ``x`` and the stored ``w``.

    Autodiff of a mixed-precision matmul keeps the compute-dtype cast of the weight (a copy per
    layer, and 1 GB for the 2B preset's output matrix); this keeps the weight as stored, which the
    layer scan forwards for free, and casts it again in the backward pass. The forward is one
    ``dot_general``, which an enclosing ``jax.checkpoint`` policy sees as such (``dots`` keeps its
    output); the backward is autodiff's input-gradient matmul and :func:`weight_grad`, the same sums
    as autodiff's weight gradient contracted in ``w``'s layout (no transposed copy of the cotangent).

    Args:
      x: the activation ``[..., k]`` (already in ``dtype``).
      w: the 2-D weight in its parameter dtype, ``k`` long on axis ``w_in_axis``.
      w_in_axis: 0 for ``[k, out]`` (a Dense kernel), 1 for ``[out, k]`` (a tied embedding).
      dtype: the compute dtype the weight is cast to.
      out_dtype: ``preferred_element_type`` of the matmul (None: ``dtype``).

    >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4))
    >>> project(x, w, 0, jnp.dtype("bfloat16")).shape, project(x, w.T, 1, jnp.dtype("bfloat16")).dtype
    ((2, 4), dtype(bfloat16))
    """
    return matmul(x, w.astype(dtype), w_in_axis, out_dtype)


def matmul(x, wc, w_in_axis: int, out_dtype):
    """``x @ wc`` contracting ``x``'s last axis with ``wc``'s axis ``w_in_axis``, accumulated in ``out_dtype``."""
    dims = (((x.ndim - 1,), (w_in_axis,)), ((), ()))
    return jax.lax.dot_general(x, wc, dims, preferred_element_type=out_dtype)


def _project_fwd(x, w, w_in_axis, dtype, out_dtype):
    # The implementation itself, not project(): a nested custom_vjp call would hide the dot from policies.
    return matmul(x, w.astype(dtype), w_in_axis, out_dtype), (x, w)


def _project_bwd(w_in_axis, dtype, out_dtype, residuals, g):
    x, w = residuals
    wc = w.astype(dtype)
    # The matmul is linear in x: its transpose is autodiff's own input-gradient matmul.
    (dx,) = jax.linear_transpose(lambda x_: matmul(x_, wc, w_in_axis, out_dtype), x)(g)
    return dx, weight_grad(x, g, w_in_axis, out_dtype).astype(dtype).astype(w.dtype)


def weight_grad(x, g, w_in_axis: int, out_dtype=None):
    """The gradient of ``x @ w`` with respect to ``w``, contracted straight into ``w``'s own layout.

    Autodiff computes the same sums as ``dot_general(g, x)`` (``[out, k]``) followed by a transpose to
    ``[k, out]``; XLA:CPU folds that transpose into the producer of ``g``, which then writes the
    ``[tokens, out]`` gradient transposed (a strided pass over the largest activations: 0.6 s of an
    11 s step at benchmarks/peer_hf.py's shape). Contracting the token axes of ``x`` and ``g`` in the
    order of ``w`` needs no transpose at all; the result is the same up to summation order.

    Args:
      x: the matmul's input ``[..., k]``.
      g: the output's cotangent ``[..., out]``.
      w_in_axis: 0 for ``w [k, out]``, 1 for ``w [out, k]``.
      out_dtype: ``preferred_element_type`` (as the forward's).

    >>> x, g = jnp.ones((2, 5, 3)), jnp.ones((2, 5, 4))
    >>> weight_grad(x, g, 0).shape, weight_grad(x, g, 1).shape
    ((3, 4), (4, 3))
    """
    tokens = tuple(range(x.ndim - 1))
    a, b = (x, g) if w_in_axis == 0 else (g, x)
    return jax.lax.dot_general(a, b, ((tokens, tokens), ((), ())), preferred_element_type=out_dtype)


project.defvjp(_project_fwd, _project_bwd)


def _rms(x, eps: float):
    """``(x in float32, 1 / rms(x) [..., 1])``: the statistics in float32, as Flax's ``RMSNorm``."""
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)  # [..., 1]
    return xf, r


def _broadcast(scale, x):
    """``scale [d]`` in float32, shaped ``[1, ..., d]`` like ``x`` (no implicit rank promotion)."""
    return scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x, scale, eps: float, dtype):
    """RMSNorm over the last axis whose backward pass keeps only ``x`` and ``scale``.

    Computed as Flax's ``nn.RMSNorm`` (float32 statistics, output cast to ``dtype``); its float32
    intermediates are recomputed in the backward pass instead of kept.

    >>> float(rms_norm(jnp.full((1, 4), 3.0), jnp.ones(4), 0.0, jnp.dtype("float32"))[0, 0])
    1.0
    """
    return _rms_norm(x, scale, eps, dtype)


def _rms_norm(x, scale, eps: float, dtype):
    xf, r = _rms(x, eps)
    return (xf * (r * _broadcast(scale, x))).astype(dtype)


def _rms_norm_fwd(x, scale, eps, dtype):
    return _rms_norm(x, scale, eps, dtype), (x, scale)


def _rms_norm_bwd(eps, dtype, residuals, g):
    x, scale = residuals
    xf, r = _rms(x, eps)
    gf = g.astype(jnp.float32)
    gs = gf * _broadcast(scale, x)
    # d/dx of x·r(x): r·g − x·r³·mean(g·x), r = (mean(x²) + eps)^(-1/2).
    dx = r * gs - xf * (r**3) * jnp.mean(gs * xf, axis=-1, keepdims=True)
    dscale = jnp.sum((gf * xf * r).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def swiglu(gate, up):
    """``silu(gate) * up`` whose backward pass keeps gate and up, not silu's intermediates.

    >>> float(swiglu(jnp.zeros(()), jnp.ones(())))
    0.0
    """
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_bwd(residuals, g):
    gate, up = residuals
    x, gf = gate.astype(jnp.float32), g.astype(jnp.float32)
    sig = jax.nn.sigmoid(x)
    d_up = gf * x * sig
    d_gate = gf * up.astype(jnp.float32) * sig * (1.0 + x * (1.0 - sig))  # silu'(x) = σ(x)(1 + x(1 − σ(x)))
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
