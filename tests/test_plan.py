"""`remat-kit plan`: the table, the seed check, the JSON schema and one-line errors."""

import json
import re
import subprocess
import sys

import pytest

from remat_kit import cli, policies
from remat_kit.cli import plan as plan_cli
from remat_kit.cli import plan_report as plan
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning import budget as A
from remat_kit.units import fmt_count

pytestmark = pytest.mark.onejax  # orchestration over compiles: the default JAX only (pyproject)

TINY = ["--preset", "tiny", "--attention", "xla", "--batch-size", "2", "--seq-len", "32"]


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert cli.main(["plan", *TINY, "--policies", "none,full,offload", "--top", "2", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_plan_json_schema(plan_json):
    assert plan_json["command"].startswith("remat-kit plan") and "--preset tiny" in plan_json["command"]
    assert {"preset", "config", "batch", "seq", "loss_chunks", "estimates", "seed_check", "records"} <= set(plan_json)
    assert [r["policy"] for r in plan_json["records"]] == ["none", "full", "offload"]
    keys = {"saved_bytes", "saved_host_bytes", "layers_saved_bytes", "head_saved_bytes", "temp_bytes", "flops"}
    keys |= {"xla_flops_raw", "largest", "layers_breakdown", "compile_s"}
    for record in plan_json["records"]:
        assert keys <= set(record)
        assert len(record["largest"]) == 2
        assert {"region", "label", "tags", "shape", "dtype", "nbytes", "host", "source"} == set(record["largest"][0])


def test_plan_seed_check_agrees_to_the_byte(plan_json):
    lines = plan_json["seed_check"]
    assert any("layer inputs" in line and "equal to the byte" in line for line in lines)
    assert any("logits" in line for line in lines)
    assert any("Korthikanti" in line for line in lines)
    full = next(r for r in plan_json["records"] if r["policy"] == "full")
    offload = next(r for r in plan_json["records"] if r["policy"] == "offload")
    # On CPU no memory moves: offloaded layer inputs are counted on the device, with a note.
    assert offload["saved_host_bytes"] == 0 and offload["layers_saved_bytes"] == full["layers_saved_bytes"] > 0
    assert any("no memory moves" in n for n in offload["notes"])
    assert all(r["peak_bytes"] > r["temp_bytes"] for r in plan_json["records"])


def test_plan_prints_table_and_largest(capsys):
    assert cli.main(["plan", *TINY, "--policies", "full", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "XLA temp" in out and "full" in out
    assert "largest residuals per policy" in out and "layer_input" in out
    params = fmt_count(TransformerConfig.preset("tiny").num_params())
    assert params == "218 k" and f"preset tiny ({params} params" in out  # with its unit, not "0.00 B params"
    assert "against the theory" in out and "seed check" not in out
    assert "default shape" not in out  # the shape was given


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--preset", "tiny", "--policies", "none,fulll"], "unknown policy spec 'fulll'"),
        (["--preset", "tiny", "--batch", "0"], "batch must be a positive integer"),
        (["--preset", "tiny", "--seq", "0"], "seq must be a positive integer"),
        (["--preset", "tiny", "--seq", "100000"], "exceeds the model's max_seq_len"),
        (["--preset", "tiny", "--loss-chunks", "-2"], "loss_chunks"),
        (["--preset", "tiny", "--json", "/"], "'/' is a directory; give a file path"),
        (["--preset", "tiny", "--policies", "every_n:99"], "greater than the depth"),
    ],
    ids=["preset", "policy", "batch", "seq0", "seq_max", "chunks", "unwritable", "depth"],
)
def test_bad_arguments_give_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_output_under_a_file_is_rejected(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["plan", "--preset", "tiny", "--json", str(blocker / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a folder" in err


def test_output_in_a_missing_folder_is_written_there(tmp_path, capsys):
    # The rule train applies to --metrics: the folder is created when the file is written.
    path = tmp_path / "new" / "dir" / "plan.json"
    assert cli.main(["plan", "--preset", "tiny", "--policies", "none", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["records"][0]["policy"] == "none"


def test_exit_code_from_the_console():
    proc = subprocess.run(
        [sys.executable, "-m", "remat_kit.cli", "plan", "--preset", "tiny", "--batch", "-1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "batch must be a positive integer" in proc.stderr


def test_parse_policies_keeps_tag_lists_together():
    got = [str(p) for p in plan.parse_policies("none,selective:q_proj,k_proj,every_n:2", 4)]
    assert got == ["none", "selective:q_proj,k_proj", "every_n:2"]
    got = [str(p) for p in plan.parse_policies("jax:save_only_these_names(query_proj,mlpwo),jax:dots_saveable", 4)]
    assert got == ["jax:save_only_these_names(query_proj,mlpwo)", "jax:dots_saveable"]
    with pytest.raises(ValueError, match="names no policy"):
        plan.parse_policies(" , ", 4)
    # Options after ';' without tags start a new spec too; an empty item is refused, not dropped.
    got = [str(p) for p in plan.parse_policies("selective:q_proj,offload;save=mlp_up,selective;strict=false", 4)]
    assert got == ["selective:q_proj", "offload:layer_input;save=mlp_up", str(policies.selective(strict=False))]
    with pytest.raises(ValueError, match=r"--policies 'none,,full' has an empty item"):
        plan.parse_policies("none,,full", 4)


# ---- plan --budget (remat_kit.planning.budget through the CLI) ---------------------------------------------------


def test_plan_budget_chooses_and_writes_json(tmp_path, capsys):
    out = tmp_path / "budget.json"
    code = cli.main(
        [
            "plan",
            "--preset",
            "tiny",
            "--policies",
            "none,full",
            "--budget",
            "30MB",
            "--limits",
            "chosen",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "chosen: none" in text and "max batch" in text
    assert "batch 2 × seq 32 (preset tiny's default shape; --batch-size/--seq-len to plan yours)" in text
    assert "max seq: plan --max-seq's longest sequence" in text
    payload = json.loads(out.read_text())
    assert payload["chosen"] == "none" and payload["budget_bytes"] == 30 * 10**6
    rows = {r["policy"]: r for r in payload["candidates"]}
    assert rows["none"]["fits"] and rows["none"]["max_batch"] >= 2 and rows["full"]["max_batch"] is None
    assert (tmp_path / "p.png").stat().st_size > 0


def test_plan_budget_and_max_seq_print_the_same_longest_sequence(tmp_path, capsys):
    # One computation (the levers by default): plan --budget's max seq column is plan --max-seq's answer.
    common = ["plan", "--preset", "tiny", "--policies", "full", "--budget", "30MB", "--no-progress"]
    budget_json, reach_json = tmp_path / "budget.json", tmp_path / "reach.json"
    assert cli.main([*common, "--limits", "chosen", "--json", str(budget_json)]) == 0
    assert cli.main([*common, "--max-seq", "--json", str(reach_json)]) == 0
    row = next(r for r in json.loads(budget_json.read_text())["candidates"] if r["policy"] == "full")
    edge = json.loads(reach_json.read_text())["policies"][0]["edges"][0]
    assert row["max_seq"] == edge["seq"] > 32
    assert f"{edge['seq']:,}" in capsys.readouterr().out


def test_a_need_over_the_budget_shows_the_digits_that_tell_them_apart():
    # "0.20 GB, over" against a 0.20 GB budget says nothing; the digits that differ say why.
    from remat_kit.cli import plan_max_seq
    from remat_kit.planning.limits import SeqEdge

    edge = SeqEdge("full", 200_000_000, 0.0, 256, 199_900_000, 512, 200_300_000, 0, 256, 1024)
    row = plan_max_seq.PolicyReach("full", 256, 150_000_000, None, 1.0, 0.0, (edge,))
    (line,) = plan_max_seq.format_edges([row])
    assert "256 needs 0.1999 GB; 512 needs 0.2003 GB, over" in line


def test_plan_budget_nothing_fits_is_a_message_and_exit_1(capsys):
    code = cli.main(["plan", "--preset", "tiny", "--policies", "full", "--budget", "1MB", "--limits", "none"])
    assert code == 1
    captured = capsys.readouterr()
    # Said once, before any compile (the parameters and optimizer state alone exceed it), with what is needed.
    assert captured.err.count("nothing fits") == 1 and "the parameters and optimizer state alone" in captured.err
    assert "nothing fits" not in captured.out and "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--budget", "80 GX"], "cannot read memory size '80 GX'"),
        (["--margin", "0.2"], "--margin goes with --budget"),
        (["--budget", "1GB", "--margin", "2"], r"margin must be in \[0, 1\)"),
        (["--mesh", "data=3"], "needs 3 devices but 4 are available"),
        (["--mesh", "data"], "axis 'data' needs a size; the '=N' is missing"),
        (["--budget", "-5GB"], "a memory budget must be positive, got '-5GB'"),
    ],
    ids=["unit", "margin-alone", "margin-range", "mesh", "mesh-without-size", "negative-budget"],
)
def test_plan_budget_bad_arguments(argv, match, capsys):
    assert cli.main(["plan", "--preset", "tiny", "--policies", "full", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(match, err)


def test_plan_json_without_path_goes_to_stdout_and_the_text_to_stderr(capsys):
    assert cli.main(["plan", *TINY, "--policies", "full", "--top", "0", "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)  # stdout is the JSON alone
    assert [r["policy"] for r in payload["records"]] == ["full"]
    assert "against the theory" in captured.err and "tracing and compiling" not in captured.err  # --no-progress


# ---- plan --budget --per-tensor / --calibrate --------------------------------------------------------------

BUDGET_TINY = ["plan", *TINY, "--policies", "none,full", "--limits", "none", "--no-progress"]


def test_plan_per_tensor_prints_the_answer_and_its_maxtext_settings(tmp_path, capsys):
    out = tmp_path / "per.json"
    # MaxText-named groups only (5 groups: 32 one-layer traces); an ample budget: none, a seed, no compile more.
    argv = [*BUDGET_TINY, "--budget", "1GB", "--per-tensor", "--maxtext", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "per tensor: every one of the 32 subsets of q_proj+k_proj+v_proj, context, attn_out" in text
    assert "  none: est. 0 ms over none" in text and "(compiled, fits; a preset)" in text
    assert "as MaxText settings: remat_policy: none" in text
    per = json.loads(out.read_text())["per_tensor"]
    assert (
        per["chosen"] == "none"
        and per["source"] == "preset"
        and per["maxtext"] == [{"layers": None, "settings": {"remat_policy": "none"}}]
    )


def test_maxtext_settings_are_given_per_part_of_a_mix():
    got = plan.maxtext_settings(policies.parse("selective:q_proj*1+full*3"))
    assert [r["layers"] for r in got] == [[0, 0], [1, 3]]
    assert got[0]["settings"]["query_proj"] == "device" and got[1]["settings"]["query_proj"] == "remat"
    assert "MaxText has no tensor name for ['mlp_act']" in plan.maxtext_settings(policies.parse("selective:mlp_act"))


def test_plan_calibrate_shows_both_figures(capsys):
    assert cli.main([*BUDGET_TINY, "--budget", "1GB", "--calibrate"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("cost model:"))
    assert "cpu (calibrated on this machine)" in line and "the defaults: 0.1 TFLOP/s, 20 GB/s memory" in line


def test_plan_model_budget_calibrate(capsys):
    argv = ["plan", "--model", "plan_model_factory:factory", "--policies", "none,full", "--budget", "1GB"]
    assert cli.main([*argv, "--calibrate", "--no-progress"]) == 0
    assert "(calibrated on this machine)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--model", "plan_model_factory:factory", "--budget", "1GB", "--per-tensor"], "--per-tensor chooses per tag"),
        (["--model", "plan_model_factory:factory", "--calibrate"], "--calibrate goes with --budget"),
        (["--preset", "tiny", "--maxtext"], "--maxtext goes with --budget"),
        (["--preset", "tiny", "--budget", "1GB", "--maxtext"], "--maxtext goes with --per-tensor"),
    ],
    ids=["model-per-tensor", "model-calibrate", "maxtext-alone", "maxtext-without-per-tensor"],
)
def test_per_tensor_and_calibrate_flags_are_refused_where_they_do_nothing(argv, match, capsys):
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err


def test_limits_pareto_takes_the_front_by_estimated_cost():
    # none and selective recompute 0 matmul FLOPs; by FLOPs selective dominated none (it needs less), by the
    # estimated cost (selective recomputes norms and activations) both are on the front.
    rows = [
        A.Candidate("none", 0, 0, need_bytes=300, recompute_s=0.0),
        A.Candidate("selective", 0, 0, need_bytes=200, recompute_s=1e-3),
        A.Candidate("every_n:2", 0, 10, need_bytes=250, recompute_s=2e-3),
        A.Candidate("full", 0, 20, need_bytes=100, recompute_s=3e-3),
    ]
    assert plan_cli.limit_policies(rows, "pareto", None) == ["none", "selective", "full"]
    assert plan_cli.limit_policies(rows, "chosen", policies.full()) == ["full"]
    assert plan_cli.limit_policies(rows, "all", None) == ["none", "selective", "every_n:2", "full"]


def test_a_tiled_choice_is_marked_alone_in_the_table_and_carried_in_the_json():
    # The same policy untiled (over the budget) and in 4 tiles (fits): only the tiled row is the chosen one.
    rows = (
        A.Candidate("none", 0, 0, need_bytes=300, host_bytes=0, fits=False),
        A.Candidate("full", 0, 20, need_bytes=200, host_bytes=0, fits=False, recompute_s=3e-3),
        A.Candidate("full", 0, 20, 150, 0, True, recompute_s=3e-3, seq_tiles=4, tiles_s=1e-3),
    )
    r = A.AutoResult(policies.full(), 180, 0.1, 2, 64, 0, "adamw", rows, "", 0, 0.0, seq_tiles=4)
    table = r.table({"full": (3, 96)})
    marked = [line for line in table if line.startswith("*")]
    assert len(marked) == 1 and marked[0].startswith("*full @4 tiles") and " 4 ms " in marked[0]  # 3 + 1 ms
    assert [line.split()[-1] for line in table if line.startswith(" full ")] == ["96"]  # limits: the untiled row's
    assert r.to_dict()["seq_tiles"] == 4 and r.to_dict()["candidates"][2]["seq_tiles"] == 4
