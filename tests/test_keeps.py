"""What policies keep, read from JAX's residual analysis and the compiled program (not from constants)."""

import jax
import jax.numpy as jnp
import pytest

from remat_kit import _jax_internals as internals
from remat_kit import policies as P
from remat_kit.analysis import memory
from remat_kit.names import tag


def _kept(fn, *args):
    return sorted((r.shape, r.host) for r in internals.saved_residuals(fn, *args) if not r.is_argument)


def test_dots_keeps_unbatched_matmul_outputs_and_recomputes_the_rest():
    # [8, 16] @ [16, 32] is a dot without batch dimensions: kept. The batched einsum ([4, 8, 16] x
    # [4, 16, 8], batch dim 4) and the elementwise sin/cos are recomputed.
    def f(w, x, y):
        h = jnp.sin(x @ w)  # dot [8, 32], then sin
        z = jnp.einsum("bij,bjk->bik", jnp.broadcast_to(x, (4, 8, 16)), y)  # batched dot [4, 8, 8]
        return jnp.sum(jnp.cos(h)) + jnp.sum(jnp.cos(z))

    args = jnp.ones((16, 32)), jnp.ones((8, 16)), jnp.ones((4, 16, 8))
    assert _kept(P.dots()(f), *args) == [((8, 32), False)]
    assert ((8, 32), False) in _kept(f, *args) and len(_kept(f, *args)) > 1  # without a policy, more is kept


def test_jit_retraces_only_when_the_policy_changes():
    # Policies are static jit arguments: equal specs hit the cache, a different policy retraces.
    traces = []
    f = jax.jit(lambda x, p: traces.append(str(p)) or p.checkpoint(jnp.sin)(x), static_argnums=1)
    x = jnp.ones(3)
    f(x, P.parse("minimal"))
    f(x, P.parse("selective:q_proj,k_proj,v_proj,attn_out,mlp_gate,mlp_up,mlp_out"))  # the same policy
    f(x, P.full())
    assert traces == ["selective:q_proj,k_proj,v_proj,attn_out,mlp_gate,mlp_up,mlp_out", "full"]


@pytest.mark.skipif(not internals.offload_supported(), reason="this JAX's remat cannot offload (remat3 on 0.10)")
def test_offload_is_host_placed_in_the_compiled_program_only_where_the_backend_enforces_it():
    def f(w, x):
        h = tag(jnp.sin(x @ w), "u")
        return jnp.sum(jnp.sin(h @ w))

    w, x = jnp.ones((64, 64)), jnp.ones((8, 64))
    g = P.offload(["u"])(f)
    assert _kept(g, w, x) == [((8, 64), True)]  # JAX's analysis: the tagged value goes to host memory
    compiled = jax.jit(jax.grad(g)).lower(w, x).compile()
    stats = compiled.memory_analysis()
    host_bytes = stats.host_temp_size_in_bytes + stats.host_argument_size_in_bytes + stats.host_output_size_in_bytes
    on_host = host_bytes > 0 or "S(5)" in compiled.as_text()  # S(5): XLA's host memory space
    assert on_host == memory.host_offload().enforced
    if not on_host:  # CPU: the program keeps it on the device, and every report says so
        assert "does not enforce host offload" in memory.host_offload().note
    else:
        assert memory.host_offload().note is None
