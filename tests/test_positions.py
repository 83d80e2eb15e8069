"""remat_kit.policies.positions: a traced program run a block of positions at a time, checked first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remat_kit.policies import positions

RTOL = 1e-5  # float32 sums in another order
S, D = 16, 8


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _rope(x, pos):
    angle = pos[..., None].astype(jnp.float32) / 10000 ** (jnp.arange(D // 2) / (D // 2))[None, None, :]
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([a * jnp.cos(angle) - b * jnp.sin(angle), b * jnp.cos(angle) + a * jnp.sin(angle)], -1)


PER_TOKEN = {  # fn, in_axes, the output's axis
    "mlp": (lambda x, w: jax.nn.gelu(x @ w) @ w.T, (1, None), 1),
    "rmsnorm": (lambda x, w: _rms(x) * w[0][None, None, :], (1, None), 1),
    "heads": (lambda x, w: (x @ w).reshape(x.shape[0], S, 2, D // 2).transpose(0, 2, 1, 3).sum(-1), (1, None), 2),
    "rope": (lambda x, pos: _rope(x, pos), (1, 1), 1),
    "where_iota": (lambda x, w: jnp.where(jnp.arange(S)[None, :, None] % 3 == 0, x @ w, -x), (1, None), 1),
    "concat_other": (lambda x, w: jnp.concatenate([x, x @ w], axis=-1), (1, None), 1),
}

NOT_PER_TOKEN = {
    "cumsum": (lambda x, w: jnp.cumsum(x, axis=1) @ w, "cumsum"),
    "mean_over_seq": (lambda x, w: x - jnp.mean(x, axis=1, keepdims=True), "reduce_sum"),
    "contract_seq": (lambda x, w: jnp.einsum("bsd,bse->bde", x, x), "dot_general"),
    "flip": (lambda x, w: jnp.flip(x, axis=1), "rev"),
    "gather": (lambda x, w: x[:, jnp.array([3, 1, 2, 0] * (S // 4))], "gather"),
}


def _args(name):
    x = jax.random.normal(jax.random.key(0), (2, S, D))
    if name == "rope":
        return x, jnp.broadcast_to(jnp.arange(S), (2, S))
    return x, jax.random.normal(jax.random.key(1), (D, D)) / 3


@pytest.mark.parametrize("name", list(PER_TOKEN), ids=list(PER_TOKEN))
def test_per_token_programs_run_in_blocks_with_the_plain_gradients(name):
    fn, in_axes, out_axis = PER_TOKEN[name]
    args = _args(name)
    closed = jax.make_jaxpr(fn)(*args)
    assert positions.check(closed, in_axes, 4) == (out_axis,)
    run = positions.blocked(closed, in_axes, 4)
    np.testing.assert_allclose(run(*args)[0], fn(*args), rtol=RTOL, atol=1e-6)
    g_plain = jax.grad(lambda x: jnp.sum(jnp.sin(fn(x, args[1]))))(args[0])
    g_blocked = jax.grad(lambda x: jnp.sum(jnp.sin(run(x, args[1])[0])))(args[0])
    np.testing.assert_allclose(g_blocked, g_plain, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("name", list(NOT_PER_TOKEN), ids=list(NOT_PER_TOKEN))
def test_a_program_that_mixes_positions_is_refused_naming_the_equation(name):
    fn, primitive = NOT_PER_TOKEN[name]
    closed = jax.make_jaxpr(fn)(*_args("mlp"))
    with pytest.raises(positions.NotPerPosition, match=primitive):
        positions.check(closed, (1, None), 4)


def test_blocks_must_divide_the_length():
    closed = jax.make_jaxpr(lambda x: x * 2)(jnp.ones((2, S, D)))
    with pytest.raises(ValueError, match="blocks=3 does not divide the sequence length 16"):
        positions.check(closed, (1,), 3)


def test_an_output_without_the_axis_is_refused():
    closed = jax.make_jaxpr(lambda x, w: (x @ w, w * 2))(*_args("mlp"))
    with pytest.raises(positions.NotPerPosition, match="does not carry the blocked axis"):
        positions.check(closed, (1, None), 4)


# ---- attention regions ----------------------------------------------------------------------------------


def attention(x, wq, wk, wv, *, kv_heads=2, softcap=None, window=None):
    """Scores, a causal (or sliding) mask from iota, soft-capping, GQA: what libraries write inline."""
    b, s, _ = x.shape
    q = jnp.einsum("bsd,dhe->bshe", x, wq)
    k, v = jnp.einsum("bsd,dhe->bshe", x, wk), jnp.einsum("bsd,dhe->bshe", x, wv)
    q = q.reshape(b, s, kv_heads, q.shape[2] // kv_heads, q.shape[3])
    scores = jnp.einsum("bqkgh,bskh->bkgqs", q, k) / jnp.sqrt(q.shape[-1])
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    qi, ki = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    mask = qi >= ki if window is None else (qi >= ki) & (qi - ki < window)
    scores = jnp.where(mask, scores, -1e9)
    p = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
    out = jnp.einsum("bkgqs,bskh->bqkgh", p, v)
    return out.reshape(b, s, -1)


ATTENTION = {
    "causal": {},
    "softcap": {"softcap": 30.0},
    "sliding": {"window": 5},
}


def _weights(seq=S, d=D, heads=4, head_dim=4):
    ks = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(ks[0], (2, seq, d))
    return x, *(jax.random.normal(k, (d, heads, head_dim)) / 3 for k in ks[1:])


def _wk(wk):
    return wk[:, :2]  # two kv heads


@pytest.mark.parametrize("kind", list(ATTENTION), ids=list(ATTENTION))
def test_attention_runs_in_query_blocks_with_the_plain_gradients(kind):
    x, wq, wk, wv = _weights()
    fn = lambda x, wq, wk, wv: attention(x, wq, _wk(wk), _wk(wv), **ATTENTION[kind])
    flat = positions.inline(jax.make_jaxpr(fn)(x, wq, wk, wv))
    (region,) = positions.attention_regions(flat, S)
    assert "test_positions.py" in region.where
    run = positions.run_regions(flat, [region], 4)
    np.testing.assert_allclose(run(x, wq, wk, wv)[0], fn(x, wq, wk, wv), rtol=RTOL, atol=1e-6)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    g_plain = jax.grad(loss(fn), argnums=(0, 1, 2, 3))(x, wq, wk, wv)
    g_blocked = jax.grad(loss(lambda *a: run(*a)[0]), argnums=(0, 1, 2, 3))(x, wq, wk, wv)
    for a, b in zip(g_blocked, g_plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)


def test_attention_weights_that_leave_the_region_are_refused():
    def fn(x, wq, wk, wv):
        q, k = jnp.einsum("bsd,dhe->bshe", x, wq), jnp.einsum("bsd,dhe->bshe", x, wk)
        p = jax.nn.softmax(jnp.einsum("bqhe,bkhe->bhqk", q, k), axis=-1)
        return jnp.einsum("bhqk,bkhe->bqhe", p, jnp.einsum("bsd,dhe->bshe", x, wv)), p

    flat = positions.inline(jax.make_jaxpr(fn)(*_weights()))
    with pytest.raises(positions.NotPerPosition, match=r"leaves its region"):
        positions.attention_regions(flat, S)


def test_query_blocks_shrink_the_backward_working_set():
    seq = 1024
    x, wq, wk, wv = _weights(seq, 32, 4, 8)
    fn = lambda *a: attention(a[0], a[1], _wk(a[2]), _wk(a[3]))
    flat = positions.inline(jax.make_jaxpr(fn)(x, wq, wk, wv))
    run = positions.run_regions(flat, positions.attention_regions(flat, seq), 16)

    def temp(f):
        step = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1)))
        return step.lower(x, wq, wk, wv).compile().memory_analysis().temp_size_in_bytes

    scores = 2 * 4 * seq * seq * 4  # one float32 copy of [b, heads, s, s]
    assert temp(fn) > scores
    # 16 blocks: a block's scores are 1/16 of them; the backward holds a few such copies, never the whole.
    assert temp(lambda *a: run(*a)[0]) < scores / 2
