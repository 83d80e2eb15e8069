"""Training under every policy, exact resume after a kill, and clear errors for bad runs."""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ALL_SPECS

from remat_kit import cli, train
from remat_kit.cli.train import config_from_args
from remat_kit.model import loss
from remat_kit.model.transformer import TransformerConfig
from remat_kit.step import mesh as mesh_lib
from remat_kit.train import data, interrupt
from remat_kit.train import progress as train_progress
from remat_kit.train import trainer as trainer_lib
from remat_kit.train.checkpoint import Checkpoints

#: Per-step losses of one seed under two policies agree to this relative error (float32; the
#: model-level tolerance of the style guide). Remat only reorders float rounding.
LOSS_RTOL = 1e-4

STEPS = 6
BASE = dict(steps=STEPS, batch_size=2, seq_len=32, eval_every=3, eval_batches=1, learning_rate=3e-3)


@pytest.fixture(scope="module")
def corpus():
    # Real text: the first 96 KiB of the standard library's sources.
    return data.load_corpus(max_bytes=96 * 1024)


@pytest.fixture(scope="module")
def metrics_path(tmp_path_factory):
    return tmp_path_factory.mktemp("reference") / "metrics.jsonl"


@pytest.fixture(scope="module")
def reference(corpus, metrics_path):
    return train.train(train.TrainConfig(policy="none", **BASE), corpus, metrics_path=metrics_path)


def losses(result):
    return np.array([r["loss"] for r in result.history])


def test_loss_decreases_and_step_traces_once(reference):
    ls = losses(reference)
    assert len(ls) == STEPS and np.all(np.isfinite(ls))
    assert ls[-1] < ls[0] - 0.5, ls  # byte-level text starts near ln(256) = 5.5 and falls fast
    assert reference.step_traces == 1
    assert [r["step"] for r in reference.history] == list(range(1, STEPS + 1))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(reference.history[0])
    assert [r["step"] for r in reference.history if "val_loss" in r] == [3, 6]


# Gradient equality under every policy is checked where it is cheap (tests/test_scan.py,
# tests/test_model.py, tests/test_mesh.py). Here, three policies whose training steps differ in
# kind: plain per-layer remat, host offload inside the jitted step, and grouped (nested) scans.
TRAIN_SPECS = ["full", "offload", "segments:2"]
assert set(TRAIN_SPECS) < set(ALL_SPECS)


@pytest.mark.parametrize("spec", TRAIN_SPECS, ids=str)
def test_policies_give_the_same_losses(corpus, reference, spec):
    # No validation here (it does not change training, and each run compiles less).
    result = train.train(train.TrainConfig(policy=spec, **{**BASE, "eval_every": 0}), corpus)
    assert result.step_traces == 1 and not any("val_loss" in r for r in result.history)
    np.testing.assert_allclose(losses(result), losses(reference), rtol=LOSS_RTOL)
    # Parameters are not compared element-wise: Adam divides each gradient by its own scale, so
    # rounding noise in a near-zero gradient becomes a learning-rate-sized step. The losses and
    # the gradients themselves (tests/test_model.py) are the policy-independent quantities.


def test_chunked_loss_and_grad_accumulation_give_the_same_run(corpus, reference):
    # Two micro-batches of 1 see the same windows as one batch of 2 (batch i of size b holds
    # windows b*i .. b*i+b-1), and the chunked loss equals the plain one.
    cfg = train.TrainConfig(policy="full", **{**BASE, "batch_size": 1, "eval_every": 0}, grad_accum=2, loss_chunks=3)
    result = train.train(cfg, corpus)
    np.testing.assert_allclose(losses(result), losses(reference), rtol=LOSS_RTOL)


# One mesh with both axes; every policy under both meshes is checked in tests/test_mesh.py.
@pytest.mark.parametrize(("mesh", "spec"), [("data=2,fsdp=2", "offload")])
def test_training_over_a_mesh_gives_the_same_losses(corpus, reference, mesh, spec):
    # Four simulated CPU devices (tests/conftest.py); the batch of 2 is doubled to split 4 ways.
    cfg = train.TrainConfig(policy=spec, **{**BASE, "batch_size": 1, "eval_every": 0}, grad_accum=2)
    with pytest.raises(ValueError, match=r"batch 1 is not divisible by the data-parallel device count 4"):
        train.Trainer(cfg, mesh)
    cfg = train.TrainConfig(policy=spec, **{**BASE, "batch_size": 4, "steps": 3, "eval_every": 3})
    single = train.train(cfg, corpus)
    sharded = train.train(cfg, corpus, mesh=mesh)
    np.testing.assert_allclose(losses(sharded), losses(single), rtol=LOSS_RTOL)
    assert sharded.history[-1]["val_loss"] == pytest.approx(single.history[-1]["val_loss"], rel=LOSS_RTOL)
    kernel = sharded.state.params["layers"]["layers"]["mlp_up"]["kernel"]
    assert "fsdp" in tuple(kernel.sharding.spec) and kernel.sharding.spec[0] is None


def test_a_retrace_is_an_error(corpus):
    trainer = train.Trainer(train.TrainConfig(**BASE))
    state = trainer.init_state()
    state, _ = trainer.step(state, [np.zeros((2, 32), np.int32)])
    with pytest.raises(train.RetraceError, match="traced 2 times"):
        trainer.step(state, [np.zeros((2, 16), np.int32)])


def test_a_trainer_on_cpu_returns_freed_buffers(monkeypatch):
    # Training on CPU fixes the C allocator's mmap threshold (remat_kit.step.allocator) before its first step.
    calls = []
    monkeypatch.setattr(trainer_lib.allocator, "return_freed_buffers", lambda: calls.append(1) or True)
    train.Trainer(train.TrainConfig(**BASE))
    assert calls == [1]


def test_resume_under_another_policy_continues_the_run(corpus, reference, tmp_path):
    def crash_after_4(step, record):
        if step == 4:
            raise KeyboardInterrupt

    cfg = train.TrainConfig(policy="none", **BASE)
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg, corpus, checkpoint_dir=tmp_path, checkpoint_every=3, callbacks=[crash_after_4])
    with Checkpoints(tmp_path) as ckpts:
        assert ckpts.steps() == [3]
    # The parameter tree is the same under every policy, so a run may switch policy on resume.
    resumed = train.train(train.TrainConfig(policy="sqrt_n", **BASE), corpus, checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_from == 3
    assert [r["step"] for r in resumed.history] == [4, 5, 6]
    np.testing.assert_allclose(losses(resumed), losses(reference)[3:], rtol=LOSS_RTOL)


def test_metrics_file_and_plot(reference, metrics_path):
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert records == list(reference.history)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and all("loss" in r for r in records)
    png = metrics_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- kill and resume through the CLI ------------------------------------------------------------------

# The CLI, slowed to 0.2 s per step so the test can kill it between checkpoints. Dropout is on, so
# exact resume also needs the checkpointed RNG. It sees as many CPU devices as this process (conftest's):
# the compiled step depends on the device count (chunked attention's chains), and so do its last bits.
_SLOW_CLI = f"""
import sys, time
import jax
jax.config.update("jax_num_cpu_devices", {jax.device_count()})
from remat_kit import cli
from remat_kit import train
_train = train.train
train.train = lambda *a, **k: _train(*a, callbacks=[lambda step, record: time.sleep(0.2)], **k)
sys.exit(cli.main(sys.argv[1:]))
"""

_ARGS = [
    "train",
    "--preset",
    "tiny",
    "--policy",
    "selective",
    "--steps",
    "12",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--checkpoint-every",
    "4",
    "--eval-every",
    "5",
    "--eval-batches",
    "1",
    "--max-corpus-bytes",
    "65536",
    "--seed",
    "3",
    "--dropout",
    "0.1",
    "--no-progress",
]


def _metric_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError, KeyError):
            out.append(json.loads(line)["step"])
    return out


def test_killed_run_resumes_exactly(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_metrics, run_metrics = tmp_path / "ref.jsonl", tmp_path / "run.jsonl"
    assert cli.main([*_ARGS, "--checkpoint-dir", str(ref_dir), "--metrics", str(ref_metrics)]) == 0

    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI, *_ARGS, "--checkpoint-dir", str(run_dir), "--metrics", str(run_metrics)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    try:
        # Kill (SIGKILL: no clean-up at all) once step 4 is checkpointed and step 6 is done.
        while not ((run_dir / "4").is_dir() and max(_metric_steps(run_metrics), default=0) >= 6):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the run never reached step 6"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(_metric_steps(run_metrics))
    with Checkpoints(run_dir) as ckpts:
        assert 6 <= killed_at < 12 and ckpts.steps() == [4]

    assert cli.main([*_ARGS, "--checkpoint-dir", str(run_dir), "--metrics", str(run_metrics), "--resume"]) == 0

    ref = [json.loads(line) for line in ref_metrics.read_text().splitlines()]
    run = [json.loads(line) for line in run_metrics.read_text().splitlines()]
    assert [r["step"] for r in run] == list(range(1, 13))  # steps 5..killed_at were redone, not duplicated
    # Exact: the same compiled step on the same inputs is deterministic on CPU.
    assert [r["loss"] for r in run] == [r["loss"] for r in ref]
    assert [r.get("val_loss") for r in run] == [r.get("val_loss") for r in ref]
    abstract = jax.eval_shape(lambda: train.Trainer(config_from_args(_parse(_ARGS))).init_state().to_dict())
    with Checkpoints(ref_dir) as ref_ckpts, Checkpoints(run_dir) as run_ckpts:
        ref_state, run_state = ref_ckpts.restore_latest(abstract), run_ckpts.restore_latest(abstract)
    assert ref_state[0] == run_state[0] == 12
    for a, b in zip(jax.tree.leaves(run_state[1]), jax.tree.leaves(ref_state[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _parse(argv):
    return cli.build_parser().parse_args(argv)


# ---- bad input: one clear line, exit 2, existing checkpoints untouched -----------------------------------


def _tree_snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    own_source = str(Path(train.__file__).parent)  # --data with a folder of real text
    args = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--data", own_source, "--no-progress"]
    assert cli.main(["train", *args, "--checkpoint-dir", str(root / "ckpt")]) == 0
    return root / "ckpt", args


def _run_cli(argv, capsys):
    code = cli.main(argv)
    err = capsys.readouterr().err
    return code, err.strip()


def test_missing_data_path(capsys, tmp_path):
    code, err = _run_cli(["train", "--data", str(tmp_path / "nope.txt"), "--steps", "2"], capsys)
    assert code == 2 and "data path" in err and "nope.txt" in err and "does not exist" in err


def test_empty_corpus(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    code, err = _run_cli(["train", "--data", str(tmp_path), "--steps", "2"], capsys)
    assert code == 2 and "is empty" in err


def test_sequence_longer_than_corpus(capsys, tmp_path):
    (tmp_path / "short.txt").write_text("a short text of sixty-some bytes, far too few for a sequence.\n")
    code, err = _run_cli(["train", "--data", str(tmp_path), "--seq-len", "128", "--steps", "2"], capsys)
    assert code == 2 and "sequence length 128" in err and "tokens" in err


def test_unwritable_checkpoint_dir(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a directory cannot be created under a file (even as root)
    code, err = _run_cli(["train", "--steps", "2", "--checkpoint-dir", str(blocker / "ckpt")], capsys)
    assert code == 2 and "not writable" in err and str(blocker / "ckpt") in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--keep", "0"], "--keep must be a positive integer, got 0"),
        (["--mesh", "fsdp=1000", "--batch-size", "1000"], "needs 1000 devices"),
        (["--data", "{tmp}/nonexistent"], "does not exist"),
        (["--batch-size", "4"], "the training step needs"),  # refused after the lock: what was made is taken back
    ],
    ids=["keep-0", "impossible-mesh", "missing-data", "too-little-memory"],
)
def test_a_refused_run_leaves_no_checkpoint_folder(extra, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_lib, "available_memory", lambda device: (1000, "this test's machine"))
    ckpt = tmp_path / "runs" / "ckpt"
    argv = ["train", "--steps", "2", "--seq-len", "16", "--checkpoint-dir", str(ckpt)]
    code, err = _run_cli([*argv, *[e.format(tmp=tmp_path) for e in extra]], capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []  # neither the folder, its parent, nor a lock file


def test_checkpoint_from_a_different_model(capsys, saved_run):
    ckpt, args = saved_run
    before = _tree_snapshot(ckpt)
    code, err = _run_cli(["train", *args, "--dropout", "0.1", "--checkpoint-dir", str(ckpt), "--resume"], capsys)
    assert code == 2 and "different model config" in err and "model.dropout: 0.0 (checkpoint) vs 0.1 (now)" in err
    code, err = _run_cli(["train", *args, "--preset", "small", "--checkpoint-dir", str(ckpt), "--resume"], capsys)
    assert code == 2 and "model.d_model: 64 (checkpoint) vs 256 (now)" in err
    assert _tree_snapshot(ckpt) == before


def test_different_data_or_batch_on_resume(capsys, saved_run):
    ckpt, args = saved_run
    before = _tree_snapshot(ckpt)
    code, err = _run_cli(["train", *args, "--batch-size", "4", "--checkpoint-dir", str(ckpt), "--resume"], capsys)
    assert code == 2 and "batch_size: 2 (checkpoint) vs 4 (now)" in err
    code, err = _run_cli(["train", *args, "--seed", "1", "--checkpoint-dir", str(ckpt), "--resume"], capsys)
    assert code == 2 and "seed: 0 (checkpoint) vs 1 (now)" in err
    assert _tree_snapshot(ckpt) == before


def test_existing_checkpoints_need_resume(capsys, saved_run):
    ckpt, args = saved_run
    before = _tree_snapshot(ckpt)
    code, err = _run_cli(["train", *args, "--checkpoint-dir", str(ckpt)], capsys)
    assert code == 2 and "already holds checkpoints (steps [2])" in err and "--resume" in err
    assert _tree_snapshot(ckpt) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "fulll"}, "unknown policy spec"),
        ({"steps": 0}, "steps must be a positive integer, got 0"),
        ({"seq_len": 129}, "exceeds the model's max_seq_len=128"),
        ({"warmup_steps": 6}, "warmup_steps=6 must be smaller than steps=6"),
        ({"learning_rate": -1.0}, "learning_rate must be a finite number > 0"),
        ({"learning_rate": float("inf")}, "learning_rate must be a finite number > 0, got inf"),
        ({"model": TransformerConfig(vocab_size=100)}, "smaller than the 256 byte-level tokens"),
        ({"loss_chunks": "fused"}, "loss_chunks must be 'auto', 0 .* or a positive integer .*got 'fused'"),
        ({"loss_chunks": -1}, "loss_chunks must be 'auto', 0 .* or a positive integer .*got -1"),
    ],
    ids=["policy", "steps", "seq_len", "warmup", "lr", "lr_inf", "vocab", "loss_chunks", "loss_chunks_negative"],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        train.TrainConfig(**{**BASE, **kwargs})


def test_loss_chunks_auto_is_resolved_for_the_runs_shape_and_mesh(monkeypatch):
    cfg = train.TrainConfig(**{**BASE, "batch_size": 4})
    assert cfg.loss_chunks == "auto"
    assert train.Trainer(cfg).loss_chunks == 0  # 4 × 32 tokens × 256: 128 KiB of logits, the plain loss
    monkeypatch.setattr(loss, "AUTO_FUSED_FROM", 1)
    monkeypatch.setattr(loss, "AUTO_CHUNK_BYTES", 4 * 32 * 256 * 4 // 8)
    assert train.Trainer(cfg).loss_chunks == 8
    assert train.Trainer(cfg, "data=4").loss_chunks == 0  # a batch over several devices
    assert train.Trainer(dataclasses.replace(cfg, loss_chunks=3), "data=4").loss_chunks == 3


def test_divergence_stops_before_saving_a_bad_state(corpus, tmp_path):
    cfg = train.TrainConfig(**{**BASE, "steps": 4, "learning_rate": 1e30}, clip_norm=1e30)
    with pytest.raises(
        train.DivergedError, match=r"(loss is nan|parameters became non-finite) at step \d; nothing saved after step"
    ):
        train.train(cfg, corpus, checkpoint_dir=tmp_path, checkpoint_every=1)
    with Checkpoints(tmp_path) as ckpts:
        good = ckpts.restore_latest(jax.eval_shape(lambda: train.Trainer(cfg).init_state().to_dict()))
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(good[1]["params"]))


def test_ctrl_c_saves_the_current_step_and_exits_130(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI, *_ARGS, "--checkpoint-dir", str(ckpt), "--metrics", str(metrics)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while max(_metric_steps(metrics), default=0) < 1:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = max(_metric_steps(metrics))
    assert last < 12 and f"interrupted after step {last}; saved step {last} in {ckpt / str(last)}" in err
    assert err.count(train_progress._StopOnSignal.MESSAGE) == 1  # acknowledged once, before the step finished
    assert err.index(train_progress._StopOnSignal.MESSAGE) < err.index("interrupted after step")
    assert "Traceback" not in err and "Exception ignored" not in err, err
    with Checkpoints(ckpt) as ckpts:
        assert ckpts.steps()[-1] == last  # saved although it is not a multiple of --checkpoint-every
        cfg = config_from_args(cli.build_parser().parse_args(_ARGS))
        step, restored, _ = ckpts.restore_latest(train.Trainer(cfg).abstract_state())
    assert step == last == int(restored["step"])


def test_stop_on_signal_acknowledges_from_the_wakeup_fd_and_restores_handlers():
    # A compile holds the main thread in C, where no Python handler runs; the acknowledgement must come
    # from the watcher thread reading the C-level wake-up write. A do-nothing Python handler stands in.
    messages = []
    before = signal.getsignal(signal.SIGINT), signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before[1])
    stop = train_progress._StopOnSignal(messages.append)
    with stop:
        stop._handle = lambda *_: None  # the Python-level handler does nothing: only the watcher can answer
        signal.signal(signal.SIGINT, stop._handle)
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while not messages and time.monotonic() < deadline:
            time.sleep(0.01)
    assert messages == [train_progress._StopOnSignal.MESSAGE]
    assert signal.getsignal(signal.SIGINT) is before[0] and signal.set_wakeup_fd(before[1]) == before[1]


def test_divergence_without_checkpoints_says_none_was_saved(corpus):
    cfg = train.TrainConfig(**{**BASE, "steps": 4, "learning_rate": 1e30}, clip_norm=1e30)
    with pytest.raises(train.DivergedError, match=r"at step \d; no checkpoint was saved\. Lower --lr"):
        train.train(cfg, corpus)


def test_a_step_that_needs_more_memory_than_there_is_is_refused_before_anything(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_lib, "available_memory", lambda device: (1000, "this test's machine"))
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(
        ValueError,
        match=r"the training step needs .* but this test's machine has 1.0 kB; lower "
        r"--batch-size \(with --grad-accum .*--policy full.*--loss-chunks K.*--lora-rank",
    ):
        train.train(train.TrainConfig(**BASE), corpus, metrics_path=metrics)
    assert not metrics.exists()  # refused before the metrics, the batches or the state


def test_compiled_step_need_is_xla_buffer_assignment_and_is_what_runs(corpus):
    trainer = train.Trainer(train.TrainConfig(**BASE))
    need = trainer.compile_step()
    state = trainer.init_state()
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves((state.params, state.opt_state)))
    assert need > state_bytes  # at least the state and its gradients
    trainer.step(state, [np.zeros((2, 32), np.int32)])
    assert trainer.traces["step"] == 1  # the step ran the compiled executable: traced once, by compile_step
    assert trainer_lib.available_memory(jax.devices()[0])[0] > 0  # MemAvailable on Linux


def test_impossible_meshes_are_refused_and_a_simulated_one_is_announced(corpus):
    cfg = train.TrainConfig(**{**BASE, "batch_size": 1000})
    with pytest.raises(ValueError, match=r"mesh data=1,fsdp=1000 needs 1000 devices .*at most 64 CPU devices"):
        train.Trainer(cfg, "fsdp=1000")
    params = {"w": jax.ShapeDtypeStruct((3, 5), np.float32)}
    with pytest.raises(ValueError, match=r"fsdp=2: no parameter has a dimension divisible by 2 .*shard nothing"):
        mesh_lib.check_fsdp_shards(params, mesh_lib.make_mesh("fsdp=2", jax.devices()[:2]))
    lines = []
    train.train(
        train.TrainConfig(**{**BASE, "steps": 1, "batch_size": 4, "eval_every": 0}),
        corpus,
        mesh="data=4",
        log=lines.append,
    )
    assert [line for line in lines if "simulated" in line] == [
        f"note: mesh data=4,fsdp=1 runs on 4 simulated CPU devices ({os.cpu_count()} cores here): it checks the "
        "sharding, not the speed of a real mesh"
    ]


def test_outputs_are_checked_before_any_work_and_their_folders_created(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"plot .*plot.txt': cannot write a .txt picture"):
        train.train(train.TrainConfig(**BASE), corpus, plot_path=tmp_path / "plot.txt")
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match=r"metrics file .*file/m.jsonl': .*file' is a file, not a folder"):
        train.train(train.TrainConfig(**BASE), corpus, metrics_path=tmp_path / "file" / "m.jsonl")
    cfg = train.TrainConfig(**{**BASE, "steps": 1, "eval_every": 0})
    train.train(cfg, corpus, metrics_path=tmp_path / "runs" / "new" / "m.jsonl", checkpoint_dir=tmp_path / "runs/c")
    assert (tmp_path / "runs" / "new" / "m.png").exists() and (tmp_path / "runs" / "c" / "1").is_dir()


_TWO_SIGNALS_IN_C = """
import os, signal, sys, time
from remat_kit.train import interrupt
with interrupt.StopOnSignal(exit_at_once=True) as stop:
    signal.signal(signal.SIGINT, lambda *_: None)  # as inside XLA: no Python handler runs at all
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
sys.exit(f"still running, requested={stop.requested}")
"""


def test_a_second_signal_while_python_handlers_cannot_run_ends_the_command_at_once():
    # Two Ctrl-C inside a compile reach Python's handler as one, after the compile: the watcher thread
    # counts the C-level wake-up bytes and ends the process itself.
    proc = subprocess.run([sys.executable, "-c", _TWO_SIGNALS_IN_C], capture_output=True, text=True, timeout=60)
    assert proc.returncode == interrupt.EXIT_INTERRUPTED, proc.stderr
    assert proc.stderr.splitlines() == [interrupt.StopOnSignal.MESSAGE, interrupt.StopOnSignal.AT_ONCE]


# ---- signals: a Ctrl-C at any moment is acknowledged once, saves what there is and exits 130 ----------

#: The CLI with a line on stderr when the first compile starts, and a slow step (so a signal lands mid-run).
_SIGNAL_CLI = """
import sys, time
from remat_kit import cli
from remat_kit.train import loop, trainer
_compile = trainer.Trainer.compile_step
def compile_step(self):
    print("COMPILING", file=sys.stderr, flush=True)
    return _compile(self)
trainer.Trainer.compile_step = compile_step
_train = loop.train
loop.train = lambda *a, **k: _train(*a, callbacks=[lambda step, record: time.sleep(0.3)], **k)
sys.exit(cli.main(sys.argv[1:]))
"""


def _start(tmp_path, *extra, program=("-c", _SIGNAL_CLI)):
    return subprocess.Popen(
        [sys.executable, *program, *_ARGS, "--checkpoint-dir", str(tmp_path / "ckpt"), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_handler(pid: int) -> None:
    # Python catches SIGINT from its first instant, SIGTERM only once remat_kit's handler is in: read
    # the process's caught-signal mask (Linux) instead of guessing with a sleep.
    deadline = time.monotonic() + 60
    while True:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught >> (signal.SIGTERM - 1) & 1:
            return
        assert time.monotonic() < deadline, "the CLI never installed its signal handler"
        time.sleep(0.005)


def _wait_for_line(proc, text: str) -> None:
    deadline = time.monotonic() + 180
    for line in proc.stderr:
        if text in line:
            return
        assert time.monotonic() < deadline, f"no {text!r} line"
    raise AssertionError(f"the run ended ({proc.wait()}) without printing {text!r}")


@pytest.mark.integration
@pytest.mark.parametrize("when", ["start_up", "first_compile", "twice_in_compile"])
def test_ctrl_c_before_the_first_step_exits_130_without_a_traceback(when, tmp_path):
    proc = _start(tmp_path, program=("-m", "remat_kit.cli") if when == "start_up" else ("-c", _SIGNAL_CLI))
    if when == "start_up":
        _wait_for_handler(proc.pid)
        # Then while the CLI imports JAX, before any progress line: train's own handler is in by then (the
        # command line's start-up one, before the command is known, ends the process at once).
        while "jaxlib" not in Path(f"/proc/{proc.pid}/maps").read_text():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=180)[1]
    else:
        _wait_for_line(proc, "COMPILING")
        proc.send_signal(signal.SIGINT)
        if when == "twice_in_compile":
            _wait_for_line(proc, interrupt.StopOnSignal.MESSAGE.split("…")[0])
            proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=180)[1]
    assert proc.returncode == interrupt.EXIT_INTERRUPTED, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    if when == "twice_in_compile":
        assert interrupt.StopOnSignal.AT_ONCE in err
    else:
        assert err.count(interrupt.StopOnSignal.MESSAGE) == 1, err
        assert "interrupted before step 1 (nothing to save)" in err and "remat-kit train: interrupted" in err
    assert not list((tmp_path / "ckpt").glob("[0-9]*"))  # nothing trained, nothing saved


@pytest.mark.integration
def test_a_second_writer_on_a_checkpoint_dir_is_refused_and_the_first_finishes_intact(tmp_path, capsys):
    first = _start(tmp_path, "--seed", "3")
    _wait_for_line(first, "COMPILING")  # the first run holds the lock from before its compile
    rc = cli.main([*_ARGS, "--seed", "4", "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"is in use by another run (pid {first.pid} on " in err and "choose another --checkpoint-dir" in err
    _, rest = first.communicate(timeout=300)
    assert first.returncode == 0, rest
    with Checkpoints(tmp_path / "ckpt") as ckpts:
        assert ckpts.steps()[-1] == 12 and ckpts.read_meta(12)["config"]["seed"] == 3  # the first run's, whole
