"""Two JAX processes x 2 CPU devices on localhost train, plan and checkpoint like one process x 4.

The module fixture runs two 2-process launches of this file (see ``_child``), each with a hard
time limit and its processes always killed afterwards:

* ``main``: processes started with different flags are refused; then ``full``, ``selective`` and
  ``offload`` runs over ``--mesh data=2,fsdp=2``; a resume of a 1-process checkpoint; a
  compile-only plan; last, a run in which process 1 dies (SIGKILL) mid-way: process 0 must abort
  within JAX's heartbeat timeout (``--distributed-timeout``).
* ``resume``: both restart the killed run with ``--resume`` and must end bit for bit where
  ``main``'s uninterrupted ``full`` run did.

Cross-process all-reduces (gloo) add in another order than in-process ones, so 2 processes agree
with 1 process x 4 devices to float rounding (rel 1e-5), and with themselves bit for bit. Against
1 device (no sharding at all) the losses agree to 1e-5 but single parameters need not: AdamW's
first steps move each weight by about ``lr * g / |g|``, so a weight whose gradient is rounding
noise moves by +-lr in either run (the same holds for any sharded run, one process or many).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# Process orchestration around JAX, not JAX itself: CI runs these once, on the default JAX (.ci/run).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
MESH = "data=2,fsdp=2"
POLICIES = ("full", "selective", "offload")
STEPS = 6
KILL_AT = 4  # process 1 dies after computing this step, before saving it
HEARTBEAT_S = 15  # --distributed-timeout of the kill scenario
LAUNCH_LIMIT_S = 300  # hard limit of one launch (2 busy cores, several compiles)
RTOL_F32 = 1e-5


def _train_args(corpus: Path, policy: str = "full") -> list[str]:
    return [
        "train",
        "--preset",
        "tiny",
        "--policy",
        policy,
        "--steps",
        str(STEPS),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--val-fraction",
        "0.1",
        "--data",
        str(corpus),
        "--no-progress",
        "--mesh",
        MESH,
    ]


# ---- the child: `python tests/test_multiprocess.py SCENARIO PORT PID WORKDIR` ------------------------


def _child(scenario: str, port: int, pid: int, work: Path) -> None:
    from remat_kit import cli
    from remat_kit.model.transformer import TransformerConfig
    from remat_kit.planning import analysis
    from remat_kit.step import mesh as mesh_lib
    from remat_kit.train import loop as train_loop

    dist = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)]
    corpus = work / "corpus.txt"
    out: dict = {}

    def run(*args: str) -> int:
        print(f"=== {' '.join(args)}", file=sys.stderr, flush=True)
        return cli.main([*_train_args(corpus), *args, *dist])

    def record(key, value):  # after every run: a scenario may end with this process aborted
        out[key] = value
        (work / f"{scenario}-p{pid}.json").write_text(json.dumps(out))

    if scenario == "main":
        # Different flags in process 1: refused by both before anything is compiled. The first run
        # joins the coordinator, so its --distributed-timeout is the heartbeat timeout of them all.
        record("mismatch_rc", run("--lr", "0.003" if pid == 0 else "0.002", "--distributed-timeout", str(HEARTBEAT_S)))
        for policy in POLICIES:
            record(
                policy,
                run(
                    "--policy",
                    policy,
                    "--checkpoint-dir",
                    str(work / policy),
                    "--checkpoint-every",
                    "100",
                    "--metrics",
                    str(work / f"{policy}-p{pid}.jsonl"),
                ),
            )
        record(
            "from1", run("--checkpoint-dir", str(work / "from1"), "--resume", "--metrics", str(work / "from1.jsonl"))
        )
        # plan's figures: compile-only and per device, in each of the 2 processes.
        a = analysis.analyze(TransformerConfig.preset("tiny"), "full", 4, 32, mesh=mesh_lib.make_mesh(MESH))
        record("plan", {k: v for k, v in a.to_dict().items() if k.endswith("_bytes")})
        if pid == 1:
            # Patched where `remat-kit train` looks it up when it runs (the CLI imports it from the loop
            # module): the package's lazy `remat_kit.train.train` is another name the CLI never reads.
            original = train_loop.train

            def dies_at_step(*args, **kwargs):
                def die(step, _record):
                    if step == KILL_AT:
                        print(f"killing process 1 at step {step}", file=sys.stderr, flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)

                return original(*args, **kwargs, callbacks=[die])

            train_loop.train = dies_at_step
        record(
            "kill",
            run(
                "--checkpoint-dir", str(work / "kill"), "--checkpoint-every", "1", "--metrics", str(work / "kill.jsonl")
            ),
        )
    elif scenario == "resume":
        record(
            "rc",
            run(
                "--checkpoint-dir",
                str(work / "kill"),
                "--checkpoint-every",
                "1",
                "--resume",
                "--metrics",
                str(work / "kill.jsonl"),
            ),
        )
    elif scenario == "unreachable":
        t0 = time.monotonic()
        rc = run("--distributed-timeout", "3")
        record("rc", rc)
        record("seconds", time.monotonic() - t0)


# ---- launching --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario: str, work: Path, pids=(0, 1), port: int | None = None) -> dict:
    """Run the scenario's processes to the end (hard limit); returns exit codes, times and logs."""
    port = port or _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "REMAT_KIT_", "XLA_FLAGS"))}
    env |= {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    # The references are computed in this process: the children compile at its code-generation level (conftest's).
    levels = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optimization_level")]
    env |= {"XLA_FLAGS": " ".join(levels)}
    # The runs of `full` compile the same programs: compile them once (JAX's persistent cache).
    env |= {"JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    procs, files = {}, []
    t0 = time.monotonic()
    ended: dict[int, float] = {}
    try:
        for pid in pids:
            out = open(work / f"{scenario}-p{pid}.out", "w")  # noqa: SIM115 - closed in finally
            err = open(work / f"{scenario}-p{pid}.err", "w")  # noqa: SIM115
            files += [out, err]
            procs[pid] = subprocess.Popen(
                [sys.executable, __file__, scenario, str(port), str(pid), str(work)],
                env=env,
                cwd=work,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        while len(ended) < len(procs) and time.monotonic() - t0 < LAUNCH_LIMIT_S:
            for pid, p in procs.items():
                if pid not in ended and p.poll() is not None:
                    ended[pid] = time.monotonic() - t0
            time.sleep(0.1)
    finally:
        for p in procs.values():  # always: the whole process group, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for f in files:
            f.close()
    assert len(ended) == len(procs), f"{scenario}: processes still running after {LAUNCH_LIMIT_S} s were killed"
    result = {"rc": {pid: p.returncode for pid, p in procs.items()}, "ended": ended}
    for pid in pids:
        result[pid] = {
            "out": (work / f"{scenario}-p{pid}.out").read_text(),
            "err": (work / f"{scenario}-p{pid}.err").read_text(),
        }
        path = work / f"{scenario}-p{pid}.json"
        result[pid]["result"] = json.loads(path.read_text()) if path.exists() else None
    return result


# ---- the runs ---------------------------------------------------------------------------------------


def _final(directory: Path):
    """(step, parameters) of the newest checkpoint, restored in this process onto one device."""
    from remat_kit import train
    from remat_kit.train.checkpoint import Checkpoints

    with Checkpoints(directory) as ckpts:
        step, state, _ = ckpts.restore_latest(train.Trainer(_config("full")).abstract_state())
    return step, state["params"]


def _config(policy: str):
    from remat_kit import train
    from remat_kit.model.transformer import TransformerConfig

    return train.TrainConfig(
        model=TransformerConfig.preset("tiny"),
        policy=policy,
        steps=STEPS,
        batch_size=4,
        seq_len=32,
        eval_every=3,
        eval_batches=1,
        val_fraction=0.1,
    )


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _rel(a, b) -> float:
    from conftest import max_rel_err

    return max_rel_err(a, b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from remat_kit import train
    from remat_kit.train import data

    work = tmp_path_factory.mktemp("multiprocess")
    # Real text (JAX's own source), small: reading it is instant.
    src = (Path(np.__file__).parent / "__init__.py").read_bytes() * 3
    (work / "corpus.txt").write_bytes(src)
    corpus = data.load_corpus([work / "corpus.txt"])
    refs = {}
    for policy in POLICIES:  # one process, 4 devices: what the 2 processes must reproduce
        refs[policy] = train.train(_config(policy), corpus, mesh=MESH)
    # One process, one device, checkpointing every step; its step 3 seeds the 1 -> 2 process resume.
    refs["one_device"] = train.train(
        _config("full"), corpus, mesh=None, checkpoint_dir=work / "one", checkpoint_every=1, keep=STEPS
    )
    shutil.copytree(work / "one", work / "from1")
    for step in range(4, STEPS + 1):
        shutil.rmtree(work / "from1" / str(step))
    launches = {"main": _launch("main", work)}
    shutil.copytree(work / "kill", work / "killed")  # as the kill left it, for the 2 -> 1 process resume
    launches["resume"] = _launch("resume", work)
    return {"work": work, "corpus": corpus, "refs": refs, **launches}


def test_processes_with_different_flags_are_refused(runs):
    for pid in (0, 1):
        assert runs["main"][pid]["result"]["mismatch_rc"] == 2
        assert (
            "process 1 differs from process 0 in run.config.learning_rate (0.003 vs 0.002)" in runs["main"][pid]["err"]
        )


@pytest.mark.parametrize("policy", POLICIES)
def test_two_processes_train_like_one(runs, policy):
    main, work, ref = runs["main"], runs["work"], runs["refs"][policy]
    assert main[0]["result"][policy] == 0 and main[1]["result"][policy] == 0
    losses = _losses(work / f"{policy}-p0.jsonl")
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, [r["loss"] for r in ref.history], rtol=RTOL_F32)
    step, params = _final(work / policy)  # saved by 2 processes, restored in this one
    assert step == STEPS and _rel(params, ref.state.params) <= RTOL_F32
    if policy == "full":  # 1 device: the same losses (parameters: see the module docstring)
        one = runs["refs"]["one_device"]
        np.testing.assert_allclose(losses, [r["loss"] for r in one.history], rtol=RTOL_F32)


def test_process_0_alone_writes_metrics_and_other_logs_say_their_process(runs):
    main, work = runs["main"], runs["work"]
    assert not (work / "full-p1.jsonl").exists()
    records = [json.loads(line) for line in (work / "full-p0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert "[p1] step 6/6" in main[1]["err"] and "[p1]" not in main[0]["err"]
    assert any(line.startswith("[p1] trained tiny under full to step 6") for line in main[1]["out"].splitlines())
    assert any(line.startswith("trained tiny under full to step 6") for line in main[0]["out"].splitlines())


def test_plan_is_the_same_in_two_processes(runs):
    from remat_kit.model.transformer import TransformerConfig
    from remat_kit.planning import analysis
    from remat_kit.step import mesh

    here = analysis.analyze(TransformerConfig.preset("tiny"), "full", 4, 32, mesh=mesh.make_mesh(MESH)).to_dict()
    for pid in (0, 1):
        there = runs["main"][pid]["result"]["plan"]
        assert there == {k: here[k] for k in there} and there["temp_bytes"] > 0


def test_one_process_checkpoint_resumes_in_two(runs):
    work = runs["work"]
    err = runs["main"][0]["err"]
    assert runs["main"][0]["result"]["from1"] == 0 and "resumed from step 3" in err, err[-3000:]
    one = runs["refs"]["one_device"]  # steps 1-3 were on 1 device, so it is the reference
    # The metrics file of the resumed run starts after the checkpoint: steps 4..6.
    np.testing.assert_allclose(_losses(work / "from1.jsonl"), [r["loss"] for r in one.history[3:]], rtol=RTOL_F32)
    step, params = _final(work / "from1")
    assert step == STEPS and _rel(params, one.state.params) <= RTOL_F32


def test_killing_one_process_stops_the_other_within_the_heartbeat_timeout(runs):
    kill = runs["main"]
    assert "kill" not in kill[0]["result"] and "kill" not in kill[1]["result"]  # neither run returned
    assert kill["rc"][1] == -signal.SIGKILL and f"killing process 1 at step {KILL_AT}" in kill[1]["err"]
    assert kill["rc"][0] == -signal.SIGABRT, kill[0]["err"][-2000:]  # JAX's fatal error, not a hang
    assert "Terminating process because the JAX distributed service detected fatal errors" in kill[0]["err"]
    assert "stopped sending heartbeats" in kill[0]["err"]
    waited = kill["ended"][0] - kill["ended"][1]
    assert 0 < waited <= HEARTBEAT_S + 20, waited  # the timeout plus generous start-up/polling slack


def test_restarting_both_resumes_bit_for_bit(runs):
    resume, work = runs["resume"], runs["work"]
    assert resume["rc"] == {0: 0, 1: 0}, resume[0]["err"][-2000:]
    assert "resumed from step" in resume[0]["err"] and "[p1] resumed from step" in resume[1]["err"]
    # The uninterrupted 2-process run is main's `full`: same losses and parameters, exactly.
    assert _losses(work / "kill.jsonl") == _losses(work / "full-p0.jsonl")
    (step, params), (_, uninterrupted) = _final(work / "kill"), _final(work / "full")
    assert step == STEPS
    for a, b in zip(jax_leaves(params), jax_leaves(uninterrupted), strict=True):
        np.testing.assert_array_equal(a, b)


def test_two_process_checkpoint_resumes_in_one(runs):
    import warnings

    from remat_kit import train

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # restored arrays that failed their SHA-256 would warn and be skipped
        result = train.train(_config("full"), runs["corpus"], checkpoint_dir=runs["work"] / "killed", resume=True)
    assert result.resumed_from in (KILL_AT - 2, KILL_AT - 1)  # the newest save that was complete
    _, uninterrupted = _final(runs["work"] / "full")  # steps up to the kill were in 2 processes
    assert _rel(result.state.params, uninterrupted) <= RTOL_F32


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ---- bad inputs without a coordinator ----------------------------------------------------------------


def test_unreachable_coordinator_fails_within_the_timeout(tmp_path):
    (tmp_path / "corpus.txt").write_bytes(b"no coordinator listens here. " * 200)
    r = _launch("unreachable", tmp_path, pids=(1,))
    assert r["rc"] == {1: 0}, r[1]["err"][-2000:]
    child = r[1]["result"]
    assert child["rc"] == 2 and child["seconds"] < 3 + 10
    assert "remat-kit train: error: process 1 of 2 could not join the coordinator at 127.0.0.1:" in r[1]["err"]
    assert "within 3 s" in r[1]["err"]


def test_process_count_must_divide_the_mesh(capsys):
    from remat_kit import cli

    argv = ["train", "--mesh", "data=3", "--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "0"]
    assert cli.main(argv) == 2
    assert "mesh data=3,fsdp=1 has 3 devices, which 2 processes cannot share evenly" in capsys.readouterr().err


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
