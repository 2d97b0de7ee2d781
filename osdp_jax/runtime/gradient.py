"""The gradient under a plan: explicit data parallelism under ``jax.shard_map``.

Every device runs ``loss_fn`` on its slice of the global batch. Per parameter, by its layout:

- replicated: the local gradient is averaged with one all-reduce (``pmean``);
- zero3/hsdp: the stored shard is all-gathered (``runtime.collectives.gather``) before ``loss_fn``
  runs, at its dense layer, or one layer at a time inside the model's loop, and the gradient of
  the gathered weight is reduce-scattered back to a shard;
- zero2: used whole, as replicated; its gradient is reduce-scattered (``psum_scatter``) to the
  shard its optimizer state is kept on.

With microbatches, each gradient is summed across them where its layout's ``accumulate`` says
(:func:`_accumulated`). Flax linen metadata boxes are stripped before ``loss_fn`` sees the
parameters. The loss is the mean of the per-device losses, so ``loss_fn`` must return the *mean*
loss over the batch it is given; the gradient is then exactly that of the global mean loss.

:func:`value_and_grad` is the public entry (a drop-in for ``jax.value_and_grad`` inside a step of
the user's own); ``runtime.step`` builds the library's train step on :func:`build_gradient`.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from osdp_jax.core.describe import check_trainable, describe, path_name, strip_boxes
from osdp_jax.core.layout import (
    Layout,
    as_layout,
    batch_specs,
    collective,
    manual_specs,
    one_segment,
    spec_tree,
    state_spec_tree,
)
from osdp_jax.core.simulated import warn_if_collectives_may_race
from osdp_jax.core.stack import Segmented, is_segmented
from osdp_jax.core.strategies import accumulation, axes_size, axis_entry, sharded_dim
from osdp_jax.core.tensor import model_spec
from osdp_jax.runtime.collectives import device_index, gather
from osdp_jax.runtime.context import SplitEntry, StepContext, active
from osdp_jax.runtime.hooks import wrap_tree
from osdp_jax.runtime.interception import intercepting
from osdp_jax.runtime.model_loops import placeholder
from osdp_jax.runtime.place import check_matches, check_mesh
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


def reduce_out(x, axes, how: str):
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
    how, stacks, split_specs, loops = gathering.how, gathering.stacks, gathering.split_specs, gathering.loops

    def gather_here(path, w, s):
        name = path_name(path)
        if name in stacks or name in loops:
            parts = w.parts if isinstance(w, Segmented) else (w,)
            view = StackView(name, gathering.shapes[name], parts[0].dtype, parts, {**stacks, **loops}[name])
            return placeholder(view) if name in loops else view
        if sharded_dim(s) is None or name in split_specs:
            return w
        return gather(w, sharded_dim(s), how[name], _model_spec(gathering, name, w))

    def run(p, *args, **kwargs):
        ctx = StepContext(split_specs, per_step=gathering.per_step, units=gathering.units,
                          unit_remat=gathering.unit_remat, tensor=gathering.tensor, model_axis=gathering.model_axis,
                          sequence=gathering.sequence)
        with active(ctx):
            used = strip_boxes(jax.tree_util.tree_map_with_path(gather_here, p, param_specs, is_leaf=is_segmented))
        for path, x in jax.tree_util.tree_flatten_with_path(used, is_leaf=lambda v: isinstance(v, StackView))[0]:
            ctx.kernels[id(x)] = (x, path_name(path))  # layers.scan names the arrays it is given
        with active(ctx), intercepting(lookups):
            out = loss_fn(wrap_tree(ctx, used), *args, **kwargs)
        _check_loops_ran(ctx, loops)
        return out

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


def _model_spec(gathering, name: str, w) -> P | None:
    """How parameter ``name`` (local array ``w``) lies over the model axis, or None."""
    return model_spec(np.shape(w), gathering.tensor.get(name, ""), gathering.model_axis)


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


def _by_path(f, *trees):
    """``f(path name, *leaves)`` over ``trees``, whose structure is the first's (``PartitionSpec``s are leaves)."""
    return jax.tree_util.tree_map_with_path(lambda path, *x: f(path_name(path), *x), *trees,
                                            is_leaf=lambda x: isinstance(x, P))


def _scattered(path: str, spec: P, state: P, whole: frozenset) -> bool:
    """A zero2 gradient summed in its shard across microbatches (``whole``: those summed whole)."""
    return sharded_dim(spec) is None and sharded_dim(state) is not None and path not in whole


def _loss_and_grad(view, options: StepOptions, params, batch, state, rng):
    """``((loss, (aux, new_state)), grads)`` of one call of ``view`` (a :func:`model_view`)."""
    def loss_of(p):
        loss, aux, new_state = options.call(view, p, batch, state, rng)
        return loss, (aux, new_state)
    return jax.value_and_grad(loss_of, has_aux=True)(params)


def _accumulated(loss_fn, param_specs, state_specs, axes, n: int, gathering: "_Gathering", options: StepOptions,
                 params, batch, rng):
    """``options.microbatches`` microbatches in a loop, each gradient summed where its layout says
    (``osdp_jax.core.strategies.accumulation``): a zero3/hsdp weight is gathered in every microbatch
    and its gradient reduce-scattered there into a shard-sized accumulator, unless it is kept
    (gathered once, before the loop; its gradient summed whole and reduce-scattered once, after
    it); a zero2 gradient is reduce-scattered in every microbatch too, unless summed whole; a
    replicated gradient (and a zero2 one summed whole) is summed whole and reduced once, after
    the loop. Returns what :func:`_loss_and_grad` does, averaged over the microbatches."""
    m, kept, whole = options.microbatches, gathering.kept, gathering.zero2_whole
    rows = jax.tree.leaves(batch)[0].shape[0]
    if rows % m:
        raise ValueError(f"each device's batch slice has {rows} examples, not divisible into {m} "
                         f"microbatches: use a global batch size divisible by devices x microbatches")
    split = jax.tree.map(lambda x: x.reshape(m, rows // m, *x.shape[1:]), batch)
    specs = {path_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        param_specs, is_leaf=lambda x: isinstance(x, P))[0]}
    shards = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if path_name(p) in kept}
    gathered, pullback = jax.vjp(
        lambda xs: {p: gather(x, sharded_dim(specs[p]), gathering.how[p], _model_spec(gathering, p, x))
                    for p, x in xs.items()}, shards)
    inner = _by_path(lambda p, x: gathered[p] if p in kept else x, params)
    inner_view = model_view(loss_fn, _by_path(lambda p, s: P() if p in kept else s, param_specs),
                            gathering.inside_microbatches(), options.embed_lookup)

    def scatter(p, g, s, t):  # a zero2 gradient summed in its shard: reduce-scattered in this microbatch
        return _scatter(g, t, axes) if _scattered(p, s, t, whole) else g

    def one(total, xs):
        i, b = xs
        # tie the other shards to the microbatch, so that XLA cannot hoist their gathers out of
        # the loop (XLA:CPU does: the gathered weights then stay alive through it)
        here = _by_path(lambda p, x, s: jax.numpy.where(i >= 0, x, jax.numpy.zeros_like(x))
                        if sharded_dim(s) is not None and p not in kept else x, inner, param_specs)
        key = None if rng is None else jax.random.fold_in(rng, i)
        (loss, (aux, _)), g = _loss_and_grad(inner_view, options, here, b, None, key)
        g = _by_path(scatter, g, param_specs, state_specs)
        return jax.tree.map(jax.numpy.add, total, (loss.astype(jax.numpy.float32), g)), aux

    zeros = (jax.numpy.zeros((), jax.numpy.float32),
             _by_path(lambda p, x, s, t: jax.numpy.zeros(_shard_shape(x.shape, t, n) if _scattered(p, s, t, whole)
                                                         else x.shape, x.dtype), inner, param_specs, state_specs))
    (loss, grads), auxs = jax.lax.scan(one, zeros, (jax.numpy.arange(m), split))
    aux = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]) if options.aux == "gather" else
                       (a.mean(0) if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) else a.sum(0)), auxs)
    if kept:  # the kept weights' whole gradients through their gather's backward: one reduce-scatter
        (back,) = pullback({path_name(p): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]
                            if path_name(p) in kept})
        grads = _by_path(lambda p, g: back[p] if p in kept else g, grads)
    return (loss / m, (aux, None)), jax.tree.map(lambda g: g / m, grads)


def grad_body(loss_fn, param_specs, axes, n: int, gathering: "_Gathering", options: StepOptions = StepOptions(),
              state_specs=None):
    """The per-device body: gather, loss and gradient, gradient collectives.

    Returns ``(loss, aux, grads, new_state)``: the loss averaged over the devices, the aux combined
    as ``options.aux`` says, the gradients as :func:`_reduce_grad` leaves them (laid out as
    ``state_specs``, the storage specs except for zero2 parameters), and the
    new mutable state averaged over the devices. The optimizer is not applied here.
    """
    view = model_view(loss_fn, param_specs, gathering, options.embed_lookup)
    m, whole = options.microbatches, gathering.zero2_whole
    state_specs = param_specs if state_specs is None else state_specs

    def body(params, batch, state, rng):
        if options.rng:
            rng = jax.random.fold_in(rng, device_index(axes))
        if m > 1:
            (loss, (aux, new_state)), grads = _accumulated(loss_fn, param_specs, state_specs, axes, n, gathering,
                                                           options, params, batch, rng)
        else:
            (loss, (aux, new_state)), grads = _loss_and_grad(view, options, params, batch, state, rng)
        # a gradient reduce-scattered in the loop (summed sharded) arrives as a shard, as a zero3 one does
        done = _by_path(lambda p, s, t: t if m > 1 and _scattered(p, s, t, whole) else s, param_specs, state_specs)
        grads = jax.tree.map(lambda g, s, t: _reduce_grad(g, s, t, axes, n), grads, done, state_specs)
        aux = jax.tree.map(lambda x: reduce_out(x, axes, options.aux), aux)
        new_state = jax.tree.map(lambda x: _reduce_state(x, axes), new_state)
        return jax.lax.pmean(loss, axes), aux, grads, new_state

    return body


def _lay_out(x, sharding: NamedSharding):
    """Constrain ``x`` to ``sharding``: ``reshard`` on Explicit meshes, a constraint on Auto ones."""
    if jax.sharding.AxisType.Explicit in tuple(sharding.mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def lay_out_tree(tree, specs, mesh):
    """:func:`_lay_out` of each leaf of ``tree`` to its ``PartitionSpec`` in ``specs`` on ``mesh``."""
    return jax.tree.map(lambda x, s: _lay_out(x, NamedSharding(mesh, s)), tree, specs)


def _check_loops_ran(ctx: StepContext, loops: dict) -> None:
    """Every sharded ``model_loop`` parameter was run per iteration by a scan: a ``ValueError``
    naming the first that was not (its placeholder was gathered whole, once per step)."""
    missed = sorted(p for p, runs in loops.items() if p not in ctx.loop_used and any(r.how for r in runs))
    if missed:
        raise ValueError(
            f"parameter {missed[0]!r} is laid out model_loop (gathered per iteration of the model's own "
            f"jax.lax.scan, nn.scan or nnx.scan), but the model did not pass it unchanged to a jax.lax.scan "
            f"as a per-iteration operand (cast or sliced first, or scanned by a function bound before "
            f"osdp_jax ran): plan it again with osdp_jax.plan, or leave it out of model_loop")


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
    loops: dict = {}  # path -> SegmentRuns: stacked, sliced per iteration by the model's own scans
    tensor: dict = {}  # path -> "column"/"row": split over the model axis (core.tensor)
    model_axis: str | None = None
    sequence: bool = False  # row layers' outputs split on their sequence (core.tensor.output_spec)

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


def gathering_of(layout: Layout, mesh, params) -> _Gathering:
    """Per-layer gathering for the ``in_loop`` (stacked) parameters, segment by segment (or, for
    ``model_loop`` ones, per iteration of the model's own scan: ``runtime.model_loops``); gathering
    at the unit (``ParamLayout.unit``, ``runtime.units``); the dense
    layer's gathering for split kernels and for per-step sharded kernels of dense layers
    (``ParamLayout.dense``: gathered at the layer, from its input, since XLA:CPU's scheduler would
    otherwise gather them at the start of the step and keep them alive through the layer loops);
    and before the loss for the rest."""
    how = layout.collectives()
    infos = describe(params)
    check_trainable(infos)
    shapes = {i.path: i.shape for i in infos}
    split_specs, stacks, units, loops = {}, {}, {}, {}
    for pl in layout.params:
        if pl.in_loop:
            runs = []
            segments = pl.segments or one_segment(shapes[pl.path][0], pl.spec, pl.strategy, pl.split,
                                                  pl.two_stage, "full")
            for seg in segments:
                c = collective(seg.spec, layout.axes, seg.two_stage, pl.gather_dtype, layout.model_axis)
                model = model_spec(shapes[pl.path][1:], pl.tensor, layout.model_axis)
                runs.append(SegmentRun(seg.start, seg.stop, sharded_dim(seg.spec), c, seg.split,
                                       axes_size(mesh, c.axes) if c else 1, seg.remat, pl.tensor, model))
            # sliced per iteration by the model's own scan (runtime.model_loops), or by layers.scan
            (loops if pl.model_loop else stacks)[pl.path] = tuple(runs)
            continue
        if how[pl.path] is not None and (pl.split > 1 or pl.dense or pl.unit):
            split_specs[pl.path] = SplitEntry(sharded_dim(pl.spec), how[pl.path], pl.split,
                                              axes_size(mesh, how[pl.path].axes))
            if pl.unit and pl.split == 1:
                units[pl.path] = pl.unit
    per_step = frozenset(p for p, c in how.items() if c is not None and p not in stacks and p not in split_specs
                         and p not in loops and not layout.stacks_per_step)
    kept = frozenset(pl.path for pl in layout.params if pl.kept)
    # a zero2 stack (or segment) sums its gradient whole: reduce-scattering every layer's in every
    # microbatch costs m times the collectives, and zero3 is there for the memory
    zero2_whole = frozenset(p for pl in layout.params for p in (
        [f"{pl.path}/{j}" for j in range(len(pl.segments))] + [pl.path] if pl.in_loop else
        [pl.path] if pl.strategy == "zero2" and accumulation("zero2", pl.accumulate) == "whole" else []))
    return _Gathering(how, stacks, {p: shapes[p] for p in (*stacks, *loops)}, split_specs, per_step, units,
                      layout.unit_remat, kept, zero2_whole, loops, layout.tensor, layout.model_axis,
                      layout.sequence)


def extra_args(extra: tuple, options: StepOptions, head: str) -> tuple:
    """``(state, rng)`` from the arguments after the batch, as ``options`` says they are passed;
    ``head``: how the call's arguments before them read, for the error."""
    extra = list(extra)
    state = extra.pop(0) if options.state else None
    rng = extra.pop(0) if options.rng else None
    if extra:
        raise TypeError(f"the call takes ({head}, batch{', state' if options.state else ''}"
                        f"{', rng' if options.rng else ''}); got {len(extra)} more argument(s)")
    return state, rng


def build_gradient(loss_fn, mesh, layout, options: StepOptions = StepOptions()):
    """``gradients(params, batch, state, rng) -> (loss, aux, grads, new_state)`` under ``layout``
    (a :class:`~osdp_jax.Layout` or a ``Plan``), on the global arrays.

    The parameters are gathered as the layout says, per device under ``jax.shard_map``
    (:func:`grad_body`). ``grads`` are laid out as the optimizer state is
    (``core.layout.state_spec_tree``): a replicated parameter's whole, a zero3/hsdp/zero2 one's
    as its shard. ``state`` and ``rng`` are None unless ``options`` takes them.
    """
    planned = layout
    check_mesh(planned, mesh)
    layout = as_layout(layout)
    axes = layout.axes
    _check_splits(layout)

    def gradients(params, batch, state=None, rng=None):
        check_matches(planned, params)  # at trace time: a Plan's shapes, a Layout's paths
        n = axes_size(mesh, axes)
        check_batch(batch, n)
        p_specs = spec_tree(params, layout)
        t_specs = state_spec_tree(params, layout, n)  # gradients and optimizer state
        # manual over the data axes only: a model axis is XLA's (core.tensor)
        manual_p, manual_t = manual_specs(p_specs, layout), manual_specs(t_specs, layout)
        in_specs = (manual_p, batch_specs(batch, axes), jax.tree.map(lambda _: P(), state),
                    None if rng is None else P())
        gathering = gathering_of(layout, mesh, params)
        # Explicit meshes need inputs already laid out as their specs (a no-op when they are)
        params, batch, state = lay_out_tree((params, batch, state), (p_specs, *in_specs[1:3]), mesh)
        body = grad_body(loss_fn, manual_p, axes, n, gathering, options, manual_t)
        aux_spec = P(axis_entry(axes)) if options.aux == "gather" else P()
        out_specs = (P(), aux_spec, manual_t, P())

        def model_specs(outputs):  # the gradients split over a model axis as stored, the rest whole
            return (P(), jax.tree.map(lambda _: aux_spec, outputs[1]), t_specs, jax.tree.map(lambda _: P(), outputs[3]))

        return manual_over_data(body, mesh, layout, in_specs, out_specs, model_specs)(params, batch, state, rng)

    return gradients


def manual_over_data(body, mesh, layout: Layout, in_specs, out_specs, model_specs=None):
    """``jax.shard_map(body)`` manual over the layout's data axes only, its model axis (if it has
    one, ``core.tensor``) left to XLA's partitioner: ``in_specs`` and ``out_specs`` name the data
    axes only; ``model_specs(outputs)`` (a tree of abstract outputs) gives the outputs' whole
    specs, the model axis included (default: replicated over it). On a mesh where the model axis
    is Explicit it runs as an Auto axis (``jax.sharding.auto_axes``): the model's own layers carry
    no output shardings, which an Explicit axis would need."""
    model = layout.model_axis
    if not model:
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    model_specs = model_specs or (lambda outputs: jax.tree.map(lambda _: P(), outputs))
    kind = dict(zip(mesh.axis_names, mesh.axis_types))[model]
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=tuple(
        jax.sharding.AxisType.Auto if name == model else t for name, t in zip(mesh.axis_names, mesh.axis_types)))
    mapped = jax.shard_map(body, mesh=auto, in_specs=in_specs, out_specs=out_specs, axis_names=set(layout.axes),
                           check_vma=False)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731

    def run(*args):  # the body traced once: its outputs constrained as model_specs says
        outputs = mapped(*args)
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), model_specs(outputs), is_leaf=is_spec)
        return jax.lax.with_sharding_constraint(outputs, shardings)

    def run_auto(*args):  # auto_axes needs the outputs' shardings before the call: their shapes first
        outputs = jax.eval_shape(jax.sharding.auto_axes(mapped, axes=model, out_sharding=P()), *args)
        return jax.sharding.auto_axes(mapped, axes=model, out_sharding=model_specs(outputs))(*args)

    return run_auto if kind == jax.sharding.AxisType.Explicit else run


def value_and_grad(loss_fn, plan, mesh, *, has_aux: bool = False, aux: str = "mean", rng: bool = False,
                   state: bool = False, microbatches: int | None = None):
    """``jax.value_and_grad(loss_fn)`` under ``plan``, for a training step of your own.

    Call the returned function inside your own ``jax.jit`` step, on parameters placed with
    :func:`osdp_jax.shard` (or ``jax.device_put`` onto :func:`osdp_jax.shardings`), then run your
    own optimizer and update code on the gradients. The weights are gathered as the plan says and
    as :func:`osdp_jax.make_train_step` gathers them (it is built on this function): per layer in a
    layer stack, per unit, one slice at a time for split kernels, with the plan's remat and
    microbatches, so the plan's memory budget holds in your step too, as long as the step donates
    the parameters and optimizer state (``donate_argnums``), as ``make_train_step`` does.

    Each device runs ``loss_fn`` on its slice of the batch; the loss returned is the mean of the
    devices' losses, so ``loss_fn`` must return the *mean* loss over the batch it is given.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (a scalar), as for :func:`osdp_jax.make_train_step`:
        with ``has_aux``, ``(loss, aux)``; with ``rng``, it also takes ``rng=``; with ``state``, it also
        takes ``state=`` and returns ``(loss, new_state)`` (``(loss, (aux, new_state))`` with ``has_aux``).
      plan: the :class:`osdp_jax.Plan` (or :class:`osdp_jax.Layout`) the parameters were placed with.
      mesh: the mesh the plan was made for.
      has_aux: ``loss_fn`` returns ``(loss, aux)``, as for :func:`osdp_jax.make_train_step`.
      aux: how aux leaves are combined over the devices: ``"mean"`` or ``"gather"``.
      rng: the returned function takes a PRNG key after the batch (and the state); ``loss_fn`` gets
        it as ``rng=``, folded with the device's data-parallel index.
      state: the returned function takes mutable collections after the batch; ``loss_fn`` takes
        ``state=`` and returns the new state as well.
      microbatches: gradient accumulation over this many microbatches per device; default: the
        plan's ``microbatches``.

    Returns:
      ``f(params, batch[, state][, rng]) -> (value, grads)``. ``value`` is the loss, or what
      ``loss_fn`` returns in its place (``(loss, aux)``, ``(loss, new_state)``,
      ``(loss, (aux, new_state))``), combined over the devices; ``grads`` has the parameters' tree
      structure, each gradient averaged over the devices and laid out as the parameter's optimizer
      state is: whole for a replicated parameter, as its shard for a zero3, hsdp or zero2 one.

    Raises:
      ValueError: the parameters do not match the plan, the mesh is not the plan's, or a batch
        leaf's leading dimension is not a multiple of the data-parallel devices.

    Example:
      >>> grad_fn = osdp_jax.value_and_grad(loss_fn, plan, mesh)                  # doctest: +SKIP
      >>> @functools.partial(jax.jit, donate_argnums=(0, 1))                     # doctest: +SKIP
      ... def step(params, opt_state, batch):
      ...     loss, grads = grad_fn(params, batch)
      ...     updates, opt_state = optimizer.update(grads, opt_state, params)
      ...     return optax.apply_updates(params, updates), opt_state, loss
    """
    options = StepOptions(has_aux, aux, rng, state,
                          microbatches=getattr(plan, "microbatches", 1) if microbatches is None else microbatches)
    gradients = build_gradient(loss_fn, mesh, plan, options)
    warn_if_collectives_may_race(mesh)

    def planned_value_and_grad(params, batch, *extra):
        st, key = extra_args(extra, options, "params")
        loss, aux_out, grads, new_state = gradients(params, batch, st, key)
        if has_aux and state:
            return (loss, (aux_out, new_state)), grads
        if has_aux or state:
            return (loss, aux_out if has_aux else new_state), grads
        return loss, grads

    return planned_value_and_grad
