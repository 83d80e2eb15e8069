"""MaxText interop: its remat_policy presets and its per-tensor custom settings, both ways."""

import pytest

from remat_kit import names
from remat_kit import policies as P

PRESETS = {
    "save_dot_with_context_except_mlp": ("q_proj", "k_proj", "v_proj", "context", "attn_out"),
    "save_dot_except_mlpwi": ("q_proj", "k_proj", "v_proj", "attn_out", "mlp_out"),
    "save_dot_except_mlp": ("q_proj", "k_proj", "v_proj", "attn_out"),
    "minimal_flash": ("q_proj", "k_proj", "v_proj", "attn_out", "mlp_gate", "mlp_up", "mlp_out", "context"),
}


@pytest.mark.parametrize(("name", "tags"), PRESETS.items(), ids=list(PRESETS))
def test_maxtext_presets_save_what_maxtext_saves(name, tags):
    policy = P.parse(name)
    assert policy.kind == "selective" and set(policy.save) == set(tags)


SETTINGS = [
    {"query_proj": "offload", "mlpwi": "remat", "mlpwo": "device"},
    {"qkv_proj": "device", "context": "device", "out_proj": "remat"},
    {"decoder_layer_input": "offload"},
    {},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["offload", "groups", "layer-input", "empty"])
def test_settings_round_trip(settings):
    policy = P.from_maxtext(settings)
    full = policy.to_maxtext()
    assert set(full) == set(P.MAXTEXT_TENSORS) and set(full.values()) <= set(P.MAXTEXT_SETTINGS)
    for tensor, setting in settings.items():
        for tag in names.resolve((tensor,)):
            name = next(k for k, v in P.MAXTEXT_TENSORS.items() if v == tag)
            assert full[name] == setting
    assert P.from_maxtext(full) == policy
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
    ],
    ids=str,
)
def test_policies_round_trip_through_maxtext(spec):
    policy = P.parse(spec)
    back = P.from_maxtext(policy.to_maxtext())
    assert back.to_maxtext() == policy.to_maxtext()
    if policy.kind != "none":  # none is everything on the device: MaxText's remat_policy 'none', not custom
        assert (back.kind, set(back.save), set(back.offload)) == (policy.kind, set(policy.save), set(policy.offload))


def test_an_auto_answer_converts():
    assert P.to_maxtext("selective:q_proj,context")["context"] == "device"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: P.from_maxtext({"q_proj": "device"}), r"unknown MaxText tensor 'q_proj'; allowed: decoder_la"),
        (lambda: P.from_maxtext({"mlpwo": "host"}), r"setting 'host'; allowed: remat, device, offload"),
        (lambda: P.from_maxtext(["mlpwo"]), r"takes a dict"),
        (lambda: P.to_maxtext("every_n:2"), r"no per-tensor MaxText equivalent"),
        (lambda: P.to_maxtext("full*2+none*2"), r"MaxText's custom remat applies one setting per tensor"),
        (lambda: P.to_maxtext("selective:attn_norm"), r"MaxText has no tensor name for \['attn_norm'\]"),
    ],
    ids=["tensor", "setting", "type", "grouping", "mix", "tag"],
)
def test_bad_maxtext_input(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
