"""benchmarks/peer_hf.py's figures: ratios per round, their median and range, the targets (no torch needed)."""

import dataclasses
import importlib.util
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
