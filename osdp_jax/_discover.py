"""Discovery: which parameters a loss function runs as layer stacks, and which reach dense layers.

The planner traces the loss once, abstractly, with the step context in recording mode: the
parameters each ``osdp_jax.layers.scan`` call runs are noted as one stack (gathered per layer,
inside the loop), and every 2-D kernel that reaches a dense layer (``osdp_jax.split.dense``, or
an intercepted Flax ``Dense``/``nnx.Linear``) as a dense kernel; every call that could be a unit
(``osdp_jax.units``) with the parameters it holds. Nothing is compiled or allocated.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from ._describe import strip_boxes
from .runtime.context import StepContext, active
from .runtime.hooks import wrap_tree
from .runtime.interception import intercepting


class Found(NamedTuple):
    in_loop: set  # paths of stacked parameters (run by layers.scan)
    dense: set  # paths of kernels that reach a dense layer
    stacks: tuple  # per layers.scan call, the paths of its parameters
    units: tuple = ()  # possible units (runtime.units): (kind, name, parameter paths) per call
    saved: dict = {}  # per possible unit, the activation bytes its calls save (runtime.units.saved_bytes)


def find(loss_fn, params, batch) -> Found:
    """What tracing ``loss_fn`` once, abstractly, shows (``params`` and ``batch`` may be abstract)."""
    ctx = StepContext(recording=True)

    def traced(p, b):
        p = wrap_tree(ctx, strip_boxes(p))
        with intercepting():
            return loss_fn(p, b)

    with active(ctx):
        # a fresh function each time: eval_shape caches traces by function, and a cached trace
        # would not call the hooks again
        jax.eval_shape(traced, params, batch)
    stacks = tuple(dict.fromkeys(s for s in ctx.recorded_stacks if s))  # a stack run twice is one
    return Found(ctx.recorded_loop, ctx.recorded_split, stacks, tuple(ctx.recorded_units), dict(ctx.recorded_saved))


def discover(loss_fn, params, batch) -> tuple[set[str], set[str]]:
    """Paths of the stacked parameters ``loss_fn`` runs through ``osdp_jax.layers.scan``, and of the
    kernels it runs through a dense layer, traced abstractly (``params`` and ``batch`` may be
    abstract)."""
    found = find(loss_fn, params, batch)
    return found.in_loop, found.dense
