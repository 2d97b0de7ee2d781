"""Operator splitting: a dense layer whose ZeRO-3 kernel is gathered one slice at a time.

Under ZeRO-3 a dense kernel W (D, F) is all-gathered whole before use, so the step's transient
peak holds all D*F of it (and its full-size gradient). Split into k slices, ``y = sum_j x_j W_j``
along the input dimension (or ``y = concat_j x W_j`` along the output dimension), only one slice,
D*F/k, is gathered at a time. The slices run as a ``jax.lax.scan`` whose body gathers its slice
and is rematerialised (``jax.checkpoint``), so XLA keeps the all-gather inside the loop and the
backward pass gathers each slice again instead of keeping all k; each slice's gradient is
reduce-scattered on its own.

The split is *strided*: device r's stored shard holds rows ``[r D/N, (r+1) D/N)`` and slice j
takes rows ``[j D/(N k), (j+1) D/(N k))`` of every shard, a local reshape with no data movement.
So the kernel keeps its natural shape and storage ``PartitionSpec`` for every k; the input
features are regrouped the same way. Needs ``D % (N k) == 0`` for the split dimension of size D.

Costs, per split kernel of p bytes per step (N devices): ``k`` iterations, each gathering p/k
bytes twice (forward, and again in the rematerialised backward) and reduce-scattering p/k.

Models use it in one of two ways:

- unmodified ``flax.linen.Dense`` and ``flax.nnx.Linear`` layers are intercepted while an
  osdp-jax step (or the planner's discovery) traces the loss;
- custom layers call :func:`dense` with the kernel exactly as they got it from the params.

Outside an osdp-jax step, or for replicated kernels, :func:`dense` is ``x @ W + b``. A sharded
per-step kernel the plan does not split (k = 1) is gathered whole by its dense layer, once the
layer's input is ready (not before the loss, where XLA:CPU would start the gather at the top of
the step and keep the weight alive through every layer loop); any other use of it gathers it
there.
A split kernel reaches the model as a ``SplitKernel`` (its local shard with the whole kernel's
shape, so Flax's shape checks pass); any other use of it raises a ``TypeError`` naming it.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from ._context import ACTIVE, SplitKernel, SplitSpec, original, patched


def matmul(x, shard, spec: SplitSpec, precision=None):
    """``x @ W`` for the ZeRO-3 kernel W whose local shard is ``shard`` (inside ``shard_map``).

    Args:
      x: (..., D) inputs.
      shard: this device's shard of W (D, F), split along ``spec.dim`` over ``spec.how.axes``.
      spec: the split: sharded dimension (0: input features, 1: output features), how the
        shard is gathered (``Collective``), and k.
    """
    from ._train import gather

    if spec.k == 1:
        # not split: the whole kernel gathered here, once x is ready. Adding 0 x (one element of
        # x) makes the gather depend on x; XLA:CPU would otherwise start it at the top of the
        # step (an optimization_barrier does not stop that) and keep it alive through the loops.
        shard = shard + jax.lax.stop_gradient(x.reshape(-1)[0] * 0).astype(shard.dtype)
        return jnp.matmul(x, gather(shard, spec.dim, spec.how), precision=precision)
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
        def body(acc, jw):
            j, wj = jw
            xj = jax.lax.dynamic_index_in_dim(xr, j, axis=xr.ndim - 2, keepdims=False).reshape(*lead, n * piece)
            return acc + jnp.matmul(xj, gather(wj, 0, spec.how), precision=precision), None

        dtype = jnp.result_type(x, shard)
        y, _ = jax.lax.scan(body, jnp.zeros((*lead, shard.shape[1]), dtype), (jnp.arange(k), ws))
        return y

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
    return jnp.moveaxis(ys, 0, -2).reshape(*lead, n * k * piece)


def dense(x, kernel, bias=None, *, precision=None, dtype=None):
    """``x @ kernel + bias`` that the plan may split (operator splitting); else plain.

    Call it with the kernel exactly as it came from the params: under a plan that splits it,
    that is a :class:`SplitKernel` (this device's shard) and the product runs slice by slice.

    Args:
      x: (..., D) inputs.
      kernel: (D, F) weight.
      bias: optional (F,) bias.
      precision: passed to the matmul.
      dtype: compute dtype that inputs, kernel and bias are promoted to (default: their common type).
    """
    _record(kernel)
    if not isinstance(kernel, SplitKernel):
        if dtype is not None:
            x, kernel = x.astype(dtype), kernel.astype(dtype)
        y = jnp.matmul(x, kernel, precision=precision)
    else:
        shard = kernel.shard
        dtype = dtype or jnp.result_type(x, shard)
        y = matmul(x.astype(dtype), shard.astype(dtype), kernel.spec, precision=precision)
    return y + bias.astype(y.dtype) if bias is not None else y


def _record(kernel) -> None:
    """During discovery, note that ``kernel`` (a 2-D parameter) reaches a splittable dense layer."""
    ctx = ACTIVE.get()
    if ctx is not None and ctx.recording and getattr(kernel, "ndim", 0) == 2:
        path = ctx.lookup(kernel)
        if path is not None:
            ctx.recorded_split.add(path)


# --- interception of unmodified Flax layers ----------------------------------------------------

def _linen_interceptor(next_fun, args, kwargs, context):
    from flax import linen as nn

    module = context.module
    if (context.method_name != "__call__" or type(module) is not nn.Dense or module.scope is None
            or len(args) != 1 or kwargs or not module.scope.has_variable("params", "kernel")
            or module.dot_general is not None or module.dot_general_cls is not None):
        return next_fun(*args, **kwargs)
    kernel = module.scope.get_variable("params", "kernel")
    _record(kernel)
    if not isinstance(kernel, SplitKernel):
        return next_fun(*args, **kwargs)
    bias = module.scope.get_variable("params", "bias") if module.use_bias else None
    return dense(args[0], kernel, bias, precision=module.precision, dtype=module.dtype)


def _nnx_call(self, inputs, out_sharding=None):
    from flax import nnx

    original_call = original(nnx.Linear, "__call__")
    kernel = self.kernel[...]
    _record(kernel)
    if not isinstance(kernel, SplitKernel):
        return original_call(self, inputs, out_sharding)
    if out_sharding is not None or getattr(self, "dot_general", jax.lax.dot_general) is not jax.lax.dot_general:
        kernel.as_array()  # raises for a split kernel; an unsplit one is gathered by nnx's own code
        return original_call(self, inputs, out_sharding)
    bias = self.bias[...] if self.bias is not None else None
    y = dense(inputs, kernel, bias, precision=self.precision, dtype=self.dtype)
    return y.astype(self.preferred_element_type) if self.preferred_element_type is not None else y


@contextlib.contextmanager
def intercepting():
    """While tracing a step: ``flax.linen.Dense`` and ``flax.nnx.Linear`` go through :func:`dense`,
    and ``flax.linen.Embed`` and ``flax.nnx.Embed`` through ``_embed.lookup``."""
    from flax import linen as nn
    from flax import nnx

    from . import _embed

    # nnx has no method interception: Linear.__call__ is patched while the step is traced
    with nn.intercept_methods(_linen_interceptor), patched(nnx.Linear, "__call__", _nnx_call), \
            _embed.intercepting():
        yield
