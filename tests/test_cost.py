"""remat_kit.planning.cost: recompute priced by a roofline, offload by the host link; auto ranks by it."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from remat_kit import policies as P
from remat_kit.model.transformer import PRESET_SHAPES, TransformerConfig
from remat_kit.planning import cost
from remat_kit.planning import fit as F

CPU = cost.DEFAULT_HARDWARE["cpu"]
GPU = cost.DEFAULT_HARDWARE["gpu"]


def _elementwise(x):
    return jnp.sum(jnp.tanh(jnp.sin(x) * 2.0))


def _grad_work(fn, x):
    return cost.work_of(jax.make_jaxpr(jax.grad(fn))(x))


def test_elementwise_recompute_costs_memory_bound_time():
    # No matmul is recomputed, so a FLOPs-only count says "free"; the roofline says bytes / bandwidth.
    x = jnp.ones((4096,), jnp.float32)
    e = cost.estimate(_grad_work(jax.checkpoint(_elementwise), x), _grad_work(_elementwise, x), CPU)
    assert e.recompute_flops > 0 and e.recompute_bytes >= 2 * 4096 * 4  # sin and tanh again: read x, write
    assert e.recompute_s == pytest.approx(
        sum(
            CPU.op_seconds(f, b) * n
            for (_, f, b), n in _grad_work(jax.checkpoint(_elementwise), x).minus(_grad_work(_elementwise, x)).ops
        ),
        rel=1e-12,
    )
    assert e.recompute_s >= e.recompute_bytes / CPU.bytes_per_s * 0.999999  # memory-bound ops dominate
    assert cost.estimate(_grad_work(_elementwise, x), _grad_work(_elementwise, x), CPU).cost_s == 0.0


def test_roofline_is_the_slower_of_compute_and_memory():
    hw = cost.Hardware("t", flops_per_s=100.0, bytes_per_s=10.0, host_bytes_per_s=1.0, overlap=0.25)
    assert hw.op_seconds(1000, 10) == 10.0 and hw.op_seconds(10, 1000) == 100.0
    assert hw.transfer_seconds(8) == 6.0  # a quarter hidden behind compute


def test_scan_bodies_count_once_per_trip():
    w = jnp.ones((8, 8))

    def scanned(x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]

    def unrolled(x):
        for _ in range(5):
            x = jnp.tanh(x @ w)
        return x

    x = jnp.ones((4, 8))
    a, b = cost.work_of(jax.make_jaxpr(scanned)(x)), cost.work_of(jax.make_jaxpr(unrolled)(x))
    assert a.flops == b.flops == 5 * (2 * 4 * 8 * 8 + 4 * 8)
    assert a.seconds(CPU) == pytest.approx(b.seconds(CPU), rel=1e-12)


def test_offload_is_priced_by_the_bytes_over_the_host_link():
    def f(x):
        return jnp.sum(jnp.sin(checkpoint_name(jnp.sin(x), "h")))

    x = jnp.ones((1024,), jnp.float32)
    off = _grad_work(P.offload(["h"])(f), x)
    assert off.host_bytes == 2 * 1024 * 4  # out in the forward pass, back in the backward
    base = _grad_work(f, x)
    moved = cost.estimate(off, base, GPU, host_moves=True)
    assert moved.offload_bytes == 2 * 1024 * 4
    assert moved.offload_s == pytest.approx(2 * 1024 * 4 / GPU.host_bytes_per_s * (1 - GPU.overlap), rel=1e-12)
    assert cost.estimate(off, base, GPU, host_moves=False).offload_s == 0.0  # XLA:CPU moves nothing


def test_ties_go_to_less_recompute_of_any_kind():
    a = cost.Estimate(0.0, 0.0, 0, 0, 0)
    b = cost.Estimate(0.0, 0.0, 0, 10, 0)
    c = cost.Estimate(0.0, 0.0, 5, 0, 0)
    assert sorted([c, b, a], key=lambda e: e.rank) == [a, b, c]


def test_calibration_measures_this_machine():
    hw = cost.calibrate(seconds=0.05)
    assert hw.calibrated and hw.flops_per_s > 1e8 and hw.bytes_per_s > 1e8
    assert hw.host_bytes_per_s == cost.default_hardware().host_bytes_per_s
    assert "calibrated on this machine" in hw.describe() and "defaults" in CPU.describe()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: cost.Hardware("x", 0, 1, 1), r"flops_per_s must be a positive number, got 0"),
        (lambda: cost.Hardware("x", 1, 1, 1, overlap=2), r"overlap must be in \[0, 1\], got 2"),
        (lambda: cost.default_hardware("abacus"), r"no cost-model defaults for backend 'abacus'; allowed: cpu"),
    ],
    ids=["peak", "overlap", "backend"],
)
def test_bad_hardware(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- a comfortable budget gives none --------------------------------------------------------------------


@pytest.mark.onejax  # a budget search over the presets (pyproject)
@pytest.mark.parametrize(
    ("preset", "shape"), [("tiny", (8, 128)), ("small", PRESET_SHAPES["small"])], ids=["tiny", "small"]
)
def test_comfortable_budget_gives_none(preset, shape):
    # The FLOPs-only ranking answered `selective` here: its softmax and norm recompute counted as free.
    cfg = TransformerConfig.preset(preset)
    r = F.auto(cfg, batch=shape[0], seq=shape[1], budget_bytes=10**12)
    assert r.chosen == P.none()
    rows = {c.policy: c for c in r.candidates}
    assert rows["selective"].recompute_flops == 0 < rows["selective"].cost_s  # free in matmuls, not in time
    assert r.candidates[0].policy == "none" and r.compiled == 1


def _mlp_loss(policy):
    def loss(params, x):
        def layer(h, w):
            return jnp.tanh(h @ w)

        for w in params:
            x = policy(layer)(x, w) if policy.remat else layer(x, w)
        return jnp.mean(x**2)

    return loss


def test_comfortable_budget_gives_none_for_a_user_model():
    params = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 3
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    r = F.auto(_mlp_loss, params, x, budget_bytes=10**12, exhaustive=True)
    rows = {c.policy: c for c in r.candidates}
    assert rows["dots"].recompute_flops == 0 < rows["dots"].cost_s  # dots recomputes the tanh
    assert r.chosen == P.none()


def test_offload_is_never_chosen_where_it_moves_nothing():
    cfg = TransformerConfig.preset("tiny", num_layers=2)
    r = F.auto(cfg, batch=2, seq=32, budget_bytes=10**12, candidates=["minimal_offloaded", "full"], mixes=False)
    rows = {c.policy: c for c in r.candidates}
    off = rows[str(P.parse("minimal_offloaded"))]
    assert off.fits and off.rank < rows["full"].rank  # cheaper and fitting, yet not the answer on CPU
    assert r.chosen == P.full()
    assert "never chosen here" in "\n".join(r.table())


def test_table_shows_the_estimate_beside_the_flops():
    cfg = TransformerConfig.preset("tiny", num_layers=2)
    hw = dataclasses.replace(CPU, name="probe", calibrated=True)
    r = F.auto(cfg, batch=2, seq=32, budget_bytes=10**12, candidates=["none", "full"], hardware=hw)
    rows = r.table()
    assert "recompute" in rows[0] and "est." in rows[0]
    assert rows[-1].startswith("cost model: probe (calibrated on this machine)")
    assert r.to_dict()["hardware"]["name"] == "probe" and r.to_dict()["candidates"][1]["cost_s"] > 0
