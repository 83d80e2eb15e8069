"""Mixed policies (policies.mix): spec round trip, depth checks, exact gradients, memory, and auto's answer."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import RTOL_F32, max_rel_err

import remat_kit
from remat_kit import _jax_internals as internals
from remat_kit import policies as P
from remat_kit.model.transformer import Transformer, TransformerConfig
from remat_kit.names import tag
from remat_kit.planning import analysis, builtin
from remat_kit.planning import fit as fit_lib
from remat_kit.planning import planner as planner_lib

B, S, D, F = 2, 3, 8, 24


class Block(nn.Module):
    """A small tagged block with dropout, shaped so every kept value is recognizable by its shape."""

    rate: float = 0.0

    @nn.compact
    def __call__(self, x, deterministic=True):  # x: [B, S, D]
        x = tag(x, "layer_input")
        q = tag(nn.Dense(D, name="q")(x), "q_proj")
        up = tag(nn.Dense(F, name="up")(jnp.tanh(q)), "mlp_up")
        out = nn.Dense(D, name="down")(tag(jnp.sin(up), "mlp_act"))
        return x + nn.Dropout(self.rate)(out, deterministic=deterministic)


def _setup(depth, policy, rate=0.0):
    """(the stack under ``policy``, parameters made under none, an input)."""
    layers = remat_kit.stack(functools.partial(Block, rate=rate), depth, policy)
    x = jax.random.normal(jax.random.key(0), (B, S, D))
    params = remat_kit.stack(Block, depth, "none").init(jax.random.key(1), x)
    return layers, params, x


def _loss(layers, rate=0.0):
    def loss(params, x):
        kw = {} if rate == 0 else {"deterministic": False, "rngs": {"dropout": jax.random.key(7)}}
        return jnp.sum(layers.apply(params, x, **kw) ** 2)

    return loss


def _activations(depth, policy):
    """Saved residuals that are not arguments (parameters, input): the activation memory."""
    layers, params, x = _setup(depth, policy)
    # A linear read-out keeps nothing itself, so every residual belongs to the stack.
    loss = lambda p, x: jnp.sum(layers.apply(p, x))
    return [r for r in internals.saved_residuals(loss, params, x) if not r.is_argument]


MIXES = [
    "full*2+none*3",
    "none*1+selective:q_proj*4",
    "every_n:2*3+full*2",
    "segments:2*3+offload:q_proj*2",
    "dots*2+sqrt_n*3",
    "full*1+none*2+selective:q_proj;strict=false*2",
]


# ---- spec and validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [*MIXES, "selective*20+full*8", "every_n:2*4+offload:q_proj;save=mlp_up*4"])
def test_mix_round_trips_through_str_and_parse(spec):
    m = P.parse(spec)
    assert isinstance(m, P.Mix) and str(m) == spec and P.parse(str(m)) == m
    assert hash(m) == hash(P.parse(spec))


def test_mix_constructor_takes_policies_or_specs():
    m = P.mix([("selective", 20), (P.full(), 8)])
    assert m.parts == ((P.selective(), 20), (P.full(), 8)) and m.num_layers == 28
    assert str(m) == "selective*20+full*8" and m.kind == "mix" and m.remat


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: P.parse("full*2+none*2", num_layers=5), ValueError, r"counts sum to 4 layers but the stack has 5"),
        (lambda: remat_kit.stack(Block, 5, "full*2+none*2"), ValueError, r"sum to 4 layers but the stack has 5"),
        (
            lambda: Transformer(config=TransformerConfig.preset("tiny", num_layers=4), policy="full*3+none*3"),
            ValueError,
            r"sum to 6 layers but the stack has 4",
        ),
        (lambda: P.mix([(P.full(), 0), (P.none(), 4)]), ValueError, r"mix count of full must be a positive integer"),
        (lambda: P.mix([(P.full(), 2.0), (P.none(), 2)]), TypeError, r"mix count of full must be a positive integer"),
        (lambda: P.mix([(P.full(), 4)]), ValueError, r"at least two"),
        (lambda: P.parse("full*4"), ValueError, r"at least two parts"),
        (lambda: P.parse("full*2*2+none*1"), ValueError, r"two counts; mixes do not nest"),
        (lambda: P.mix([(P.parse("full*1+none*1"), 2), ("none", 2)]), ValueError, r"mixes do not nest"),
        (lambda: P.parse("full*2+none"), ValueError, r"part 'none' has no \*COUNT"),
        (lambda: P.parse("full*two+none*2"), ValueError, r"the count 'two' is not an integer"),
        (lambda: P.parse("every_n:3*2+full*2", num_layers=4), ValueError, r"part every_n:3\*2 does not fit"),
        (lambda: P.selective(["a+b"]), ValueError, r"tag 'a\+b'"),
    ],
    ids=[
        "parse-depth",
        "stack-depth",
        "transformer-depth",
        "count-0",
        "count-float",
        "one-part",
        "one-part-spec",
        "nested-spec",
        "nested-mix",
        "no-count",
        "bad-count",
        "part-too-deep",
        "tag-with-plus",
    ],
)
def test_bad_mixes_are_clear_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_mix_applied_to_one_function_is_a_clear_error():
    with pytest.raises(ValueError, match=r"mix full\*1\+none\*1 runs the layers of a stack.*remat_kit.stack"):
        P.parse("full*1+none*1")(jnp.sin)


# ---- what a mix computes and keeps ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", [s for s in MIXES if "dots" not in s and "selective:q_proj*4" not in s])
def test_gradients_equal_none_with_dropout(spec):
    layers, params, x = _setup(5, P.parse(spec), 0.3)
    reference, _, _ = _setup(5, "none", 0.3)
    g = jax.jit(jax.grad(_loss(layers, 0.3), argnums=(0, 1)))(params, x)
    g0 = jax.jit(jax.grad(_loss(reference, 0.3), argnums=(0, 1)))(params, x)
    assert max_rel_err(g, g0) <= RTOL_F32


def test_parameters_are_the_one_stacked_tree_of_every_policy():
    x = jnp.ones((B, S, D))
    ref = remat_kit.stack(Block, 5, "none").init(jax.random.key(3), x)
    got = remat_kit.stack(Block, 5, "full*2+none*3").init(jax.random.key(3), x)
    assert jax.tree.structure(got) == jax.tree.structure(ref) and max_rel_err(got, ref) == 0.0


def test_each_part_keeps_what_its_policy_keeps():
    """full*2+selective:q_proj*4 keeps full's 2 inputs and selective's 4 inputs + 4 q_proj: no weight slice."""
    acts = _activations(6, P.parse("full*2+selective:q_proj*4"))
    got = sorted(r.shape for r in acts if r.dtype == "float32")  # the rest: the parts' int32 layer indices
    assert got == [(2, 2, 3, 8), (4, 2, 3, 8), (4, 2, 3, 8)]


def test_one_block_compiled_per_part_whatever_the_depth():
    counts = []
    for depth in (4, 16):
        layers, params, x = _setup(depth, P.parse(f"full*{depth // 2}+selective:q_proj*{depth // 2}"))
        jaxpr = jax.make_jaxpr(jax.grad(_loss(layers)))(params, x)
        counts.append(internals.count_primitive(jaxpr, "dot_general"))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("k", [1, 3], ids=["k1", "k3"])
def test_mix_saved_bytes_interpolate_its_parts(k):
    """The stack keeps k/L of none's bytes plus (L−k)/L of full's (within 2 %), on the tiny preset."""
    cfg = TransformerConfig.preset("tiny", num_layers=4)
    none, full, got = (analysis.layer_stack_bytes(cfg, s, 2, 16)[0] for s in ("none", "full", f"none*{k}+full*{4 - k}"))
    ideal = (k * none + (4 - k) * full) / 4
    assert full < got <= 1.02 * ideal
    if not internals.remat3_enabled():  # remat3 recomputes the none part's elementwise work too
        assert got >= ideal


# ---- every_n's bound (issue 13, item 2) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "n", "dtype"),
    [("tiny", 3, "float32"), ("small", 2, "float32"), ("small", 3, "float32"), ("tiny", 2, "bfloat16")],
    ids=["tiny-n3", "small-n2", "small-n3", "tiny-n2-bf16"],
)
def test_every_n_saved_bytes_within_2_percent_of_ideal(preset, n, dtype):
    """((n−1)·none + full)/n per group, the remainder group counted as such (trace-only). In bfloat16
    (the 2B preset's compute dtype) too, where a float32 value ending in a cast would be kept at 2x."""
    cfg = TransformerConfig.preset(preset, dtype=dtype)
    batch, seq = 2, 64
    none, full, got = (analysis.layer_stack_bytes(cfg, s, batch, seq)[0] for s in ("none", "full", f"every_n:{n}"))
    L = cfg.num_layers
    rematerialized = len(range(0, L, n))
    ideal = ((L - rematerialized) * none + rematerialized * full) / L
    assert full < got <= 1.02 * ideal


# ---- auto answers with a mix between two presets ---------------------------------------------------------

CFG = TransformerConfig.preset("tiny", num_layers=4, max_seq_len=256)
BATCH, SEQ = 8, 256  # activations dominate the step, so a mix's need falls between its parts'


@functools.cache
def _planner_and_needs():
    planner = builtin.Planner(CFG)
    return planner, {s: planner.memory(P.parse(s), BATCH, SEQ)[0] for s in ("none", "full")}


def test_auto_answers_a_mix_with_strictly_less_recompute_than_the_best_preset():
    planner, need = _planner_and_needs()
    budget = int((0.6 * need["none"] + 0.4 * need["full"]) * (1 + planner_lib.DEFAULT_MARGIN))
    r = fit_lib.auto(CFG, batch=BATCH, seq=SEQ, budget_bytes=budget, candidates=["none", "full"], planner=planner)
    assert isinstance(r.chosen, P.Mix) and r.chosen.policies == (P.none(), P.full())
    rows = {c.policy: c for c in r.candidates}
    win, full = rows[str(r.chosen)], rows["full"]
    # Measured, not interpolated: the mix's own compile fits, and one more layer of none does not.
    assert win.fits and win.need_bytes * (1 + r.margin) <= budget
    assert win.recompute_flops < full.recompute_flops
    k = r.chosen.parts[0][1]
    more = rows.get(str(P.mix([("none", k + 1), ("full", 3 - k)]))) if k < 3 else None
    assert more is None or not more.fits
    assert "costs less than full, the best single policy that fits" in r.reason
    assert r.mixed_front == (("none", "full", need["none"], need["full"], 0, full.recompute_flops),)
    # Without mixes, the answer is the preset.
    plain = fit_lib.auto(
        CFG, batch=BATCH, seq=SEQ, budget_bytes=budget, candidates=["none", "full"], planner=planner, mixes=False
    )
    assert plain.chosen == P.full()


def test_auto_takes_no_mix_when_the_least_recompute_fits():
    planner, need = _planner_and_needs()
    kw = {"candidates": ["none", "full"], "planner": planner}
    r = fit_lib.auto(CFG, batch=BATCH, seq=SEQ, budget_bytes=2 * need["none"], **kw)
    assert r.chosen == P.none() and all("*" not in c.policy for c in r.candidates)
