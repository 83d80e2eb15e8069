"""The private-JAX wrapper: these tests break first when a JAX upgrade moves those names."""

import jax
import jax.numpy as jnp

from remat_kit import _jax_internals as internals
from remat_kit.names import tag


def _f(w, x):
    h = tag(jnp.sin(x @ w), "h")
    return jnp.sum(jnp.cos(h) * 2.0)


def test_saved_residuals_reports_names_sizes_and_arguments():
    w, x = jnp.ones((4, 8)), jnp.ones((3, 4))
    f = jax.checkpoint(_f, policy=jax.checkpoint_policies.save_only_these_names("h"))
    res = internals.saved_residuals(f, w, x)
    named = [r for r in res if r.tag == "h"]
    assert len(named) == 1
    assert named[0].shape == (3, 8) and named[0].dtype == "float32" and named[0].nbytes == 3 * 8 * 4
    assert not named[0].host and not named[0].is_argument
    assert {r.shape for r in res if r.is_argument} == {(4, 8), (3, 4)}


def test_saved_residuals_marks_host_offload():
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device", offload_dst="pinned_host"
    )
    res = internals.saved_residuals(jax.checkpoint(_f, policy=policy), jnp.ones((4, 8)), jnp.ones((3, 4)))
    assert [r.shape for r in res if r.host] == [(3, 8)]


def test_saved_residuals_sizes_prng_keys():
    def f(key, x):
        return jnp.sum(x * jax.random.uniform(key, x.shape))

    res = internals.saved_residuals(f, jax.random.key(0), jnp.ones(3))
    keys = [r for r in res if "key" in r.dtype]
    assert all(r.nbytes == 8 for r in keys)  # threefry key data: 2 x uint32


def test_emitted_tags_finds_names_inside_scan_and_remat():
    def f(x):
        g = jax.checkpoint(lambda c: tag(jnp.sin(c), "inner"))
        out, _ = jax.lax.scan(lambda c, _: (g(tag(c, "outer")), None), x, None, length=3)
        return out

    assert internals.emitted_tags(f, jax.ShapeDtypeStruct((2,), jnp.float32)) == {"inner", "outer"}


def test_count_primitive_top_level_and_recursive():
    def f(x):
        out, _ = jax.lax.scan(lambda c, _: (jnp.sin(c) @ jnp.eye(2), None), x, None, length=5)
        return out

    jaxpr = jax.make_jaxpr(f)(jnp.ones(2))
    assert internals.count_primitive(jaxpr, "scan", top_level=True) == 1
    assert internals.count_primitive(jaxpr, "dot_general") == 1
