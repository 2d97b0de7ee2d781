"""Kernels the step runs in place of plain array code, each shaped by XLA:CPU's scheduler.

XLA:CPU's (concurrency-optimising) scheduler starts every collective and every constant fill that
depends on nothing at the top of the step, and keeps its result alive until its last use. Three
kernels arrange the dependencies so that memory is held only where it is used:

- :func:`after`: ``y + 0 * x[0]`` (stop-gradient), which makes a gather or a zero fill wait for
  ``x``. (An ``optimization_barrier`` does not stop the hoisting.)
- :func:`matmul`: operator splitting. A ZeRO-3 dense kernel W (D, F) split into k slices,
  ``y = sum_j x_j W_j`` along the input dimension (or ``concat_j x W_j`` along the output one),
  runs as a ``jax.lax.scan`` whose ``jax.checkpoint``ed body gathers its slice just before the
  matmul; the backward pass gathers each slice again and reduce-scatters its gradient. So one
  slice, D F / k elements, is alive at a time instead of the whole kernel. Per split kernel of p
  bytes per step over N devices: k iterations, each gathering p/k bytes twice (forward, and again
  in the rematerialised backward) and reduce-scattering p/k. The split is *strided*: device r's
  shard holds rows ``[r D/N, (r+1) D/N)`` and slice j takes rows ``[j D/(N k), (j+1) D/(N k))`` of
  every shard, a local reshape, so the kernel keeps its shape and storage ``PartitionSpec`` for
  every k; needs ``D % (N k) == 0``. With k = 1 the kernel is gathered whole, after its input.
  The input split's zero-initialised accumulator is made once x is (:func:`after`): made at the
  top of the step, it would hold an output-sized buffer through the forward pass.
  Only each slice's product is checkpointed, not the running sum it is added to, so no slice's
  loop input is kept for the backward pass; and the result is named ``_stack.SPLIT_NAME``, which
  the "dots" remat policy keeps as it keeps an unsplit matmul's output. (With the sum inside the
  checkpoint, a layer under "dots" would keep k output-sized sums.)
- :func:`lookup`: an embedding lookup whose table-sized gradient buffer (V x D bytes) is made from
  the cotangent, when the backward pass reaches it, rather than at the top of the step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from osdp_jax.core.stack import SPLIT_NAME
from osdp_jax.runtime.collectives import gather
from osdp_jax.runtime.context import SplitSpec


def after(x, y):
    """``y``, computed only once ``x`` is: ``y + 0 * x[0]`` with the gradient stopped (dtype of ``y``)."""
    # x's first element by index, not by flattening: a flattened x split over a model axis is gathered
    return y + jax.lax.stop_gradient(x[(0,) * x.ndim] * 0).astype(y.dtype)


def matmul(x, shard, spec: SplitSpec, precision=None):
    """``x @ W`` for the ZeRO-3 kernel W whose local shard is ``shard`` (inside ``shard_map``).

    Args:
      x: (..., D) inputs.
      shard: this device's shard of W (D, F), split along ``spec.dim`` over ``spec.how.axes``.
      spec: the split: sharded dimension (0: input features, 1: output features), how the
        shard is gathered (``Collective``), and k.
    """
    if spec.k == 1:
        # not split: the whole kernel gathered here, once x is ready
        return jnp.matmul(x, spec.gather(after(x, shard)), precision=precision)
    n = jax.lax.psum(1, spec.how.axes)
    k = spec.k
    if shard.ndim != 2 or spec.dim not in (0, 1):
        raise ValueError(f"a split kernel must be 2-D and sharded along dimension 0 or 1, got shape "
                         f"{shard.shape} sharded along {spec.dim}")
    local = shard.shape[spec.dim]
    if local % k:
        raise ValueError(f"cannot split a kernel shard of {local} rows into {k} slices")
    piece = local // k

    if spec.dim == 0:
        # input split: slice j of x's features, in the strided order of the gathered slice, is
        # read inside the loop body (no rearranged copy of x)
        lead = x.shape[:-1]
        xr = x.reshape(*lead, n, k, piece)
        ws = shard.reshape(k, piece, shard.shape[1])

        @jax.checkpoint
        def product(j, wj):  # x_j W_j, the slice gathered here and again in the backward pass
            xj = jax.lax.dynamic_index_in_dim(xr, j, axis=xr.ndim - 2, keepdims=False).reshape(*lead, n * piece)
            return jnp.matmul(xj, gather(wj, 0, spec.how), precision=precision)

        def body(acc, jw):  # the sum outside the checkpoint: its input is no residual
            return acc + product(*jw), None

        y0 = after(x, jnp.zeros((*lead, shard.shape[1]), jnp.result_type(x, shard)))  # made once x is: not hoisted
        y, _ = jax.lax.scan(body, y0, (jnp.arange(k), ws))
        return checkpoint_name(y, SPLIT_NAME)

    # output split: y = concat_j x W_j, W_j the strided column slice j. The shard is used
    # transposed, (F/N, D), so each slice is gathered and reduce-scattered along its major
    # dimension (no full-slice transposes around the collectives).
    ws = shard.T.reshape(k, piece, shard.shape[0])  # (k, F/(N k), D)

    @jax.checkpoint
    def body(_, wj):
        wt = gather(wj, 0, spec.how)  # (n piece, D)
        return None, jax.lax.dot_general(x, wt, (((x.ndim - 1,), (1,)), ((), ())), precision=precision)

    _, ys = jax.lax.scan(body, None, ws)  # (k, ..., n * piece)
    lead = x.shape[:-1]
    ys = ys.reshape(k, *lead, n, piece)
    return checkpoint_name(jnp.moveaxis(ys, 0, -2).reshape(*lead, n * k * piece), SPLIT_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table, ids, shape):
    return jnp.take(table, ids, axis=0)


def _lookup_fwd(table, ids, shape):
    return _lookup(table, ids, shape), ids


def _lookup_bwd(shape, ids, cotangent):
    zero = after(cotangent, jnp.zeros((), cotangent.dtype))  # made once the cotangent is: not hoisted
    grad = jnp.broadcast_to(zero, shape).at[ids].add(cotangent, mode="drop")
    return grad, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def lookup(table, ids):
    """``jnp.take(table, ids, axis=0)`` (rows of ``table`` (V, D) for integer ``ids``), whose
    gradient buffer for ``table`` is allocated only when the backward pass reaches it."""
    return _lookup(table, ids, tuple(table.shape))
