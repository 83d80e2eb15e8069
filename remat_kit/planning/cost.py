"""What recompute and offload cost in step time: a roofline over the ops a policy adds to the step's jaxpr.

Which ops a policy recomputes is read off the jaxprs, not guessed: every leaf equation of the traced
step (scan bodies counted once per trip, remat/checkpoint bodies included, see
:func:`remat_kit._jax_internals.weighted_leaf_eqns`) is keyed by ``(primitive, FLOPs, bytes)`` and
counted (:class:`Work`); the policy's counts minus ``none``'s (the positive part) are the recomputed
ops. Each is priced by a roofline, ``max(flops / peak FLOP/s, bytes / memory bandwidth)`` with bytes
the op's inputs plus outputs, so a recomputed softmax or norm costs memory-bound time, not zero.
Offloaded residuals are priced by the bytes that cross the host link (both ways), times the share of
the transfer that does not overlap compute; on a backend where offload moves nothing (XLA:CPU,
:func:`remat_kit.analysis.memory.host_offload`) it costs nothing and saves nothing.

The figures per backend (:data:`DEFAULT_HARDWARE`) are datasheet-class defaults; :func:`calibrate`
replaces peak FLOP/s and bandwidth with a timed matmul and a timed copy on this machine (a few
hundred ms). The model ignores fusion (an elementwise chain is priced op by op, an upper bound); launch
overheads are priced per loop trip (:attr:`Hardware.trip_s`, the dispatch of one trip's fused kernels), so the
extra trips of sequence tiles (:func:`remat_kit.policies.tiling.tiled`: K trips where one call was) cost time even
though their FLOPs and bytes are the untiled ones'.

>>> import jax, jax.numpy as jnp
>>> f = lambda x: jnp.sum(jnp.sin(jnp.sin(x)))
>>> x = jnp.ones((1024,))
>>> none = work_of(jax.make_jaxpr(jax.grad(f))(x))
>>> full = work_of(jax.make_jaxpr(jax.grad(jax.checkpoint(f)))(x))
>>> e = estimate(full, none, DEFAULT_HARDWARE["cpu"])
>>> e.recompute_flops > 0 and e.recompute_s > 0, estimate(none, none, DEFAULT_HARDWARE["cpu"]).cost_s
(True, 0.0)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from remat_kit import _jax_internals
from remat_kit.analysis import flops

#: Primitives that move or relabel no data once XLA has fused them (views, names, barriers); priced at 0.
#: ``device_put`` is the host transfer of an offload, priced by :meth:`Hardware.transfer_seconds` instead.
#: ``reduce_precision`` is what ``jax.checkpoint`` wraps each saved residual in, at the residual's own
#: precision: an identity XLA's simplifier deletes, so counting it would make saving look like work.
FREE_PRIMITIVES = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "name",
        "optimization_barrier",
        "device_put",
        "reduce_precision",
    }
)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The throughputs recompute and offload are priced against.

    Attributes:
      name: what the figures describe, e.g. ``"gpu (H100/H200-class defaults)"``.
      flops_per_s: peak matmul throughput.
      bytes_per_s: device memory bandwidth.
      host_bytes_per_s: the host link's bandwidth (offload).
      overlap: the share of an offload's transfer hidden behind compute, in [0, 1].
      calibrated: True when peak and bandwidth were measured here by :func:`calibrate`.
      trip_s: seconds of dispatch per loop trip (launching one trip's fused kernels), an assumption.
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    host_bytes_per_s: float
    overlap: float = 0.0
    calibrated: bool = False
    trip_s: float = 0.0

    def __post_init__(self):
        for field in ("flops_per_s", "bytes_per_s", "host_bytes_per_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Hardware.{field} must be a positive number, got {value!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"Hardware.overlap must be in [0, 1], got {self.overlap!r}")
        if isinstance(self.trip_s, bool) or not isinstance(self.trip_s, (int, float)) or self.trip_s < 0:
            raise ValueError(f"Hardware.trip_s must be a number >= 0, got {self.trip_s!r}")

    def op_seconds(self, op_flops: float, op_bytes: float) -> float:
        """The roofline time of one op: compute-bound or memory-bound, whichever is slower."""
        return max(op_flops / self.flops_per_s, op_bytes / self.bytes_per_s)

    def transfer_seconds(self, nbytes: float) -> float:
        """Exposed seconds of moving ``nbytes`` over the host link (the overlapped share is free)."""
        return nbytes / self.host_bytes_per_s * (1 - self.overlap)

    def defaults(self) -> Hardware | None:
        """The backend's :data:`DEFAULT_HARDWARE` entry these figures were calibrated from (None when they are
        not calibrated, or named after no default)."""
        if not self.calibrated:
            return None
        return next((h for h in DEFAULT_HARDWARE.values() if h.name == self.name), None)

    def describe(self) -> str:
        """One line: the figures and where they come from; calibrated ones with the backend's defaults beside them.

        >>> import dataclasses
        >>> probe = dataclasses.replace(DEFAULT_HARDWARE["cpu"], flops_per_s=2e11, calibrated=True)
        >>> probe.describe().split("; ")[0]
        'cost model: cpu (calibrated on this machine): 0.2 TFLOP/s, 20 GB/s memory, host link 20 GB/s (0% overlapped)'
        >>> probe.describe().split("; ")[1]
        'the defaults: 0.1 TFLOP/s, 20 GB/s memory'
        """
        how = "calibrated on this machine" if self.calibrated else "defaults"
        base = self.defaults()
        beside = (
            ""
            if base is None
            else f"; the defaults: {base.flops_per_s / 1e12:.3g} TFLOP/s, {base.bytes_per_s / 1e9:.3g} GB/s memory"
        )
        return (
            f"cost model: {self.name} ({how}): {self.flops_per_s / 1e12:.3g} TFLOP/s, "
            f"{self.bytes_per_s / 1e9:.3g} GB/s memory, host link {self.host_bytes_per_s / 1e9:.3g} GB/s "
            f"({self.overlap:.0%} overlapped){beside}; per op max(FLOPs/peak, bytes/bandwidth)"
        )


#: Datasheet-class figures per backend. cpu: a few server cores in float32; gpu: H100/H200 SXM bf16 dense
#: (989 TFLOP/s; HBM 3.35 TB/s on H100, 4.8 on H200: the lower is used) over PCIe Gen5 x16 (~55 GB/s
#: effective); tpu: v5p-class (459 TFLOP/s bf16, 2.76 TB/s HBM). The offload overlap is an assumption
#: (XLA schedules the copies asynchronously; half of them hidden), not a measurement.
#: The dispatch cost per loop trip is an assumption too: a trip of a tiled block runs some ten fused kernels, about
#: 5 µs each to launch on a GPU, a few µs on a TPU; XLA:CPU dispatches a trip's thunks in a few µs.
DEFAULT_HARDWARE: dict[str, Hardware] = {
    "cpu": Hardware("cpu", flops_per_s=1e11, bytes_per_s=2e10, host_bytes_per_s=2e10, overlap=0.0, trip_s=5e-6),
    "gpu": Hardware(
        "gpu (H100/H200-class)",
        flops_per_s=989e12,
        bytes_per_s=3.35e12,
        host_bytes_per_s=5.5e10,
        overlap=0.5,
        trip_s=5e-5,
    ),
    "tpu": Hardware(
        "tpu (v5p-class)", flops_per_s=459e12, bytes_per_s=2.76e12, host_bytes_per_s=3.2e10, overlap=0.5, trip_s=2e-5
    ),
}


#: Dense bf16 tensor-core FLOPs per SM per clock by CUDA compute capability, from NVIDIA's datasheets: H100 SXM
#: 989 TFLOP/s at 132 SMs x 1.83 GHz (4096), A100 312 TFLOP/s at 108 SMs x 1.41 GHz (2048).
TENSOR_FLOPS_PER_SM_CLOCK: dict[tuple[int, int], int] = {(9, 0): 4096, (8, 0): 2048}

#: The share of a host link's nominal bandwidth an offload copy reaches (PCIe 5.0 x16: ~55 of 64 GB/s).
HOST_LINK_EFFICIENCY = 0.85


def target_hardware(target) -> Hardware:
    """The throughputs of a compile-only GPU target (:class:`remat_kit.target.Target`): its memory bandwidth and
    host link from its config (the link at :data:`HOST_LINK_EFFICIENCY` of nominal), its tensor-core peak from
    its SM count and clock (:data:`TENSOR_FLOPS_PER_SM_CLOCK`; the gpu default where its capability is not listed).

    >>> from remat_kit import target
    >>> h = target_hardware(target.parse("h100"))
    >>> h.name, round(h.host_bytes_per_s / 1e9, 1)
    ('h100 (NVIDIA H100 80GB HBM3)', 54.4)
    """
    base = DEFAULT_HARDWARE["gpu"]
    per_clock = TENSOR_FLOPS_PER_SM_CLOCK.get(target.compute_capability)
    flops = per_clock * target.core_count * target.clock_hz if per_clock and target.clock_hz else base.flops_per_s
    return dataclasses.replace(
        base,
        name=f"{target.name} ({target.device_kind})",
        flops_per_s=flops,
        bytes_per_s=target.memory_bandwidth or base.bytes_per_s,
        host_bytes_per_s=target.host_bandwidth * HOST_LINK_EFFICIENCY,
    )


def default_hardware(platform: str | None = None) -> Hardware:
    """The :data:`DEFAULT_HARDWARE` entry of ``platform`` (default: JAX's default backend; cuda/rocm are gpu).

    >>> default_hardware("cpu").name
    'cpu'
    """
    platform = platform or jax.default_backend()
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if platform not in DEFAULT_HARDWARE:
        raise ValueError(f"no cost-model defaults for backend {platform!r}; allowed: {', '.join(DEFAULT_HARDWARE)}")
    return DEFAULT_HARDWARE[platform]


def _best_seconds(fn, *args, budget_s: float) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm
    best, spent = math.inf, 0.0
    while spent < budget_s:
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return best


def calibrate(platform: str | None = None, *, seconds: float = 0.3) -> Hardware:
    """Measure peak FLOP/s (a timed square matmul) and memory bandwidth (a timed copy) on the default device.

    The host link and the overlap keep the backend's defaults. About ``seconds`` of timing plus two small
    compiles.

    Args:
      platform: the backend whose defaults are the starting point (default: JAX's default backend).
      seconds: timing budget, split between the two probes.

    Returns:
      A :class:`Hardware` with ``calibrated=True``.

    >>> calibrate(seconds=0.02).calibrated
    True
    """
    base = default_hardware(platform)
    n = 1024 if jax.default_backend() == "cpu" else 8192
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    a = jnp.ones((n, n), dtype)
    matmul = _best_seconds(jax.jit(lambda x, y: x @ y), a, a, budget_s=seconds / 2)
    size = 16 * 2**20 if jax.default_backend() == "cpu" else 256 * 2**20  # elements
    x = jnp.ones((size,), jnp.float32)
    copy = _best_seconds(jax.jit(lambda v: v * 2), x, budget_s=seconds / 2)
    return dataclasses.replace(base, flops_per_s=2 * n**3 / matmul, bytes_per_s=2 * 4 * size / copy, calibrated=True)


@dataclasses.dataclass(frozen=True)
class Work:
    """The ops one step executes, counted: ``((primitive, flops, bytes), count)`` pairs, sorted.

    Attributes:
      ops: each distinct op (primitive name, FLOPs, bytes read + written) and how many times it runs.
      host_bytes: bytes the step moves between device and host memory (offload copies, both ways).
      trips: loop trips the step executes (scans multiplied out; :func:`remat_kit._jax_internals.loop_trips`).
    """

    ops: tuple[tuple[tuple[str, int, int], int], ...]
    host_bytes: int = 0
    trips: int = 0

    def minus(self, base: Work) -> Work:
        """The ops this step runs more often than ``base`` (what a policy recomputes over ``none``), and its
        extra loop trips."""
        extra = collections.Counter(dict(self.ops)) - collections.Counter(dict(base.ops))
        return Work(
            tuple(sorted(extra.items())), max(self.host_bytes - base.host_bytes, 0), max(self.trips - base.trips, 0)
        )

    @property
    def flops(self) -> int:
        """FLOPs of all the ops (matmuls 2·M·N·K, elementwise one per element)."""
        return sum(f * n for (_, f, _), n in self.ops)

    @property
    def nbytes(self) -> int:
        """Bytes all the ops read and write."""
        return sum(b * n for (_, _, b), n in self.ops)

    def seconds(self, hardware: Hardware) -> float:
        """The roofline time of all the ops, op by op."""
        return sum(hardware.op_seconds(f, b) * n for (_, f, b), n in self.ops)


def _op_key(eqn) -> tuple[str, int, int]:
    name = eqn.primitive.name
    if name in FREE_PRIMITIVES:
        return name, 0, 0
    ins = [_jax_internals.aval_nbytes(v) for v in eqn.invars]
    outs = [_jax_internals.aval_nbytes(v) for v in eqn.outvars]
    if name == "dot_general":
        op_flops = flops.eqn_matmul_flops(eqn)
    else:  # elementwise or reduction: one operation per element of the largest operand
        sizes = [math.prod(getattr(v.aval, "shape", ())) for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval")]
        op_flops = max(sizes, default=0)
    return name, int(op_flops), int(sum(ins) + sum(outs))


def work_of(jaxpr) -> Work:
    """Count the ops of a (closed) jaxpr, scan bodies once per trip (see :class:`Work`)."""
    counts: collections.Counter = collections.Counter()
    host = 0
    for eqn, times in _jax_internals.weighted_leaf_eqns(jaxpr):
        if _jax_internals.is_host_transfer(eqn):
            host += times * sum(_jax_internals.aval_nbytes(v) for v in eqn.invars)
        counts[_op_key(eqn)] += times
    counts = collections.Counter({k: n for k, n in counts.items() if k[1] or k[2]})  # free ops carry no cost
    return Work(tuple(sorted(counts.items())), host, _jax_internals.loop_trips(jaxpr))


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a policy adds to one step's time over ``none``, by :class:`Hardware`'s roofline.

    Attributes:
      recompute_s: seconds of the recomputed ops.
      offload_s: exposed seconds of host transfers (0 where offload moves nothing).
      recompute_flops, recompute_bytes: FLOPs and bytes of the recomputed ops.
      offload_bytes: bytes moved over the host link.
      trips_s, extra_trips: the dispatch time of the loop trips the step runs beyond ``none``'s (sequence
        tiles: K trips per tiled call), and their count.
    """

    recompute_s: float
    offload_s: float
    recompute_flops: int
    recompute_bytes: int
    offload_bytes: int
    trips_s: float = 0.0
    extra_trips: int = 0

    @property
    def cost_s(self) -> float:
        """The estimated step-time cost: recompute, exposed offload and the dispatch of extra loop trips."""
        return self.recompute_s + self.offload_s + self.trips_s

    @property
    def rank(self) -> tuple:
        """How candidates are ordered: least cost, then (ties) less recompute of any kind."""
        return (round(self.cost_s, 15), self.recompute_flops, self.recompute_bytes, self.offload_bytes)


def estimate(work: Work, base: Work, hardware: Hardware, *, host_moves: bool = True) -> Estimate:
    """The cost of ``work`` over ``base`` (``none``'s step) on ``hardware``.

    Args:
      host_moves: whether offloaded residuals really cross the host link on the backend
        (:func:`remat_kit.analysis.memory.host_offload`); if not, offload costs nothing.
    """
    extra = work.minus(base)
    moved = extra.host_bytes if host_moves else 0
    return Estimate(
        recompute_s=extra.seconds(hardware),
        offload_s=hardware.transfer_seconds(moved),
        recompute_flops=extra.flops,
        recompute_bytes=extra.nbytes,
        offload_bytes=moved,
        trips_s=extra.trips * hardware.trip_s,
        extra_trips=extra.trips,
    )
