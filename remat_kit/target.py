"""The device a step is planned for: the local backend, or a GPU compiled for without one (compile-only).

A :class:`Target` is parsed from a name (:func:`parse`): ``"local"`` (the backend JAX runs here, the default),
``"cpu"``, one of the GPUs whose configs ship with the package (``"h100"``, ``"h200"``, ``"a100"``:
:data:`GPU_TARGETS`), or the path of an XLA ``GpuTargetConfigProto`` text file. A GPU target gives compile-only
devices (``jax.experimental.topologies``, the CUDA plugin's deviceless compiler): a step lowered on their mesh
compiles to XLA:GPU's own code and buffer assignment, host offload included, on a machine with no GPU. What it
cannot see: autotuning (no device to time kernels on: XLA takes its default choices) and the runtime
allocator's slack.

This module is the one reader of the CUDA plugin and of ``jax.experimental.topologies``; while a planner traces
for a target, :func:`traced_platform` tells model code (attention's kernel choice) which backend it traces for.

>>> t = parse("local")
>>> t.compile_only, str(t)
(False, 'local')
>>> parse("h100").device_memory // 2**30, parse("h100").host_link
(79, 'PCIe 5.0 x16')
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

import jax

from remat_kit import constants

#: Every target name :func:`parse` takes besides a file path (defined with the CLI's names).
TARGET_NAMES: tuple[str, ...] = constants.TARGET_NAMES

#: The GPUs whose target configs ship with the package (``remat_kit/target_configs/NAME.txtpb``).
GPU_TARGETS: tuple[str, ...] = tuple(n for n in TARGET_NAMES if n not in ("local", "cpu"))

#: What to install for a GPU target.
INSTALL_HINT = "pip install 'remat-kit[gpu-target]'"

#: The host link assumed when a user's config states no ``pcie_bandwidth``: PCIe 4.0 x16, bytes/s each way.
DEFAULT_HOST_BANDWIDTH = 32e9

_CONFIGS = Path(__file__).resolve().parent / "target_configs"
# The CUDA plugin's package (jax[cuda12]); JAX finds it by this name among its jax_plugins.
_CUDA_PLUGIN = "jax_plugins.xla_cuda12"
# The deviceless topology remat_kit plans on: one host of n devices (n = the mesh's size).
_TOPOLOGY = "1x1x{n}"

_TRACED: contextvars.ContextVar[str | None] = contextvars.ContextVar("remat_kit_traced_platform", default=None)


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to plan for. Build it with :func:`parse`.

    Attributes:
      name: what was parsed: ``"local"``, ``"cpu"``, a name in :data:`GPU_TARGETS` or a config file's path.
      platform: ``"local"``, ``"cpu"`` or ``"gpu"`` (a GPU is always compiled for deviceless).
      config: the ``GpuTargetConfigProto`` text of a GPU target (empty otherwise).
      device_kind: the device's name as XLA reports it (``"NVIDIA H100 80GB HBM3"``).
      device_memory: the device's memory in bytes (0 where not stated).
      memory_bandwidth: device memory bandwidth, bytes/s (0 where not stated).
      host_bandwidth: host <-> device link bandwidth each way, bytes/s: what an offloaded byte crosses
        (``pcie_bandwidth`` in the config; :data:`DEFAULT_HOST_BANDWIDTH` where not stated; 0 for CPU).
      host_link: the link's name (``"PCIe 5.0 x16"``, ``"NVLink-C2C"``), from a ``# remat_kit host_link:`` line.
      compute_capability: the CUDA compute capability, ``(9, 0)`` for Hopper.
      core_count: streaming multiprocessors.
      clock_hz: the SM clock the config states.
    """

    name: str
    platform: str
    config: str = dataclasses.field(default="", repr=False)
    device_kind: str = ""
    device_memory: int = 0
    memory_bandwidth: float = 0.0
    host_bandwidth: float = 0.0
    host_link: str = ""
    compute_capability: tuple[int, int] = (0, 0)
    core_count: int = 0
    clock_hz: float = 0.0

    def __str__(self) -> str:
        return self.name

    @property
    def compile_only(self) -> bool:
        """Whether steps are compiled for devices that are not here (a GPU target)."""
        return self.platform == "gpu"

    @property
    def elsewhere(self) -> bool:
        """Whether steps for it must be placed on its own devices: a GPU target, or ``cpu`` where JAX's default
        backend is another (a planner then compiles on a mesh of :meth:`devices`)."""
        return self.compile_only or (self.platform == "cpu" and jax.default_backend() != "cpu")

    @property
    def label(self) -> str:
        """One line for a report: ``h100 (NVIDIA H100 80GB HBM3, compile-only XLA:GPU)``, or ``local (cpu)``."""
        if self.compile_only:
            return f"{self.name} ({self.device_kind}, compile-only XLA:GPU)"
        return f"{self.name} ({self.devices()[0].platform})"

    def devices(self, count: int = 1) -> list:
        """``count`` devices to compile for: the local backend's, or compile-only GPUs.

        Raises:
          ImportError: a GPU target without the CUDA plugin (:data:`INSTALL_HINT`).
          RuntimeError: the plugin is installed but did not start (see :func:`_topology`).
          ValueError: more devices than the local backend has.
        """
        if self.compile_only:
            return list(_topology(self.config, count).devices)
        found = jax.devices("cpu") if self.platform == "cpu" else jax.devices()
        if count > len(found):
            raise ValueError(f"target {self.name}: {count} devices asked, {len(found)} here")
        return list(found[:count])

    def abstract(self, tree):
        """``tree`` placed for this target: unchanged where the local backend compiles; for a target
        :attr:`elsewhere` (a GPU: its first compile-only device) as ``jax.ShapeDtypeStruct``s on its device, so
        that ``jax.jit(f).trace(...).lower().compile()`` compiles for it."""
        if not self.elsewhere:
            return tree
        sharding = jax.sharding.SingleDeviceSharding(self.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """While active, :func:`traced_platform` is this target's platform (model code picks its kernels by it)."""
        token = _TRACED.set(None if self.platform == "local" else self.platform)
        try:
            yield
        finally:
            _TRACED.reset(token)


#: The default target: the backend JAX runs here.
LOCAL = Target("local", "local")


def traced_platform() -> str:
    """The platform code is traced for: the target a planner is tracing for, else JAX's default backend.

    >>> traced_platform() == jax.default_backend()
    True
    >>> with parse("cpu").tracing():
    ...     traced_platform()
    'cpu'
    """
    return _TRACED.get() or jax.default_backend()


def _field(text: str, name: str) -> str | None:
    """A scalar field of a text-format proto (the first ``name: value``), or None."""
    m = re.search(rf"^\s*{name}\s*:\s*\"?([^\"\n]*)\"?\s*$", text, flags=re.M)
    return m.group(1).strip() if m else None


def from_config(text: str, name: str) -> Target:
    """A GPU :class:`Target` from a ``GpuTargetConfigProto`` in text format (only read here; XLA parses it
    when the devices are made, and refuses fields the installed XLA does not know).

    Raises:
      ValueError: the text names no ``gpu_device_info`` or no ``cuda_compute_capability`` (only CUDA is planned).
    """
    if "gpu_device_info" not in text or "cuda_compute_capability" not in text:
        raise ValueError(
            f"target {name}: not a CUDA GpuTargetConfigProto in text format "
            "(no gpu_device_info with a cuda_compute_capability)"
        )
    link = re.search(r"^#\s*remat_kit host_link:\s*(.+)$", text, flags=re.M)
    cc = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", text)
    pcie = _field(text, "pcie_bandwidth")
    return Target(
        name=name,
        platform="gpu",
        config=text,
        device_kind=_field(text, "device_description_str") or _field(text, "name") or name,
        device_memory=int(_field(text, "device_memory_size") or 0),
        memory_bandwidth=float(_field(text, "memory_bandwidth") or 0),
        host_bandwidth=float(pcie) if pcie else DEFAULT_HOST_BANDWIDTH,
        host_link=link.group(1).strip() if link else ("PCIe" if pcie else "PCIe 4.0 x16 (assumed)"),
        compute_capability=(int(cc.group(1)), int(cc.group(2))) if cc else (0, 0),
        core_count=int(_field(text, "core_count") or 0),
        clock_hz=float(_field(text, "clock_rate_ghz") or 0) * 1e9,
    )


def parse(target: str | Target | None = None) -> Target:
    """A :class:`Target` from a name in :data:`TARGET_NAMES`, a config file's path, a Target, or None (local).

    Raises:
      ValueError: an unknown name that is no file either, in one line listing the valid names.

    >>> parse("v100")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown target 'v100'; allowed: local, cpu, h100, h200, a100, or the path of a ...
    """
    if isinstance(target, Target):
        return target
    if target is None or target == "local":
        return LOCAL
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"target must be a name or a path, got {type(target).__name__}")
    key = str(target)
    if key == "cpu":
        return Target("cpu", "cpu")
    if key.lower() in GPU_TARGETS:
        return _builtin(key.lower())
    if Path(key).is_file():
        return from_config(Path(key).read_text(), key)
    raise ValueError(
        f"unknown target {key!r}; allowed: {', '.join(TARGET_NAMES)}, or the path of a GpuTargetConfigProto text file"
    )


@functools.cache
def _builtin(name: str) -> Target:
    return from_config((_CONFIGS / f"{name}.txtpb").read_text(), name)


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (the ``gpu-target`` extra) is installed; nothing is imported or started."""
    try:
        return importlib.util.find_spec(_CUDA_PLUGIN) is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


@functools.cache
def _topology(config: str, count: int):
    """The deviceless topology of ``count`` GPUs described by ``config`` (memoized: XLA parses it once)."""
    from jax.experimental import topologies

    if not cuda_plugin_installed():
        raise ImportError(f"a GPU target needs JAX's CUDA plugin, which is not installed: {INSTALL_HINT}")
    try:
        return topologies.get_topology_desc(platform="cuda", target_config=config, topology=_TOPOLOGY.format(n=count))
    except NotImplementedError:  # JAX registers no cuda topology when the plugin failed to start
        raise RuntimeError(
            "JAX's CUDA plugin is installed but did not start (no GPU here): set JAX_PLATFORMS=cpu "
            "(or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) before JAX starts to compile for a GPU target without one"
        ) from None
    except jax.errors.JaxRuntimeError as err:
        raise ValueError(
            f"XLA refused the target config ({str(err).splitlines()[0]}): its fields must be those of the "
            f"installed XLA (jax {jax.__version__})"
        ) from None
