"""Every Python block of docs/*.md runs as written, each in a fresh namespace, and does what its guide says."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest
from conftest import max_rel_err
from doc_blocks import DOCS, ROOT, name, python_blocks, run_block

import remat_kit


def _linen_loop(ns):
    """Your own loop of policy(MyBlock): same parameters and gradients as the bare block."""
    assert ns["policy"].save == ("mlp_up",)
    kernels = [leaf.shape for leaf in jax.tree.leaves(ns["grads"])]
    assert (64, 256) in kernels and len(kernels) == 4 * 4  # four blocks of two Dense layers
    bare = ns["MyModel"]()  # the same model with the class swapped back: no remat
    ns["RematBlock"] = ns["MyBlock"]
    want = jax.grad(lambda p: jnp.sum(bare.apply(p, ns["x"], True, rngs={"dropout": jax.random.key(1)}) ** 2))(
        ns["params"]
    )
    assert max_rel_err(ns["grads"], want) <= 1e-5


def _stack(ns):
    """remat_kit.stack with BatchNorm: params and batch_stats stacked, statistics updated."""
    assert ns["grads"]["layers"]["Dense_0"]["kernel"].shape == (6, 64, 128)
    before = ns["variables"]["batch_stats"]["layers"]["BatchNorm_0"]["mean"]
    after = ns["batch_stats"]["layers"]["BatchNorm_0"]["mean"]
    assert before.shape == after.shape == (6, 128) and not jnp.allclose(before, after)


def _nnx(ns):
    """NNX: the stack's gradients are stacked and non-zero; the owning wrapper's gradients are the bare block's."""
    kernel = ns["grads"]["layers"]["up"]["kernel"]
    assert kernel.shape == (8, 16, 64) and float(jnp.max(jnp.abs(kernel[...]))) > 0
    bare = ns["nnx"].grad(ns["loss"])(ns["block"].module)
    assert max_rel_err(ns["block_grads"]["module"], bare) <= 1e-5


def _nnx_compare(ns):
    """The NNX recipe for compare: each row measured under its own policy."""
    table = ns["table"]
    assert table.policies == ("none", "full") and table["full"].saved_bytes < table["none"].saved_bytes


def _unedited_linen(ns):
    """remat_kit.apply on an unedited Linen model: the plain model's tree and gradients; names by path."""
    plain = ns["Transformer"]()
    assert jax.tree.structure(ns["params"]) == jax.tree.structure(plain.init(jax.random.key(0), ns["x"]))
    want = jax.grad(lambda p: plain.apply(p, ns["x"]).sum())(ns["params"])
    assert max_rel_err(ns["grads"], want) <= 1e-5


def _unedited_nnx(ns):
    """remat_kit.apply(..., scan=True) on an NNX model: gradients in the model's own layout, non-zero."""
    kernel = ns["grads"]["layers"][0]["up"]["kernel"][...]
    assert kernel.shape == (16, 64) and float(jnp.max(jnp.abs(kernel))) > 0


def _unedited_compare(ns):
    """apply_factory's make_loss: each row runs its own policy (full keeps least); an applied model is refused."""
    table = ns["table"]
    assert table["full"].saved_bytes < table["selective:up"].saved_bytes < table["none"].saved_bytes
    applied = ns["remat_kit"].apply(ns["plain"], "full")
    with pytest.raises(TypeError, match=r"made by remat_kit\.apply"):
        ns["remat_kit"].compare(lambda policy: lambda m, x: 0.0, ["none", "full"], applied, ns["x"])


def _unedited_factory(ns):
    """The tags factory: the names remat-kit tags lists (traced under full) include the blocks' paths."""
    from remat_kit.planning.user_model import names_from_factory

    assert {"up", "up/kernel", "out"} <= set(names_from_factory(ns["factory"]).names)


def _maxtext(ns):
    """MaxText's custom settings: the policy they make, and back."""
    assert str(ns["p"]) == "offload:q_proj;save=mlp_out" and ns["p"].to_maxtext()["mlpwi_0"] == "remat"


def _plan_own(ns):
    """inspect/compare/auto on a user's stack: full keeps less than none, and the choice fits the budget."""
    assert ns["report"].saved_bytes > 0
    saved = [r.saved_bytes for r in ns["table"].reports]
    assert saved[2] < saved[1] < saved[0]  # full < selective:mlp_up < none
    assert ns["choice"].chosen is not None


def _explain(ns):
    """Why doesn't it fit: the groups at the peak sum to it, and every parameter byte is live there."""
    r = ns["r"]
    assert sum(r.at_peak.values()) == r.peak_bytes
    assert r.at_peak["parameters"] == 4 * 64 * 64 * 4 and len(r.largest_at_peak) == 10


def _budget(ns):
    """remat_kit.auto on the tiny preset: a generous budget answers none (no recompute of any kind)."""
    assert ns["r"].chosen is not None and ns["r"].chosen.kind == "none"


def _per_tensor(ns):
    """per_tensor on tiny: an ample budget answers none, compiled and fitting."""
    assert str(ns["t"].chosen) == "none" and ns["t"].fits and ns["t"].cost_s == 0.0


def _lora(ns):
    """LoRA: only the adapters have optimizer state, and the frozen int8 base is untouched by the update."""
    trainable, frozen = ns["lora"].partition(ns["params"])
    mu = ns["opt_state"][0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(trainable) and jax.tree.leaves(frozen)
    before = ns["lora"].partition(ns["lora"].from_base(ns["full_params"], ns["cfg"], jax.random.key(1)))[1]
    assert max_rel_err(frozen, before) == 0.0


def _fit(ns):
    """fit with a comfortable budget: none, after one compile, its need within the budget, its spec parses."""
    r = ns["result"]
    assert r.policy == "none" and str(remat_kit.parse(r.policy)) == "none" and 0 < r.need_bytes <= 10**9
    assert "*" in r.table() and r.model is not None


def _tiled(ns):
    """tiled: the untiled function's gradients, and the tiled one really runs as a scan of K slices."""
    assert max_rel_err(ns["g_tiled"], ns["g_plain"]) <= 1e-5
    assert "scan" in str(jax.make_jaxpr(ns["tiled_mlp"])(ns["x"], ns["w_up"], ns["w_down"]))


def _max_seq(ns):
    """max_seq on tunix's Llama 3, unedited: the answer fits 64 MB with the margin, the next length does not."""
    r = ns["result"]
    assert r.seq > 0 and r.seq % 128 == 0 and r.next_seq == r.seq + 128
    assert r.need_bytes * 1.1 <= 64 * 10**6 < r.next_need_bytes * 1.1
    assert r.levers.policy == "full" and r.levers.scan and dict(r.needs)[r.seq] == r.need_bytes


def _head_loss(ns):
    """head_loss: the plain cross-entropy's loss and gradients, with no full logits in the compiled step."""
    want, grads = jax.value_and_grad(ns["plain"])(ns["variables"])
    assert abs(float(ns["loss"]) - float(want)) <= 1e-5 * float(want)
    assert max_rel_err(ns["grads"], grads) <= 1e-5
    logits = 2 * 1024 * ns["model"].vocab * 4
    assert ns["temp"]["plain"] > logits > 4 * ns["temp"]["chunked"], ns["temp"]


def _target(ns):
    """compare(target=...): offload's tagged outputs are host bytes on an H100 target, device bytes (and a note
    pointing to --target) where the block fell back to XLA:CPU (no CUDA plugin in the suite's venv)."""
    full, offload = ns["table"].reports
    act = 16 * 8 * 256 * 512 * 2  # the 16 tagged [8, 256, 512] bf16 outputs
    if offload.platform == "gpu":
        assert offload.saved_host_bytes == act and offload.peak_bytes < full.peak_bytes + act // 2
    else:
        assert offload.saved_host_bytes == 0 and offload.peak_bytes > full.peak_bytes + act // 2
        assert any("--target h100" in n for n in offload.notes)


#: The guide each check's block lives in → {a marker found in the block: what to assert after running it}.
def _unedited_kinds(ns):
    """Blocks of several kinds: found by compute, a name kept where it exists, a policy per kind."""
    assert ns["table"].why.startswith("Block ×6") and "Expert ×2" in ns["table"].why
    plain = ns["Model"]()
    want = jax.grad(lambda p: plain.apply(p, ns["x"]).sum())(ns["params"])
    assert max_rel_err(ns["grads"], want) <= 1e-5
    from remat_kit import _jax_internals

    loss = lambda m: lambda p: m.apply(p, ns["x"]).sum()
    kept = {r.tag for r in _jax_internals.saved_residuals(loss(ns["model"]), ns["params"]) if r.tag}
    assert kept == {"attn"}
    kept = {r.tag for r in _jax_internals.saved_residuals(loss(ns["per_kind"]), ns["params"]) if r.tag}
    assert kept == {"attn", "rec"}


def _unedited_long(ns):
    """Query blocks and tiles on an unedited Linen model: the plain model's gradients; names_of says which is which."""
    parts = {p.path: p.kind for p in ns["remat_kit"].names_of(ns["model"], ns["x"]).parts}
    assert parts == {"attn_norm": "per-token", "attn": "attention", "mlp_norm": "per-token", "mlp": "per-token"}
    model, x = ns["model"], ns["x"]
    want = jax.grad(lambda v: jnp.sum(model.apply(v, x) * x))(ns["variables"])
    assert max_rel_err(ns["grads"], want) <= 1e-5


CHECKS = {
    "your-model.md": {
        "RematBlock = policy(MyBlock": _linen_loop,
        "remat_kit.stack(NormBlock": _stack,
        "remat_kit.nnx.stack(Block": _nnx,
        'remat_kit.compare(make_loss, ["none", "full"], params, rest': _nnx_compare,
    },
    "unedited-models.md": {
        'remat_kit.apply(Transformer(), "selective': _unedited_linen,
        'remat_kit.apply(Model(rngs=nnx.Rngs(0)), "every_n:2"': _unedited_nnx,
        "per_kind = remat_kit.apply(Model(), {Block": _unedited_kinds,
        'remat_kit.compare(make_loss, ["none", "selective:up", "full"]': _unedited_compare,
        "return make_loss(policy), (variables, x)": _unedited_factory,
        'remat_kit.apply(model, "full", query_blocks=4, seq_tiles=4)': _unedited_long,
    },
    "policies.md": {"policies.from_maxtext(": _maxtext},
    "planning.md": {
        "remat_kit.inspect(make_loss": _plan_own,
        "jax.ShapeDtypeStruct((32, 64), jnp.float32), explain=True": _explain,
        "remat_kit.auto(cfg": _budget,
        "per_tensor(cfg": _per_tensor,
        'target="h100")': _target,
    },
    "built-in-lm.md": {"lora.update(loss_fn": _lora},
    "long-context.md": {
        "remat_kit.tiled(mlp, 8": _tiled,
        "remat_kit.max_seq(model, loss_fn, args_at": _max_seq,
        "remat_kit.head_loss(model, variables": _head_loss,
    },
    "fit.md": {'remat_kit.fit(model, loss_fn, variables, x, budget="1GB")': _fit},
}
CASES = [(page, i) for page in DOCS for i in range(len(python_blocks(page)))]


@pytest.mark.onejax  # the API the blocks show is tested on both JAX versions by its own tests (pyproject)
@pytest.mark.parametrize(("page", "index"), CASES, ids=[f"{page.stem}-{i}" for page, i in CASES])
def test_docs_python_block_runs(page, index):
    if "from tunix" in python_blocks(page)[index]:  # a model the user installed: the registry package google-tunix
        if importlib.util.find_spec("tunix") is None and os.environ.get("REMAT_KIT_REQUIRE_THIRDPARTY") != "1":
            pytest.skip("google-tunix is not installed here")
        with jax.numpy_rank_promotion("allow"):  # tunix broadcasts ranks implicitly; the suite's conftest forbids it
            run_block(page, index, CHECKS.get(page.name, {}))
        return
    run_block(page, index, CHECKS.get(page.name, {}))


@pytest.mark.parametrize("guide", sorted(CHECKS), ids=sorted(CHECKS))
def test_every_check_has_its_block_in_its_guide(guide):
    blocks = "\n".join(python_blocks(ROOT / "docs" / guide))
    assert [marker for marker in CHECKS[guide] if marker not in blocks] == []


def test_every_docs_block_is_checked():
    """A block with no check would run but assert nothing of what its guide claims."""
    unchecked = [
        f"{name(page)}[{i}]"
        for page, i in CASES
        if not any(marker in python_blocks(page)[i] for marker in CHECKS.get(page.name, {}))
    ]
    assert unchecked == []
