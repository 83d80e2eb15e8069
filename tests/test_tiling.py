"""Sequence tiles (remat_kit.policies.tiling.tiled, TransformerConfig.seq_tiles) and ``plan --max-seq``.

Tiled gradients equal the untiled ones (float32, rel 1e-5) for a plain function and for the model under every
policy kind; the tiles take effect (a scan of K trips, less compiled memory); bad values are one-line errors
before anything is traced; ``plan --max-seq`` reports edges that the planner's compiles confirm.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err

from remat_kit import cli, policies
from remat_kit._jax_internals import iter_eqns
from remat_kit.analysis.memory import CompiledMemory
from remat_kit.model.loss import lm_loss
from remat_kit.model.transformer import Transformer, TransformerConfig, auto_tiles, init_params, resolve_tiles
from remat_kit.planning.builtin import Planner
from remat_kit.planning.planner import Budget
from remat_kit.policies import tiling
from remat_kit.train.config import TrainConfig

W1 = jax.random.normal(jax.random.key(0), (8, 24)) * 0.3
W2 = jax.random.normal(jax.random.key(1), (24, 8)) * 0.3


def mlp(x, w1, w2):
    return x + jax.nn.silu(x @ w1) @ w2


@pytest.mark.parametrize("tiles", [1, 2, 4, 16], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("policy", [None, "full", "selective", "none"], ids=str)
def test_tiled_equals_untiled(tiles, policy):
    x = jax.random.normal(jax.random.key(2), (2, 16, 8))
    f = tiling.tiled(mlp, tiles, in_axes=(1, None, None), policy=None if policy is None else policies.parse(policy))
    loss = lambda fn: lambda x, w1, w2: jnp.sum(jnp.tanh(fn(x, w1, w2)) ** 2)
    assert max_rel_err(f(x, W1, W2), mlp(x, W1, W2)) <= RTOL_F32
    got = jax.grad(loss(f), argnums=(0, 1, 2))(x, W1, W2)
    want = jax.grad(loss(mlp), argnums=(0, 1, 2))(x, W1, W2)
    assert max_rel_err(got, want) <= RTOL_F32


def test_tiled_axis0_and_pytree_outputs():
    x = jax.random.normal(jax.random.key(3), (12, 8))
    fn = lambda x: {"a": jnp.sin(x), "b": (x * 2.0)[:, :3]}
    got = tiling.tiled(fn, 3, axis=0)(x)
    want = fn(x)
    assert max_rel_err(got, want) <= RTOL_F32
    g = jax.grad(lambda x: jnp.sum(tiling.tiled(fn, 3, axis=0)(x)["a"] ** 2))(x)
    assert max_rel_err(g, jax.grad(lambda x: jnp.sum(fn(x)["a"] ** 2))(x)) <= RTOL_F32


@pytest.mark.parametrize("policy", [None, "full", "offload"], ids=str)
@pytest.mark.parametrize("argnums", [(0, 1, 2, 3), (1,), (0, 3)], ids=lambda a: "d" + "".join(map(str, a)))
def test_tiles_that_keep_nothing_write_their_gradients_in_place(policy, argnums):
    # Their own backward pass: x's gradient over the output gradient of its shape, c's over q's (same bytes per
    # tile), w and the untiled bias summed, the integer input none; only what is differentiated is.
    def fn(x, c, w, bias, n):
        y = x + jnp.tanh(c @ w) * n[..., None] + bias[None, None, :]
        return y, (c * 2.0).reshape(*c.shape[:2], 2, 4)

    x, c = (jax.random.normal(jax.random.key(k), (2, 16, 8)) for k in (4, 5))
    bias, n = jnp.linspace(0.0, 1.0, 8), jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    f = tiling.tiled(fn, 4, in_axes=(1, 1, None, None, 1), policy=None if policy is None else policies.parse(policy))
    loss = lambda g: lambda *a: sum(jnp.sum(jnp.sin(o) * (k + 1)) for k, o in enumerate(g(*a, n)))
    got = jax.jit(jax.grad(loss(f), argnums=argnums))(x, c, W1[:, :8], bias)
    want = jax.grad(loss(fn), argnums=argnums)(x, c, W1[:, :8], bias)
    assert max_rel_err(got, want) <= RTOL_F32


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_tiled_reads_16_bit_inputs_as_words_bit_for_bit(dtype, monkeypatch):
    # A tile's 16-bit inputs are cut from their uint16 words (XLA:CPU would widen the whole input to float32
    # before the loop): values and gradients are those of the plain cut exactly, float32 inputs are cut plainly.
    x = jax.random.normal(jax.random.key(4), (2, 16, 8)).astype(dtype)
    w1, w2 = W1.astype(dtype), W2.astype(dtype)
    loss = lambda f: lambda x, w1, w2: jnp.sum(f(x, w1, w2).astype(jnp.float32) ** 2)

    def run():
        f = tiling.tiled(mlp, 4, in_axes=(1, None, None))
        program = jax.make_jaxpr(jax.grad(loss(f)))(x, w1, w2)
        cuts = [e for e in iter_eqns(program) if e.primitive.name == "bitcast_convert_type"]
        return jax.jit(f)(x, w1, w2), jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(x, w1, w2), len(cuts)

    *words, count = run()
    assert count >= 2  # the input to words and each tile back, in the forward and in the recompute
    monkeypatch.setattr(tiling.words, "pack", lambda a: a)
    *plain, plain_count = run()
    assert plain_count == 0
    for a, b in zip(jax.tree.leaves(words), jax.tree.leaves(plain), strict=True):
        assert a.dtype == b.dtype == dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    f32 = jax.make_jaxpr(jax.grad(loss(tiling.tiled(mlp, 4, in_axes=(1, None, None)))))(x.astype(jnp.float32), W1, W2)
    assert not [e for e in iter_eqns(f32) if e.primitive.name == "bitcast_convert_type"]


def _scanned_temp(tiles: int) -> int:
    # Four MLP layers under a scan, each fully rematerialized: the recompute's working set is what tiles cut.
    def loss(ws, x):
        def step(h, w):
            f = lambda h: mlp(h, *w)
            f = tiling.tiled(f, tiles) if tiles > 1 else f
            return jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)(h), None

        return jnp.sum(jax.lax.scan(step, x, ws)[0] ** 2)

    ws = (jax.ShapeDtypeStruct((4, 64, 512), jnp.float32), jax.ShapeDtypeStruct((4, 512, 64), jnp.float32))
    x = jax.ShapeDtypeStruct((2, 1024, 64), jnp.float32)
    return CompiledMemory.from_compiled(jax.jit(jax.grad(loss)).lower(ws, x).compile()).total


def test_tiles_shrink_the_recompute_working_set():
    untiled, tiled8 = _scanned_temp(1), _scanned_temp(8)
    # The untiled recompute holds [2, 1024, 512] float32 hidden activations and their gradients (4 MiB each).
    assert tiled8 < untiled - 8 * 2**20, (untiled, tiled8)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: tiling.tiled(jnp.sin, 0), "tiles must be"),
        (lambda: tiling.tiled(jnp.sin, 2.5), "tiles"),
        (lambda: tiling.tiled(jnp.sin, 3)(jnp.ones((2, 8))), "tiles=3 does not divide the sequence length 8"),
        (lambda: tiling.tiled(jnp.sin, 2, in_axes=(0,))(jnp.ones((2, 8))), "in_axes entries must be axis=1"),
        (lambda: tiling.tiled(lambda a, b: a + b, 2)(jnp.ones((2, 8)), jnp.ones((2, 4))), "different lengths"),
        (lambda: tiling.tiled(lambda x: x.sum(1), 2)(jnp.ones((2, 8))), "sequence on axis 1"),
    ],
    ids=["zero", "float", "not-a-divisor", "in-axes", "lengths", "output-axis"],
)
def test_tiled_bad_values(call, match):
    with pytest.raises((ValueError, TypeError), match=match) as err:
        call()
    assert "\n" not in str(err.value)


# ---- the model ---------------------------------------------------------------------------------------------


CFG = TransformerConfig.preset("tiny", max_seq_len=32)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def _grads(cfg, policy, params, tokens):
    model = Transformer(config=cfg, policy=policy)
    return jax.jit(jax.value_and_grad(lambda p: lm_loss(model, p, tokens)))(params)


@pytest.mark.parametrize("spec", [*ALL_SPECS, "jax:dots_saveable", "full*2+none*2"], ids=str)
def test_model_tiled_gradients_equal_untiled(spec, params):
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256, dtype=jnp.int32)
    loss1, g1 = _grads(CFG, spec, params, tokens)
    loss4, g4 = _grads(dataclasses.replace(CFG, seq_tiles=4), spec, params, tokens)
    assert abs(float(loss4) - float(loss1)) <= RTOL_F32 * abs(float(loss1))
    assert max_rel_err(g4, g1) <= RTOL_F32


def _scan_lengths(cfg, params) -> list[int]:
    model = Transformer(config=cfg, policy="full")
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: lm_loss(model, p, jnp.zeros((2, 32), jnp.int32))))(params)
    out = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "scan":
                out.append(e.params["length"])
            for v in e.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                        walk(getattr(sub, "jaxpr", sub))

    walk(jaxpr.jaxpr)
    return out


def test_model_tiles_run_as_a_scan_of_k_trips(params):
    assert 8 in _scan_lengths(dataclasses.replace(CFG, seq_tiles=8), params)
    assert 8 not in _scan_lengths(CFG, params)


def test_model_tiles_run_one_batch_row_at_a_time(params):
    # With tiles, a batch of 3 runs each layer as a scan of 3 rows (attention never mixes rows); untiled, not.
    model = lambda cfg: Transformer(config=cfg, policy="full")
    tokens = jax.random.randint(jax.random.key(1), (3, 32), 0, 256, dtype=jnp.int32)
    lengths = lambda cfg: [
        e.params["length"]
        for e in iter_eqns(jax.make_jaxpr(jax.grad(lambda p: lm_loss(model(cfg), p, tokens)))(params))
        if e.primitive.name == "scan"
    ]
    assert 3 in lengths(dataclasses.replace(CFG, seq_tiles=4))
    assert 3 not in lengths(CFG)
    loss1, g1 = _grads(CFG, "offload", params, tokens)
    loss4, g4 = _grads(dataclasses.replace(CFG, seq_tiles=4), "offload", params, tokens)
    assert abs(float(loss4) - float(loss1)) <= RTOL_F32 * abs(float(loss1))
    assert max_rel_err(g4, g1) <= RTOL_F32


def test_model_dropout_with_tiles_trains(params):
    cfg = dataclasses.replace(CFG, seq_tiles=2, dropout=0.1)
    model = Transformer(config=cfg, policy="full")
    tokens = jnp.zeros((2, 32), jnp.int32)
    f = lambda p, k: lm_loss(model, p, tokens, deterministic=False, rngs={"dropout": k})
    a, b = f(params, jax.random.key(0)), f(params, jax.random.key(1))
    assert bool(jnp.isfinite(a)) and float(a) != float(b)  # the masks depend on the key
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(jax.grad(f)(params, jax.random.key(0))))


def test_auto_tiles():
    assert [auto_tiles(2, 1024), auto_tiles(2, 16384), auto_tiles(1, 6000)] == [1, 8, 2]
    assert resolve_tiles("auto", 2, 50_176) == 28 and 50_176 % 28 == 0


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TransformerConfig.preset("tiny", seq_tiles=0), "seq_tiles must be 'auto' or an integer >= 1"),
        (lambda: TransformerConfig.preset("tiny", seq_tiles="4"), "seq_tiles must be"),
        (
            lambda: Transformer(config=TransformerConfig.preset("tiny", seq_tiles=3)).init(
                jax.random.key(0), jnp.zeros((1, 16), jnp.int32)
            ),
            "seq_tiles=3 does not divide the sequence length 16",
        ),
        (
            lambda: TrainConfig(model=TransformerConfig.preset("tiny", seq_tiles=3), seq_len=32),
            "seq_tiles=3 does not divide the sequence length 32",
        ),
    ],
    ids=["zero", "string", "not-a-divisor", "train-config"],
)
def test_model_bad_tiles(make, match):
    with pytest.raises(ValueError, match=match) as err:
        make()
    assert "\n" not in str(err.value)


# ---- the command line ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["plan", "--preset", "tiny", "--seq-tiles", "0"], "--seq-tiles must be 'auto' or an integer >= 1"),
        (["plan", "--preset", "tiny", "--seq-len", "32", "--seq-tiles", "3"], "seq_tiles=3 does not divide"),
        (["bench", "--preset", "tiny", "--seq-len", "32", "--seq-tiles", "5"], "seq_tiles=5 does not divide"),
        (["train", "--seq-len", "32", "--seq-tiles", "3", "--steps", "1"], "seq_tiles=3 does not divide"),
        (["train", "--seq-tiles", "0", "--steps", "1"], "--seq-tiles must be"),
        (["plan", "--preset", "tiny", "--max-seq"], "--max-seq needs --budget"),
        (["plan", "--preset", "tiny", "--seq-step", "8", "--budget", "1GB"], "--seq-step goes with --max-seq"),
        (["plan", "--preset", "tiny", "--max-seq", "100", "--budget", "1GB"], "multiple of --seq-step 256"),
        (
            ["plan", "--preset", "tiny", "--max-seq", "64", "--seq-step", "8", "--seq-tiles", "3", "--budget", "1GB"],
            "--seq-step 8 must be a multiple of --seq-tiles 3",
        ),
        (
            [
                "plan",
                "--model",
                "tests.plan_model_factory:factory",
                "--max-seq",
                "64",
                "--seq-step",
                "8",
                "--budget",
                "1GB",
            ],
            "the factory must take no argument and return (model, loss_fn, args_at)",
        ),
    ],
    ids=[
        "zero",
        "plan-divisor",
        "bench-divisor",
        "train-divisor",
        "train-zero",
        "no-budget",
        "step-alone",
        "limit",
        "step-tiles",
        "model-seq",
    ],
)
def test_cli_bad_values_one_line(argv, match, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


@pytest.mark.onejax  # the plan command over many compiles (pyproject)
def test_plan_max_seq_finds_the_compiled_edge(tmp_path, capsys):
    out = tmp_path / "edge.json"
    argv = [
        "plan",
        "--preset",
        "tiny",
        "--max-seq",
        "1024",
        "--seq-step",
        "32",
        "--budget",
        "7MB,10MB",
        "--policies",
        "none,full",
        "--seq-tiles",
        "2",
        "--json",
        str(out),
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "max seq 7.0 MB" in text and "the edges, compiled" in text
    report = json.loads(out.read_text())
    cfg = TransformerConfig(**{**report["config"], "lora_targets": tuple(report["config"]["lora_targets"])})
    assert report["loss_chunks"] == "auto" and cfg.seq_tiles == 2  # the chunked loss by default; tiles as given
    planner = Planner(cfg, loss_chunks="auto")  # an independent planner: every edge is compiled again here
    for row in report["policies"]:
        assert row["floor_per_position_bytes"] > 0 and row["per_position_bytes"] > 0
        for e in row["edges"]:
            budget = Budget(e["budget_bytes"], e["margin"])
            assert e["seq"] > 0 and e["next_seq"] == e["seq"] + 32
            assert budget.fits(planner.memory(policies.parse(row["policy"]), 2, e["seq"])[0])
            assert not budget.fits(planner.memory(policies.parse(row["policy"]), 2, e["next_seq"])[0])
    full, none = (next(r for r in report["policies"] if r["policy"] == p) for p in ("full", "none"))
    assert all(f["seq"] > n["seq"] for f, n in zip(full["edges"], none["edges"], strict=True))
    assert full["floor_per_position_bytes"] == 4 * 64 * 4 * 2  # L · d · float32 · batch: the layer inputs


# ---- full's layer inputs kept as 16-bit words (the stack's pack) -----------------------------------------------


def _packed_model(cfg, pack: bool):
    from remat_kit.linen.scan import stack
    from remat_kit.model import transformer

    class Model(transformer.Transformer):
        def make_layers(self):
            block = transformer._block_class(self.config, self.policy)
            return stack(block, self.config.num_layers, self.policy, pack=pack, name="layers")

    return Model(config=cfg, policy="full")


@pytest.mark.parametrize(
    "overrides",
    [{}, {"lora_rank": 4, "lora_targets": ("q_proj", "mlp_up"), "quantize": "nf4"}, {"dropout": 0.1}],
    ids=["bf16", "lora-nf4", "dropout"],
)
def test_packed_full_equals_full(overrides):
    from remat_kit.model import lora

    cfg = TransformerConfig.preset("tiny", max_seq_len=32, dtype="bfloat16", **overrides)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256, dtype=jnp.int32)
    trainable, frozen = lora.partition(params) if cfg.lora_rank else (params, {})
    deterministic = not cfg.dropout
    rngs = None if deterministic else {"dropout": jax.random.key(2)}

    def grads(pack):
        model = _packed_model(cfg, pack)
        loss = lambda t: lm_loss(
            model, lora.combine(t, frozen) if frozen else t, tokens, deterministic=deterministic, rngs=rngs
        )
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(trainable))
        return jax.jit(jax.value_and_grad(loss))(trainable), "u16[4,2,32,64]" in jaxpr

    (loss0, g0), packed0 = grads(False)
    (loss1, g1), packed1 = grads(True)
    assert (packed0, packed1) == (False, True)  # the kept inputs are 16-bit words only when packed
    assert float(loss1) == float(loss0)
    assert max_rel_err(g1, g0) <= RTOL_F32
