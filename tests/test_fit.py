"""remat_kit.fit: one call from a model and a budget to a model that fits, chosen per tensor from its own names."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import remat_kit
from remat_kit import _jax_internals, cli, policies
from remat_kit.model.loss import lm_loss
from remat_kit.model.transformer import Transformer, TransformerConfig
from remat_kit.planning import analysis, engine, solve, tensors
from remat_kit.planning import fit as fit_lib
from remat_kit.planning.builtin import Planner
from remat_kit.planning.planner import DEFAULT_MARGIN, Budget, StepPlanner
from remat_kit.unedited import guard
from tests import unedited_models as um

RTOL = 1e-5  # float32 gradients


def _never(*_):
    raise AssertionError("the loss was traced: the budget should have been refused first")


@pytest.mark.parametrize(
    "budget", ["-1GB", "abc", 0, -5, True, 1.5], ids=["negative", "text", "zero", "neg-int", "bool", "float"]
)
def test_a_bad_budget_is_one_line_before_anything_is_traced(budget):
    model = um.NnxModel(2, 8, alternate=False, rngs=nnx.Rngs(0))
    with pytest.raises((ValueError, TypeError)) as err:
        remat_kit.fit(model, _never, jnp.ones((2, 4, 8)), budget=budget)
    assert "\n" not in str(err.value) and re.search(r"budget|memory size", str(err.value))


def test_a_bad_model_or_loss_is_one_line():
    with pytest.raises(TypeError, match=r"fit takes a flax\.linen or flax\.nnx Module instance"):
        remat_kit.fit(object(), _never, jnp.ones(2), budget="1GB")
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        remat_kit.fit(um.NnxModel(2, 8, rngs=nnx.Rngs(0)), None, jnp.ones(2), budget="1GB")


# ---- the three kinds of model ------------------------------------------------------------------------------------


def _nnx():
    model = um.NnxModel(num_layers=4, d=16, alternate=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 32, 16))
    loss = lambda m, x: jnp.mean(m(x, True) ** 2)

    def grads(m):
        return nnx.grad(loss)(m, x)

    build = lambda scan: (
        lambda p, b, s: (
            remat_kit.apply_factory(model, loss, scan=scan)(p),
            nnx.state(model, nnx.Param),
            (x,),
        )
    )
    return model, loss, (x,), grads, build


def _linen():
    model = um.InlineModel(num_layers=4, features=16, alternate=False)
    x = jax.random.normal(jax.random.key(1), (4, 32, 16))
    variables = model.init(jax.random.key(0), x)
    loss = lambda m, v, x: jnp.mean(m.apply(v, x) ** 2)
    grads = lambda m: jax.grad(lambda v: loss(m, v, x))(variables)
    build = lambda scan: lambda p, b, s: (remat_kit.apply_factory(model, loss, scan=scan)(p), variables, (x,))
    return model, loss, (variables, x), grads, build


def _builtin():
    cfg = TransformerConfig.preset("tiny", num_layers=4)
    model = Transformer(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
    params = model.init(jax.random.key(0), tokens)["params"]
    loss = lambda m, p, t: lm_loss(m, p, t)
    grads = lambda m: jax.grad(lambda p: loss(m, p, tokens))(params)
    build = lambda _scan: lambda p, b, s: ((lambda v, t: loss(model.clone(policy=p), v, t)), params, (tokens,))
    return model, loss, (params, tokens), grads, build


MODELS = {"nnx-unedited": _nnx, "linen-unedited": _linen, "builtin-tiny": _builtin}


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def case(request):
    model, loss, args, grads, build = MODELS[request.param]()
    # `none` of the model as given (its own loop, unscanned), `full` of its blocks scanned (the lean end)
    ends = {s: StepPlanner(build(s == "full")).memory(policies.parse(s))[0] for s in ("none", "full")}
    return model, loss, args, grads, ends


def test_between_full_and_none_fit_plans_a_remat_that_fits_and_keeps_the_gradients(case):
    model, loss, args, grads, ends = case
    assert ends["full"] < ends["none"]
    budget = int((ends["full"] + ends["none"]) / 2 * (1 + DEFAULT_MARGIN))
    r = remat_kit.fit(model, loss, *args, budget=budget)
    assert r.policy != "none"
    assert r.need_bytes * (1 + DEFAULT_MARGIN) <= budget
    assert str(policies.parse(r.policy)) == r.policy  # the spec round-trips
    assert r.est_step_time_s > 0 and r.choice.compiles <= fit_lib.MAX_COMPILES
    assert any(c.policy == r.policy and c.need_bytes == r.need_bytes for c in r.candidates)
    assert f"*{r.policy}" in r.table()
    plain, planned = grads(model), grads(r.model)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(planned), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=RTOL, atol=1e-7)


def test_a_comfortable_budget_keeps_everything_with_one_compile(case):
    model, loss, args, _, ends = case
    r = remat_kit.fit(model, loss, *args, budget=ends["none"] * 2)
    assert r.policy == "none" and r.need_bytes == ends["none"] and r.choice.compiles == 1


def test_an_impossible_budget_is_a_one_line_refusal_with_the_least_need_and_the_levers(case):
    model, loss, args, _, ends = case
    with pytest.raises(fit_lib.NothingFits) as err:
        remat_kit.fit(model, loss, *args, budget=ends["full"] // 2)
    text = str(err.value)
    assert "\n" not in text and text.startswith("nothing fits") and "LoRA" in text and "mesh" in text
    # The built-in model tries sequence tiles too (4 at 2 x 32: nothing fits there, so 2 is not tried); fit inserts
    # none into a user's model.
    assert ("nor in 4 sequence tiles" in text) == isinstance(model, Transformer)
    assert err.value.need_bytes <= ends["full"]


def test_group_names_keeps_the_outermost_name_of_one_value():
    emitted = {"a/q/kernel": 8, "a/q": 8, "a/o/kernel": 8, "a/o": 8, "a": 8, "norm": 8, "mlp/w": 32}
    assert fit_lib.group_names(emitted) == ((("a/q",), 8), (("a",), 8), (("norm",), 8), (("mlp/w",), 32))


def test_a_value_the_backward_pass_never_needs_costs_no_bytes_and_no_seconds():
    """The block's last matmul, added to the residual stream, is no residual: keeping it would change nothing."""
    from jax.ad_checkpoint import checkpoint_name

    def block(x, w1, w2):
        x = checkpoint_name(x, "layer_input")  # the block's own input: every remat keeps it already
        h = checkpoint_name(jnp.tanh(checkpoint_name(x @ w1, "up")), "act")
        return x + checkpoint_name(h @ w2, "down")

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    body = _jax_internals.remat_body(jax.make_jaxpr(remat_kit.policies.full().checkpoint(block))(x, w, w).eqns[0])
    assert engine.needed_names(body, ["layer_input", "up", "act", "down"]) == {"layer_input", "up", "act"}
    assert engine.given_names(body) == {"layer_input"}
    hardware = remat_kit.planning.cost.default_hardware("cpu")
    priced = {v.name: v for v in engine.price_block(body, 1, hardware).values}
    assert priced["down"].nbytes == priced["layer_input"].nbytes == 0 and priced["down"].recompute_s == 0.0
    assert priced["up"].nbytes == priced["act"].nbytes == 4 * 8 * 4 and priced["up"].recompute_s > 0
    # Where the slope is calibrated over all names (the built-in model), every name keeps its bytes.
    every = {v.name: v.nbytes for v in engine.price_block(body, 1, hardware, needed_only=False).values}
    assert every == dict.fromkeys(["layer_input", "up", "act", "down"], 4 * 8 * 4)


@pytest.mark.onejax  # the plan command over many compiles (pyproject)
def test_plan_budget_and_fit_agree_on_the_built_in_model(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--preset", "tiny", "--budget", "5.2MB", "--limits", "none", "--no-progress", "--json", str(out)]
    assert cli.main(argv) == 0
    chosen = json.loads(out.read_text())["chosen"]
    assert f"chosen: {chosen}" in capsys.readouterr().out
    cfg = TransformerConfig.preset("tiny")
    model = Transformer(cfg)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, 32), jnp.int32))["params"])
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    r = remat_kit.fit(model, lambda m, p, t: lm_loss(m, p, t), params, tokens, budget="5.2MB")
    assert r.policy == chosen != "none"


def test_auto_answers_with_the_engines_choice_beside_its_table():
    # auto is a front: its table's rows stay, its answer is the engine's, the engine's compiled plans become rows.
    from remat_kit.planning.budget import AutoResult, Candidate
    from remat_kit.planning.engine import Choice

    rows = (Candidate("none", 10, 0, 100, 0, False), Candidate("full", 12, 2))  # full priced, not compiled
    table = AutoResult(None, 90, 0.0, None, None, 0, "adamw", rows, "the table's reason", 1, 1.0)
    engine_rows = (Candidate("full", 12, 2, 50, 0, True), Candidate("selective:a", 11, 1, 80, 0, True))
    choice = Choice(policies.parse("selective:a"), 80, 1.0, engine_rows, Budget(90, 0.0), 2, 2.0, "the engine's")
    r = fit_lib.with_choice(table, choice)
    assert (str(r.chosen), r.reason, r.compiled, r.seconds) == ("selective:a", "the engine's", 3, 3.0)
    assert [(c.policy, c.need_bytes, c.fits) for c in r.candidates] == [
        ("none", 100, False),
        ("full", 50, True),
        ("selective:a", 80, True),
    ]
    same = fit_lib.with_choice(dataclasses.replace(table, chosen=policies.parse("selective:a")), choice)
    assert same.reason == "the table's reason"  # the same plan: the table's own words stay


# ---- the generic path loads no built-in model ------------------------------------------------------------------

#: auto and fit on a user's own loss and model, in a fresh interpreter; prints the remat_kit wings then loaded.
_USER_ONLY = """
import sys
import jax, jax.numpy as jnp
from remat_kit import policies
from remat_kit.names import tag
from remat_kit.planning import budget, engine, planner

def make_loss(p):
    layer = lambda w, x: jnp.tanh(tag(x @ w, "act"))
    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (p(layer)(w, h), None), x, ws)
        return jnp.sum(h ** 2)
    return loss

ws, x = jax.ShapeDtypeStruct((2, 8, 8), jnp.float32), jax.ShapeDtypeStruct((2, 8), jnp.float32)
pl = planner.StepPlanner(lambda p, b, s: (make_loss(p), ws, (x,)))
assert budget.search(pl, [policies.none(), policies.full()], planner.Budget(10**9)).chosen is not None
assert engine.plan(pl, planner.Budget(10**9)).chosen is not None
print(" ".join(sorted(m for m in sys.modules if m.split(".")[:2] in (["remat_kit", "model"], ["remat_kit", "train"]))))
"""


def test_the_generic_engine_on_a_user_loss_loads_no_built_in_model_or_training():
    # The engine and the pool search import nothing of the built-in model; the entry (remat_kit.fit, remat_kit.auto)
    # sits above both the engine and the built-in model's planning, so it loads that at import (no late import).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _USER_ONLY], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [], f"the generic path loaded {out.stdout.strip()}"


# ---- sequence tiles, a lever when nothing fits untiled -----------------------------------------------------------

TILE_CFG = TransformerConfig.preset("tiny", max_seq_len=64)
TILE_SHAPE = {"batch": 2, "seq": 64}  # 128 tokens: the smallest shape where 4 tiles shrink full's step


@pytest.fixture(scope="module")
def tile_planners():
    untiled, tiled = Planner(TILE_CFG), Planner(dataclasses.replace(TILE_CFG, seq_tiles=4))
    full = policies.full()
    needs = {k: p.memory(full, **TILE_SHAPE)[0] for k, p in ((1, untiled), (4, tiled))}
    return untiled, tiled, needs


def _tile_choice(tile_planners, budget):
    untiled, tiled, _ = tile_planners
    return tensors.config_choice(
        TILE_CFG,
        Budget(budget),
        **TILE_SHAPE,
        planner=untiled,
        presets=[policies.full()],
        tiles=(4,),
        retile=lambda k: tiled,
    )


def test_a_budget_only_tiles_fit_plans_tiles_and_the_compiled_tiled_step_fits(tile_planners):
    _, _, needs = tile_planners
    assert needs[4] < needs[1]  # 4 tiles shrink full's recompute working set
    budget = int((needs[4] + needs[1]) / 2 * (1 + DEFAULT_MARGIN))
    choice = _tile_choice(tile_planners, budget)
    assert (str(choice.chosen), choice.seq_tiles, choice.need_bytes) == ("full", 4, needs[4])
    rows = {(c.policy, c.seq_tiles): c for c in choice.candidates}
    assert not rows[("full", 1)].fits and rows[("full", 4)].fits
    assert rows[("full", 4)].tiles_s > 0 and rows[("full", 4)].cost_s > rows[("full", 1)].cost_s  # tiles cost time
    assert "in 4 sequence tiles" in choice.reason and "*full @4 tiles" in choice.table()
    # The step train compiles at that plan (its own compile, LLVM's usual optimization) fits the budget too.
    compiled, _ = analysis.analyze_compiled(dataclasses.replace(TILE_CFG, seq_tiles=4), "full", **TILE_SHAPE)
    assert compiled.peak_bytes * (1 + DEFAULT_MARGIN) <= budget


def test_a_budget_that_fits_untiled_tries_no_tiles(tile_planners):
    _, _, needs = tile_planners
    choice = _tile_choice(tile_planners, int(needs[1] * (1 + DEFAULT_MARGIN)) + 1)
    assert (str(choice.chosen), choice.seq_tiles) == ("full", 1)
    assert all(c.seq_tiles == 1 for c in choice.candidates)  # tiles only cost time here: none were compiled


def test_tiles_that_do_not_divide_the_sequence_are_one_line_before_any_compile():
    with pytest.raises(ValueError, match="tiles=3 does not divide the sequence length 64") as err:
        tensors.config_choice(TILE_CFG, Budget(10**6), **TILE_SHAPE, tiles=(3,), planner=StepPlanner(_never))
    assert "\n" not in str(err.value)


def test_of_the_tile_counts_that_fit_the_one_with_fewest_trips_wins(tile_planners):
    untiled, tiled, needs = tile_planners
    tiled8 = Planner(dataclasses.replace(TILE_CFG, seq_tiles=8))
    budget = int(needs[4] * 1.01 * (1 + DEFAULT_MARGIN))  # nothing untiled fits; full in 4 or 8 tiles does
    choice = tensors.config_choice(
        TILE_CFG,
        Budget(budget),
        **TILE_SHAPE,
        planner=untiled,
        presets=[policies.full()],
        tiles=(4, 8),
        retile=lambda k: {4: tiled, 8: tiled8}[k],
    )
    rows = {(c.policy, c.seq_tiles): c for c in choice.candidates}
    assert rows[("full", 8)].fits and rows[("full", 4)].fits
    assert rows[("full", 8)].cost_s > rows[("full", 4)].cost_s  # twice the tiles, more loop trips
    assert (str(choice.chosen), choice.seq_tiles) == ("full", 4)


# ---- the exact solver ----------------------------------------------------------------------------------------------


def _pool(seed: int, n: int, offload: bool):
    """A small pool of named values with random bytes and prices (offload priced where ``offload``)."""
    rng = np.random.default_rng(seed)
    return [
        solve.Value(
            f"v{i}",
            int(rng.integers(1, 9)) * 64,
            float(rng.uniform(0.1, 2.0)),
            float(rng.uniform(0.5, 3.0)) if offload else None,
        )
        for i in range(n)
    ]


def _exhaustive(values, layers: int, capacity: float, base_s: float) -> float | None:
    """The least cost over every assignment of every value of every layer (keep / recompute / offload)."""
    choices = []
    for v in values:
        opts = [(0, v.recompute_s), (v.nbytes, 0.0)] + ([(0, v.offload_s)] if v.offload_s is not None else [])
        choices.append(opts)
    per_layer = [(sum(b for b, _ in combo), base_s + sum(c for _, c in combo)) for combo in itertools.product(*choices)]
    best = None
    for plan in itertools.product(per_layer, repeat=layers):
        if sum(b for b, _ in plan) <= capacity:
            total = sum(c for _, c in plan)
            best = total if best is None or total < best else best
    return best


@pytest.mark.parametrize(
    "seed, n, layers, offload",
    [(0, 3, 3, False), (1, 4, 2, False), (2, 3, 2, True), (3, 2, 4, True), (4, 4, 3, False)],
    ids=["3x3", "4x2", "3x2-offload", "2x4-offload", "4x3"],
)
def test_the_solver_finds_the_exhaustive_optimum(seed, n, layers, offload):
    values, base_s = _pool(seed, n, offload), 0.05
    front = solve.layer_front(values, base_s=base_s)
    total = sum(v.nbytes for v in values) * layers
    for capacity in (0, total // 5, total // 3, total // 2, 2 * total // 3, total):
        plan = solve.solve([front] * layers, capacity)
        want = _exhaustive(values, layers, capacity, base_s)
        assert plan is not None and want is not None
        assert sum(o.nbytes for o in plan) <= capacity
        assert sum(o.cost_s for o in plan) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_the_uniform_solver_finds_the_best_single_option():
    values = _pool(5, 4, False)
    front = solve.layer_front(values)
    total = sum(v.nbytes for v in values)
    for capacity in (0, total, 2 * total, 3 * total):
        plan = solve.solve([front] * 3, capacity, uniform=True)
        assert len({o for o in plan}) == 1
        fitting = [o for o in front if 3 * o.nbytes <= capacity]
        assert plan[0].cost_s == min(o.cost_s for o in fitting)


def test_the_two_part_solver_finds_the_best_uniform_plan_or_mix_of_two():
    values = _pool(6, 4, False)
    front = solve.layer_front(values)
    layers, total = 5, sum(v.nbytes for v in values) * 5
    for capacity in (0, total // 4, total // 2, total):
        plan = solve.solve([front] * layers, capacity, parts=2)
        assert len(set(plan)) <= 2 and solve.plan_bytes(plan) <= capacity
        best = min(
            a.cost_s * k + b.cost_s * (layers - k)
            for a in front
            for b in front
            for k in range(layers + 1)
            if solve.plan_bytes([a] * k + [b] * (layers - k)) <= capacity
        )
        assert sum(o.cost_s for o in plan) == pytest.approx(best, rel=1e-12)


def test_progress_and_the_log_say_each_phase(caplog):
    model = um.InlineModel(num_layers=2, features=16, alternate=False)
    x = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape)))
    lines, loss = [], lambda m, v, x: jnp.mean(m.apply(v, x) ** 2)
    with caplog.at_level("INFO", logger="remat_kit.fit"):
        r = remat_kit.fit(model, loss, variables, x, budget="1GB", progress=lines.append)
    assert r.policy == "none" and r.compiles == 1 and r.model is model  # the model as given, untouched
    assert lines[0].startswith("compiling the model as given (none) (1 of at most 3)")
    assert [rec.getMessage() for rec in caplog.records if rec.name == "remat_kit.fit"] == lines


def test_a_compile_waited_on_returns_its_value_or_raises_its_error():
    from remat_kit.planning import engine

    assert engine.Background(lambda a, b: a + b, 2, 3).result() == 5
    with pytest.raises(ZeroDivisionError):
        engine.interruptible(lambda: 1 / 0)


@pytest.mark.parametrize(
    "none, full, named, same, slope",
    [(150, 100, 100, True, 0.55), (150, 100, 100, False, 1.0), (300, 100, 100, True, 1.0), (101, 100, 1000, True, 0.1)],
    ids=["calibrated", "plain-loop", "capped-at-1", "floored"],
)
def test_the_memory_slope_is_calibrated_on_none_only_on_the_same_stack(none, full, named, same, slope):
    from remat_kit.planning import engine

    assert engine._slope(none, full, named, same) == pytest.approx(slope)


def test_an_unedited_model_gets_query_blocks_and_tiles_when_nothing_fits_without_them():
    """Issue 48: fit prices apply's long-context levers (no code edited) when no plan fits the model as written."""
    seq = 4096  # query_blocks="auto" cuts 4,096 queries into 4 blocks; at 1,024 it would leave them whole
    model = um.InlineModel()
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((2, 8, 8))))
    x = jax.ShapeDtypeStruct((2, seq, 8), jnp.float32)
    loss = lambda m, v, x: jnp.mean(m.apply(v, x) ** 2)
    lines: list[str] = []
    r = remat_kit.fit(model, loss, variables, x, budget="300MB", progress=lines.append)
    assert r.long == fit_lib.LONG_LEVERS
    assert r.need_bytes * (1 + DEFAULT_MARGIN) <= 300e6
    assert any("nothing fits as written" in line for line in lines)
    assert r.model.plan.long is not None  # the model returned runs under the levers
    # Nothing fits even so: the refusal names the levers' leanest plan (0.14 GB), not full as written (0.86 GB).
    with pytest.raises(fit_lib.NothingFits, match=r"the leanest plan, full, needs 0\.1\d GB"):
        remat_kit.fit(model, loss, variables, x, budget="150MB")


@pytest.mark.parametrize("name", ["nnx-unedited", "linen-unedited"])
def test_the_model_as_given_is_compiled_as_written_without_apply(name, monkeypatch):
    """fit's first compile is the user's own step: apply (its discovery and guard traces) builds only the stack."""
    model, loss, args, _, _ = MODELS[name]()
    seen = {}
    real_plan = fit_lib.engine.plan
    monkeypatch.setattr(
        fit_lib.engine, "plan", lambda *a, **k: seen.setdefault("plain", k["plain"]) and real_plan(*a, **k)
    )
    r = remat_kit.fit(model, loss, *args, budget="1GB")
    assert r.policy == "none" and r.compiles == 1 and r.model is model
    monkeypatch.setattr(fit_lib.unedited_lib, "apply", lambda *a, **k: pytest.fail("apply on the as-given path"))
    fresh = StepPlanner(seen["plain"].build)  # the same build, traced and compiled anew with apply unavailable
    assert fresh.memory(policies.none())[0] == r.need_bytes


def test_fit_verifies_the_stack_once_and_later_candidates_take_the_verdict(monkeypatch):
    """Within fit the guard runs on the stack's first policy only (guard.verified_once); its answer still compiles."""
    model, loss, args, _, build = _linen()
    ends = {s: StepPlanner(build(s == "full")).memory(policies.parse(s))[0] for s in ("none", "full")}
    checked = []
    real = guard._verify
    monkeypatch.setattr(guard, "_verify", lambda *a, **k: checked.append(str(a[3])) or real(*a, **k))
    r = remat_kit.fit(model, loss, *args, budget=int((ends["full"] + ends["none"]) / 2 * (1 + DEFAULT_MARGIN)))
    assert r.compiles == 3 and r.policy not in ("none", "full")
    assert checked == ["full"]
    remat_kit.apply(model, r.policy, scan=True).apply(*args)  # outside fit, a new applied model is verified
    assert checked == ["full", r.policy]


# ---- an unedited stack calibrates on full's gradient: full's step is compiled only where it is the answer ------

GRADIENT_TOLERANCE = 0.02  # the gradient-plus-state estimate against the step's compiled need (measured 0.9 % under)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_full_s_gradient_and_the_optimizer_state_estimate_the_step(kind):
    """Within 2 % where activations outweigh the parameters (6 blocks, d=64, 8 x 128: benchmarks/fit.py's models);
    the update's own temporaries, left out, are some 5 % of a model a few kB wide."""
    x = jax.ShapeDtypeStruct((8, 128, 64), jnp.float32)
    if kind == "nnx":
        model = um.NnxModel(6, 64, alternate=False, rngs=nnx.Rngs(0))
        loss = lambda m, x: jnp.mean(m(x, True) ** 2)
        build = lambda p, b, s: (remat_kit.apply_factory(model, loss, scan=True)(p), nnx.state(model, nnx.Param), (x,))
    else:
        model = um.InlineModel(num_layers=6, features=64, alternate=False)
        variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape)))
        loss = lambda m, v, x: jnp.mean(m.apply(v, x) ** 2)
        build = lambda p, b, s: (remat_kit.apply_factory(model, loss, scan=True)(p), variables, (x,))
    planner = StepPlanner(build)
    assert planner.gradient_calibrates
    estimate, uncertainty = planner.gradient_need(planner.lower_gradient(policies.full()))
    assert planner.compiles == 1
    step = planner.memory(policies.full())[0]
    assert abs(estimate - step) <= GRADIENT_TOLERANCE * step
    assert estimate <= step <= estimate + uncertainty  # the update's temporaries, within the parameters' bytes
    with_sgd = StepPlanner(build, optimizer="sgd")  # no moments: the state's bytes are the difference
    assert with_sgd.gradient_need(with_sgd.lower_gradient(policies.full()))[0] < estimate


def test_an_unedited_fit_compiles_full_only_where_it_is_the_answer():
    model, loss, args, _, build = _linen()
    ends = {s: StepPlanner(build(s == "full")).memory(policies.parse(s))[0] for s in ("none", "full")}
    lines: list[str] = []
    between = int((ends["full"] + ends["none"]) / 2 * (1 + DEFAULT_MARGIN))
    r = remat_kit.fit(model, loss, *args, budget=between, progress=lines.append)
    assert r.compiles == 3 and r.policy not in ("none", "full")
    assert [c.policy for c in r.candidates] == ["none", r.policy]  # full's gradient calibrated: no full row
    assert any(line.startswith("compiling full's gradient (2 of at most 3)") for line in lines)
    # Within the estimate's uncertainty (the parameters' bytes) of the budget, full's step is compiled as the answer.
    edge = remat_kit.fit(model, loss, *args, budget=int(ends["full"] * (1 + DEFAULT_MARGIN)) + 1)
    assert edge.policy == "full" and edge.need_bytes == ends["full"] and edge.compiles == 3
    assert [c.policy for c in edge.candidates] == ["none", "full"]


def test_an_answer_that_misses_after_an_estimate_falls_back_to_full_compiled(monkeypatch):
    """An estimate far under full's need sends the solver past the budget: full, compiled, is the verified answer."""
    model, loss, args, _, build = _linen()
    ends = {s: StepPlanner(build(s == "full")).memory(policies.parse(s))[0] for s in ("none", "full")}
    real = StepPlanner.gradient_need
    monkeypatch.setattr(StepPlanner, "gradient_need", lambda self, lowered: (real(self, lowered)[0] // 2, 0))
    budget = int(ends["full"] * 1.05 * (1 + DEFAULT_MARGIN))
    r = remat_kit.fit(model, loss, *args, budget=budget)
    assert r.policy == "full" and r.need_bytes == ends["full"]
    assert r.compiles == 4  # the one case past three: full compiled to verify the fallback
    assert "compiled over the budget; full is the verified fallback" in r.choice.reason
