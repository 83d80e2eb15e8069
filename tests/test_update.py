"""remat_kit.step.update: the optimizer's update is traced once per optimizer, whatever the loss around it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from remat_kit.step import update as step_lib


def _counting(inner: optax.GradientTransformation, calls: list) -> optax.GradientTransformation:
    def update(grads, state, params=None):
        calls.append(1)
        return inner.update(grads, state, params)

    return optax.GradientTransformation(inner.init, update)


PARAMS = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
X = jnp.ones((2, 4))


def _losses():
    plain = lambda p, x: jnp.sum((x @ p["w"] + p["b"][None]) ** 2)
    remat = lambda p, x: jnp.sum(jax.checkpoint(lambda p: (x @ p["w"] + p["b"][None]) ** 2)(p))
    return plain, remat


def test_a_second_step_over_another_loss_reuses_the_update_s_trace():
    calls: list = []
    opt = _counting(optax.adamw(1e-2), calls)
    state = step_lib.init_optimizer(opt, PARAMS)
    outs = [jax.jit(step_lib.make_step(loss, opt))(PARAMS, state, X) for loss in _losses()]
    assert len(calls) == 1  # the two steps (another policy, say) share the update's trace
    for a, b in zip(jax.tree.leaves(outs[0][:2]), jax.tree.leaves(outs[1][:2]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@dataclasses.dataclass(eq=True)
class Unhashable:
    """An optimizer object that cannot be hashed (a dataclass with eq): its update is traced with each step."""

    inner: optax.GradientTransformation

    def init(self, params):
        return self.inner.init(params)

    def update(self, grads, state, params=None):
        return self.inner.update(grads, state, params)


def test_an_unhashable_optimizer_still_updates():
    opt = Unhashable(optax.sgd(0.1))
    state = step_lib.init_optimizer(opt, PARAMS)
    params, *_ = jax.jit(step_lib.make_step(_losses()[0], opt))(PARAMS, state, X)
    reference = optax.apply_updates(PARAMS, optax.sgd(0.1).update(jax.grad(_losses()[0])(PARAMS, X), state)[0])
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
