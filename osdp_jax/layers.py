"""Layer stacks a plan can cut per layer: :func:`scan`, and :class:`Stack` (Flax linen) and
:class:`NnxStack` (Flax nnx) built on it.

A model runs its repeated layers through one of these, with the layers' parameters stacked along
a leading layer axis (``[L, ...]``). Outside an osdp-jax step it is an ordinary
``jax.lax.scan`` under ``jax.checkpoint``. Under a plan each stacked parameter is gathered one
layer at a time inside the loop, and the plan may cut the stack into segments of layers, each
with its own strategy, split count and remat policy (``Plan.segments``); every segment runs as
its own scan. Nothing in the model names paths: the planner finds the stack by tracing the loss.

    # functional core
    x = osdp_jax.layers.scan(lambda p, h: block(p, h), params["blocks"], x)

    # linen: `length` copies of a module, stacked parameters under "<name>/layers"
    x = osdp_jax.layers.Stack(Block(cfg), length=12, name="blocks")(x)

    # nnx
    self.blocks = osdp_jax.layers.NnxStack(lambda rngs: Block(cfg, rngs=rngs), 12, rngs=rngs)

Layers here are deterministic functions of their parameters and input (no dropout rngs, no
mutable collections such as BatchNorm statistics).
"""
from __future__ import annotations

import jax
from flax import linen as nn
from flax import nnx

from osdp_jax.core.stack import REMAT_POLICIES, check_remat
from osdp_jax.runtime.stack import StackView, scan

__all__ = ["NnxStack", "REMAT_POLICIES", "Stack", "StackView", "scan"]


class Stack(nn.Module):
    """``length`` copies of the linen module ``layer``, run by :func:`scan`.

    The parameters are one tree under ``"layers"``, each leaf ``[length, ...]`` (the copies are
    initialised from ``length`` split keys). ``layer(x)`` must return an output shaped like ``x``.
    ``remat`` is the policy outside a plan; under one, each segment's own.
    """

    layer: nn.Module
    length: int
    remat: str = "full"
    unroll: int = 1

    @nn.compact
    def __call__(self, x):
        check_remat(self.remat)
        if self.length < 1:
            raise ValueError(f"Stack length must be at least 1, got {self.length}")
        template = self.layer.clone(parent=None, name=None)

        def init(rng):
            keys = jax.random.split(rng, self.length)
            return jax.vmap(lambda k: template.init(k, x)["params"])(keys)

        if self.has_variable("params", "layers"):
            stacked = self.get_variable("params", "layers")
        else:
            stacked = self.param("layers", init)
        return scan(lambda p, h: template.apply({"params": p}, h), stacked, x, remat=self.remat,
                    unroll=self.unroll)


class NnxStack(nnx.Module):
    """``length`` layers made by ``make_layer(rngs)``, with stacked parameters, run by :func:`scan`.

    ``self.layers`` is one layer module whose ``nnx.Param``s are ``[length, ...]`` (made with
    ``nnx.vmap`` over split rngs). A layer's state must be parameters only.
    """

    def __init__(self, make_layer, length: int, *, rngs: nnx.Rngs, remat: str = "full", unroll: int = 1):
        if length < 1:
            raise ValueError(f"NnxStack length must be at least 1, got {length}")

        @nnx.split_rngs(splits=length)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(r):
            return make_layer(r)

        self.layers = create(rngs)
        self.remat, self.unroll = check_remat(remat), unroll

    def __call__(self, x):
        graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError("NnxStack layers may hold nnx.Param state only (no rngs, batch statistics or "
                             "other variables), since only parameters are stacked")

        def layer_fn(p, h):
            return nnx.merge(graphdef, p, rest)(h)

        return scan(layer_fn, params, x, remat=self.remat, unroll=self.unroll)
