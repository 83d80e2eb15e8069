"""Sharded training math on 4 simulated CPU devices (set in conftest)."""

import functools

import jax
import numpy as np
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err

from remat_kit.model.loss import lm_loss
from remat_kit.model.transformer import Transformer, TransformerConfig, init_params
from remat_kit.step import mesh as M
from remat_kit.train import distributed as D


def test_four_simulated_devices():
    assert len(jax.devices()) == 4


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("data=4", M.MeshSpec(4, 1)),
        ("data=2,fsdp=2", M.MeshSpec(2, 2)),
        ("fsdp=4", M.MeshSpec(1, 4)),
        ("", M.MeshSpec()),
    ],
    ids=["data", "both", "fsdp", "empty"],
)
def test_parse_mesh(spec, expected):
    assert M.MeshSpec.parse(spec) == expected
    assert M.MeshSpec.parse(str(expected)) == expected


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("model=4", r"unknown axis in 'model=4'; allowed axes: data, fsdp"),
        ("data=2,data=2", r"axis 'data' given twice"),
        ("data=two", r"size of 'data' must be an integer, got 'two'"),
        ("data=0", r"mesh axis data must be a positive integer, got 0"),
        ("data", r"axis 'data' needs a size; the '=N' is missing"),
    ],
    ids=["unknown-axis", "repeated", "non-int", "zero", "no-size"],
)
def test_bad_mesh_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        M.MeshSpec.parse(spec)


def test_axis_sizes_must_multiply_to_device_count():
    with pytest.raises(ValueError, match=r"mesh data=2,fsdp=1 needs 2 devices but 4 are available"):
        M.make_mesh("data=2")


def test_batch_must_divide_over_data_parallel_devices():
    mesh = M.make_mesh("data=2,fsdp=2")
    M.check_batch(8, mesh)
    with pytest.raises(ValueError, match=r"batch 6 is not divisible by the data-parallel device count 4"):
        M.check_batch(6, mesh)


def test_fsdp_shards_largest_divisible_dim_and_never_the_layer_axis():
    cfg = TransformerConfig.preset("tiny")
    params = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
    shardings = M.tree_shardings(params, M.make_mesh("fsdp=4"))
    for path, s in jax.tree_util.tree_leaves_with_path(shardings):
        keys = [getattr(k, "key", None) for k in path]
        spec = tuple(s.spec)
        if "layers" in keys and spec:
            assert spec[0] is None, path
    q = shardings["layers"]["layers"]["q_proj"]["kernel"].spec  # [L=4, 64, 64]
    assert tuple(q) == (None, None, "fsdp")
    assert tuple(shardings["embed"]["embedding"].spec) == ("fsdp", None)  # [256, 64]
    assert tuple(M.tree_shardings(params, M.make_mesh("data=4"))["embed"]["embedding"].spec) == ()


def _loss_and_grads(cfg, spec, params, tokens, mesh=None):
    model = Transformer(config=cfg, policy=spec)
    f = jax.value_and_grad(lambda p, t: lm_loss(model, p, t))
    if mesh is None:
        return jax.jit(f)(params, tokens)
    shardings = M.tree_shardings(params, mesh)
    params = jax.device_put(params, shardings)
    tokens = jax.device_put(tokens, M.batch_sharding(mesh))
    loss, grads = jax.jit(f, out_shardings=(None, shardings))(params, tokens)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(shardings), strict=True):
        assert g.sharding.is_equivalent_to(s, g.ndim)  # gradients come back sharded like the parameters
    return loss, grads


# Every policy on one mesh (both meshes covered, offload and the grouped scans under FSDP): sharding
# and the policy are independent, and each case compiles the step twice instead of three times.
_MESH_OF = {
    "none": "data=4",
    "full": "data=2,fsdp=2",
    "every_n:2": "data=4",
    "selective": "data=4",
    "offload": "data=2,fsdp=2",
    "segments:2": "data=2,fsdp=2",
    "sqrt_n": "data=4",
    "dots": "data=2,fsdp=2",
}
assert set(_MESH_OF) == set(ALL_SPECS), "give every policy kind a mesh"


@pytest.mark.parametrize(("spec", "mesh_spec"), list(_MESH_OF.items()), ids=str)
def test_every_policy_same_loss_and_grads_sharded(spec, mesh_spec):
    cfg = TransformerConfig.preset("tiny", num_layers=3)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab_size)
    loss0, grads0 = _loss_and_grads(cfg, spec, params, tokens)
    loss, grads = _loss_and_grads(cfg, spec, params, tokens, M.make_mesh(mesh_spec))
    assert abs(float(loss) - float(loss0)) <= RTOL_F32 * abs(float(loss0))
    assert max_rel_err(jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, grads0)) <= RTOL_F32


def test_distributed_initialize_only_when_configured(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(D, "_answer_roll_call", lambda *_: None)  # no process 0 to report to here
    assert D.maybe_initialize_distributed({}) is False
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert D.maybe_initialize_distributed(env) is True
    assert calls == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}]
    assert D.maybe_initialize_distributed({"REMAT_KIT_DISTRIBUTED": "1"}) is True and calls[-1] == {}


@pytest.mark.parametrize(
    ("kwargs", "env", "expected"),
    [
        ({}, {}, None),
        ({}, {"REMAT_KIT_DISTRIBUTED": "1", "REMAT_KIT_DISTRIBUTED_TIMEOUT": "7"}, D.Processes(timeout_s=7)),
        (
            {"coordinator": "127.0.0.1:5", "num_processes": 2},
            {"JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "10.0.0.9:9"},
            D.Processes("127.0.0.1:5", 2, 1),
        ),
        (
            {},
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"},
            D.Processes("h:1", 4, 3),
        ),
    ],
    ids=["single", "auto-detect", "flags-over-env", "env"],
)
def test_processes_from_flags_then_environment(kwargs, env, expected):
    assert D.Processes.resolve(**kwargs, env=env) == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"coordinator": "localhost", "num_processes": 2, "process_id": 0},
            r"coordinator must be HOST:PORT \(e.g. 10.0.0.1:1234\), got 'localhost'",
        ),
        ({"coordinator": "h:1", "num_processes": 2}, r"without the process count and this process's id"),
        ({"num_processes": 2, "process_id": 1}, r"2 processes \(this one 1\) need a coordinator"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, r"process_id 2 must be smaller than num_"),
        ({"coordinator": "h:1", "num_processes": 0, "process_id": 0}, r"num_processes must be an integer >= 1"),
        ({"timeout_s": 0}, r"timeout_s must be an integer >= 1, got 0"),
    ],
    ids=["no-port", "no-id", "no-coordinator", "id-too-big", "zero-processes", "zero-timeout"],
)
def test_bad_process_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.Processes.resolve(**kwargs, env={"REMAT_KIT_DISTRIBUTED": "1"})


def test_a_bad_timeout_is_refused_with_one_process_too():
    with pytest.raises(ValueError, match=r"timeout_s must be an integer >= 1, got -5"):
        D.Processes.resolve(timeout_s=-5, env={})  # returned None (one process) without a word


def test_bad_process_setting_from_environment():
    with pytest.raises(ValueError, match=r"JAX_NUM_PROCESSES must be an integer, got 'two'"):
        D.Processes.resolve(env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two"})


def test_each_process_contributes_an_equal_share_of_the_mesh():
    assert D.Processes("h:1", 2, 1).local_devices("data=2,fsdp=2") == 2
    assert D.Processes("h:1", 4, 0).local_devices("data=4") == 1
    with pytest.raises(ValueError, match=r"mesh data=2,fsdp=3 has 6 devices, which 4 processes cannot share evenly"):
        D.Processes("h:1", 4, 0).local_devices("data=2,fsdp=3")


def test_one_process_feeds_the_whole_batch():
    mesh = M.make_mesh("data=2,fsdp=2")
    assert M.local_rows(8, mesh) == slice(0, 8)
    tokens = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    x = M.global_batch(tokens, 8, mesh)
    assert x.sharding.is_equivalent_to(M.batch_sharding(mesh), 2)
    np.testing.assert_array_equal(np.asarray(x), tokens)


def test_one_process_always_agrees_with_itself_and_differences_are_named():
    D.check_same_across_processes({"lr": 1})  # no other process: nothing to compare
    a = {"config": {"lr": 0.1, "model": {"d": 64}}, "mesh": "data=2"}
    b = {"config": {"lr": 0.2, "model": {"d": 64}}, "mesh": "data=4"}
    assert D._differing_fields(a, b) == ["config.lr (0.1 vs 0.2)", "mesh ('data=2' vs 'data=4')"]


def test_batch_rows_read_only_that_part_of_the_global_batch():
    from remat_kit.train import data

    batches = data.Batches(np.arange(4000, dtype=np.int64).astype(np.uint8), batch_size=4, seq_len=16, seed=3)
    for position in (0, 7, 300):  # 300 is past the first epoch
        whole = batches.batch(position)
        for rows in (slice(0, 2), slice(2, 4), slice(1, 3)):
            np.testing.assert_array_equal(batches.batch(position, rows=rows), whole[rows])
    with pytest.raises(ValueError, match=r"rows must be a contiguous slice of the batch"):
        batches.batch(0, rows=slice(0, 4, 2))
