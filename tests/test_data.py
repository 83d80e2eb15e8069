"""Offline byte-level data: the stdlib corpus, deterministic shuffling, splits and clear errors."""

import numpy as np
import pytest

from remat_kit.train import data


@pytest.fixture(scope="module")
def stdlib():
    return data.load_corpus(max_bytes=64 * 1024)


def test_default_corpus_is_real_python_source(stdlib):
    text = data.decode(stdlib.tokens)
    assert stdlib.tokens.size == 64 * 1024 + stdlib.num_files - 1  # files joined by newlines
    assert "def " in text and "import " in text and "standard library" in stdlib.source
    assert all("site-packages" not in str(p) for p in data.stdlib_files())
    assert data.load_corpus(max_bytes=64 * 1024).fingerprint == stdlib.fingerprint  # same files, same order


def test_encode_decode_round_trip():
    ids = data.encode("π ≈ 3.14\n")
    assert ids.dtype == np.uint8 and ids.max() < data.BYTE_VOCAB
    assert data.decode(ids) == "π ≈ 3.14\n"


def test_user_paths_files_and_folders(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2binary")
    c = data.load_corpus([tmp_path])
    assert data.decode(c.tokens) == "first\nsecond" and c.num_files == 2  # sorted; binary skipped
    assert data.decode(data.load_corpus([tmp_path / "b.txt"], max_bytes=3).tokens) == "sec"


def test_split_is_disjoint_tail(stdlib):
    train, val = stdlib.split(0.1)
    assert train.size + val.size == stdlib.tokens.size
    assert val.size == pytest.approx(0.1 * stdlib.tokens.size, abs=1)
    np.testing.assert_array_equal(np.concatenate([train, val]), stdlib.tokens)


def test_batches_are_a_pure_function_of_seed_and_position(stdlib):
    train, _ = stdlib.split(0.1)
    a = data.Batches(train, batch_size=4, seq_len=32, seed=1)
    b = data.Batches(train, batch_size=4, seq_len=32, seed=1)
    c = data.Batches(train, batch_size=4, seq_len=32, seed=2)
    for pos in (0, 7, 3):  # any order: a resumed run asks for position k directly
        np.testing.assert_array_equal(a.batch(pos), b.batch(pos))
    assert a.batch(0).shape == (4, 32) and a.batch(0).dtype == np.int32
    assert not np.array_equal(a.batch(0), c.batch(0))


def test_an_epoch_visits_every_window_once_then_reshuffles():
    tokens = np.arange(100, dtype=np.uint8)
    b = data.Batches(tokens, batch_size=2, seq_len=10, seed=0)
    assert b.windows_per_epoch == 10
    epoch0 = np.concatenate([b.batch(i) for i in range(5)])
    epoch1 = np.concatenate([b.batch(i) for i in range(5, 10)])
    assert sorted(epoch0[:, 0].tolist()) == list(range(0, 100, 10))
    assert sorted(epoch1[:, 0].tolist()) == list(range(0, 100, 10))
    assert epoch0[:, 0].tolist() != epoch1[:, 0].tolist()
    assert all(np.array_equal(row, np.arange(row[0], row[0] + 10)) for row in epoch0)  # contiguous windows


def test_eval_windows_are_fixed_and_full(stdlib):
    _, val = stdlib.split(0.05)
    w = data.eval_windows(val, batch_size=2, seq_len=16, num_batches=3)
    assert w.shape == (3, 2, 16)
    np.testing.assert_array_equal(w[0, 0], val[:16])
    tiny = data.eval_windows(np.arange(20, dtype=np.uint8), batch_size=2, seq_len=16, num_batches=2)
    assert (tiny == np.arange(16)).all()  # short held-out text repeats its one window


def test_missing_path():
    with pytest.raises(FileNotFoundError, match=r"data path '/no/such/corpus' does not exist"):
        data.load_corpus(["/no/such/corpus"])


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "nul.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"is empty: no text in 2 file\(s\)"):
        data.load_corpus([tmp_path])
    with pytest.raises(ValueError, match="is empty"):
        data.corpus_from_bytes(b"")


def test_sequence_longer_than_text():
    with pytest.raises(ValueError, match=r"sequence length 64 is longer than the text it is cut from \(10 tokens\)"):
        data.Batches(np.zeros(10, np.uint8), batch_size=1, seq_len=64)
    with pytest.raises(ValueError, match="validation split has 10 tokens, fewer than one sequence of 64"):
        data.eval_windows(np.zeros(10, np.uint8), batch_size=1, seq_len=64, num_batches=1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: data.load_corpus(max_bytes=0), "max_bytes must be a positive integer"),
        (lambda: data.corpus_from_bytes(b"abc").split(1.0), r"val_fraction must be in \(0, 1\)"),
        (lambda: data.Batches(np.zeros(10, np.uint8), batch_size=0, seq_len=2), "batch_size must be a positive"),
        (lambda: data.Batches(np.zeros(10, np.uint8), 1, 2).batch(-1), "non-negative integer"),
    ],
    ids=["max_bytes", "val_fraction", "batch_size", "position"],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()
