"""The sharded training step: explicit data parallelism under ``jax.shard_map``.

Every device runs ``loss_fn`` on its slice of the global batch. Per parameter, by its plan:

- replicated: the local gradient is averaged with one all-reduce (``pmean``);
- zero3: the stored shard is all-gathered just before ``loss_fn`` runs (or, for parameters the
  model passes through ``osdp_jax.gather_params``, one layer at a time inside its loop), and the
  gradient of the
  gathered weight is reduce-scattered (``psum_scatter``) back to a shard, through a
  ``custom_vjp``. XLA on CPU emits real ``all-gather`` and ``reduce-scatter`` ops this way, where
  plain ``jit`` would all-reduce the full gradient.

Flax linen metadata boxes are stripped before ``loss_fn`` sees the parameters: their logical
sharding constraints do not apply inside the step (``model.apply`` takes unboxed params).

The loss is the mean of the per-device losses, so ``loss_fn`` must return the *mean* loss over the
batch it is given; the gradient is then exactly that of the global mean loss.
"""
from __future__ import annotations

import functools

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._describe import path_name, strip_boxes
from ._context import Collective, SplitEntry, StepContext, active
from ._gather import discover, wrap_tree
from ._split import intercepting
from ._strategies import axes_size, axis_entry, sharded_dim


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather(shard, dim: int, how: Collective):
    """All-gather a ZeRO-3 shard along ``dim`` as ``how`` says (inside shard_map).

    Its gradient reduce-scatters the cotangent back to a shard (and sums it over
    ``how.reduce_axes``): the sum over devices, so the caller divides by the device count for a
    mean.
    """
    if how.two_stage and len(how.axes) > 1:
        for axis in reversed(how.axes):  # inner (intra-node) axis first
            shard = jax.lax.all_gather(shard, axis, axis=dim, tiled=True)
        return shard
    return jax.lax.all_gather(shard, how.axes, axis=dim, tiled=True)


def _gather_fwd(shard, dim, how):
    return gather(shard, dim, how), None


def _gather_bwd(dim, how, _, cotangent):
    if how.two_stage and len(how.axes) > 1:
        for axis in how.axes:  # outer (inter-node) axis first: the reverse of the gather
            cotangent = jax.lax.psum_scatter(cotangent, axis, scatter_dimension=dim, tiled=True)
    else:
        cotangent = jax.lax.psum_scatter(cotangent, how.axes, scatter_dimension=dim, tiled=True)
    if how.reduce_axes:
        cotangent = jax.lax.psum(cotangent, how.reduce_axes)
    return (cotangent,)


gather.defvjp(_gather_fwd, _gather_bwd)


def collective(spec: P, axes, two_stage: bool = False) -> Collective | None:
    """How a parameter stored as ``spec`` is gathered: over the axes its sharded dimension names;
    its gradient is also summed over the other data-parallel ``axes``. None if replicated."""
    dim = sharded_dim(spec)
    if dim is None:
        return None
    entry = spec[dim]
    on = tuple(entry) if isinstance(entry, tuple) else (entry,)
    return Collective(on, tuple(a for a in axes if a not in on), two_stage)


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
    entry = axis_entry(axes)
    return jax.tree.map(lambda _: P(entry), batch)


def check_batch(batch, n: int):
    """Every batch leaf needs a leading dimension the data-parallel size divides."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(leaf, "shape", ())
        if not shape or shape[0] % n:
            raise ValueError(
                f"batch leaf {path_name(path) or '<root>'!r} has shape {tuple(shape)}: its leading "
                f"(global batch) dimension must be divisible by the {n} data-parallel devices; "
                f"use a batch size that is a multiple of {n}")


def local_step(loss_fn, optimizer, param_specs, axes, n: int, loop_specs: dict, split_specs: dict,
               how: dict):
    """The per-device body: gather, loss and gradient, gradient collectives, optimizer update.

    ``loop_specs`` (path -> (dim, Collective)) are the sharded parameters the model gathers
    itself, one layer at a time (``osdp_jax.gather_params``); ``split_specs`` (path ->
    ``SplitEntry``) the kernels its dense layers gather, whole (k = 1) or one slice at a time
    (``osdp_jax.split``); every other sharded parameter is gathered here, before the loss, as
    ``how`` (path -> Collective) says.
    """
    def body(params, opt_state, batch):

        def gather_here(path, w, s):
            name = path_name(path)
            if sharded_dim(s) is None or name in loop_specs or name in split_specs:
                return w
            return gather(w, sharded_dim(s), how[name])

        def loss_of(p):
            used = strip_boxes(jax.tree_util.tree_map_with_path(gather_here, p, param_specs))
            ctx = StepContext(loop_specs, split_specs)
            with active(ctx), intercepting():
                return loss_fn(wrap_tree(ctx, used), batch)

        loss, grads = jax.value_and_grad(loss_of)(params)
        grads = jax.tree.map(
            lambda g, s: jax.lax.pmean(g, axes) if sharded_dim(s) is None else g / n,
            grads, param_specs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axes)

    return body


def _lay_out(x, sharding: NamedSharding):
    """Constrain ``x`` to ``sharding``: ``reshard`` on Explicit meshes, a constraint on Auto ones."""
    if jax.sharding.AxisType.Explicit in tuple(sharding.mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


_DISCOVERED: dict = {}  # (loss_fn, tree structure, shapes) -> discover's answer; the planner compiles
_DISCOVERED_MAX = 32     # several probe steps of one loss, and each would trace it again (~0.5 s)


def _discover_cached(loss_fn, params, batch):
    leaves, treedef = jax.tree.flatten((params, batch))
    key = (loss_fn, treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
    if key not in _DISCOVERED:
        if len(_DISCOVERED) >= _DISCOVERED_MAX:
            _DISCOVERED.pop(next(iter(_DISCOVERED)))
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
        _DISCOVERED[key] = discover(loss_fn, *abstract)
    return _DISCOVERED[key]


def build_step(loss_fn, optimizer, mesh, axes, specs_by_path, in_loop=frozenset(), splits=None,
               two_stage=frozenset()):
    """An un-jitted step ``(params, opt_state, batch) -> (params, opt_state, loss)``.

    ``splits`` maps the paths of split kernels to their slice count k (> 1; sharded kernels
    only); parameters in ``two_stage`` are gathered one mesh axis at a time.
    """
    splits = {p: k for p, k in (splits or {}).items() if k > 1}
    for path in splits:
        if sharded_dim(specs_by_path[path]) is None:
            raise ValueError(f"parameter {path!r} is split but not sharded: only sharded (zero3 or hsdp) "
                             f"kernels can be split")
    how = {path: collective(spec, axes, path in two_stage) for path, spec in specs_by_path.items()}
    split_specs = {path: SplitEntry(sharded_dim(specs_by_path[path]), how[path], k,
                                    axes_size(mesh, how[path].axes), path in in_loop)
                   for path, k in splits.items()}
    loop_specs = {path: (sharded_dim(specs_by_path[path]), how[path]) for path in in_loop
                  if how[path] is not None and path not in splits}

    def step(params, opt_state, batch):
        n = axes_size(mesh, axes)
        check_batch(batch, n)
        # Per-step sharded kernels of dense layers are gathered at the layer, from its input
        # (k = 1 in osdp_jax.split), not before the loss: XLA:CPU's scheduler would otherwise
        # gather them at the start of the step and keep them alive through the layer loops.
        layered, dense = _discover_cached(loss_fn, params, batch)  # layered: stacked kernels
        at_layer = {path: SplitEntry(sharded_dim(specs_by_path[path]), how[path], 1,
                                     axes_size(mesh, how[path].axes), False)
                    for path in dense - layered if path not in split_specs and how.get(path) is not None}
        p_specs = spec_tree(params, specs_by_path)
        o_specs = opt_state_specs(optimizer, opt_state, p_specs)
        in_specs = (p_specs, o_specs, batch_specs(batch, axes))
        # Explicit meshes need inputs already laid out as in_specs (a no-op when they are).
        args = jax.tree.map(lambda x, s: _lay_out(x, NamedSharding(mesh, s)), (params, opt_state, batch),
                            in_specs)
        mapped = jax.shard_map(
            local_step(loss_fn, optimizer, p_specs, axes, n, loop_specs, {**split_specs, **at_layer}, how),
            mesh=mesh,
            in_specs=in_specs, out_specs=(p_specs, o_specs, P()), check_vma=False)
        return mapped(*args)
    return step


def jit_step(step):
    """``jax.jit(step)`` with params and optimizer state donated."""
    return jax.jit(step, donate_argnums=(0, 1))


def make_train_step(loss_fn, optimizer, plan, mesh):
    """A ``jax.jit``-wrapped step ``(params, opt_state, batch) -> (params, opt_state, loss)``.

    ``params`` and ``opt_state`` are donated: use the returned ones. Place them first with
    :func:`osdp_jax.shard` and :func:`osdp_jax.init_opt_state`.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the batch it gets.
      optimizer: an ``optax.GradientTransformation``.
      plan: the :class:`osdp_jax.Plan` the params were sharded with.
      mesh: the mesh the plan was made for.
    """
    step = build_step(loss_fn, optimizer, mesh, plan.axes, plan.specs_by_path, plan.in_loop,
                      plan.splits_by_path, plan.two_stage)
    return jit_step(step)


def abstract_args(optimizer, params, batch, mesh, axes, specs_by_path):
    """``ShapeDtypeStruct`` (params, opt_state, batch) carrying the planned shardings, for lowering.

    Nothing is allocated: the optimizer state comes from ``jax.eval_shape``.
    """
    p_specs = spec_tree(params, specs_by_path)
    opt_state = jax.eval_shape(optimizer.init, params)

    def sds(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return (jax.tree.map(sds, params, p_specs),
            jax.tree.map(sds, opt_state, opt_state_specs(optimizer, opt_state, p_specs)),
            jax.tree.map(sds, batch, batch_specs(batch, axes)))
