"""Placing parameters, optimizer state and batches on the mesh as a plan (or layout) says, and
their abstract (``ShapeDtypeStruct``) counterparts for compiling without allocating."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from osdp_jax.core.describe import check_optimizer, describe, path_name
from osdp_jax.core.layout import Layout, as_layout, batch_specs, opt_state_specs, spec_tree, state_spec_tree, to_storage
from osdp_jax.core.stack import held_fraction, is_segmented, merge
from osdp_jax.core.strategies import axes_size, axis_entry


def place(params, mesh, layout):
    """``params`` placed on ``mesh`` per ``layout`` (a ``Layout`` or ``Plan``): the same tree type
    back (boxes, nnx.State kept). ``jax.ShapeDtypeStruct`` leaves come back as ``ShapeDtypeStruct``
    carrying the sharding. Arrays are copied, never aliased, so donating the result to a train
    step leaves the caller's arrays intact. On a mesh spanning several processes
    (``jax.distributed``), every process passes the same values.

    A layer stack the layout cuts into segments comes back as one ``osdp_jax.Segmented`` per
    parameter (one array per segment); :func:`merge_segments` gives the whole arrays back.
    Parameters already stored in other segments are merged first."""
    check_matches(layout, params)
    check_mesh(layout, mesh)
    layout = as_layout(layout)
    params = to_storage(_remerge(params, layout), layout)
    specs = spec_tree(params, layout)

    def one(x, spec):
        sharding = NamedSharding(mesh, spec)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if not sharding.is_fully_addressable:
            # a mesh over several processes: every process holds the same whole value and places
            # the shards of its own devices
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        if isinstance(x, jax.Array):
            # device_put may hand back the caller's buffer as one of the shards (even with
            # may_alias=False in jax 0.10), and the train step donates it: copy first.
            x = jnp.copy(x)
        return jax.device_put(x, sharding)

    return jax.tree.map(one, params, specs)


def _remerge(params, layout: Layout):
    """``params`` with any parameter stored in segments the layout does not use merged whole."""
    wanted = {pl.path: tuple((s.start, s.stop) for s in pl.segments) for pl in layout.params if pl.segmented}

    def one(path, x):
        if is_segmented(x) and wanted.get(path_name(path)) != x.bounds:
            return merge(x)
        return x
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_segmented)


def merge_segments(tree):
    """``tree`` (params, optimizer state, or both) with every parameter stored in layer segments
    (``osdp_jax.Segmented``) concatenated back into its whole ``[L, ...]`` array: the
    parameters as the model defines them, for export or evaluation elsewhere. Abstract
    (``ShapeDtypeStruct``) parts give an abstract whole."""
    return merge(tree)


def whole_target(target):
    """Restore targets (``ShapeDtypeStruct``s with shardings, e.g. from :func:`abstract_state`)
    with every layer stack whole: a ``Segmented`` target becomes one ``[L, ...]`` target laid out
    as its most sharded segment (whose spec fits the whole stack). Restore a checkpoint saved with
    :func:`merge_segments` onto it, then :func:`cut_segments` it."""
    def one(x):
        if not is_segmented(x):
            return x
        part = min(x.parts, key=held_fraction)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=part.sharding)
    return jax.tree.map(one, target, is_leaf=is_segmented)


def cut_segments(tree, target):
    """``tree`` (whole layer stacks, e.g. restored onto :func:`whole_target`) cut into ``target``'s
    segments, each part placed as its target says; other leaves unchanged."""
    def one(x, t):
        if not is_segmented(t):
            return x
        return type(t)([jax.device_put(x[a:b], p.sharding) for (a, b), p in zip(t.bounds, t.parts)], t.bounds)
    return jax.tree.map(one, tree, target, is_leaf=is_segmented)


def check_mesh(plan, mesh) -> None:
    """A ``ValueError`` unless ``mesh`` has the data-parallel axes ``plan`` shards over, of the
    device count it was planned for (a ``Layout`` names its axes only)."""
    axes = as_layout(plan).axes
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise ValueError(f"the plan shards over mesh axes {list(axes)}, but the mesh has axes "
                         f"{list(mesh.axis_names)}: use the mesh the plan was made for, or plan for this one")
    n, have = getattr(plan, "num_devices", None), axes_size(mesh, axes)
    shape = dict(getattr(plan, "mesh_shape", ()))
    build = " or build the mesh it was made for with plan.make_mesh()" if shape else ""
    model = as_layout(plan).model_axis
    if model and model in shape and mesh.shape.get(model) != shape[model]:
        raise ValueError(f"the plan splits parameters over {shape[model]} devices of the model axis {model!r}, but "
                         f"this mesh has {mesh.shape.get(model, 0)} there: build the mesh it was made for with "
                         f"plan.make_mesh(), or plan again for this one")
    if n is not None and n != have:
        raise ValueError(f"the plan was made for {n} data-parallel devices on axes {list(axes)}, but this mesh "
                         f"has {have}: its memory was checked for {n}. Plan again for this mesh "
                         f"(osdp_jax.plan(params, mesh, ...)){build}")


def check_matches(layout, params) -> None:
    """A ``ValueError`` unless ``params`` are what ``layout`` was made for (a ``Plan`` checks
    shapes too; a ``Layout`` the parameter paths)."""
    infos = describe(params)
    if hasattr(layout, "check_matches"):
        layout.check_matches(infos)
        return
    ours = {pl.path for pl in as_layout(layout).params}
    theirs = {i.path for i in infos}
    if ours != theirs:
        diff = sorted(ours ^ theirs)[:3]
        raise ValueError(f"the params do not match the plan (parameters differ, e.g. {diff}); plan again for "
                         f"these params")


def init_opt_state(optimizer, params, plan, mesh):
    """``optimizer.init(params)`` with each state leaf sharded like its parameter (a zero2
    parameter's state like its gradient: sharded).

    The state is created directly in place (``jit`` with ``out_shardings``), never gathered.
    """
    check_matches(plan, params)
    check_mesh(plan, mesh)
    check_optimizer(optimizer, params)
    layout = as_layout(plan)
    params = to_storage(params, layout)
    abstract = jax.eval_shape(optimizer.init, params)
    specs = opt_state_specs(optimizer, abstract, state_spec_tree(params, layout, axes_size(mesh, layout.axes)), params)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return jax.jit(as_auto(optimizer.init, mesh, shardings), out_shardings=shardings)(params)


def as_auto(fn, mesh, out_shardings):
    """``fn`` run with ``mesh``'s Explicit axes as Auto ones (``jax.sharding.auto_axes``), its
    outputs laid out as ``out_shardings``; ``fn`` itself on a mesh without Explicit axes.

    For the optimizer's ``init`` and ``update``, which run on sharded parameters, gradients and
    state: one that is not elementwise (``optax.contrib.muon`` multiplies each gradient matrix by
    its transpose) is refused by an Explicit mesh's sharding rules on a ZeRO-3 shard
    (``ShardingTypeError``), where on an Auto mesh XLA gathers what it needs, inside the compiled
    step, so XLA's peak, which every plan is checked against, counts it."""
    explicit = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                     if kind == jax.sharding.AxisType.Explicit)
    if not explicit:
        return fn
    return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=out_shardings)


def abstract_state(params, plan, mesh, optimizer=None):
    """``(params, opt_state)`` as ``jax.ShapeDtypeStruct`` trees carrying the planned shardings.

    These are the targets orbax restores onto (``ocp.args.StandardRestore(target)``), so a
    checkpoint written under any mesh or plan comes back laid out as ``plan`` says on ``mesh``;
    nothing is allocated. ``params`` may be arrays or ``ShapeDtypeStruct``s (any tree type);
    ``opt_state`` is None without an ``optimizer``.
    """
    check_matches(plan, params)
    check_mesh(plan, mesh)
    layout = as_layout(plan)
    whole = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params, is_leaf=is_segmented)
    params = to_storage(whole, layout)
    p_specs = spec_tree(params, layout)

    def sds(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    params_t = jax.tree.map(sds, abstract, p_specs)
    if optimizer is None:
        return params_t, None
    opt_state = jax.eval_shape(optimizer.init, abstract)
    t_specs = state_spec_tree(params, layout, axes_size(mesh, layout.axes))
    return params_t, jax.tree.map(sds, opt_state, opt_state_specs(optimizer, opt_state, t_specs, abstract))


class Shardings(NamedTuple):
    """The ``NamedSharding`` trees of a plan on a mesh, as :func:`shardings` returns them.

    Attributes:
      params: shaped like the params as ``osdp_jax.shard`` returns them.
      opt_state: shaped like the optimizer's state of those params; None without an optimizer.
      batch: shaped like the batch; None without one.
    """

    params: object  # shaped like the params as osdp_jax.shard returns them
    opt_state: object  # shaped like the optimizer's state of those params; None without an optimizer
    batch: object  # shaped like the batch; None without one


def shardings(params, plan, mesh, optimizer=None, batch=None) -> Shardings:
    """The ``jax.sharding.NamedSharding`` trees of the parameters, the optimizer state and a
    batch under ``plan`` on ``mesh``: what ``jax.jit(in_shardings=, out_shardings=)``,
    ``jax.device_put`` and orbax's restore targets take.

    Args:
      params: the params tree (arrays or ``jax.ShapeDtypeStruct``s); nothing is allocated.
      plan: a ``Plan`` or ``Layout``.
      mesh: the mesh the plan is for.
      optimizer: an optax optimizer, for the optimizer state's shardings.
      batch: an example batch (arrays or ``ShapeDtypeStruct``s), for the batch's shardings: each
        leaf split along its leading (global batch) dimension over the data-parallel axes.

    Returns:
      A :class:`Shardings` of ``params``, ``opt_state`` and ``batch`` trees. A layer stack the plan
      cuts into segments appears as the ``osdp_jax.Segmented`` node ``osdp_jax.shard`` returns.
      The plan's memory budget holds inside ``osdp_jax.make_train_step``: a step of your own over
      arrays placed with these shardings lets XLA gather sharded weights where it chooses.

    Example:
      >>> s = osdp_jax.shardings(params, plan, mesh, optimizer, batch)            # doctest: +SKIP
      >>> params = jax.device_put(params, s.params)                               # doctest: +SKIP
    """
    p_t, o_t = abstract_state(params, plan, mesh, optimizer)
    of = lambda tree: None if tree is None else jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    b_t = None
    if batch is not None:
        b_t = jax.tree.map(lambda x, spec: NamedSharding(mesh, spec), batch, batch_specs(batch, as_layout(plan).axes))
    return Shardings(of(p_t), of(o_t), b_t)


def batch_sharding(mesh, plan) -> NamedSharding:
    """The sharding of every batch leaf under ``plan``: split along its leading (global batch)
    dimension over the data-parallel axes."""
    return NamedSharding(mesh, P(axis_entry(as_layout(plan).axes)))


def abstract_args(optimizer, params, batch, mesh, plan) -> tuple:
    """``(params, opt_state, batch)`` as ``ShapeDtypeStruct``s carrying ``plan``'s shardings: the
    train step's inputs, for lowering it without allocating."""
    p_t, o_t = abstract_state(params, plan, mesh, optimizer)
    b_t = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(mesh, s)),
                       batch, batch_specs(batch, as_layout(plan).axes))
    return p_t, o_t, b_t
