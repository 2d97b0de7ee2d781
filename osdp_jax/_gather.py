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

import contextlib
import contextvars
import dataclasses

import jax

from ._describe import path_name, strip_boxes


@dataclasses.dataclass
class _Context:
    specs: dict  # path -> (sharded dim of the stacked parameter, mesh axes)
    recorded: set | None = None  # discovery mode: collect paths, gather nothing


_ACTIVE: contextvars.ContextVar[_Context | None] = contextvars.ContextVar("osdp_jax_gather", default=None)


def gather_params(tree, prefix: str = ""):
    """Per-layer slices of stacked parameters, all-gathered where the plan shards them.

    Args:
      tree: the slices one loop iteration uses (leading layer axis already removed).
      prefix: the path of the stacked parameters in the params tree, e.g. ``"blocks/layers"``.
    """
    ctx = _ACTIVE.get()
    if ctx is None:
        return tree
    from ._train import gather  # the custom_vjp all-gather / reduce-scatter pair

    def one(path, x):
        name = "/".join(p for p in (prefix, path_name(path)) if p)
        if ctx.recorded is not None:
            ctx.recorded.add(name)
            return x
        if name in ctx.specs:
            dim, axes = ctx.specs[name]
            return gather(x, dim - 1, axes)  # the slice has lost the leading layer axis
        return x

    return jax.tree_util.tree_map_with_path(one, tree)


@contextlib.contextmanager
def gathering(specs: dict):
    """While tracing a train step: ``gather_params`` gathers the given ``{path: (dim, axes)}``."""
    token = _ACTIVE.set(_Context(specs))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def discover(loss_fn, params, batch) -> set[str]:
    """Paths of the parameters ``loss_fn`` passes through :func:`gather_params` (traced abstractly)."""
    ctx = _Context({}, recorded=set())
    token = _ACTIVE.set(ctx)
    try:
        # a fresh function each time: eval_shape caches traces by function, and a cached trace
        # would not call gather_params again
        jax.eval_shape(lambda p, b: loss_fn(p, b), strip_boxes(params), batch)
    finally:
        _ACTIVE.reset(token)
    return ctx.recorded
