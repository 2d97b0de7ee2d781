"""Embedding lookups with a deferred table gradient (osdp_jax.runtime.kernels): same values and gradients
as ``jnp.take``, and the gradient buffer no longer sits in the step's peak."""
import jax
import jax.numpy as jnp
import numpy as np

from osdp_jax.runtime.kernels import lookup


def test_lookup_equals_take_with_repeated_ids():
    table = jax.random.normal(jax.random.key(0), (16, 8))
    ids = jnp.array([[0, 3, 3, 15], [7, 0, 0, 0]])
    w = jax.random.normal(jax.random.key(1), (2, 4, 8))

    def f(lookup_fn, t):
        return jnp.sum(jnp.sin(lookup_fn(t, ids)) * w)
    take = lambda t, i: jnp.take(t, i, axis=0)  # noqa: E731
    np.testing.assert_array_equal(lookup(table, ids), take(table, ids))
    g = jax.jit(jax.grad(lambda t: f(lookup, t)))(table)
    g_ref = jax.grad(lambda t: f(take, t))(table)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(g)[[1, 2, 4]] == 0)  # rows never looked up get no gradient


def test_lookup_gradient_buffer_is_not_alive_through_the_step():
    """A table looked up before a loop whose backward pass comes first: with ``jnp.take``
    XLA:CPU fills the table-sized zeros for the table's gradient at the start, so they are alive
    together with the loop's saved activations; with ``lookup`` they are made when the backward
    pass reaches the lookup, after the loop. XLA's temp drops by about one table. (The table's
    gradient is reduced here, as a train step reduce-scatters it, so it is temp, not an output.)"""
    table = jax.ShapeDtypeStruct((4096, 512), jnp.float32)  # 8 MiB
    ws = jax.ShapeDtypeStruct((16, 512, 512), jnp.float32)
    ids = jax.ShapeDtypeStruct((2048,), jnp.int32)  # saved activations: 16 x 2048 x 512 x 4 = 64 MiB

    def loss(lookup_fn, t, w, i):
        def layer(h, wi):
            return jnp.tanh(h @ wi), None
        h, _ = jax.lax.scan(jax.checkpoint(layer), lookup_fn(t, i), w)
        return jnp.sum(h ** 2)

    def temp(lookup_fn):
        def f(t, w, i):
            g_t, g_w = jax.grad(lambda t, w: loss(lookup_fn, t, w, i), argnums=(0, 1))(t, w)
            return g_t.sum(0), g_w
        return jax.jit(f).lower(table, ws, ids).compile().memory_analysis().temp_size_in_bytes

    take = lambda t, i: jnp.take(t, i, axis=0)  # noqa: E731
    table_bytes = 4096 * 512 * 4
    with_take, with_lookup = temp(take), temp(lookup)
    assert with_lookup <= with_take - 0.9 * table_bytes, (with_lookup, with_take)
