"""The layout: how each parameter is stored on the data-parallel devices and gathered for use.

A :class:`Layout` is a value, per parameter path: its storage ``PartitionSpec``, its strategy,
where it is gathered (before the loss, at its dense layer, or per layer inside the model's loop),
its operator-split count and its collective. The planner produces one inside every
:class:`~osdp_jax.Plan` (``plan.layout``); :meth:`Layout.ddp`, :meth:`Layout.fsdp` and
:meth:`Layout.from_specs` write one by hand. ``shard``, ``init_opt_state``, ``make_train_step``
and ``compile_step`` take either.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from osdp_jax.core.describe import describe, map_state_params, path_name
from osdp_jax.core.stack import Segment, Segmented, check_remat, check_segments, cut, is_segmented
from osdp_jax.core.strategies import (
    GATHERED,
    accumulation,
    axes_size,
    axis_entry,
    data_axes,
    sharded_dim,
    spec_for,
    state_spec_for,
)
from osdp_jax.core.tensor import check_tensor, manual_spec, storage_spec


@dataclasses.dataclass(frozen=True)
class Collective:
    """How a sharded parameter is gathered inside the step.

    All-gathered over mesh ``axes`` in one ring, or with ``two_stage`` one axis at a time, the
    last (inner, intra-node) first; its gradient is reduce-scattered back the reverse way and
    then summed over ``reduce_axes`` (``hsdp``: the axes it is replicated over).
    """

    axes: tuple[str, ...]
    reduce_axes: tuple[str, ...] = ()
    two_stage: bool = False
    dtype: str | None = None  # gathered in this dtype (the shard cast first, e.g. "bfloat16"), and its
    #                           gradient reduce-scattered in it; None: the parameter's own dtype
    model_axis: str | None = None  # a model axis the step leaves to XLA: gathered in a shard_map manual over it
    #                                too (runtime.collectives.gather)


def collective(spec: P, axes, two_stage: bool = False, dtype: str | None = None,
               model_axis: str | None = None) -> Collective | None:
    """How a parameter stored as ``spec`` is gathered: over the axes its sharded dimension names;
    its gradient is also summed over the other data-parallel ``axes``. None if replicated."""
    dim = sharded_dim(spec)
    if dim is None:
        return None
    entry = spec[dim]
    on = tuple(entry) if isinstance(entry, tuple) else (entry,)
    return Collective(on, tuple(a for a in axes if a not in on), two_stage, dtype or None, model_axis or None)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One parameter's layout in a :class:`Layout`: how it is stored, gathered and synchronised.

    Attributes:
      path: the parameter's path.
      spec: its storage ``PartitionSpec``.
      strategy: ``"replicate"``, ``"zero3"``, ``"hsdp"`` or ``"zero2"`` (stored whole, optimizer
        state sharded).
      in_loop: gathered one layer at a time inside ``osdp_jax.layers.scan``, or, with
        ``model_loop``, inside the model's own ``jax.lax.scan`` (Flax ``nn.scan``, ``nnx.scan``).
      split: operator splitting: slices its dense layer gathers one at a time.
      two_stage: gathered one mesh axis at a time, inside a node first (2-D meshes).

    The other fields say where it is gathered (its dense layer, its unit), its layer segments, the
    dtype it is gathered in and where its gradient is summed across microbatches.
    """

    path: str
    spec: P  # storage PartitionSpec
    strategy: str = "replicate"  # "replicate", "zero3", "hsdp" or "zero2" (stored whole, state sharded)
    in_loop: bool = False  # gathered one layer at a time inside ``osdp_jax.layers.scan``
    split: int = 1  # operator splitting: slices its dense layer gathers one at a time
    two_stage: bool = False  # gathered one mesh axis at a time, intra-node first (2-D meshes)
    dense: bool = False  # a kernel of a dense layer outside any layer loop: a sharded one is gathered
    #                      at its layer, from the layer's input (not before the loss)
    segments: tuple[Segment, ...] = ()  # an in_loop (layer-stacked) parameter's segments, in order
    unit: str = ""  # the unit (osdp_jax.units) a sharded parameter is gathered at, on each call and again
    #                 in the backward pass; "" gathers it once per step
    gather_dtype: str = ""  # a sharded parameter gathered in this dtype (its shard, master and optimizer
    #                         state stay in its own); "": its own dtype
    accumulate: str = ""  # with microbatches, where its gradient is summed: "shard" or "whole" (a zero3/hsdp
    #                       weight then gathered once per step, kept); "": its strategy's default
    #                       (osdp_jax.core.strategies.accumulation)
    model_loop: bool = False  # an in_loop parameter sliced per iteration by the model's own jax.lax.scan
    #                           (Flax nn.scan, nnx.scan), which gathers one layer's slice per iteration
    tensor: str = ""  # tensor parallelism over Layout.model_axis (osdp_jax.core.tensor): "column",
    #                   "row", or "" (not split over it)

    @property
    def kept(self) -> bool:
        """A sharded weight gathered once per step and kept across microbatches (accumulated whole)."""
        return self.strategy in GATHERED and accumulation(self.strategy, self.accumulate) == "whole"

    @property
    def segmented(self) -> bool:
        """Stored as one array per segment (two or more segments)."""
        return len(self.segments) > 1


def whole_spec(segments) -> P:
    """The spec a segmented parameter is kept under whole (checkpoints, export): its most sharded
    segment's."""
    order = {"zero3": 0, "hsdp": 1}
    return min(segments, key=lambda s: order.get(s.strategy, 2)).spec


def one_segment(layers: int, spec: P, strategy: str, split: int, two_stage: bool, remat: str) -> tuple:
    return (Segment(0, layers, strategy, split, check_remat(remat), spec, two_stage),)


def _strategy_of(spec: P, axes) -> str:
    dim = sharded_dim(spec)
    if dim is None:
        return "replicate"
    entry = spec[dim]
    on = set(entry) if isinstance(entry, tuple) else {entry}
    return "zero3" if on >= set(axes) else "hsdp"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How every parameter is laid out over the data-parallel mesh ``axes``: a value that
    :func:`osdp_jax.shard`, :func:`osdp_jax.make_train_step` and the other steps take in place of
    a :class:`Plan` (``plan.layout`` is the planner's).

    Write one by hand with :meth:`ddp` (everything replicated), :meth:`fsdp` (everything ZeRO-3)
    or :meth:`from_specs` (a ``PartitionSpec`` per path, with segments, splits and remat).

    Example:
      >>> layout = osdp_jax.Layout.fsdp(params, mesh)                          # doctest: +SKIP
      >>> step = osdp_jax.make_train_step(loss_fn, optax.adam(1e-3), layout, mesh)  # doctest: +SKIP
    """

    params: tuple[ParamLayout, ...]
    axes: tuple[str, ...]
    stacks_per_step: bool = False  # allow a layers.scan stack that is not in_loop to be gathered whole
    #                                once per step (to measure what per-layer gathering saves); else
    #                                such a stack is an error
    unit_remat: str = "full"  # what a unit saves for its backward pass (osdp_jax.units): a remat policy
    model_axis: str | None = None  # the mesh axis the "column"/"row" kernels are split over (tensor
    #                                parallelism, osdp_jax.core.tensor); None: no such axis
    sequence: bool = False  # sequence parallelism: row layers' outputs split on their sequence over the model axis

    @property
    def layout(self) -> "Layout":  # a Layout is its own layout, as a Plan has one
        return self

    @property
    def batch_size(self) -> None:  # no planned batch size: the step accepts any
        return None

    @property
    def specs_by_path(self) -> dict[str, P]:
        return {pl.path: pl.spec for pl in self.params}

    @property
    def in_loop(self) -> frozenset[str]:
        return frozenset(pl.path for pl in self.params if pl.in_loop)

    @property
    def splits_by_path(self) -> dict[str, int]:
        return {pl.path: pl.split for pl in self.params if pl.split > 1}

    @property
    def two_stage(self) -> frozenset[str]:
        return frozenset(pl.path for pl in self.params if pl.two_stage)

    @property
    def dense(self) -> frozenset[str]:
        return frozenset(pl.path for pl in self.params if pl.dense)

    @property
    def units(self) -> dict[str, str]:
        """Path -> unit of every parameter gathered at a unit (``osdp_jax.units``)."""
        return {pl.path: pl.unit for pl in self.params if pl.unit}

    @property
    def tensor(self) -> dict[str, str]:
        """Path -> ``"column"``/``"row"`` of every parameter split over :attr:`model_axis`."""
        return {pl.path: pl.tensor for pl in self.params if pl.tensor}

    @property
    def segments(self) -> dict[str, tuple[Segment, ...]]:
        """Path -> segments of every layer-stacked (``in_loop``) parameter."""
        return {pl.path: pl.segments for pl in self.params if pl.segments}

    def storage_specs(self, params):
        """A tree shaped like the *stored* ``params`` whose leaves are their specs: a
        :class:`Segmented` of specs where a parameter is stored in segments."""
        return spec_tree(params, self)

    def collectives(self) -> dict[str, Collective | None]:
        """Path -> how it is gathered (None: replicated)."""
        return {pl.path: collective(pl.spec, self.axes, pl.two_stage, pl.gather_dtype, self.model_axis)
                for pl in self.params}

    # --- constructors ------------------------------------------------------------------------
    @classmethod
    def from_specs(cls, params, mesh, specs, *, axis=None, in_loop=(), splits=None, two_stage=(),
                   dense=(), segments=None, remat: str = "full", stacks_per_step: bool = False,
                   units=None, unit_remat: str = "full", zero2=(), gather_dtype: str | None = None,
                   accumulate=None, model_loop=(), tensor=None, model_axis: str | None = None,
                   sequence: bool = False) -> "Layout":
        """A hand-written layout: ``specs`` maps paths (``"block0/w1"``) to storage
        ``PartitionSpec``s, or is a pytree of them shaped like the unboxed params; missing paths
        are replicated. ``in_loop``: layer-stacked paths the model runs with
        ``osdp_jax.layers.scan`` (``osdp_jax.discover`` finds them); ``splits``: path -> k;
        ``dense``: kernels of dense layers, gathered at their layer. An ``in_loop`` parameter runs as
        one segment with the ``remat`` policy, unless ``segments`` (path -> list of
        :class:`~osdp_jax.Segment`) cuts it into several. A sharded stack left out of ``in_loop`` is
        an error when the step runs, unless ``stacks_per_step``: then it is gathered whole before
        the loss (to measure what per-layer gathering saves). ``units``:
        path -> the unit (``osdp_jax.units``, e.g. a linen module path such as ``"blocks_3"``) a
        sharded parameter is gathered at, instead of once per step; ``unit_remat`` the remat policy
        its units run under. ``zero2``: paths stored whole (their spec must be replicated) whose
        gradient and optimizer state are sharded (``osdp_jax.strategies``: ZeRO-2). ``gather_dtype``
        (e.g. ``"bfloat16"``): every sharded parameter is gathered in that dtype, its gradient
        reduce-scattered in it; the stored shard, its update and its optimizer state keep the
        parameter's dtype. ``accumulate``: path -> ``"shard"`` or ``"whole"``, where the gradient
        is summed across microbatches (``make_train_step(microbatches=)``; ``osdp_jax.strategies``):
        a sharded parameter's default is ``"shard"`` (reduce-scattered in each); ``"whole"`` sums
        it whole and reduces it once, keeping a zero3/hsdp weight gathered across them.
        ``model_loop``: layer-stacked paths the model slices per iteration with a
        ``jax.lax.scan`` of its own (Flax ``nn.scan``, ``nnx.scan``; ``osdp_jax.model_loops``
        finds them); they are ``in_loop`` too (segments and remat as for those), unsplit, each
        layer's slice gathered inside the model's loop (``runtime.model_loops``).
        ``tensor``: path -> ``"column"``, ``"heads"`` or ``"row"``, tensor parallelism over the
        mesh axis ``model_axis`` (default ``"model"``; it must not be a data-parallel axis, so pass
        ``axis=``): a column kernel split on its output features, a heads kernel ``(D, H, hd)``
        on its heads, a row kernel on its input features (``osdp_jax.core.tensor``); a stack's
        parameter is split per layer, one of the model's own scan (``model_loop``) cannot take
        one. ``sequence``: with ``tensor``, Megatron's sequence parallelism: each row layer's
        ``(batch, sequence, ...)`` output split on its sequence over the model axis
        (``core.tensor.output_spec``)."""
        axes = data_axes(mesh, axis)
        tensor = dict(tensor or {})
        model_axis = _model_axis(mesh, axes, model_axis, bool(tensor))
        infos = describe(params)
        if not isinstance(specs, dict) or not all(isinstance(v, P) for v in specs.values()):
            flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
            specs = {path_name(p): s for p, s in flat}
        unknown = sorted(set(specs) - {i.path for i in infos})
        if unknown:
            raise KeyError(f"layout names parameters the params do not have: {unknown[:3]}")
        model_loop = set(model_loop)
        splits, segments = dict(splits or {}), dict(segments or {})
        in_loop = set(in_loop) | set(segments) | model_loop
        units, accumulate, zero2 = dict(units or {}), dict(accumulate or {}), set(zero2)
        for what, named in (("segments name", segments), ("units name", units), ("accumulate names", accumulate),
                            ("zero2 names", zero2), ("model_loop names", model_loop), ("tensor names", tensor)):
            unknown = sorted(set(named) - {i.path for i in infos})
            if unknown:
                raise KeyError(f"{what} parameters the params do not have: {unknown[:3]}")
        gather_dtype = check_dtype(gather_dtype, "gather_dtype")
        stacked_units = sorted(set(units) & in_loop)
        if stacked_units:
            raise ValueError(f"parameter {stacked_units[0]!r} is layer-stacked (gathered per layer by "
                             f"osdp_jax.layers.scan): it cannot also be gathered at a unit")
        named = _Named(specs, splits, segments, in_loop, units, accumulate, zero2, model_loop, set(two_stage),
                       set(dense))
        params_ = [_tensor_layout(_param_layout(i, named, mesh, axes, remat, gather_dtype), i, tensor, mesh,
                                  model_axis) for i in infos]
        if sequence and not tensor:
            raise ValueError("sequence=True is sequence parallelism over the model axis of tensor parallelism: "
                             "pass tensor= the column/row roles too (osdp_jax.tensor_roles)")
        return cls(tuple(params_), axes, stacks_per_step, check_remat(unit_remat), model_axis, bool(sequence))

    @classmethod
    def ddp(cls, params, mesh, *, axis=None, in_loop=(), remat: str = "full") -> "Layout":
        """Every parameter replicated (plain data parallelism); ``in_loop`` stacks run with the
        ``remat`` policy."""
        return cls.from_specs(params, mesh, {}, axis=axis, in_loop=in_loop, remat=remat)

    @classmethod
    def fsdp(cls, params, mesh, *, axis=None, in_loop=(), dense=(), remat: str = "full", units=None,
             unit_remat: str = "full", gather_dtype: str | None = None, model_loop=()) -> "Layout":
        """Every parameter ZeRO-3 sharded over all data-parallel devices, along its first
        dimension they divide (after the layer axis for ``in_loop`` ones); the others replicated.
        ``units`` (path -> unit) and ``unit_remat`` as in :meth:`from_specs`
        (``osdp_jax.units.find`` finds the units); ``model_loop`` as in :meth:`from_specs`."""
        axes = data_axes(mesh, axis)
        n = axes_size(mesh, axes)
        in_loop = set(in_loop) | set(model_loop)
        specs = {}
        for i in describe(params):
            spec = spec_for(i, "zero3", axes, n, i.path in in_loop, n)
            specs[i.path] = spec if spec is not None else P()
        return cls.from_specs(params, mesh, specs, axis=axis, in_loop=in_loop, dense=dense, remat=remat,
                              units=units, unit_remat=unit_remat, gather_dtype=gather_dtype, model_loop=model_loop)


def _model_axis(mesh, axes, model_axis: str | None, wanted: bool) -> str | None:
    """The checked model axis of a layout with ``tensor`` roles (``wanted``), else None."""
    if not wanted:
        return None
    model_axis = model_axis or "model"
    if model_axis not in mesh.axis_names:
        raise ValueError(f"tensor parallelism needs a model axis, but the mesh has no axis {model_axis!r} (its "
                         f"axes are {list(mesh.axis_names)}); pass model_axis= one of them, e.g. "
                         f"jax.make_mesh((2, 4), ('data', 'model')) with axis='data'")
    if model_axis in axes:
        raise ValueError(f"mesh axis {model_axis!r} is both data-parallel and the model axis: pass axis= the "
                         f"data-parallel axes only, e.g. axis='data'")
    return model_axis


def _tensor_layout(pl: ParamLayout, info, tensor: dict, mesh, model_axis: str | None) -> ParamLayout:
    """``pl`` with its tensor role from ``tensor``, checked."""
    role = tensor.get(pl.path, "")
    if not role:
        return pl
    strategies = {seg.strategy for seg in pl.segments} | {pl.strategy}
    bad = sorted(strategies & {"zero2", "hsdp"})
    why = ("sliced by the model's own scan (model_loop)" if pl.model_loop else bad[0] if bad
           else f"split in {split}" if (split := max([pl.split, *(seg.split for seg in pl.segments)])) > 1
           else f"in unit {pl.unit!r}" if pl.unit else "")
    if why:
        raise ValueError(f"parameter {pl.path!r} is {why}: tensor parallelism applies to replicated or zero3 "
                         f"parameters of dense layers (layer stacks of osdp_jax.layers.scan included) outside "
                         f"units, unsplit")
    for seg in pl.segments or (None,):
        check_tensor(pl.path, info.shape, role, seg.spec if seg else pl.spec, model_axis, mesh.shape[model_axis],
                     pl.in_loop)
    return dataclasses.replace(pl, tensor=role)


class _Named(NamedTuple):
    """What :meth:`Layout.from_specs` was given, by parameter path."""

    specs: dict
    splits: dict
    segments: dict
    in_loop: set
    units: dict
    accumulate: dict
    zero2: set
    model_loop: set
    two_stage: set
    dense: set


def _param_layout(i, named: _Named, mesh, axes, remat: str, gather_dtype: str) -> ParamLayout:
    """One parameter's :class:`ParamLayout` as ``named`` gives it, checked (one ``ValueError``
    naming the parameter and the problem)."""
    segs = tuple(named.segments.get(i.path, ()))
    spec = whole_spec(segs) if segs else named.specs.get(i.path, P())
    for one in (*(s.spec for s in segs), spec):
        dim = sharded_dim(one)
        if dim is not None and i.shape[dim] % axes_size(mesh, collective(one, axes).axes):
            raise ValueError(f"parameter {i.path!r} {i.shape} cannot be stored as {one}: its dimension "
                             f"{dim} is not divisible by the devices it is sharded over")
    strategy, k, staged = _strategy_of(spec, axes), named.splits.get(i.path, 1), i.path in named.two_stage
    in_loop, n = i.path in named.in_loop, axes_size(mesh, axes)
    if i.path in named.zero2:
        if strategy != "replicate" or segs:
            raise ValueError(f"parameter {i.path!r} is zero2, so it is stored whole: give it no spec "
                             f"(it is {spec}) and no segments (a segment takes strategy 'zero2' itself)")
        state_spec_for(i.shape, "zero2", P(), axes, n, in_loop)
        strategy = "zero2"
    for seg in segs:
        if seg.strategy == "zero2":
            state_spec_for((seg.layers, *i.shape[1:]), "zero2", seg.spec, axes, n, True)
    if i.path in named.model_loop and k > 1:
        raise ValueError(f"parameter {i.path!r} is model_loop (sliced by the model's own scan): it is "
                         f"gathered whole per layer, not split; give it no split")
    if in_loop:
        if len(i.shape) < 2:
            raise ValueError(f"parameter {i.path!r} {i.shape} cannot be gathered per layer: a stacked "
                             f"parameter has a layer axis and at least one more")
        segs = segs or one_segment(i.shape[0], spec, strategy, k, staged, remat)
        check_segments(i.path, segs, i.shape[0])
    sharded = any(sharded_dim(x.spec) is not None for x in segs) or sharded_dim(spec) is not None
    acc = named.accumulate.get(i.path, "")
    if acc:
        _check_accumulate(i.path, strategy, acc, in_loop, i.path in named.units, k)
    return ParamLayout(i.path, spec, strategy, in_loop, k, staged, i.path in named.dense, segs,
                       named.units.get(i.path, ""), gather_dtype if sharded else "", acc, i.path in named.model_loop)


def _check_accumulate(path: str, strategy: str, accumulate: str, in_loop: bool, unit: bool, split: int) -> None:
    """A ``ValueError`` naming ``path`` when its ``accumulate`` does not apply to its layout."""
    try:
        whole = accumulation(strategy, accumulate) == "whole"
    except ValueError as e:
        raise ValueError(f"parameter {path!r}: {e}") from None
    if in_loop:
        raise ValueError(f"parameter {path!r} is layer-stacked: its gradient accumulates as its segments' "
                         f"strategies do (zero3/hsdp in its shard, replicate and zero2 whole); leave its "
                         f"accumulate unset")
    if whole and strategy in GATHERED and (unit or split > 1):
        where = "in a unit (gathered at it)" if unit else f"split in {split}"
        raise ValueError(f"parameter {path!r} is {where}, so it cannot be kept gathered across microbatches "
                         f"(accumulate='whole'): leave its accumulate 'shard'")


def check_dtype(dtype, what: str = "compute_dtype") -> str:
    """A floating dtype's name (``"bfloat16"``), or "" for None/""; a ``ValueError`` otherwise."""
    if dtype is None or dtype == "":
        return ""
    try:
        d = jax.numpy.dtype(dtype)
    except TypeError:
        d = None
    if d is None or not jax.numpy.issubdtype(d, jax.numpy.floating):
        raise ValueError(f"{what} must be a floating dtype such as 'bfloat16', 'float16' or 'float32', "
                         f"got {dtype!r}")
    return d.name


def as_layout(plan_or_layout) -> Layout:
    """The :class:`Layout` of a ``Plan`` (``plan.layout``) or a ``Layout`` itself."""
    layout = getattr(plan_or_layout, "layout", None)
    if not isinstance(layout, Layout):
        raise TypeError(f"expected an osdp_jax.Plan or osdp_jax.Layout, got {type(plan_or_layout).__name__}")
    return layout


def spec_tree(params, layout):
    """A tree shaped like the stored ``params`` (boxes and all) whose leaves are the planned specs:
    a :class:`Segmented` of the segments' specs where ``layout`` (a :class:`Layout`, or a dict of
    path -> spec for unsegmented layouts) stores a parameter in segments. A parameter split over
    the layout's model axis has it in its spec (``core.tensor.storage_spec``); :func:`manual_specs`
    leaves it out."""
    by_path = {pl.path: pl for pl in layout.params} if isinstance(layout, Layout) else None

    def spec(path, x):
        name = path_name(path)
        if by_path is None:
            if name not in layout:
                raise KeyError(f"parameter {name!r} is not in the plan; re-plan for these params")
            return layout[name]
        pl = by_path.get(name)
        if pl is None:
            raise KeyError(f"parameter {name!r} is not in the plan; re-plan for these params")
        if pl.segmented:
            bounds = tuple((s.start, s.stop) for s in pl.segments)
            if not isinstance(x, Segmented) or x.bounds != bounds:
                raise ValueError(
                    f"parameter {name!r} is stored as {x!r} but the plan stores it in layer segments "
                    f"{[f'{a}-{b - 1}' for a, b in bounds]}: place the params with osdp_jax.shard(params, mesh, "
                    f"plan) (osdp_jax.merge_segments gives whole arrays back)")
            return Segmented([storage_spec(s.spec, x.shape, pl.tensor, layout.model_axis, True) for s in pl.segments],
                             bounds)
        if isinstance(x, Segmented):
            raise ValueError(f"parameter {name!r} is stored in layer segments {x!r} that the plan does not "
                             f"use: merge them first with osdp_jax.merge_segments, then shard under this plan")
        return storage_spec(pl.spec, np.shape(x), pl.tensor, layout.model_axis, pl.in_loop)
    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=is_segmented)


def manual_specs(specs, layout: Layout):
    """``specs`` (a tree of ``PartitionSpec`` and :class:`Segmented` leaves) without the layout's
    model axis: the ``in_specs`` of a ``shard_map`` manual over the data axes only."""
    if not layout.model_axis:
        return specs
    return jax.tree.map(lambda s: manual_spec(s, layout.model_axis), specs, is_leaf=lambda x: isinstance(x, P))


def state_spec_tree(params, layout: Layout, n: int):
    """:func:`spec_tree` for the gradients and the optimizer state: the storage specs, except
    that a zero2 parameter (or segment) gets the spec its state is sharded under
    (``_strategies.state_spec_for``; ``n`` the data-parallel device count)."""
    by_path = {pl.path: pl for pl in layout.params}
    specs = spec_tree(params, layout)

    def one(path, x, spec):
        pl = by_path[path_name(path)]
        if isinstance(x, Segmented):
            return Segmented([state_spec_for(part.shape, seg.strategy, seg.spec, layout.axes, n, True)
                              for part, seg in zip(x.parts, pl.segments)], x.bounds)
        strategy = pl.segments[0].strategy if pl.segments else pl.strategy
        return state_spec_for(x.shape, strategy, spec, layout.axes, n, pl.in_loop)
    return jax.tree_util.tree_map_with_path(one, params, specs, is_leaf=is_segmented)


def to_storage(params, layout: Layout):
    """``params`` (whole arrays, ``ShapeDtypeStruct``s, or already stored) with every parameter the
    layout stores in segments cut into them (:class:`Segmented`)."""
    by_path = {pl.path: pl for pl in layout.params if pl.segmented}
    if not by_path:
        return params

    def one(path, x):
        pl = by_path.get(path_name(path))
        if pl is None or isinstance(x, Segmented):
            return x
        return cut(x, pl.segments)
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_segmented)


def opt_state_specs(optimizer, abstract_state, param_specs, params):
    """Specs for the optimizer state: param-shaped parts follow the params (``param_specs``),
    the rest replicate (the optimizer's ``init`` traced, not run: ``_describe.map_state_params``).
    A leaf where a parameter's state sits but of another shape than the parameter (``params``,
    the stored parameters or their shapes) is replicated too: ``optax.adafactor`` keeps a row
    and a column vector per matrix, and a ``(1,)`` placeholder per vector, in its place."""
    def follow(x, spec, p):
        return spec if tuple(x.shape) == tuple(np.shape(p)) else P()

    return map_state_params(optimizer, follow, abstract_state, param_specs, params,
                            transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))


def batch_specs(batch, axes):
    """The batch's specs: every leaf split along its leading (global batch) dimension."""
    entry = axis_entry(axes)
    return jax.tree.map(lambda _: P(entry), batch)
