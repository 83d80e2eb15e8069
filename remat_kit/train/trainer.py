"""The jitted training and evaluation steps of one run (:class:`Trainer`), on one device or a mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from remat_kit import units
from remat_kit.analysis.memory import CompiledMemory
from remat_kit.model import loss as loss_lib
from remat_kit.model.loss import lm_loss
from remat_kit.model.transformer import Transformer, init_params
from remat_kit.step import allocator
from remat_kit.step import mesh as mesh_lib
from remat_kit.step import update as step_lib
from remat_kit.train.config import RetraceError, TrainConfig, TrainState, optimizer_for

# Compiled once per model config for the whole process (the policy does not change parameters),
# instead of hundreds of eagerly dispatched initializer ops per run.
_init_params = jax.jit(init_params, static_argnums=0)


class Trainer:
    """The jitted training and evaluation steps for one :class:`TrainConfig`.

    Args:
      config: the run's configuration.
      mesh: a ``jax.sharding.Mesh`` or spec (``"data=2,fsdp=2"``, see :mod:`remat_kit.step.mesh`):
        batches split over ``data`` × ``fsdp``, parameters and optimizer state sharded over
        ``fsdp``. None: one device. Like the policy, it may change on resume.
    """

    def __init__(self, config: TrainConfig, mesh=None):
        allocator.return_freed_buffers()  # on CPU, what a step frees leaves the process: its RSS follows the plan
        self.config = config
        self.model = Transformer(config=config.model, policy=config.policy)
        self.optimizer, self.schedule = optimizer_for(config)
        self.traces = {"step": 0, "eval": 0}
        self.mesh = mesh_lib.make_mesh(mesh) if isinstance(mesh, (str, mesh_lib.MeshSpec)) else mesh
        step_kw, eval_kw = {"donate_argnums": (0, 1)}, {}
        self._shardings = None
        #: The rows of each global batch this process feeds (all of them in one process).
        self.local_rows = slice(0, config.batch_size)
        if self.mesh is None and jax.process_count() > 1:
            raise ValueError(
                f"a run over {jax.process_count()} processes needs a mesh over all {jax.device_count()} devices "
                f"(e.g. --mesh data={jax.device_count()})"
            )
        if self.mesh is not None:
            mesh_lib.check_batch(config.batch_size, self.mesh)
            self.local_rows = mesh_lib.local_rows(config.batch_size, self.mesh)
            abstract = jax.eval_shape(self.init_state)
            mesh_lib.check_fsdp_shards(abstract.params, self.mesh)
            params = mesh_lib.tree_shardings(abstract.params, self.mesh)
            opt_state = mesh_lib.tree_shardings(abstract.opt_state, self.mesh)
            tokens = mesh_lib.batch_sharding(self.mesh)
            self._shardings = (params, opt_state, tokens)
            step_kw = step_lib.jit_kwargs(abstract.params, abstract.opt_state, self.mesh, batch_args=2)
            eval_kw = {"in_shardings": (params, tokens)}
        #: ``config.loss_chunks`` as a count (``"auto"`` resolved for this run's shape and mesh).
        self.loss_chunks = loss_lib.resolve_chunks(
            config.loss_chunks,
            config.batch_size * config.seq_len,
            config.model.vocab_size,
            1 if self.mesh is None else self.mesh.size,
        )
        # The step plan, auto and bench compile (remat_kit.step.update); parameters and optimizer state donated.
        micro_step = step_lib.make_step(self._loss, self.optimizer, on_trace=lambda: self._count_trace("step"))
        self._micro_step = jax.jit(micro_step, **step_kw)
        self._compiled_step = None  # set by compile_step: the executable later steps run
        self._eval = jax.jit(self._eval_impl, **eval_kw)

    def compile_step(self) -> int:
        """Compile the training micro-step for this run's shapes now, allocating and running nothing.

        Later :meth:`step` calls run this executable (it is compiled once either way).

        Returns:
          The bytes the step needs at its peak on each device (XLA's buffer assignment: arguments +
          outputs - donated + temporaries).
        """
        if self._compiled_step is None:
            abstract = jax.eval_shape(self.init_state)
            params, opt_state = abstract.params, abstract.opt_state
            tokens_sharding = None
            if self._shardings is not None:
                params_s, opt_s, tokens_sharding = self._shardings
                with_s = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                params, opt_state = jax.tree.map(with_s, params, params_s), jax.tree.map(with_s, opt_state, opt_s)
            shape = (self.config.batch_size, self.config.seq_len)
            tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=tokens_sharding)
            key = jax.eval_shape(lambda: jax.random.key(0))
            self._compiled_step = self._micro_step.lower(params, opt_state, tokens, key).compile()
        return CompiledMemory.from_compiled(self._compiled_step).total

    def check_memory(self, available: tuple[int, str] | None = None) -> None:
        """Refuse, before anything is allocated, a step that needs more memory than there is.

        Args:
          available: ``(bytes, what)`` free for the step (default :func:`available_memory` of the
            first local device; on CPU all simulated devices share it). None when unknown: no check.

        Raises:
          ValueError: naming the need, the memory there is and the levers that lower the need.
        """
        devices = jax.local_devices() if self.mesh is None else list(self.mesh.local_devices)
        available = available or available_memory(devices[0])
        if available is None:
            return
        per_device = self.compile_step()
        cpu = devices[0].platform == "cpu"
        need = per_device * (len(devices) if cpu and self.mesh is not None else 1)
        if need > available[0]:
            c = self.config
            raise ValueError(
                f"the training step needs {units.fmt_bytes(need)} (batch {c.batch_size} x seq {c.seq_len}, policy "
                f"{c.policy}) but {available[1]} has {units.fmt_bytes(available[0])}; lower --batch-size (with "
                "--grad-accum to keep the tokens per step), remat more (--policy full), --loss-chunks K, or train "
                "LoRA adapters (--lora-rank)"
            )

    def state_shardings(self) -> dict[str, Any] | None:
        """Shardings of :meth:`TrainState.to_dict`'s leaves on the mesh (None without a mesh).

        Parameters and optimizer state are FSDP-sharded; the step, data position and RNG are
        replicated, so that every process holds them and a checkpoint stores them once.
        """
        if self._shardings is None:
            return None
        params, opt_state, _ = self._shardings
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return {
            "params": params,
            "opt_state": opt_state,
            "step": replicated,
            "data_position": replicated,
            "rng": replicated,
        }

    def abstract_state(self) -> dict[str, Any]:
        """:meth:`TrainState.to_dict` of a fresh state as ``jax.ShapeDtypeStruct`` leaves (with the mesh's
        shardings), nothing allocated: what a checkpoint is restored into, resharded as needed."""
        abstract = jax.eval_shape(lambda: self.init_state().to_dict())
        # Without a mesh: one device. Orbax needs a target sharding to read a checkpoint that
        # another process count wrote.
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = self.state_shardings() or jax.tree.map(lambda _: one, abstract)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    def place(self, state: TrainState) -> TrainState:
        """Put a state on the mesh (:meth:`state_shardings`; a no-op without one)."""
        shardings = self.state_shardings()
        if shardings is None:
            return state
        multi = jax.process_count() > 1

        def put(x, sharding):
            # Across processes, a process-local array (the same in every process: a fresh state,
            # or the step counter) goes to the global mesh from host memory.
            if multi and getattr(x, "is_fully_addressable", True):
                x = np.asarray(x)
            return jax.device_put(x, sharding)

        return TrainState(**jax.tree.map(put, state.to_dict(), shardings))

    def _tokens(self, tokens) -> jax.Array:
        if self._shardings is None:
            return jnp.asarray(tokens)
        tokens = np.asarray(tokens)
        if tokens.shape[0] == self.config.batch_size:  # a whole global batch: keep this process's rows
            tokens = tokens[self.local_rows]
        return mesh_lib.global_batch(tokens, self.config.batch_size, self.mesh)

    def _count_trace(self, name: str) -> None:
        # Runs only while tracing. Per instance, unlike chex.assert_max_traces, whose counter is
        # keyed by source code and call stack and so is shared by every Trainer in the process.
        self.traces[name] += 1
        if self.traces[name] > 1:
            raise RetraceError(f"the jitted {name} function was traced {self.traces[name]} times; it must trace once")

    def _loss(self, params, tokens, key):
        dropout = self.config.model.dropout > 0
        return lm_loss(
            self.model,
            params,
            tokens,
            loss_chunks=self.loss_chunks,
            deterministic=not dropout,
            rngs={"dropout": key} if dropout else None,
        )

    def _eval_impl(self, params, tokens):
        self._count_trace("eval")
        return lm_loss(self.model, params, tokens, loss_chunks=self.loss_chunks)

    def init_state(self) -> TrainState:
        """A fresh state from ``config.seed``."""
        key = jax.random.key(self.config.seed)
        params = _init_params(self.config.model, jax.random.fold_in(key, 0))
        return TrainState(
            params=params,
            opt_state=step_lib.init_optimizer(self.optimizer, params),
            step=jnp.asarray(0, jnp.int32),
            data_position=jnp.asarray(0, jnp.int32),
            rng=jax.random.key_data(jax.random.fold_in(key, 1)),
        )

    def step(self, state: TrainState, batches: Sequence[np.ndarray]) -> tuple[TrainState, dict[str, float]]:
        """One optimizer update over ``grad_accum`` micro-batches (``int32 [batch, seq]`` each).

        Returns:
          The new state and ``{"loss", "grad_norm"}`` averaged over the micro-batches, with
          ``params_finite``: whether every new parameter is finite.
        """
        if len(batches) != self.config.grad_accum:
            raise ValueError(f"step needs {self.config.grad_accum} micro-batches, got {len(batches)}")
        step = int(state.step) + 1
        base = jax.random.wrap_key_data(state.rng)
        params, opt_state = state.params, state.opt_state
        losses, norms, finite = [], [], []
        micro_step = self._compiled_step or self._micro_step
        for micro, tokens in enumerate(batches):
            key = jax.random.fold_in(jax.random.fold_in(base, step), micro)
            params, opt_state, loss, norm, ok = micro_step(params, opt_state, self._tokens(tokens), key)
            losses.append(loss)
            norms.append(norm)
            finite.append(ok)
        new = TrainState(
            params=params,
            opt_state=opt_state,
            step=jnp.asarray(step, jnp.int32),
            data_position=jnp.asarray(int(state.data_position) + len(batches), jnp.int32),
            rng=state.rng,
        )
        return new, {
            "loss": float(np.mean(jax.device_get(losses))),
            "grad_norm": float(np.mean(norms)),
            "params_finite": bool(np.all(finite)),
        }

    def evaluate(self, params, windows: np.ndarray) -> float:
        """Mean loss over validation batches ``[num_batches, batch, seq]`` (no dropout).

        Across processes ``windows`` may hold only this process's rows (``[:, local_rows]``).
        """
        return float(np.mean([float(self._eval(params, self._tokens(w))) for w in windows]))


def available_memory(device: jax.Device) -> tuple[int, str] | None:
    """``(bytes, what)`` free for a training step on ``device``; None where it cannot be known.

    CPU: ``MemAvailable`` of ``/proc/meminfo`` (Linux). Accelerators: the device's limit less what is
    in use, where its ``memory_stats()`` reports them.
    """
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "this machine (MemAvailable)"
        except OSError:
            return None
        return None
    stats = getattr(device, "memory_stats", lambda: None)() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device.device_kind} {device.id}"
