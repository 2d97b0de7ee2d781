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

import jax
import optax
from jax.sharding import PartitionSpec as P

from ._describe import describe, path_name
from ._strategies import axes_size, axis_entry, data_axes, sharded_dim, spec_for


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


def collective(spec: P, axes, two_stage: bool = False) -> Collective | None:
    """How a parameter stored as ``spec`` is gathered: over the axes its sharded dimension names;
    its gradient is also summed over the other data-parallel ``axes``. None if replicated."""
    dim = sharded_dim(spec)
    if dim is None:
        return None
    entry = spec[dim]
    on = tuple(entry) if isinstance(entry, tuple) else (entry,)
    return Collective(on, tuple(a for a in axes if a not in on), two_stage)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One parameter's layout."""

    path: str
    spec: P  # storage PartitionSpec
    strategy: str = "replicate"  # "replicate", "zero3" or "hsdp"
    in_loop: bool = False  # gathered one layer at a time inside the model's loop (gather_params)
    split: int = 1  # operator splitting: slices its dense layer gathers one at a time
    two_stage: bool = False  # gathered one mesh axis at a time, intra-node first (2-D meshes)
    dense: bool = False  # a kernel of a dense layer outside any layer loop: a sharded one is gathered
    #                      at its layer, from the layer's input (not before the loss)


def _strategy_of(spec: P, axes) -> str:
    dim = sharded_dim(spec)
    if dim is None:
        return "replicate"
    entry = spec[dim]
    on = set(entry) if isinstance(entry, tuple) else {entry}
    return "zero3" if on >= set(axes) else "hsdp"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per-parameter layouts over the data-parallel mesh ``axes``."""

    params: tuple[ParamLayout, ...]
    axes: tuple[str, ...]

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

    def collectives(self) -> dict[str, Collective | None]:
        """Path -> how it is gathered (None: replicated)."""
        return {pl.path: collective(pl.spec, self.axes, pl.two_stage) for pl in self.params}

    # --- constructors ------------------------------------------------------------------------
    @classmethod
    def from_specs(cls, params, mesh, specs, *, axis=None, in_loop=(), splits=None, two_stage=(),
                   dense=()) -> "Layout":
        """A hand-written layout: ``specs`` maps paths (``"block0/w1"``) to storage
        ``PartitionSpec``s, or is a pytree of them shaped like the unboxed params; missing paths
        are replicated. ``in_loop``: paths the model gathers per layer (``gather_params``);
        ``splits``: path -> k; ``dense``: kernels of dense layers, gathered at their layer."""
        axes = data_axes(mesh, axis)
        infos = describe(params)
        if not isinstance(specs, dict) or not all(isinstance(v, P) for v in specs.values()):
            flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
            specs = {path_name(p): s for p, s in flat}
        unknown = sorted(set(specs) - {i.path for i in infos})
        if unknown:
            raise KeyError(f"layout names parameters the params do not have: {unknown[:3]}")
        splits = dict(splits or {})
        params_ = []
        for i in infos:
            spec = specs.get(i.path, P())
            dim = sharded_dim(spec)
            if dim is not None and i.shape[dim] % axes_size(mesh, collective(spec, axes).axes):
                raise ValueError(f"parameter {i.path!r} {i.shape} cannot be stored as {spec}: its dimension "
                                 f"{dim} is not divisible by the devices it is sharded over")
            params_.append(ParamLayout(i.path, spec, _strategy_of(spec, axes), i.path in set(in_loop),
                                       splits.get(i.path, 1), i.path in set(two_stage), i.path in set(dense)))
        return cls(tuple(params_), axes)

    @classmethod
    def ddp(cls, params, mesh, *, axis=None) -> "Layout":
        """Every parameter replicated (plain data parallelism)."""
        return cls.from_specs(params, mesh, {}, axis=axis)

    @classmethod
    def fsdp(cls, params, mesh, *, axis=None, in_loop=(), dense=()) -> "Layout":
        """Every parameter ZeRO-3 sharded over all data-parallel devices, along its first
        dimension they divide (after the layer axis for ``in_loop`` ones); the others replicated."""
        axes = data_axes(mesh, axis)
        n = axes_size(mesh, axes)
        in_loop = set(in_loop)
        specs = {}
        for i in describe(params):
            spec = spec_for(i, "zero3", axes, n, i.path in in_loop, n)
            specs[i.path] = spec if spec is not None else P()
        return cls.from_specs(params, mesh, specs, axis=axis, in_loop=in_loop, dense=dense)


def as_layout(plan_or_layout) -> Layout:
    """The :class:`Layout` of a ``Plan`` (``plan.layout``) or a ``Layout`` itself."""
    layout = getattr(plan_or_layout, "layout", None)
    if not isinstance(layout, Layout):
        raise TypeError(f"expected an osdp_jax.Plan or osdp_jax.Layout, got {type(plan_or_layout).__name__}")
    return layout


def spec_tree(params, specs_by_path: dict[str, P]):
    """A tree shaped like ``params`` (boxes and all) whose leaves are the planned specs."""
    def spec(path, _):
        name = path_name(path)
        if name not in specs_by_path:
            raise KeyError(f"parameter {name!r} is not in the plan; re-plan for these params")
        return specs_by_path[name]
    return jax.tree_util.tree_map_with_path(spec, params)


def opt_state_specs(optimizer, abstract_state, param_specs):
    """Specs for the optimizer state: param-shaped parts follow the params, the rest replicate."""
    return optax.tree_map_params(optimizer, lambda _, spec: spec, abstract_state, param_specs,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))


def batch_specs(batch, axes):
    """The batch's specs: every leaf split along its leading (global batch) dimension."""
    entry = axis_entry(axes)
    return jax.tree.map(lambda _: P(entry), batch)
