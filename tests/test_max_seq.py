"""remat_kit.max_seq: the longest sequence whose compiled step fits, found at its edge, on unedited models."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
import unedited_models as um
from flax import nnx

import remat_kit
from remat_kit import policies
from remat_kit.planning import max_seq as max_seq_lib
from remat_kit.planning.planner import StepPlanner

pytestmark = pytest.mark.onejax  # orchestration over compiles: the default JAX only (pyproject)

D = 16


def _linen():
    model = um.InlineModel(num_layers=4, features=D, alternate=False)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((1, 8, D))))
    args_at = lambda seq: (variables, jax.ShapeDtypeStruct((1, seq, D), jnp.float32))
    return model, (lambda m, v, x: jnp.mean(m.apply(v, x) ** 2)), args_at


def _nnx():
    model = um.NnxModel(num_layers=4, d=D, alternate=False, rngs=nnx.Rngs(0))
    args_at = lambda seq: (jax.ShapeDtypeStruct((1, seq, D), jnp.float32),)
    return model, (lambda m, x: jnp.mean(m(x, deterministic=True) ** 2)), args_at


def _independent_need(model, loss, args_at, seq, levers):
    """The step's need at ``seq`` under ``levers``, compiled by a planner of its own (not the search's)."""
    kwargs = {k: getattr(levers, k) for k in ("query_blocks", "seq_tiles") if getattr(levers, k) != 1}
    make = remat_kit.apply_factory(model, loss, scan=levers.scan, **kwargs)
    args = args_at(seq)
    if isinstance(model, nnx.Module):
        params, batch = nnx.state(model, nnx.Param), args
    else:
        params, batch = args[0], args[1:]
    planner = StepPlanner(lambda p, b, s: (make(p), params, batch))
    return planner.memory(policies.full())[0]


@pytest.mark.parametrize("make", [_linen, _nnx], ids=["linen", "nnx"])
def test_the_answer_fits_and_the_next_step_does_not(make):
    model, loss, args_at = make()
    budget = 3_000_000
    r = remat_kit.max_seq(model, loss, args_at, budget=budget, step=64, limit=8192, margin=0.1)
    assert r.seq > 0 and r.seq % 64 == 0 and r.next_seq == r.seq + 64
    assert r.levers.policy == "full" and r.levers.scan
    assert r.need_bytes * 1.1 <= budget < r.next_need_bytes * 1.1
    # The edge, compiled again by a planner that shares nothing with the search.
    assert _independent_need(model, loss, args_at, r.seq, r.levers) * 1.1 <= budget
    assert _independent_need(model, loss, args_at, r.seq + 64, r.levers) * 1.1 > budget
    assert dict(r.needs)[r.seq] == r.need_bytes and r.compiles == len(r.needs)
    assert "longest sequence" in r.summary() and "levers: full, scan" in r.summary()


def test_the_plain_model_reaches_less_than_the_levers():
    model, loss, args_at = _linen()
    kw = dict(budget=3_000_000, step=64, limit=8192, query_blocks=1, seq_tiles=1, loss_chunks=0)
    plain = remat_kit.max_seq(model, loss, args_at, policy="none", scan=False, **kw)
    full = remat_kit.max_seq(model, loss, args_at, **kw)
    assert plain.levers.plain and "the model as given" in plain.levers.describe()
    assert 0 < plain.seq < full.seq


def test_a_loss_with_a_loss_chunks_keyword_gets_it():
    model, loss, args_at = _linen()
    seen = []

    def chunked(m, v, x, *, loss_chunks):
        seen.append(loss_chunks)
        return loss(m, v, x)

    one = dict(budget="1GB", step=64, limit=64)  # one length, one compile
    r = remat_kit.max_seq(model, chunked, args_at, loss_chunks=4, **one)
    assert r.levers.loss_chunks == 4 and set(seen) == {4} and r.compiles == 1
    off = remat_kit.max_seq(model, chunked, args_at, loss_chunks=0, **one)  # off: the loss is told 0
    assert off.levers.loss_chunks == 0 and seen[-1] == 0 and "the loss as given" in off.levers.describe()
    r = remat_kit.max_seq(model, loss, args_at, **one)
    assert r.levers.loss_chunks == 0 and any(u.startswith("loss_chunks") for u in r.unavailable)


def test_nothing_fits_is_seq_zero_with_the_first_need():
    model, loss, args_at = _linen()
    r = remat_kit.max_seq(model, loss, args_at, budget=10_000, step=64, limit=1024)
    assert r.seq == 0 and r.need_bytes is None and r.next_seq == 64 and r.next_need_bytes * 1.1 > 10_000
    assert r.summary().startswith("nothing fits")


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"budget": "-1GB"}, ValueError, "budget"),
        ({"budget": 1.5}, TypeError, "budget"),
        ({"step": 0}, ValueError, "step must be"),
        ({"limit": 100, "step": 64}, ValueError, "limit 100 must be a multiple of step 64"),
        ({"start": 65, "step": 64}, ValueError, "start must be"),
        ({"query_blocks": 0}, ValueError, "query_blocks must be 'auto' or an integer >= 1"),
        ({"seq_tiles": "many"}, ValueError, "seq_tiles must be"),
        ({"loss_chunks": 3}, ValueError, "loss_chunks=3: loss_fn takes no loss_chunks keyword"),
        ({"offload": True}, ValueError, "offload=True"),
        ({"offload": "yes"}, TypeError, "offload must be"),
        ({"scan": None}, TypeError, "scan must be True or False"),
        ({"policy": "fully"}, ValueError, "fully"),
        ({"optimizer": "adamx"}, ValueError, "adamx"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(v),
)
def test_bad_input_is_one_line_before_any_compile(monkeypatch, kwargs, error, words):
    model, loss, args_at = _linen()
    monkeypatch.setattr(StepPlanner, "compiled_memory", lambda *a, **k: pytest.fail("compiled"))
    kwargs = {"budget": "1GB", **kwargs}
    with pytest.raises(error, match=words.replace("(", r"\(")):
        remat_kit.max_seq(model, loss, args_at, **kwargs)


def test_bad_model_loss_and_args_are_type_errors(monkeypatch):
    model, loss, args_at = _linen()
    monkeypatch.setattr(StepPlanner, "compiled_memory", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(TypeError, match="Module instance"):
        remat_kit.max_seq(object(), loss, args_at, budget="1GB")
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        remat_kit.max_seq(model, None, args_at, budget="1GB")
    with pytest.raises(TypeError, match=r"args_at must be callable"):
        remat_kit.max_seq(model, loss, (1, 2), budget="1GB")
    with pytest.raises(TypeError, match=r"args_at\(256\) must return a tuple"):
        remat_kit.max_seq(model, loss, lambda s: None, budget="1GB")
    with pytest.raises(TypeError, match="NNX convention"):
        remat_kit.max_seq(model, loss, lambda s: (jnp.ones((1, s, D)),), budget="1GB")


def test_a_count_for_a_lever_this_apply_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(max_seq_lib, "_apply_levers", lambda: frozenset())
    model, loss, args_at = _linen()
    with pytest.raises(ValueError, match="seq_tiles=4: this remat_kit's apply has no seq_tiles"):
        remat_kit.max_seq(model, loss, args_at, budget="1GB", seq_tiles=4)
    levers, unavailable = max_seq_lib.resolve_levers(
        model,
        loss,
        policy="full",
        scan=True,
        query_blocks="auto",
        seq_tiles="auto",
        loss_chunks=0,
        offload=None,
        step=256,
        target=None,
    )
    assert (levers.query_blocks, levers.seq_tiles) == (1, 1)
    assert [u.split(":")[0] for u in unavailable] == ["query_blocks", "seq_tiles", "offload"]


def test_the_levers_this_apply_has_are_on_by_default():
    model, loss, _ = _linen()
    levers, _ = max_seq_lib.resolve_levers(
        model,
        loss,
        policy="full",
        scan=True,
        query_blocks="auto",
        seq_tiles="auto",
        loss_chunks="auto",
        offload=None,
        step=256,
        target=None,
    )
    has = max_seq_lib._apply_levers()
    assert {k for k in ("query_blocks", "seq_tiles") if getattr(levers, k) == "auto"} == has


def test_cli_plan_max_seq_model_runs_the_same_engine(tmp_path, capsys):
    from remat_kit import cli

    out = tmp_path / "edges.json"
    argv = ["plan", "--model", "tests.unedited_models:max_seq_factory", "--max-seq", "8192", "--seq-step", "64"]
    argv += ["--budget", "3MB", "--json", str(out)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "levers: full, scan" in captured.out and "longest " in captured.out
    assert "[max-seq] " in captured.err  # progress on stderr
    report = json.loads(out.read_text())
    model, loss, args_at = um.max_seq_factory()
    want = remat_kit.max_seq(model, loss, args_at, budget="3MB", step=64, limit=8192)
    (edge,) = report["edges"]
    assert (edge["seq"], edge["need_bytes"], edge["next_need_bytes"]) == (
        want.seq,
        want.need_bytes,
        want.next_need_bytes,
    )
    assert report["levers"]["policy"] == "full" and report["unavailable"] == list(want.unavailable)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--policies", "full,none"], "--max-seq with --model takes one policy"),
        (["--query-blocks", "0"], "query_blocks must be 'auto' or an integer >= 1"),
        (["--loss-chunks", "3"], "loss_chunks=3: loss_fn takes no loss_chunks keyword"),
    ],
    ids=["policies", "query-blocks", "loss-chunks"],
)
def test_cli_plan_max_seq_model_bad_values_one_line(extra, words, capsys, monkeypatch):
    from remat_kit import cli

    monkeypatch.setattr(StepPlanner, "compiled_memory", lambda *a, **k: pytest.fail("compiled"))
    argv = ["plan", "--model", "tests.unedited_models:max_seq_factory", "--max-seq", "--budget", "1GB", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_cli_query_blocks_goes_with_max_seq_model(capsys):
    from remat_kit import cli

    assert cli.main(["plan", "--preset", "tiny", "--query-blocks", "2"]) == 2
    assert "--query-blocks goes with --max-seq --model" in capsys.readouterr().err
