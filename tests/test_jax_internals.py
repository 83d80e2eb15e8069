"""The private-JAX wrapper: these tests break first when a JAX upgrade moves those names.

Every test that reads a jaxpr or residual list runs with ``jax_remat3`` off and on, so both of
JAX's representations of checkpoint names stay covered on whatever JAX the suite runs on. Each
assertion names the JAX version, so a failure after an upgrade says which JAX moved.
"""

import jax
import jax.numpy as jnp
import pytest

from remat_kit import _jax_internals as internals
from remat_kit import policies
from remat_kit.names import tag

JAX = f"jax {jax.__version__}"


@pytest.fixture(params=[False, True], ids=["classic", "remat3"])
def remat3(request):
    """Run the test with JAX's remat3 off, then on; restore the setting afterwards."""
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", request.param)
    yield request.param
    jax.config.update("jax_remat3", before)


def _f(w, x):
    h = tag(jnp.sin(x @ w), "h")
    return jnp.sum(jnp.cos(h) * 2.0)


def test_private_names_exist():
    assert callable(internals._saved_residuals), f"{JAX}: jax._src.ad_checkpoint.saved_residuals is gone"
    assert internals._REMAT3_NAME_CLASSES, (
        f"{JAX}: none of jax._src.ad_checkpoint.{internals._REMAT3_NAME_CLASS_NAMES} exists; "
        "remat3 checkpoint names would go unseen"
    )
    assert isinstance(jax.config.jax_remat3, bool), f"{JAX}: the jax_remat3 flag is gone"


def test_remat3_enabled_follows_the_flag(remat3):
    assert internals.remat3_enabled() is remat3, JAX


def test_checkpoint_name_representation(remat3):
    jaxpr = jax.make_jaxpr(lambda x: tag(x, "h"))(jnp.ones(2))
    (eqn,) = jaxpr.jaxpr.eqns
    expected = internals._HI_PRIMITIVE if remat3 else internals._NAME_PRIMITIVE
    assert eqn.primitive.name == expected, f"{JAX} (remat3={remat3}): checkpoint_name binds {eqn.primitive.name!r}"
    assert internals.checkpoint_name_of(eqn) == "h", f"{JAX} (remat3={remat3}): the tag is no longer readable"
    (plain,) = jax.make_jaxpr(jnp.sin)(jnp.ones(2)).jaxpr.eqns
    assert internals.checkpoint_name_of(plain) is None


def test_saved_residuals_reports_names_sizes_and_arguments(remat3):
    w, x = jnp.ones((4, 8)), jnp.ones((3, 4))
    f = jax.checkpoint(_f, policy=jax.checkpoint_policies.save_only_these_names("h"))
    res = internals.saved_residuals(f, w, x)
    named = [r for r in res if r.tag == "h"]
    assert len(named) == 1, f"{JAX} (remat3={remat3}): {[r.source for r in res]}"
    assert named[0].shape == (3, 8) and named[0].dtype == "float32" and named[0].nbytes == 3 * 8 * 4
    assert not named[0].host and not named[0].is_argument
    assert {r.shape for r in res if r.is_argument} == {(4, 8), (3, 4)}, f"{JAX}: {[r.source for r in res]}"
    assert len(res) == 3


def test_saved_residuals_marks_host_offload(remat3):
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device", offload_dst="pinned_host"
    )
    res = internals.saved_residuals(jax.checkpoint(_f, policy=policy), jnp.ones((4, 8)), jnp.ones((3, 4)))
    # jax 0.10's remat3 cannot offload (see test_offload_supported): it keeps nothing then.
    expected = [(3, 8)] if internals.offload_supported() else []
    assert [r.shape for r in res if r.host] == expected, f"{JAX} (remat3={remat3}): {res}"


def test_saved_residuals_sizes_prng_keys():
    # Full recompute keeps the function's inputs, the key among them.
    f = jax.checkpoint(lambda key, x: jnp.sum(jnp.sin(x * jax.random.uniform(key, x.shape))))
    res = internals.saved_residuals(f, jax.random.key(0), jnp.ones(3))
    keys = [r for r in res if "key" in r.dtype]
    assert keys and all(r.nbytes == 8 for r in keys), f"{JAX}: {res}"  # threefry key data: 2 x uint32


def test_emitted_tags_finds_names_inside_scan_and_remat(remat3):
    def f(x):
        g = jax.checkpoint(lambda c: tag(jnp.sin(c), "inner"))
        out, _ = jax.lax.scan(lambda c, _: (g(tag(c, "outer")), None), x, None, length=3)
        return out

    found = internals.emitted_tags(f, jax.ShapeDtypeStruct((2,), jnp.float32))
    assert found == {"inner", "outer"}, f"{JAX} (remat3={remat3}): {sorted(found)}"


def test_count_primitive_top_level_and_recursive(remat3):
    def f(x):
        out, _ = jax.lax.scan(lambda c, _: (jnp.sin(c) @ jnp.eye(2), None), x, None, length=5)
        return out

    jaxpr = jax.make_jaxpr(f)(jnp.ones(2))
    assert internals.count_primitive(jaxpr, "scan", top_level=True) == 1
    assert internals.count_primitive(jaxpr, "dot_general") == 1


def test_subjaxprs_walks_into_rematerialized_calls(remat3):
    # The recompute lives in a remat body (remat2, or remat3's RematTraced; jax 0.10's remat3 inlines
    # it): a walker that missed it would count the backward pass of a rematerialized step short.
    def loss(w, x):
        g = jax.checkpoint(lambda w, c: jnp.sin(c @ w) @ w, policy=jax.checkpoint_policies.nothing_saveable)
        return jnp.sum(g(w, x))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(jnp.ones((4, 4)), jnp.ones((2, 4)))
    # forward 2, recompute 1 (sin's input), backward 3 (both cotangents of the outer dot, d/dw of
    # the inner one); identical in both representations.
    assert internals.count_primitive(jaxpr, "dot_general") == 6, f"{JAX} (remat3={remat3}): {jaxpr}"


def _block(w, x):
    up = tag(x @ w, "mlp_up")  # [3, 8], a dot with no batch dims
    act = tag(jnp.sin(up), "mlp_act")
    return jnp.sum(jnp.cos(act))


def _kept(policy):
    res = internals.saved_residuals(policy.checkpoint(_block), jnp.ones((4, 8)), jnp.ones((3, 4)))
    return sorted((r.shape, r.host, r.tag or r.source.split(" from ")[0]) for r in res if not r.is_argument)


_ON_DEVICE = ((3, 8), False)
# What each jax.checkpoint policy that policies.Policy.jax_policy builds keeps of _block.
POLICY_KEEPS = {
    "full": [],
    "selective:mlp_act": [(*_ON_DEVICE, "mlp_act")],
    "offload:mlp_act": [((3, 8), True, "output of device_put")],
    "offload:mlp_act;save=mlp_up": [(*_ON_DEVICE, "mlp_up"), ((3, 8), True, "output of device_put")],
    "dots": [(*_ON_DEVICE, "output of dot_general")],
}


@pytest.mark.parametrize("spec", sorted(POLICY_KEEPS))
def test_policy_keeps_the_same_under_remat3(spec, remat3):
    expected = POLICY_KEEPS[spec]
    if remat3 and spec.startswith("offload") and not internals.offload_supported():
        # jax 0.10's remat3 knows only its own policy classes; it recomputes everything under the
        # offload policy (a plain function there).
        expected = []
    assert _kept(policies.parse(spec)) == expected, f"{JAX} (remat3={remat3})"


def test_unpinned_host_stays_on_the_device(remat3):
    """Why policies.OFFLOAD_DESTINATIONS holds only pinned_host: JAX's remat leaves an unpinned_host residual on
    the device (a silent no-op), so remat_kit refuses that destination."""
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["mlp_act"],
        offload_src="device",
        offload_dst="unpinned_host",
    )
    res = internals.saved_residuals(jax.checkpoint(_block, policy=policy), jnp.ones((4, 8)), jnp.ones((3, 4)))
    assert not any(r.host for r in res), f"{JAX} (remat3={remat3})"
    assert policies.OFFLOAD_DESTINATIONS == ("pinned_host",)


def test_offload_supported(remat3):
    old = jax.__version_info__ < (0, 11)
    assert internals.offload_supported() is not (remat3 and old), f"{JAX} (remat3={remat3})"


def test_dot_shapes_reads_dimension_numbers(remat3):
    # [batch=2, m=3, k=4] x [batch=2, k=4, n=5]: rhs axis 1 contracted, axis 0 batched.
    jaxpr = jax.make_jaxpr(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))(jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)))
    (dot,) = [d for d in map(internals.dot_shapes, internals.iter_eqns(jaxpr)) if d is not None]
    assert dot == internals.DotShapes(lhs=(2, 3, 4), rhs=(2, 4, 5), rhs_contracting=(1,), rhs_batch=(0,)), JAX
    (plain,) = internals.eqns(jax.make_jaxpr(jnp.sin)(jnp.ones(2)))
    assert internals.dot_shapes(plain) is None and internals.primitive_name(plain) == "sin"


def test_scan_length_reads_the_trip_count(remat3):
    def f(x):
        out, _ = jax.lax.scan(jax.checkpoint(lambda c, _: (jnp.sin(c), None)), x, None, length=7)
        return out

    (scan,) = internals.eqns(jax.make_jaxpr(f)(jnp.ones(2)))
    assert internals.primitive_name(scan) == "scan" and internals.scan_length(scan) == 7, f"{JAX} (remat3={remat3})"
    assert all(internals.scan_length(e) is None for sub in internals.subjaxprs(scan) for e in internals.iter_eqns(sub))


def test_under_transform_sees_grad_jit_and_vmap():
    seen = []

    def probe(x):
        seen.append(internals.under_transform())
        return x

    probe(1.0)
    jax.grad(probe)(1.0)
    jax.jit(probe)(1.0)
    jax.vmap(probe)(jnp.ones(2))
    assert seen == [False, True, True, True], JAX


# ---- the cost model's walks (added for remat_kit.planning.cost and .tensors) --------------------------------


def test_weighted_leaf_eqns_multiply_scan_bodies_and_enter_remat():
    def f(x):
        body = jax.checkpoint(lambda c, _: (jnp.sin(c) * c, None))  # its backward needs sin(c)
        return jax.lax.scan(body, x, None, length=3)[0]

    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x))))(jnp.ones(4))
    sins = sum(t for e, t in internals.weighted_leaf_eqns(jaxpr) if e.primitive.name == "sin")
    assert sins == 2 * 3  # forward, and again in the backward pass under remat, per trip
    assert all(not list(internals.subjaxprs(e)) for e, _ in internals.weighted_leaf_eqns(jaxpr))


def test_host_transfers_and_bytes():
    def f(x):
        return jnp.sum(jnp.sin(tag(jnp.sin(x), "h")))

    jaxpr = jax.make_jaxpr(jax.grad(policies.offload(["h"])(f)))(jnp.ones(8, jnp.float32))
    moves = [e for e, _ in internals.weighted_leaf_eqns(jaxpr) if internals.is_host_transfer(e)]
    assert len(moves) == 2 and all(internals.aval_nbytes(e.invars[0]) == 32 for e in moves)
    plain = jax.make_jaxpr(lambda x: jax.device_put(x, jax.devices()[0]))(jnp.ones(2))
    assert not any(internals.is_host_transfer(e) for e in plain.jaxpr.eqns)


def test_first_remat_body_and_its_vjp():
    fn = jax.checkpoint(lambda x: jnp.sin(jnp.sin(x)))
    body = internals.first_remat_body(jax.make_jaxpr(fn)(jnp.ones(4)))
    assert body is not None and [v.aval.shape for v in body.jaxpr.invars] == [(4,)]
    recomputed = internals.vjp_jaxpr(body, jax.checkpoint_policies.nothing_saveable)
    kept = internals.vjp_jaxpr(body, None)
    count = lambda j: sum(t for e, t in internals.weighted_leaf_eqns(j) if e.primitive.name == "sin")
    assert (count(kept), count(recomputed)) == (2, 3)  # the backward needs the inner sin again
    assert internals.first_remat_body(jax.make_jaxpr(jnp.sin)(1.0)) is None


def test_linen_layer_rngs_draw_each_layers_plain_dropout_key():
    """A layer's functional apply under marked streams draws the key Flax derives from that layer's path."""
    import flax.linen as nn

    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(x)

    names = ["layer_0", "layer_1", "layer_2"]
    got, seen = {}, {}

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            outs = []
            for name in names:
                block = Drop(name=name)
                if name == "layer_0":  # read the first block's streams before it draws
                    seen["rngs"] = internals.linen_block_rngs(block.scope, names)
                outs.append(block(x))
            return outs

    x, rngs = jnp.ones((64,)), {"dropout": jax.random.key(3)}
    want = Model().apply({}, x, rngs=rngs)
    marked, prefixes = seen["rngs"]
    assert prefixes == [(n,) for n in names], JAX
    for i in range(3):
        with internals.linen_layer_rngs(prefixes, jnp.int32(i)):
            got[i] = Drop().apply({}, x, rngs=marked)
        assert bool(jnp.all(got[i] == want[i])), (i, JAX)
    assert not bool(jnp.all(want[0] == want[1]))  # the layers draw different keys


# ---- Flax transforms already on a model (remat_kit.apply sees through nn.jit/nnx.jit, refuses the rest) ----


def test_linen_transform_names_the_lifted_transform_on_a_method_or_class():
    import flax.linen as nn

    class M(nn.Module):
        @nn.jit
        def a(self, x):
            return x

        def __call__(self, x):
            return x

    assert internals.linen_transform(M.a) == "jit"
    assert internals.linen_transform(M.__call__) is None
    assert internals.linen_transform(nn.remat(M).__call__) == "checkpoint"
    assert internals.linen_transform(nn.vmap(M, variable_axes={}, split_rngs={}).__call__) == "vmap"


def test_linen_transforms_around_reads_the_enclosing_transforms():
    import flax.linen as nn

    seen = []

    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen.append(internals.linen_transforms_around())
            return x

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat(Inner)()(x)

    Outer().init(jax.random.key(0), jnp.ones(2))
    assert seen[0] == [("checkpoint", "CheckpointInner.__call__")]


def test_nnx_transform_names_jit_and_vmap():
    from flax import nnx

    class B(nnx.Module):
        @nnx.jit
        def a(self, x):
            return x

        @nnx.vmap(in_axes=(None, 0))
        def b(self, x):
            return x

        def c(self, x):
            return x

    assert [internals.nnx_transform(f) for f in (B.a, B.b, B.c)] == ["jit", "vmap", None]
