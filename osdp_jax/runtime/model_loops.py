"""Layer stacks run by a loop of the model's own: ``jax.lax.scan``, Flax ``nn.scan``, ``nnx.scan``.

A stacked parameter ``[L, ...]`` that the layout marks ``model_loop`` reaches the model as a
*placeholder*: the whole stack, all-gathered, as an array of its own shape, so Flax's shape checks
and the model's code see what they expect. When the model passes the placeholder unchanged as a
per-iteration operand (``xs``) of ``jax.lax.scan`` (Flax's ``nn.scan`` and ``nnx.scan`` do, for
``variable_axes={"params": 0}``), the scan runs on this device's shard instead, and its body
gathers one layer's slice per iteration:

    jax.checkpoint(gather the slices, then the model's body; policy: save all but the gathered)

so one layer's gathered weights are alive at a time, the backward pass gathers each slice again
and reduce-scatters its gradient, and the model's own remat inside the body (``nn.remat``,
``jax.checkpoint``) is kept as it is. The placeholder's own all-gather is then unused, and XLA
removes it. A placeholder the model uses anywhere else (cast or sliced before the loop, or read
outside it) stays a correct whole gather, once per step.

``jax.lax.scan`` is wrapped once, on first use, by a function that defers to JAX's own unless this
thread is tracing an osdp-jax step that has placeholders: no other code sees a difference. Code
that bound the function before (``from jax.lax import scan``) calls JAX's own, and its stack is
gathered once per step.
"""
from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name

from osdp_jax.core.layout import Collective
from osdp_jax.core.stack import GATHERED_NAME, remat_policy
from osdp_jax.runtime.collectives import gather
from osdp_jax.runtime.context import ACTIVE

_LOCK = threading.Lock()
_ORIGINAL: dict = {}


class LoopEntry(NamedTuple):
    """How a ``model_loop`` parameter is stored on this device and gathered per iteration."""

    dim: int  # the stored [L, ...] parameter's sharded dimension (a layer's slice: dim - 1)
    how: Collective


def placeholder(shard, entry: LoopEntry, path: str):
    """The whole stacked parameter as the model sees it (module docstring), registered in the
    step's context so that :func:`scan` finds it."""
    ctx = ACTIVE.get()
    whole = gather(shard, entry.dim, entry.how)
    ctx.loop_placeholders[id(whole)] = (whole, shard, entry, path)
    _install()
    return whole


def _install() -> None:
    with _LOCK:
        if "scan" in _ORIGINAL:
            return
        original = jax.lax.scan

        @functools.wraps(original)
        def dispatch(f, init=None, xs=None, *args, **kwargs):
            ctx = ACTIVE.get()
            if ctx is None or not ctx.loop_placeholders:
                return original(f, init, xs, *args, **kwargs)
            return _scan(original, ctx, f, init, xs, *args, **kwargs)

        _ORIGINAL["scan"] = original
        jax.lax.scan = dispatch


def _scan(original, ctx, f, init, xs, *args, **kwargs):
    """``original(f, init, xs, ...)`` with each placeholder among ``xs``'s leaves run on its shard
    and gathered one slice per iteration (module docstring)."""
    leaves, treedef = jax.tree.flatten(xs)
    hits = {}
    for i, leaf in enumerate(leaves):
        hit = ctx.loop_placeholders.get(id(leaf))
        if hit is not None and hit[0] is leaf:
            hits[i] = hit
    if not hits:
        return original(f, init, xs, *args, **kwargs)
    ctx.loop_used.update(path for _, _, _, path in hits.values())
    local = [hits[i][1] if i in hits else leaf for i, leaf in enumerate(leaves)]

    def body(carry, x):
        parts = treedef.flatten_up_to(x)
        for i, (_, _, entry, _) in hits.items():
            parts[i] = checkpoint_name(gather(parts[i], entry.dim - 1, entry.how), GATHERED_NAME)
        return f(carry, jax.tree.unflatten(treedef, parts))

    body = jax.checkpoint(body, policy=remat_policy("none"), prevent_cse=False)
    return original(body, init, jax.tree.unflatten(treedef, local), *args, **kwargs)
