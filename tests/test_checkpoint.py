"""Orbax checkpoints: keep-last-N, exact round trip, and fallback from a corrupt latest step."""

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from remat_kit import train
from remat_kit.train import data
from remat_kit.train.checkpoint import CORRUPT_PREFIX, Checkpoints, CheckpointWarning, prepare_directory, tree_digest

# After a failed tensorstore read (the corrupt-checkpoint tests do that on purpose), orbax's asyncio
# helpers report an ignored "Event loop is closed" when collected, in whichever test runs then.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _state(seed=0):
    params = {"w": jax.random.normal(jax.random.key(seed), (3, 4)), "b": jnp.arange(4.0)}
    return {"params": params, "opt": optax.adam(1e-3).init(params), "step": jnp.asarray(seed, jnp.int32)}


def _abstract(state):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_round_trip_keeps_structure_and_last_n(tmp_path):
    ckpts = Checkpoints(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpts.save(step, _state(step), {"note": "x"})
    ckpts.wait()
    assert ckpts.steps() == [2, 3]
    step, state, meta = ckpts.restore_latest(_abstract(_state()))
    ckpts.close()
    assert step == 3 and meta["note"] == "x" and meta["step"] == 3
    # optax states are namedtuples: the restored tree has exactly the saved structure.
    assert jax.tree.structure(state) == jax.tree.structure(_state())
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state(3)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_empty_directory_restores_nothing(tmp_path):
    with Checkpoints(tmp_path / "new") as ckpts:
        assert ckpts.restore_latest(_abstract(_state())) is None


def test_digest_sees_one_changed_value():
    s = _state()
    t = jax.tree.map(lambda a: a, s)
    t["params"]["b"] = t["params"]["b"].at[2].add(1e-6)
    assert tree_digest(s) == tree_digest(_state()) != tree_digest(t)


def _delete_manifest(step_dir: Path):
    (step_dir / "state" / "manifest.ocdbt").unlink()


def _scramble_data(step_dir: Path):
    # Same length, different bytes: a silent corruption only the recorded SHA-256 can catch.
    for f in sorted((step_dir / "state").rglob("d/*")):
        f.write_bytes(bytes(255 - b for b in f.read_bytes()))


def _truncate_meta(step_dir: Path):
    meta = step_dir / "meta" / "metadata"
    meta.write_bytes(meta.read_bytes()[:5])


def _wrong_hash(step_dir: Path):
    # Readable arrays that are not the ones saved (as after a silent bit flip): only the hash tells.
    meta = step_dir / "meta" / "metadata"
    record = json.loads(meta.read_text())
    record["state_sha256"] = "0" * 64
    meta.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "corrupt", [_delete_manifest, _scramble_data, _truncate_meta, _wrong_hash], ids=lambda f: f.__name__
)
def test_corrupt_latest_falls_back_and_keeps_its_files(tmp_path, corrupt):
    ckpts = Checkpoints(tmp_path, keep=3)
    for step in (1, 2):
        ckpts.save(step, _state(step), {})
    ckpts.close()
    corrupt(tmp_path / "2")
    damaged = _files(tmp_path / "2")

    ckpts = Checkpoints(tmp_path, keep=3)
    with pytest.warns(CheckpointWarning, match=r"checkpoint step 2 .* is unreadable .* resuming from step 1") as got:
        step, state, _ = ckpts.restore_latest(_abstract(_state()))
    assert step == 1
    said = str(got[0].message)
    assert "bound method" not in said and "pybind11" not in said and "TensorStore details" not in said, said
    np.testing.assert_array_equal(state["params"]["w"], _state(1)["params"]["w"])
    # The damaged step is moved aside, byte for byte, and no longer listed; step 1 is untouched.
    moved = [p for p in tmp_path.iterdir() if p.name.startswith(f"{CORRUPT_PREFIX}2-")]
    assert len(moved) == 1 and _files(moved[0]) == damaged
    assert ckpts.steps() == [1]
    ckpts.save(2, _state(2), {})  # the step number is free again
    ckpts.close()
    with Checkpoints(tmp_path) as ckpts:
        assert ckpts.steps() == [1, 2]


#: The message orbax raises for a step whose data file holds random bytes, as it comes: pybind11's repr of
#: TensorStore.spec opens a multi-line spec, so its first line never closes the ``<bound method``.
UNREADABLE_ARRAY = (
    "Encountered error while reading array index: (slice(0, 64, 1), slice(0, 64, 1)). See full TensorStore "
    "details: <bound method pybind11_detail_function_record_v1_system_libstdcpp_gxx_abi_1xxx_use_cxx11_abi_1.spec "
    "of TensorStore({\n  'base': {\n    'driver': 'zarr',\n    'dtype': 'float32',\n  },\n})>."
)


def test_a_corruption_warning_keeps_the_error_and_drops_the_tensorstore_details():
    from remat_kit.train.checkpoint import _describe

    assert _describe(Exception(UNREADABLE_ARRAY)) == (
        "Exception: Encountered error while reading array index: (slice(0, 64, 1), slice(0, 64, 1))."
    )


def test_partial_save_of_a_killed_run_is_ignored(tmp_path):
    with Checkpoints(tmp_path) as ckpts:
        ckpts.save(1, _state(1), {})
    partial = tmp_path / "2.orbax-checkpoint-tmp-1700000000"  # what a kill during a save leaves
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "manifest.ocdbt").write_bytes(b"half")
    with Checkpoints(tmp_path) as ckpts:
        assert ckpts.steps() == [1]
        assert ckpts.restore_latest(_abstract(_state()))[0] == 1
        ckpts.save(2, _state(2), {})
    with Checkpoints(tmp_path) as ckpts:
        assert ckpts.restore_latest(_abstract(_state()))[0] == 2


def test_all_steps_corrupt_is_a_clear_error_and_changes_nothing(tmp_path):
    ckpts = Checkpoints(tmp_path)
    ckpts.save(1, _state(1), {})
    ckpts.close()
    _delete_manifest(tmp_path / "1")
    before = _files(tmp_path)
    with Checkpoints(tmp_path) as ckpts, pytest.raises(ValueError, match=r"no readable .*nothing was changed.*step 1"):
        ckpts.restore_latest(_abstract(_state()))
    assert _files(tmp_path) == before


def test_check_meta_error_stops_without_fallback(tmp_path):
    ckpts = Checkpoints(tmp_path)
    for step in (1, 2):
        ckpts.save(step, _state(step), {"model": step})
    ckpts.close()
    before = _files(tmp_path)

    def reject(meta):
        raise ValueError(f"different model {meta['model']}")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with Checkpoints(tmp_path) as ckpts, pytest.raises(ValueError, match="different model 2"):
            ckpts.restore_latest(_abstract(_state()), reject)
    assert _files(tmp_path) == before


def test_prepare_directory_errors(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(OSError, match="is not writable"):
        prepare_directory(tmp_path / "f" / "sub")
    with pytest.raises(ValueError, match="keep must be a positive integer"):
        Checkpoints(tmp_path / "ok", keep=0)


def test_training_resumes_exactly_past_a_corrupt_latest(tmp_path):
    corpus = data.corpus_from_bytes(Path(data.__file__).read_bytes() * 4, "data.py")
    cfg = train.TrainConfig(steps=4, batch_size=2, seq_len=32, eval_every=4, eval_batches=1)
    full = train.train(cfg, corpus, checkpoint_dir=tmp_path, checkpoint_every=2)
    _scramble_data(tmp_path / "4")
    with pytest.warns(CheckpointWarning, match="resuming from step 2"):
        again = train.train(cfg, corpus, checkpoint_dir=tmp_path, resume=True)
    assert again.resumed_from == 2
    assert [r["loss"] for r in again.history] == [r["loss"] for r in full.history[2:]]
    for a, b in zip(jax.tree.leaves(again.state.params), jax.tree.leaves(full.state.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_failed_read_echoes_are_dropped_while_restoring(caplog, capsys):
    # A failed orbax read leaves per-array futures failing unobserved (asyncio logs a traceback for
    # each) and late callbacks into the closed loop; the user sees the one CheckpointWarning instead.
    import logging
    import sys
    import types

    from remat_kit.train import checkpoint

    hooks = sys.excepthook, sys.unraisablehook
    unraisable = types.SimpleNamespace(
        exc_value=RuntimeError("Event loop is closed"),
        exc_type=RuntimeError,
        exc_traceback=None,
        err_msg=None,
        object=None,
    )
    with caplog.at_level(logging.ERROR, logger="asyncio"), checkpoint._quiet_failed_reads():
        logging.getLogger("asyncio").error("Future exception was never retrieved")
        sys.unraisablehook(unraisable)
        logging.getLogger("asyncio").error("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
    assert "Event loop is closed" not in capsys.readouterr().err
    assert (sys.excepthook, sys.unraisablehook) == hooks


def test_a_failed_save_is_one_line_at_that_save_and_keeps_the_last_good_step(tmp_path, capfd, monkeypatch):
    import errno

    from orbax.checkpoint._src.handlers import json_checkpoint_handler  # the writer of each step's meta

    ckpts = Checkpoints(tmp_path)
    ckpts.save(1, _state(1), {})

    async def disk_full(self, x, directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", disk_full)
    with pytest.raises(
        OSError,
        match=r"could not save step 2 in .*: No space left on device; the last good "
        r"checkpoint, step 1, is kept",
    ):
        ckpts.save(2, _state(2), {})
    ckpts.close()
    assert "Traceback" not in capfd.readouterr().err  # orbax's absl tracebacks are not shown
    with Checkpoints(tmp_path) as again:
        assert again.steps() == [1]


def test_a_failed_array_write_after_a_good_save_is_one_line_and_echoes_nothing(tmp_path, caplog, monkeypatch):
    # A real write failure inside tensorstore, as on a disk that fills mid-run: once the file-size limit
    # is lowered (after a first save went through), every write past 4 KiB of a file fails (EFBIG). The
    # step's metadata is smaller, the arrays' data file larger. With many arrays in flight, orbax's
    # threads echo the failure ("Event loop is closed" through sys.unraisablehook, asyncio's unretrieved
    # futures) during the save and after it, as its futures are collected; the echoes' timing varies, so
    # two saves fail (each echoes in most tries).
    import gc
    import logging
    import resource
    import signal
    import sys
    import threading

    echoed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: echoed.append(str(u.exc_value)))
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: echoed.append(str(value)))
    monkeypatch.setattr(threading, "excepthook", lambda args: echoed.append(str(args.exc_value)))
    arrays = lambda seed: {f"w{i}": jax.random.normal(jax.random.key(seed + i), (32, 32)) for i in range(30)}
    ckpts = Checkpoints(tmp_path)
    ckpts.save(1, arrays(1), {})
    limit, on_signal = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        for step in (2, 3):
            with (
                caplog.at_level(logging.WARNING, logger="asyncio"),
                pytest.raises(
                    OSError,
                    match=rf"^could not save step {step} in .*: File too large; the last good "
                    r"checkpoint, step 1, is kept$",
                ),
            ):
                ckpts.save(step, arrays(step), {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, on_signal)
    ckpts.close()
    gc.collect()
    assert echoed == [] and [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    with Checkpoints(tmp_path) as again:
        assert again.steps() == [1]


def test_orbax_warnings_do_not_leak_on_resume(tmp_path, caplog):
    with Checkpoints(tmp_path) as ckpts:
        ckpts.save(1, _state(1), {})
    (tmp_path / "1" / "_CHECKPOINT_METADATA").unlink()  # orbax warns "Metadata file does not exist"
    with Checkpoints(tmp_path) as ckpts:
        assert ckpts.restore_latest(_abstract(_state()))[0] == 1
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == []


def test_lock_refuses_a_second_holder_and_is_freed_when_its_holder_is_killed(tmp_path):
    import signal
    import subprocess
    import sys

    from remat_kit.train.lock import DirectoryInUseError, DirectoryLock

    hold = "import sys, time; from remat_kit.train.lock import DirectoryLock; DirectoryLock(sys.argv[1]).acquire(); "
    hold += "print('held', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        with pytest.raises(DirectoryInUseError, match=rf"in use by another run \(pid {proc.pid} on .*, started "):
            DirectoryLock(tmp_path).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with DirectoryLock(tmp_path):  # the kernel released the dead holder's lock: nothing stuck
        pass


def test_a_discarded_lock_file_is_gone_and_a_run_that_opened_it_takes_the_new_one(tmp_path, monkeypatch):
    import fcntl
    import os

    from remat_kit.train import lock as lock_lib

    first = lock_lib.DirectoryLock(tmp_path).acquire()
    first.discard()  # a refused run: nothing of it stays
    assert list(tmp_path.iterdir()) == []
    # A second run opens the file, then its holder discards it before the second run's flock: the second
    # run's lock would be on a removed file, which locks nothing, so it takes the file there now.
    calls, flock = [], fcntl.flock

    def flock_after_a_discard(fd, how):
        calls.append(fd)
        if len(calls) == 1:
            (tmp_path / lock_lib.LOCK_NAME).unlink()
        return flock(fd, how)

    monkeypatch.setattr(lock_lib.fcntl, "flock", flock_after_a_discard)
    with lock_lib.DirectoryLock(tmp_path) as second:
        assert len(calls) == 2 and lock_lib._same_file(second._fd, second.path)
        assert os.path.exists(second.path)
