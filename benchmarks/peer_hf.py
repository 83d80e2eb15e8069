"""remat_kit beside PyTorch + Hugging Face Transformers on the same model, batch, optimizer and threads.

The peer is a Transformers ``LlamaForCausalLM`` built from a config (random weights, nothing
downloaded) with the architecture of remat_kit's :class:`~remat_kit.model.transformer.Transformer`: RMSNorm
pre-norm, RoPE, causal attention (SDPA), SwiGLU MLP of the same hidden width, untied output
projection, no biases, no dropout. Both train with AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8,
weight decay 1e-4: optax's defaults, given to torch explicitly) on the same random tokens.

Each (framework, policy) runs in its own subprocess pinned to the same ``--threads`` cores
(``sched_setaffinity`` + ``OMP_NUM_THREADS``; ``torch.set_num_threads`` too), which reports its peak
resident set (``ru_maxrss``: the whole process, imports and compilation included), its resident
set just before the first step (parameters and optimizer state live), and the median step time
over ``--steps`` steps after ``--warmup``. Policies:

=============  =======================================  ==============================================
policy         remat_kit                                Transformers
=============  =======================================  ==============================================
``none``       ``none``                                 no checkpointing
``full``       ``full``                                 ``activation_checkpointing_enable()``
``every_n:2``  ``every_n:2``                            ``activation_checkpointing_enable(every_n_layers=2)``
``offload``    ``offload`` (layer inputs to host)       ``activation_checkpointing_enable(offload=True)``
=============  =======================================  ==============================================

Run it with a Python that has torch and transformers (the ``peer`` extra; never needed by the
tests); the remat_kit side may run in another interpreter (``--jax-python``)::

    python benchmarks/peer_hf.py --quick                      # smoke test, a minute or two
    python benchmarks/peer_hf.py --json benchmarks/results/peer_hf.json   # the issue's config

Targets on CPU (issue 17): remat_kit's peak memory ≤ the peer's and its step time ≤ the peer's, for
every policy. The table states the measured ratios either way.

A 2-core cloud machine's speed drifts by 10 % and more over minutes, and one (framework, policy) run
after another lets the drift fall on one side of a ratio. ``--rounds N`` runs the whole set N times,
policy by policy and remat_kit then the peer within each, and reports per policy the median over
the rounds of each round's ratio, with its min–max: each ratio compares two runs minutes apart, not
two runs a whole benchmark apart. ``--interleave`` goes further: a policy's workers (remat_kit, its
``--loss-chunks`` variant, the peer) are started side by side, warm up one after the other, and then
step in turn, one worker computing at a time; each turn gives a ratio of two steps run seconds
apart, and the table reports their median and min–max. Its figures are the ones to quote.

    python benchmarks/peer_hf.py --interleave --steps 8 --json benchmarks/results/peer_hf.json

remat_kit runs twice per policy: with the plain loss, as the peer's (like for like), and with the
fused chunked loss in ``--loss-chunks`` chunks (default 4: what ``remat-kit train``'s default
``loss_chunks="auto"`` picks at this shape, so the step a remat_kit user trains with).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

#: The issue's configuration: hidden 512, 8 layers, 8 heads, SwiGLU, vocabulary 32,000, float32.
#: d_ff = 1408 is remat_kit's SwiGLU ratio (2.75 × d_model, as the ``small`` preset).
MODEL = dict(vocab_size=32_000, d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, d_ff=1408, max_seq_len=1024)
FULL = dict(batch=4, seq=1024, steps=5, warmup=1)
QUICK = dict(batch=2, seq=256, steps=3, warmup=1)
POLICIES: tuple[str, ...] = ("none", "full", "every_n:2", "offload")
#: ``--loss-chunks``'s default: the count ``loss_chunks="auto"`` (``remat-kit train``'s default) picks at
#: FULL's shape, so a default run compares the step a remat_kit user trains with as well as the plain
#: loss (tests/test_peer_hf.py checks it against remat_kit.model.loss.auto_chunks).
DEFAULT_LOSS_CHUNKS = 4
ADAMW = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)


@dataclasses.dataclass(frozen=True)
class Result:
    """One framework under one policy.

    Attributes:
      framework: ``"remat_kit"`` or ``"peer"``.
      policy: the policy name of :data:`POLICIES`.
      ok: False when the framework cannot run the policy here (``error`` says why).
      peak_rss: peak resident set of the worker process in bytes (``ru_maxrss``: imports, model
        construction and JAX's compilation included). The targets are judged on this.
      step_peak_rss: peak resident set from the first step on (the kernel's high-water mark reset
        just before it): what training itself needs, without compile-time peaks.
      baseline_rss: resident set just before the first step.
      step_time_s: median of the timed steps; step_times_s: each of them.
      loss: the loss of the first step (same tokens, comparable across frameworks only roughly:
        the random initializations differ).
      error: the reason when not ``ok``.
      round: which round of ``--rounds`` it ran in (0-based).
      loss_chunks: remat_kit's ``lm_loss(loss_chunks=)`` (0: the plain loss, as the peer's).
      interleaved: stepped in turn with the policy's other workers (``--interleave``): its i-th
        step ran right before or after theirs.
    """

    framework: str
    policy: str
    ok: bool
    peak_rss: int = 0
    step_peak_rss: int = 0
    baseline_rss: int = 0
    step_time_s: float = 0.0
    step_times_s: tuple[float, ...] = ()
    loss: float = 0.0
    error: str = ""
    round: int = 0
    loss_chunks: int = 0
    interleaved: bool = False


# ---- workers (run in a fresh process each) -------------------------------------------------------------


def _rss() -> int:
    return _status("VmRSS")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_high_water_mark() -> None:
    # Linux >= 4.0: writing 5 resets VmHWM (not ru_maxrss) to the current resident set.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _tokens_numpy(batch: int, seq: int, vocab: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq), dtype=np.int32)


def _run_steps(step, warmup: int, turns, report=lambda seconds: None) -> tuple[list[float], float, int, int]:
    """Run ``warmup`` steps, then one timed step per item of ``turns`` (each timing given to ``report``).

    Returns:
      (times, first loss, RSS before the first step, peak RSS of the steps).
    """
    baseline = _rss()
    _reset_high_water_mark()
    first = None
    for _ in range(warmup):
        loss = step()
        first = loss if first is None else first
    times = []
    for _ in turns:
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
        first = loss if first is None else first
        report(times[-1])
    return times, float(first if first is not None else "nan"), baseline, _status("VmHWM")


def _asked_turns(lines):
    """For a worker the parent steps (``--interleave``): say ``@ready`` once warm, then a turn per ``step`` line.

    A generator, so ``@ready`` goes out when :func:`_run_steps` first asks for a turn, after its
    warm-up; any other line (``done``) or the end of ``lines`` ends the turns.
    """
    print("@ready", flush=True)
    for line in lines:
        if line.strip() != "step":
            return
        yield


def _report_step(seconds: float) -> None:
    """Tell the parent (``--interleave``) that an asked step took ``seconds``: the ``@step`` line it waits for."""
    print(f"@step {seconds!r}", flush=True)


def _jax_step(job: dict[str, Any]):
    """The compiled remat_kit training step of ``job``, as a function of nothing that returns the loss."""
    import jax
    import jax.numpy as jnp
    import optax

    from remat_kit.model.loss import lm_loss
    from remat_kit.model.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig(**job["model"])
    model = Transformer(config=cfg, policy=job["policy"])
    a = ADAMW
    opt = optax.adamw(a["lr"], b1=a["b1"], b2=a["b2"], eps=a["eps"], weight_decay=a["weight_decay"])

    chunks = job.get("loss_chunks", 0)

    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(model, p, tokens, loss_chunks=chunks))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = jnp.asarray(_tokens_numpy(job["batch"], job["seq"], cfg.vocab_size))
    params = jax.jit(lambda k: model.init(k, tokens[:1, :8])["params"])(jax.random.key(0))
    opt_state = jax.jit(opt.init)(params)
    compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
    state = {"params": params, "opt": opt_state}
    del params, opt_state

    def step():
        state["params"], state["opt"], loss = jax.block_until_ready(compiled(state["params"], state["opt"], tokens))
        return loss

    return step


def build_peer(model: dict[str, Any], policy: str):
    """The peer's ``LlamaForCausalLM`` (random init, in training mode, checkpointing per ``policy``) and its AdamW.

    Args:
      model: the :data:`MODEL`-shaped dict (vocab_size, d_model, num_layers, num_heads, num_kv_heads, d_ff,
        max_seq_len).
      policy: one of :data:`POLICIES`.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; allowed: {', '.join(POLICIES)}")
    torch.manual_seed(0)
    m = model
    config = LlamaConfig(
        vocab_size=m["vocab_size"],
        hidden_size=m["d_model"],
        intermediate_size=m["d_ff"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"],
        num_key_value_heads=m["num_kv_heads"],
        max_position_embeddings=m["max_seq_len"],
        rms_norm_eps=1e-6,  # remat_kit's TransformerConfig.norm_eps
        rope_theta=10_000.0,  # remat_kit's rope_base
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
        use_cache=False,
        attn_implementation="sdpa",
    )
    net = LlamaForCausalLM(config).float()
    net.train()
    if policy == "full":
        net.activation_checkpointing_enable()
    elif policy == "every_n:2":
        net.activation_checkpointing_enable(every_n_layers=2)
    elif policy == "offload":
        net.activation_checkpointing_enable(offload=True)
    a = ADAMW
    opt = torch.optim.AdamW(
        net.parameters(), lr=a["lr"], betas=(a["b1"], a["b2"]), eps=a["eps"], weight_decay=a["weight_decay"]
    )
    return net, opt


def _torch_step(job: dict[str, Any]):
    """The peer's training step of ``job`` (zero_grad, forward, backward, AdamW), returning the loss."""
    import torch

    torch.set_num_threads(job["threads"])
    m = job["model"]
    model, opt = build_peer(m, job["policy"])
    tokens = torch.from_numpy(_tokens_numpy(job["batch"], job["seq"], m["vocab_size"]).astype("int64"))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss  # shifted next-token cross-entropy, as lm_loss
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _worker_main(job_text: str) -> int:
    job = json.loads(job_text)
    if job.get("cores"):
        # Pinned here, before torch or JAX start their threads, rather than by a preexec_fn in the
        # parent: that would make subprocess fork a parent that may be running threads (JAX's, in tests).
        os.sched_setaffinity(0, job["cores"])
    chunks = job.get("loss_chunks", 0)
    try:
        step = (_jax_step if job["framework"] == "remat_kit" else _torch_step)(job)
        if job.get("serve"):
            times, loss, baseline, step_peak = _run_steps(step, job["warmup"], _asked_turns(sys.stdin), _report_step)
        else:
            times, loss, baseline, step_peak = _run_steps(step, job["warmup"], range(job["steps"]))
        result = Result(
            framework=job["framework"],
            policy=job["policy"],
            ok=bool(times),
            peak_rss=_peak_rss(),
            step_peak_rss=step_peak,
            baseline_rss=baseline,
            step_time_s=statistics.median(times) if times else 0.0,
            step_times_s=tuple(times),
            loss=loss,
            error="" if times else "no step was asked for",
            loss_chunks=chunks,
            interleaved=bool(job.get("serve")),
        )
    except Exception as e:  # reported in the table: e.g. offload needs an accelerator for pin_memory
        error = f"{type(e).__name__}: {e}".splitlines()[0]
        result = Result(job["framework"], job["policy"], ok=False, error=error, loss_chunks=chunks)
    print("@result " + json.dumps(dataclasses.asdict(result)), flush=True)
    return 0


# ---- the parent ------------------------------------------------------------------------------------------


def _worker_command(job: dict[str, Any], python: str, threads: int) -> dict[str, Any]:
    """``subprocess`` arguments for one worker: its command line, environment and core pinning."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: the peer is built from a config
    job = dict(job, cores=sorted(os.sched_getaffinity(0))[:threads])  # the worker pins itself to these
    args = [python, os.path.abspath(__file__), "--worker", json.dumps(job)]
    return dict(args=args, text=True, env=env)


def _parse_result(job: dict[str, Any], stdout: str, returncode: int, stderr: str) -> Result:
    lines = [line[len("@result ") :] for line in stdout.splitlines() if line.startswith("@result ")]
    if returncode != 0 or not lines:
        tail = stderr.strip().splitlines()[-1:] or [f"exit {returncode}"]
        return Result(job["framework"], job["policy"], ok=False, error=f"worker failed: {tail[0]}")
    fields = json.loads(lines[-1])
    return Result(**{**fields, "step_times_s": tuple(fields["step_times_s"])})


def run_one(job: dict[str, Any], python: str, threads: int) -> Result:
    """Run one (framework, policy) job in a fresh ``python`` process pinned to ``threads`` cores."""
    proc = subprocess.run(capture_output=True, **_worker_command(job, python, threads))
    return _parse_result(job, proc.stdout, proc.returncode, proc.stderr)


def run_interleaved(jobs: list[tuple[dict[str, Any], str]], threads: int, steps: int, pause_s: float = 0.5):
    """Run a policy's jobs side by side, one step at a time in turn: the drift of the machine falls on all alike.

    Every ``(job, python)`` gets its own worker process, pinned to the same ``threads`` cores, which
    builds its step, warms up and waits (one worker after the other: two compiling at once would
    slow both and inflate their peaks); then each of ``steps`` turns steps every worker once, one
    after the other (the order rotating by one each turn, so none always runs first), with
    ``pause_s`` before each step for the previous worker's threads to go idle. A worker that fails
    (a policy its framework cannot run here) drops out. Only one worker computes at any time, so
    each process's peak RSS is its own; their resident sets add up in memory, though (under 8 GB
    for ``none`` at the default shape).

    Returns:
      One :class:`Result` per job, in order, with ``interleaved=True``: step i of each ran in turn i.
    """
    with contextlib.ExitStack() as files:
        workers = []
        for job, python in jobs:
            job = dict(job, serve=True)
            err = files.enter_context(tempfile.TemporaryFile("w+"))  # an unread pipe could fill and stall it
            proc = subprocess.Popen(
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, **_worker_command(job, python, threads)
            )
            workers.append((job, proc, err, _read_until(proc, "@ready")))
        live = [i for i, (*_, seen) in enumerate(workers) if seen[-1:] and seen[-1].startswith("@ready")]
        for turn in range(steps):
            for i in live[turn % len(live) :] + live[: turn % len(live)] if live else []:
                proc, seen = workers[i][1], workers[i][3]
                if proc.poll() is not None:
                    continue
                time.sleep(pause_s)
                proc.stdin.write("step\n")
                proc.stdin.flush()
                seen += _read_until(proc, "@step")
        results = []
        for job, proc, err, seen in workers:
            stdout, _ = proc.communicate("done\n" if proc.poll() is None else None)
            err.seek(0)
            results.append(_parse_result(job, "".join(seen) + stdout, proc.returncode, err.read()))
    return results


def _read_until(proc, prefix: str) -> list[str]:
    """The lines of ``proc``'s stdout up to and including one starting with ``prefix`` (or to its end)."""
    lines = []
    while line := proc.stdout.readline():
        lines.append(line)
        if line.startswith(prefix):
            break
    return lines


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine_info(threads: int) -> dict[str, Any]:
    """The machine the figures come from: CPU model (``/proc/cpuinfo``), its core count, the threads each
    worker used, and the load average when asked (the step-time ratio depends on all of them)."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return dict(
        cpu_model=model,
        cores=os.cpu_count(),
        threads_per_worker=threads,
        load_average=[round(x, 2) for x in os.getloadavg()],
    )


def _machine_line(info: dict[str, Any]) -> str:
    load = ", ".join(f"{x:.2f}" for x in info["load_average"])
    return (
        f"machine: {info['cpu_model']}, {info['cores']} cores, {info['threads_per_worker']} threads per worker "
        f"(load average {load})"
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One policy (and remat_kit loss) over every round: each framework's figures and the remat_kit / peer ratios.

    Attributes:
      policy: the policy name.
      loss_chunks: remat_kit's ``loss_chunks`` in these runs (the peer's loss is always plain).
      rk_peak, peer_peak: the largest peak RSS over the rounds (bytes; 0 when it never ran).
      rk_step, peer_step: the median over the rounds of each round's median step time (0: never ran).
      mem_ratios, time_ratios: one ratio per round in which both ran (remat_kit / peer); with
        ``--interleave``, one time ratio per turn of those rounds.
    """

    policy: str
    loss_chunks: int
    rk_peak: int
    peer_peak: int
    rk_step: float
    peer_step: float
    mem_ratios: tuple[float, ...]
    time_ratios: tuple[float, ...]

    @property
    def label(self) -> str:
        return _variant(self.policy, self.loss_chunks)


def compare(results: list[Result]) -> list[Comparison]:
    """Per policy and remat_kit loss, in the order first run: the figures over every round and the per-round ratios.

    >>> rs = [Result("remat_kit", "none", True, peak_rss=3, step_time_s=9.0, round=0),
    ...       Result("peer", "none", True, peak_rss=4, step_time_s=10.0, round=0),
    ...       Result("remat_kit", "none", True, peak_rss=3, step_time_s=12.0, round=1),
    ...       Result("peer", "none", True, peak_rss=5, step_time_s=12.0, round=1)]
    >>> c = compare(rs)[0]
    >>> c.time_ratios, c.mem_ratios, c.rk_step, c.peer_peak
    ((0.9, 1.0), (0.75, 0.6), 10.5, 5)
    """
    out = []
    for policy in dict.fromkeys(r.policy for r in results):
        runs = [r for r in results if r.policy == policy]
        peer = {r.round: r for r in runs if r.framework == "peer" and r.ok}
        for chunks in dict.fromkeys(r.loss_chunks for r in runs if r.framework == "remat_kit") or (0,):
            rk = {r.round: r for r in runs if r.framework == "remat_kit" and r.loss_chunks == chunks and r.ok}
            both = [(rk[n], peer[n]) for n in sorted(rk) if n in peer]
            (rk_peak, rk_step), (peer_peak, peer_step) = _figures(rk), _figures(peer)
            out.append(
                Comparison(
                    policy,
                    chunks,
                    rk_peak,
                    peer_peak,
                    rk_step,
                    peer_step,
                    tuple(round(a.peak_rss / b.peak_rss, 6) for a, b in both),
                    tuple(ratio for a, b in both for ratio in _time_ratios(a, b)),
                )
            )
    return out


def _time_ratios(rk: Result, peer: Result) -> tuple[float, ...]:
    """remat_kit / peer step time: one ratio per turn when both were interleaved, else of the medians.

    >>> a = Result("remat_kit", "none", True, step_time_s=9.0, step_times_s=(9.0, 12.0), interleaved=True)
    >>> b = Result("peer", "none", True, step_time_s=11.0, step_times_s=(10.0, 12.0), interleaved=True)
    >>> _time_ratios(a, b), _time_ratios(dataclasses.replace(a, interleaved=False), b)
    ((0.9, 1.0), (0.818182,))
    """
    if rk.interleaved and peer.interleaved and len(rk.step_times_s) == len(peer.step_times_s):
        return tuple(round(a / b, 6) for a, b in zip(rk.step_times_s, peer.step_times_s, strict=True))
    return (round(rk.step_time_s / peer.step_time_s, 6),)


def _figures(by_round: dict[int, Result]) -> tuple[int, float]:
    """(largest peak RSS, median step time) of one framework's runs over the rounds; (0, 0.0) when none ran."""
    if not by_round:
        return 0, 0.0
    return max(r.peak_rss for r in by_round.values()), statistics.median(r.step_time_s for r in by_round.values())


def _ratio_cell(ratios: tuple[float, ...], width: int) -> str:
    if not ratios:
        return f"{'-':>{width}}"
    med = statistics.median(ratios)
    text = f"{med:.3f}" if len(ratios) == 1 else f"{med:.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
    return f"{text:>{width}}"


def format_table(results: list[Result]) -> list[str]:
    """Side-by-side rows per policy: the remat_kit / peer ratios (median, min-max over rounds) and the targets."""
    rounds = len({r.round for r in results})
    head = (
        f"{'policy':16} {'rk peak RSS':>12} {'peer peak RSS':>14} {'mem ratio':>20}  "
        f"{'rk step':>8} {'peer step':>9} {'time ratio':>20}  targets (mem <= 1, time <= 1)"
    )
    rows = [head, "-" * len(head)]
    for c in compare(results):
        cells = [f"{c.label:16}"]
        cells.append(f"{_gb(c.rk_peak):>12}" if c.rk_peak else f"{'failed':>12}")
        cells.append(f"{_gb(c.peer_peak):>14}" if c.peer_peak else f"{'n/a':>14}")
        cells.append(_ratio_cell(c.mem_ratios, 20))
        cells.append(f" {c.rk_step:>7.2f}s" if c.rk_peak else f" {'-':>8}")
        cells.append(f"{c.peer_step:>8.2f}s" if c.peer_peak else f"{'-':>9}")
        cells.append(_ratio_cell(c.time_ratios, 20))
        if c.time_ratios:
            mem, tr = statistics.median(c.mem_ratios), statistics.median(c.time_ratios)
            cells.append(f"  mem {'met' if mem <= 1.0 else 'MISSED'}, time {'met' if tr <= 1.0 else 'MISSED'}")
        rows.append(" ".join(cells))
    if any(r.interleaved for r in results):
        rows += [
            "(interleaved: a policy's workers alive side by side, stepping in turn; a time ratio per turn, of two "
            "steps run one right after the other: their median and min-max"
            + (f", over {rounds} rounds)" if rounds > 1 else ")")
        ]
    elif rounds > 1:
        rows += [
            f"({rounds} rounds: peak RSS the largest, step the median of the rounds' medians, ratios the median of "
            "the rounds' ratios with their min-max)"
        ]
    notes = sorted({f"{r.framework} {r.policy}: {r.error}" for r in results if not r.ok})
    if any(c.loss_chunks for c in compare(results)):
        rows += ["(lc=K: remat_kit's loss_chunks=K, the fused chunked cross-entropy; the peer's loss is the plain one)"]
    if notes:
        rows += ["", "not run:", *(f"  {n}" for n in notes)]
    rows += [
        "",
        "RSS before the first step (params, optimizer state where allocated, runtime) -> peak during the steps:",
    ]
    rows += [
        f"  {r.framework:9} {_variant(r.policy, r.loss_chunks):16} "
        f"{('r' + str(r.round + 1)) if rounds > 1 else '':3}"
        f"{_gb(r.baseline_rss)} -> {_gb(r.step_peak_rss)}   steps: "
        + ", ".join(f"{t:.2f}" for t in r.step_times_s)
        + f" s, first loss {r.loss:.4f}"
        for r in results
        if r.ok
    ]
    rows += ["(torch's AdamW allocates its state in the first step; JAX's exists before it)"]
    return rows


def _variant(policy: str, loss_chunks: int) -> str:
    """A policy and remat_kit loss as the table names them: ``none``, ``none lc=4``."""
    return f"{policy} lc={loss_chunks}" if loss_chunks else policy


def _label(job: dict[str, Any]) -> str:
    return f"{job['framework']} {_variant(job['policy'], job['loss_chunks'])}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK}")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated subset of " + ", ".join(POLICIES)
    )
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--layers", type=int, help=f"override the depth ({MODEL['num_layers']})")
    parser.add_argument("--steps", type=int, help="timed steps per policy (median reported)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="cores for each worker")
    parser.add_argument("--jax-python", default=sys.executable, help="interpreter for the remat_kit workers")
    parser.add_argument("--torch-python", default=sys.executable, help="interpreter with torch + transformers")
    parser.add_argument("--rounds", type=int, default=1, help="run the whole set this many times (see above)")
    parser.add_argument(
        "--loss-chunks",
        type=int,
        default=DEFAULT_LOSS_CHUNKS,
        help="also run remat_kit with lm_loss(loss_chunks=K), the fused loss (default: %(default)s, what "
        "loss_chunks='auto' picks at the issue's shape; 0: the plain loss only)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="keep a policy's workers alive side by side and step them in turn (see above)",
    )
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker)

    run = dict(QUICK if args.quick else FULL)
    for key in ("batch", "seq", "steps", "warmup"):
        if getattr(args, key) is not None:
            run[key] = getattr(args, key)
    model = dict(MODEL, max_seq_len=max(MODEL["max_seq_len"], run["seq"]))
    if args.layers:
        model["num_layers"] = args.layers
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        parser.error(f"unknown policies {bad}; allowed: {', '.join(POLICIES)}")
    if args.loss_chunks < 0:
        parser.error(f"--loss-chunks must be >= 0, got {args.loss_chunks}")
    for key, value in (*run.items(), ("threads", args.threads), ("rounds", args.rounds)):
        if value < (0 if key == "warmup" else 1):
            parser.error(f"--{key} must be positive, got {value}")

    print(f"model: {model}")
    print(f"run: {run}, threads per worker: {args.threads}, AdamW {ADAMW}, float32")
    print(_machine_line(machine_info(args.threads)))
    results = []
    for rnd in range(args.rounds):
        for policy in policies:
            variants = [("remat_kit", 0), *([("remat_kit", args.loss_chunks)] if args.loss_chunks else []), ("peer", 0)]
            jobs = []
            for framework, chunks in variants:
                tried = [r for r in results if (r.framework, r.policy, r.loss_chunks) == (framework, policy, chunks)]
                if rnd and not any(r.ok for r in tried):
                    continue  # failed in the first round (peer offload on CPU): it will fail again
                job = dict(framework=framework, policy=policy, model=model, threads=args.threads, **run)
                job["loss_chunks"] = chunks
                jobs.append((job, args.jax_python if framework == "remat_kit" else args.torch_python))
            rnd_label = f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else ""
            if args.interleave:
                print(f"running {policy}, {len(jobs)} workers interleaved{rnd_label} ...", file=sys.stderr, flush=True)
                done = run_interleaved(jobs, args.threads, run["steps"])
            else:
                done = []
                for job, python in jobs:
                    print(f"running {_label(job)}{rnd_label} ...", file=sys.stderr, flush=True)
                    done.append(run_one(job, python, args.threads))
            for (job, _), r in zip(jobs, done, strict=True):
                r = dataclasses.replace(r, round=rnd, loss_chunks=job["loss_chunks"])
                status = f"{_gb(r.peak_rss)}, {r.step_time_s:.2f} s/step" if r.ok else r.error
                print(f"  {_label(job)}{rnd_label}: {status}", file=sys.stderr, flush=True)
                results.append(r)
    info = machine_info(args.threads)  # the load average again, after the runs
    print()
    print("\n".join(format_table(results)))
    print(_machine_line(info) + " (after the runs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": model,
                    "run": run,
                    "rounds": args.rounds,
                    "loss_chunks": args.loss_chunks,
                    "interleave": args.interleave,
                    "threads": args.threads,
                    "adamw": ADAMW,
                    "machine": info,
                    "results": [dataclasses.asdict(r) for r in results],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
