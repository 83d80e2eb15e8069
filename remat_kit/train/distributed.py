"""Several JAX processes as one run: joining them, naming them in logs, and refusing ones that disagree.

:func:`initialize_processes` joins the processes of a multi-host run (``--coordinator``, or a cluster JAX
detects); :func:`check_same_across_processes` refuses processes started with different settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
from collections.abc import Mapping

import jax
import numpy as np

from remat_kit import constants
from remat_kit.step.mesh import MeshSpec, ensure_cpu_devices

#: JAX's defaults, used unless ``--distributed-timeout`` / ``REMAT_KIT_DISTRIBUTED_TIMEOUT`` sets both:
#: seconds to wait for all processes to join, and for a process that stopped sending heartbeats.
JAX_JOIN_TIMEOUT_S = constants.JAX_JOIN_TIMEOUT_S
JAX_HEARTBEAT_TIMEOUT_S = constants.JAX_HEARTBEAT_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class Processes:
    """How one run is spread over JAX processes (one per host on a cluster).

    Attributes:
      coordinator: ``host:port`` of process 0's coordination service (None: JAX detects the
        cluster itself, e.g. SLURM or Open MPI).
      num_processes: how many processes take part (None: detected).
      process_id: this process's index, ``0 <= process_id < num_processes`` (None: detected).
      timeout_s: seconds to wait for the coordinator at start-up, and for a process that stopped
        sending heartbeats during the run, before this process exits with an error (None: JAX's
        defaults).
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    timeout_s: int | None = None

    def __post_init__(self):
        if self.coordinator is not None:
            host, colon, port = str(self.coordinator).rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"coordinator must be HOST:PORT (e.g. 10.0.0.1:1234), got {self.coordinator!r}")
        for field, low in (("num_processes", 1), ("process_id", 0), ("timeout_s", 1)):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{field} must be an integer >= {low}, got {value!r}")
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ValueError(f"process_id {self.process_id} must be smaller than num_processes {self.num_processes}")

    @classmethod
    def resolve(
        cls,
        coordinator: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        timeout_s: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Processes | None:
        """The multi-process setting from flags, else the environment; None for one process.

        Read from the environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
        ``JAX_PROCESS_ID``, ``REMAT_KIT_DISTRIBUTED_TIMEOUT``; ``REMAT_KIT_DISTRIBUTED=1`` alone asks
        JAX to detect a cluster (SLURM, Open MPI, TPU pods).

        >>> Processes.resolve(env={})
        >>> Processes.resolve("127.0.0.1:1234", 2, env={"JAX_PROCESS_ID": "1"})
        Processes(coordinator='127.0.0.1:1234', num_processes=2, process_id=1, timeout_s=None)

        Raises:
          ValueError: a malformed or partial setting (a coordinator without a process count or id).
        """
        env = os.environ if env is None else env

        def from_env(value, name):
            if value is not None or name not in env:
                return value
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None

        coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
        num_processes = from_env(num_processes, "JAX_NUM_PROCESSES")
        process_id = from_env(process_id, "JAX_PROCESS_ID")
        timeout_s = from_env(timeout_s, "REMAT_KIT_DISTRIBUTED_TIMEOUT")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1):
            raise ValueError(f"timeout_s must be an integer >= 1, got {timeout_s!r}")  # also with one process
        if coordinator is None:
            if num_processes not in (None, 1) or process_id not in (None, 0):
                raise ValueError(
                    f"{num_processes} processes (this one {process_id}) need a coordinator: pass --coordinator "
                    "HOST:PORT or set JAX_COORDINATOR_ADDRESS"
                )
            if env.get("REMAT_KIT_DISTRIBUTED") == "1":
                return cls(timeout_s=timeout_s)
            return None
        if num_processes is None or process_id is None:
            raise ValueError(
                f"coordinator {coordinator!r} given without the process count and this process's id: pass "
                "--num-processes and --process-id (or set JAX_NUM_PROCESSES and JAX_PROCESS_ID)"
            )
        return cls(coordinator, num_processes, process_id, timeout_s)

    def local_devices(self, spec: str | MeshSpec | None) -> int:
        """Devices each process contributes to ``spec``'s mesh.

        >>> Processes("h:1", 2, 0).local_devices("data=2,fsdp=2")
        2

        Raises:
          ValueError: the mesh's device count is not a multiple of the process count.
        """
        spec = MeshSpec.parse(spec)
        n = self.num_processes or 1
        if spec.size % n:
            raise ValueError(
                f"mesh {spec} has {spec.size} devices, which {n} processes cannot share evenly; use a mesh whose "
                f"size is a multiple of {n} (every process contributes the same number of devices)"
            )
        return spec.size // n


def initialize_processes(spec: str | MeshSpec | None = None, processes: Processes | None = None) -> Processes | None:
    """Join a multi-process run (``jax.distributed.initialize``) and set up this process's devices.

    Call before any device query. With ``processes`` None (one process) this only simulates
    ``spec``'s CPU devices (:func:`ensure_cpu_devices`). Otherwise each process simulates its share
    of the mesh's CPU devices (a no-op for GPUs and TPUs), cross-process CPU collectives go over
    gloo, and the run joins the coordinator. If JAX is already initialized, nothing is done again.

    First the processes meet over a plain socket on the coordinator's port (the roll call): process 0
    waits (up to the timeout) for every other one to report, and raises a clear error naming those that
    never did; another process raises one if it cannot reach process 0. JAX itself would abort the
    process (a fatal log and a C++ stack; "another task died"). Once joined, a process that stops
    sending heartbeats for the timeout makes JAX abort every other process (SIGABRT, "Terminating
    process because the JAX distributed service detected fatal errors"), so no process waits forever
    on a dead one.

    Args:
      spec: the mesh the run will use (checked to split evenly over the processes).
      processes: the setting (:meth:`Processes.resolve`).

    Returns:
      ``processes``.

    Raises:
      ValueError: the mesh does not split over the processes (checked before anything starts).
      TimeoutError: a process did not join within the timeout (process 0 names which).
      OSError: process 0 cannot listen on the coordinator's port.
    """
    if processes is None:
        ensure_cpu_devices(spec)
        return None
    # Without a mesh (e.g. `plan` of one device) there is nothing to split; train checks its own mesh.
    local = processes.local_devices(spec) if spec and processes.num_processes else None
    if jax.distributed.is_initialized():
        return processes
    if local is not None and local > 1:
        with contextlib.suppress(RuntimeError):  # backends already up: make_mesh reports the real count
            jax.config.update("jax_num_cpu_devices", local)
    # gloo is JAX's default for CPU since 0.5; set it so older releases do not fall back to none.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if processes.coordinator is not None:
        kwargs = {
            "coordinator_address": processes.coordinator,
            "num_processes": processes.num_processes,
            "process_id": processes.process_id,
        }
    if processes.timeout_s is not None:
        kwargs |= {"initialization_timeout": processes.timeout_s, "heartbeat_timeout_seconds": processes.timeout_s}
    if processes.coordinator is not None:
        timeout = processes.timeout_s or JAX_JOIN_TIMEOUT_S
        # Said first, so that JAX's abort when a process never joins comes with this context.
        print(
            f"process {processes.process_id} of {processes.num_processes}: joining the coordinator at "
            f"{processes.coordinator} (waiting up to {timeout} s for all processes)",
            file=sys.stderr,
            flush=True,
        )
        if processes.num_processes > 1:
            _roll_call(processes, timeout) if processes.process_id == 0 else _answer_roll_call(processes, timeout)
    jax.distributed.initialize(**kwargs)
    return processes


# ---- the roll call: every process is there before JAX joins them ---------------------------------------
# JAX aborts a process whose peers do not all join within its timeout (a fatal log and a C++ stack, in
# process 0 too), and a process that finds no coordinator is told "another task died". So first, over a
# plain socket on the coordinator's port, process 0 waits for every other process to report, and tells
# them all to go on only once everyone has; whoever is missing is named in one line, before JAX starts.

_ROLL_CALL = b"remat-kit process "  # + the id and a newline; process 0 answers GO, or STOP once it gives up
_GO, _STOP = b"go\n", b"stop\n"


def _roll_call(processes: Processes, timeout_s: float) -> None:
    """Process 0: wait up to ``timeout_s`` for every other process to report on the coordinator's port."""
    port = int(processes.coordinator.rpartition(":")[2])
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    try:
        server = socket.create_server(("", port), family=family, dualstack_ipv6=family == socket.AF_INET6)
    except OSError as err:
        raise OSError(
            f"process 0 of {processes.num_processes} cannot listen on port {port} of --coordinator "
            f"{processes.coordinator}: {err.strerror or err}"
        ) from None
    joined: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    try:
        with server:
            while len(joined) < processes.num_processes - 1 and (left := deadline - time.monotonic()) > 0:
                server.settimeout(left)
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    break
                pid = _read_id(conn)
                if pid is None or not 0 < pid < processes.num_processes or pid in joined:
                    conn.close()  # not one of ours, or a second process with the same id
                    continue
                joined[pid] = conn
        missing = sorted(set(range(1, processes.num_processes)) - set(joined))
        for conn in joined.values():
            with contextlib.suppress(OSError):
                conn.sendall(_STOP if missing else _GO)
    finally:
        for conn in joined.values():
            conn.close()
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise TimeoutError(
            f"process 0 of {processes.num_processes}: process{'es' if len(missing) > 1 else ''} {shown} never "
            f"joined the coordinator at {processes.coordinator} within {timeout_s:g} s; start one process per "
            "--process-id with the same --coordinator and --num-processes (--distributed-timeout sets the wait)"
        )


def _read_id(conn: socket.socket) -> int | None:
    conn.settimeout(5.0)
    try:
        line = conn.recv(64)
    except OSError:
        return None
    text = line.removeprefix(_ROLL_CALL).strip() if line.startswith(_ROLL_CALL) else b""
    return int(text) if text.isdigit() else None


def _answer_roll_call(processes: Processes, timeout_s: float) -> None:
    """Another process: report to process 0 (retrying until ``timeout_s``) and wait for its go."""
    host, _, port = processes.coordinator.rpartition(":")
    who = f"process {processes.process_id} of {processes.num_processes}"
    deadline = time.monotonic() + timeout_s
    why = "no answer"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0) as conn:
                conn.sendall(_ROLL_CALL + str(processes.process_id).encode() + b"\n")
                conn.settimeout(max(deadline - time.monotonic(), 0) + 5.0)  # process 0 answers within its wait
                answer = conn.recv(16)
        except OSError as err:
            why = err.strerror or str(err)
            answer = b""
        if answer == _GO:
            return
        if answer == _STOP:
            raise TimeoutError(
                f"{who}: process 0 at {processes.coordinator} gave up waiting for the other processes (it names "
                "those missing); start one process per --process-id"
            )
        # Not listening yet, or not answering: process 0 has not started, or it refused this id (taken).
        time.sleep(0.2)
    raise TimeoutError(
        f"{who} could not join the coordinator at {processes.coordinator} within {timeout_s:g} s ({why}); is process "
        f"0 running there, the port reachable from this host, and no other process started with --process-id "
        f"{processes.process_id}? (--distributed-timeout sets the wait)"
    )


def maybe_initialize_distributed(env: Mapping[str, str] | None = None) -> bool:
    """Call ``jax.distributed.initialize()`` when the environment configures a multi-process run.

    The environment-only form of :func:`initialize_processes` (see :meth:`Processes.resolve` for
    the variables read).

    Returns:
      True when it initialized, False on a single host.
    """
    processes = Processes.resolve(env=env)
    if processes is None:
        return False
    initialize_processes(None, processes)
    return True


def process_prefix() -> str:
    """``"[pN] "`` for process N > 0 of a multi-process run, ``""`` for process 0 (log lines)."""
    return f"[p{jax.process_index()}] " if jax.process_index() else ""


def is_main_process() -> bool:
    """True in process 0, the one that writes metrics, plots and progress."""
    return jax.process_index() == 0


def check_same_across_processes(record: Mapping, what: str = "configuration") -> None:
    """Raise ValueError in every process unless all processes hold the same JSON-able ``record``.

    Process 0's record is compared with every other process's; the message names the fields that
    differ. A no-op in one process. Every process must call it (it is a collective).

    Raises:
      ValueError: some process's record differs from process 0's.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(record, sort_keys=True).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray(raw.size, np.int64))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: raw.size] = raw
    everyone = multihost_utils.process_allgather(padded)
    records = [json.loads(bytes(row[: int(n)]).decode()) for row, n in zip(everyone, sizes, strict=True)]
    diffs = []
    for pid, other in enumerate(records[1:], start=1):
        fields = _differing_fields(records[0], other)
        if fields:
            diffs.append(f"process {pid} differs from process 0 in {', '.join(fields)}")
    if diffs:
        raise ValueError(f"the processes disagree on the {what}: {'; '.join(diffs)} (start all with the same flags)")


def _differing_fields(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _differing_fields(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')} ({a!r} vs {b!r})"]
