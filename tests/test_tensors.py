"""remat_kit.planning.tensors: per-tensor save/recompute choice under a budget, compiled and fitting."""

import jax
import pytest

from remat_kit import policies as P
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning import budget as A
from remat_kit.planning import cost, tensors
from remat_kit.planning import planner as planner_lib

CFG = TransformerConfig.preset("tiny", num_layers=4)
BATCH, SEQ = 8, 128
# Five groups (32 subsets) keep the test fast; every selective preset's tags are unions of them.
GROUPS = [("q_proj", "k_proj", "v_proj"), ("context",), ("attn_out",), ("mlp_gate", "mlp_up"), ("mlp_out",)]
HW = cost.DEFAULT_HARDWARE["cpu"]


@pytest.fixture(scope="module")
def planner():
    return planner_lib.Planner(CFG)


@pytest.fixture(scope="module")
def needs(planner):
    return {p: planner.memory(P.parse(p), BATCH, SEQ)[0] for p in ("none", "full")}


def _budgets(needs):
    full, none = needs["full"], needs["none"]
    return [int((full + f * (none - full)) * (1 + planner_lib.DEFAULT_MARGIN)) + 1 for f in (0.0, 0.3, 0.6, 1.0)]


@pytest.mark.xfail(
    jax.config.jax_remat3,
    strict=True,
    reason="known (issue 27): under remat3 the stack's full recomputes RoPE's elementwise ops ~8% beyond L x one "
    "layer's price; keep_activations asks the policy only at names, matmuls and control flow there",
)
def test_one_layer_prices_the_stack_per_layer(planner):
    # The per-layer subsets are priced on one layer's jaxpr; the stack recomputes exactly L times that.
    price = A.Pricer(planner, HW, BATCH, SEQ)
    for policy in (P.full(), P.selective(["q_proj", "context"]), P.selective()):
        layer = tensors._layer_recompute_s(CFG, BATCH, SEQ, 0, HW, policy)
        assert price.estimate(policy).recompute_s == pytest.approx(CFG.num_layers * layer, rel=1e-9), str(policy)


def test_per_tensor_fits_and_costs_no_more_than_the_best_preset_or_mix(planner, needs):
    for budget in _budgets(needs):
        best = A.auto(CFG, batch=BATCH, seq=SEQ, budget_bytes=budget, planner=planner, hardware=HW)
        win = next(c for c in best.candidates if c.policy == str(best.chosen))
        r = tensors.per_tensor(
            CFG,
            batch=BATCH,
            seq=SEQ,
            budget_bytes=budget,
            planner=planner,
            hardware=HW,
            groups=GROUPS,
            baseline=best.chosen,
        )
        assert r.fits and r.need_bytes == planner.memory(r.chosen, BATCH, SEQ)[0]  # compiled, not modelled
        assert r.need_bytes * (1 + r.margin) <= budget
        assert r.cost_s <= win.cost_s
        assert P.parse(str(r.chosen)) == r.chosen  # an ordinary policy or mix: its spec round-trips
        assert (str(r.chosen), r.need_bytes, True) in r.compiled or r.source == "baseline"


def test_comfortable_budget_gives_none(planner):
    r = tensors.per_tensor(CFG, batch=BATCH, seq=SEQ, budget_bytes=10**12, planner=planner, groups=GROUPS)
    assert r.chosen == P.none() and r.cost_s == 0.0


def test_groups_cover_the_emitted_tags():
    sizes = tensors.tag_bytes(CFG, BATCH, SEQ)
    groups = tensors.default_groups(list(sizes))
    assert ("q_proj", "k_proj", "v_proj") in groups and ("mlp_gate", "mlp_up") in groups
    assert sorted(t for g in groups for t in g) == sorted(t for t in sizes if t != "layer_input")


def test_unknown_group_tag_is_refused_before_compiling():
    with pytest.raises(ValueError, match=r"the block does not emit \['qq_proj'\]; it emits: layer_input"):
        tensors.per_tensor(CFG, batch=BATCH, seq=SEQ, budget_bytes=10**9, groups=[("qq_proj",)])
