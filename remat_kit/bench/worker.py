"""One policy measured in one process (run by ``bench`` in a fresh worker process per policy).

The worker protocol: ``python -m remat_kit.bench.worker --worker JOB_JSON`` prints progress lines
(``progress: ...``) on stderr and the record as the last JSON line on stdout.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from remat_kit import policies
from remat_kit.analysis import inspection
from remat_kit.analysis.memory import CompiledMemory
from remat_kit.model import lora
from remat_kit.model.loss import lm_loss
from remat_kit.model.transformer import Transformer, TransformerConfig
from remat_kit.planning import analysis
from remat_kit.planning.user_model import load_factory, model_from_factory
from remat_kit.step import allocator
from remat_kit.step import mesh as mesh_lib
from remat_kit.step import update as step_lib


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux ≥ 4.0), so the peak covers only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    peak = _proc_status("VmHWM")
    if peak is None:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return peak


class _MemoryProbe:
    """Device memory stats where the backend has them, else this process's resident set."""

    def __init__(self, device):
        self.device = device
        self.source = "device" if device.memory_stats() else "rss"
        self._baseline = 0

    def baseline(self) -> int:
        if self.source == "device":
            return int(self.device.memory_stats().get("bytes_in_use", 0))
        _reset_peak_rss()
        self._baseline = _proc_status("VmRSS") or _peak_rss()
        return self._baseline

    def peak(self) -> int:
        if self.source == "device":
            return int(self.device.memory_stats().get("peak_bytes_in_use", 0))
        # The kernel raises VmHWM lazily (on unmap and exit), so it can trail the resident set read
        # just after the reset; the peak since then is at least each of them.
        return max(_peak_rss(), _proc_status("VmRSS") or 0, self._baseline)


def measure(
    config: TransformerConfig,
    policy: str,
    batch: int,
    seq: int,
    *,
    steps: int = 5,
    warmup: int = 1,
    loss_chunks: int = 0,
    seed: int = 0,
    learning_rate: float = 1e-3,
    grads_path: str | None = None,
    log: Callable[[str], None] = lambda _: None,
    mesh: str | None = None,
) -> dict[str, Any]:
    """Compile, check and time one policy in this process; returns a partial record.

    With ``mesh`` (a spec such as ``"data=2,fsdp=2"``) the step runs sharded over that mesh and
    XLA's figures are per device (the process's peak RSS still covers every local device).

    The gradients at the initial parameters are written to ``grads_path`` (``.npz``) when given,
    so the caller can compare policies (None skips that check and its extra compile). Ratios and
    differences against ``none`` are left to the caller.
    """
    import jax
    import numpy as np

    log("compiling")
    mesh_obj = mesh_lib.make_mesh(mesh) if mesh else None
    a, compiled = analysis.analyze_compiled(
        config, policy, batch, seq, loss_chunks=loss_chunks, learning_rate=learning_rate, mesh=mesh_obj
    )
    model = Transformer(config=config, policy=policy)
    key_params, key_tokens = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(key_tokens, (batch, seq), 0, config.vocab_size, dtype=jax.numpy.int32)
    params = jax.jit(lambda k: model.init(k, tokens[:1])["params"])(key_params)
    opt_state = jax.jit(lambda p: step_lib.init_optimizer(analysis.optimizer(learning_rate), p))(params)
    if mesh_obj is not None:  # the compiled step takes its inputs laid out as it was compiled for
        params = jax.device_put(params, mesh_lib.tree_shardings(params, mesh_obj))
        opt_state = jax.device_put(opt_state, mesh_lib.tree_shardings(opt_state, mesh_obj))
        tokens = jax.device_put(tokens, mesh_lib.batch_sharding(mesh_obj))

    # Keep a host copy of the initial parameters for the gradient check, which runs after the
    # timed steps so that its own buffers cannot inflate (or pre-pay) the measured peak.
    initial = jax.device_get(params) if grads_path else None
    probe = _MemoryProbe(jax.devices()[0])
    baseline = probe.baseline()  # parameters and optimizer state live; the peak covers warm-up on
    first_loss = None
    times = []
    for i in range(warmup + steps):
        log(f"warm-up {i + 1}/{warmup}" if i < warmup else f"step {i + 1 - warmup}/{steps}")
        start = time.perf_counter()
        params, opt_state, loss, *_ = jax.block_until_ready(compiled(params, opt_state, tokens))
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if first_loss is None:
            first_loss = float(loss)  # the loss at the initial parameters, the same for every policy
    peak = probe.peak()
    del params, opt_state

    if grads_path:
        log("gradient check")
        trainable, frozen = lora.partition(initial)  # LoRA: the adapters' gradients (an int8 base has none)
        grad_fn = jax.value_and_grad(lambda t: lm_loss(model, lora.combine(t, frozen), tokens, loss_chunks=loss_chunks))
        grads = jax.jit(grad_fn)(trainable)[1]
        np.savez(grads_path, *[np.asarray(g, np.float32) for g in jax.tree.leaves(grads)])
        del grads
    return {
        "policy": a.policy,
        "saved_bytes": a.saved_bytes,
        "saved_host_bytes": a.saved_host_bytes,
        "layers_saved_bytes": a.layers_saved_bytes,
        "temp_bytes": a.memory.temp,
        "xla_peak_bytes": a.peak_bytes,
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        "peak_source": probe.source,
        "flops": a.flops,
        "compile_s": a.compile_s,
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "loss": first_loss,
        "warnings": list(a.warnings),
    }


def measure_model(
    model: str,
    policy: str,
    *,
    steps: int = 5,
    warmup: int = 1,
    seed: int = 0,
    learning_rate: float = 1e-3,
    grads_path: str | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """:func:`measure` for ``--model MODULE:FACTORY``: the shared step (:mod:`remat_kit.step.update`) of
    ``FACTORY(policy)``'s loss on its example inputs (ShapeDtypeStructs are drawn from ``seed``:
    floats normal × 0.02, integers zero), timed, its peak measured, its gradients written."""
    import jax
    import numpy as np

    make_loss, example = model_from_factory(load_factory(model), model)
    loss_fn = make_loss(policies.parse(policy))
    log("compiling")
    report = inspection.inspect(loss_fn, *example)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(example))))

    def real(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return jax.numpy.asarray(x)
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            return (0.02 * jax.random.normal(next(keys), x.shape)).astype(x.dtype)
        return jax.numpy.zeros(x.shape, x.dtype)

    params, *batch = jax.tree.map(real, tuple(example))
    opt = step_lib.make_optimizer(learning_rate)
    opt_state = jax.jit(lambda p: step_lib.init_optimizer(opt, p))(params)
    start = time.perf_counter()
    compiled = (
        jax.jit(step_lib.make_step(loss_fn, opt), **step_lib.jit_kwargs(params, opt_state))
        .trace(params, opt_state, *batch)
        .lower()
        .compile()
    )
    compile_s = time.perf_counter() - start
    xla_peak = CompiledMemory.from_compiled(compiled).total
    initial = jax.device_get(params) if grads_path else None
    probe = _MemoryProbe(jax.devices()[0])
    baseline = probe.baseline()
    first_loss, times = None, []
    for i in range(warmup + steps):
        log(f"warm-up {i + 1}/{warmup}" if i < warmup else f"step {i + 1 - warmup}/{steps}")
        start = time.perf_counter()
        params, opt_state, loss, *_ = jax.block_until_ready(compiled(params, opt_state, *batch))
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if first_loss is None:
            first_loss = float(loss)
    peak = probe.peak()
    del params, opt_state
    if grads_path:
        log("gradient check")
        grads = jax.jit(jax.grad(loss_fn))(initial, *batch)
        np.savez(grads_path, *[np.asarray(g, np.float32) for g in jax.tree.leaves(grads)])
    return {
        "policy": str(policies.parse(policy)),
        "saved_bytes": report.saved_bytes,
        "saved_host_bytes": report.saved_host_bytes,
        "layers_saved_bytes": report.saved_bytes,
        "temp_bytes": report.temp_bytes,
        "xla_peak_bytes": xla_peak,
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        "peak_source": probe.source,
        "flops": report.flops,
        "compile_s": compile_s,
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "loss": first_loss,
        "warnings": list(report.warnings),
    }


def _worker_main(job_text: str) -> int:
    job = json.loads(job_text)
    log = lambda m: print("progress: " + m, file=sys.stderr, flush=True)
    if "model" not in job:
        # A fresh process: simulate the mesh's CPU devices, before anything (the allocator's check) starts JAX.
        mesh_lib.ensure_cpu_devices(job.get("mesh"))
    allocator.return_freed_buffers()  # measured as train runs: on CPU, freed buffers leave the process
    if "model" in job:
        record = measure_model(job.pop("model"), log=log, **job)
        print(json.dumps(record))
        return 0
    config = TransformerConfig(**job.pop("config"))
    record = measure(config, log=log, **job)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m remat_kit.bench.worker --worker JOB_JSON (run by remat-kit bench)")
    sys.exit(_worker_main(sys.argv[2]))
