"""MaxText interop: its remat_policy presets and its per-tensor custom settings, both ways."""

import pytest

from remat_kit import names
from remat_kit import policies as P

PRESETS = {
    "save_dot_with_context_except_mlp": ("q_proj", "k_proj", "v_proj", "context", "attn_out"),
    "save_dot_except_mlpwi": ("q_proj", "k_proj", "v_proj", "attn_out", "mlp_out"),
    "save_dot_except_mlp": ("q_proj", "k_proj", "v_proj", "attn_out"),
    "minimal_flash": ("q_proj", "k_proj", "v_proj", "attn_out", "mlp_gate", "mlp_up", "mlp_out", "context"),
    "minimal_with_quantization": (
        "q_proj",
        "k_proj",
        "v_proj",
        "attn_out",
        "mlp_gate",
        "mlp_up",
        "mlp_out",
        "quantization",
    ),
}

#: MaxText's remat settings as its configs/base.yml ships them (MaxText main, 2026): every tensor named.
MAXTEXT_DEFAULTS = {
    "remat_policy": "full",
    "decoder_layer_input": "device",
    "indexer_cutoff_threshold": "remat",
    "context": "remat",
    "mlpwi": "remat",
    "mlpwi_0": "remat",
    "mlpwi_1": "remat",
    "mlpwo": "remat",
    "moe_mlpwi_0": "remat",
    "moe_mlpwi_1": "remat",
    "moe_mlpwo": "remat",
    "query_proj": "remat",
    "key_proj": "remat",
    "value_proj": "remat",
    "kv_proj": "remat",
    "qkv_proj": "remat",
    "out_proj": "remat",
    "query_wa_proj": "remat",
    "kv_wa_proj": "remat",
    "mla_q": "remat",
    "mla_kv": "remat",
    "attention_out": "remat",
    "engram": "remat",
}

#: remat_policy values from MaxText's decoders.py get_remat_policy (all but custom, which the settings say).
MAXTEXT_POLICY_NAMES = (
    "none",
    "full",
    "minimal",
    "minimal_with_context",
    "minimal_flash",
    "minimal_with_quantization",
    "minimal_with_context_and_quantization",
    "save_dot_with_context_except_mlp",
    "save_dot_except_mlpwi",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "qkv_proj_offloaded",
    "minimal_offloaded",
    "save_out_proj",
)


@pytest.mark.parametrize(("name", "tags"), PRESETS.items(), ids=list(PRESETS))
def test_maxtext_presets_save_what_maxtext_saves(name, tags):
    policy = P.parse(name)
    assert policy.kind == "selective" and set(policy.save) == set(tags)


def test_every_maxtext_tensor_and_policy_name_is_known():
    assert set(P.MAXTEXT_TENSORS) == set(MAXTEXT_DEFAULTS) - {"remat_policy"}
    assert set(P.MAXTEXT_REMAT_POLICIES) == {*MAXTEXT_POLICY_NAMES, "custom"}


@pytest.mark.parametrize("name", MAXTEXT_POLICY_NAMES, ids=str)
def test_maxtext_remat_policy_names_are_their_presets(name):
    # Any remat_policy but custom is that preset; the per-tensor settings are ignored, as MaxText ignores them.
    got = P.from_maxtext({**MAXTEXT_DEFAULTS, "remat_policy": name, "query_proj": "device"})
    assert got == P.parse(name)


def _custom(**changes):
    return P.from_maxtext({**MAXTEXT_DEFAULTS, "remat_policy": "custom", **changes})


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, "full"),
        (
            {"query_proj": "device", "key_proj": "device", "value_proj": "device", "mlpwo": "device"},
            "selective:q_proj,k_proj,v_proj,mlp_out",
        ),
        ({"qkv_proj": "device"}, "selective:q_proj,k_proj,v_proj"),  # a fused model's group: most kept wins
        ({"mlpwi_0": "device", "mlpwi_1": "offload"}, "offload:mlp_up;save=mlp_gate"),
        ({"mlpwi": "offload", "mlpwi_0": "device"}, "offload:mlp_up;save=mlp_gate"),
        ({"kv_proj": "device"}, "selective:k_proj,v_proj"),
        ({"attention_out": "device"}, "selective:context"),
        ({"context": "offload", "attention_out": "device"}, "selective:context"),
        ({"decoder_layer_input": "offload", "out_proj": "device"}, "offload:layer_input;save=attn_out"),
        ({"mla_q": "remat", "engram": "remat", "moe_mlpwo": "remat"}, "full"),
    ],
    ids=[
        "defaults",
        "individual-over-group",
        "group",
        "members",
        "group-and-member",
        "kv",
        "attention_out",
        "context-most-kept",
        "layer-input",
        "no-equivalent-remat",
    ],
)
def test_maxtext_full_settings(changes, expected):
    assert str(_custom(**changes)) == expected


def test_none_is_maxtexts_none_not_custom():
    # custom with every tensor on the device still recomputes what MaxText does not name (norms, activations).
    assert P.to_maxtext("none") == {"remat_policy": "none"}
    assert P.from_maxtext({"remat_policy": "none"}) == P.none()


SETTINGS = [
    {"query_proj": "offload", "mlpwi": "remat", "mlpwo": "device"},
    {"qkv_proj": "device", "context": "device", "out_proj": "remat"},
    {"decoder_layer_input": "offload"},
    {},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["offload", "groups", "layer-input", "empty"])
def test_settings_round_trip(settings):
    policy = P.from_maxtext(settings)
    out = policy.to_maxtext()
    assert out["remat_policy"] == "custom" and set(out) == {"remat_policy", *P.MAXTEXT_TENSORS}
    assert set(out.values()) - {"custom"} <= set(P.MAXTEXT_SETTINGS)
    for tensor, setting in settings.items():
        for tag in names.resolve((tensor,)):
            assert out[next(k for k, v in P.MAXTEXT_TENSORS.items() if v == (tag,))] == setting
    assert P.from_maxtext(out) == policy
    assert P.from_maxtext({**MAXTEXT_DEFAULTS, **out}) == policy  # pasted over MaxText's base.yml
    assert P.parse(str(policy)) == policy


@pytest.mark.parametrize(
    "spec",
    [
        "none",
        "full",
        "selective",
        "minimal",
        "save_qkv_proj",
        "offload",
        "qkv_proj_offloaded",
        "save_dot_with_context_except_mlp",
        "selective:q_proj,mlp_gate",
    ],
    ids=str,
)
def test_policies_round_trip_through_maxtext(spec):
    policy = P.parse(spec)
    assert P.from_maxtext(policy.to_maxtext()) == policy


def test_a_group_is_written_when_its_members_agree():
    s = P.to_maxtext("selective:q_proj,k_proj,v_proj,mlp_gate,context")
    assert (s["qkv_proj"], s["kv_proj"], s["query_proj"]) == ("device", "device", "device")
    assert (s["mlpwi"], s["mlpwi_0"], s["mlpwi_1"]) == ("remat", "device", "remat")  # a fused value cannot split
    assert s["context"] == s["attention_out"] == "device" and s["mla_q"] == s["engram"] == "remat"


def test_an_auto_answer_converts():
    assert P.to_maxtext("selective:q_proj,context")["context"] == "device"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: P.from_maxtext({"q_proj": "device"}), r"unknown MaxText tensor 'q_proj'; allowed: remat_policy, deco"),
        (lambda: P.from_maxtext({"mlpwo": "host"}), r"setting 'host'; allowed: remat, device, offload"),
        (
            lambda: P.from_maxtext({"mla_q": "device"}),
            r"'mla_q' is a value remat_kit's block does not compute .*'remat'",
        ),
        (lambda: P.from_maxtext({"remat_policy": "fastest"}), r"unknown MaxText remat_policy 'fastest'; allowed: none"),
        (lambda: P.from_maxtext(["mlpwo"]), r"takes a dict"),
        (lambda: P.to_maxtext("every_n:2"), r"no per-tensor MaxText equivalent"),
        (lambda: P.to_maxtext("jax:dots_saveable"), r"no per-tensor MaxText equivalent"),
        (lambda: P.to_maxtext("full*2+none*2"), r"MaxText's custom remat applies one setting per tensor"),
        (lambda: P.to_maxtext("selective:attn_norm"), r"MaxText has no tensor name for \['attn_norm'\]"),
    ],
    ids=["tensor", "setting", "no-equivalent", "remat-policy", "type", "grouping", "jax", "mix", "tag"],
)
def test_bad_maxtext_input(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
