"""``scan``: a layer stack run one layer per loop iteration, in segments as the plan says.

``scan(layer_fn, stacked, x)`` is ``jax.lax.scan`` of ``layer_fn(layer_params, x) -> x`` over the
leading (layer) axis of ``stacked``. Outside a train step it is exactly that, each layer under
``jax.checkpoint`` with the ``remat`` policy asked for. Inside an osdp-jax step, each stacked
parameter reaches it as a :class:`StackView` (this device's arrays, one per segment, and how each
segment is gathered), and every segment runs as its own scan:

- the body gathers its layer's slice of each ZeRO-3/HSDP parameter (all-gather; the backward pass
  gathers it again and reduce-scatters the gradient), or wraps it as a ``SplitKernel`` for its
  dense layer (split in k slices);
- the body runs under ``jax.checkpoint`` with the segment's remat policy (``_stack.remat_policy``);
  a gathered weight is never saved for the backward pass, under any policy.

So one layer's gathered weights are alive at a time. Per layer of p bytes over N devices (ring
bandwidth W): 2 all-gathers and 1 reduce-scatter of p bytes, 3 (N-1)/N p / W seconds.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name

from osdp_jax.core.layout import Collective
from osdp_jax.core.stack import GATHERED_NAME, check_remat, is_segmented, remat_policy
from osdp_jax.runtime.collectives import gather
from osdp_jax.runtime.context import ACTIVE, SplitKernel, SplitSpec

log = logging.getLogger("osdp_jax")


class SegmentRun(NamedTuple):
    """How one segment of a stacked parameter runs on this device."""

    start: int
    stop: int
    dim: int | None  # sharded dimension of the stored [L, ...] parameter (None: replicated)
    how: Collective | None
    k: int  # split count (1: gathered whole)
    n: int  # devices in the gather
    remat: str
    tensor: str = ""  # "column"/"row": a layer's slice split over the model axis (core.tensor)
    model: object = None  # that slice's PartitionSpec over the model axis


class StackView:
    """A stacked parameter as the model sees it inside a step: ``parts[j]`` is this device's array
    for ``runs[j]``; ``shape`` is the whole parameter's, so Flax's shape checks pass. Only
    :func:`scan` can use it."""

    def __init__(self, path: str, shape, dtype, parts, runs):
        self.path, self.shape, self.dtype = path, tuple(shape), dtype
        self.parts, self.runs = tuple(parts), tuple(runs)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _refuse(self, *_, **__):
        raise TypeError(
            f"parameter {self.path!r} is a layer stack that the plan runs with osdp_jax.layers.scan: pass "
            f"the stacked parameters to it unchanged (cast or reshape inside layer_fn, per layer)")

    __jax_array__ = __array__ = _refuse

    def __getitem__(self, key):  # nnx reads a variable's value as ``var[...]``
        if key is Ellipsis:
            return self
        self._refuse()

    def __getattr__(self, name):
        if name.startswith("__") or name in ("path", "shape", "dtype", "parts", "runs"):
            raise AttributeError(name)
        self._refuse()

    def layer(self, j: int, local):
        """One layer's slice ``local`` of segment j, as ``layer_fn`` gets it."""
        run = self.runs[j]
        if run.how is None:
            return _tensor_slice(local, run)
        if run.k > 1:
            return SplitKernel(local, self.shape[1:], SplitSpec(run.dim - 1, run.how, run.k), self.path)
        gathered = gather(local, run.dim - 1, run.how, run.model)
        return _tensor_slice(checkpoint_name(gathered, GATHERED_NAME), run)

    def __repr__(self):
        return f"StackView({self.path!r}, shape={self.shape}, segments={len(self.runs)})"


def _tensor_slice(layer, run: SegmentRun):
    """A layer's slice kept split over the model axis, and known to the dense layers as split
    (``StepContext.tensor_output``), when its parameter has a tensor role."""
    if not run.tensor:
        return layer
    layer = jax.lax.with_sharding_constraint(layer, run.model)
    ACTIVE.get().tensor_ids[id(layer)] = (layer, run.tensor)
    return layer


def _is_view(x) -> bool:
    return isinstance(x, StackView)


def _layers(leaves) -> int:
    sizes = {leaf.shape[0] for leaf in leaves if getattr(leaf, "ndim", 0) >= 1}
    if len(sizes) != 1:
        raise ValueError(f"osdp_jax.layers.scan: every stacked parameter needs the same leading (layer) "
                         f"dimension, got {sorted(sizes)}")
    return sizes.pop()


def _run(layer_fn, leaves, treedef, x, segments, slice_of, remat_of, unroll, recorded=None):
    for j, (start, stop) in enumerate(segments):
        xs = [slice_of(leaf, j, start, stop) for leaf in leaves]

        def body(h, layer, j=j):
            used = [leaf.layer(j, p) if _is_view(leaf) else p for leaf, p in zip(leaves, layer)]
            for p, path in zip(used, recorded or ()):
                if path is not None:  # discovery: a layer's slice reaching a dense layer is its kernel
                    ACTIVE.get().kernels[id(p)] = (p, path)
            return layer_fn(jax.tree.unflatten(treedef, used), h), None

        body = jax.checkpoint(body, policy=remat_policy(remat_of(j)), prevent_cse=False)
        x, _ = jax.lax.scan(body, x, xs, unroll=unroll)
    return x


def scan(layer_fn, stacked, x, *, remat: str = "full", unroll: int = 1):
    """Run ``layer_fn`` over the layers of ``stacked``: ``x = layer_fn(layer_params, x)`` per layer.

    Outside a step, parameters placed in segments (``osdp_jax.Segmented``, from ``osdp_jax.shard``)
    run segment by segment as they are stored.

    Args:
      layer_fn: ``(layer_params, x) -> x``, with ``layer_params`` shaped like ``stacked`` without
        its leading layer axis; ``x`` any pytree of arrays, the same structure and shapes out as in.
      stacked: a pytree of the stack's parameters, each ``[L, ...]``, passed exactly as they come
        from the params (under a plan they are :class:`StackView` objects).
      x: the first layer's input.
      remat: the remat policy outside a plan (``"full"``, ``"dots"`` or ``"none"``); under a plan,
        each segment's own.
      unroll: ``jax.lax.scan``'s unroll.

    Returns:
      The last layer's output.
    """
    check_remat(remat)
    leaves, treedef = jax.tree.flatten(stacked, is_leaf=lambda v: _is_view(v) or is_segmented(v))
    if not leaves:
        raise ValueError("osdp_jax.layers.scan: the stack has no parameters")
    layers = _layers(leaves)
    ctx = ACTIVE.get()
    views = [leaf for leaf in leaves if _is_view(leaf)]
    recorded = None
    if ctx is not None and ctx.recording:
        recorded = [ctx.lookup(leaf) for leaf in leaves]
        if None in recorded:
            log.warning("osdp_jax.layers.scan got a stacked array that is not one of the params as given "
                        "(transformed before the call?): it cannot be sharded per layer")
        paths = [p for p in recorded if p is not None]
        ctx.recorded_loop.update(paths)
        ctx.recorded_stacks.append(tuple(paths))
    if not views:
        if ctx is not None and not ctx.recording:
            gathered = sorted(p for p in (ctx.lookup(leaf) for leaf in leaves) if p in ctx.per_step)
            if gathered:
                raise ValueError(
                    f"parameter {gathered[0]!r} is run by osdp_jax.layers.scan but the layout gathers it whole "
                    f"before the loss, once per step: mark the stack's parameters in_loop (e.g. "
                    f"Layout.fsdp(params, mesh, in_loop=osdp_jax.discover(loss_fn, params, batch)[0])), or plan "
                    f"with osdp_jax.plan(..., loss_fn=, batch=) so that they are found")
        stored = [leaf for leaf in leaves if is_segmented(leaf)]  # placed params used outside a step
        bounds = list(stored[0].bounds) if stored else [(0, layers)]
        if any(list(leaf.bounds) != bounds for leaf in stored):
            raise ValueError("osdp_jax.layers.scan: the stack's parameters are stored in different segments; "
                             "merge them with osdp_jax.merge_segments first")

        def part(leaf, j, a, b):
            if is_segmented(leaf):
                return leaf.parts[j]
            return leaf if len(bounds) == 1 else leaf[a:b]
        return _run(layer_fn, leaves, treedef, x, bounds, part, lambda j: remat, unroll, recorded)
    bounds = [(r.start, r.stop) for r in views[0].runs]
    for v in views[1:]:
        if [(r.start,
             r.stop) for r in v.runs] != bounds or [r.remat for r in v.runs] != [r.remat for r in views[0].runs]:
            raise ValueError(
                f"parameters {views[0].path!r} and {v.path!r} run in one osdp_jax.layers.scan but the plan cuts "
                f"them into different segments: a layout must give every parameter of a stack the same "
                f"segment bounds and remat policies")
    if bounds[-1][1] != layers:
        raise ValueError(f"the plan's segments of {views[0].path!r} cover {bounds[-1][1]} layers, the stack has "
                         f"{layers}: re-plan for this model")

    def slice_of(leaf, j, start, stop):
        return leaf.parts[j] if _is_view(leaf) else leaf[start:stop]

    return _run(layer_fn, leaves, treedef, x, bounds, slice_of, lambda j: views[0].runs[j].remat, unroll)
