"""Each example runs end to end in a reduced mode (a few steps), as a user would run it."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from remat_kit import units

# Process orchestration around JAX, not JAX itself: CI runs these once, on the default JAX (.ci/run).
pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name, *args, cwd):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_train_lm(tmp_path):
    out = run_example(
        "train_lm.py", "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--out", "run", cwd=tmp_path
    )
    assert "policy selective: loss" in out and "sample: 'import " in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] < records[0]["loss"]
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 0
    assert "3" in {p.name for p in (tmp_path / "run" / "checkpoints").iterdir()}  # the last step is saved


def test_custom_module(tmp_path):
    out = run_example("custom_module.py", "--steps", "3", "--depth", "3", cwd=tmp_path)
    assert "3 x MyBlock under selective:ffn_up; params" in out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.parametrize("policies", [("none", "selective")], ids=["none-selective"])
def test_compare_policies(tmp_path, policies):
    args = ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--out", "cmp.png", "--policies", *policies]
    out = run_example("compare_policies.py", *args, cwd=tmp_path)
    rows = {parts[0]: parts for parts in map(str.split, out.splitlines()) if parts and parts[0] in policies}
    for name in policies:
        rel_diff, kept_mib = float(rows[name][1]), float(rows[name][2])
        assert rel_diff < 1e-4 and kept_mib > 0  # same losses; memory reported
    assert float(rows["selective"][2]) < float(rows["none"][2])  # selective keeps less than none
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"


def test_lora_finetune(tmp_path):
    args = ["--preset", "tiny", "--base-steps", "2", "--steps", "12", "--batch-size", "4", "--seq-len", "32"]
    out = run_example("lora_finetune.py", *args, "--out", "run", cwd=tmp_path)
    assert "base: tiny trained 2 steps" in out and "base int8" in out
    before, after = (float(x) for x in out.split("validation ")[1].split()[0:3:2])
    assert after < before, out  # the adapters learn the new text
    assert "base weights unchanged: True" in out


def test_nnx_module(tmp_path):
    args = ["--steps", "3", "--depth", "2", "--width", "16", "--seq-len", "16", "--batch-size", "2"]
    out = run_example("nnx_module.py", *args, cwd=tmp_path)
    assert "2 x MyBlock under selective:ffn_up" in out and "ffn_up of every layer (tagged, kept)" in out
    kept = {
        parts[0]: units.parse_bytes(" ".join(parts[1:3]))
        for parts in map(str.split, out.splitlines())
        if parts and parts[0] in ("none", "selective:ffn_up", "full")
    }
    assert kept["full"] < kept["selective:ffn_up"] < kept["none"], out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_plan_your_model(tmp_path):
    # 8 MB lies between dots' need (~6 MB with the margin) and none's (~14 MB): a comfortable budget gives none.
    out = run_example("plan_your_model.py", "--small", "--budget", "8MB", cwd=tmp_path)
    assert "inspect, policy full:" in out and "peak" in out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] in (["none"], ["dots"], ["full"])]
    assert rows[:3] == ["none", "dots", "full"]  # compare keeps the order asked
    assert "chosen: dots" in out  # none does not fit; dots recomputes less than full


def docstring_flags(name):
    """The flags of the command an example's docstring shows (``python examples/NAME ...``)."""
    doc = ast.get_docstring(ast.parse((EXAMPLES / name).read_text()))
    line = next(line for line in doc.splitlines() if line.strip().startswith(f"python examples/{name}"))
    return line.split()[2:]


def test_unedited_model(tmp_path):
    # The docstring's own command (its flags must parse), at a reduced size.
    flags = docstring_flags("unedited_model.py")
    out = run_example("unedited_model.py", *flags, "--layers", "2", "--width", "16", "--seq-len", "16", cwd=tmp_path)
    assert "attn/q_einsum" in out and "mlp/gating_einsum" in out  # names_of's table
    chosen = out.split("chosen: ")[1].split()[0]
    assert chosen not in ("none", "full"), out  # the budget lies between them
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0]
