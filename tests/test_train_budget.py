"""remat-kit train --budget: the plan chosen by remat_kit.fit's engine, recorded, reused on --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat_kit import cli, policies
from remat_kit.train import loop as train

pytestmark = pytest.mark.onejax  # orchestration over compiles: the default JAX only (pyproject)

TINY = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--no-progress"]


def _run(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--policy", "auto"], "--policy auto chooses the policy that fits --budget SIZE"),
        (["--budget", "1GB", "--policy", "full"], "give --policy auto or leave it out, not 'full'"),
        (["--budget", "abc"], "cannot read memory size 'abc'"),
        (["--budget", "-1GB"], "a memory budget must be positive"),
        (["--budget", "0"], "a memory budget must be positive"),
    ],
    ids=["auto-without-budget", "budget-with-policy", "text", "negative", "zero"],
)
def test_bad_budget_flags_are_one_line(extra, match, capsys):
    code, _, err = _run(["train", *TINY, "--steps", "1", *extra], capsys)
    assert code == 2 and err.count("\n") == 0 and match in err


def test_train_budget_plans_records_resumes_and_refuses_a_changed_budget(tmp_path, capsys):
    data = str(Path(train.__file__).parent)  # a folder of real text, nothing downloaded
    ckpt = tmp_path / "ckpt"
    base = ["train", *TINY, "--data", data, "--checkpoint-dir", str(ckpt), "--json"]
    # Between full's need (4.4 MB) and none's (5.0 MB) at this shape, with the 10% margin.
    code, out, _ = _run([*base, "--steps", "2", "--budget", "5MB"], capsys)
    assert code == 0
    plan = json.loads((ckpt / "remat_plan.json").read_text())
    assert plan["budget_bytes"] == 5 * 10**6 and plan["policy"] != "none"
    assert plan["need_bytes"] * (1 + plan["margin"]) <= plan["budget_bytes"]
    assert str(policies.parse(plan["policy"])) == plan["policy"]
    assert plan["seq_tiles"] == 1  # it fits untiled: no tiles (they only cost time)
    assert f"policy {plan['policy']}" in out  # printed before the first step
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["policy"] == plan["policy"] and summary["step"] == 2

    code, out, _ = _run([*base, "--steps", "3", "--budget", "5MB", "--resume"], capsys)
    assert code == 0 and "resuming under the recorded plan" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["policy"] == plan["policy"] and summary["step"] == 3 and summary["resumed_from"] == 2

    code, _, err = _run([*base, "--steps", "4", "--resume"], capsys)  # no --budget: still the recorded plan
    assert code == 0 and "resuming under the recorded plan" in err

    code, _, err = _run([*base, "--steps", "5", "--budget", "6MB", "--resume"], capsys)
    assert code == 2 and err.count("\n") == 0
    assert "this run was planned for --budget 5.0 MB" in err and plan["policy"] in err


def test_resume_keeps_the_recorded_plans_sequence_tiles(tmp_path, capsys):
    data = str(Path(train.__file__).parent)
    ckpt = tmp_path / "ckpt"
    base = ["train", *TINY, "--data", data, "--checkpoint-dir", str(ckpt), "--json"]
    # A run planned in 4 sequence tiles (as --budget records it when nothing fits untiled), then resumed without the
    # flag: the checkpoint's model has seq_tiles=4; a resume that dropped the tiles would be refused as another model.
    code, _, _ = _run([*base, "--steps", "1", "--policy", "full", "--seq-tiles", "4"], capsys)
    assert code == 0
    record = {"budget_bytes": 5 * 10**6, "margin": 0.1, "policy": "full", "seq_tiles": 4, "need_bytes": 4 * 10**6}
    (ckpt / "remat_plan.json").write_text(json.dumps(record))
    code, out, _ = _run([*base, "--steps", "2", "--budget", "5MB", "--resume"], capsys)
    assert code == 0 and "resuming under the recorded plan full in 4 sequence tiles" in out
    assert json.loads(out.strip().splitlines()[-1])["step"] == 2
