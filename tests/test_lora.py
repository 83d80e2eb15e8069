"""LoRA adapters and the int8 / NF4 bases: equal gradients under every policy, a frozen base, exact resume."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err
from flax import traverse_util

from remat_kit import _jax_internals, train
from remat_kit.model import lora, nf4
from remat_kit.model.loss import lm_loss
from remat_kit.model.transformer import Transformer, TransformerConfig, init_params
from remat_kit.step import update as step_lib
from remat_kit.train import data
from remat_kit.train.checkpoint import Checkpoints

LORA = TransformerConfig.preset("tiny", lora_rank=4, lora_targets=("q_proj", "v_proj", "mlp_out"))
QLORA = TransformerConfig.preset("tiny", lora_rank=4, lora_targets=lora.TARGETS, quantize="int8")
NF4 = TransformerConfig.preset("tiny", lora_rank=4, lora_targets=("q_proj", "v_proj", "mlp_out"), quantize="nf4")

#: Relative tolerance of a whole model's float32 outputs (house rule: 1e-4 for the model).
MODEL_RTOL = 1e-4

#: Relative error of the int8 model's logits against the float model's (per-channel absmax int8
#: rounds each weight by at most half a step, 1/254 of its channel's largest entry).
QUANT_LOGITS_RTOL = 2e-2
#: The same for the NF4 base at random init (4 bits: 16 levels per 64-block's absmax).
NF4_LOGITS_RTOL = 0.5


@pytest.fixture(scope="module")
def lora_params():
    # Adapters made non-zero, so gradients reach A as well as B.
    params = init_params(LORA, jax.random.key(0))
    t, f = lora.partition(params)
    t = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape), t)
    return t, f


@pytest.fixture(scope="module")
def reference_grads(lora_params, tokens_m):
    return _adapter_grads("none", *lora_params, tokens_m)


@pytest.fixture(scope="module")
def tokens_m():
    return jax.random.randint(jax.random.key(1), (2, 16), 0, 256, dtype=jnp.int32)


def _adapter_grads(spec, trainable, frozen, tokens):
    model = Transformer(config=LORA, policy=spec)
    return jax.jit(jax.grad(lambda t: lm_loss(model, lora.combine(t, frozen), tokens)))(trainable)


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if s != "none"], ids=str)
def test_adapter_gradients_equal_under_every_policy(lora_params, reference_grads, tokens_m, spec):
    grads = _adapter_grads(spec, *lora_params, tokens_m)
    assert max_rel_err(grads, reference_grads) < RTOL_F32


def test_partition_holds_only_adapters(lora_params, reference_grads):
    trainable, frozen = lora_params
    names = {path[-1] for path in _paths(trainable)}
    assert names == {"lora_a", "lora_b"}
    assert {path[-2] for path in _paths(trainable)} == {"q_proj", "v_proj", "mlp_out"}
    assert all(path[-1] not in lora.ADAPTER_NAMES for path in _paths(frozen))
    assert sum(x.size for x in jax.tree.leaves(trainable)) == lora.num_trainable(LORA)
    # Every adapter leaf gets a non-zero gradient (A through B != 0, B through x A).
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(reference_grads))


def _paths(tree):
    return [tuple(k.key for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_adapted_model_starts_equal_to_the_base(tokens_m):
    base_cfg = TransformerConfig.preset("tiny")
    base = init_params(base_cfg, jax.random.key(0))
    params = lora.from_base(base, LORA, jax.random.key(5))
    ref = Transformer(config=base_cfg).apply({"params": base}, tokens_m)
    out = Transformer(config=LORA, policy="full").apply({"params": params}, tokens_m)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_int8_forward_is_close_to_the_float_one(tokens_m):
    base_cfg = TransformerConfig.preset("tiny")
    base = init_params(base_cfg, jax.random.key(0))
    params = lora.from_base(base, QLORA, jax.random.key(5))
    kernel = params["layers"]["layers"]["q_proj"]["kernel"]
    assert kernel["qvalue"].dtype == jnp.int8 and kernel["scale"].shape == (4, 1, 64)
    ref = np.asarray(Transformer(config=base_cfg).apply({"params": base}, tokens_m))
    out = np.asarray(Transformer(config=QLORA, policy="selective").apply({"params": params}, tokens_m))
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert 0 < err < QUANT_LOGITS_RTOL, err


def test_int8_round_trip_is_within_half_a_step():
    w = jax.random.normal(jax.random.key(0), (3, 32, 8))
    q = lora.quantize_int8(w)
    step = np.asarray(q["scale"])
    assert np.all(np.abs(np.asarray(lora.dequantize(q)) - np.asarray(w)) <= step / 2 + 1e-7)


@pytest.mark.parametrize("spec", ["none", "full", "selective", "dots"], ids=str)
def test_no_dequantized_kernel_is_saved_under_remat(tokens_m, spec):
    params = init_params(QLORA, jax.random.key(0))
    trainable, frozen = lora.partition(params)
    model = Transformer(config=QLORA, policy=spec)
    res = _jax_internals.saved_residuals(lambda t, x: lm_loss(model, lora.combine(t, frozen), x), trainable, tokens_m)
    kernel_shapes = {x.shape for x in jax.tree.leaves(frozen) if x.dtype == jnp.int8}
    floats = [r for r in res if r.shape in kernel_shapes and r.dtype != "int8"]
    assert kernel_shapes and not floats, floats


def test_frozen_base_gets_no_update_and_no_optimizer_state(tokens_m):
    params = init_params(QLORA, jax.random.key(0))
    trainable, frozen = lora.partition(params)
    # The one step that plan, auto, bench and train compile (remat_kit.step.update).
    opt = step_lib.make_optimizer(1e-2)
    state = step_lib.init_optimizer(opt, params)
    # Adam's moments cover exactly the adapters: no entry (not even zeros) for the base, also in
    # the abstract state the planner counts.
    moments = optax.tree_utils.tree_get(state, "mu")
    assert jax.tree.structure(moments) == jax.tree.structure(trainable)
    abstract_moments = optax.tree_utils.tree_get(step_lib.abstract_state(params, opt)[1], "mu")
    assert jax.tree.structure(abstract_moments) == jax.tree.structure(trainable)
    model = Transformer(config=QLORA, policy="full")
    step = jax.jit(step_lib.make_step(lambda q, x: lm_loss(model, q, x), opt))
    new, _, loss, grad_norm, finite = step(params, state, tokens_m)
    assert bool(finite) and float(grad_norm) > 0 and np.isfinite(float(loss))
    new_trainable, new_frozen = lora.partition(new)
    for a, b in zip(jax.tree.leaves(new_frozen), jax.tree.leaves(frozen), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert max_rel_err(new_trainable, trainable) > 0  # the adapters did move


@pytest.mark.parametrize("model", [QLORA, NF4], ids=["int8", "nf4"])
def test_lora_run_resumes_bit_exact(tmp_path, model):
    corpus = data.corpus_from_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    config = train.TrainConfig(model=model, steps=4, batch_size=2, seq_len=16, eval_every=0, policy="selective")
    full = train.train(config, corpus, checkpoint_dir=tmp_path / "run", checkpoint_every=2, keep=5)
    with Checkpoints(tmp_path / "run") as ckpts:
        assert ckpts.steps() == [2, 4]
    shutil.rmtree(tmp_path / "run" / "4")  # as if killed after step 3
    resumed = train.train(config, corpus, checkpoint_dir=tmp_path / "run", resume=True)
    assert resumed.resumed_from == 2
    assert [r["step"] for r in resumed.history] == [3, 4]
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history[2:]]
    for a, b in zip(jax.tree.leaves(resumed.state.to_dict()), jax.tree.leaves(full.state.to_dict()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lora_rank": -1}, "lora_rank must be an integer >= 0"),
        ({"lora_rank": 2.5}, "lora_rank must be an integer >= 0"),
        ({"lora_rank": 65}, "exceeds d_model=64"),
        ({"lora_rank": 4, "lora_targets": ("q_proj", "wq")}, "unknown lora_targets ['wq']"),
        ({"lora_rank": 4, "lora_targets": "q_proj"}, "lora_targets must be a tuple"),
        ({"lora_rank": 4, "lora_alpha": 0}, "lora_alpha must be a number > 0"),
        ({"lora_rank": 4, "quantize": "fp4"}, "quantize='fp4'; allowed: none, int8, nf4"),
        ({"quantize": "int8"}, "needs lora_rank > 0"),
        ({"quantize": "nf4"}, "quantize='nf4' needs lora_rank > 0"),
        ({"lora_rank": 4, "quantize": "nf4", "d_ff": 99}, "quantize='nf4' cannot store mlp_gate: nf4 needs kernels"),
        ({"lora_rank": 4, "quantize": "int8", "dtype": "float16"}, "does not support compute dtype 'float16'"),
    ],
    ids=[
        "negative-rank",
        "float-rank",
        "rank-too-big",
        "unknown-target",
        "target-string",
        "alpha",
        "fp4",
        "quantize-without-lora",
        "nf4-without-lora",
        "nf4-odd-width",
        "float16",
    ],
)
def test_bad_lora_config_is_one_line_error(overrides, message):
    with pytest.raises(ValueError) as err:
        TransformerConfig.preset("tiny", **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cli_flags_reach_the_config():
    from remat_kit import cli
    from remat_kit.cli.train import config_from_args

    args = cli.build_parser().parse_args(
        ["train", "--lora-rank", "8", "--lora-alpha", "32", "--lora-targets", "all", "--quantize", "int8"]
    )
    model = config_from_args(args).model
    assert (model.lora_rank, model.lora_alpha, model.lora_targets, model.quantize) == (8, 32.0, lora.TARGETS, "int8")


# ---- the NF4 base --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nf4_params():
    # From a full checkpoint's parameters, adapters made non-zero so gradients reach A as well as B.
    base = init_params(TransformerConfig.preset("tiny"), jax.random.key(0))
    t, f = lora.partition(lora.from_base(base, NF4, jax.random.key(5)))
    t = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape), t)
    return t, f


def _nf4_grads(spec, trainable, frozen, tokens):
    model = Transformer(config=NF4, policy=spec)
    return jax.jit(jax.grad(lambda t: lm_loss(model, lora.combine(t, frozen), tokens)))(trainable)


@pytest.fixture(scope="module")
def nf4_reference_grads(nf4_params, tokens_m):
    return _nf4_grads("none", *nf4_params, tokens_m)


def _dequantized(params):
    """The plain model's parameters: every NF4 kernel replaced by the float kernel it stands for."""
    flat = traverse_util.flatten_dict(lora.partition(params)[1])
    kernels = {k[:-1] for k in flat if k[-1] in nf4.LEAVES}
    out = {k: v for k, v in flat.items() if k[:-1] not in kernels}
    for k in kernels:
        out[k] = nf4.dequantize({name: flat[(*k, name)] for name in nf4.LEAVES})
    return traverse_util.unflatten_dict(out)


def test_nf4_model_starts_equal_to_the_dequantized_base(tokens_m):
    base_cfg = TransformerConfig.preset("tiny")
    base = init_params(base_cfg, jax.random.key(0))
    params = lora.from_base(base, NF4, jax.random.key(5))
    kernel = params["layers"]["layers"]["mlp_gate"]["kernel"]
    assert kernel["codes"].dtype == jnp.uint8 and kernel["codes"].shape == (4, 64, NF4.d_ff // 2)  # 2 codes per byte
    deq = _dequantized(params)
    ref = np.asarray(Transformer(config=base_cfg).apply({"params": deq}, tokens_m))
    out = np.asarray(Transformer(config=NF4, policy="full").apply({"params": params}, tokens_m))
    # Equal up to float32 summation order (XLA fuses the dequantization into the matmul), the model tolerance.
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) < MODEL_RTOL
    # ... and the dequantized base is a 4-bit copy of the original, not the original: 16 levels per
    # 64-block (RMS error ~0.1 of the weights' std, benchmarks/results/nf4_quality.txt) move the
    # random tiny model's logits by ~20 % of their largest entry, int8 by < 2 %.
    exact = np.asarray(Transformer(config=base_cfg).apply({"params": base}, tokens_m))
    assert 0 < np.max(np.abs(out - exact)) / np.max(np.abs(exact)) < NF4_LOGITS_RTOL


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if s != "none"], ids=str)
def test_nf4_adapter_gradients_equal_under_every_policy(nf4_params, nf4_reference_grads, tokens_m, spec):
    grads = _nf4_grads(spec, *nf4_params, tokens_m)
    assert max_rel_err(grads, nf4_reference_grads) < RTOL_F32
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(nf4_reference_grads))


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [*((s, "float32") for s in ALL_SPECS), ("none", "bfloat16"), ("full", "bfloat16")],
    ids=lambda v: v if v not in ("float32", "bfloat16") else {"float32": "f32", "bfloat16": "bf16"}[v],
)
def test_no_dequantized_nf4_kernel_is_saved_under_remat(nf4_params, tokens_m, spec, dtype):
    trainable, frozen = nf4_params  # float32 parameters; the bfloat16 model computes in bfloat16 from them
    model = Transformer(config=dataclasses.replace(NF4, dtype=dtype), policy=spec)
    res = _jax_internals.saved_residuals(lambda t, x: lm_loss(model, lora.combine(t, frozen), x), trainable, tokens_m)
    # Every form a dequantized kernel could take: [d_in, d_out], transposed, per-block, flat, stacked.
    shapes = set()
    for d_in, d_out in lora.kernel_shapes(NF4).values():
        for form in [(d_in, d_out), (d_out, d_in), (d_in * d_out // nf4.BLOCK, nf4.BLOCK), (d_in * d_out,)]:
            shapes |= {form, (NF4.num_layers, *form)}
    floats = [r for r in res if r.shape in shapes and r.dtype not in ("uint8", "int8")]  # float32 or bfloat16
    assert not floats, floats
    if spec == "none":  # what is kept instead: the packed codes (one byte per two weights)
        assert any(r.dtype == "uint8" and r.shape[-1] == 64 // 2 for r in res), res


def test_nf4_project_gradients_match_autodiff_of_the_dequantized_matmul():
    q = nf4.quantize(jax.random.normal(jax.random.key(0), (64, 8)))
    x = jax.random.normal(jax.random.key(1), (3, 64))
    floats = (q["absmax_scale"], q["absmax_offset"])
    f32 = jnp.dtype("float32")

    def custom(x, s, o):
        return jnp.sum(jnp.sin(lora.nf4_project(x, q["codes"], q["absmax_q"], s, o, f32)))

    def plain(x, s, o):
        w = nf4.dequantize({"codes": q["codes"], "absmax_q": q["absmax_q"], "absmax_scale": s, "absmax_offset": o})
        return jnp.sum(jnp.sin(x @ w))

    got = jax.grad(custom, argnums=(0, 1, 2))(x, *floats)
    want = jax.grad(plain, argnums=(0, 1, 2))(x, *floats)
    assert max_rel_err(got, want) < RTOL_F32
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(want))


def test_nf4_frozen_base_is_half_a_byte_per_weight_plus_scales():
    int8_cfg = TransformerConfig.preset("tiny", lora_rank=4, lora_targets=NF4.lora_targets, quantize="int8")
    nf4_bytes, int8_bytes = lora.param_bytes(NF4).frozen, lora.param_bytes(int8_cfg).frozen
    # Every matrix is quantized: the Block kernels, the embedding [vocab, d] and the untied head [d, vocab].
    layer, outside = lora.kernel_shapes(NF4).values(), lora.matrix_shapes(NF4)
    weights = NF4.num_layers * sum(a * b for a, b in layer) + sum(a * b for a, b in outside.values())
    # int8: 1 byte per weight + a float32 per output channel (per row of the embedding); nf4: 0.5 byte +
    # an int8 per 64 (padded to 256s) + the second level's float32s.
    scale_bytes = lambda s: nf4.num_scales(s) + 4 * nf4.num_scales(s) // 256 + 4
    scales = NF4.num_layers * sum(scale_bytes(s) for s in layer) + sum(scale_bytes(s) for s in outside.values())
    int8_scales = NF4.num_layers * sum(4 * d_out for _, d_out in layer)
    int8_scales += 4 * outside["embed"][0] + 4 * outside["lm_head"][1]
    assert int8_bytes - nf4_bytes == weights // 2 + int8_scales - scales


def test_cli_nf4_without_lora_rank_is_a_clear_error(capsys):
    from remat_kit import cli

    assert cli.main(["plan", "--preset", "tiny", "--quantize", "nf4"]) == 2
    err = capsys.readouterr().err
    assert "--quantize nf4 needs --lora-rank R > 0" in err and "Traceback" not in err
