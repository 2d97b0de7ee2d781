"""Discovery: which parameters a loss function gathers per layer, and which reach dense layers.

The planner traces the loss once, abstractly, with the step context in recording mode: every
parameter passed through ``osdp_jax.gather_params`` is noted as gathered inside a layer loop,
and every 2-D kernel that reaches a dense layer (``osdp_jax.split.dense``, or an intercepted
Flax ``Dense``/``nnx.Linear``) as a dense kernel. Nothing is compiled or allocated.
"""
from __future__ import annotations

import jax

from ._describe import strip_boxes
from .runtime.context import StepContext, active
from .runtime.hooks import wrap_tree
from .runtime.interception import intercepting


def discover(loss_fn, params, batch) -> tuple[set[str], set[str]]:
    """Paths of the parameters ``loss_fn`` passes through ``gather_params``, and of the kernels it
    runs through a dense layer, traced abstractly (``params`` and ``batch`` may be abstract)."""
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
