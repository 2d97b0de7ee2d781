"""The calls a model makes into osdp-jax besides ``osdp_jax.layers.scan``: :func:`dense`.

**Dense layers.** :func:`dense` is ``x @ kernel + bias`` that the plan may split (operator
splitting, ``osdp_jax.runtime.kernels.matmul``) or gather at the layer; unmodified Flax
``Dense``/``nnx.Linear`` layers are routed to it (``osdp_jax.runtime.interception``).

**Per-layer gathering** is ``osdp_jax.layers.scan`` (``runtime.stack``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from osdp_jax.core.describe import path_name
from osdp_jax.runtime.context import ACTIVE, SplitKernel, StepContext
from osdp_jax.runtime.kernels import matmul


def wrap_tree(ctx: StepContext, params):
    """``params`` (unboxed) as the model sees them: split kernels wrapped (``StepContext.wrap``)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: ctx.wrap(x, path_name(path)), params)


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
    record(kernel, x)
    if not isinstance(kernel, SplitKernel):
        if dtype is not None:
            x, kernel = x.astype(dtype), kernel.astype(dtype)
        y = jnp.matmul(x, kernel, precision=precision)
    else:
        shard = kernel.shard
        dtype = dtype or jnp.result_type(x, shard)
        y = matmul(x.astype(dtype), shard.astype(dtype), kernel.spec, precision=precision)
    return y + bias.astype(y.dtype) if bias is not None else y


def record(kernel, x=None, splittable: bool = True) -> None:
    """During discovery, note that ``kernel`` reaches a dense layer, in the order layers are
    first called, and the shape of its input ``x`` (the first call's); a 2-D kernel of a
    ``splittable`` layer (Dense, Linear) is also one operator splitting may split. A
    multi-head projection's (``DenseGeneral``, ``LinearGeneral``) is recorded with
    ``splittable=False``: for its order and input only (``planner.tensor_pairs``)."""
    ctx = ACTIVE.get()
    if ctx is not None and ctx.recording and getattr(kernel, "ndim", 0) >= 2:
        path = ctx.lookup(kernel)
        if path is None:
            return
        if splittable and kernel.ndim == 2:
            ctx.recorded_split.add(path)
        elif splittable:
            return
        if path not in ctx.recorded_dense:
            ctx.recorded_dense.append(path)
            ctx.recorded_inputs[path] = tuple(getattr(x, "shape", ()))
