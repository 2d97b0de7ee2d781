"""Gathering ZeRO-3 weights inside a model's layer loop, one layer at a time.

XLA keeps every weight gathered outside a loop alive for the whole step (``shared/JAX_NOTES.md``),
so ZeRO-3 only saves memory for the gathered weights when each layer gathers its own slice inside
the loop body, under ``jax.checkpoint`` (the backward pass gathers it again). A model opts in by
passing the per-layer parameter slices through :func:`gather_params` in its scanned body, e.g.
with Flax's ``nn.map_variables``::

    body = nn.map_variables(Block, "params", init=self.is_initializing(),
                            trans_in_fn=lambda v: {**v, "params": osdp_jax.gather_params(
                                v["params"], prefix="blocks/layers")})
    nn.scan(nn.remat(body), variable_axes={"params": 0}, ...)

``prefix`` is the stacked parameters' path in the params tree. Outside an osdp-jax train step (or
for parameters the plan replicates) ``gather_params`` returns its input unchanged, so the same
model runs anywhere. The planner finds the parameters a model gathers this way by tracing the
loss once (``discover``).
"""
from __future__ import annotations

import jax

from ._context import ACTIVE, StepContext, active
from ._describe import path_name, strip_boxes


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
    from ._train import gather  # the custom_vjp all-gather / reduce-scatter pair

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


def discover(loss_fn, params, batch) -> tuple[set[str], set[str]]:
    """Paths of the parameters ``loss_fn`` passes through :func:`gather_params`, and of the
    kernels it runs through a splittable dense layer (``osdp_jax.split``), traced abstractly."""
    from ._split import intercepting

    ctx = StepContext({}, recording=True)

    def traced(p, b):
        p = wrap_tree(ctx, strip_boxes(p))
        with intercepting():
            return loss_fn(p, b)

    with active(ctx):
        # a fresh function each time: eval_shape caches traces by function, and a cached trace
        # would not call the hooks again
        jax.eval_shape(traced, params, batch)
    return ctx.recorded_loop, ctx.recorded_split
