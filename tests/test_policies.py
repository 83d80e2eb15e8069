import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err

from remat_kit import _jax_internals as internals
from remat_kit import policies as P
from remat_kit.model.transformer import Block, TransformerConfig
from remat_kit.names import tag

README = Path(__file__).resolve().parent.parent / "README.md"

CONSTRUCTED = [
    P.none(),
    P.full(),
    P.every_n(1),
    P.every_n(3),
    P.selective(),
    P.selective(["q_proj", "k_proj"]),
    P.selective(["my_tag"]),
    P.selective(["my_tag"], strict=False),
    P.offload(),
    P.offload(["q_proj", "k_proj"], save=["mlp_up"]),
    P.offload(["layer_input"], dst="pinned_host"),
    P.offload(["mine"], save=["other"]),
    P.offload(["mine"], save=["other"], strict=False),
    P.segments(4),
    P.sqrt_n(),
    P.dots(),
    P.from_jax("dots_saveable"),
    P.from_jax("save_only_these_names", "query_proj", "mlpwo"),
]


@pytest.mark.parametrize("policy", CONSTRUCTED, ids=str)
def test_str_and_parse_round_trip(policy):
    assert P.parse(str(policy)) == policy
    assert P.parse(policy) is policy


def test_policies_are_static_jit_arguments_equal_ones_share_a_trace():
    # Each distinct policy traces once; an equal one built anew (parsed from its spec) hits jit's cache.
    traces = []

    def scale(x, policy):
        traces.append(policy)
        return x * (2.0 if policy.remat else 1.0)

    f = jax.jit(scale, static_argnums=1)
    for policy in CONSTRUCTED:
        assert float(f(1.0, policy)) == (2.0 if policy.kind != "none" else 1.0)
    specs = [str(p) for p in traces]  # a spec names one policy: its strict flag and dst included
    assert sorted(specs) == sorted({str(p) for p in CONSTRUCTED})  # one trace per distinct policy
    for policy in CONSTRUCTED:
        copy = P.parse(str(policy))
        assert copy is not policy
        f(1.0, copy)
    assert len(traces) == len(specs)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("full", P.full()),
        ("minimal", P.selective(["q_proj", "k_proj", "v_proj", "attn_out", "mlp_gate", "mlp_up", "mlp_out"])),
        ("save_dot_except_mlp", P.selective(["q_proj", "k_proj", "v_proj", "attn_out"])),
        ("save_qkv_proj", P.selective(["qkv_proj"])),
        ("qkv_proj_offloaded", P.offload(["q_proj", "k_proj", "v_proj"])),
        ("minimal_offloaded", P.offload(["q_proj", "k_proj", "v_proj", "attn_out", "mlp_gate", "mlp_up", "mlp_out"])),
        ("selective:query_proj,key_proj", P.selective(["q_proj", "k_proj"])),
        (" every_n:2 ", P.every_n(2)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_parse_accepts_maxtext_presets_and_aliases(spec, expected):
    assert P.parse(spec) == expected


def test_default_selective_keeps_what_the_readme_says_on_a_block():
    # The README's selective row names the default: the matmul outputs and the attention context.
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `selective[:TAGS]`"))
    assert "default: matmul outputs q/k/v, context, attn_out, mlp gate/up/out" in row
    readme_tags = {"q_proj", "k_proj", "v_proj", "context", "attn_out", "mlp_gate", "mlp_up", "mlp_out"}
    # XLA attention: under JAX's remat3 a tag inside chunked attention's custom_vjp is not kept (docs/internals.md,
    # "JAX's remat3"), which would make this a test of the remat implementation, not of the default.
    cfg = TransformerConfig.preset("tiny", num_layers=1, attention="xla")
    x = jnp.ones((1, 8, cfg.d_model))
    params = Block(cfg).init(jax.random.key(0), x)

    def kept_tags(block):
        kept = [r for r in internals.saved_residuals(lambda p, x: jnp.sum(block(cfg).apply(p, x)), params, x)]
        kept = [r for r in kept if not r.is_argument]  # the layer input and the weights are arguments here
        assert all("named '" in r.source for r in kept), [r.source for r in kept]  # nothing untagged
        return {m for r in kept for m in re.findall(r"named '(\w+)'", r.source)}

    # mlp_out feeds only the residual add, whose backward needs nothing: it is named, never kept.
    assert kept_tags(P.selective()(Block)) == readme_tags - {"mlp_out"}
    assert kept_tags(P.selective(["mlp_out", "mlp_up"])(Block)) == {"mlp_up"}  # the check can tell policies apart


def test_each_field_has_one_meaning():
    assert (P.every_n(3).period, P.every_n(3).group_size) == (3, 0)
    assert (P.segments(4).period, P.segments(4).group_size) == (0, 4)
    with pytest.raises(ValueError, match=r"policy 'every_n' takes no group_size"):
        P.Policy("every_n", period=2, group_size=2)


def test_building_a_policy_queries_no_backend(monkeypatch):
    def no_backend(*a, **k):
        raise AssertionError("a policy queried the backend")

    monkeypatch.setattr(jax, "devices", no_backend)
    monkeypatch.setattr(jax, "local_devices", no_backend)
    for policy in CONSTRUCTED:
        assert P.parse(str(policy)) == policy


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host", "device"])
def test_offload_destinations_are_exactly_where_jax_remat_offloads(kind):
    """OFFLOAD_DESTINATIONS against the running JAX: only those kinds put a residual in host memory."""
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["u"], offload_src="device", offload_dst=kind
    )
    f = jax.checkpoint(lambda x: jnp.sum(jnp.sin(tag(jnp.sin(x), "u"))), policy=policy)
    (kept,) = [r for r in internals.saved_residuals(f, jnp.ones(3)) if not r.is_argument]
    assert kept.host == (kind in P.OFFLOAD_DESTINATIONS)


def test_default_offload_moves_layer_inputs_to_pinned_host():
    p = P.offload()
    assert p.offload == ("layer_input",) and p.save == () and p.dst == "pinned_host"


# ---- the seed's worked example: u = a*x, y = b*u, L = y^2/2 ----------------------------------------


def _seed_loss(x, a, b):
    u = tag(a * x, "u")
    y = b * u
    return 0.5 * y**2


SINGLE_SPECS = [s for s in ALL_SPECS if P.parse(s).kind not in P.GROUPING_KINDS]


@pytest.mark.parametrize("spec", [*SINGLE_SPECS, "selective:u", "offload:u", "selective:u;strict=false"])
def test_seed_worked_example_under_every_policy(spec):
    policy = P.parse(spec)
    if policy.tags and spec in ("selective", "offload"):
        policy = P.parse(spec + ":u")  # the defaults name the transformer's tags, not this function's
    f = policy(_seed_loss)
    value, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(2.0, 3.0, 4.0)
    assert float(value) == 288.0
    assert tuple(float(g) for g in grads) == (288.0, 192.0, 144.0)


# ---- applying to functions and module classes -----------------------------------------------------


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = tag(nn.Dense(16, name="up")(x), "up")
        return nn.Dense(4, name="down")(jnp.tanh(h))


@pytest.mark.parametrize("spec", SINGLE_SPECS)
def test_module_class_under_policy_has_same_params_and_grads(spec):
    x = jax.random.normal(jax.random.key(0), (3, 4))
    base = _Mlp()
    params = base.init(jax.random.key(1), x)
    policy = P.parse(spec + ":up" if spec in ("selective", "offload") else spec)
    wrapped_cls = policy(_Mlp)
    assert (wrapped_cls is _Mlp) == (spec == "none")
    wrapped = wrapped_cls()
    assert jax.tree.structure(wrapped.init(jax.random.key(1), x)) == jax.tree.structure(params)

    def loss(m, p):
        return jnp.sum(m.apply(p, x) ** 2)

    assert (
        max_rel_err(jax.grad(lambda p: loss(wrapped, p))(params), jax.grad(lambda p: loss(base, p))(params)) <= RTOL_F32
    )


def test_full_on_a_function_saves_only_its_inputs():
    def f(w, x):
        return jnp.sum(jnp.sin(jnp.sin(x @ w)))

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    plain = [r for r in internals.saved_residuals(f, w, x) if not r.is_argument]
    remat = [r for r in internals.saved_residuals(P.full()(f), w, x) if not r.is_argument]
    assert plain and not remat


def test_selective_jax_policy_saves_exactly_the_named_value():
    def f(w, x):
        h = tag(jnp.sin(x @ w), "q_proj")
        return jnp.sum(jnp.sin(h) @ w)

    res = internals.saved_residuals(P.selective(["q_proj"])(f), jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert [r.tag for r in res if not r.is_argument] == ["q_proj"]


def test_none_returns_the_function_itself():
    f = lambda x: x
    assert P.none()(f) is f


def test_applying_to_an_instance_is_a_type_error():
    with pytest.raises(TypeError, match=r"not an instance.*policy\(_Mlp\)"):
        P.full()(_Mlp())
    with pytest.raises(TypeError, match=r"a function, a flax\.linen\.Module class"):
        P.full()(3)


# ---- bad input: clear errors, raised at construction ---------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: P.every_n(0), ValueError, r"every_n\(period\) must be a positive integer, got 0"),
        (lambda: P.every_n(-1), ValueError, r"got -1"),
        (lambda: P.every_n(1.5), TypeError, r"every_n\(period\) must be a positive integer, got 1.5"),
        (lambda: P.every_n(True), TypeError, r"got True"),
        (lambda: P.segments(0), ValueError, r"segments\(group_size\) must be a positive integer, got 0"),
        (lambda: P.parse("fulll"), ValueError, r"unknown policy spec 'fulll'; allowed: none, full"),
        (lambda: P.parse("every_n:x"), ValueError, r"every_n needs an integer"),
        (lambda: P.parse("selective:q_proj;bogus=1"), ValueError, r"bad option 'bogus=1'"),
        (lambda: P.parse(3), TypeError, r"must be a string"),
        (lambda: P.selective(["a,b"]), ValueError, r"tag 'a,b': a tag is a non-empty name"),
        (lambda: P.offload(["q_proj"], save=["query_proj"]), ValueError, r"\['q_proj'\] are both saved and offloaded"),
        (lambda: P.offload(["q_proj"], dst="hbm"), ValueError, r"offload destination 'hbm'.*allowed: pinned_host$"),
        (lambda: P.offload(["q_proj"], dst="unpinned_host"), ValueError, r"'unpinned_host' is not a memory kind"),
        (lambda: P.parse("offload:q_proj;dst=device"), ValueError, r"'device' is not a memory kind"),
        (lambda: P.parse("selective:q_proj;strict=no"), ValueError, r"strict must be true or false"),
        (lambda: P.offload(()), ValueError, r"at least one tag"),
        (lambda: P.selective(()), ValueError, r"selective\(save=\(\)\) names no tag to keep; .* use full\(\)"),
        (lambda: P.parse("selective:"), ValueError, r"'selective:': no tag after ':'"),
        (lambda: P.parse("offload:;save=mlp_up"), ValueError, r"'offload:;save=mlp_up': no tag after ':'"),
        (lambda: P.parse("offload;save="), ValueError, r"'offload;save=': an option names no tag"),
        (lambda: P.parse("selective:q_proj,,k_proj"), ValueError, r"an empty tag in 'q_proj,,k_proj'"),
        (lambda: P.parse("every_n:99999999999999999999"), ValueError, r"every_n:N must be 1 <= N <= 2147483647"),
        (lambda: P.parse("segments:0"), ValueError, r"segments:K must be 1 <= K <= 2147483647 .*got 0"),
        (lambda: P.every_n(2**40), ValueError, r"every_n\(period\) must be 1 <= n <= 2147483647"),
    ],
    ids=[
        "every_n-0",
        "every_n-neg",
        "every_n-float",
        "every_n-bool",
        "segments-0",
        "unknown-spec",
        "every_n-nonint",
        "bad-option",
        "spec-not-str",
        "tag-with-comma",
        "saved-and-offloaded",
        "bad-dst",
        "dst-unpinned",
        "dst-device",
        "strict-not-bool",
        "offload-empty",
        "selective-empty",
        "selective-colon-only",
        "offload-colon-then-option",
        "offload-save-empty",
        "empty-tag-in-list",
        "every_n-huge",
        "segments-0-spec",
        "every_n-huge-constructed",
    ],
)
def test_bad_input_raises_clear_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _grammar_examples() -> list[str]:
    """Every spec the printed grammar shows: each form with each subset of its ``[...]`` parts, filled in."""
    text = P.SPEC_GRAMMAR.split(", or a MaxText preset")[0]
    fill = {
        "jax:NAME": "jax:dots_saveable",
        "(TAG,...)": "(q_proj,k_proj)",
        ":N": ":2",
        ":K": ":2",
        ":TAG,...": ":q_proj,k_proj",
        "save=TAG,...": "save=mlp_up",
        "KIND": "pinned_host",
    }
    examples = []
    for form in re.split(r", (?![^\[]*\])", text):
        head, optional = form.split("[")[0], re.findall(r"\[([^\]]*)\]", form)
        for mask in range(2 ** len(optional)):
            spec = head + "".join(part for i, part in enumerate(optional) if mask >> i & 1)
            for placeholder, value in fill.items():
                spec = spec.replace(placeholder, value)
            examples.append(spec)
    return examples


def test_grammar_shows_the_forms_the_parser_accepts():
    examples = _grammar_examples()
    # Each optional part of selective/offload is shown: 6 + 2**2 + 2**4 specs, and the two jax forms.
    assert len(examples) == 28 and "selective;strict=false" in examples and "offload;save=mlp_up" in examples
    for spec in examples:
        policy = P.parse(spec)
        assert P.parse(str(policy)) == policy, spec
    assert P.parse("selective;strict=false") == P.selective(strict=False)
    assert P.parse("offload;save=mlp_up;dst=pinned_host") == P.offload(save=["mlp_up"])
    for kind, options in P.SPEC_OPTIONS.items():  # the table the parser reads is the one the grammar shows
        assert all(f"[;{o}=" in P.SPEC_GRAMMAR for o in options), kind


@pytest.mark.parametrize("policy", [P.every_n(5), P.segments(9)], ids=str)
def test_group_larger_than_depth_is_rejected(policy):
    with pytest.raises(ValueError, match=r"greater than the depth \(4 layers\); allowed: 1 <= \w+ <= 4"):
        policy.validate_depth(4)


@pytest.mark.parametrize(
    ("policy", "depth", "size", "mode"),
    [
        (P.full(), 8, 1, "layer"),
        (P.every_n(3), 8, 3, "first"),
        (P.segments(4), 10, 4, "group"),
        (P.sqrt_n(), 16, 4, "group"),
        (P.sqrt_n(), 28, 5, "group"),
    ],
    ids=str,
)
def test_plan(policy, depth, size, mode):
    assert policy.plan(depth) == P.LayerPlan(size, mode)


# ---- JAX policies as a policy kind ---------------------------------------------------------------------


def _jax_probe(w, x):  # w: [4, 4], x: [2, 3, 4]; one plain matmul, one batched, two named values
    a = jnp.einsum("bsd,de->bse", x, w)  # no batch dims
    b = jnp.einsum("bsd,bte->bst", x, x)  # batch dim b
    c = tag(jnp.sin(a), "c")
    d = tag(jnp.cos(b), "d")
    return jnp.sum(jnp.sin(c) @ w) + jnp.sum(jnp.sin(d))


_JW, _JX = jax.random.normal(jax.random.key(0), (4, 4)), jax.random.normal(jax.random.key(1), (2, 3, 4))


def _jax_kept(fn):
    """What the backward pass keeps beyond the inputs: sorted (tag or producing primitive, shape)."""
    rows = internals.saved_residuals(fn, _JW, _JX)
    return sorted(
        (r.tag or r.source.split(" from ")[0].removeprefix("output of "), r.shape) for r in rows if not r.is_argument
    )


_CP = jax.checkpoint_policies
#: Each JAX policy remat_kit names, with what it must keep on _jax_probe (written out, not computed).
JAX_KEEPS = {
    "nothing_saveable": [],
    "dots_saveable": [("dot_general", (2, 3, 3)), ("dot_general", (2, 3, 4))],
    "dots_with_no_batch_dims_saveable": [("dot_general", (2, 3, 4))],
    "save_only_these_names": [("c", (2, 3, 4))],
}


@pytest.mark.parametrize("name", [*P.JAX_POLICIES, *P.JAX_POLICY_FACTORIES])
def test_every_named_jax_policy_saves_what_it_says(name):
    assert set(JAX_KEEPS) | {"everything_saveable"} == set(P.JAX_POLICIES + P.JAX_POLICY_FACTORIES)
    policy = P.from_jax(name, "c") if name in P.JAX_POLICY_FACTORIES else P.from_jax(name)
    kept = _jax_kept(policy(_jax_probe))
    # What is saved is exactly this, the inputs aside (everything_saveable: as without remat).
    assert kept == (_jax_kept(_jax_probe) if name == "everything_saveable" else JAX_KEEPS[name])
    upstream = _CP.save_only_these_names("c") if name in P.JAX_POLICY_FACTORIES else getattr(_CP, name)
    assert kept == _jax_kept(jax.checkpoint(_jax_probe, policy=upstream))


@pytest.mark.parametrize(
    "given, spec",
    [
        (_CP.dots_saveable, "jax:dots_saveable"),
        (_CP.checkpoint_dots, "jax:dots_saveable"),
        (_CP.checkpoint_dots_with_no_batch_dims, "jax:dots_with_no_batch_dims_saveable"),
        (_CP.save_only_these_names("value_proj", "query_proj"), "jax:save_only_these_names(query_proj,value_proj)"),
        ("jax:save_only_these_names(query_proj,mlpwo)", "jax:save_only_these_names(query_proj,mlpwo)"),
    ],
    ids=["dots", "checkpoint_dots", "no_batch_dims", "save_only_callable", "save_only_spec"],
)
def test_a_jax_policy_is_accepted_and_its_spec_round_trips(given, spec):
    policy = P.parse(given)
    assert (policy.kind, str(policy), P.parse(str(policy))) == ("jax", spec, policy)
    assert policy.tags == () and policy.plan(4) == P.LayerPlan(1, "layer")


def test_any_callable_is_a_jax_policy_named_by_its_name_and_not_parsed_back():
    # Matmuls: both remat implementations consult a policy there (remat3 never asks it about a sin).
    def save_matmuls(prim, *_, **__):
        return prim.name == "dot_general"

    policy = P.parse(save_matmuls)
    assert (
        str(policy)
        == "jax:test_any_callable_is_a_jax_policy_named_by_its_name_and_not_parsed_back.<locals>.save_matmuls"
    )
    assert policy.jax_policy is save_matmuls and hash(policy) == hash(P.parse(save_matmuls))
    assert any(k[0] == "dot_general" for k in _jax_kept(policy(_jax_probe)))
    with pytest.raises(ValueError, match=r"cannot be rebuilt from its spec; pass the callable itself"):
        P.parse(str(policy))


@pytest.mark.parametrize(
    "given, match",
    [
        ("jax:save_anything_except_these_names", "saves everything"),
        (_CP.save_anything_except_these_names("c"), "saves everything"),
        ("jax:save_only_these_names", "needs its tags"),
        ("jax:dots_saveable(c)", "write jax:NAME"),
        ("jax:offload_dot_with_no_batch_dims", "unknown JAX policy"),
    ],
    ids=["stub_spec", "stub_callable", "factory_without_tags", "plain_with_tags", "unsupported"],
)
def test_bad_jax_policies_are_clear_errors(given, match):
    with pytest.raises(ValueError, match=match):
        P.parse(given)
