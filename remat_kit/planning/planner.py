"""The compile-only step planner: one model's training step traced and compiled per policy and shape, memoized.

:class:`StepPlanner` compiles the shared step (:mod:`remat_kit.step.update`) of any model
(:class:`remat_kit.planning.builtin.Planner` is the one of the built-in Transformer); :class:`Budget` is the
one rule of what fits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from remat_kit import _jax_internals, policies
from remat_kit import target as target_lib
from remat_kit.analysis import _xla_dump, explain, flops
from remat_kit.analysis.memory import CompiledMemory, tree_bytes
from remat_kit.constants import DEFAULT_MARGIN
from remat_kit.planning import cost
from remat_kit.step import mesh as mesh_lib
from remat_kit.step import update as step_lib
from remat_kit.units import check_int

#: Optimizers by name (their state is part of what must fit).
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": lambda: step_lib.make_optimizer(1e-3),  # train's clipped AdamW: what is planned is what is trained
    "adam": lambda: optax.adam(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-3),
    "sgd": lambda: optax.sgd(1e-3),
}


def get_optimizer(optimizer: str | optax.GradientTransformation) -> optax.GradientTransformation:
    """An optax optimizer from a name in :data:`OPTIMIZERS`, or the transformation itself."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZERS)} or an optax transformation"
        )
    return OPTIMIZERS[optimizer]()


@dataclasses.dataclass(frozen=True)
class Budget:
    """Device bytes a step may need, and the safety margin every need is inflated by: the one fit rule.

    A step fits when its compiled need times ``1 + margin`` is at most ``bytes``.

    >>> b = Budget(125, margin=0.25)
    >>> b.fits(100), b.fits(101), round(b.target, 6)
    (True, False, 100.0)

    Raises:
      TypeError/ValueError: ``bytes`` is not a positive integer, or ``margin`` is not in [0, 1).
    """

    bytes: int
    margin: float = DEFAULT_MARGIN

    def __post_init__(self):
        try:
            check_int("budget_bytes", self.bytes)
        except ValueError as err:  # NotAnIntegerError stays one (it is a TypeError too)
            raise type(err)(f"{err} (use parse_bytes('80GB') for a size string)") from None
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin!r}")

    @property
    def target(self) -> float:
        """The largest need that fits: ``bytes / (1 + margin)``."""
        return self.bytes / (1 + self.margin)

    def with_margin(self, need: int | float) -> float:
        """``need`` inflated by the margin: what is compared with ``bytes``."""
        return need * (1 + self.margin)

    def fits(self, need: int | float) -> bool:
        """Whether ``need`` (device bytes) fits, margin included."""
        return self.with_margin(need) <= self.bytes


#: The module of the built-in model: named here, never imported (:func:`is_built_in`).
BUILT_IN_MODEL = "remat_kit.model.transformer"


def is_built_in(obj: Any, name: str) -> bool:
    """Whether ``obj`` is an instance of the built-in model's class ``name`` (``"TransformerConfig"``,
    ``"Transformer"``), without importing the model: no such object exists unless its module was imported.

    >>> is_built_in(object(), "TransformerConfig")
    False
    """
    module = sys.modules.get(BUILT_IN_MODEL)
    return module is not None and isinstance(obj, getattr(module, name))


#: XLA options for the planner's CPU compiles. The planner only reads the buffer assignment
#: (``memory_analysis()``) and never runs the executable; buffer assignment is done on the optimized HLO,
#: before LLVM, so LLVM's optimization level changes the machine code but not one byte of the figures
#: (checked: every tiny candidate at two shapes, the 2B preset's ``full``; tested in test_budget.py)
#: while it halves the compile time. (``xla_cpu_use_fusion_emitters=False`` would be 4x faster still,
#: but it changes fusion and so the bytes: not used.)
CPU_PLAN_COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}


@contextlib.contextmanager
def cancel_on_error(pool: concurrent.futures.Executor):
    """On any exception (a Ctrl-C, a failed compile), drop the queued jobs: leaving the pool's ``with`` block
    otherwise runs every one of them first, and a Ctrl-C waited for all the policies' compiles, not one.

    >>> with concurrent.futures.ThreadPoolExecutor(1) as pool, cancel_on_error(pool):
    ...     pool.submit(int, "3").result()
    3
    """
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise


def target_mesh(target: target_lib.Target, mesh=None) -> Any:
    """The mesh of a compile-only target's devices: ``mesh`` a spec (``"data=2"``), None (one device) or a mesh
    already made of the target's devices.

    Raises:
      TypeError: ``mesh`` is a ``jax.sharding.Mesh`` of other devices: pass its spec.
    """
    if isinstance(mesh, jax.sharding.Mesh):
        if not set(mesh.devices.flat) <= set(target.devices(mesh.size)):
            raise TypeError(f"target {target}: pass the mesh as a spec such as 'data=2', not a Mesh of other devices")
        return mesh
    spec = mesh_lib.MeshSpec.parse(mesh or "data=1")
    return mesh_lib.make_mesh(spec, devices=target.devices(spec.size))


class StepPlanner:
    """Traces and compiles the shared training step (:mod:`remat_kit.step.update`) of one model, memoized.

    Each shape is traced, lowered and compiled once; ``compiles`` counts the XLA compiles done, the
    planner's cost (on CPU they run at LLVM -O0: see :data:`CPU_PLAN_COMPILER_OPTIONS`).

    Args:
      build: ``build(policy, batch, seq) -> (loss_fn, params, batch_args)``: the loss
        ``loss_fn(params, *batch_args)`` under ``policy`` and its inputs (ShapeDtypeStructs) at that
        shape; ``batch`` and ``seq`` are None for a model planned at one fixed shape.
      optimizer: a name in :data:`OPTIMIZERS` or an optax transformation; its state is part of the step.
      mesh: a ``jax.sharding.Mesh`` or spec (``"data=2,fsdp=2"``); bytes are then per device.
      progress: ``progress(done, total, what)`` after each compile (``total``: compiles done plus those
        known to be ahead, see :meth:`expect`).
      target: the device planned for (:func:`remat_kit.target.parse`: ``"local"``, the default, ``"h100"``, a
        config file...); a GPU target compiles for its compile-only devices, on a mesh of them.
    """

    def __init__(
        self,
        build: Callable,
        optimizer: str | optax.GradientTransformation = "adamw",
        mesh=None,
        progress: Callable | None = None,
        target=None,
    ):
        self.build = build
        self.target = target_lib.parse(target)
        if self.target.elsewhere:
            self.mesh = target_mesh(self.target, mesh)
        else:
            self.mesh = mesh_lib.make_mesh(mesh) if isinstance(mesh, (str, mesh_lib.MeshSpec)) else mesh
        self.optimizer_name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
        self.opt = get_optimizer(optimizer)
        self.progress = progress
        self.device = self.mesh.devices.flat[0] if self.mesh is not None else self.target.devices()[0]
        platform = self.device.platform
        self.compiler_options = CPU_PLAN_COMPILER_OPTIONS if platform == "cpu" else None
        self._traced: dict[tuple, Any] = {}
        self._forward: dict[tuple, Any] = {}
        self._lowered: dict[tuple, Any] = {}
        self._flops: dict[tuple, int] = {}
        self._work: dict[tuple, cost.Work] = {}
        self._loops: dict[tuple, bool] = {}
        self._memory: dict[tuple, CompiledMemory] = {}
        self._explained: dict[tuple, explain.Explanation] = {}
        self._lock = threading.Lock()
        self.compiles = 0
        self.planned = 0  # compiles known to be ahead (precompile, expect), for progress

    @property
    def hardware(self) -> cost.Hardware:
        """The throughputs recompute and offload are priced against by default: a GPU target's own
        (:func:`remat_kit.planning.cost.target_hardware`), else the backend's defaults."""
        if self.target.compile_only:
            return cost.target_hardware(self.target)
        return cost.default_hardware(self.device.platform)

    def _key(self, policy, batch, seq) -> tuple:
        return (str(policy), batch, seq)

    def _trace(self, policy: policies.Policy, batch: int | None, seq: int | None):
        key = self._key(policy, batch, seq)
        if key not in self._traced:
            with self.target.tracing():  # model code picks the target's kernels (attention)
                loss_fn, params, batch_args = self.build(policy, batch, seq)
                params, opt_state = step_lib.abstract_state(params, self.opt)
                kwargs = step_lib.jit_kwargs(params, opt_state, self.mesh, batch_args=len(batch_args))
                step = step_lib.make_step(loss_fn, self.opt)
                self._traced[key] = jax.jit(step, **kwargs).trace(params, opt_state, *batch_args)
        return self._traced[key]

    def _lower(self, policy: policies.Policy, batch: int | None, seq: int | None):
        key = self._key(policy, batch, seq)
        if key not in self._lowered:
            if key not in self._work:  # count the ops now: the trace is dropped below, and a count would retrace
                self._count(policy, batch, seq)
            self._lowered[key] = self._trace(policy, batch, seq).lower()
            self._traced.pop(key, None)  # keep memory flat over long searches
        return self._lowered[key]

    def forward_jaxpr(self, policy: policies.Policy, batch: int | None = None, seq: int | None = None):
        """The loss's own jaxpr under ``policy`` (no gradient, no optimizer: each block appears once; trace only,
        memoized)."""
        key = self._key(policy, batch, seq)
        if key not in self._forward:
            loss_fn, params, batch_args = self.build(policy, batch, seq)
            self._forward[key] = jax.make_jaxpr(loss_fn)(params, *batch_args)
        return self._forward[key]

    def is_compiled(self, policy: policies.Policy, batch: int | None = None, seq: int | None = None) -> bool:
        """Whether the step under ``policy`` at this shape has been compiled (its memory known)."""
        return self._key(policy, batch, seq) in self._memory

    def needs_by_shape(self) -> dict[tuple, int]:
        """Every compiled step's total need at every shape: ``(policy spec, batch, seq) -> bytes``."""
        return {k: m.total for k, m in self._memory.items()}

    def prepare(self, policy: policies.Policy, batch: int | None = None, seq: int | None = None) -> None:
        """Trace and lower the step under ``policy`` now (no compile), so a compile later starts at XLA."""
        if self._key(policy, batch, seq) not in self._memory:
            self._lower(policy, batch, seq)

    def flops(self, policy: policies.Policy, batch: int | None = None, seq: int | None = None) -> int:
        """Matmul FLOPs of one step (trace only; no compile)."""
        key = self._key(policy, batch, seq)
        if key not in self._flops:
            self._count(policy, batch, seq)
        return self._flops[key]

    def work(self, policy: policies.Policy, batch: int | None = None, seq: int | None = None) -> cost.Work:
        """The ops of one step, counted for the cost model (:class:`remat_kit.planning.cost.Work`; trace only)."""
        key = self._key(policy, batch, seq)
        if key not in self._work:
            self._count(policy, batch, seq)
        return self._work[key]

    def remat_outside_loops(self, policy: policies.Policy, batch: int | None = None, seq: int | None = None) -> bool:
        """Whether the step rematerializes outside a loop, where XLA may remove the recompute (trace only)."""
        key = self._key(policy, batch, seq)
        if key not in self._loops:
            self._count(policy, batch, seq)
        return self._loops[key]

    def _count(self, policy, batch, seq) -> None:
        # One trace of the step fills FLOPs, the cost model's op counts and where it rematerializes.
        key = self._key(policy, batch, seq)
        jaxpr = self._trace(policy, batch, seq).jaxpr
        self._flops[key] = flops.jaxpr_flops(jaxpr)
        self._work[key] = cost.work_of(jaxpr)
        self._loops[key] = _jax_internals.remat_outside_loops(jaxpr)

    def compiled_memory(self, policy: policies.Policy, batch=None, seq=None) -> CompiledMemory:
        """XLA's memory figures of the compiled step (per device under a mesh)."""
        key = self._key(policy, batch, seq)
        if key not in self._memory:
            lowered = self._lower(policy, batch, seq)
            compiled = lowered.compile(self.compiler_options) if self.compiler_options else lowered.compile()
            memory = CompiledMemory.from_compiled(compiled)
            with self._lock:
                self._memory[key] = memory
                self._lowered.pop(key, None)  # no longer needed: keep memory flat over long searches
                self.compiles += 1
                self.planned = max(self.planned - 1, 0)
                done, total = self.compiles, self.compiles + self.planned
            if self.progress:
                self.progress(done, total, f"{key[0]}" + ("" if batch is None else f" @ batch {batch} × seq {seq}"))
        return self._memory[key]

    @property
    def gradient_calibrates(self) -> bool:
        """Whether :meth:`gradient_need` may stand in for the step's compile here: on one local device (no mesh,
        no compile-only target), where the gradient alone compiles with no shardings to give."""
        return self.mesh is None and not self.target.elsewhere

    def lower_gradient(self, policy: policies.Policy, batch: int | None = None, seq: int | None = None):
        """The loss's gradient alone under ``policy``, lowered (no compile), for :meth:`gradient_need`."""
        loss_fn, params, batch_args = self.build(policy, batch, seq)
        params, opt_state = step_lib.abstract_state(params, self.opt)
        trainable, frozen = step_lib.partition(params)
        grad = jax.jit(step_lib.trainable_value_and_grad(loss_fn, frozen), donate_argnums=0)
        return grad.lower(trainable, *batch_args), tree_bytes(opt_state), tree_bytes(trainable)

    def gradient_need(self, lowered) -> tuple[int, int]:
        """The step's need estimated from its gradient alone (``lowered``: :meth:`lower_gradient`'s), one compile.

        The gradient compiled with the trainable parameters donated, as the step donates them, plus the optimizer
        state the step holds: on XLA:CPU it compiles in about half the step's time (the optimizer's update is most of
        a scanned step's kernels). Where the step's peak is in the backward pass that is its need; where it is in
        the update (activations narrower than the parameters), the update's temporaries come on top.

        Returns:
          ``(estimate, uncertainty)``: the uncertainty is the trainable parameters' bytes, what the update's
          temporaries may add (``benchmarks/results/fit.txt`` has how close it comes).
        """
        lowered, state_bytes, param_bytes = lowered
        compiled = lowered.compile(self.compiler_options) if self.compiler_options else lowered.compile()
        with self._lock:
            self.compiles += 1
        return CompiledMemory.from_compiled(compiled).total + state_bytes, param_bytes

    def explanation(self, policy: policies.Policy, batch=None, seq=None) -> explain.Explanation:
        """What is live at the compiled step's peak and where it is (:func:`remat_kit.analysis.explain.explain`).

        One more compile, with XLA's dump (memoized): asked only where a report must say why a policy's
        saving does not show in the step's peak (:func:`remat_kit.planning.budget.cse_notes`).
        """
        key = self._key(policy, batch, seq)
        if key not in self._explained:
            compiled, program = _xla_dump.compile_with_dump(self._trace(policy, batch, seq).lower())
            self._traced.pop(key, None)
            self._explained[key] = explain.explain(
                program, CompiledMemory.from_compiled(compiled), parameter_groups=lambda n: "inputs", has_optimizer=True
            )
            with self._lock:
                self.compiles += 1
        return self._explained[key]

    def expect(self, n: int) -> None:
        """Announce ``n`` more compiles ahead (an estimate), so progress shows how many are left."""
        with self._lock:
            self.planned += n

    def precompile(self, shapes: Sequence[tuple], jobs: int = 1) -> None:
        """Compile ``(policy, batch, seq)`` shapes not yet known, ``jobs`` at a time (XLA compiles on
        one core per job, outside the GIL). Each shape is traced and lowered here (Python, one at a
        time) and handed to the pool at once, so lowering the next overlaps compiling the last."""
        check_int("jobs", jobs)
        todo = [s for s in dict.fromkeys((str(p), b, q) for p, b, q in shapes) if s not in self._memory]
        todo_policies = {str(p): p for p, _, _ in shapes}
        with self._lock:
            self.planned += len(todo)
        run = lambda s: self.compiled_memory(todo_policies[s[0]], s[1], s[2])
        if jobs <= 1 or len(todo) <= 1:
            for s in todo:
                run(s)
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool, cancel_on_error(pool):
            futures = []
            for s in todo:
                self._lower(todo_policies[s[0]], s[1], s[2])
                futures.append(pool.submit(run, s))
            for f in futures:
                f.result()

    def memory(self, policy: policies.Policy, batch=None, seq=None) -> tuple[int, int]:
        """``(device bytes, host bytes)`` at the step's peak (per device under a mesh), under the one
        host rule (:func:`remat_kit.analysis.memory.host_offload`)."""
        m = self.compiled_memory(policy, batch, seq)
        return m.total, m.host

    def compiled_needs(self, batch=None, seq=None) -> dict[str, int]:
        """The device bytes of every policy already compiled at this shape, by spec (nothing compiled here)."""
        with self._lock:
            return {k[0]: m.total for k, m in self._memory.items() if k[1:] == (batch, seq)}

    def fits(self, policy, batch, seq, budget: Budget) -> bool:
        """Whether the step's device bytes at this shape fit ``budget`` (with its margin)."""
        return budget.fits(self.memory(policy, batch, seq)[0])
