"""Device meshes for data parallelism and FSDP, built on ``jax.sharding``.

A mesh always has the two axes ``("data", "fsdp")``; ``--mesh data=2,fsdp=2`` sets their sizes. The
batch is split over both axes (every device sees different examples); parameters, gradients and
optimizer state are split over ``fsdp`` along their largest divisible dimension. The scanned layer
stack's layer axis (axis 0 of every leaf under a ``layers`` key) is never split: the scan walks it.

The mesh may span several JAX processes (one per host, joined by :mod:`remat_kit.train.distributed`):
:func:`local_rows` / :func:`global_batch` let each process feed only its rows of a batch.

>>> MeshSpec.parse("data=2,fsdp=2")
MeshSpec(data=2, fsdp=2)
>>> str(MeshSpec.parse("fsdp=4"))
'data=1,fsdp=4'
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from remat_kit.units import check_int

AXES: tuple[str, ...] = ("data", "fsdp")

#: The most CPU devices a mesh simulates on one host (``--mesh`` without accelerators): enough to check any
#: sharding a real run would use, while XLA's per-device threads and buffers still fit one machine.
MAX_SIMULATED_DEVICES = 64

#: The key under which the scan core stores stacked layer parameters (see remat_kit.linen.scan.Stack).
STACKED_KEY = "layers"


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the ``data`` and ``fsdp`` mesh axes."""

    data: int = 1
    fsdp: int = 1

    def __post_init__(self):
        for axis in AXES:
            check_int(f"mesh axis {axis}", getattr(self, axis))

    def __str__(self) -> str:
        return f"data={self.data},fsdp={self.fsdp}"

    @property
    def size(self) -> int:
        """Devices the mesh needs."""
        return self.data * self.fsdp

    @classmethod
    def parse(cls, spec: str | MeshSpec | None) -> MeshSpec:
        """Parse ``"data=4"`` / ``"data=2,fsdp=2"`` (omitted axes have size 1; None or "" is 1 device).

        Raises:
          ValueError: an unknown axis, a repeated axis, or a size that is not a positive integer.
        """
        if spec is None or isinstance(spec, MeshSpec):
            return spec or cls()
        if not isinstance(spec, str):
            raise TypeError(f"a mesh spec must be a string like 'data=2,fsdp=2', got {spec!r}")
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            axis, eq, value = part.partition("=")
            axis = axis.strip()
            if not eq and axis in AXES:
                raise ValueError(
                    f"mesh spec {spec!r}: axis {axis!r} needs a size; the '=N' is missing (e.g. '{axis}=2')"
                )
            if not eq or axis not in AXES:
                raise ValueError(
                    f"mesh spec {spec!r}: unknown axis in {part!r}; allowed axes: {', '.join(AXES)} "
                    f"(e.g. 'data=2,fsdp=2')"
                )
            if axis in sizes:
                raise ValueError(f"mesh spec {spec!r}: axis {axis!r} given twice")
            try:
                sizes[axis] = int(value)
            except ValueError:
                raise ValueError(f"mesh spec {spec!r}: size of {axis!r} must be an integer, got {value!r}") from None
        return cls(**sizes)


def make_mesh(spec: str | MeshSpec | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "fsdp")`` mesh over ``devices`` (default: all devices).

    Raises:
      ValueError: the axis sizes do not multiply to the number of devices.
    """
    spec = MeshSpec.parse(spec)
    devices = list(jax.devices() if devices is None else devices)
    if spec.size != len(devices):
        cap = ""
        if devices[0].platform == "cpu" and spec.size > MAX_SIMULATED_DEVICES:
            cap = f" (at most {MAX_SIMULATED_DEVICES} CPU devices are simulated; a larger mesh needs real devices)"
        raise ValueError(
            f"mesh {spec} needs {spec.size} devices but {len(devices)} are available "
            f"({', '.join(str(d) for d in devices[:4])}{', ...' if len(devices) > 4 else ''}){cap}; "
            f"the axis sizes must multiply to the device count"
        )
    grid = np.asarray(devices, dtype=object).reshape(spec.data, spec.fsdp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def check_batch(batch: int, mesh: Mesh) -> None:
    """Raise ValueError unless ``batch`` splits evenly over the mesh's data-parallel devices."""
    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch % ways:
        raise ValueError(
            f"batch {batch} is not divisible by the data-parallel device count {ways} "
            f"(data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}); use a multiple of {ways}"
        )


def simulated_note(mesh: Mesh) -> str | None:
    """The one line saying a mesh runs on simulated CPU devices (None for real accelerators or one device)."""
    if mesh.size == 1 or mesh.devices.flat[0].platform != "cpu":
        return None
    return (
        f"note: mesh {MeshSpec(mesh.shape['data'], mesh.shape['fsdp'])} runs on {mesh.size} simulated CPU devices "
        f"({os.cpu_count()} cores here): it checks the sharding, not the speed of a real mesh"
    )


def check_fsdp_shards(params, mesh: Mesh) -> None:
    """Raise ValueError when ``fsdp`` > 1 but no parameter has a dimension it divides (nothing would be sharded)."""
    fsdp = mesh.shape["fsdp"]
    if fsdp == 1:
        return
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if any("fsdp" in leaf_spec(tuple(leaf.shape), fsdp, _is_stacked(path)) for path, leaf in leaves):
        return
    largest = max((max(leaf.shape, default=1) for _, leaf in leaves), default=1)
    raise ValueError(
        f"mesh fsdp={fsdp}: no parameter has a dimension divisible by {fsdp} (the largest is {largest}), so FSDP "
        "would shard nothing; use an fsdp size that divides the model's widths (e.g. 2, 4, 8)"
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a ``[batch, ...]`` array: batch split over ``data`` and ``fsdp``."""
    return NamedSharding(mesh, P(AXES))


def _is_stacked(path) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) == STACKED_KEY for k in path)


def leaf_spec(shape: Sequence[int], fsdp: int, stacked: bool) -> P:
    """FSDP partition of one array: its largest dimension divisible by ``fsdp`` goes over ``fsdp``.

    Axis 0 of a stacked (scanned) leaf is excluded; a leaf with no divisible dimension is replicated.

    >>> leaf_spec((8, 64, 32), fsdp=4, stacked=True)
    P(None, 'fsdp', None)
    >>> leaf_spec((6,), fsdp=4, stacked=False)
    P()
    """
    if fsdp == 1:
        return P()
    first = 1 if stacked else 0
    candidates = [(shape[i], i) for i in range(first, len(shape)) if shape[i] % fsdp == 0]
    if not candidates:
        return P()
    _, axis = max(candidates)
    return P(*(("fsdp" if i == axis else None) for i in range(len(shape))))


def tree_shardings(tree, mesh: Mesh):
    """NamedShardings for a tree of parameters, gradients or optimizer state (arrays or shapes)."""
    fsdp = mesh.shape["fsdp"]

    def one(path, leaf):
        shape = getattr(leaf, "shape", ())
        return NamedSharding(mesh, leaf_spec(tuple(shape), fsdp, _is_stacked(path)))

    return jax.tree_util.tree_map_with_path(one, tree)


def local_rows(batch: int, mesh: Mesh) -> slice:
    """The rows of a global ``[batch, ...]`` array that this process's devices hold.

    In one process this is every row. Across processes each process feeds only its slice (see
    :func:`global_batch`), which is contiguous because the mesh lists devices process by process.

    Raises:
      ValueError: this process's rows are not one contiguous block (a mesh not built by :func:`make_mesh`).
    """
    sharding = batch_sharding(mesh)
    starts = sorted(
        {
            (idx[0].start or 0, batch if idx[0].stop is None else idx[0].stop)
            for idx in sharding.addressable_devices_indices_map((batch,)).values()
        }
    )
    for (_, stop), (start, _) in itertools.pairwise(starts):
        if stop != start:
            raise ValueError(f"this process's rows of the batch are not contiguous: {starts}")
    return slice(starts[0][0], starts[-1][1])


def global_batch(local: np.ndarray, batch: int, mesh: Mesh) -> jax.Array:
    """A ``[batch, ...]`` array on ``mesh`` from this process's rows ``local`` (:func:`local_rows`)."""
    local = np.asarray(local)
    return jax.make_array_from_process_local_data(batch_sharding(mesh), local, (batch, *local.shape[1:]))


def ensure_cpu_devices(spec: str | MeshSpec | None) -> None:
    """Simulate enough CPU devices for ``spec`` (a no-op once JAX's backends have started).

    Lets ``--mesh data=8`` plan an 8-device run on a laptop. Must run before the first device query.
    """
    size = MeshSpec.parse(spec).size
    if 1 < size <= MAX_SIMULATED_DEVICES:  # more: make_mesh refuses the mesh, naming the cap
        # Once backends are up JAX refuses the change; make_mesh then reports the real device count.
        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", size)
