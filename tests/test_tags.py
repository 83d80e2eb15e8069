"""The one tag rule (remat_kit.policies.tags): what is missing, the nearest emitted name, checked once."""

import jax
import jax.numpy as jnp
import pytest

from remat_kit import policies as P
from remat_kit.names import tag
from remat_kit.policies import tags


def _f(x):
    return jnp.sum(tag(jnp.sin(tag(x * 2, "mlp_gate")), "mlp_up"))


X = jax.ShapeDtypeStruct((3,), jnp.float32)


def test_emitted_tags_are_read_from_the_trace():
    assert tags.emitted_tags(_f, X) == {"mlp_gate", "mlp_up"}


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        (P.selective(["mlp_upp"]), r"never emits: mlp_upp \(did you mean 'mlp_up'\?\); it emits: mlp_gate, mlp_up$"),
        (P.parse("save_qkv_proj"), r"never emits: q_proj, k_proj, v_proj; it emits: mlp_gate, mlp_up$"),
        (P.offload(["zzz"], save=["mlp_gate"]), r"never emits: zzz; it emits"),
    ],
    ids=["misspelt", "maxtext-preset", "offload-unrelated"],
)
def test_check_names_missing_tags_and_the_nearest(policy, match):
    with pytest.raises(ValueError, match=match):
        tags.check(policy, tags.emitted_tags(_f, X), "f")


def test_check_passes_and_strict_false_skips():
    tags.check(P.selective(["mlp_up"]), {"mlp_up"}, "f")
    tags.check(P.selective(["nope"], strict=False), set(), "f")
    assert not tags.needs_check(P.selective(["nope"], strict=False))
    assert not tags.needs_check(P.full()) and tags.needs_check(P.offload())


def test_check_traced_traces_once_per_signature(monkeypatch):
    calls = []
    real = tags.emitted_tags
    monkeypatch.setattr(tags, "emitted_tags", lambda *a: calls.append(1) or real(*a))
    policy = P.selective(["mlp_gate"])
    for x in (jnp.ones(3), jnp.zeros(3), jnp.ones(4)):
        tags.check_traced(policy, "f", _f, x, key="test_check_traced")
    assert len(calls) == 2
    tags.check_traced(policy, "f", _f, jnp.ones(3))  # no key: always traced
    assert len(calls) == 3


def test_signature_keys_arrays_by_shape_and_flags_by_value():
    a, b = jnp.ones((2, 3)), jnp.zeros((2, 3), jnp.int32)
    assert tags.signature((a, True)) != tags.signature((b, True))
    assert tags.signature((a, True)) != tags.signature((a, False))
    assert tags.signature(([1],)) is not None and tags.signature(({1: []},)) is not None
    assert tags.signature((object.__new__(type("Unhashable", (), {"__hash__": None})),)) is None


def test_once_remembers_passed_checks_only_and_never_an_unhashable_key():
    calls = []

    def failing():
        calls.append("fail")
        raise ValueError("no")

    for _ in range(2):
        with pytest.raises(ValueError):
            tags.once(("test_once", "fails"), failing)
    assert calls == ["fail", "fail"]  # a check that raised runs again
    for _ in range(2):
        tags.once(("test_once", []), lambda: calls.append("unhashable"))
    assert calls.count("unhashable") == 2
    assert tags.hashable(("test_once", [])) is None and tags.hashable(("test_once", 1)) == ("test_once", 1)


def test_once_is_bounded(monkeypatch):
    monkeypatch.setattr(tags, "_MAX_CHECKED", 2)
    monkeypatch.setattr(tags, "_CHECKED", type(tags._CHECKED)())
    for i in range(3):
        tags.once(("test_once_bounded", i), lambda: None)
    assert list(tags._CHECKED) == [("test_once_bounded", 1), ("test_once_bounded", 2)]  # the oldest went first
