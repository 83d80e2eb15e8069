"""What a compiled step holds in memory, and the one rule for what host offload does on this backend.

:class:`CompiledMemory` reads XLA's buffer assignment of a compiled function. :func:`host_offload` is
the one host-offload rule of the package: every report, table and planner asks it, and nothing else,
whether offload policies are worth trying here (:attr:`HostOffload.available`) and whether the bytes
they offload really leave the device (:attr:`HostOffload.enforced`; not on XLA:CPU, which lowers the
device-to-host copy to nothing). The one private JAX read it needs, whether the running JAX's remat
can offload at all, stays fenced in :func:`remat_kit._jax_internals.offload_supported`.

>>> import jax
>>> rule = host_offload(jax.devices("cpu")[0])
>>> rule.enforced, rule.note is not None
(False, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from remat_kit import _jax_internals
from remat_kit.policies import OFFLOAD_DESTINATIONS


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``), as stored: size × itemsize.

    >>> import jax, jax.numpy as jnp
    >>> tree_bytes({"w": jax.ShapeDtypeStruct((4, 8), jnp.bfloat16), "b": jnp.zeros(8)})
    96
    """
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


#: What a report says when offloaded residuals stay on the device.
CPU_OFFLOAD_NOTE = (
    "this backend ({platform}) does not enforce host offload: XLA lowers the device-to-host copy to nothing, "
    "so offloaded residuals are counted as device bytes (no memory moves: offload is not modelled here; plan for "
    "the GPU with target='h100' or --target h100 to see them leave the device)"
)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's buffer assignment for a compiled function (``Compiled.memory_analysis()``), in bytes.

    ``argument`` and ``output`` overlap by ``alias`` (donated inputs reused as outputs).
    ``temp`` is everything else the function needs at once: activations, gradients, workspace.

    >>> import jax, jax.numpy as jnp
    >>> m = CompiledMemory.from_compiled(jax.jit(jnp.sin).lower(jnp.ones(256, jnp.float32)).compile())
    >>> m.argument, m.output, m.host
    (1024, 1024, 0)
    """

    argument: int
    output: int
    alias: int
    temp: int
    host_argument: int
    host_output: int
    host_temp: int

    @classmethod
    def from_compiled(cls, compiled) -> CompiledMemory:
        """Read ``compiled.memory_analysis()`` (per device for a sharded executable)."""
        m = compiled.memory_analysis()
        return cls(
            argument=int(m.argument_size_in_bytes),
            output=int(m.output_size_in_bytes),
            alias=int(m.alias_size_in_bytes),
            temp=int(m.temp_size_in_bytes),
            host_argument=int(m.host_argument_size_in_bytes),
            host_output=int(m.host_output_size_in_bytes),
            host_temp=int(m.host_temp_size_in_bytes),
        )

    @property
    def total(self) -> int:
        """Device bytes live at the peak, bounded by XLA's buffer assignment: arguments + outputs − aliased + temp."""
        return self.argument + self.output - self.alias + self.temp

    @property
    def host(self) -> int:
        """Bytes XLA placed in host memory (arguments, outputs and temp)."""
        return self.host_argument + self.host_output + self.host_temp


@dataclasses.dataclass(frozen=True)
class HostOffload:
    """What host offload does on one device under the running JAX. Build it with :func:`host_offload`.

    Each answer is read when asked (the JAX probe behind :attr:`remat_offloads` traces once, cached).

    Attributes:
      device: the ``jax.Device`` the rule is read for.
    """

    device: Any

    @property
    def platform(self) -> str:
        """The device's platform (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
        return self.device.platform

    @property
    def remat_offloads(self) -> bool:
        """Whether the running JAX's ``jax.checkpoint`` sends an offloadable name to ``pinned_host`` under the
        current flags (False for jax 0.10's remat3, which recomputes it instead)."""
        return _jax_internals.offload_supported()

    @property
    def host_memory(self) -> bool:
        """Whether the device has a memory kind remat offloads to (:data:`~remat_kit.policies.OFFLOAD_DESTINATIONS`)."""
        kinds = {m.kind for m in self.device.addressable_memories()}
        if not kinds and self.platform == "gpu":  # a compile-only GPU (remat_kit.target) lists no memories
            return True  # every CUDA device has pinned host memory, and XLA:GPU compiles remat offload to it
        return bool(kinds & set(OFFLOAD_DESTINATIONS))

    @property
    def enforced(self) -> bool:
        """Whether offloaded residuals really leave device memory; where not, they count as device bytes."""
        # XLA:CPU lowers the device-to-host copy to nothing; every other backend moves the bytes.
        return self.platform != "cpu"

    @property
    def available(self) -> bool:
        """Whether offload policies are worth considering: the device has host memory and JAX's remat offloads."""
        return self.host_memory and self.remat_offloads

    @property
    def note(self) -> str | None:
        """The note a report prints where offload is not enforced (None where it is)."""
        return None if self.enforced else CPU_OFFLOAD_NOTE.format(platform=self.platform)


def host_offload(device: Any = None) -> HostOffload:
    """The one host-offload rule, read for ``device`` (default: the first device).

    Args:
      device: a ``jax.Device``; None for ``jax.devices()[0]``.

    Returns:
      A :class:`HostOffload`.

    >>> import jax
    >>> host_offload(jax.devices("cpu")[0]).platform
    'cpu'
    """
    return HostOffload(device or jax.devices()[0])
