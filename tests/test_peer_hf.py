"""benchmarks/peer_hf.py's figures: ratios per round, their median and range, the targets (no torch needed)."""

import dataclasses
import importlib.util
import io
import json
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "peer_hf.py"
_SPEC = importlib.util.spec_from_file_location("peer_hf", _PATH)
peer_hf = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("peer_hf", peer_hf)  # its dataclasses look their module up there
_SPEC.loader.exec_module(peer_hf)
Result = peer_hf.Result


def _run(framework, policy, rnd, step, peak=4_000_000_000, ok=True):
    return Result(framework, policy, ok, peak_rss=peak if ok else 0, step_time_s=step if ok else 0.0, round=rnd)


def test_ratios_pair_runs_of_the_same_round():
    # The machine slows down between rounds: each round's ratio is 0.9, the pooled medians would say 0.95.
    results = [
        _run("remat_kit", "none", 0, 9.0),
        _run("peer", "none", 0, 10.0),
        _run("remat_kit", "none", 1, 10.8),
        _run("peer", "none", 1, 12.0),
        _run("remat_kit", "none", 2, 13.5, peak=3_000_000_000),
        _run("peer", "none", 2, 15.0),
    ]
    (c,) = peer_hf.compare(results)
    assert c.time_ratios == pytest.approx((0.9, 0.9, 0.9))
    assert c.rk_step == 10.8 and c.peer_step == 12.0  # medians of the rounds' medians
    assert c.rk_peak == 4_000_000_000  # the largest over the rounds
    assert c.mem_ratios == pytest.approx((1.0, 1.0, 0.75))


def test_table_states_median_range_and_missed_targets():
    results = [
        _run("remat_kit", "none", 0, 9.0),
        _run("peer", "none", 0, 10.0),
        _run("remat_kit", "none", 1, 11.0),
        _run("peer", "none", 1, 10.0),
        _run("remat_kit", "full", 0, 12.0, peak=5_000_000_000),
        _run("peer", "full", 0, 10.0),
        _run("remat_kit", "full", 1, 12.0, peak=5_000_000_000),
        _run("peer", "full", 1, 10.0),
    ]
    rows = peer_hf.format_table(results)
    none = next(r for r in rows if r.startswith("none"))
    full = next(r for r in rows if r.startswith("full"))
    assert "1.000 (0.90-1.10)" in none and "time met" in none  # median 1.0 meets "<= 1"
    assert "1.200 (1.20-1.20)" in full and "mem MISSED, time MISSED" in full
    assert any("2 rounds" in r for r in rows)


def test_a_framework_that_cannot_run_a_policy_has_no_ratio():
    results = [_run("remat_kit", "offload", 0, 9.0), _run("peer", "offload", 0, 0.0, ok=False)]
    (c,) = peer_hf.compare(results)
    assert c.time_ratios == () and c.peer_peak == 0 and c.rk_step == 9.0
    row = next(r for r in peer_hf.format_table(results) if r.startswith("offload"))
    assert "n/a" in row and "met" not in row


def test_a_loss_chunks_variant_is_compared_with_the_same_peer_runs():
    results = [
        _run("remat_kit", "none", 0, 9.0),
        dataclasses.replace(_run("remat_kit", "none", 0, 8.0), loss_chunks=4),
        _run("peer", "none", 0, 10.0),
    ]
    plain, chunked = peer_hf.compare(results)
    assert (plain.label, plain.time_ratios) == ("none", (0.9,))
    assert (chunked.label, chunked.time_ratios) == ("none lc=4", (0.8,))
    assert any(r.startswith("none lc=4") for r in peer_hf.format_table(results))


def test_interleaved_runs_pair_each_turn_not_the_medians():
    # The machine slows down during the run: turn by turn remat_kit is 0.9x, its median step is not.
    rk = Result(
        "remat_kit", "none", True, peak_rss=3, step_time_s=10.8, step_times_s=(9.0, 10.8, 18.0), interleaved=True
    )
    peer = Result("peer", "none", True, peak_rss=4, step_time_s=12.0, step_times_s=(10.0, 12.0, 20.0), interleaved=True)
    (c,) = peer_hf.compare([rk, peer])
    assert c.time_ratios == pytest.approx((0.9, 0.9, 0.9)) and c.mem_ratios == pytest.approx((0.75,))
    rows = peer_hf.format_table([rk, peer])
    assert "0.900 (0.90-0.90)" in next(r for r in rows if r.startswith("none")) and any(
        "interleaved" in r for r in rows
    )


def test_a_serving_worker_steps_only_when_asked(capsys):
    calls = []
    turns = peer_hf._asked_turns(io.StringIO("step\nstep\ndone\nstep\n"))
    step = lambda: calls.append(len(calls)) or float(len(calls))
    times, first, _, _ = peer_hf._run_steps(step, 1, turns, peer_hf._report_step)
    out = capsys.readouterr().out.splitlines()
    assert len(calls) == 3 and len(times) == 2 and first == 1.0  # 1 warm-up + 2 asked; "done" ends it
    assert out[0] == "@ready" and [line.split()[0] for line in out[1:]] == ["@step", "@step"]


@pytest.mark.integration
def test_interleaved_workers_run_in_turn_and_one_that_fails_drops_out():
    # remat_kit workers only (no torch needed) at a tiny shape; an unknown policy fails before it is ready.
    model = dict(
        peer_hf.MODEL, vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, d_ff=64, max_seq_len=16
    )
    job = dict(framework="remat_kit", model=model, threads=1, batch=1, seq=16, steps=2, warmup=1, loss_chunks=0)
    policies = ("none", "no-such-policy", "full")
    jobs = [(dict(job, policy=p), sys.executable) for p in policies]
    none, bad, full = peer_hf.run_interleaved(jobs, threads=1, steps=3, pause_s=0.0)
    for r in (none, full):
        assert r.ok and r.interleaved and len(r.step_times_s) == 3
        assert r.peak_rss > 0 and r.step_peak_rss >= r.baseline_rss > 0
    assert none.loss == pytest.approx(full.loss, rel=1e-6)  # the same model and batch under two policies
    assert not bad.ok and "no-such-policy" in bad.error and bad.step_times_s == ()


def test_workers_pin_themselves_so_the_parent_never_forks_with_threads():
    cmd = peer_hf._worker_command({"framework": "peer", "policy": "none"}, sys.executable, threads=1)
    job = json.loads(cmd["args"][-1])
    assert "preexec_fn" not in cmd and len(job["cores"]) == 1 and cmd["env"]["OMP_NUM_THREADS"] == "1"


def test_the_default_fused_variant_is_what_auto_picks_at_the_issues_shape():
    from remat_kit.model.loss import auto_chunks

    tokens = peer_hf.FULL["batch"] * peer_hf.FULL["seq"]
    assert peer_hf.DEFAULT_LOSS_CHUNKS == auto_chunks(tokens, peer_hf.MODEL["vocab_size"]) == 4
