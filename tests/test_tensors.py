"""remat_kit.planning.tensors: per-tensor save/recompute choice under a budget, compiled and fitting."""

import pytest

from remat_kit import policies as P
from remat_kit.analysis import memory
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning import budget as A
from remat_kit.planning import builtin, cost, tensors
from remat_kit.planning import fit as F
from remat_kit.planning import planner as planner_lib

CFG = TransformerConfig.preset("tiny", num_layers=4)
BATCH, SEQ = 8, 128
# Five groups (32 subsets) keep the test fast; every selective preset's tags are unions of them.
GROUPS = [("q_proj", "k_proj", "v_proj"), ("context",), ("attn_out",), ("mlp_gate", "mlp_up"), ("mlp_out",)]
# A short preset pool (7 compiles), the seeds of per_tensor and auto's pool alike.
POOL = ("none", "selective", "save_dot_except_mlp", "save_qkv_proj", "selective:mlp_gate,mlp_up", "every_n:2", "full")
HW = cost.DEFAULT_HARDWARE["cpu"]


@pytest.fixture(scope="module")
def planner():
    return builtin.Planner(CFG)


@pytest.fixture(scope="module")
def needs(planner):
    return {p: planner.memory(P.parse(p), BATCH, SEQ)[0] for p in ("none", "full")}


def _budget(needs, f):
    full, none = needs["full"], needs["none"]
    return int((full + f * (none - full)) * (1 + planner_lib.DEFAULT_MARGIN)) + 1


@pytest.mark.parametrize("spec", ["full", "selective:q_proj,context", "selective"], ids=str)
def test_one_layer_prices_the_stack_per_layer(planner, spec):
    # The per-layer subsets are priced on one layer's jaxpr plus the stack's constant per remat layer (0 on
    # the classic remat; remat3 re-runs RoPE's elementwise ops per remat layer): the stack is L times that.
    price = A.Pricer(planner, HW, BATCH, SEQ)
    policy = P.parse(spec)
    layer = tensors._layer_recompute_s(price, CFG, 0, policy)
    assert price.estimate(policy).recompute_s == pytest.approx(CFG.num_layers * layer, rel=1e-9)


@pytest.mark.parametrize("f", [0.3, 0.85], ids=["30%", "85%"])
def test_per_tensor_fits_and_costs_no_more_than_the_best_preset_or_mix(planner, needs, f):
    # No baseline: auto's presets and mix are the search's seeds, so it cannot lose to them.
    budget = _budget(needs, f)
    best = F.auto(CFG, batch=BATCH, seq=SEQ, budget_bytes=budget, planner=planner, hardware=HW, candidates=POOL)
    win = next(c for c in best.candidates if c.policy == str(best.chosen))
    r = tensors.per_tensor(
        CFG,
        batch=BATCH,
        seq=SEQ,
        budget_bytes=budget,
        planner=planner,
        hardware=HW,
        groups=GROUPS,
        pool=POOL,
        max_compiles=3,  # the bound holds whatever the cap (the seeds are candidates); fewer compiles for CI
    )
    assert r.fits and r.need_bytes == planner.memory(r.chosen, BATCH, SEQ)[0]  # compiled, not modelled
    assert r.need_bytes * (1 + r.margin) <= budget
    assert r.cost_s <= win.cost_s
    assert r.cost_s == A.Pricer(planner, HW, BATCH, SEQ).estimate(r.chosen).cost_s  # priced on the full step
    assert P.parse(str(r.chosen)) == r.chosen  # an ordinary policy or mix: its spec round-trips
    assert (str(r.chosen), r.need_bytes, True, r.source) in r.compiled
    assert r.source in tensors.SOURCES


def test_none_is_not_pruned_and_its_mixes_are_planned(planner, needs):
    # `none` (the keep-everything option) used to be pruned by a compiled figure set against tag sums.
    r = tensors.per_tensor(
        CFG,
        batch=BATCH,
        seq=SEQ,
        budget_bytes=_budget(needs, 1.0),
        planner=planner,
        hardware=HW,
        groups=GROUPS,
        pool=(),
    )
    assert r.chosen == P.none() and r.cost_s == 0.0
    assert P.none() not in [o.policy for o in r.options]  # kept apart from the front, never pruning it
    # The front's cheap end is there: an option as cheap as keeping every group (what `none`'s figure pruned).
    every = tensors._layer_recompute_s(A.Pricer(planner, HW, BATCH, SEQ), CFG, 0, P.selective())
    assert min(o.cost_s for o in r.options) == pytest.approx(every, rel=1e-12)


def test_comfortable_budget_gives_none(planner):
    r = tensors.per_tensor(CFG, batch=BATCH, seq=SEQ, budget_bytes=10**12, planner=planner, groups=GROUPS, pool=POOL)
    assert r.chosen == P.none() and r.cost_s == 0.0 and r.source == "preset"


def test_offload_options_are_generated_and_charged_the_transfer(planner, monkeypatch):
    # Where offload moves memory (not XLA:CPU: the host rule is patched), every kept group may also be offloaded.
    groups = [("q_proj", "k_proj", "v_proj"), ("mlp_out",)]
    sizes = tensors.tag_bytes(CFG, BATCH, SEQ)
    plain = tensors.layer_options(A.Pricer(planner, HW, BATCH, SEQ), CFG, groups, sizes)
    monkeypatch.setattr(memory.HostOffload, "enforced", property(lambda self: True))
    price = A.Pricer(planner, HW, BATCH, SEQ)
    assert price.host_moves
    options = tensors.layer_options(price, CFG, groups, sizes)
    assert len(plain) == 2 ** len(groups) and len(options) == 3 ** len(groups)
    offloaded = [o for o in options if o.policy.kind == "offload"]
    assert {o.policy.offload for o in offloaded} == {("q_proj", "k_proj", "v_proj"), ("mlp_out",)} | {
        ("q_proj", "k_proj", "v_proj", "mlp_out")
    }
    kept = {frozenset(o.policy.save): o for o in plain}  # the same tags kept on the device: the recompute
    for o in offloaded:
        moved = 2 * sum(sizes[t] for t in o.policy.offload)
        same = kept[frozenset(o.policy.save + o.policy.offload)]
        assert o.cost_s == pytest.approx(same.cost_s + HW.transfer_seconds(moved), rel=1e-12)
        assert o.cost_s > same.cost_s
        assert o.device_bytes == sum(sizes[t] for t in o.policy.save)  # the offloaded bytes leave the device


def test_maxtext_answers_only_what_maxtext_can_name(planner, needs):
    emitted = list(tensors.tag_bytes(CFG, BATCH, SEQ))
    groups = tensors.default_groups(emitted, maxtext=True)
    assert {t for g in groups for t in g} == set(emitted) & P.MAXTEXT_TAGS - {"layer_input"}
    r = tensors.per_tensor(
        CFG,
        batch=BATCH,
        seq=SEQ,
        budget_bytes=_budget(needs, 0.85),
        planner=planner,
        hardware=HW,
        pool=POOL,
        maxtext=True,
        max_compiles=2,
    )
    assert r.fits and r.maxtext and tensors.maxtext_ok(r.chosen)
    assert all(tensors.maxtext_ok(P.parse(spec)) for spec, *_ in r.compiled)


def test_groups_cover_the_emitted_tags():
    sizes = tensors.tag_bytes(CFG, BATCH, SEQ)
    groups = tensors.default_groups(list(sizes))
    assert ("q_proj", "k_proj", "v_proj") in groups and ("mlp_gate", "mlp_up") in groups
    assert sorted(t for g in groups for t in g) == sorted(t for t in sizes if t != "layer_input")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"groups": [("qq_proj",)]}, r"the block does not emit \['qq_proj'\]; it emits: layer_input"),
        ({"groups": [("attn_norm",)], "maxtext": True}, r"MaxText's custom remat has no name for \['attn_norm'\]"),
        ({"maxtext": "yes"}, r"maxtext must be True or False, got 'yes'"),
        ({"max_compiles": -1}, r"max_compiles must be an integer >= 0 \(0: the seeds alone\), got -1"),
        ({"pool": ["fulll"]}, r"unknown policy spec 'fulll'"),
    ],
    ids=["unknown-tag", "maxtext-unnamed", "maxtext-type", "max-compiles", "pool"],
)
def test_bad_input_is_refused_before_compiling(kw, match):
    planner = builtin.Planner(CFG)
    with pytest.raises((ValueError, TypeError), match=match):
        tensors.per_tensor(CFG, batch=BATCH, seq=SEQ, budget_bytes=10**9, planner=planner, **kw)
    assert planner.compiles == 0
