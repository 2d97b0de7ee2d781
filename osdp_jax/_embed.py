"""Embedding lookups whose table gradient is built when the backward pass reaches them.

The gradient of ``jnp.take(table, ids, axis=0)`` is a scatter-add of the output's cotangent into
a table-sized buffer of zeros. That zero fill depends on nothing, so XLA:CPU's scheduler starts
it at the top of the step, and the whole table-sized gradient buffer (V x D) stays alive through
every layer loop of the forward and backward passes: 179 MiB per device for gpt2-48l-1536's
embedding. :func:`lookup` is the same lookup with its own VJP, whose zeros are made from the
cotangent (0 x one of its elements), so the buffer exists only from the lookup's backward on.

While an osdp-jax step (or the planner's discovery) traces the loss, unmodified
``flax.linen.Embed`` and ``flax.nnx.Embed`` lookups go through :func:`lookup`
(``osdp_jax.split.intercepting``); their ``attend`` is unchanged.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from ._context import original, patched


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table, ids, shape):
    return jnp.take(table, ids, axis=0)


def _lookup_fwd(table, ids, shape):
    return _lookup(table, ids, shape), ids


def _lookup_bwd(shape, ids, cotangent):
    zero = jax.lax.stop_gradient(cotangent.reshape(-1)[0] * 0)  # depends on the cotangent: not hoisted
    grad = jnp.broadcast_to(zero, shape).at[ids].add(cotangent, mode="drop")
    return grad, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def lookup(table, ids):
    """``jnp.take(table, ids, axis=0)`` (rows of ``table`` (V, D) for integer ``ids``), whose
    gradient buffer for ``table`` is allocated only when the backward pass reaches it."""
    return _lookup(table, ids, tuple(table.shape))


def _linen_interceptor(next_fun, args, kwargs, context):
    from flax import linen as nn

    module = context.module
    if (context.method_name != "__call__" or type(module) is not nn.Embed or module.scope is None
            or len(args) != 1 or kwargs or module.num_embeddings == 1
            or not jnp.issubdtype(args[0].dtype, jnp.integer)
            or not module.scope.has_variable("params", "embedding")):
        return next_fun(*args, **kwargs)
    table = module.scope.get_variable("params", "embedding")
    (table,) = module.promote_dtype(table, dtype=module.dtype, inexact=False)
    return lookup(table, args[0])


def _nnx_call(self, inputs, out_sharding=None):
    from flax import nnx

    if out_sharding is not None or self.num_embeddings == 1 or not jnp.issubdtype(inputs.dtype, jnp.integer):
        return original(nnx.Embed, "__call__")(self, inputs, out_sharding)
    (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    return lookup(table, inputs)


@contextlib.contextmanager
def intercepting():
    """While tracing a step: ``flax.linen.Embed`` and ``flax.nnx.Embed`` look up through :func:`lookup`."""
    from flax import linen as nn
    from flax import nnx

    with nn.intercept_methods(_linen_interceptor), patched(nnx.Embed, "__call__", _nnx_call):
        yield
