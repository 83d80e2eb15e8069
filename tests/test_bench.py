"""`remat-kit bench`: real steps per policy; records, reports and errors (tiny preset, few steps)."""

import dataclasses
import json
from pathlib import Path

import pytest

from remat_kit import cli
from remat_kit.bench import run as bench
from remat_kit.model.transformer import TransformerConfig

pytestmark = pytest.mark.onejax  # orchestration over compiles: the default JAX only (pyproject)

#: The guide that explains the bfloat16 check `bench` points to.
PLANNING_GUIDE = Path(__file__).resolve().parent.parent / "docs" / "planning.md"

CFG = TransformerConfig.preset("tiny")
#: Keys the issue requires in every JSON record.
REQUIRED = {
    "policy",
    "saved_bytes",
    "saved_host_bytes",
    "temp_bytes",
    "peak_bytes",
    "flops",
    "step_time_s",
    "step_time_ratio",
    "loss",
    "max_grad_diff",
}


@pytest.fixture(scope="module")
def records():
    return bench.run_bench(CFG, 2, 32, ["full", "selective"], steps=2, warmup=1, subprocesses=False)


def test_none_is_the_reference_and_runs_first(records):
    assert [r.policy for r in records] == ["none", "full", "selective"]
    for r in records:  # each ratio is over none's measured median, not a constant
        assert r.step_time_ratio == pytest.approx(r.step_time_s / records[0].step_time_s, rel=1e-12)


def test_gradient_check_sees_a_difference(tmp_path):
    import numpy as np

    ref, got = tmp_path / "ref.npz", tmp_path / "got.npz"
    np.savez(ref, np.array([1.0, -4.0]), np.array([[2.0]]))
    np.savez(got, np.array([1.0, -4.0]), np.array([[2.5]]))
    assert bench._grad_diffs(str(got), str(ref)) == (0.5, 0.25)
    assert bench._grad_diffs(str(ref), str(ref)) == (0.0, 0.0)


def test_memory_probe_sees_an_allocation():
    import jax
    import numpy as np

    probe = bench._MemoryProbe(jax.devices()[0])
    if probe.source == "device":  # device stats: put the bytes on the device
        base = probe.baseline()
        x = jax.device_put(np.ones(25_000_000 // 4, np.float32)).block_until_ready()
    else:  # this process's resident set
        base = probe.baseline()
        x = np.ones(25_000_000 // 8)  # 25 MB, touched
    assert probe.peak() - base >= 20_000_000
    del x


def test_record_keys_are_the_record_fields():
    assert tuple(f.name for f in dataclasses.fields(bench.BenchRecord)) == bench.RECORD_KEYS


def test_noisy_timings_are_flagged():
    def rec(policy, times):
        return bench.BenchRecord(
            policy, *[0] * 7, "rss", 0, 0.0, sorted(times)[len(times) // 2], tuple(times), 1.0, 0.0, 0.0, None, None
        )

    steady, noisy = rec("none", [1.0, 1.05, 1.1]), rec("full", [0.8, 1.0, 1.4])
    assert (steady.step_time_min_s, steady.step_time_max_s) == (1.0, 1.1)
    assert noisy.step_time_spread == pytest.approx(0.6)
    (line,) = bench.noise_warnings([steady, noisy])
    assert line.startswith("full: step times 800–1400 ms spread 60% of the median")
    assert bench.noise_warnings([steady, noisy], threshold=0.7) == []
    table = "\n".join(bench.format_table([steady, noisy]))
    assert "min–max" in table and "800–1400" in table


def test_a_measured_peak_above_nones_with_a_lower_compiled_peak_is_explained_on_its_row():
    def rec(policy, xla_peak, peak):
        return bench.BenchRecord(
            policy, *[0] * 4, xla_peak, peak, 0, "rss", 0, 0.0, 1.0, (1.0,), 1.0, 0.0, 0.0, None, None
        )

    records = [rec("none", 100, 200), rec("sqrt_n", 50, 300), rec("full", 40, 150), rec("dots", 120, 300)]
    assert list(bench.peak_notes(records)) == ["sqrt_n"]  # full measured lower; dots compiled higher: no riddle
    rows = bench.format_table(records)[2:]
    assert [row.endswith("† peak") for row in rows] == [False, True, False, False]
    assert "compiled peak is lower (50 B vs 100 B)" in bench.peak_notes(records)["sqrt_n"]


def test_policies_match_none_exactly(records):
    for r in records[1:]:
        assert r.max_grad_rel_diff <= 1e-5, r.policy  # RTOL_F32, never loosened
        assert r.loss_diff <= 1e-5 * abs(records[0].loss), r.policy


def test_records_carry_measurements(records):
    for r in records:
        assert len(r.step_times_s) == 2 and r.step_time_s > 0
        assert r.baseline_bytes > 0 and r.peak_source in ("device", "rss")
        assert min(r.step_times_s) == r.step_time_min_s <= r.step_time_s <= r.step_time_max_s
        assert r.temp_bytes > 0 and r.flops > 0
    by = {r.policy: r for r in records}
    assert by["full"].saved_bytes < by["selective"].saved_bytes < by["none"].saved_bytes
    assert by["full"].flops > by["none"].flops


def test_pareto_front():
    def rec(policy, t, mem):
        return bench.BenchRecord(policy, 0, 0, 0, 0, 0, mem, 0, "rss", 0, 0.0, t, (t,), 1.0, 0.0, 0.0, 0.0, 0.0)

    rs = [rec("a", 1.0, 10), rec("b", 2.0, 5), rec("c", 2.5, 8), rec("d", 3.0, 1)]
    assert bench.pareto_front(rs) == ["a", "b", "d"]


def _timed(policy, times, mem):
    return bench.BenchRecord(
        policy,
        0,
        0,
        0,
        0,
        mem,
        mem,
        0,
        "rss",
        0,
        0.0,
        sorted(times)[len(times) // 2],
        tuple(times),
        1.0,
        0.0,
        0.0,
        None,
        None,
    )


def test_pareto_front_is_drawn_over_the_spread_not_the_medians():
    # Two runs of one command: medians shuffle within overlapping min–max ranges. A front over the
    # medians differs between them (none is on it in run 1 only); the front over the spread does not.
    run1 = [
        _timed("none", (1.00, 1.02, 1.20), 300),
        _timed("full", (1.01, 1.05, 1.25), 100),
        _timed("sqrt_n", (2.00, 2.10, 2.20), 90),
    ]
    run2 = [
        _timed("none", (1.00, 1.10, 1.20), 300),
        _timed("full", (1.01, 1.04, 1.25), 100),
        _timed("sqrt_n", (2.00, 2.05, 2.20), 90),
    ]
    from remat_kit.planning.pareto import pareto_front as by_medians

    fronts = [[rs[i].policy for i in by_medians([(r.step_time_s, r.step_bytes) for r in rs])] for rs in (run1, run2)]
    assert fronts == [["none", "full", "sqrt_n"], ["full", "sqrt_n"]]
    assert bench.pareto_front(run1) == bench.pareto_front(run2) == ["full", "sqrt_n"]
    # Memory within MEMORY_NOISE is a tie: a faster policy with 3 % more memory stays on the front.
    tie = [_timed("a", (1.0, 1.0, 1.0), 103), _timed("b", (2.0, 2.0, 2.0), 100)]
    assert bench.pareto_front(tie) == ["a"]
    assert bench.pareto_front([_timed("a", (1.0,), 110), _timed("b", (2.0,), 100)]) == ["a", "b"]


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        (
            [
                _timed("none", (1.0, 1.02, 1.04), 300),
                _timed("full", (1.01, 1.03, 1.05), 100),
                _timed("sqrt_n", (2.0, 2.1, 2.2), 50),
            ],
            "recommended: full (least compiled peak, 100 B, at the speed of the fastest within its 1000–1040 ms); "
            "for less memory: sqrt_n (50 B, ×2.04 time); sure",
        ),
        (
            [_timed("none", (1.0, 1.02, 1.04), 300), _timed("full", (1.1, 1.2, 1.3), 100)],
            "recommended: none (least compiled peak, 300 B, at the speed of the fastest within its 1000–1040 ms); "
            "for less memory: full (100 B, ×1.18 time); sure",
        ),
        (
            [_timed("none", (1.0, 1.5, 2.0), 300), _timed("full", (1.0, 1.2, 1.3), 100)],
            "recommended: full (least compiled peak, 100 B, at the speed of the fastest within its 1000–1300 ms); "
            "unsure: step times of none, full spread over 25% (rerun with more --steps on an idle machine)",
        ),
        (
            [_timed("none", (1.0, 1.02, 1.04), 101), _timed("full", (1.01, 1.03, 1.05), 100)],
            "recommended: full (least compiled peak, 100 B, at the speed of the fastest within its 1000–1040 ms); "
            "unsure: none within 1% of its compiled peak (rerun with more --steps on an idle machine)",
        ),
        (
            # The README's main job on CPU: every_n:2 clearly slower than none, offload's compiled peak full's (it
            # moves nothing here), full leaner at a measured cost.
            [
                _timed("none", (1.0, 1.02, 1.04), 300),
                _timed("every_n:2", (1.05, 1.16, 1.30), 200),
                _timed("offload", (0.9, 0.95, 1.0), 100),
                _timed("full", (1.15, 1.2, 1.3), 100),
            ],
            "recommended: none (least compiled peak, 300 B, at the speed of the fastest within its 1000–1040 ms); "
            "for less memory: full (100 B, ×1.18 time); sure",
        ),
        (
            [_timed("none", (1.0, 1.02, 1.04), 300), _timed("every_n:2", (1.0, 1.16, 1.25), 200)],
            "recommended: every_n:2 (least compiled peak, 200 B, at the speed of the fastest within its 1000–1040 "
            "ms); unsure: its median is ×1.14 none's, beyond none's own range (rerun with more --steps on an idle "
            "machine)",
        ),
    ],
    ids=["full-free-sqrt_n-leaner", "full-costs-time", "noisy", "memory-tie", "offload-moves-nothing", "overlap-only"],
)
def test_recommendation_names_one_policy_and_how_sure(records, expected):
    assert bench.recommend(records, host_moves=False) == expected


def test_cli_writes_json_markdown_and_plot(tmp_path, capsys):
    out = {ext: tmp_path / f"bench.{ext}" for ext in ("json", "md", "png")}
    argv = ["bench", "--preset", "tiny", "--policies", "full", "--steps", "1", "--warmup", "0", "--in-process"]
    argv += ["--json", str(out["json"]), "--markdown", str(out["md"]), "--plot", str(out["png"])]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "none" in captured.out and "full" in captured.out and "Pareto front" in captured.out
    assert "[2/2] full: compiling" in captured.err  # progress
    data = json.loads(out["json"].read_text())
    assert data["command"].startswith("remat-kit bench") and "--preset tiny" in data["command"]
    assert [r["policy"] for r in data["records"]] == ["none", "full"]
    for record in data["records"]:
        assert set(record) >= REQUIRED and set(bench.RECORD_KEYS) <= set(record)
    assert out["md"].read_text().startswith("# remat-kit bench") and "| full |" in out["md"].read_text()
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worker_subprocess_reports_its_own_peak(tmp_path):
    job = {"policy": "full", "batch": 2, "seq": 16, "steps": 1, "warmup": 1, "loss_chunks": 0, "seed": 0}
    job |= {"learning_rate": 1e-3, "grads_path": str(tmp_path / "g.npz"), "config": dataclasses.asdict(CFG)}
    lines = []
    record = bench._run_worker(job, lines.append)
    # The probe's peak is the worker process's resident set in bytes (ru_maxrss is in KiB on Linux): a
    # process that imported JAX and compiled a step holds well over 50 MB; a unit slip would read ~1000x less.
    # (peak >= baseline is true by construction: the peak is a max that includes the baseline.)
    assert record["policy"] == "full" and record["peak_bytes"] > 50e6 and record["baseline_bytes"] > 50e6
    assert "compiling" in lines and (tmp_path / "g.npz").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--preset", "tiny", "--policies", "sometimes"], "unknown policy spec 'sometimes'"),
        (["--preset", "tiny", "--batch", "0"], "batch must be a positive integer"),
        (["--preset", "tiny", "--seq", "-3"], "seq must be a positive integer"),
        (["--preset", "tiny", "--seq", "4096"], "exceeds the model's max_seq_len"),
        (["--preset", "tiny", "--steps", "0"], "--steps must be >= 1"),
        (["--preset", "tiny", "--plot", "p.txt"], "cannot write a .txt picture"),
        (["--preset", "tiny", "--markdown", "/"], "is a directory"),
    ],
    ids=["preset", "policy", "batch", "seq", "seq_max", "steps", "plot_path", "md_dir"],
)
def test_bad_arguments_give_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_grad_check_can_be_skipped():
    records = bench.run_bench(CFG, 2, 16, ["full"], steps=1, warmup=0, subprocesses=False, grad_check=False)
    assert [r.max_grad_diff for r in records] == [None, None]
    assert records[1].loss_diff <= 1e-5 * abs(records[0].loss)  # the first step's loss, at the same parameters


def test_run_bench_rejects_bad_steps():
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        bench.run_bench(CFG, 2, 32, ["full"], steps=0)


def test_bench_over_a_mesh_matches_one_device():
    # Four simulated CPU devices (tests/conftest.py); temp bytes are then per device.
    single = bench.run_bench(CFG, 4, 16, ["full"], steps=1, warmup=0, subprocesses=False, grad_check=False)
    sharded = bench.run_bench(
        CFG, 4, 16, ["full"], steps=1, warmup=0, subprocesses=False, grad_check=False, mesh="data=2,fsdp=2"
    )
    for a, b in zip(single, sharded, strict=True):
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
        assert b.temp_bytes < a.temp_bytes


def test_cli_bench_model_factory(tmp_path, capsys):
    # A model remat_kit did not write (tests/plan_model_factory.py), its example inputs drawn from the seed.
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "plan_model_factory:factory", "--policies", "full", "--steps", "1", "--warmup", "0"]
    assert cli.main([*argv, "--in-process", "--json", str(out)]) == 0
    assert "XLA peak" in capsys.readouterr().out
    records = json.loads(out.read_text())["records"]
    assert [r["policy"] for r in records] == ["none", "full"]
    assert records[1]["max_grad_rel_diff"] <= 1e-5 and records[1]["xla_peak_bytes"] < records[0]["xla_peak_bytes"]


def test_gradient_note_only_above_float32_rounding():
    exact, off = _timed("full", (1.0,), 1), _timed("selective", (1.0,), 1)
    exact = dataclasses.replace(exact, max_grad_rel_diff=2.7e-8)
    off = dataclasses.replace(off, max_grad_rel_diff=6e-3)
    assert bench.grad_note([exact]) is None and bench.grad_note([_timed("x", (1.0,), 1)]) is None
    note = bench.grad_note([exact, off])
    assert note.startswith("selective: gradients differ from none's by up to 6.0e-03 relative")
    assert bench.EXACT_BF16_FLAGS in note and bench.EXACT_BF16_FLAGS in PLANNING_GUIDE.read_text()


# A bfloat16 chain in a float32 function: jit fuses it (keeping float32 between its ops unless told not
# to); op by op, each bfloat16 result is rounded. Prints their largest relative difference.
_BF16_PROBE = """
import jax, jax.numpy as jnp, numpy as np
x = jax.random.normal(jax.random.key(0), (4096,)) * 3
def f(x):
    hb = x.astype(jnp.bfloat16)
    return (hb * jnp.cos(hb) + jnp.sin(hb) * hb).astype(jnp.float32)
with jax.disable_jit():
    eager = np.asarray(f(x))
fused = np.asarray(jax.jit(f)(x))
print(float(np.max(np.abs(fused - eager)) / np.max(np.abs(eager))))
"""


@pytest.mark.integration
def test_exact_bf16_flag_makes_two_compilations_agree():
    import os
    import subprocess
    import sys

    def rel(flags):
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, "-c", _BF16_PROBE], env=env, capture_output=True, text=True, check=True)
        return float(out.stdout.split()[-1])

    assert rel(bench.EXACT_BF16_FLAGS.split("=", 1)[1]) == 0.0  # bit for bit with the documented flag
    assert rel("") > 1e-4  # XLA's default: the fused chain keeps excess precision (1.9e-3 on CPU, jax 0.10-0.12)
