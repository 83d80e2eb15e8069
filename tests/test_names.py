import pytest

from remat_kit import names


def test_vocabulary_is_unique_and_aliases_point_into_it():
    assert len(set(names.VOCABULARY)) == len(names.VOCABULARY)
    for alias, targets in names.ALIASES.items():
        assert alias not in names.VOCABULARY or targets == (alias,)
        assert all(t in names.VOCABULARY for t in targets), alias
    assert set(names.MATMUL_OUTPUTS) <= set(names.VOCABULARY)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["decoder_layer_input"], ("layer_input",)),
        (["query_proj", "key_proj", "value_proj"], ("q_proj", "k_proj", "v_proj")),
        (["qkv_proj", "q_proj"], ("q_proj", "k_proj", "v_proj")),
        (["out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"], ("attn_out", "mlp_gate", "mlp_up", "mlp_out")),
        (["context"], ("context",)),
        ((), ()),
    ],
    ids=["layer_input", "qkv", "dedupe", "mlp", "context", "empty"],
)
def test_resolve_maps_maxtext_aliases(given, expected):
    assert names.resolve(given) == expected


def test_resolve_passes_own_tags_through():
    # A typo is caught where the policy is applied, against the tags really emitted (tests/test_tags.py).
    assert names.resolve(["my_tag", "query_proj", "q_prj"]) == ("my_tag", "q_proj", "q_prj")


@pytest.mark.parametrize("bad", ["q_proj", [1], [None], [""]], ids=["bare-string", "int", "none", "empty"])
def test_resolve_type_errors(bad):
    with pytest.raises(TypeError):
        names.resolve(bad)
