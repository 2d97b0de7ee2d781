"""The planning problem: per parameter, which (strategy, split count k) choices exist.

A :class:`Problem` holds the parameters (``describe``), the data-parallel axes, what tracing the
loss found (parameters gathered per layer, kernels of dense layers) and the choice matrix: one
column per (strategy, k), one storage ``PartitionSpec`` per parameter and column, None where the
choice does not apply (a dimension the devices do not divide, a kernel that cannot split in k).
Everything else in the planner reads it; nothing here compiles.
"""
from __future__ import annotations

import collections
import dataclasses
import logging

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from osdp_jax.core.describe import ParamInfo, check_trainable, describe
from osdp_jax.core.layout import Layout, ParamLayout, one_segment
from osdp_jax.core.logical import logical_names
from osdp_jax.core.stack import Segment, check_remat
from osdp_jax.core.strategies import GATHERED, axes_size, sharded_dim, spec_for
from osdp_jax.core.tensor import split_dim
from osdp_jax.planner.cost import Topology
from osdp_jax.planner.discover import find
from osdp_jax.planner.unit_policy import from_found

log = logging.getLogger("osdp_jax")


@dataclasses.dataclass(frozen=True)
class Problem:
    """What the planner decides: the parameters, the mesh's data-parallel axes, and per parameter
    the choices (strategy and split count columns) available to it, with the layer stacks and
    units the loss's trace found. :func:`build_problem` makes one; the search runs over its
    cost tables (``osdp_jax.planning`` exposes both for users who drive the stages)."""

    infos: tuple[ParamInfo, ...]
    axes: tuple[str, ...]
    n: int  # data-parallel devices
    topo: Topology
    strategies: tuple[str, ...]  # allowed by the user
    columns: tuple[tuple, ...]  # (strategy, k) per column; (strategy, 1, accumulate) with microbatches
    options: tuple[tuple[P | None, ...], ...]  # [parameter][column] storage spec, None: unavailable
    in_loop: frozenset[str] = frozenset()  # layer-stacked, gathered per layer (osdp_jax.layers.scan, model_loop)
    dense: frozenset[str] = frozenset()  # kernels of dense layers outside layer loops (gathered at the layer)
    split_ks: dict = dataclasses.field(default_factory=dict)  # (path, strategy) -> [k > 1 it can take]
    stacks: tuple[tuple[str, ...], ...] = ()  # per layers.scan call, its stacked parameters' paths
    units: dict = dataclasses.field(default_factory=dict)  # path -> unit it is gathered at when sharded
    unit_remat: str = "full"  # the remat policy units run under (osdp_jax.units)
    compute_dtype: str = ""  # sharded parameters gathered in this dtype ("": their own)
    last_unit: str = ""  # the unit the forward pass calls last (its backward pass runs first)
    unit_saved: dict = dataclasses.field(default_factory=dict)  # unit -> activation bytes its calls save
    fingerprint: str = ""  # the loss's, as traced at the smallest batch size (``_discover.fingerprint``)
    model_loop: frozenset[str] = frozenset()  # in_loop, sliced per iteration by the model's own scan
    tensor: dict = dataclasses.field(default_factory=dict)  # path -> "column"/"row" over model_axis
    model_axis: str | None = None  # the mesh axis those are split over (osdp_jax.core.tensor)
    model_size: int = 1  # devices on model_axis
    tensor_bytes: dict = dataclasses.field(default_factory=dict)  # row kernel path -> bytes of its output per
    #                                                                 global sample (all-reduced over model_axis)
    dense_flops: dict = dataclasses.field(default_factory=dict)  # kernel path -> its dense layer's forward FLOPs
    #                                                                 per global sample (_dense_flops)
    sequence: bool = False  # sequence parallelism: row layers' outputs split on their sequence (core.tensor)
    data_dims: dict = dataclasses.field(default_factory=dict)  # path -> the dimension a data-parallel shard
    #                                                              takes where the devices divide it (logical names)

    def model_share(self) -> np.ndarray:
        """Per parameter, the share of it one device of the model axis holds (1/t split, else 1)."""
        return np.array([1.0 / self.model_size if self._split_dim(i) is not None else 1.0 for i in self.infos])

    def _split_dim(self, info: ParamInfo) -> int | None:
        return split_dim(info.shape, self.tensor.get(info.path, ""), info.path in self.in_loop)

    def cost_infos(self) -> list[ParamInfo]:
        """The parameters as one device of the model axis holds them: a split one's dimension 1/t."""
        out = []
        for i in self.infos:
            dim = self._split_dim(i)
            out.append(i if dim is None else dataclasses.replace(
                i, shape=tuple(n // self.model_size if d == dim else n for d, n in enumerate(i.shape))))
        return out

    def gather_ratio(self) -> np.ndarray:
        """Per parameter, bytes gathered per byte stored: itemsize(compute_dtype) / its itemsize
        (at most 1; 1 without a compute dtype)."""
        if not self.compute_dtype:
            return np.ones(len(self.infos))
        size = np.dtype(jax.numpy.dtype(self.compute_dtype)).itemsize
        return np.array([min(1.0, size / np.dtype(i.dtype).itemsize) for i in self.infos])

    def with_accumulation(self) -> "Problem":
        """The problem of a step run as microbatches: one more column per strategy whose gradient
        can be summed the other way (``_strategies.accumulation``): ``("zero3", 1, "whole")`` and
        ``("hsdp", 1, "whole")`` (the weight gathered once per step and kept across the
        microbatches) and ``("zero2", 1, "whole")`` (the gradient summed whole, reduce-scattered
        once), each where the plain column applies to a parameter gathered once per step
        (not a stacked one, gathered per layer, nor a unit's)."""
        extra = [(s, 1, "whole") for s in (*GATHERED, "zero2") if (s, 1) in self.columns]
        if not extra:
            return self
        at_use = self.at_use()
        options = tuple((*row, *(row[self.columns.index(c[:2])] if i.path not in at_use else None for c in extra))
                        for i, row in zip(self.infos, self.options))
        return dataclasses.replace(self, columns=(*self.columns, *extra), options=options)

    def without_splits(self, paths) -> "Problem":
        """The problem with the kernels ``paths`` never split: their k > 1 columns unavailable
        (a kernel that must split, ``splits`` without 1, keeps them)."""
        options, ks = [], dict(self.split_ks)
        for i, row in zip(self.infos, self.options):
            sharded = {s for (p, s), k in self.split_ks.items() if p == i.path and k}
            if i.path in paths and sharded and all(row[self.columns.index((s, 1))] is not None for s in sharded):
                row = tuple(None if c[1] > 1 else o for c, o in zip(self.columns, row))
                ks.update({(i.path, s): [] for s in sharded})
            options.append(row)
        return dataclasses.replace(self, options=tuple(options), split_ks=ks)

    def stack_layers(self, s: int) -> int:
        """Layers of stack ``s``."""
        return next(i.shape[0] for i in self.infos if i.path == self.stacks[s][0])

    @property
    def available(self) -> np.ndarray:
        return np.array([[o is not None for o in row] for row in self.options], dtype=bool)

    def spec_of(self, info: ParamInfo, strategy: str) -> P | None:
        """``info``'s storage spec over the data axes under ``strategy`` (None: it cannot take it);
        a parameter split over the model axis is sharded along another dimension."""
        dim = self._split_dim(info)
        if dim is not None:
            info = dataclasses.replace(info, shape=tuple(1 if d == dim else n for d, n in enumerate(info.shape)))
        return spec_for(info, strategy, self.axes, self.n, info.path in self.in_loop, self.topo.inner,
                        self.data_dims.get(info.path))

    def _sharded_columns(self) -> np.ndarray:
        return np.array([column[0] != "replicate" for column in self.columns], dtype=bool)

    def any_sharded(self) -> bool:
        """Whether any parameter may take a column other than replication."""
        return bool(self.available[:, self._sharded_columns()].any())

    def replicated_only(self) -> "Problem":
        """The problem with every parameter's sharded columns unavailable: its one probe is the
        all-replicated step (``_calibration.probe_kinds``), the same layout as this problem's."""
        sharded = self._sharded_columns()
        return dataclasses.replace(self, options=tuple(tuple(None if off else o for o, off in zip(row, sharded))
                                                       for row in self.options))

    def can_shard(self) -> np.ndarray:
        return np.array([self.spec_of(i, "zero3") is not None for i in self.infos])

    def loop_mask(self) -> np.ndarray:
        """Parameters gathered where they are used, one layer or unit at a time, not once per step."""
        return np.array([i.path in self.in_loop or i.path in self.units for i in self.infos])

    def last_unit_mask(self) -> np.ndarray:
        """The parameters of :attr:`last_unit` (none without units)."""
        return np.array([bool(self.last_unit) and self.units.get(i.path) == self.last_unit for i in self.infos])

    def saving_bytes(self) -> np.ndarray:
        """Per parameter, the bytes the per-layer memory term counts (``_cost``: kappa bytes of temp
        saved per byte sharded): its own bytes, except in a unit, where the unit's share of the
        saving follows the activations it saves (``unit_saved``) rather than its parameter bytes.
        A unit u of P_u parameter bytes and A_u saved activation bytes counts
        ``W_u = A_u sum(P) / sum(A)`` (sums over the units but :attr:`last_unit`, which saves none),
        shared among its parameters by bytes: ``w_i = p_i W_u / P_u``; sum(W) = sum(P), so a probe
        that shards every unit fits the same kappa either way. Shares by bytes alone under-predict a
        model whose activations and parameters are spread the opposite ways over its units (a
        ResNet: early blocks hold the activations, late ones the parameters). Without a figure for
        every unit (a call ``jax.vjp`` could not trace): the bytes."""
        p = np.array([i.nbytes for i in self.cost_infos()], dtype=np.float64)
        saving = [u for u in set(self.units.values()) if u != self.last_unit]
        if not saving or any(self.unit_saved.get(u) is None for u in saving):
            return p
        acts = {u: float(self.unit_saved[u]) for u in saving}
        if sum(acts.values()) <= 0:
            return p
        unit_bytes = {u: 0.0 for u in self.units.values()}
        for i in self.infos:
            if i.path in self.units:
                unit_bytes[self.units[i.path]] += i.nbytes
        scale = sum(unit_bytes[u] for u in saving) / sum(acts.values())
        w = p.copy()
        for k, i in enumerate(self.infos):
            u = self.units.get(i.path)
            if u in acts and unit_bytes[u] > 0:
                w[k] = i.nbytes * acts[u] * scale / unit_bytes[u]
        return w

    def at_use(self) -> frozenset[str]:
        """Paths of the parameters :meth:`loop_mask` marks."""
        return self.in_loop | frozenset(self.units)

    def layout(self, zero3_where=lambda info: False, splits=None, remat: str = "full",
               zero2_where=lambda info: False, remat_layers=lambda layers: layers) -> Layout:
        """A probe's layout: zero3 where ``zero3_where(info)`` (and it applies), else zero2 where
        ``zero2_where(info)`` (and it applies), else replicated; ``splits`` (path -> k) on sharded
        kernels; the first ``remat_layers(L)`` layers of every stack (of L) run with the ``remat``
        policy, the rest with "full"."""
        splits = splits or {}
        params = []
        for i in self.infos:
            spec = (self.spec_of(i, "zero3") if zero3_where(i) else None) or P()
            strategy = "replicate" if sharded_dim(spec) is None else "zero3"
            if strategy == "replicate" and zero2_where(i) and self.spec_of(i, "zero2") is not None:
                strategy = "zero2"
            k = splits.get(i.path, 1) if strategy == "zero3" else 1
            segs = _probe_segments(i.shape[0], remat_layers(i.shape[0]), spec, strategy, k, remat) \
                if i.path in self.in_loop else ()
            unit = self.units.get(i.path, "") if strategy == "zero3" and k == 1 else ""
            params.append(ParamLayout(i.path, spec, strategy, i.path in self.in_loop, k, False,
                                      i.path in self.dense, segs, unit,
                                      self.compute_dtype if strategy == "zero3" else "",
                                      model_loop=i.path in self.model_loop, tensor=self.tensor.get(i.path, "")))
        return Layout(tuple(params), self.axes, unit_remat=self.unit_remat, model_axis=self.model_axis,
                      sequence=self.sequence)


TENSOR_WITH = ("replicate", "zero3")  # the data-parallel strategies a parameter split over the model axis takes


def _tensor_bytes(tensor: dict, infos, found, batch, in_loop) -> dict[str, float]:
    """Row kernel path -> the bytes of its layer's output per global sample: its input's
    recorded shape (at ``batch``'s size) but for the dimensions it contracts, times its output
    features."""
    if found is None or not tensor:
        return {}
    size = int(jax.tree.leaves(batch)[0].shape[0])
    by_path = {i.path: i for i in infos}
    out = {}
    for path, role in tensor.items():
        shape = found.dense_inputs.get(path)
        if role != "row" or not shape or path not in by_path:
            continue
        info = by_path[path]
        layers = info.shape[0] if path in in_loop else 1  # a layer stack's: one all-reduce pair per layer
        contracted = len(info.shape) - (path in in_loop) - 1  # (F, D): F; a multi-head (H, hd, D): H, hd
        out[path] = (layers * float(np.prod(shape[:-contracted])) / size * info.shape[-1]
                     * np.dtype(info.dtype).itemsize)
    return out


def _dense_flops(infos, found, batch, in_loop) -> dict[str, float]:
    """Kernel path -> its dense layer's forward FLOPs per global sample, ``2 T K``, for every
    kernel whose layer's input the trace recorded (first call): ``T`` rows of input per sample
    (every layer's, in a stack), ``K`` kernel entries per layer. The input's trailing dimensions
    that match the kernel's leading ones are the contracted ones (at least one, never all)."""
    if found is None:
        return {}
    size = int(jax.tree.leaves(batch)[0].shape[0])
    out = {}
    for info in infos:
        shape = found.dense_inputs.get(info.path)
        kernel = info.shape[1:] if info.path in in_loop else info.shape
        if not shape or len(kernel) < 2:
            continue
        contracted = max(c for c in range(1, len(kernel)) if c == 1 or tuple(shape[-c:]) == kernel[:c])
        layers = info.shape[0] if info.path in in_loop else 1
        out[info.path] = 2.0 * layers * float(np.prod(shape[:-contracted])) / size * float(np.prod(kernel))
    return out


def _data_dims(params, infos, tensor: dict, in_loop) -> dict[str, int]:
    """For parameters annotated with logical axis names: path -> the dimension carrying the name
    the most parameter bytes carry (the model axis's split dimensions and a stack's layer axis
    left out), so that every data-parallel shard splits one name and one rule per name
    (``osdp_jax.logical_axis_rules``) can place a plan's parameters. Empty without names."""
    names = logical_names(params)
    if not names:
        return {}
    by_path = {i.path: i for i in infos}
    free = {}  # path -> {name: dimension} a data-parallel shard may take
    for path, dims in names.items():
        info = by_path.get(path)
        if info is None:
            continue
        skip = {split_dim(info.shape, tensor.get(path, ""), path in in_loop), 0 if path in in_loop else None}
        free[path] = {name: d for d, name in enumerate(dims) if name is not None and d not in skip}
    weight = collections.Counter()
    for path, dims in free.items():
        for name in dims:
            weight[name] += by_path[path].nbytes
    if not weight:
        return {}
    top = max(weight, key=lambda name: (weight[name], name))
    return {path: dims[top] for path, dims in free.items() if top in dims}


def _probe_segments(layers: int, under: int, spec, strategy: str, k: int, remat: str) -> tuple:
    """One segment of ``layers`` layers, its first ``under`` run with ``remat`` and the rest with
    "full" (two segments then; one, "full", when ``under`` is 0)."""
    if under >= layers or under <= 0 or remat == "full":
        return one_segment(layers, spec, strategy, k, False, remat if under > 0 else "full")
    return (Segment(0, under, strategy, k, check_remat(remat), spec),
            Segment(under, layers, strategy, k, "full", spec))


def _stacks(found, in_loop) -> tuple[tuple[str, ...], ...]:
    """The stacks discovery found, each its stacked parameters; a parameter in two stacks (one
    stack run twice with others) joins the first, and stacks left empty are dropped."""
    seen, out = set(), []
    for stack in found:
        mine = tuple(p for p in stack if p in in_loop and p not in seen)
        seen.update(mine)
        if mine:
            out.append(mine)
    return tuple(out)


def _split_counts(problem: Problem, info: ParamInfo, strategy: str, splittable, splits) -> list[int]:
    """Split counts k > 1 a sharded kernel can take: its gather group times k must divide its
    sharded dimension."""
    spec = problem.spec_of(info, strategy)
    if info.path not in splittable or spec is None:
        return []
    size, group = info.shape[sharded_dim(spec)], (problem.n if strategy == "zero3" else problem.topo.inner)
    return [k for k in splits if k > 1 and size % (group * k) == 0]


def build_problem(params, mesh, axes, strategies, splits, loss_fn=None, batch=None, units=None,
                  unit_remat: str = "full", compute_dtype: str = "", tensor=None,
                  model_axis: str | None = None, sequence: bool = False) -> Problem:
    """The problem for ``params`` on ``mesh``'s data-parallel ``axes``; with ``loss_fn`` and an
    (abstract) ``batch``, the loss is traced once to find per-layer parameters, dense kernels and
    units (``units``: patterns of the units to use, None: the default policy, ``()``: none; see
    ``_unit_policy``).

    Columns: every allowed strategy at k = 1, then the sharded ones at each k > 1 of ``splits``.
    A parameter no allowed strategy can store (a 0-d scalar, or no dimension the devices divide,
    under zero3) is replicated, the one layout that always applies. ``tensor`` (path ->
    ``"column"``/``"row"``) splits those parameters over the mesh axis ``model_axis`` in every
    layout; they take replicate or zero3 only, unsplit and outside units.
    """
    infos = tuple(describe(params))
    check_trainable(infos)
    in_loop, dense, splittable, stacks, model_loop = frozenset(), frozenset(), frozenset(), (), frozenset()
    unit_of, last_unit, saved, fingerprint = {}, "", {}, ""
    if loss_fn is not None:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        shapes = {i.path: i.shape for i in infos}
        found = find(loss_fn, abstract, batch)
        loop_found, dense_found, found_stacks = found.in_loop, found.dense, found.stacks
        in_loop = frozenset(p for p in loop_found if len(shapes.get(p, ())) >= 2)
        stacks = _stacks(found_stacks, in_loop)
        model_loop = frozenset(found.model_loop) & in_loop
        splittable = frozenset(p for p in dense_found if len(shapes.get(p, ())) == 2 + (p in in_loop)) - model_loop
        dense = frozenset(p for p in dense_found if p in shapes and p not in in_loop)
        unit_of = {p: u for p, u in from_found(found, infos, units).items() if p not in model_loop}
        if model_loop:
            log.info("stacked parameters run by the model's own scans, gathered per iteration: %d (e.g. %s)",
                     len(model_loop), sorted(model_loop)[0])
        chosen = set(unit_of.values())
        last_unit = next((name for _, name, _ in reversed(found.units) if name in chosen), "")
        saved = {u: found.saved.get(u) for u in chosen}
        fingerprint = found.fingerprint
        if unit_of:
            log.info("units: %s", ", ".join(sorted(set(unit_of.values()))))
    tensor = {p: r for p, r in (tensor or {}).items() if p not in model_loop}  # a model's own scan: data-parallel
    if tensor:
        unit_of = {p: u for p, u in unit_of.items() if p not in tensor}
        splittable = splittable - set(tensor)
    topo = Topology(tuple(axes), tuple(mesh.shape[a] for a in axes))
    names = strategies if "replicate" in strategies else (*strategies, "replicate")
    sharded = [s for s in GATHERED if s in strategies]
    columns = tuple([(s, 1) for s in names] + [(s, k) for s in sharded for k in splits if k > 1])
    problem = Problem(infos, tuple(axes), axes_size(mesh, axes), topo, tuple(strategies), columns, (),
                      in_loop, dense, stacks=stacks, units=unit_of, unit_remat=check_remat(unit_remat),
                      last_unit=last_unit, unit_saved=saved, compute_dtype=compute_dtype, fingerprint=fingerprint,
                      model_loop=model_loop, tensor=tensor, model_axis=model_axis if tensor else None,
                      model_size=mesh.shape[model_axis] if tensor else 1,
                      dense_flops=_dense_flops(infos, found if loss_fn is not None else None, batch, in_loop),
                      tensor_bytes=_tensor_bytes(tensor, infos, found if loss_fn is not None else None, batch,
                                                 in_loop),
                      data_dims=_data_dims(params, infos, tensor, in_loop), sequence=bool(sequence and tensor))
    ks = {(i.path, s): _split_counts(problem, i, s, splittable, splits) for i in infos for s in sharded}
    if 1 not in splits:  # a kernel that must split is gathered slice by slice, never whole with a unit
        must_split = {path for (path, _), counts in ks.items() if counts}
        problem = dataclasses.replace(problem, units={p: u for p, u in unit_of.items() if p not in must_split})
    options = []
    for i in infos:
        row = []
        for s, k in columns:
            spec = problem.spec_of(i, s) if s in strategies and (i.path not in tensor or s in TENSOR_WITH) else None
            if s in sharded and k > 1 and k not in ks[i.path, s]:
                spec = None
            if s in sharded and k == 1 and 1 not in splits and ks[i.path, s]:
                spec = None  # this kernel must split
            row.append(spec)
        if all(o is None for o in row):
            row[columns.index(("replicate", 1))] = P()
            log.info("parameter %s %s cannot be stored as %s: replicated", i.path, i.shape, "/".join(strategies))
        options.append(tuple(row))
    return dataclasses.replace(problem, options=tuple(options), split_ks=ks)
