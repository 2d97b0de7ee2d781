"""The sharded training step: explicit data parallelism under ``jax.shard_map``.

Every device runs ``loss_fn`` on its slice of the global batch. Per parameter, by its layout:

- replicated: the local gradient is averaged with one all-reduce (``pmean``);
- zero3/hsdp: the stored shard is all-gathered (``runtime.collectives.gather``) before ``loss_fn``
  runs, at its dense layer, or one layer at a time inside the model's loop, and the gradient of
  the gathered weight is reduce-scattered back to a shard;
- zero2: used whole, as replicated; its gradient is reduce-scattered (``psum_scatter``) to the
  shard its optimizer state is kept on, and the updated shards are all-gathered into the whole
  parameter when the step lays its output out.

With microbatches, each gradient is summed across them where its layout's ``accumulate`` says
(:func:`grad_body`).

The optimizer then runs on the global arrays (outside the shard_map). Flax linen metadata boxes
are stripped before ``loss_fn`` sees the parameters. The loss is the mean of the per-device
losses, so ``loss_fn`` must return the *mean* loss over the batch it is given; the gradient is then
exactly that of the global mean loss.

This module also compiles a step without allocating (:func:`compile_step`); placing parameters,
optimizer state and batches is ``runtime.place``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import time
from typing import NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from osdp_jax.core.compat import supported_compile_options
from osdp_jax.core.describe import check_trainable, describe, path_name, strip_boxes
from osdp_jax.core.layout import (
    Layout,
    as_layout,
    batch_specs,
    collective,
    one_segment,
    opt_state_specs,
    spec_tree,
    state_spec_tree,
)
from osdp_jax.core.stack import Segmented, is_segmented
from osdp_jax.core.strategies import accumulation, axes_size, axis_entry, sharded_dim
from osdp_jax.core.xla import StepProfile, loop_flops, profile_compiled
from osdp_jax.runtime.collectives import device_index, gather
from osdp_jax.runtime.context import SplitEntry, StepContext, active
from osdp_jax.runtime.hooks import wrap_tree
from osdp_jax.runtime.interception import intercepting
from osdp_jax.runtime.place import abstract_args, as_auto, check_matches, check_mesh
from osdp_jax.runtime.stack import SegmentRun, StackView


def check_batch_leaves(batch) -> int:
    """The global batch size: every leaf of ``batch`` has it as its leading dimension. A scalar
    leaf, or leaves of different leading sizes, is a ``ValueError`` naming them."""
    leaves = [(path_name(path) or "<root>", tuple(getattr(leaf, "shape", np.shape(leaf))))
              for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]]
    if not leaves:
        raise ValueError("the batch has no array leaves")
    for name, shape in leaves:
        if not shape:
            raise ValueError(
                f"batch leaf {name!r} is a scalar: every batch leaf is split over the devices along its "
                f"leading (global batch) dimension; give loss_fn a per-step constant another way (a "
                f"closure), or repeat it once per example")
    sizes = {shape[0] for _, shape in leaves}
    if len(sizes) > 1:
        shown = ", ".join(f"{name!r} {shape[0]}" for name, shape in leaves[:6])
        raise ValueError(f"batch leaves must share one leading (global batch) dimension, got {shown}")
    return sizes.pop()


def check_batch(batch, n: int):
    """Every batch leaf needs a leading dimension the data-parallel size divides."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(leaf, "shape", ())
        if not shape or shape[0] % n:
            raise ValueError(
                f"batch leaf {path_name(path) or '<root>'!r} has shape {tuple(shape)}: its leading "
                f"(global batch) dimension must be divisible by the {n} data-parallel devices; "
                f"use a batch size that is a multiple of {n}")


def _reduce_out(x, axes, how: str):
    """One device's auxiliary output combined across the data-parallel devices: floating leaves
    averaged (``pmean``), integer and bool leaves summed (``psum``: counts); or, with ``"gather"``,
    concatenated along the leading axis (a 0-d leaf becomes one entry per device)."""
    x = jax.numpy.asarray(x)
    if how == "gather":
        return x[None] if x.ndim == 0 else x
    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return jax.lax.pmean(x, axes)
    return jax.lax.psum(x, axes)


def _reduce_state(x, axes):
    """One device's new mutable state combined across the data-parallel devices: floating leaves
    averaged (``pmean``: BatchNorm statistics); the others (integer counters, PRNG keys: nnx's
    rng state) start replicated and change alike on every device, so each device's is kept."""
    x = jax.numpy.asarray(x)
    return jax.lax.pmean(x, axes) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact) else x


def model_view(loss_fn, param_specs, gathering: "_Gathering", lookups: bool = True):
    """``f(params, *args) -> loss_fn(model params, *args)``, per device: the parameters as the model
    sees them inside the step.

    Layer-stacked parameters (``gathering.stacks``, path -> ``SegmentRun``s) reach the model as
    ``StackView``s, which ``osdp_jax.layers.scan`` runs segment by segment, gathering one layer at a
    time; ``gathering.split_specs`` (path -> ``SplitEntry``) are the kernels their dense layers
    gather, whole (k = 1) or one slice at a time (``osdp_jax.split``); every other sharded
    parameter is gathered here, before the loss, as ``gathering.how`` (path -> Collective) says.
    """
    how, stacks, split_specs = gathering.how, gathering.stacks, gathering.split_specs

    def gather_here(path, w, s):
        name = path_name(path)
        if name in stacks:
            parts = w.parts if isinstance(w, Segmented) else (w,)
            return StackView(name, gathering.shapes[name], parts[0].dtype, parts, stacks[name])
        if sharded_dim(s) is None or name in split_specs:
            return w
        return gather(w, sharded_dim(s), how[name])

    def run(p, *args, **kwargs):
        used = strip_boxes(jax.tree_util.tree_map_with_path(gather_here, p, param_specs, is_leaf=is_segmented))
        ctx = StepContext(split_specs, per_step=gathering.per_step, units=gathering.units,
                          unit_remat=gathering.unit_remat)
        for path, x in jax.tree_util.tree_flatten_with_path(used, is_leaf=lambda v: isinstance(v, StackView))[0]:
            ctx.kernels[id(x)] = (x, path_name(path))  # layers.scan names the arrays it is given
        with active(ctx), intercepting(lookups):
            return loss_fn(wrap_tree(ctx, used), *args, **kwargs)

    return run


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What the user's ``loss_fn`` takes and returns (see :func:`make_train_step`)."""

    has_aux: bool = False  # loss_fn returns (loss, aux)
    aux: str = "mean"  # how aux leaves are combined across devices: "mean" or "gather"
    rng: bool = False  # loss_fn takes rng=, a key folded with the device index
    state: bool = False  # loss_fn takes state= (mutable collections) and returns the new state too
    embed_lookup: bool = True  # Flax Embed through runtime.kernels.lookup (False: Flax's own, to measure)
    microbatches: int = 1  # each device's batch slice runs as this many microbatches, gradients summed

    def __post_init__(self):
        if self.aux not in ("mean", "gather"):
            raise ValueError(f"aux must be 'mean' (average floats, sum integers) or 'gather' "
                             f"(concatenate along the leading axis), got {self.aux!r}")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer (1: no accumulation), got {self.microbatches!r}")
        if self.microbatches > 1 and self.state:
            raise ValueError("microbatches > 1 with state=True (mutable collections) is not supported: the "
                             "statistics of one microbatch would replace another's; use microbatches=1")

    def call(self, f, params, batch, state, rng):
        """``(loss, aux, new_state)`` of one call of ``f`` (a ``model_view`` of loss_fn)."""
        kwargs = {}
        if self.rng:
            kwargs["rng"] = rng
        if self.state:
            kwargs["state"] = state
        out = f(params, batch, **kwargs)
        loss, aux, new_state = out, None, None
        if self.state:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("with state=True, loss_fn must return (loss, new_state), or "
                                "(loss, (aux, new_state)) with has_aux=True")
            loss, rest = out
            aux, new_state = rest if self.has_aux else (None, rest)
        elif self.has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("with has_aux=True, loss_fn must return (loss, aux)")
            loss, aux = out
        if not (hasattr(loss, "shape") and loss.shape == ()):
            raise TypeError(
                f"loss_fn must return a scalar loss, got {getattr(loss, 'shape', type(loss).__name__)}; "
                f"if it returns (loss, aux), pass has_aux=True; if it takes and returns mutable "
                f"collections, state=True to make_train_step (state=the collections to osdp_jax.plan)")
        return loss, aux, new_state


def _scatter(g, state: P, axes):
    """A whole local gradient reduce-scattered (summed) to the shard its state ``state`` keeps."""
    return jax.lax.psum_scatter(g, axes if len(axes) > 1 else axes[0], scatter_dimension=sharded_dim(state), tiled=True)


def _reduce_grad(g, spec: P, state: P, axes, n: int):
    """One parameter's local gradient, averaged over the devices: an all-reduce for a replicated
    one, a reduce-scatter to its state's shard for zero2; a zero3/hsdp one arrives already
    reduce-scattered (by :func:`gather`'s backward pass), summed."""
    if sharded_dim(spec) is not None:
        return g / n
    if sharded_dim(state) is None:
        return jax.lax.pmean(g, axes)
    return _scatter(g, state, axes) / n


def _shard_shape(shape, spec: P, n: int) -> tuple:
    """The local shape of a ``shape`` array split as ``spec`` over ``n`` devices (inside shard_map)."""
    d = sharded_dim(spec)
    return tuple(x // n if i == d else x for i, x in enumerate(shape))


def grad_body(loss_fn, param_specs, axes, n: int, gathering: "_Gathering", options: StepOptions = StepOptions(),
              state_specs=None):
    """The per-device body: gather, loss and gradient, gradient collectives.

    Returns ``(loss, aux, grads, new_state)``: the loss averaged over the devices, the aux combined
    as ``options.aux`` says, the gradients as :func:`_reduce_grad` leaves them (laid out as
    ``state_specs``, the storage specs except for zero2 parameters), and the
    new mutable state averaged over the devices. The optimizer is not applied here: it runs on
    the global arrays (see :func:`build_step`).
    """
    view = model_view(loss_fn, param_specs, gathering, options.embed_lookup)
    m = options.microbatches
    kept, whole = gathering.kept, gathering.zero2_whole
    state_specs = param_specs if state_specs is None else state_specs

    def scattered(p, s, t) -> bool:  # a zero2 gradient summed in its shard (a stack's: whole, below)
        return sharded_dim(s) is None and sharded_dim(t) is not None and p not in whole

    def by_path(f, *trees):
        return jax.tree_util.tree_map_with_path(lambda path, *x: f(path_name(path), *x), *trees,
                                                is_leaf=lambda x: isinstance(x, P))

    def value_and_grad(params, batch, state, rng, view=view):
        def loss_of(p):
            loss, aux, new_state = options.call(view, p, batch, state, rng)
            return loss, (aux, new_state)
        return jax.value_and_grad(loss_of, has_aux=True)(params)

    def accumulated(params, batch, rng):
        """m microbatches in a loop, each gradient summed where its layout says
        (``osdp_jax.core.strategies.accumulation``): a zero3/hsdp weight is gathered in every microbatch
        and its gradient reduce-scattered there into a shard-sized accumulator, unless it is kept
        (gathered once, before the loop; its gradient summed whole and reduce-scattered once, after
        it); a zero2 gradient is reduce-scattered in every microbatch too, unless summed whole; a
        replicated gradient (and a zero2 one summed whole) is summed whole and reduced once, after
        the loop."""
        rows = jax.tree.leaves(batch)[0].shape[0]
        if rows % m:
            raise ValueError(f"each device's batch slice has {rows} examples, not divisible into {m} "
                             f"microbatches: use a global batch size divisible by devices x microbatches")
        split = jax.tree.map(lambda x: x.reshape(m, rows // m, *x.shape[1:]), batch)
        specs = {path_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(
            param_specs, is_leaf=lambda x: isinstance(x, P))[0]}
        shards = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if path_name(p) in kept}
        gathered, pullback = jax.vjp(
            lambda xs: {p: gather(x, sharded_dim(specs[p]), gathering.how[p]) for p, x in xs.items()}, shards)
        inner = by_path(lambda p, x: gathered[p] if p in kept else x, params)
        inner_view = model_view(loss_fn, by_path(lambda p, s: P() if p in kept else s, param_specs),
                                gathering.inside_microbatches(), options.embed_lookup)
        def scatter(p, g, s, t):  # a zero2 gradient summed in its shard: reduce-scattered in this microbatch
            return _scatter(g, t, axes) if scattered(p, s, t) else g

        def one(total, xs):
            i, b = xs
            # tie the other shards to the microbatch, so that XLA cannot hoist their gathers out of
            # the loop (XLA:CPU does: the gathered weights then stay alive through it)
            here = by_path(lambda p, x, s: jax.numpy.where(i >= 0, x, jax.numpy.zeros_like(x))
                           if sharded_dim(s) is not None and p not in kept else x, inner, param_specs)
            (loss, (aux, _)), g = value_and_grad(here, b, None, None if rng is None else jax.random.fold_in(rng, i),
                                                 inner_view)
            g = by_path(scatter, g, param_specs, state_specs)
            return jax.tree.map(jax.numpy.add, total, (loss.astype(jax.numpy.float32), g)), aux

        zeros = (jax.numpy.zeros((), jax.numpy.float32),
                 by_path(lambda p, x, s, t: jax.numpy.zeros(_shard_shape(x.shape, t, n) if scattered(p, s, t)
                                                            else x.shape, x.dtype), inner, param_specs, state_specs))
        (loss, grads), auxs = jax.lax.scan(one, zeros, (jax.numpy.arange(m), split))
        aux = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]) if options.aux == "gather" else
                           (a.mean(0) if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) else a.sum(0)), auxs)
        if kept:  # the kept weights' whole gradients through their gather's backward: one reduce-scatter
            (back,) = pullback({path_name(p): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]
                                if path_name(p) in kept})
            grads = by_path(lambda p, g: back[p] if p in kept else g, grads)
        return (loss / m, (aux, None)), jax.tree.map(lambda g: g / m, grads)

    def body(params, batch, state, rng):
        if options.rng:
            rng = jax.random.fold_in(rng, device_index(axes))
        if m > 1:
            (loss, (aux, new_state)), grads = accumulated(params, batch, rng)
        else:
            (loss, (aux, new_state)), grads = value_and_grad(params, batch, state, rng)
        # a gradient reduce-scattered in the loop (summed sharded) arrives as a shard, as a zero3 one does
        done = by_path(lambda p, s, t: t if m > 1 and scattered(p, s, t) else s, param_specs, state_specs)
        grads = jax.tree.map(lambda g, s, t: _reduce_grad(g, s, t, axes, n), grads, done, state_specs)
        aux = jax.tree.map(lambda x: _reduce_out(x, axes, options.aux), aux)
        new_state = jax.tree.map(lambda x: _reduce_state(x, axes), new_state)
        return jax.lax.pmean(loss, axes), aux, grads, new_state

    return body


def _lay_out(x, sharding: NamedSharding):
    """Constrain ``x`` to ``sharding``: ``reshard`` on Explicit meshes, a constraint on Auto ones."""
    if jax.sharding.AxisType.Explicit in tuple(sharding.mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _lay_out_tree(tree, specs, mesh):
    """:func:`_lay_out` of each leaf of ``tree`` to its ``PartitionSpec`` in ``specs`` on ``mesh``."""
    return jax.tree.map(lambda x, s: _lay_out(x, NamedSharding(mesh, s)), tree, specs)


class _Gathering(NamedTuple):
    """Where each sharded parameter of a layout is gathered inside the step."""

    how: dict  # path -> Collective (None: replicated)
    stacks: dict  # path -> SegmentRuns: layer-stacked, run by osdp_jax.layers.scan
    shapes: dict  # path -> whole shape of each stacked parameter
    split_specs: dict  # path -> SplitEntry: gathered by its dense layer, whole (k = 1) or in k slices
    per_step: frozenset  # sharded parameters gathered whole before the loss
    units: dict  # path -> the unit (runtime.units) it is gathered at, on entry and in the backward pass
    unit_remat: str  # the remat policy units run under
    kept: frozenset = frozenset()  # sharded, gathered once per step and kept across microbatches
    zero2_whole: frozenset = frozenset()  # zero2 gradients summed whole across microbatches (the others
    #                                       are reduce-scattered in every microbatch)

    def inside_microbatches(self) -> "_Gathering":
        """The gathering of the microbatch loop's body: the kept weights arrive gathered."""
        kept = self.kept
        return self._replace(how={p: (None if p in kept else c) for p, c in self.how.items()},
                             split_specs={p: e for p, e in self.split_specs.items() if p not in kept},
                             per_step=self.per_step - kept, units={p: u for p,
                                                                   u in self.units.items() if p not in kept})


def _check_splits(layout: Layout) -> None:
    """Only sharded kernels can be split: a ``ValueError`` naming the first that is not."""
    how = layout.collectives()
    for pl in layout.params:
        for seg in pl.segments or ():
            if seg.split > 1 and collective(seg.spec, layout.axes) is None:
                raise ValueError(f"parameter {pl.path!r} is split in layers {seg.start}-{seg.stop - 1} but "
                                 f"not sharded there: only sharded (zero3 or hsdp) kernels can be split")
        if not pl.in_loop and pl.split > 1 and how[pl.path] is None:
            raise ValueError(f"parameter {pl.path!r} is split but not sharded: only sharded (zero3 or hsdp) "
                             f"kernels can be split")


def _gathering(layout: Layout, mesh, params) -> _Gathering:
    """Per-layer gathering for the ``in_loop`` (stacked) parameters, segment by segment; gathering
    at the unit (``ParamLayout.unit``, ``runtime.units``); the dense
    layer's gathering for split kernels and for per-step sharded kernels of dense layers
    (``ParamLayout.dense``: gathered at the layer, from its input, since XLA:CPU's scheduler would
    otherwise gather them at the start of the step and keep them alive through the layer loops);
    and before the loss for the rest."""
    how = layout.collectives()
    infos = describe(params)
    check_trainable(infos)
    shapes = {i.path: i.shape for i in infos}
    split_specs, stacks, units = {}, {}, {}
    for pl in layout.params:
        if pl.in_loop:
            runs = []
            segments = pl.segments or one_segment(shapes[pl.path][0], pl.spec, pl.strategy, pl.split,
                                                  pl.two_stage, "full")
            for seg in segments:
                c = collective(seg.spec, layout.axes, seg.two_stage, pl.gather_dtype)
                runs.append(SegmentRun(seg.start, seg.stop, sharded_dim(seg.spec), c, seg.split,
                                       axes_size(mesh, c.axes) if c else 1, seg.remat))
            stacks[pl.path] = tuple(runs)
            continue
        if how[pl.path] is not None and (pl.split > 1 or pl.dense or pl.unit):
            split_specs[pl.path] = SplitEntry(sharded_dim(pl.spec), how[pl.path], pl.split,
                                              axes_size(mesh, how[pl.path].axes))
            if pl.unit and pl.split == 1:
                units[pl.path] = pl.unit
    per_step = frozenset(p for p, c in how.items() if c is not None and p not in stacks and p not in split_specs
                         and not layout.stacks_per_step)
    kept = frozenset(pl.path for pl in layout.params if pl.kept)
    # a zero2 stack (or segment) sums its gradient whole: reduce-scattering every layer's in every
    # microbatch costs m times the collectives, and zero3 is there for the memory
    zero2_whole = frozenset(p for pl in layout.params for p in (
        [f"{pl.path}/{j}" for j in range(len(pl.segments))] + [pl.path] if pl.in_loop else
        [pl.path] if pl.strategy == "zero2" and accumulation("zero2", pl.accumulate) == "whole" else []))
    return _Gathering(how, stacks, {p: shapes[p] for p in stacks}, split_specs, per_step, units,
                      layout.unit_remat, kept, zero2_whole)


def build_step(loss_fn, optimizer, mesh, layout, options: StepOptions = StepOptions()):
    """An un-jitted step ``(params, opt_state, batch[, state][, rng]) -> (params, opt_state, loss[, aux][, state])``
    for ``layout`` (a :class:`~osdp_jax.Layout` or a ``Plan``).

    The gradients are computed per device under ``jax.shard_map`` (:func:`grad_body`); the
    optimizer then runs on the global arrays, outside the shard_map, so a transformation that
    reduces across parameters (``optax.clip_by_global_norm``, LAMB's trust ratio) sees whole
    gradients, not one device's shards, and every replica of a replicated parameter and of its
    optimizer state gets bit-identical values (XLA computes replicated elementwise updates the
    same way on every device; the one cross-device sum, the norm, is an all-reduce).
    """
    planned = layout
    check_mesh(planned, mesh)
    layout = as_layout(layout)
    axes = layout.axes
    _check_splits(layout)

    def step(params, opt_state, batch, *extra):
        check_matches(planned, params)  # at trace time: a Plan's shapes, a Layout's paths
        n = axes_size(mesh, axes)
        check_batch(batch, n)
        extra = list(extra)
        state = extra.pop(0) if options.state else None
        rng = extra.pop(0) if options.rng else None
        if extra:
            raise TypeError(f"the step takes (params, opt_state, batch{', state' if options.state else ''}"
                            f"{', rng' if options.rng else ''}); got {len(extra)} more argument(s)")
        p_specs = spec_tree(params, layout)
        g = _gathering(layout, mesh, params)
        t_specs = state_spec_tree(params, layout, n)  # gradients and optimizer state
        o_specs = opt_state_specs(optimizer, opt_state, t_specs, params)
        s_specs = jax.tree.map(lambda _: P(), state)
        r_spec = None if rng is None else P()
        in_specs = (p_specs, batch_specs(batch, axes), s_specs, r_spec)
        # Explicit meshes need inputs already laid out as in_specs (a no-op when they are).
        params, opt_state, batch, state = _lay_out_tree((params, opt_state, batch, state),
                                                        (p_specs, o_specs, in_specs[1], s_specs), mesh)
        body = grad_body(loss_fn, p_specs, axes, n, g, options, t_specs)
        aux_spec = P(axis_entry(axes)) if options.aux == "gather" else P()
        mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                               out_specs=(P(), aux_spec, t_specs, P()), check_vma=False)
        loss, aux, grads, new_state = mapped(params, batch, state, rng)
        named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree)  # noqa: E731
        updates, opt_state = as_auto(optimizer.update, mesh, (named(t_specs), named(o_specs)))(grads, opt_state, params)
        # a zero2 parameter's update is applied on its shard, then gathered whole below
        params = optax.apply_updates(_lay_out_tree(params, t_specs, mesh), updates)
        params, opt_state = _lay_out_tree((params, opt_state), (p_specs, o_specs), mesh)
        out = (params, opt_state, loss)
        if options.has_aux:
            out += (aux,)
        if options.state:
            out += (new_state,)
        return out
    return step


def jit_step(step):
    """``jax.jit(step)`` with params and optimizer state donated."""
    return jax.jit(step, donate_argnums=(0, 1))


# --- compiled steps kept for reuse ------------------------------------------------------------
# Under ``plan(verify="full")`` the planner's verification compile is the train step's compile
# (by default it is compiled for its figures only, kept apart below and never run):
# ``compile_counted`` keeps the last few compiled steps, keyed by the loss function and optimizer objects, the mesh,
# the layout,
# the step options and the inputs' shapes, dtypes and shardings (each kept as ``(compiled, FLOPs
# XLA leaves out)``, so a step found here is not traced again); ``make_train_step`` runs one of
# them instead of compiling the same step again, and ``compile_counted`` returns one it already
# has (a plan whose layout a probe or an earlier plan compiled).
_COMPILED: "collections.OrderedDict" = collections.OrderedDict()
_KEEP = 8  # compiled steps kept (each holds its executable)
# Steps compiled for their figures only (``FIGURES_ONLY``) are kept apart, never run: a budget
# sweep meets the same layout at several budgets, and compiles it once.
_FIGURES: "collections.OrderedDict" = collections.OrderedDict()
_KEEP_FIGURES = 32


def _keep(kept: "collections.OrderedDict", key, compiled, most: int) -> None:
    kept[key] = compiled
    kept.move_to_end(key)
    while len(kept) > most:
        kept.popitem(last=False)


def _sharding_key(sharding, ndim: int):
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return sharding.mesh, spec
    return None if sharding is None else repr(sharding)


def signature(args) -> tuple:
    """The inputs as a compiled step sees them: tree structure, and shape, dtype and sharding of
    every leaf (arrays or ``ShapeDtypeStruct``s)."""
    leaves, treedef = jax.tree.flatten(args)
    return str(treedef), tuple((tuple(x.shape), str(x.dtype), _sharding_key(getattr(x, "sharding", None), len(x.shape)))
                               for x in leaves)


def _reuse_key(loss_fn, optimizer, mesh, layout, options, args):
    key = (loss_fn, optimizer, mesh, as_layout(layout), options, signature(args))
    try:
        hash(key)
    except TypeError:  # an unhashable loss function or optimizer: nothing is kept
        return None
    return key


_COMPILES = 0  # steps XLA compiled in this process through compile_counted
_COMPILE_SECONDS = 0.0  # and the seconds those compiles took


def compile_count() -> int:
    """How many steps ``compile_step``/``profile_step`` (and the planner) have compiled in this
    process; a step found among the kept ones is not counted."""
    return _COMPILES


def compile_seconds() -> float:
    """Seconds the compiles :func:`compile_count` counts took, wall clock (those :func:`compile_many`
    ran at once count once)."""
    return _COMPILE_SECONDS


def clear_compiled() -> None:
    """Forget the compiled steps kept for reuse (and those compiled for their figures only)."""
    _COMPILED.clear()
    _FIGURES.clear()


class TrainStep:
    """A jitted train step that refuses donated (deleted) arrays with a clear error.

    Calling a jitted function with an array that an earlier call donated fails deep inside jax;
    this checks the arguments first, and, given the ``mesh``, that no batch leaf is committed to
    other devices (``jax.device_put(x, jax.devices()[0])``: jax refuses to mix device
    assignments, naming no fix). ``lower`` is the jitted function's. With ``reuse`` (the
    loss function, optimizer, mesh, layout and options it was made from), a call whose inputs
    match a step compiled earlier in this process (the planner's ``verify="full"`` compile) runs that
    executable instead of compiling again; ``reused`` says whether the last call did.
    """

    def __init__(self, jitted, what: str = "train step", batch_size: int | None = None, batch_arg: int = 2,
                 reuse: tuple | None = None, mesh=None):
        self._jitted, self._what, self._batch_size, self._batch_arg = jitted, what, batch_size, batch_arg
        self._reuse, self.reused = reuse, False
        self._devices = None if mesh is None else tuple(mesh.devices.flat)  # the mesh's device order, once
        self._device_set = None if mesh is None else set(self._devices)

    def _check_batch_devices(self, args):
        if self._devices is None or len(args) <= self._batch_arg:
            return
        order = self._devices
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[self._batch_arg])[0]:
            if not (isinstance(leaf, jax.Array) and leaf.committed):
                continue  # host arrays and uncommitted ones: the step places them
            sharding = leaf.sharding
            same = sharding.device_set == self._device_set and (
                not isinstance(sharding, NamedSharding) or tuple(sharding.mesh.devices.flat) == order)
            if not same:
                ids = ([d.id for d in sharding.mesh.devices.flat] if isinstance(sharding, NamedSharding)
                       else sorted(d.id for d in sharding.device_set))
                raise ValueError(
                    f"batch leaf {path_name(path) or '<root>'!r} is committed to devices {ids}, not to the "
                    f"{self._what}'s mesh (devices {[d.id for d in order]}, in that order): place the batch "
                    f"with jax.device_put(batch, osdp_jax.batch_sharding(mesh, plan)), or pass host (numpy) "
                    f"or uncommitted arrays, which the step places itself")

    def _compiled_for(self, args):
        if self._reuse is None:
            return None
        key = _reuse_key(*self._reuse, args)
        kept = _COMPILED.get(key) if key is not None else None
        return None if kept is None else kept[0]

    def _check_batch_size(self, args):
        if self._batch_size is None or len(args) <= self._batch_arg:
            return
        got = check_batch_leaves(args[self._batch_arg])
        if got != self._batch_size:
            raise ValueError(
                f"the plan was made for global batch size {self._batch_size}, got a batch of "
                f"{got}: its memory was not checked against the budget. Re-plan with that "
                f"batch size, or pass any_batch_size=True to make_train_step to run it anyway")

    def __call__(self, *args):
        self._check_batch_size(args)
        self._check_batch_devices(args)
        for i, tree in enumerate(args[:2]):
            if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree)):
                name = ("params", "opt_state")[i]
                raise ValueError(
                    f"{name} passed to the {self._what} were donated to an earlier call (their buffers are "
                    f"deleted): use the {name} that call returned, e.g. params, opt_state, loss = "
                    f"step(params, opt_state, batch)")
        compiled = self._compiled_for(args)
        self.reused = compiled is not None
        return compiled(*args) if compiled is not None else self._jitted(*args)

    def lower(self, *args):
        self._check_batch_size(args)
        return self._jitted.lower(*args)

    def __repr__(self):
        return f"<osdp_jax {self._what}>"


def make_train_step(loss_fn, optimizer, plan, mesh, *, has_aux: bool = False, aux: str = "mean",
                    rng: bool = False, state: bool = False, any_batch_size: bool = False,
                    microbatches: int | None = None):
    """A ``jax.jit``-wrapped step ``(params, opt_state, batch[, state][, rng])`` returning
    ``(params, opt_state, loss[, aux][, new_state])``.

    ``params`` and ``opt_state`` are donated: use the returned ones (passing donated ones again
    raises a ``ValueError``). Place them first with :func:`osdp_jax.shard` and
    :func:`osdp_jax.init_opt_state`. Each device runs ``loss_fn`` on its slice of the batch; the
    loss is the mean of the devices' losses, so ``loss_fn`` must return the *mean* loss over the
    batch it is given.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss``, a scalar; with ``has_aux``, ``(loss, aux)``;
        with ``rng``, it also takes ``rng=``; with ``state``, it also takes ``state=`` and returns
        ``(loss, new_state)`` (``(loss, (aux, new_state))`` with ``has_aux``).
      optimizer: an ``optax.GradientTransformation``; it runs on the global gradients, so
        cross-parameter transformations such as ``optax.clip_by_global_norm`` are exact.
      plan: the :class:`osdp_jax.Plan` (or :class:`osdp_jax.Layout`) the params were sharded with.
      mesh: the mesh the plan was made for.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns ``aux`` after the loss.
      aux: ``"mean"``: each floating aux leaf is averaged over the data-parallel devices (each
        device's value is of its batch slice), integer and bool leaves are summed (counts);
        ``"gather"``: leaves are concatenated along their leading axis in device order (per-example
        outputs; a 0-d leaf gives one value per device).
      rng: the step takes a PRNG key after the batch (pass a new one each step, e.g.
        ``jax.random.fold_in(key, step)``); each device's ``loss_fn`` gets it folded with the
        device's data-parallel index, so dropout differs across the batch slices and a run is
        reproducible.
      state: the step takes mutable collections (e.g. ``{"batch_stats": ...}``, replicated) after
        the batch and returns the new ones, averaged over the data-parallel devices (BatchNorm
        statistics of the whole batch, for statistics that are means).
      microbatches: run each device's batch slice as this many microbatches in a loop, summing
        the gradients (gradient accumulation): activation memory falls about m-fold. Each gradient
        is summed where the layout's ``accumulate`` says (``osdp_jax.strategies.accumulation``):
        a sharded parameter is gathered and reduce-scattered once per microbatch unless kept
        (gathered once, reduce-scattered once); a zero2 gradient is reduce-scattered in each unless
        summed whole; a replicated gradient is summed locally and reduced once. The loss and gradient equal those of the
        whole batch (mean of equal microbatches), up to float rounding. Default: the plan's
        ``microbatches`` (1 for a ``Layout``). Not with ``state=True``. With ``rng``, each
        microbatch gets the device's key folded with its index.
      any_batch_size: accept a global batch size other than ``plan.batch_size`` (it recompiles,
        and its memory was not checked against the budget). By default such a batch raises a
        ``ValueError`` naming the planned size.
    """
    options = StepOptions(has_aux, aux, rng, state,
                          microbatches=getattr(plan, "microbatches", 1) if microbatches is None else microbatches)
    step = build_step(loss_fn, optimizer, mesh, plan, options)
    return TrainStep(jit_step(step), "train step", None if any_batch_size else plan.batch_size,
                     reuse=(loss_fn, optimizer, mesh, plan, options), mesh=mesh)


def make_eval_step(fn, plan, mesh, *, aux: str = "mean", rng: bool = False, state: bool = False):
    """A ``jax.jit``-wrapped ``(params, batch[, state][, rng]) -> outputs`` under ``plan``.

    Each device runs ``fn(params, batch)`` (with ``rng=``/``state=`` when asked, as in
    :func:`make_train_step`) on its slice of the batch, with the parameters gathered as the
    train step gathers them; the outputs (any pytree) are combined as ``aux`` says: ``"mean"``
    averages floating leaves and sums integer ones over the devices, ``"gather"`` concatenates
    them along the leading axis. Nothing is donated and no gradient is taken. Any batch size the
    data-parallel device count divides is accepted.
    """
    options = StepOptions(False, aux, rng, False)
    layout = as_layout(plan)
    axes = layout.axes

    def evaluate(params, batch, *extra):
        check_batch(batch, axes_size(mesh, axes))
        extra = list(extra)
        st = extra.pop(0) if state else None
        key = extra.pop(0) if rng else None
        p_specs = spec_tree(params, layout)
        view = model_view(fn, p_specs, _gathering(layout, mesh, params))

        def body(p, b, s, r):
            kw = {}
            if state:
                kw["state"] = s
            if rng:
                kw["rng"] = jax.random.fold_in(r, device_index(axes))
            return jax.tree.map(lambda x: _reduce_out(x, axes, options.aux), view(p, b, **kw))

        out_spec = P(axis_entry(axes)) if aux == "gather" else P()
        in_specs = (p_specs, batch_specs(batch, axes), jax.tree.map(lambda _: P(), st),
                    None if key is None else P())
        # Explicit meshes need inputs already laid out as in_specs (a no-op when they are)
        params, batch, st = _lay_out_tree((params, batch, st), in_specs[:3], mesh)
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                             check_vma=False)(params, batch, st, key)

    return TrainStep(jax.jit(evaluate), "eval step", batch_arg=1, mesh=mesh)


# --- compiling without allocating --------------------------------------------------------------

def compile_step(loss_fn, optimizer, params, batch, mesh, plan, **options):
    """The train step for ``plan`` (a ``Plan`` or ``Layout``) lowered and compiled on abstract
    inputs: nothing is allocated. ``params`` and ``batch`` may be arrays or ``ShapeDtypeStruct``s;
    ``options`` are :func:`make_train_step`'s ``has_aux`` and ``aux``, and ``embed_lookup=False`` to
    compile with Flax's own Embed lookup instead of ``runtime.kernels.lookup``. Read XLA's
    per-device figures with :func:`osdp_jax.profile_compiled`."""
    return compile_counted(loss_fn, optimizer, params, batch, mesh, plan, **options)[0]


# A step compiled only for XLA's figures: buffer assignment (the memory figures) and the cost
# analysis run on the optimised HLO, before the backend's LLVM passes, which this option turns off
# (a compile then takes about half the time on XLA:CPU; tests/test_plan.py checks the figures are
# equal). Probes and the planner's figures-only checks (below) compile with it.
FIGURES_ONLY = {"xla_backend_optimization_level": 0}
# A probe goes further on XLA:CPU: its kernels are emitted by the older loop emitters
# (``xla_cpu_use_fusion_emitters`` off), which halves a probe's compile on the layer-stack models
# (the new emitters' MLIR pipeline is most of a figures-only compile there). XLA then fuses some
# elementwise ops differently, so the figures are not the default compile's to the byte: measured
# within 1 KiB of temp on every model tried (tests/test_plan.py bounds it); FLOPs differ by under
# 0.1%. Probes are fitted terms; the chosen plan is checked as a probe, then verified on its
# default compile (:func:`profile_checked`), or on the probe compile alone when it will not be run.
# Its LLVM module is also not split for parallel codegen (``xla_cpu_parallel_codegen_split_count``
# 1): the compile threads (``compile_many``) already keep the cores busy, and on 2 cores the
# splitting only added work (cold plans 6 to 13% faster without it on 2 cores, the same plans and
# XLA peaks). Codegen comes after buffer assignment: the figures are the same to the byte.
# An option the running XLA does not know is left out (``_compat.supported_compile_options``):
# jaxlib 0.11 and later have no older emitters, and their probes compile with the default ones.
PROBE_ONLY_CPU = {"xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}
PROBE_TOLERANCE = 1024  # bytes: a probe compile's peak may be this far under the default compile's


def _options(purpose: str, mesh) -> dict | None:
    """Compiler options for a step compiled to run (``"run"``), for its figures (``"figures"``) or
    as a probe (``"probe"``): only those the running XLA knows, None for a default compile."""
    if purpose == "run":
        return None
    platform = mesh.devices.flat[0].platform
    cpu = purpose == "probe" and platform == "cpu"
    return supported_compile_options({**FIGURES_ONLY, **(PROBE_ONLY_CPU if cpu else {})}, platform)


@dataclasses.dataclass
class _Pending:
    """A step traced for :func:`compile_counted`: compiled already (``compiled``), or to compile
    from ``lowered``; kept under ``key`` in ``kept`` once it is."""

    key: object
    kept: "collections.OrderedDict"
    lowered: object
    options: dict | None
    missing_flops: float
    compiled: object = None


def _prepare(loss_fn, optimizer, params, batch, mesh, plan, figures_only: bool | str, options) -> _Pending:
    purpose = "probe" if figures_only == "probe" else "figures" if figures_only else "run"
    args = abstract_args(optimizer, params, batch, mesh, plan)
    options.setdefault("microbatches", getattr(plan, "microbatches", 1))
    step_options = StepOptions(**options)
    key = _reuse_key(loss_fn, optimizer, mesh, plan, step_options, args)
    kept, found = _COMPILED, _COMPILED.get(key) if key is not None else None  # a runnable one serves all
    if found is None and purpose != "run":
        kept, (key, found) = _FIGURES, _kept_figures(key, purpose)
    if found is not None:  # kept with its FLOPs: not traced again (a second on a 48-layer model)
        return _Pending(key, kept, None, None, found[1], found[0])
    traced = jit_step(build_step(loss_fn, optimizer, mesh, plan, step_options)).trace(*args)
    return _Pending(key, kept, traced.lower(), _options(purpose, mesh), loop_flops(traced.jaxpr))


def _kept_figures(key, purpose: str) -> tuple:
    """The key a step compiled for its figures as ``purpose`` is kept under in ``_FIGURES``, and
    that step, as ``(compiled, FLOPs XLA leaves out)``, if it is kept (None, None for a step that
    cannot be keyed)."""
    key = None if key is None else (key, purpose)
    return key, _FIGURES.get(key) if key is not None else None


def _compile(pending: _Pending) -> tuple[object, float, float]:
    """The pending step compiled (no shared state is touched: safe in a worker thread), and when
    the compile started and ended (``time.perf_counter``)."""
    t0 = time.perf_counter()
    return pending.lowered.compile(compiler_options=pending.options), t0, time.perf_counter()


def _union(spans: list) -> float:
    """Seconds covered by the ``(start, end)`` spans (overlapping compiles counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def _finish(pending: _Pending, compiled=None, seconds: float = 0.0):
    global _COMPILES, _COMPILE_SECONDS
    if pending.compiled is None:
        _COMPILES += 1
        _COMPILE_SECONDS += seconds
        pending.compiled = compiled
    if pending.key is not None:
        _keep(pending.kept, pending.key, (pending.compiled, pending.missing_flops),
              _KEEP_FIGURES if pending.kept is _FIGURES else _KEEP)
    return pending.compiled, pending.missing_flops


def compile_counted(loss_fn, optimizer, params, batch, mesh, plan, *, figures_only: bool | str = False, **options):
    """``(compiled step, FLOPs XLA leaves out)``: :func:`compile_step`, and the matmul FLOPs of
    the loop iterations XLA's cost analysis does not count (``osdp_jax.xla.loop_flops``), from the
    same trace. ``figures_only``: compiled for its figures alone (:data:`FIGURES_ONLY`; ``"probe"``:
    and :data:`PROBE_ONLY_CPU`), not to be run, so not kept for :func:`make_train_step` to reuse;
    a kept runnable step is used if there is one."""
    return _compiled(_prepare(loss_fn, optimizer, params, batch, mesh, plan, figures_only, options))


def _compiled(pending: _Pending):
    """:func:`_finish` of the pending step, compiled here unless it was kept."""
    if pending.compiled is not None:
        return _finish(pending)
    compiled, start, end = _compile(pending)
    return _finish(pending, compiled, end - start)


def compile_many(steps, threads: int, early=lambda: False):
    """:func:`compile_counted` for each ``(loss_fn, optimizer, params, batch, mesh, plan,
    figures_only)`` of ``steps``, yielding ``(index, (compiled, FLOPs XLA leaves out))`` as each is
    done. Each step is traced and lowered in this thread, in order, while up to ``threads`` worker
    threads compile those already lowered (XLA compiles outside Python's lock: on 2 cores, 12
    probes of gpt2-mini took 30% less time pipelined so). While ``early()`` is true, a step
    compiled while later ones are traced is yielded then, so that the caller may stop early
    (close the generator): steps not yet compiling are dropped, and those compiling are finished,
    counted and kept. Otherwise the figures are read after the last trace, off the tracing
    thread's critical path (opt_mini's cold plan took about 10% longer with every step yielded
    early)."""
    steps = list(steps)
    if threads <= 1 or len(steps) < 2:
        for i, step in enumerate(steps):
            yield i, compile_counted(*step[:6], figures_only=step[6])
        return
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="osdp-jax-compile")
    futures, spans, done = {}, [], set()

    def finished(future):
        done.add(future)
        i, pending = futures[future]
        compiled, start, end = future.result()
        before = _union(spans)
        spans.append((start, end))
        return i, _finish(pending, compiled, _union(spans) - before)  # wall seconds, not thread seconds

    try:
        for i, step in enumerate(steps):
            pending = _prepare(*step, {})
            if pending.compiled is not None:
                yield i, _finish(pending)
                continue
            futures[pool.submit(_compile, pending)] = i, pending
            for future in [f for f in futures if f.done() and f not in done] if early() else ():
                yield finished(future)
        for future in concurrent.futures.as_completed([f for f in futures if f not in done]):
            yield finished(future)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for future in futures:
            if future not in done and not future.cancelled() and future.exception() is None:
                finished(future)


def profile_checked(loss_fn, optimizer, params, batch, mesh, plan, fits, **options) -> StepProfile:
    """XLA's figures for the step under ``plan``, as :func:`profile_step` gives them for a step
    compiled to run, at less cost when it does not fit: traced once, compiled first as a probe is
    (:data:`PROBE_ONLY_CPU`, a quarter to a half of a full compile on XLA:CPU), and only when
    ``fits(figures)`` compiled in full (kept for :func:`make_train_step`), whose figures are
    returned. A plan the verification rejects costs one probe compile, not a full one."""
    pending = _prepare(loss_fn, optimizer, params, batch, mesh, plan, False, options)
    if pending.compiled is not None:
        return profile_compiled(*_finish(pending))
    key, kept = _kept_figures(pending.key, "probe")
    quick = profile_compiled(*_compiled(_Pending(key, _FIGURES, pending.lowered, _options("probe", mesh),
                                                 pending.missing_flops, None if kept is None else kept[0])))
    return profile_compiled(*_compiled(pending)) if fits(quick) else quick


def profile_step(loss_fn, optimizer, params, batch, mesh, plan, *, figures_only: bool | str = False,
                 **options) -> StepProfile:
    """XLA's per-device figures (:class:`osdp_jax.StepProfile`) for the step under ``plan``, its
    FLOPs with every loop iteration counted; ``figures_only``: compiled for them alone
    (:func:`compile_counted`)."""
    return profile_compiled(*compile_counted(loss_fn, optimizer, params, batch, mesh, plan,
                                             figures_only=figures_only, **options))
