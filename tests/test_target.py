"""Targets (remat_kit/target.py): parsing everywhere; compiling for a GPU without one where the CUDA plugin is.

The deviceless tests need JAX's CUDA plugin (``pip install 'remat-kit[gpu-target]'``) and ``JAX_PLATFORMS=cpu``;
the suite's own venv has no plugin, so they skip there, saying why, and CI runs them in a venv of their own
(.ci/run, the gpu-target section).
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest

import remat_kit
from remat_kit import target
from remat_kit.analysis import memory
from remat_kit.names import tag
from remat_kit.planning import cost

# ---- parsing: no plugin needed ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kind, gib",
    [("h100", "NVIDIA H100 80GB HBM3", 79), ("h200", "NVIDIA H200", 140), ("a100", "NVIDIA A100-SXM4-80GB", 80)],
    ids=["h100", "h200", "a100"],
)
def test_shipped_configs_parse(name, kind, gib):
    t = target.parse(name)
    assert t.compile_only and t.platform == "gpu" and t.device_kind == kind
    assert t.device_memory // 2**30 == gib and t.host_bandwidth > 0 and t.core_count > 0
    assert t.compute_capability == ((8, 0) if name == "a100" else (9, 0))
    assert target.parse(name.upper()) is t  # case-insensitive, read once


@pytest.mark.parametrize("name", ["local", None, "cpu"], ids=["local", "none", "cpu"])
def test_local_targets_compile_here(name):
    t = target.parse(name)
    assert not t.compile_only
    assert t.devices()[0].platform == "cpu"


def test_unknown_target_is_one_line_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown target 'v100'; allowed: local, cpu, h100, h200, a100") as err:
        target.parse("v100")
    assert "\n" not in str(err.value)


def test_a_users_config_file(tmp_path):
    text = target._builtin("h100").config.replace("# remat_kit host_link: PCIe 5.0 x16", "# remat_kit host_link: C2C")
    text = text.replace("pcie_bandwidth: 64000000000", "pcie_bandwidth: 450000000000")
    path = tmp_path / "gh200.txtpb"
    path.write_text(text)
    t = target.parse(str(path))
    assert t.name == str(path) and t.host_link == "C2C" and t.host_bandwidth == 450e9
    assert cost.target_hardware(t).host_bytes_per_s == pytest.approx(450e9 * cost.HOST_LINK_EFFICIENCY)


def test_a_file_that_is_no_cuda_config_is_refused(tmp_path):
    path = tmp_path / "x.txtpb"
    path.write_text('platform_name: "ROCM"\n')
    with pytest.raises(ValueError, match="not a CUDA GpuTargetConfigProto"):
        target.parse(str(path))


def test_without_the_plugin_a_gpu_target_says_what_to_install(monkeypatch):
    monkeypatch.setattr(target, "cuda_plugin_installed", lambda: False)
    target._topology.cache_clear()
    with pytest.raises(ImportError, match=r"pip install 'remat-kit\[gpu-target\]'"):
        target.parse("a100").devices()
    target._topology.cache_clear()


def test_tracing_sets_the_platform_model_code_sees():
    from remat_kit.model import attention

    assert target.traced_platform() == jax.default_backend()
    with dataclasses.replace(target.parse("cpu"), platform="gpu").tracing():  # what a GPU target's trace sees
        assert target.traced_platform() == "gpu"
        assert attention.resolve("auto", "bfloat16", 64) == "cudnn"
        assert attention.resolve("auto", "float32", 64) == "chunked"  # cuDNN takes 16-bit only
    assert attention.resolve("auto", "bfloat16", 64) == "chunked"


def test_the_cost_model_prices_the_targets_link():
    h100, a100 = cost.target_hardware(target.parse("h100")), cost.target_hardware(target.parse("a100"))
    assert h100.host_bytes_per_s == pytest.approx(2 * a100.host_bytes_per_s)  # PCIe 5.0 against 4.0
    assert h100.bytes_per_s == 3.352e12 and a100.flops_per_s == pytest.approx(312e12, rel=0.01)


def test_the_cpu_note_points_to_a_target():
    note = memory.host_offload(jax.devices("cpu")[0]).note
    assert "not modelled here" in note and "--target h100" in note


# ---- deviceless: XLA:GPU's own compile, no GPU -------------------------------------------------------------


#: Set by CI's gpu-target section: a plugin missing or not started there fails these tests instead of skipping them.
REQUIRED = os.environ.get("REMAT_KIT_REQUIRE_GPU_TARGET") == "1"


def _skip(why: str):
    (pytest.fail if REQUIRED else pytest.skip)(why)


@pytest.fixture(scope="module")
def h100():
    if not target.cuda_plugin_installed():
        _skip(f"JAX's CUDA plugin is not installed ({target.INSTALL_HINT}); CI runs these in its own venv")
    try:
        target.parse("h100").devices()
    except RuntimeError as err:  # installed, but started for a GPU it did not find
        _skip(f"the CUDA plugin did not start: run with JAX_PLATFORMS=cpu ({err})")
    return target.parse("h100")


def _make_loss(policy):
    """A 16-layer scan whose matmul output is tagged ``act`` (kept, recomputed or offloaded per policy)."""

    def layer(w, x):
        return jnp.tanh(tag(x @ w, "act"))

    def loss(ws, x):  # ws [16, 512, 512], x [8, 256, 512]
        h, _ = jax.lax.scan(lambda h, w: (policy(layer)(w, h), None), x, ws)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    return loss


WS = jax.ShapeDtypeStruct((16, 512, 512), jnp.bfloat16)
X = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16)


def test_the_devices_are_the_targets(h100):
    (device,) = h100.devices()
    assert device.platform == "gpu" and device.device_kind == "NVIDIA H100 80GB HBM3"
    assert memory.host_offload(device).enforced and memory.host_offload(device).available


def test_offload_leaves_the_device_on_a_gpu_target(h100):
    table = remat_kit.compare(_make_loss, ["none", "offload:act"], WS, X, target="h100")
    none, offload = table.reports
    assert {r.platform for r in table.reports} == {"gpu"} and offload.host_offload_enforced
    act = 16 * 8 * 256 * 512 * 2  # the 16 tagged matmul outputs, bf16
    assert offload.saved_host_bytes == act and none.saved_host_bytes == 0
    assert offload.peak_bytes < none.peak_bytes - act // 2  # the offloaded outputs are not device bytes
    assert offload.notes == () and offload.warnings == ()


def test_the_same_compare_on_cpu_counts_offload_on_the_device():
    table = remat_kit.compare(_make_loss, ["offload:act"], WS, X, target="cpu")
    (offload,) = table.reports
    assert offload.saved_host_bytes == 0 and not offload.host_offload_enforced
    assert any("not modelled here" in n for n in offload.notes)


def test_offload_is_chosen_only_where_it_lowers_the_device_need(h100):
    from remat_kit.planning.budget import Pricer
    from remat_kit.planning.planner import StepPlanner

    planner = StepPlanner(lambda p, b, s: (_make_loss(p), WS, (X,)), target="h100")
    price = Pricer(planner, planner.hardware, None, None)
    moves = remat_kit.policies.parse("offload:act")
    moves_nothing = remat_kit.policies.parse("offload:not_emitted;strict=false")  # offloads a tag the loss never emits
    assert price.choosable(moves) and price.choosable(moves_nothing)  # not compiled yet: the backend's rule
    planner.memory(moves), planner.memory(moves_nothing)
    assert price.choosable(moves)  # below selective:act, its twin on the device
    assert not price.choosable(moves_nothing)  # the same need as its twin: nothing to gain


def test_attention_takes_cudnn_on_a_gpu_target(h100):
    from remat_kit.model import attention

    q = jax.ShapeDtypeStruct((2, 512, 4, 64), jnp.bfloat16)
    loss = lambda q, k, v: attention.attend(q, k, v).astype(jnp.float32).sum()
    with h100.tracing():
        lowered = jax.jit(jax.grad(loss)).trace(*h100.abstract((q, q, q))).lower()
    assert "cudnn" in lowered.compile().as_text()


def test_a_planner_compiles_for_the_target(h100):
    from remat_kit.model.transformer import TransformerConfig
    from remat_kit.planning.builtin import Planner

    config = TransformerConfig.preset("tiny", dtype="bfloat16")
    planner = Planner(config, target="h100")
    assert planner.device.device_kind == h100.device_kind and planner.hardware.name.startswith("h100")
    device, host = planner.memory(remat_kit.policies.offload(), 2, 64)
    assert device > 0 and host > 0  # the layer inputs went to pinned host memory
    assert planner.compiler_options is None  # the CPU's -O0 shortcut is for XLA:CPU only
    two = Planner(config, target="h100", mesh="data=2")  # a deviceless topology of two H100s
    assert {d.device_kind for d in two.mesh.devices.flat} == {h100.device_kind} and two.mesh.size == 2
    assert two.memory(remat_kit.policies.full(), 4, 64)[0] > 0  # per device: a batch of 2 on each


def test_fit_returns_xla_gpus_need(h100):
    from remat_kit.model import Transformer, TransformerConfig
    from remat_kit.model.loss import lm_loss
    from remat_kit.model.transformer import abstract_params
    from remat_kit.planning.builtin import Planner

    config = TransformerConfig.preset("tiny", dtype="bfloat16")
    tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
    loss = lambda m, p, t: lm_loss(m, p, t)
    result = remat_kit.fit(
        Transformer(config=config), loss, abstract_params(config), tokens, budget="1GB", target="h100"
    )
    assert result.need_bytes == Planner(config, target="h100").memory(result.policy, 2, 64)[0]  # the H100's compile
    assert result.need_bytes != Planner(config).memory(result.policy, 2, 64)[0]  # not XLA:CPU's


# ---- the command line ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, message",
    [("v100", "unknown target 'v100'; allowed: local, cpu, h100"), ("h100", "pip install 'remat-kit[gpu-target]'")],
    ids=["unknown", "no-plugin"],
)
def test_plan_refuses_a_target_in_one_line(name, message, monkeypatch, capsys):
    from remat_kit import cli

    monkeypatch.setattr(target, "cuda_plugin_installed", lambda: False)
    assert cli.main(["plan", "--preset", "tiny", "--target", name, "--budget", "1GB", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plan_max_seq_on_a_gpu_target(h100, capsys):
    from remat_kit import cli

    argv = ["plan", "--preset", "tiny", "--dtype", "bfloat16", "--target", "h100", "--max-seq", "512"]
    argv += ["--seq-step", "256", "--budget", "1GB", "--policies", "offload", "--host-ram", "64GB", "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "target: h100 (NVIDIA H100 80GB HBM3, compile-only XLA:GPU); attention: cudnn" in out
    assert "the host has 64.00 GB: holds them: yes" in out and "not modelled here" not in out
