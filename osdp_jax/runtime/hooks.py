"""The calls a model makes into osdp-jax: :func:`gather_params` and :func:`dense`.

**Per-layer gathering.** XLA keeps every weight gathered outside a loop alive for the whole step
(measured by ``experiments/benchmarks/gather_memory.py``), so ZeRO-3 only saves the gathered
weights' memory when each layer gathers its own slice inside the loop body, under
``jax.checkpoint`` (the backward pass gathers it again). A model opts in by passing the per-layer
parameter slices through :func:`gather_params` in its scanned body, e.g. with Flax's
``nn.map_variables``::

    body = nn.map_variables(Block, "params", init=self.is_initializing(),
                            trans_in_fn=lambda v: {**v, "params": osdp_jax.gather_params(
                                v["params"], prefix="blocks/layers")})
    nn.scan(nn.remat(body), variable_axes={"params": 0}, ...)

``prefix`` is the stacked parameters' path in the params tree. Outside an osdp-jax train step (or
for parameters the plan replicates) ``gather_params`` returns its input unchanged, so the same
model runs anywhere.

**Dense layers.** :func:`dense` is ``x @ kernel + bias`` that the plan may split (operator
splitting, ``osdp_jax.runtime.kernels.matmul``) or gather at the layer; unmodified Flax
``Dense``/``nnx.Linear`` layers are routed to it (``osdp_jax.runtime.interception``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .._describe import path_name
from .collectives import gather
from .context import ACTIVE, SplitKernel, StepContext
from .kernels import matmul


def gather_params(tree, prefix: str = ""):
    """Per-layer slices of stacked parameters, all-gathered where the plan shards them.

    Args:
      tree: the slices one loop iteration uses (leading layer axis already removed).
      prefix: the path of the stacked parameters in the params tree, e.g. ``"blocks/layers"``.

    A slice the plan *splits* (operator splitting, ``osdp_jax.split``) is passed on as its local
    shard: the split layer gathers it one piece at a time.
    """
    ctx = ACTIVE.get()
    if ctx is None:
        return tree

    def one(path, x):
        name = "/".join(p for p in (prefix, path_name(path)) if p)
        if ctx.recording:
            ctx.recorded_loop.add(name)
        if ctx.recording or name in ctx.split:
            return ctx.wrap(x, name, stacked=True)
        if name in ctx.gathered:
            dim, how = ctx.gathered[name]
            return gather(x, dim - 1, how)  # the slice has lost the leading layer axis
        return x

    return jax.tree_util.tree_map_with_path(one, tree)


def wrap_tree(ctx: StepContext, params):
    """``params`` (unboxed) as the model sees them: split kernels wrapped (``StepContext.wrap``)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: ctx.wrap(x, path_name(path), stacked=False), params)


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
    record(kernel)
    if not isinstance(kernel, SplitKernel):
        if dtype is not None:
            x, kernel = x.astype(dtype), kernel.astype(dtype)
        y = jnp.matmul(x, kernel, precision=precision)
    else:
        shard = kernel.shard
        dtype = dtype or jnp.result_type(x, shard)
        y = matmul(x.astype(dtype), shard.astype(dtype), kernel.spec, precision=precision)
    return y + bias.astype(y.dtype) if bias is not None else y


def record(kernel) -> None:
    """During discovery, note that ``kernel`` (a 2-D parameter) reaches a splittable dense layer."""
    ctx = ACTIVE.get()
    if ctx is not None and ctx.recording and getattr(kernel, "ndim", 0) == 2:
        path = ctx.lookup(kernel)
        if path is not None:
            ctx.recorded_split.add(path)
