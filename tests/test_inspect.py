"""inspect / compare / auto on a model remat_kit did not write (tests/plan_model_factory.py: a Linen nn.scan
MLP stack), compile-only; and ``remat-kit plan --model MODULE:FACTORY``."""

import json

import jax
import jax.numpy as jnp
import plan_model_factory as M
import pytest

import remat_kit
from remat_kit import _jax_internals, policies
from remat_kit.analysis import memory
from remat_kit.cli import main
from remat_kit.constants import DEFAULT_MARGIN
from remat_kit.planning import fit

F32 = 4
L, B, S, D = M.LAYERS, M.BATCH, M.SEQ, M.D


def _make_loss(policy):
    return M.make(policy)[0]


ARGS = M.make(policies.none())[1]


@pytest.fixture(scope="module")
def comparison():
    return remat_kit.compare(_make_loss, ["full", "none", "dots"], *ARGS)


def test_saved_bytes_equal_jax_residual_count(comparison):
    for spec in comparison.policies:
        loss, args = M.make(policies.parse(spec))
        own = [r for r in _jax_internals.saved_residuals(loss, *args) if not r.is_argument]
        report = comparison[spec]
        assert report.saved_bytes == sum(r.nbytes for r in own), spec
        assert sorted(r.shape for r in report.residuals) == sorted(r.shape for r in own), spec


def test_full_keeps_only_the_layer_inputs_and_the_loss_input(comparison):
    full = comparison["full"]
    # The L stacked block inputs, and the stack's output that the loss squares.
    assert full.saved_bytes == L * B * S * D * F32 + B * S * D * F32
    assert full.saved_host_bytes == 0


def test_none_flops_are_three_forwards(comparison):
    none = comparison["none"]
    assert none.forward_flops == L * 2 * (2 * B * S * D * 4 * D)  # two [d, 4d] matmuls per block
    assert none.flops == 3 * none.forward_flops


def test_compare_keeps_order_and_measures_recompute_against_none(comparison):
    assert comparison.policies == ("full", "none", "dots")
    assert [r.policy for r in comparison.reports] == ["full", "none", "dots"]
    ratio = comparison.flops_ratio
    # full recomputes each block's first matmul (the second's output is never needed): half a forward.
    assert ratio == {"full": 3.5 / 3, "none": 1.0, "dots": 1.0}
    assert comparison.recompute_flops["full"] == comparison["none"].forward_flops // 2
    assert comparison["dots"].saved_bytes < comparison["none"].saved_bytes


def test_report_fields_table_and_json(comparison):
    r = comparison["none"]
    assert r.peak_bytes == r.argument_bytes + r.output_bytes - r.alias_bytes + r.temp_bytes
    assert r.residuals == tuple(sorted(r.residuals, key=lambda x: -x.nbytes))
    assert all(x.memory == "device" and x.label and x.source for x in r.residuals)
    record = json.loads(json.dumps(r.to_dict()))
    assert record["saved_bytes"] == r.saved_bytes and len(record["residuals"]) == len(r.residuals)
    table = comparison.table().splitlines()
    assert table[0].split()[:5] == ["policy", "saved", "host", "XLA", "temp"] and "peak" in table[0]
    assert [line.split()[0] for line in table[2:5]] == ["full", "none", "dots"]
    assert "peak" in str(r) and "residuals" in str(r)


def test_comparison_iterates_over_its_reports_in_order(comparison):
    assert list(comparison) == list(comparison.reports) and len(comparison) == 3
    assert [r.policy for r in comparison] == ["full", "none", "dots"]
    assert dict(zip(comparison.policies, comparison, strict=True))["dots"] is comparison["dots"]
    with pytest.raises(KeyError, match="policy 'sqrt_n' was not compared; compared: full, none, dots"):
        comparison["sqrt_n"]


def test_compare_without_none_traces_it_for_the_base():
    c = remat_kit.compare(_make_loss, ["full"], *ARGS)
    assert c.policies == ("full",) and c.flops_ratio["full"] == 3.5 / 3


def test_shapes_far_beyond_this_machine():
    # 16 layers of d=4096 over 64 × 2048 tokens: terabytes of activations, none of it allocated.
    layers, batch, seq, d = 16, 64, 2048, 4096
    loss, args = M.make(policies.full(), layers=layers, batch=batch, seq=seq, d=d, dtype=jnp.bfloat16)
    r = remat_kit.inspect(loss, *args)
    inputs = layers * batch * seq * d * 2  # full keeps each block's bf16 input
    assert inputs <= r.saved_bytes <= inputs + batch * seq * d * (2 + 4)  # + the loss's input and its f32 cast
    # The kept inputs plus a layer's recompute working set: ~64 GB, nearly 3x this machine's memory (XLA's
    # temp differs by a few GB between JAX's remat implementations).
    assert r.peak_bytes > 3 * inputs > 48e9 and r.flops > 3 * r.forward_flops  # recompute: more than 3 forwards


def test_offload_on_cpu_counts_device_bytes_with_a_note():
    def loss(w, x):
        h = jax.ad_checkpoint.checkpoint_name(jnp.sin(x @ w), "h")
        return jnp.sum(jnp.sin(h))

    offload = policies.offload(["h"], strict=False)
    w, x = jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((8, 64), jnp.float32)
    r = remat_kit.inspect(offload(loss), w, x, argnums=(0, 1))
    assert any(res.memory == "pinned_host" for res in r.residuals)
    assert not r.host_offload_enforced and r.saved_host_bytes == 0
    assert r.saved_bytes == sum(res.nbytes for res in r.residuals)
    assert any("no memory moves" in n for n in r.notes)


# ---- auto on any model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auto_table():
    return fit.auto(_make_loss, *ARGS, budget_bytes=10**12, exhaustive=True)


def test_auto_chooses_what_fits_and_nothing_cheaper_does(auto_table):
    need = {c.policy: c.need_bytes for c in auto_table.candidates}
    assert auto_table.batch is None and [c.policy for c in auto_table.candidates][-1] == "full"
    budget_bytes = int(need["full"] * (1 + DEFAULT_MARGIN)) + 1
    assert budget_bytes < min(need["none"], need["dots"])  # the test means something
    r = remat_kit.auto(_make_loss, *ARGS, budget_bytes=budget_bytes)
    assert str(r.chosen) == "full" and "needs more than the budget" in r.reason
    win = next(c for c in r.candidates if c.policy == "full")
    assert win.fits and all(c.fits is not True for c in r.candidates if c.recompute_flops < win.recompute_flops)
    assert win.need_bytes == need["full"]  # the same step, memoized or not


def test_auto_ample_budget_recomputes_nothing(auto_table):
    assert auto_table.chosen is not None and auto_table.candidates[0].recompute_flops == 0
    assert str(auto_table.chosen) == "none"  # dots recomputes elementwise work: the cost model says so


def test_auto_counts_the_optimizer_state(auto_table):
    sgd = fit.auto(_make_loss, *ARGS, budget_bytes=10**12, candidates=["none"], optimizer="sgd")
    adamw = next(c for c in auto_table.candidates if c.policy == "none")
    assert sgd.candidates[0].need_bytes < adamw.need_bytes  # AdamW keeps two moments per parameter


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: remat_kit.inspect(lambda w, x: x @ w, *ARGS[:0], jnp.ones((2, 2)), jnp.ones((2, 2))),
            ValueError,
            "floating-point scalar",
        ),
        (lambda: remat_kit.inspect(lambda w: jnp.sum(w), jnp.ones(2), argnums=3), ValueError, "out of range"),
        (lambda: remat_kit.inspect(lambda w: jnp.sum(w), jnp.ones(2), argnums="w"), ValueError, "argnums"),
        (lambda: remat_kit.inspect(lambda w: jnp.sum(w), "w"), TypeError, "ShapeDtypeStructs"),
        (lambda: remat_kit.inspect("loss", jnp.ones(2)), TypeError, "callable"),
        (lambda: remat_kit.compare(_make_loss, "none", *ARGS), ValueError, "non-empty sequence"),
        (lambda: remat_kit.compare(_make_loss, ["nope"], *ARGS), ValueError, "nope"),
        (lambda: remat_kit.auto(_make_loss, *ARGS, budget_bytes="50MB"), ValueError, "positive integer"),
        (lambda: remat_kit.auto(_make_loss, *ARGS, budget_bytes=-5), ValueError, "positive integer"),
        (lambda: remat_kit.auto(_make_loss, budget_bytes=10**9), TypeError, "needs the loss's inputs"),
        (lambda: remat_kit.auto(M.factory, *ARGS, budget_bytes=10**9), TypeError, "loss function"),
        (lambda: remat_kit.auto(42, budget_bytes=10**9), TypeError, "TransformerConfig or make_loss"),
    ],
    ids=[
        "non-scalar",
        "argnums-range",
        "argnums-type",
        "bad-arg",
        "not-callable",
        "policies-str",
        "bad-policy",
        "budget-str",
        "budget-negative",
        "no-inputs",
        "make-loss-returns-pair",
        "bad-model",
    ],
)
def test_bad_inputs_are_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---- remat-kit plan --model ------------------------------------------------------------------------


def test_plan_model_table_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "plan_model_factory:factory", "--policies", "full,none", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "peak" in printed and "full" in printed
    record = json.loads(out.read_text())
    assert [r["policy"] for r in record["records"]] == ["full", "none"]
    assert [r["recompute_flops"] for r in record["records"]][1] == 0


def test_plan_model_budget_nothing_fits(capsys):
    assert main(["plan", "--model", "plan_model_factory:factory", "--policies", "none,full", "--budget", "1KB"]) == 1
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize(
    "model, extra, match",
    [
        ("plan_model_factory", [], "MODULE:FACTORY"),
        ("no_such_module_xyz:f", [], "cannot import"),
        ("plan_model_factory:nope", [], "has no 'nope'"),
        ("plan_model_factory:NOT_CALLABLE", [], "not a callable"),
        ("plan_model_factory:not_a_pair", [], "loss_fn, example_args"),
        ("plan_model_factory:factory", ["--batch", "4"], "--batch"),
        ("plan_model_factory:factory", ["--budget", "lots"], "memory size"),
        ("plan_model_factory:factory", ["--budget", "1GB", "--explain"], "do not go with --budget"),
        ("plan_model_factory:factory", ["--timeline", "t.txt"], "--timeline"),
    ],
    ids=[
        "no-colon",
        "no-module",
        "no-attr",
        "not-callable",
        "not-a-pair",
        "preset-flag",
        "bad-budget",
        "explain-with-budget",
        "timeline-not-a-picture",
    ],
)
def test_plan_model_bad_inputs_exit_2(model, extra, match, capsys):
    assert main(["plan", "--model", model, *extra]) == 2
    assert match in capsys.readouterr().err


def test_host_rule_is_one_function():
    assert memory.host_offload(jax.devices("cpu")[0]).enforced is False


def _nnx_loss_and_args(policy, layers=3, batch=4, seq=8, d=16):
    """An NNX model of the test's own (an MLP block stacked by ``remat_kit.nnx.stack``) as a pure loss of its
    state: ``(loss(params, rest, x), (params, rest, x))``, every input abstract."""
    from flax import nnx

    import remat_kit.nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = remat_kit.nnx.stack(Block, layers, policy, rngs=rngs)

        def __call__(self, x):
            return jnp.mean(self.blocks(x) ** 2)

    model = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))  # nothing allocated
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest, x):
        return nnx.merge(graphdef, params, rest)(x)

    return loss, (params, rest, jax.ShapeDtypeStruct((batch, seq, d), jnp.float32))


@pytest.mark.parametrize("spec", ["none", "full"])
def test_an_nnx_model_is_inspected_like_any_function(spec):
    layers, batch, seq, d = 3, 4, 8, 16
    loss, args = _nnx_loss_and_args(policies.parse(spec), layers, batch, seq, d)
    r = remat_kit.inspect(loss, *args)
    own = [x for x in _jax_internals.saved_residuals(loss, *args) if not x.is_argument]
    assert r.saved_bytes == sum(x.nbytes for x in own) > 0
    matmul = 2 * batch * seq * d * 4 * d  # one [d, 4d] matmul
    assert r.forward_flops == layers * 2 * matmul
    if spec == "none":
        assert r.flops == 3 * r.forward_flops
    else:
        # Each layer's input is kept, plus the stack's output that the loss squares; the first matmul recomputed.
        assert r.saved_bytes == (layers + 1) * batch * seq * d * F32
        assert r.flops == 3 * r.forward_flops + layers * matmul


def _nnx_model(policy, layers=3, d=16):
    """An NNX model of the test's own with a remat_kit.nnx.stack inside (its policy built in)."""
    from flax import nnx

    import remat_kit.nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = remat_kit.nnx.stack(Block, layers, policy, rngs=rngs)

        def __call__(self, x):
            return jnp.mean(self.blocks(x) ** 2)

    return Net


@pytest.mark.parametrize("run", ["compare", "auto"])
def test_an_nnx_model_with_its_own_policy_as_an_argument_is_a_clear_error(run):
    from flax import nnx

    from remat_kit.planning.fit import auto

    model = nnx.eval_shape(lambda: _nnx_model("full")(nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)

    def make_loss(policy):  # ignores the row's policy: the trap
        return lambda m, x: m(x)

    with pytest.raises(TypeError, match=r"argument 0 is an NNX module \(Net\) whose Stack runs its own policy full"):
        if run == "compare":
            remat_kit.compare(make_loss, ["none", "full"], model, x)
        else:
            auto(make_loss, model, x, budget_bytes=10**9, candidates=["none", "full"])


def test_the_nnx_recipe_measures_each_row_under_its_own_policy():
    from flax import nnx

    def make_loss(policy):  # the README's recipe: the model built under the row's policy, its state passed
        graphdef = nnx.split(nnx.eval_shape(lambda: _nnx_model(policy)(nnx.Rngs(0))), nnx.Param, ...)[0]
        return lambda params, rest, x: nnx.merge(graphdef, params, rest)(x)

    _, params, rest = nnx.split(nnx.eval_shape(lambda: _nnx_model("none")(nnx.Rngs(0))), nnx.Param, ...)
    x = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
    table = remat_kit.compare(make_loss, ["none", "full"], params, rest, x)
    assert table["full"].saved_bytes < table["none"].saved_bytes
    assert table.flops_ratio["full"] > 1.0
