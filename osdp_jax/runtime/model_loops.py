"""Layer stacks run by a loop of the model's own: ``jax.lax.scan``, Flax ``nn.scan``, ``nnx.scan``.

A stacked parameter ``[L, ...]`` that the layout marks ``model_loop`` reaches the model as a
*placeholder*: the whole stack as one array of its own shape (all-gathered where it is sharded),
so Flax's shape checks and the model's code see what they expect. When the model passes the
placeholder unchanged as a per-iteration operand (``xs``) of ``jax.lax.scan`` (Flax's ``nn.scan``
and ``nnx.scan`` do, for parameters scanned along axis 0), the scan runs as
``osdp_jax.layers.scan`` runs a stack: segment by segment as the plan cuts it, each segment its
own scan over this device's arrays, whose body

- gathers its layer's slice of each sharded parameter (``runtime.stack.StackView.layer``), and
- runs the model's body under ``jax.checkpoint`` with the segment's remat policy, narrowed to what
  the model's own remat around the body (``nn.remat``, ``jax.checkpoint``) saves, if it has one;
  a gathered weight is never saved for the backward pass, under any policy.

So one layer's gathered weights are alive at a time, and the backward pass gathers each slice
again and reduce-scatters its gradient, and a plan never keeps more of the body than the model's
own remat allows. The placeholder's own gather is then unused, and XLA
removes it. A placeholder the model uses anywhere else (cast or sliced before the loop, read
outside it) is a correct whole gather, once per step; ``runtime.gradient`` raises when a sharded
one never reaches a scan.

``jax.lax.scan`` is wrapped once, on first use, by a function that defers to JAX's own unless this
thread is tracing an osdp-jax step with placeholders: no other code sees a difference. Code that
bound the function before (``from jax.lax import scan`` at import) calls JAX's own.
"""
from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp

from osdp_jax.core.stack import remat_policy
from osdp_jax.runtime.collectives import gather
from osdp_jax.runtime.context import ACTIVE
from osdp_jax.runtime.stack import StackView

_LOCK = threading.Lock()
_ORIGINAL: dict = {}


def placeholder(view: StackView):
    """The whole stacked parameter of ``view`` as one array (module docstring), registered in the
    step's context so that the wrapped ``jax.lax.scan`` finds it."""
    parts = [part if run.how is None else gather(part, run.dim, run.how) for part, run in zip(view.parts, view.runs)]
    whole = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    ACTIVE.get().loop_placeholders[id(whole)] = (whole, view)
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


def _scan(original, ctx, f, init, xs, length=None, reverse=False, unroll=1, **kwargs):
    """``original(f, init, xs, ...)``, run segment by segment on this device's arrays when a
    placeholder is among ``xs``'s leaves (module docstring)."""
    leaves, treedef = jax.tree.flatten(xs)
    views = {}
    for i, leaf in enumerate(leaves):
        hit = ctx.loop_placeholders.get(id(leaf))
        if hit is not None and hit[0] is leaf:
            views[i] = hit[1]
    if not views:
        return original(f, init, xs, length=length, reverse=reverse, unroll=unroll, **kwargs)
    first = next(iter(views.values()))
    _check_segments(views.values(), first)
    ctx.loop_used.update(v.path for v in views.values())
    order = range(len(first.runs))
    carry, ys, own = init, [None] * len(first.runs), _UNSEEN
    for j in reversed(order) if reverse else order:
        run = first.runs[j]
        part = [views[i].parts[j] if i in views else leaf[run.start:run.stop] for i, leaf in enumerate(leaves)]

        def body(c, x, j=j):
            sliced = treedef.flatten_up_to(x)
            used = [views[i].layer(j, p) if i in views else p for i, p in enumerate(sliced)]
            return f(c, jax.tree.unflatten(treedef, used))

        if own is _UNSEEN:
            own = _own_policy(body, carry, jax.tree.unflatten(treedef, part))
        body = jax.checkpoint(body, policy=_both(remat_policy(run.remat), own), prevent_cse=False)
        carry, ys[j] = original(body, carry, jax.tree.unflatten(treedef, part), reverse=reverse, unroll=unroll,
                                **kwargs)
    if len(ys) == 1:
        return carry, ys[0]
    return carry, jax.tree.map(lambda *y: jnp.concatenate(y, axis=0), *ys)


_UNSEEN = object()
_NO_REMAT = object()  # the model's body has no remat of its own


def _own_policy(body, carry, xs):
    """The policy of the model's own remat around its scan body (``nn.remat``, ``jax.checkpoint``):
    the first ``checkpoint`` equation of the body traced on one iteration's slices, at its top
    level or inside ``jit``; None for its default (nothing saveable); ``_NO_REMAT`` without one."""
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs)
    closed = jax.make_jaxpr(body)(carry, one)

    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("checkpoint", "remat", "remat2"):
                return eqn.params.get("policy")
            inner = eqn.params.get("jaxpr")
            inner = getattr(inner, "jaxpr", inner)
            if eqn.primitive.name in ("pjit", "jit", "closed_call") and inner is not None:
                found = find(inner)
                if found is not _NO_REMAT:
                    return found
        return _NO_REMAT
    return find(closed.jaxpr)


def _both(policy, own):
    """``policy`` (the segment's), saving only what the model's own remat policy ``own`` saves too,
    so a plan never keeps more of the body than the model's remat allows."""
    if own is _NO_REMAT:
        return policy
    if own is None:
        return jax.checkpoint_policies.nothing_saveable

    def saveable(prim, *args, **params):
        return policy(prim, *args, **params) and own(prim, *args, **params)
    return saveable


def _check_segments(views, first: StackView) -> None:
    bounds = [(r.start, r.stop, r.remat) for r in first.runs]
    for v in views:
        if [(r.start, r.stop, r.remat) for r in v.runs] != bounds:
            raise ValueError(
                f"parameters {first.path!r} and {v.path!r} run in one scan but the plan cuts them into "
                f"different segments: a layout must give every parameter of a stack the same segment "
                f"bounds and remat policies")
