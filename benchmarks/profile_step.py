"""Where one training step's time goes: a ``jax.profiler`` trace of the project's own step, per policy.

Compiles :func:`remat_kit.step.update.make_step` (clipped AdamW, donated state, as ``bench`` and ``train``)
for the ``small`` preset at its default shape (or ``--shape peer1k``: benchmarks/peer_hf.py's model at
batch 1 × 1,024) under each policy, runs it a few times, traces
``--steps`` steps and sums the XLA:CPU thunk events of the trace (each carries its HLO op name).
Each op is put in a class from the compiled HLO text: what it computes (a ``dot`` inside it, data
movement only) and where it comes from (its ``op_name`` scope and source frames: attention.py,
loss.py, optax, the lm head), then the table gives each class's share of the summed op time.

Thunks may overlap on the two threads of a 2-core machine, so the op times sum to a little more than
the wall time of the step; shares are of that sum (the wall time is printed beside it). Loops
(``while``) are containers and count only through the ops inside them.

    PYTHONPATH=. python benchmarks/profile_step.py --out benchmarks/results/profile_small.md \
        [--torch-python /path/to/venv-with-torch/bin/python]   # the peer too, under torch.profiler
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_hf  # a sibling script: the machine record and the peer model

POLICIES: tuple[str, ...] = ("none", "full", "every_n:2", "selective")
CLASSES: tuple[str, ...] = (
    "attention",
    "matmuls (layers)",
    "lm head matmuls",
    "cross-entropy",
    "optimizer",
    "copies / fills",
    "other elementwise",
)
#: HLO opcodes that only move or fill memory (a fusion made only of these is a copy).
_MOVES = frozenset(
    [
        "parameter",
        "constant",
        "copy",
        "bitcast",
        "transpose",
        "broadcast",
        "slice",
        "dynamic-slice",
        "dynamic-update-slice",
        "concatenate",
        "pad",
        "reshape",
        "tuple",
        "get-tuple-element",
        "iota",
        "copy-start",
        "copy-done",
    ]
)
_CONTAINERS = frozenset(("while", "conditional", "call"))


@dataclasses.dataclass(frozen=True)
class Op:
    """One HLO instruction of the compiled step: opcode, the fused opcodes it contains, and its origin."""

    name: str
    opcode: str
    inner: frozenset[str]
    op_name: str
    where: str  # "file.py:12 (function)" of its innermost source frame, "" if none


def parse_hlo(text: str) -> dict[str, Op]:
    """Every instruction of an HLO module's text, with what its fused computation contains (read by
    :func:`remat_kit.analysis._xla_dump.parse_hlo`, the package's one reader of XLA's text)."""
    from remat_kit.analysis import _xla_dump

    instructions, _ = _xla_dump.parse_hlo(text)
    opcodes: dict[str, set[str]] = collections.defaultdict(set)
    for i in instructions.values():
        opcodes[i.computation].add(i.opcode)
    return {
        i.name: Op(
            i.name, i.opcode, frozenset(opcodes[i.calls]) if i.calls else frozenset((i.opcode,)), i.op_name, i.source
        )
        for i in instructions.values()
        if i.computation  # not the printer marker _xla_dump adds
    }


def classify(op: Op | None) -> str | None:
    """The class of :data:`CLASSES` an op's time counts to (None: a container, counted through its body)."""
    if op is None:
        return "other elementwise"
    if op.opcode in _CONTAINERS:
        return None
    where = op.where
    has_dot = "dot" in op.inner or "convolution" in op.inner
    if "attention.py" in where and not re.search(r"rope|_rotate", where):
        return "attention"
    if op.inner <= _MOVES:
        return "copies / fills"
    if "loss.py" in where or re.search(r"logsumexp|take_along_axis|log_softmax", op.op_name):
        return "cross-entropy"
    if "jvp(" not in op.op_name:  # after the gradient: clipping, AdamW, the finite check
        return "optimizer"
    if has_dot:
        return "matmuls (layers)" if "Transformer.hidden" in op.op_name else "lm head matmuls"
    return "other elementwise"


def trace_events(trace_dir: str) -> list[dict]:
    """The complete ("X") events of the newest ``jax.profiler`` trace in ``trace_dir``."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def op_times(trace_dir: str) -> tuple[dict[str, float], float]:
    """Summed duration (seconds) of every HLO op's thunk events, and the executions' wall time."""
    events = trace_events(trace_dir)
    times: dict[str, float] = collections.defaultdict(float)
    wall = 0.0
    for e in events:
        if e.get("ph") != "X":
            continue
        op = (e.get("args") or {}).get("hlo_op")
        if op:
            times[op] += e["dur"] * 1e-6
        elif e["name"] == "ThunkExecutor::Execute (wait for completion)":
            wall += e["dur"] * 1e-6
    return dict(times), wall


#: Width of one slice of the wall-clock view (:func:`phases`): the CPU sampler's period.
PHASE_SECONDS = 0.05


class CpuSampler:
    """This process's user and system CPU seconds, sampled every :data:`PHASE_SECONDS` on a thread.

    The step runs with the GIL released, so the sampler sees the whole step; ``os.times`` counts
    every thread of the process (XLA's, YNNPACK's), kernel time for page faults included.
    """

    def __init__(self):
        import threading

        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t = os.times()
            self.samples.append((time.perf_counter(), t.user, t.system))
            self._stop.wait(PHASE_SECONDS)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def phases(events: list[dict], ops: dict[str, Op], samples, start: float, end: float) -> dict[str, tuple]:
    """The wall clock by class: ``{class: (wall seconds, cores busy, of them in the kernel)}``.

    The traced span is cut into :data:`PHASE_SECONDS` slices; each slice goes to the class with the
    most op time in it (``"no op running"`` when none), and the CPU the process used in it (from
    the sampler) is averaged per class. Unlike the op-time shares, which count concurrent ops twice
    and miss YNNPACK's worker threads, this says where the *wall* time goes and how many of the cores
    were busy there (1.0 of 2: one core idle); the kernel share is mostly page faults of fresh buffers.

    Args:
      events: :func:`trace_events` of the traced steps; ops: :func:`parse_hlo` of the program.
      samples: a :class:`CpuSampler`'s samples; start, end: ``perf_counter`` around the traced steps.
    """
    hlo = [e for e in events if (e.get("args") or {}).get("hlo_op")]
    if not hlo:
        return {}
    t0 = min(e["ts"] for e in hlo)
    width = PHASE_SECONDS * 1e6
    n = max(1, int((end - start) / PHASE_SECONDS))
    busy: list[dict[str, float]] = [collections.defaultdict(float) for _ in range(n)]
    for e in hlo:
        cls = classify(ops.get(e["args"]["hlo_op"]))
        if cls is None:
            continue
        a, b = e["ts"] - t0, e["ts"] - t0 + e["dur"]
        while a < b and int(a // width) < n:
            k = int(a // width)
            stop = min(b, (k + 1) * width)
            busy[k][cls] += stop - a
            a = stop
    cpu = [(0.0, 0.0)] * n
    for (ta, ua, sa), (tb, ub, sb) in itertools.pairwise(samples):
        k = int(((ta + tb) / 2 - start) / PHASE_SECONDS)
        if 0 <= k < n and tb > ta:
            cpu[k] = ((ub - ua + sb - sa) / (tb - ta), (sb - sa) / (tb - ta))
    out: dict[str, list[float]] = {}
    for k in range(n):
        cls = max(busy[k].items(), key=lambda kv: kv[1])[0] if busy[k] else "no op running"
        wall, cores, kernel = out.setdefault(cls, [0.0, 0.0, 0.0])
        out[cls] = [wall + PHASE_SECONDS, cores + cpu[k][0] * PHASE_SECONDS, kernel + cpu[k][1] * PHASE_SECONDS]
    return {c: (w, cs / w, ks / w) for c, (w, cs, ks) in out.items()}


def _shape(name: str):
    """``(config, (batch, seq))`` of a shape of :data:`ab_step.SHAPES` (the ``small`` preset, or ``peer1k``)."""
    from ab_step import SHAPES  # beside this script; imports JAX, so never in the peer's worker

    return SHAPES[name]


def profile_policy(policy: str, steps: int, warmup: int, preset: str = "small"):
    """Compile the step for ``policy``, time ``warmup`` steps, trace ``steps``; per-op times and HLO ops."""
    import jax

    from remat_kit.model.loss import lm_loss
    from remat_kit.model.transformer import Transformer
    from remat_kit.step import update as step_lib

    cfg, (b, s) = _shape(preset)
    model = Transformer(config=cfg, policy=policy)
    tokens = jax.random.randint(jax.random.key(1), (b, s), 0, cfg.vocab_size)
    params = jax.jit(lambda k: model.init(k, tokens[:1, :8])["params"])(jax.random.key(0))
    opt = step_lib.make_optimizer(1e-3)
    opt_state = step_lib.init_optimizer(opt, params)
    fn = step_lib.make_step(lambda p, t: lm_loss(model, p, t), opt)
    compiled = jax.jit(fn, **step_lib.jit_kwargs(params, opt_state)).lower(params, opt_state, tokens).compile()
    ops = parse_hlo(compiled.as_text())
    untraced = []
    for _ in range(warmup):
        start = time.perf_counter()
        params, opt_state, *_ = jax.block_until_ready(compiled(params, opt_state, tokens))
        untraced.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        with CpuSampler() as sampler:
            start = time.perf_counter()
            for _ in range(steps):
                params, opt_state, *_ = jax.block_until_ready(compiled(params, opt_state, tokens))
            end = time.perf_counter()
        jax.profiler.stop_trace()
        times, wall = op_times(d)
        by_phase = phases(trace_events(d), ops, sampler.samples, start, end)
    by_phase = {c: (w / steps, cores, kernel) for c, (w, cores, kernel) in by_phase.items()}
    return {k: v / steps for k, v in times.items()}, wall / steps, ops, untraced, by_phase


def summarize(times: dict[str, float], ops: dict[str, Op]) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
    """Per-class seconds and the ops (name, class, seconds), largest first; containers left out."""
    by_class: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
    rows = []
    for name, t in times.items():
        cls = classify(ops.get(name))
        if cls is None:
            continue
        by_class[cls] += t
        rows.append((name, cls, t))
    return by_class, sorted(rows, key=lambda r: -r[2])


def _origin(op: Op | None) -> str:
    if op is None:
        return ""
    scope = re.sub(r"^jit\(step\)/", "", op.op_name)
    scope = scope.replace("Transformer.hidden/layers/while/body/closed_call/", "layer/")
    return f"{scope[-70:]} ({op.where})" if op.where else scope[-90:]


# ---- the peer (PyTorch + Transformers), profiled with torch.profiler in its own interpreter -------------

_TORCH_COPIES = re.compile(
    r"aten::(copy_|clone|contiguous|cat|fill_|zero_|zeros|zeros_like|empty|empty_like|_to_copy|to)$"
)
_TORCH_MATMULS = re.compile(r"aten::(mm|addmm|bmm|matmul|linear)$")


def torch_class(name: str, ancestors: tuple[str, ...], shapes: str, vocab: int) -> str:
    """The class of :data:`CLASSES` a torch profiler event's self time counts to."""
    chain = " ".join((name, *ancestors))
    if "Optimizer.step" in chain or "Optimizer.zero_grad" in chain:
        return "optimizer"
    if "scaled_dot_product" in chain:
        return "attention"
    if re.search(r"log_softmax|nll_loss|cross_entropy|NllLoss|LogSoftmax", chain):
        return "cross-entropy"
    if _TORCH_MATMULS.match(name):
        return "lm head matmuls" if str(vocab) in shapes else "matmuls (layers)"
    if _TORCH_COPIES.match(name):
        return "copies / fills"
    return "other elementwise"


def _peer_worker(job: dict) -> int:
    # Runs in the peer's interpreter, which has no JAX: the shapes come in the job.
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(job["threads"])
    steps, warmup, vocab = job["steps"], job["warmup"], job["model"]["vocab_size"]
    model, opt = peer_hf.build_peer(job["model"], job["policy"])
    tokens = torch.from_numpy(peer_hf._tokens_numpy(job["batch"], job["seq"], vocab).astype("int64"))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        return loss.item()

    untraced = []
    for _ in range(warmup):
        start = time.perf_counter()
        step()
        untraced.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) / steps
    times: dict[tuple[str, str], float] = collections.defaultdict(float)
    for e in prof.events():
        ancestors, p = [], e.cpu_parent
        while p is not None:
            ancestors.append(p.name)
            p = p.cpu_parent
        shapes = str(e.input_shapes)
        cls = torch_class(e.name, tuple(ancestors), shapes, vocab)
        label = e.name if not _TORCH_MATMULS.match(e.name) else f"{e.name} {shapes}"
        times[(label, cls)] += e.self_cpu_time_total * 1e-6 / steps
    rows = sorted(((n, c, t) for (n, c), t in times.items()), key=lambda r: -r[2])
    print(json.dumps(dict(rows=rows, wall=wall, untraced=untraced, torch=torch.__version__)))
    return 0


def profile_peer(policy: str, python: str, steps: int, warmup: int, preset: str = "small"):
    """Run :func:`_peer_worker` under ``python``; ``(rows, wall, untraced, torch version)`` or an error string."""
    import subprocess

    threads = len(os.sched_getaffinity(0))
    cfg, (b, s) = _shape(preset)
    fields = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff", "max_seq_len")
    job = dict(policy=policy, model={f: getattr(cfg, f) for f in fields}, batch=b, seq=s, threads=threads)
    job.update(steps=steps, warmup=warmup)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    args = [python, os.path.abspath(__file__), "--peer-worker", json.dumps(job)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    out = json.loads(lines[-1])
    return [tuple(r) for r in out["rows"]], out["wall"], out["untraced"], out["torch"]


def _describe(shape: str) -> str:
    cfg, (b, s) = _shape(shape)
    return (
        f"vocabulary {cfg.vocab_size:,}, hidden {cfg.d_model}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
        f"d_ff {cfg.d_ff}, batch {b} × {s}, float32, clipped AdamW"
    )


def machine() -> str:
    """CPU model, core count and load average (peer_hf's machine record, as one line)."""
    info = peer_hf.machine_info(threads=0)
    load = ", ".join(f"{x:.2f}" for x in info["load_average"])
    return f"{info['cpu_model']}, {info['cores']} cores (affinity {len(os.sched_getaffinity(0))}), load average {load}"


def _class_table(by_class: dict[str, float], total: float) -> list[str]:
    """The per-class seconds and shares, as Markdown rows (the same table for every policy and the peer)."""
    return [
        "| class | seconds | share |",
        "|---|---:|---:|",
        *(f"| {c} | {by_class[c]:.3f} | {100 * by_class[c] / total:.1f}% |" for c in CLASSES),
    ]


def _phase_table(by_phase: dict[str, tuple]) -> list[str]:
    """The wall clock by class (:func:`phases`) as Markdown rows, largest first."""
    if not by_phase:
        return []
    total = sum(w for w, _, _ in by_phase.values())
    cores = len(os.sched_getaffinity(0))
    return [
        f"Wall clock by class ({PHASE_SECONDS * 1e3:.0f} ms slices, each to the class with the most op time; "
        f"cores busy of {cores}, from the process's CPU time; kernel: of it in the kernel, mostly page faults):",
        "",
        "| class | wall s | share of wall | cores busy | kernel |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {c} | {w:.2f} | {100 * w / total:.1f}% | {busy:.2f} | {kernel:.2f} |"
            for c, (w, busy, kernel) in sorted(by_phase.items(), key=lambda kv: -kv[1][0])
        ),
        "",
    ]


def _peer_section(policy: str, peer, top: int) -> tuple[str, list[str]]:
    """A summary row and a detail section for the peer under ``policy`` (or its error)."""
    if isinstance(peer, str):
        return f"| peer {policy} | failed: {peer} |", []
    rows, wall, untraced, version = peer
    by_class = dict.fromkeys(CLASSES, 0.0)
    for _, c, t in rows:
        by_class[c] += t
    total = sum(by_class.values())
    row = f"| peer {policy} | {wall:.3f} s | " + " | ".join(f"{100 * by_class[c] / total:.1f}%" for c in CLASSES)
    detail = [
        f"## peer (PyTorch {version} + Transformers) {policy}",
        "",
        f"Profiled wall time per step {wall:.3f} s; summed self CPU time {total:.3f} s; unprofiled steps "
        + ", ".join(f"{t:.3f}" for t in untraced)
        + " s.",
        "",
        *_class_table(by_class, total),
        "",
        f"Top {top} ops (self CPU time):",
        "",
        "| op | class | ms | share |",
        "|---|---|---:|---:|",
        *(f"| `{n[:110]}` | {c} | {1e3 * t:.1f} | {100 * t / total:.1f}% |" for n, c, t in rows[:top]),
        "",
    ]
    return row + " |", detail


def report(results, command: str, top: int, peers=None, shape: str = "small") -> list[str]:
    import jax

    lines = [
        f"# One training step, profiled: where the time goes (`{shape}`: {_describe(shape)})",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine()} (at the end of the run). jax {jax.__version__}.",
        "The run itself keeps the cores busy: a load average well above their number means other work shared",
        "them (absolute times inflated; read the shares). Shares are of the summed XLA:CPU thunk times: ops",
        "on two threads overlap, so the sum can exceed the wall time, and YNNPACK's worker threads are not in",
        "it; the wall-clock table per policy says where the wall time goes and how busy the cores were.",
        "How to read it, and what was changed because of it: `benchmarks/results/profile_notes.md`.",
        "",
    ]
    summary = ["| policy | wall / step | " + " | ".join(CLASSES) + " |", "|---" * (len(CLASSES) + 2) + "|"]
    detail = []
    for policy, (times, wall, ops, untraced, by_phase) in results.items():
        by_class, rows = summarize(times, ops)
        total = sum(by_class.values())
        summary.append(
            f"| {policy} | {wall:.3f} s | " + " | ".join(f"{100 * by_class[c] / total:.1f}%" for c in CLASSES) + " |"
        )
        detail += [
            f"## {policy}",
            "",
            f"Traced wall time per step {wall:.3f} s; summed op time {total:.3f} s; untraced steps "
            + ", ".join(f"{t:.3f}" for t in untraced)
            + " s.",
            "",
            *_class_table(by_class, total),
            "",
            *_phase_table(by_phase),
            f"Top {top} ops:",
            "",
            "| op | class | ms | share | origin (op_name scope, innermost source frame) |",
            "|---|---|---:|---:|---|",
            *(
                f"| {n} | {c} | {1e3 * t:.1f} | {100 * t / total:.1f}% | `{_origin(ops.get(n))}` |"
                for n, c, t in rows[:top]
            ),
            "",
        ]
    for policy, peer in (peers or {}).items():
        row, section = _peer_section(policy, peer, top)
        summary.append(row)
        detail += section
    return [*lines, "## Summary: share of step time per class", "", *summary, "", *detail]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--steps", type=int, default=2, help="traced steps per policy (times are per step)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", help="write the markdown report here (else stdout)")
    parser.add_argument("--shape", default="small", choices=("small", "peer1k", "peer"), help="the model and batch")
    parser.add_argument("--torch-python", help="an interpreter with torch + transformers: profile the peer too")
    parser.add_argument("--peer-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.peer_worker:
        return _peer_worker(json.loads(args.peer_worker))
    results = {}
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        print(f"profiling {policy} ...", file=sys.stderr, flush=True)
        results[policy] = profile_policy(policy, args.steps, args.warmup, args.shape)
        print(f"  median untraced step {statistics.median(results[policy][3] or [0]):.3f} s", file=sys.stderr)
    peers = {}
    if args.torch_python:
        for policy in [p for p in results if p in ("none", "full", "every_n:2")]:  # the peer has no selective
            print(f"profiling the peer, {policy} ...", file=sys.stderr, flush=True)
            peers[policy] = profile_peer(policy, args.torch_python, args.steps, args.warmup, args.shape)
    command = "PYTHONPATH=. python benchmarks/profile_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join(report(results, command.strip(), args.top, peers, args.shape)) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
