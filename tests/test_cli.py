"""The command line itself: help without jax, --version, one flag vocabulary, `policies`, and the
errors a user meets in the first minutes (each checked before anything is compiled)."""

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remat_kit import cli, constants

COMMANDS = ("policies", "train", "plan", "bench", "tags")

# Builds the parser and prints every command's help, then lists the heavy modules that got imported.
_HELP_PROBE = f"""
import contextlib, io, json, sys
from remat_kit import cli
texts = {{}}
for argv in ([], *[[c] for c in {COMMANDS!r}]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main([*argv, "--help"])
    texts[" ".join(argv) or "remat-kit"] = out.getvalue()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax", "numpy"))
print(json.dumps({{"heavy": heavy, "texts": texts}}))
"""


@pytest.fixture(scope="module")
def help_probe():
    proc = subprocess.run([sys.executable, "-c", _HELP_PROBE], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_help_of_every_command_imports_no_jax(help_probe):
    assert help_probe["heavy"] == []
    assert set(help_probe["texts"]) == {"remat-kit", *COMMANDS}
    assert all(text.startswith("usage: remat-kit") for text in help_probe["texts"].values())


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("train", ["--policy POLICY", "(default: none)", "(default: 8)", "(default: 0.003)", "(default: 50)"]),
        ("plan", ["(default: 2b)", "Compare rematerialization policies without running anything"]),
        ("bench", ["(default: small)", "(default: 5)", "min/median/max"]),
        ("policies", ["--json"]),
    ],
    ids=["train", "plan", "bench", "policies"],
)
def test_help_shows_defaults_and_descriptions(help_probe, command, shown):
    text = " ".join(help_probe["texts"][command].split())  # argparse wraps lines
    for piece in shown:
        assert piece in text, piece
    assert ("--batch-size" in text) == (command != "policies")  # every shaped command takes it; policies none
    assert "--batch " not in text and "--seq " not in text  # the old spellings are hidden aliases


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"remat-kit {cli.version()}"
    assert cli.version().count(".") >= 2


@pytest.mark.parametrize(
    "where",
    ["version", "build_parser", "parse_args"],
    ids=["reading-the-version", "building-the-parser", "reading-the-arguments"],
)
def test_ctrl_c_before_the_command_runs_is_one_line_and_exit_130(where, monkeypatch, capsys):
    import argparse

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    owner = argparse.ArgumentParser if where == "parse_args" else cli
    monkeypatch.setattr(owner, where, interrupted)
    try:
        code = cli.main(["plan", "--preset", "tiny"])
    except KeyboardInterrupt:  # escaping, it would end the whole test session
        pytest.fail("Ctrl-C escaped main: a traceback and exit -2")
    assert code == 130
    assert capsys.readouterr().err == "remat-kit: interrupted\n"


def test_constants_match_the_library():
    # --help reads these from the jax-free constants module; here they meet the modules that own them.
    from remat_kit.model import attention, lora
    from remat_kit.model import transformer as model
    from remat_kit.planning import budget, planner
    from remat_kit.train import distributed
    from remat_kit.train.loop import TrainConfig

    assert tuple(model.PRESETS) == constants.PRESET_NAMES
    # One definition each: the library's names are the constants themselves, not copies kept equal.
    assert constants.PRESET_SHAPES is model.PRESET_SHAPES
    assert constants.DTYPES is model.DTYPES
    assert constants.ATTENTION_KINDS is attention.ATTENTION_KINDS
    assert (lora.TARGETS, lora.QUANTIZE_MODES) == (constants.LORA_TARGETS, constants.QUANTIZE_MODES)
    assert lora.TARGETS is constants.LORA_TARGETS and lora.QUANTIZE_MODES is constants.QUANTIZE_MODES
    assert constants.GENERIC_CANDIDATES is budget.GENERIC_CANDIDATES
    assert constants.DEFAULT_MARGIN is planner.DEFAULT_MARGIN
    assert distributed.JAX_JOIN_TIMEOUT_S is constants.JAX_JOIN_TIMEOUT_S
    assert set(constants.TRAIN_DEFAULTS) <= {f.name for f in dataclasses.fields(TrainConfig)}  # no stray default


def test_every_checked_train_flag_names_a_setting_the_library_checks():
    from remat_kit.cli.train import CHECKED_FLAGS
    from remat_kit.train import config

    args = vars(cli.build_parser().parse_args(["train"]))
    assert all(flag[2:].replace("-", "_") in args for flag in CHECKED_FLAGS)
    settings = set(config.INT_MINIMUMS) | set(config.NUMBER_RANGES)
    assert settings - set(CHECKED_FLAGS.values()) == {"min_lr_ratio"}  # the one setting no flag sets


@pytest.mark.parametrize("command", ["plan", "bench", "train"])
def test_one_shape_vocabulary_with_hidden_aliases(command):
    parser = cli.build_parser()
    new = parser.parse_args([command, "--batch-size", "3", "--seq-len", "64"])
    old = parser.parse_args([command, "--batch", "3", "--seq", "64"])
    assert (new.batch_size, new.seq_len) == (old.batch_size, old.seq_len) == (3, 64)
    assert parser.parse_args([command]).no_progress is False and "json" in vars(new)


def test_policies_card_is_generated_from_the_policies_module(capsys):
    from remat_kit import policies

    assert cli.main(["policies", "--json"]) == 0
    card = json.loads(capsys.readouterr().out)
    assert list(card["policies"]) == list(policies.KINDS)
    assert card["policies"]["full"] == policies.full.__doc__.strip().splitlines()[0]
    assert card["maxtext_presets"]["minimal"] == str(policies.parse("minimal"))
    assert "qkv_proj" in card["aliases"]
    assert card["grammar"] == policies.SPEC_GRAMMAR  # the grammar the parser's errors print


@pytest.mark.parametrize(
    ("spec", "lines"),
    [
        ("every_n:2", ["every_n:2 (every_n)", "layers 0, 2, 4, …"]),
        ("minimal", ["minimal = selective:q_proj,k_proj,v_proj,attn_out,mlp_gate,mlp_up,mlp_out (selective)"]),
        ("offload", ["offloads:   layer_input to pinned_host"]),
        ("full*2+every_n:2*4", ["(mix)", "layers 0–1 (full): each layer's input", "layers 2–5 (every_n:2): every"]),
    ],
    ids=["every_n", "alias", "offload", "mix"],
)
def test_policies_spec_explains_the_spec(spec, lines, capsys):
    assert cli.main(["policies", spec]) == 0
    out = capsys.readouterr().out
    for line in lines:
        assert line in out
    assert "MaxText presets" not in out  # the spec is explained, not the whole card reprinted


def test_policies_spec_json(capsys):
    assert cli.main(["policies", "segments:4", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["policy"], info["kind"], info["offloads"]) == ("segments:4", "segments", [])
    assert "4 layers at a time" in info["recomputes"]


def test_bad_spec_is_one_line_and_exit_2(capsys):
    assert cli.main(["policies", "fulll"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown policy spec 'fulll'" in err and "Traceback" not in err


def test_console_entry_point_runs_as_module():
    proc = subprocess.run(
        [sys.executable, "-m", "remat_kit.cli", "policies"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "sqrt_n" in proc.stdout


@pytest.mark.parametrize("command", ["plan", "bench", "train"])
def test_loss_chunks_takes_auto_or_a_count(command, capsys):
    parser = cli.build_parser()
    assert parser.parse_args([command, "--loss-chunks", "auto"]).loss_chunks == "auto"
    assert parser.parse_args([command, "--loss-chunks", "3"]).loss_chunks == 3
    assert parser.parse_args([command]).loss_chunks == ("auto" if command == "train" else 0)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([command, "--loss-chunks", "fused"])
    assert exit_.value.code == 2 and "expected 'auto' or an integer, got 'fused'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [(["--preset", "small"], 0), (["--preset", "2b"], 16), (["--preset", "2b", "--mesh", "data=2"], 0)],
)
def test_plan_and_bench_resolve_auto_loss_chunks_to_the_count(argv, expected):
    from remat_kit.cli.common import config_from_args

    args = cli.build_parser().parse_args(["plan", *argv, "--loss-chunks", "auto"])
    config_from_args(args)  # plans nothing: the count is fixed before any tracing
    assert args.loss_chunks == expected


# ---- train: refusals before anything is compiled ----------------------------------------------------------


def _error(argv, capsys):
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_train_refuses_to_overwrite_metrics(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1}\n')
    err = _error(["train", "--metrics", str(metrics)], capsys)
    assert "m.jsonl already exists" in err and "--resume" in err and "--overwrite" in err
    assert metrics.read_text() == '{"step": 1}\n'
    (tmp_path / "m.png").write_bytes(b"png")
    metrics.unlink()
    assert "m.png already exists" in _error(["train", "--metrics", str(metrics)], capsys)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--resume", "--checkpoint-dir", "{tmp}/missing"], "checkpoint directory '{tmp}/missing' does not exist"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-dir", "{tmp}/a_file"], "is a file, not a directory"),
        (["--resume", "--overwrite", "--checkpoint-dir", "{tmp}"], "give one of them"),
    ],
    ids=["resume-missing-dir", "resume-without-dir", "dir-is-a-file", "resume-and-overwrite"],
)
def test_train_checkpoint_dir_errors(extra, message, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    err = _error(["train", *[e.format(tmp=tmp_path) for e in extra]], capsys)
    assert message.format(tmp=tmp_path) in err


def test_binary_data_says_it_is_not_text(tmp_path):
    from remat_kit.train import data

    (tmp_path / "weights.bin").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(ValueError, match=r"weights\.bin .* is not text \(binary"):
        data.load_corpus([tmp_path / "weights.bin"])


def test_checkpoint_dir_that_is_a_file(tmp_path):
    from remat_kit.train.checkpoint import prepare_directory

    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError, match="is a file, not a directory"):
        prepare_directory(tmp_path / "f")


def test_negative_budget_reaches_its_own_check(capsys):
    err = _error(["plan", "--preset", "tiny", "--budget", "-5GB"], capsys)
    assert "a memory budget must be positive, got '-5GB'" in err


@pytest.mark.parametrize(
    ("value", "low", "message"),
    [
        (0, 1, "n must be a positive integer, got 0"),
        (True, 1, "got True"),
        (2.0, 1, "got 2.0"),
        (-1, 0, "n must be an integer >= 0, got -1"),
    ],
    ids=["zero", "bool", "float", "below-low"],
)
def test_one_integer_check(value, low, message):
    from remat_kit.units import check_int

    with pytest.raises(ValueError, match=re.escape(message)):
        check_int("n", value, low)
    assert check_int("n", low, low) == low


@pytest.mark.parametrize(
    ("argv", "code", "named"),
    [
        (["train", "--plot", "plot.txt"], 2, "'plot.txt': cannot write a .txt picture"),
        (["train", "--metrics", "FILE/m.jsonl"], 2, "FILE' is a file, not a folder"),
        (["train", "--lr", "inf"], 2, "--lr must be a finite number > 0, got inf"),
        (["plan", "--preset", "tiny", "--budget", "1e400GB"], 2, "'1e400GB' is too large"),
        (["plan", "--preset", "tiny", "--budget", "1KB"], 1, "nothing fits --budget 1KB: the parameters and optimizer"),
        (["plan", "--preset", "tiny", "--budget", "1KB"], 1, "(--lora-rank R --quantize nf4 or int8)"),  # the levers
    ],
    ids=["plot_suffix", "metrics_under_a_file", "lr_inf", "budget_overflow", "budget_below_the_state", "levers"],
)
def test_bad_input_is_one_line_before_any_work(argv, code, named, tmp_path, monkeypatch, capsys):
    from remat_kit.planning import fit
    from remat_kit.train import loop

    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("")
    work = lambda *a, **k: pytest.fail("work was done before the input was refused")
    monkeypatch.setattr(loop, "train", work)
    monkeypatch.setattr(fit, "auto", work)
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and named in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing written


def test_readme_train_example_runs_on_a_fresh_clone(tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    command = re.search(r"^(remat-kit train --preset tiny .*?)\s+#", readme.replace("\\\n", " "), re.M).group(1)
    argv = command.split()[1:]
    argv[argv.index("--steps") + 1] = "1"  # the example as written, one step and a small corpus
    monkeypatch.chdir(tmp_path)  # no runs/ folder yet
    assert cli.main([*argv, "--max-corpus-bytes", "65536", "--eval-every", "0", "--batch-size", "2"]) == 0
    assert (tmp_path / "runs" / "metrics.jsonl").exists() and (tmp_path / "runs" / "ckpt" / "1").is_dir()


# ---- bad input: one line, exit 2, before any work -------------------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Make every entry to real work (compiling, benchmarking, training, planning) fail the test loudly."""
    import jax

    from remat_kit.bench import run as bench_run
    from remat_kit.planning import analysis, fit
    from remat_kit.train import loop

    def work(*_, **__):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(jax.stages.Lowered, "compile", work)
    for module, name in ((analysis, "analyze_policies"), (fit, "auto"), (bench_run, "run_bench"), (loop, "train")):
        monkeypatch.setattr(module, name, work)


BAD_INPUTS = [
    (["policies", "every_n:99999999999999999999"], "every_n:N must be 1 <= N <= 2147483647"),
    (["policies", "selective:"], "'selective:': no tag after ':'"),
    (["plan", "--preset", "tiny", "--policies", "selective:,full"], "'selective:': no tag after ':'"),
    (["plan", "--preset", "tiny", "--policies", "none,,full"], "--policies 'none,,full' has an empty item"),
    (["plan", "--preset", "tiny", "--policies", ""], "--policies '' names no policy"),
    (["plan", "--preset", "tiny", "--budget", "50MB", "--policies", ""], "--policies '' names no policy"),
    (["bench", "--preset", "tiny", "--policies", ""], "--policies '' names no policy"),
    (["bench", "--preset", "tiny", "--policies", "none,,full"], "--policies 'none,,full' has an empty item"),
    (["plan", "--preset", "tiny", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["plan", "--preset", "tiny", "--budget", "50MB", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["plan", "--preset", "tiny", "--budget", "50MB", "--plot", "{tmp}/noext"], "'noext': cannot write a picture"),
    (["bench", "--preset", "tiny", "--plot", "{tmp}/noext"], "--plot 'noext': cannot write a picture"),
    (["train", "--metrics", "{tmp}/m.jsonl", "--plot", "{tmp}/noext"], "--plot 'noext': cannot write a picture"),
    (["train", "--metrics", "-"], "--metrics '-': metrics are written to a file"),
    (["train", "--metrics", "{tmp}/adir"], "--metrics '{tmp}/adir' is a directory; give a file path"),
    (["train", "--policy", "every_n:99999999999999999999"], "every_n:N must be 1 <= N <= 2147483647"),
    # The library's rule, the flag's name (not keep, checkpoint_every, max_corpus_bytes, learning_rate) and value.
    (["train", "--keep", "0"], "--keep must be a positive integer, got 0"),
    (["train", "--checkpoint-every", "0"], "--checkpoint-every must be a positive integer, got 0"),
    (["train", "--max-corpus-bytes", "0"], "--max-corpus-bytes must be a positive integer, got 0"),
    (["train", "--lr", "-1"], "--lr must be a finite number > 0, got -1"),
    (["train", "--lr", "1e309"], "--lr must be a finite number > 0, got 1e309"),  # as typed, not inf
    (["train", "--val-fraction", "1"], "--val-fraction must be a finite number in (0, 1), got 1"),
    (["train", "--quantize", "nf4"], "--quantize nf4 needs --lora-rank R > 0"),
    (["bench", "--preset", "tiny", "--quantize", "nf4"], "--quantize nf4 needs --lora-rank R > 0"),
    # Issue 39: every LoRA flag names the missing --lora-rank (else the full model trained, no word).
    (["train", "--lora-targets", "q_proj"], "--lora-targets q_proj needs --lora-rank R > 0"),
    (["train", "--lora-alpha", "8"], "--lora-alpha 8.0 needs --lora-rank R > 0"),
    (["train", "--lora-rank", "0", "--lora-alpha", "8"], "--lora-alpha 8.0 needs --lora-rank R > 0"),
    (["plan", "--preset", "tiny", "--lora-alpha", "8"], "--lora-alpha 8.0 needs --lora-rank R > 0"),
    (["bench", "--preset", "tiny", "--lora-targets", "all"], "--lora-targets all needs --lora-rank R > 0"),
    # An empty path is refused, not taken for "not given" (or the working directory).
    (["train", "--checkpoint-dir", ""], "--checkpoint-dir '' is empty; give a path"),
    (["train", "--metrics", ""], "--metrics '' is empty; give a path"),
    (["train", "--plot", ""], "--plot '' is empty; give a path"),
    (["plan", "--preset", "tiny", "--json", ""], "--json '' is empty; give a file path"),
    (["plan", "--preset", "tiny", "--timeline", ""], "--timeline '' is empty; give a file path"),
    (["plan", "--preset", "tiny", "--budget", "50MB", "--plot", ""], "--plot '' is empty; give a file path"),
    (["bench", "--preset", "tiny", "--json", ""], "--json '' is empty; give a file path"),
    (["bench", "--preset", "tiny", "--markdown", ""], "--markdown '' is empty; give a file path"),
    (["policies", ""], "unknown policy spec ''"),
    (["plan", "--preset", "tiny", "--mesh", ""], "--mesh '' is empty; give a value (see `remat-kit plan --help`)"),
    (["bench", "--preset", "tiny", "--mesh", ""], "--mesh '' is empty; give a value"),
    (["train", "--mesh", ""], "--mesh '' is empty; give a value"),
    (["train", "--data", "a.txt", ""], "--data '' is empty; give a value"),
    (["train", "--coordinator", ""], "--coordinator '' is empty; give a value"),
    (["tags", "--model", ""], "--model '' is empty; give a value"),
    # Values accepted without a word before.
    (["train", "--distributed-timeout", "-5"], "--distributed-timeout must be a whole number of seconds >= 1, got -5"),
    (["train", "--distributed-timeout", "5"], "--distributed-timeout goes with a run of several processes"),
    (["bench", "--preset", "tiny", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["bench", "--model", "tests.plan_model_factory:factory", "--seed", "-1"], "--seed must be an integer >= 0"),
    (
        ["train", "--seed", "99999999999999999999"],
        "--seed must be an integer in 0..4294967295, got 99999999999999999999",
    ),
    (["bench", "--preset", "tiny", "--seed", "4294967296"], "--seed must be an integer in 0..4294967295"),
    (["train", "--loss-chunks", "1000000"], "loss_chunks=1000000 exceeds the 1024 tokens of a micro-batch"),
    (["plan", "--preset", "tiny", "--loss-chunks", "65"], "loss_chunks=65 exceeds the token count 64"),
    (["bench", "--preset", "tiny", "--loss-chunks", "65"], "loss_chunks=65 exceeds the token count 64"),
    # An option that would be ignored where it is given.
    (["train", "--keep", "3"], "--keep needs --checkpoint-dir"),
    (["train", "--checkpoint-every", "50"], "--checkpoint-every needs --checkpoint-dir"),
    (["train", "--overwrite"], "--overwrite needs --metrics"),
    (["train", "--eval-batches", "2", "--eval-every", "0"], "--eval-batches needs --eval-every N > 0"),
    (["plan", "--preset", "tiny", "--budget", "50MB", "--top", "3"], "--top lists the largest residuals"),
    (["plan", "--model", "tests.plan_model_factory:factory", "--preset", "tiny"], "--preset shapes the built-in"),
    (["plan", "--model", "tests.plan_model_factory:factory", "--lora-rank", "4"], "--lora-rank shapes the built-in"),
    (["plan", "--model", "tests.plan_model_factory:factory", "--top", "3"], "--top lists the built-in model's"),
    (["plan", "--model", "tests.plan_model_factory:factory", "--jobs", "2"], "--jobs compiles --budget's candidates"),
    (["bench", "--model", "tests.plan_model_factory:factory", "--preset", "2b"], "--preset shapes the built-in"),
    (["bench", "--model", "tests.plan_model_factory:factory", "--quantize", "nf4"], "--quantize shapes the built-in"),
    # A factory whose loss cannot take its inputs: one line naming the factory and the shapes (traced, not compiled).
    (
        ["plan", "--model", "tests.plan_model_factory:wrong_shape"],
        "tests.plan_model_factory:wrong_shape: its loss_fn cannot take its example_args (a pytree of 2 arrays, "
        "float32[8,16,33]) under policy none: ",
    ),
    (
        ["bench", "--model", "tests.plan_model_factory:wrong_shape"],
        "tests.plan_model_factory:wrong_shape: its loss_fn cannot take its example_args",
    ),
    (
        ["tags", "--model", "tests.plan_model_factory:wrong_shape"],
        "tests.plan_model_factory:wrong_shape: its loss_fn cannot take its example_args",
    ),
    (
        ["plan", "--model", "tests.plan_model_factory:not_scalar", "--budget", "1GB"],
        "tests.plan_model_factory:not_scalar: its loss_fn must return a floating-point scalar (the loss), got "
        "float32[8] from example_args",
    ),
    (["tags", "--model", "os.path:join"], "os.path:join(policy full) raised TypeError: "),
]


@pytest.mark.parametrize(
    ("argv", "message"),
    BAD_INPUTS,
    ids=[
        "policies-huge-every_n",
        "policies-empty-tags",
        "plan-empty-tags",
        "plan-empty-item",
        "plan-empty-list",
        "budget-empty-list",
        "bench-empty-list",
        "bench-empty-item",
        "plan-jobs-0",
        "budget-jobs-0",
        "budget-plot-noext",
        "bench-plot-noext",
        "train-plot-noext",
        "train-metrics-dash",
        "train-metrics-dir",
        "train-huge-every_n",
        "train-keep-0",
        "train-checkpoint-every-0",
        "train-max-corpus-bytes-0",
        "train-lr-negative",
        "train-lr-overflow",
        "train-val-fraction-1",
        "train-nf4-without-lora-rank",
        "bench-nf4-without-lora-rank",
        "train-lora-targets-without-rank",
        "train-lora-alpha-without-rank",
        "train-lora-alpha-rank-0",
        "plan-lora-alpha-without-rank",
        "bench-lora-targets-without-rank",
        "train-checkpoint-dir-empty",
        "train-metrics-empty",
        "train-plot-empty",
        "plan-json-empty",
        "plan-timeline-empty",
        "budget-plot-empty",
        "bench-json-empty",
        "bench-markdown-empty",
        "policies-empty-spec",
        "plan-mesh-empty",
        "bench-mesh-empty",
        "train-mesh-empty",
        "train-data-empty",
        "train-coordinator-empty",
        "tags-model-empty",
        "train-distributed-timeout-negative",
        "train-distributed-timeout-one-process",
        "bench-seed-negative",
        "bench-model-seed-negative",
        "train-seed-huge",
        "bench-seed-over-32-bits",
        "train-loss-chunks-over-tokens",
        "plan-loss-chunks-over-tokens",
        "bench-loss-chunks-over-tokens",
        "train-keep-without-dir",
        "train-checkpoint-every-without-dir",
        "train-overwrite-without-metrics",
        "train-eval-batches-without-eval",
        "budget-top",
        "plan-model-preset",
        "plan-model-lora-rank",
        "plan-model-top",
        "plan-model-jobs",
        "bench-model-preset",
        "bench-model-quantize",
        "plan-model-wrong-shape",
        "bench-model-wrong-shape",
        "tags-model-wrong-shape",
        "budget-model-not-scalar",
        "tags-model-not-a-factory",
    ],
)
def test_bad_input_is_one_line_exit_2_before_any_work(argv, message, tmp_path, capsys, no_work, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a file named "-" would land here
    (tmp_path / "adir").mkdir()
    before = sorted(tmp_path.rglob("*"))
    err = _error([a.format(tmp=tmp_path) for a in argv], capsys)
    assert message.format(tmp=tmp_path) in err, err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


# ---- tags --model MODULE:FACTORY ----------------------------------------------------------------------


def test_tags_lists_the_names_an_unedited_models_blocks_emit(capsys):
    assert cli.main(["tags", "--model", "tests.unedited_models:factory"]) == 0
    out = capsys.readouterr().out
    for name, shape in [
        ("attn/q_einsum", "[2, 6, 8]"),
        ("pre_attention_norm", "[2, 6, 8]"),
        ("mlp/gating_einsum", "[2, 16, 2, 6]"),  # the matmul with the block's own parameter, as dot_general lays it out
    ]:
        assert re.search(rf"^{re.escape(name)}\s+{re.escape(shape)}\s+float32", out, re.M), name
    assert cli.main(["tags", "--model", "tests.unedited_models:factory", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["names"]}
    assert rows["attn/q_einsum"] == {"name": "attn/q_einsum", "shape": [2, 6, 8], "dtype": "float32", "bytes": 384}
    assert rows["mlp/gating_einsum"]["shape"] == [2, 16, 2, 6]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("tests.unedited_models", "must be MODULE:FACTORY"),
        ("tests.no_such_module:factory", "cannot import"),
        ("tests.unedited_models:nope", "has no 'nope'"),
        ("tests.plan_model_factory:NOT_CALLABLE", "not a callable"),
        ("tests.plan_model_factory:not_a_pair", r"must return \(loss_fn, example_args\)"),
        ("tests.plan_model_factory:factory", "emits no names under policy full"),
    ],
    ids=["no-colon", "no-module", "no-name", "not-callable", "not-a-pair", "no-names"],
)
def test_tags_with_a_bad_model_is_one_line_and_exit_2(capsys, model, message):
    assert cli.main(["tags", "--model", model]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("remat-kit tags: error:")
    assert re.search(message, err), err


# ---- a mistyped option value: argparse's one line and the command's --help, not 14-20 lines of usage ----------

PARSE_ERRORS = [
    (["train", "--steps", "abc"], "remat-kit train: error: argument --steps: invalid int value: 'abc'", "train"),
    (["train", "--quantize", "bogus"], "remat-kit train: error: argument --quantize: invalid choice: 'bogus'", "train"),
    (["plan", "--limits", "bogus"], "remat-kit plan: error: argument --limits: invalid choice: 'bogus'", "plan"),
    (["bench", "--warmup", "x"], "remat-kit bench: error: argument --warmup: invalid int value: 'x'", "bench"),
    (["tags"], "remat-kit tags: error: the following arguments are required: --model", "tags"),
    (["policies", "--bogus"], "remat-kit: error: unrecognized arguments: --bogus", None),
    (["bogus"], "remat-kit: error: argument COMMAND: invalid choice: 'bogus'", None),
]


@pytest.mark.parametrize(
    ("argv", "message", "command"),
    PARSE_ERRORS,
    ids=["train-steps", "train-quantize", "plan-limits", "bench-warmup", "tags-no-model", "unknown-option", "command"],
)
def test_a_mistyped_option_is_one_line_and_the_help_hint(argv, message, command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    hint = f"(see `remat-kit {command} --help`)" if command else "(see `remat-kit --help`)"
    assert err.startswith(message) and err.rstrip().endswith(hint), err


# ---- the API's bad values: one line naming the argument, before anything is traced ---------------------------------


def _selective_none():
    from remat_kit import policies

    policies.selective(save=None)


def _offload_names_none():
    from remat_kit import policies

    policies.offload(names=None)


def _auto(**kwargs):
    import remat_kit
    from remat_kit.model.transformer import TransformerConfig

    remat_kit.auto(TransformerConfig.preset("tiny"), batch=2, seq=32, budget_bytes=10**9, **kwargs)


def _partial_capturing_an_nnx_module():
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from remat_kit import policies

    module = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    loss = policies.full()(functools.partial(lambda m, x: m(x).sum(), module))
    jax.grad(loss)(jnp.ones((2, 3)))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (_selective_none, TypeError, "selective(save=...) must be a sequence of tag names (strings), got None"),
        (_offload_names_none, TypeError, "offload(names=...) must be a sequence of tag names (strings), got None"),
        (lambda: _auto(candidates=[]), ValueError, "candidates=[] names no policy; give at least one, or None"),
        (lambda: _auto(jobs=0), ValueError, "jobs must be a positive integer, got 0"),
        (
            _partial_capturing_an_nnx_module,
            ValueError,
            "function functools.partial(_partial_capturing_an_nnx_module.<locals>.<lambda>, …) closes over",
        ),
    ],
    ids=["selective-save-none", "offload-names-none", "auto-no-candidates", "auto-jobs-0", "partial-nnx-module"],
)
def test_api_bad_values_are_one_line_naming_the_argument(call, error, message, monkeypatch):
    import jax

    from remat_kit.planning import budget

    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda *_: pytest.fail("compiled before the check"))
    monkeypatch.setattr(budget, "search", lambda *_, **__: pytest.fail("searched before the check"))
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value), str(caught.value)


# ---- a --model factory's own exception: its traceback, then one line naming the factory -----------------------


@pytest.mark.parametrize("command", ["plan", "bench", "tags"])
def test_a_factorys_own_exception_shows_its_traceback_then_one_line(command, capsys, no_work):
    assert cli.main([command, "--model", "tests.plan_model_factory:raises"]) == 2
    err = capsys.readouterr().err.rstrip().splitlines()
    policy = "full" if command == "tags" else "none"
    assert "Traceback (most recent call last):" in err
    assert f"tests.plan_model_factory.OwnBug: the user's own bug under {policy}" in err  # theirs, as Python says it
    assert err[-1] == (
        f"remat-kit {command}: error: tests.plan_model_factory:raises(policy {policy}) raised OwnBug: the user's own "
        "bug under " + policy + " (the traceback above is the model's)"
    )


# ---- a multi-process run that never forms: one line, never JAX's abort ------------------------------------------


def test_process_0_names_the_process_that_never_joined_instead_of_aborting(tmp_path):
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["train", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "3", "--process-id", "0"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "remat_kit.cli", *argv, "--distributed-timeout", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Check failure" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert lines[-1].startswith(
        f"remat-kit train: error: process 0 of 3: processes 1, 2 never joined the coordinator at 127.0.0.1:{port} "
        "within 2 s; start one process per --process-id"
    ), lines
    assert time.monotonic() - start < 60  # the 2 s wait and an import of JAX, not JAX's 300 s


# ---- Ctrl-C as a terminal sends it: every command exits 130 at once, with one line ---------------------------

#: Starts the CLI as a shell starts a job: SIGINT at its default disposition (a test runner may run with it
#: ignored, and a child that inherits an ignored SIGINT would prove nothing), exec'd into `python -m remat_kit.cli`.
_TERMINAL_CHILD = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'remat_kit.cli', *sys.argv[1:]])\n"
)

#: Seconds from Ctrl-C to exit a command with nothing to save may take (it ends at once; the margin is for a
#: loaded CI machine). train saves first: it stops at its next safe point, within one compile of the tiny preset.
AT_ONCE_S, TRAIN_S = 10, 60


def _start_as_a_terminal_would(argv, cwd, **env):
    # Its own process group (a shell's job), which the terminal's Ctrl-C signals as a whole: worker processes too.
    # The repository is importable from `cwd` (the tests' factories), as the working tree is for the suite.
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-c", _TERMINAL_CHILD, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        process_group=0,
        env={**os.environ, "PYTHONPATH": path, **env},
    )


def _handler_in(pid: int) -> bool:
    # Python catches SIGINT from its first instant, SIGTERM only once remat-kit's handler is in (Linux: the
    # caught-signal mask), so this is the first moment at which a Ctrl-C is the CLI's to handle.
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


#: ``when`` of a Ctrl-C while JAX's compiled extension is being loaded (where a KeyboardInterrupt crashed the process).
IMPORTING_JAX = "importing jax"


def _importing_jax(pid: int) -> bool:
    return "jaxlib" in Path(f"/proc/{pid}/maps").read_text()


def _wait_until(proc, when: str | None) -> list[str]:
    """Wait until the handler is in (``when`` None), JAX is being imported (:data:`IMPORTING_JAX`) or a stderr line
    holds ``when``; the lines read so far."""
    deadline = time.monotonic() + 180
    if when is None or when == IMPORTING_JAX:
        ready = _handler_in if when is None else _importing_jax
        while not ready(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.002)
        return []
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if when in line:
            return lines
        assert time.monotonic() < deadline, lines
    raise AssertionError(f"exit {proc.wait()} before a {when!r} line: {lines}")


_TINY_BENCH = ["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--no-grad-check", "--policies", "full"]

SIGNALS = [
    (["policies"], None),
    (["train", "--preset", "tiny", "--steps", "1", "--no-progress"], None),
    (["plan", "--preset", "tiny"], None),
    (_TINY_BENCH, None),
    (["tags", "--model", "os.path:join"], None),
    (["policies"], IMPORTING_JAX),
    (["plan", "--preset", "tiny"], IMPORTING_JAX),  # at 0.5 s: ignored (exit 0 after all eight compiles) or a crash
    (["tags", "--model", "os.path:join"], IMPORTING_JAX),  # printed "KeyboardInterrupt:", then the factory's error
    (["plan", "--preset", "tiny"], "[1/8] none: tracing and compiling"),  # once ignored, or waited for all eight
    (["plan", "--preset", "tiny", "--jobs", "1"], "[1/8] none: tracing and compiling"),
    (["plan", "--preset", "tiny", "--budget", "1GB"], "[plan] compiling"),
    (["plan", "--model", "tests.plan_model_factory:factory"], "[plan] tests.plan_model_factory:factory"),
    ([*_TINY_BENCH, "--in-process"], "[1/2] none"),
    (_TINY_BENCH, "[1/2] none"),  # in its worker process, which the terminal's Ctrl-C reaches too
]


@pytest.mark.parametrize(
    ("argv", "when"),
    SIGNALS,
    ids=[
        "policies-start-up",
        "train-start-up",
        "plan-start-up",
        "bench-start-up",
        "tags-start-up",
        "policies-importing-jax",
        "plan-importing-jax",
        "tags-importing-jax",
        "plan-first-compile",
        "plan-jobs-1-first-compile",
        "budget-compiling",
        "plan-model-compiling",
        "bench-in-process-measuring",
        "bench-worker-measuring",
    ],
)
def test_ctrl_c_exits_130_at_once_with_one_line(argv, when, tmp_path):
    proc = _start_as_a_terminal_would(argv, tmp_path)
    try:
        _wait_until(proc, when)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: to the whole foreground job
        out, err = proc.communicate(timeout=TRAIN_S + 60)
        waited = time.monotonic() - sent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    command = argv[0]
    assert proc.returncode == 130, err
    assert waited < (TRAIN_S if command == "train" else AT_ONCE_S), f"{waited:.1f} s from Ctrl-C to exit"
    assert err.strip().splitlines()[-1] in (f"remat-kit {command}: interrupted", "remat-kit: interrupted"), err
    for swallowed in ("Traceback", "Exception ignored", "KeyboardInterrupt", "error:"):
        assert swallowed not in err, err
    if command != "policies":
        assert out == ""  # stopped before any report
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran


def test_ctrl_c_of_bench_alone_ends_its_worker_too(tmp_path):
    # `kill -INT` of the bench process only (not its group): the worker measuring a policy must not outlive it.
    proc = _start_as_a_terminal_would(_TINY_BENCH, tmp_path)
    try:
        _wait_until(proc, "[1/2] none")
        workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert workers, "no worker process"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=AT_ONCE_S + 60)
        assert proc.returncode == 130 and err.strip().splitlines()[-1] == "remat-kit bench: interrupted", err
        deadline = time.monotonic() + AT_ONCE_S
        while any(_alive(int(w)) for w in workers):
            assert time.monotonic() < deadline, "the worker outlived its bench"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctrl_c_mid_explain_removes_its_temporary_files(tmp_path):
    # --explain compiles with XLA's dump into a temporary folder; Ctrl-C ends the process without `finally`
    # blocks, so the command's private temporary folder is removed by the signal's own cleanup.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    ours = lambda: [p.name for p in scratch.iterdir() if p.name.startswith("remat")]
    proc = _start_as_a_terminal_would(
        ["plan", "--preset", "tiny", "--explain", "--jobs", "1"], tmp_path, TMPDIR=str(scratch)
    )
    try:
        _wait_until(proc, "[1/8] none: tracing and compiling")
        assert len(ours()) == 1 and ours()[0].startswith("remat-kit-")  # the command's own folder
        deadline = time.monotonic() + 120
        while not any((scratch / ours()[0]).iterdir()):  # XLA's dump folder, under it
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=AT_ONCE_S + 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and ours() == []
