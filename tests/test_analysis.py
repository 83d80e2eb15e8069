"""planning.analysis and analysis.flops on the tiny preset, against bytes and FLOPs computed by hand."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from remat_kit import names, policies
from remat_kit.analysis import flops
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning import analysis, estimates

# XLA's default attention: the analytic attention FLOPs (full s², no skipped blocks) hold exactly.
CFG = TransformerConfig.preset("tiny", attention="xla")
B, S = 2, 32
L, D, V, F = CFG.num_layers, CFG.d_model, CFG.vocab_size, CFG.d_ff
F32 = 4


@pytest.fixture(scope="module")
def results():
    specs = ["none", "full", "every_n:2", "selective", "offload", "sqrt_n"]
    return {s: analysis.analyze(CFG, s, B, S) for s in specs}


def test_full_keeps_exactly_the_layer_inputs(results):
    a = results["full"]
    assert a.layers_saved_bytes == L * B * S * D * F32
    layers = [r for r in a.residuals if r.region == "layers"]
    assert [(r.shape, r.label) for r in layers] == [((L, B, S, D), names.LAYER_INPUT)]


def test_logits_are_kept_exactly_once_and_chunking_removes_them(results):
    for spec, a in results.items():
        logits = [r for r in a.residuals if r.region == "head" and r.shape == (B, S, V)]
        assert sum(r.nbytes for r in logits) == B * S * V * F32, spec
        assert a.estimates.logits == B * S * V * F32
    chunked = analysis.analyze(CFG, "full", B, S, loss_chunks=4)
    assert not [r for r in chunked.residuals if len(r.shape) == 3 and r.shape[-1] == V]
    assert chunked.saved_bytes < results["full"].saved_bytes
    # The fused loss keeps the gradients it took in the forward pass, labelled as such.
    grads = {r.label: (r.shape, r.nbytes) for r in chunked.residuals if "(fused loss)" in r.label}
    assert grads == {
        "output matrix gradient (fused loss)": ((D, V), D * V * F32),
        "hidden-state gradient (fused loss)": ((4, B * S // 4, D), B * S * D * F32),
    }
    assert chunked.flops == results["full"].flops  # nothing recomputed: the plain loss's matmuls


def test_offload_marks_the_layer_inputs_host_but_cpu_keeps_them_on_device(results):
    a = results["offload"]
    assert all(r.host for r in a.residuals if r.region == "layers")
    assert sum(r.nbytes for r in a.residuals if r.host) == L * B * S * D * F32
    # XLA:CPU lowers the device-to-host copy to nothing: the one host rule counts them as device bytes.
    assert a.layers_saved_host_bytes == a.saved_host_bytes == 0
    assert a.layers_saved_bytes == results["full"].layers_saved_bytes == L * B * S * D * F32
    assert any("no memory moves" in n for n in a.notes)


def test_selective_keeps_only_its_tags_and_the_layer_inputs(results):
    a = results["selective"]
    allowed = {*policies.SELECTIVE_DEFAULT, names.LAYER_INPUT}
    layer_tags = {t for r in a.residuals if r.region == "layers" for t in r.tags}
    assert layer_tags and layer_tags <= allowed
    # Per token: q, context, attn_out (d wide), k and v (kv_heads·head_dim), gate and up (d_ff), and
    # the layer input. mlp_out is tagged for saving but the backward pass never needs it.
    kv = CFG.num_kv_heads * CFG.head_dim
    assert a.layers_saved_bytes == L * B * S * (3 * D + 2 * kv + 2 * F + D) * F32


def test_every_n_keeps_no_weight_slices(results):
    # Its non-rematerialized layers run under _layers.keep_all: views are recomputed.
    assert not [r for r in results["every_n:2"].residuals if r.label.startswith("weight ")]


def test_saved_bytes_order_policies(results):
    saved = {s: a.layers_saved_bytes for s, a in results.items()}
    assert saved["sqrt_n"] < saved["full"] < saved["selective"] < saved["none"]
    assert saved["full"] < saved["every_n:2"] < saved["none"]
    temp = {s: a.memory.temp for s, a in results.items()}
    assert temp["full"] < temp["none"]
    assert all(a.memory.argument > 0 and a.memory.alias > 0 for a in results.values())  # donated state


def test_flops_of_none_match_the_analytic_count(results):
    a = results["none"]
    kv = CFG.num_kv_heads * CFG.head_dim
    # Weights: q and attn_out d×d, k and v d×kv, three d×f MLP matrices per layer, and the d×V head.
    expected = 6 * (L * (2 * D * D + 2 * D * kv + 3 * D * F) + D * V) * B * S + 12 * L * B * S * S * D
    assert a.analytic.none == expected
    assert a.flops == expected


def test_flops_of_remat_policies_lie_between_none_and_one_extra_forward(results):
    none, bound = results["none"].flops, results["none"].analytic.full
    for spec in ("full", "every_n:2", "sqrt_n"):
        assert none < results[spec].flops <= bound, spec
    assert none <= results["selective"].flops < results["full"].flops


def test_xla_cost_analysis_counts_the_scan_once(results):
    # The reason flops are counted from the jaxpr: XLA's figure misses (L - 1) layers.
    a = results["none"]
    assert a.xla_flops < a.flops / 2


def test_jaxpr_flops_multiplies_scan_bodies():
    w = jnp.ones((8, 8))

    def scanned(x):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=7)[0]

    def unrolled(x):
        for _ in range(7):
            x = x @ w
        return x

    x = jnp.ones((4, 8))
    assert flops.jaxpr_flops(jax.make_jaxpr(scanned)(x)) == flops.jaxpr_flops(jax.make_jaxpr(unrolled)(x))
    assert flops.jaxpr_flops(jax.make_jaxpr(unrolled)(x)) == 7 * 2 * 4 * 8 * 8


def test_estimates_reproduce_the_seed():
    e = estimates.estimates(TransformerConfig.preset("2b"), 2, 1024)
    assert e.layer_inputs == 2 * 2 * 1024 * 2048 * 28
    assert e.logits == 2 * 1024 * 248_000 * 4
    assert e.korthikanti == 34 * 2 * 1024 * 2048 * 28


def test_to_dict_is_json_ready(results):
    import json

    record = results["selective"].to_dict(top=3)
    assert len(record["residuals"]) == 3
    assert json.loads(json.dumps(record))["saved_bytes"] == results["selective"].saved_bytes


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch": 0}, ValueError, "batch must be a positive integer"),
        ({"seq": 0}, ValueError, "seq must be a positive integer"),
        ({"seq": CFG.max_seq_len + 1}, ValueError, "exceeds the model's max_seq_len"),
        ({"batch": 2.0}, TypeError, "batch must be a positive integer"),
        ({"loss_chunks": -1}, ValueError, "loss_chunks"),
        ({"policy": "fulll"}, ValueError, "unknown policy spec"),
        ({"policy": "every_n:9"}, ValueError, "greater than the depth"),
    ],
    ids=["batch0", "seq0", "seq_too_long", "batch_float", "chunks", "policy", "every_n_depth"],
)
def test_bad_input_is_rejected_before_tracing(kwargs, error, message):
    args = {"config": CFG, "policy": "full", "batch": B, "seq": S, **kwargs}
    with pytest.raises(error, match=message):
        analysis.analyze(**args)


def test_analysis_is_frozen(results):
    with pytest.raises(dataclasses.FrozenInstanceError):
        results["full"].saved_bytes = 0


def test_breakdown_finds_materialized_attention_probabilities(results):
    # XLA attention keeps the [b, h, s, s] probabilities (at least once, in float32 here) ...
    H = CFG.num_heads
    parts = analysis.breakdown(results["none"])
    assert parts["attention scores"] >= L * B * H * S * S * F32
    assert sum(parts.values()) == results["none"].layers_saved_bytes
    # ... flash-style chunked attention keeps no [s, s] tensor at all.
    chunked = analysis.analyze(dataclasses.replace(CFG, attention="chunked"), "none", B, S)
    assert "attention scores" not in analysis.breakdown(chunked)
    assert chunked.layers_saved_bytes < results["none"].layers_saved_bytes
