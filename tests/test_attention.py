"""Attention implementations: chunked (flash-style) equals XLA's, keeps no seq × seq tensor, errors are clear."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_SPECS, RTOL_F32, max_rel_err

from remat_kit import _jax_internals as internals
from remat_kit import names
from remat_kit.analysis import flops
from remat_kit.model import attention
from remat_kit.model.transformer import Block, Transformer, TransformerConfig, abstract_params, init_params


def _qkv(b, s, h, kv, d, dtype=jnp.float32, seed=0):
    kq, kk, kv_, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, s, h, d), dtype)
    k = jax.random.normal(kk, (b, s, kv, d), dtype)
    v = jax.random.normal(kv_, (b, s, kv, d), dtype)
    w = jax.random.normal(kw, (b, s, h, d), jnp.float32)  # a random cotangent, so gradients are not symmetric
    return q, k, v, w


def _grads(fn, q, k, v, w):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(
    ("b", "s", "h", "kv", "d", "block"),
    [
        (2, 16, 4, 4, 8, 4),  # multi-head, several blocks
        (2, 16, 4, 2, 8, 4),  # grouped KV
        (1, 19, 4, 1, 8, 8),  # multi-query; seq not a multiple of the block
        (2, 13, 2, 2, 16, 64),  # one block bigger than the sequence
        (1, 7, 2, 1, 8, 1),  # one position per block
    ],
    ids=["mha", "gqa", "mqa-ragged", "one-block", "block-1"],
)
def test_chunked_equals_xla_outputs_and_gradients(b, s, h, kv, d, block):
    q, k, v, w = _qkv(b, s, h, kv, d)
    chunked = lambda q, k, v: attention.chunked_attention(q, k, v, block=block)
    assert max_rel_err(chunked(q, k, v), attention.xla_attention(q, k, v)) <= RTOL_F32
    assert max_rel_err(_grads(chunked, q, k, v, w), _grads(attention.xla_attention, q, k, v, w)) <= RTOL_F32


@pytest.mark.parametrize(("b", "cut"), [(4, True), (3, True), (1, False)], ids=["even", "uneven", "batch-of-one"])
def test_chains_equal_one_chain_and_keep_the_same_residuals(monkeypatch, b, cut):
    q, k, v, w = _qkv(b, 20, 4, 2, 8)
    results = {}
    for chains in (1, 2):
        monkeypatch.setattr(attention, "default_chains", lambda platform=None, n=chains: n)
        # A new function each time: jax caches traces by function, and the chains are read when tracing.
        fn = lambda q, k, v: attention.chunked_attention(q, k, v, block=8)
        forward = jax.make_jaxpr(fn)(q, k, v)
        backward = jax.make_jaxpr(lambda q, k, v, fn=fn: _grads(fn, q, k, v, w))(q, k, v)
        kept = [r for r in internals.saved_residuals(fn, q, k, v) if not r.is_argument]
        results[chains] = (fn(q, k, v), _grads(fn, q, k, v, w), forward, backward, kept)
    (out1, g1, fwd1, bwd1, kept1), (out2, g2, fwd2, bwd2, kept2) = results[1], results[2]
    assert max_rel_err(out2, out1) <= RTOL_F32 and max_rel_err(g2, g1) <= RTOL_F32
    count = lambda jaxpr, name: sum(e.primitive.name == name for e in internals.iter_eqns(jaxpr))
    n = 2 if cut else 1
    # The forward's one pair scan advances each chain by its own matmuls; the backward runs a scan per chain.
    assert count(fwd1, "scan") == count(fwd2, "scan") == 1
    assert count(fwd2, "dot_general") == n * count(fwd1, "dot_general")
    assert count(bwd2, "scan") - 1 == n * (count(bwd1, "scan") - 1)
    # The chains' outputs are concatenated inside the custom_vjp: the whole output and logsumexp
    # are kept once, never the pieces.
    assert sorted(r.shape for r in kept2) == sorted(r.shape for r in kept1)


def test_chains_only_on_a_single_cpu_device(monkeypatch):
    assert jax.device_count() > 1 and attention.default_chains("cpu") == 1  # conftest's simulated devices
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert attention.default_chains("cpu") == 2
    assert attention.default_chains("gpu") == attention.default_chains("tpu") == 1


def test_chunked_is_causal():
    q, k, v, _ = _qkv(2, 24, 4, 2, 8)
    t = 10
    k2, v2 = k.at[:, t:].set(3.0), v.at[:, t:].set(-2.0)
    a = attention.chunked_attention(q, k, v, block=4)
    b = attention.chunked_attention(q, k2, v2, block=4)
    np.testing.assert_array_equal(a[:, :t], b[:, :t])  # blocks before t never read later keys
    assert not np.allclose(a[:, t:], b[:, t:])


def test_chunked_bfloat16_close_to_float32_reference():
    q, k, v, _ = _qkv(2, 32, 4, 2, 16)
    ref = attention.xla_attention(q, k, v)
    got = attention.chunked_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), block=8)
    assert got.dtype == jnp.bfloat16
    assert max_rel_err(got.astype(jnp.float32), ref) <= 2e-2  # bfloat16 has 8 mantissa bits


def _logits_and_grads(cfg, policy, params, tokens):
    model = Transformer(config=cfg, policy=policy)

    def loss(params):
        logits = model.apply({"params": params}, tokens)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_model_outputs_and_gradients_equal_xla(spec):
    # 19 positions in blocks of 8: several blocks, a ragged last one, causal skipping. "auto" is
    # "chunked" on this backend (test_auto_resolves_per_backend), so it is not run twice.
    kind = attention.resolve("auto", "float32", 16)
    cfg = TransformerConfig.preset("tiny", num_layers=3, attention=kind, attention_block=8)
    ref_cfg = TransformerConfig.preset("tiny", num_layers=3, attention="xla")
    tokens = jax.random.randint(jax.random.key(1), (2, 19), 0, cfg.vocab_size, dtype=jnp.int32)
    params = init_params(ref_cfg, jax.random.key(0))  # the attention kind does not change the parameters
    logits, grads = _logits_and_grads(cfg, spec, params, tokens)
    ref_logits, ref_grads = _logits_and_grads(ref_cfg, spec, params, tokens)
    assert max_rel_err(logits, ref_logits) <= RTOL_F32
    assert max_rel_err(grads, ref_grads) <= RTOL_F32


def _activation_residuals(cfg, spec, batch, seq):
    model = Transformer(config=cfg, policy=spec)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    res = internals.saved_residuals(lambda p, t: jnp.sum(model.apply({"params": p}, t)), abstract_params(cfg), tokens)
    return [r for r in res if not r.is_argument]


def _has_seq_by_seq(residuals, seq):
    return any(len(r.shape) >= 2 and r.shape[-2:] == (seq, seq) for r in residuals)


@pytest.mark.parametrize("spec", ["none", "every_n:2"])  # the policies under which xla keeps its probabilities
def test_chunked_keeps_no_seq_by_seq_residual(spec):
    seq = 48  # distinct from every other dimension of the tiny model
    xla = _activation_residuals(TransformerConfig.preset("tiny", attention="xla"), spec, 2, seq)
    chunked = _activation_residuals(
        TransformerConfig.preset("tiny", attention="chunked", attention_block=16), spec, 2, seq
    )
    assert _has_seq_by_seq(xla, seq)  # the check can see such a residual...
    assert not _has_seq_by_seq(chunked, seq)  # ...and chunked attention keeps none
    assert sum(r.nbytes for r in chunked) < sum(r.nbytes for r in xla)


def test_selective_keeps_the_logsumexp_with_the_context():
    # context carries the softmax statistics, so the backward pass need not re-run attention's forward.
    cfg = TransformerConfig.preset("tiny", attention="chunked", attention_block=16)
    b, s, kv, g = 2, 48, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    kept = {r.shape for r in _activation_residuals(cfg, "selective:context", b, s)}
    # Under both remat implementations (the tag sits outside the custom_vjp, so remat3 sees it too).
    assert (cfg.num_layers, b, kv, g, s) in kept, internals.remat3_enabled()  # the logsumexp, stacked over layers
    assert (cfg.num_layers, b, s, cfg.d_model) in kept  # the output, flat as the out projection takes it
    recomputed = {r.shape for r in _activation_residuals(cfg, "selective:q_proj", b, s)}
    assert (cfg.num_layers, b, kv, g, s) not in recomputed


def test_chunked_context_is_kept_once():
    # The out projection reads the very array attention's backward keeps: no reshaped second copy.
    cfg = TransformerConfig.preset("tiny", attention="chunked", attention_block=16)
    block = Block(config=cfg)
    x = jax.ShapeDtypeStruct((2, 48, cfg.d_model), jnp.float32)
    p = jax.eval_shape(lambda k: block.init(k, jnp.zeros((2, 8, cfg.d_model))), jax.random.key(0))
    res = [r for r in internals.saved_residuals(lambda p, x: jnp.sum(block.apply(p, x)), p, x) if not r.is_argument]
    kv, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    assert sorted(r.shape for r in res if r.tag == names.CONTEXT) == sorted([(2, 48, cfg.d_model), (2, kv, g, 48)])
    assert not [r.source for r in res if "reshape" in r.source and "Block" in r.source]


def test_flat_output_is_the_reshaped_context():
    q, k, v, _ = _qkv(2, 12, 4, 2, 8)
    for kind in ("xla", "chunked"):
        flat = attention.attend(q, k, v, kind=kind, block=4, flat=True)
        np.testing.assert_array_equal(flat, attention.attend(q, k, v, kind=kind, block=4).reshape(2, 12, 32))


def test_chunked_block_emits_the_vocabulary_but_attn_probs():
    cfg = TransformerConfig.preset("tiny", attention="chunked")
    block = Block(config=cfg)
    x = jnp.ones((2, 8, cfg.d_model))
    p = block.init(jax.random.key(0), x)
    assert internals.emitted_tags(lambda p, x: block.apply(p, x), p, x) == set(names.VOCABULARY) - {names.ATTN_PROBS}


def test_policy_naming_attn_probs_with_chunked_attention_is_an_error(tokens):
    cfg = TransformerConfig.preset("tiny", attention="chunked")
    with pytest.raises(ValueError, match=r"never emits: attn_probs"):
        Transformer(config=cfg, policy="selective:attn_probs").init(jax.random.key(0), tokens)


def test_auto_resolves_per_backend():
    assert attention.resolve("auto", "float32", 64, platform="cpu") == "chunked"
    assert attention.resolve("auto", "float32", 64, platform="tpu") == "chunked"
    assert attention.resolve("auto", "bfloat16", 64, platform="gpu") == "cudnn"
    assert attention.resolve("auto", "float32", 64, platform="gpu") == "chunked"  # cuDNN takes no float32
    assert attention.resolve("auto", "bfloat16", 12, platform="gpu") == "chunked"  # nor head_dim 12
    assert attention.resolve("xla", "float32", 64, platform="gpu") == "xla"
    assert TransformerConfig().attention == "auto"
    assert attention.default_block("cpu") == 128


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error off a GPU")
def test_cudnn_off_gpu_is_a_clear_error_before_tracing(tokens):
    cfg = TransformerConfig.preset("tiny", attention="cudnn", dtype="bfloat16")  # valid config: dtype fits
    with pytest.raises(ValueError, match=r"attention='cudnn' needs an NVIDIA GPU, but the JAX backend is 'cpu'"):
        Transformer(config=cfg)
    q = jnp.ones((1, 8, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"needs an NVIDIA GPU"):
        attention.attend(q, q, q, kind="cudnn")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TransformerConfig(attention="flash"), r"attention='flash'; allowed: auto, xla, chunked, cudnn"),
        (lambda: TransformerConfig(attention="cudnn"), r"cudnn.*takes compute dtype bfloat16 or float16, got float32"),
        (
            lambda: TransformerConfig(attention="cudnn", dtype="bfloat16", d_model=96, num_heads=8, num_kv_heads=8),
            r"head_dim a multiple of 8 and <= 128, got 12",
        ),
        (lambda: TransformerConfig(attention_block=0), r"attention_block must be a positive integer or None, got 0"),
        (lambda: TransformerConfig(attention_block=True), r"attention_block must be a positive integer or None"),
        (lambda: attention.chunked_attention(jnp.ones((1, 4, 2, 8)), *[jnp.ones((1, 4, 2, 8))] * 2, block=0), r"got 0"),
        (
            lambda: attention.attend(jnp.ones((1, 4, 3, 8)), *[jnp.ones((1, 4, 2, 8))] * 2),
            r"query heads 3 must be a multiple of key/value heads 2",
        ),
        (lambda: attention.attend(jnp.ones((1, 4, 2, 8)), *[jnp.ones((1, 5, 2, 8))] * 2), r"does not match q shape"),
    ],
    ids=["unknown-kind", "cudnn-float32", "cudnn-head-dim", "block-0", "block-bool", "fn-block-0", "heads", "seq"],
)
def test_bad_attention_input_is_a_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _grad_jaxpr(s, block):
    q, k, v, w = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _qkv(1, s, 2, 1, 8))
    fn = lambda q, k, v, w: jnp.sum(attention.chunked_attention(q, k, v, block=block) * w)
    return jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v, w)


def test_chunked_traces_the_same_program_at_any_length():
    # The block pairs are a lax.scan, not unrolled: 4 blocks or 64, the traced program is the same size.
    sizes = {s: sum(1 for _ in internals.iter_eqns(_grad_jaxpr(s, 16))) for s in (64, 1024)}
    assert sizes[64] == sizes[1024], sizes


@pytest.mark.parametrize("s", [64, 50], ids=["whole-blocks", "ragged"])
def test_chunked_computes_only_the_causal_block_pairs(s):
    # n blocks: n(n+1)/2 pairs, each with two [16, 16] x 8 matmuls forward and five backward (the
    # scores again, dv, dp, dq, dk), and the backward's rowsum(dO ∘ O) over the pair's query block (summed
    # per pair, so no whole-sequence float32 copy of O and dO exists).
    n = -(-s // 16)
    per_matmul = 2 * 2 * 16 * 16 * 8  # 2 FLOPs × heads × bq × bk × d
    per_rowsum = 2 * 2 * 16 * 8  # 2 FLOPs × heads × bq × d
    assert flops.jaxpr_flops(_grad_jaxpr(s, 16)) == n * (n + 1) // 2 * (7 * per_matmul + per_rowsum)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_chunked_reads_16_bit_operands_as_words_bit_for_bit(dtype, monkeypatch):
    # The pair scans read q, k, v, the output and its gradient as uint16 words (XLA:CPU would widen a bfloat16
    # operand to float32 whole before the loop): the output and gradients are those of the plain operands exactly.
    q, k, v, w = _qkv(2, 24, 4, 2, 8, dtype=dtype)
    fn = lambda q, k, v: attention.chunked_attention(q, k, v, block=8)
    packed = (jax.jit(fn)(q, k, v), _grads(fn, q, k, v, w))
    program = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(fn(q, k, v).astype(jnp.float32))))(q)
    scans = [e for e in internals.iter_eqns(program) if internals.primitive_name(e) == "scan"]
    words = [x for e in scans for x in e.invars if hasattr(x, "aval") and x.aval.dtype == jnp.uint16]
    assert len(words) >= 8, words  # q, k, v in the forward's pair scan; q, k, v, O and dO in the backward's
    monkeypatch.setattr(attention.words, "pack", lambda x: x)
    fn = lambda q, k, v: attention.chunked_attention(q, k, v, block=8)  # a new function: no cached trace
    plain = (jax.jit(fn)(q, k, v), _grads(fn, q, k, v, w))
    for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(plain), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU")
def test_cudnn_matches_xla_on_gpu():
    q, k, v, w = _qkv(2, 128, 8, 2, 64, dtype=jnp.bfloat16)
    ref = attention.xla_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    got = attention.attend(q, k, v, kind="cudnn")
    assert max_rel_err(got.astype(jnp.float32), ref) <= 2e-2  # bfloat16 inputs
    g = _grads(lambda q, k, v: attention.attend(q, k, v, kind="cudnn"), q, k, v, w)
    g_ref = _grads(attention.xla_attention, *(x.astype(jnp.float32) for x in (q, k, v)), w)
    assert max_rel_err([x.astype(jnp.float32) for x in g], g_ref) <= 5e-2


@pytest.fixture(params=[False, True], ids=["classic", "remat3"])
def remat_impl(request):
    """Run with JAX's classic remat, then with remat3; restore the setting afterwards."""
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", request.param)
    yield request.param
    jax.config.update("jax_remat3", before)


def test_context_inside_chunked_attention_is_kept_under_both_remat_implementations(remat_impl):
    # The tag sits outside the custom_vjp (attention._flash), so remat3, which treats a custom_vjp as one
    # unit, sees it as the classic remat does: the output and the logsumexp are kept, nothing else.
    b, s, h, kv, d = 2, 24, 4, 2, 8
    q, k, v, w = _qkv(b, s, h, kv, d)

    def loss(q, k, v, w):
        return jnp.sum(attention.chunked_attention(q, k, v, block=8) * w)

    policy = jax.checkpoint_policies.save_only_these_names(names.CONTEXT)
    fn = jax.checkpoint(loss, policy=policy)
    kept = [r for r in internals.saved_residuals(fn, q, k, v, w) if not r.is_argument]
    assert internals.remat3_enabled() is remat_impl
    # The output (flat, as the out projection reads it) and the logsumexp, both tagged context.
    assert sorted(r.shape for r in kept) == sorted([(b, s, h * d), (b, kv, h // kv, s)]), [r.source for r in kept]
    assert {r.tag for r in kept} == {names.CONTEXT}
    got = jax.grad(fn, argnums=(0, 1, 2))(q, k, v, w)
    want = jax.grad(lambda q, k, v: jnp.sum(attention.xla_attention(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    assert max_rel_err(got, want) < 1e-4  # two attention algorithms in float32: the model tolerance
