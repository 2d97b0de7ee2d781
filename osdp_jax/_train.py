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

import dataclasses
import functools
from typing import NamedTuple

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


def _device_index(axes):
    """This device's linear index over the data-parallel ``axes`` (inside shard_map)."""
    return jax.lax.axis_index(axes if len(axes) > 1 else axes[0])


def model_view(loss_fn, param_specs, loop_specs: dict, split_specs: dict, how: dict):
    """``f(params, *args) -> loss_fn(model params, *args)``, per device: the parameters as the model
    sees them inside the step.

    ``loop_specs`` (path -> (dim, Collective)) are the sharded parameters the model gathers
    itself, one layer at a time (``osdp_jax.gather_params``); ``split_specs`` (path ->
    ``SplitEntry``) the kernels its dense layers gather, whole (k = 1) or one slice at a time
    (``osdp_jax.split``); every other sharded parameter is gathered here, before the loss, as
    ``how`` (path -> Collective) says.
    """
    def gather_here(path, w, s):
        name = path_name(path)
        if sharded_dim(s) is None or name in loop_specs or name in split_specs:
            return w
        return gather(w, sharded_dim(s), how[name])

    def run(p, *args, **kwargs):
        used = strip_boxes(jax.tree_util.tree_map_with_path(gather_here, p, param_specs))
        ctx = StepContext(loop_specs, split_specs)
        with active(ctx), intercepting():
            return loss_fn(wrap_tree(ctx, used), *args, **kwargs)

    return run


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What the user's ``loss_fn`` takes and returns (see :func:`make_train_step`)."""

    has_aux: bool = False  # loss_fn returns (loss, aux)
    aux: str = "mean"  # how aux leaves are combined across devices: "mean" or "gather"
    rng: bool = False  # loss_fn takes rng=, a key folded with the device index
    state: bool = False  # loss_fn takes state= (mutable collections) and returns the new state too

    def __post_init__(self):
        if self.aux not in ("mean", "gather"):
            raise ValueError(f"aux must be 'mean' (average floats, sum integers) or 'gather' "
                             f"(concatenate along the leading axis), got {self.aux!r}")

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
                f"if it returns (loss, aux), pass has_aux=True (and state=True if it returns new "
                f"mutable collections)")
        return loss, aux, new_state


def grad_body(loss_fn, param_specs, axes, n: int, loop_specs: dict, split_specs: dict, how: dict,
              options: StepOptions = StepOptions()):
    """The per-device body: gather, loss and gradient, gradient collectives.

    Returns ``(loss, aux, grads, new_state)``: the loss averaged over the devices, the aux combined
    as ``options.aux`` says, replicated gradients averaged with one all-reduce and zero3
    gradients reduce-scattered (by :func:`gather`'s backward pass) and divided by ``n``, and the
    new mutable state averaged over the devices. The optimizer is not applied here: it runs on
    the global arrays (see :func:`build_step`).
    """
    view = model_view(loss_fn, param_specs, loop_specs, split_specs, how)

    def body(params, batch, state, rng):
        if options.rng:
            rng = jax.random.fold_in(rng, _device_index(axes))

        def loss_of(p):
            loss, aux, new_state = options.call(view, p, batch, state, rng)
            return loss, (aux, new_state)

        (loss, (aux, new_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        grads = jax.tree.map(
            lambda g, s: jax.lax.pmean(g, axes) if sharded_dim(s) is None else g / n,
            grads, param_specs)
        aux = jax.tree.map(lambda x: _reduce_out(x, axes, options.aux), aux)
        new_state = jax.tree.map(lambda x: _reduce_out(x, axes, "mean"), new_state)
        return jax.lax.pmean(loss, axes), aux, grads, new_state

    return body


def _lay_out(x, sharding: NamedSharding):
    """Constrain ``x`` to ``sharding``: ``reshard`` on Explicit meshes, a constraint on Auto ones."""
    if jax.sharding.AxisType.Explicit in tuple(sharding.mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


_DISCOVERED: dict = {}  # (loss_fn, tree structure, shapes) -> discover's answer; the planner compiles
_DISCOVERED_MAX = 32     # several probe steps of one loss, and each would trace it again (~0.5 s)


def _discover_cached(loss_fn, params, batch, kwargs=None):
    leaves, treedef = jax.tree.flatten((params, batch, kwargs))
    key = (loss_fn, treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
    if key not in _DISCOVERED:
        if len(_DISCOVERED) >= _DISCOVERED_MAX:
            _DISCOVERED.pop(next(iter(_DISCOVERED)))
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch, kwargs))
        p, b, kw = abstract
        if kw:  # the keyword arguments are traced with the batch
            _DISCOVERED[key] = discover(lambda p_, bk: loss_fn(p_, bk[0], **bk[1]), p, (b, kw))
        else:
            _DISCOVERED[key] = discover(loss_fn, p, b)
    return _DISCOVERED[key]


class _Layout(NamedTuple):
    how: dict
    loop_specs: dict
    split_specs: dict


def _layout(mesh, specs_by_path, in_loop, splits, two_stage, axes) -> _Layout:
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
    return _Layout(how, loop_specs, split_specs)


def _at_layer(loss_fn, params, batch, kwargs, specs_by_path, lay: _Layout, mesh):
    """Per-step sharded kernels of dense layers, gathered at the layer, from its input (k = 1 in
    osdp_jax.split), not before the loss: XLA:CPU's scheduler would otherwise gather them at the
    start of the step and keep them alive through the layer loops."""
    layered, dense = _discover_cached(loss_fn, params, batch, kwargs)  # layered: stacked kernels
    how = lay.how
    at_layer = {path: SplitEntry(sharded_dim(specs_by_path[path]), how[path], 1,
                                 axes_size(mesh, how[path].axes), False)
                for path in dense - layered if path not in lay.split_specs and how.get(path) is not None}
    return {**lay.split_specs, **at_layer}


def _example_kwargs(options: StepOptions, state, rng):
    kwargs = {}
    if options.rng:
        kwargs["rng"] = rng
    if options.state:
        kwargs["state"] = state
    return kwargs


def build_step(loss_fn, optimizer, mesh, axes, specs_by_path, in_loop=frozenset(), splits=None,
               two_stage=frozenset(), options: StepOptions = StepOptions()):
    """An un-jitted step ``(params, opt_state, batch[, state][, rng]) -> (params, opt_state, loss[, aux][, state])``.

    The gradients are computed per device under ``jax.shard_map`` (:func:`grad_body`); the
    optimizer then runs on the global arrays, outside the shard_map, so a transformation that
    reduces across parameters (``optax.clip_by_global_norm``, LAMB's trust ratio) sees whole
    gradients, not one device's shards, and every replica of a replicated parameter and of its
    optimizer state gets bit-identical values (XLA computes replicated elementwise updates the
    same way on every device; the one cross-device sum, the norm, is an all-reduce).

    ``splits`` maps the paths of split kernels to their slice count k (> 1; sharded kernels
    only); parameters in ``two_stage`` are gathered one mesh axis at a time.
    """
    lay = _layout(mesh, specs_by_path, in_loop, splits, two_stage, axes)

    def step(params, opt_state, batch, *extra):
        n = axes_size(mesh, axes)
        check_batch(batch, n)
        extra = list(extra)
        state = extra.pop(0) if options.state else None
        rng = extra.pop(0) if options.rng else None
        if extra:
            raise TypeError(f"the step takes (params, opt_state, batch{', state' if options.state else ''}"
                            f"{', rng' if options.rng else ''}); got {len(extra)} more argument(s)")
        split_specs = _at_layer(loss_fn, params, batch, _example_kwargs(options, state, rng),
                                specs_by_path, lay, mesh)
        p_specs = spec_tree(params, specs_by_path)
        o_specs = opt_state_specs(optimizer, opt_state, p_specs)
        s_specs = jax.tree.map(lambda _: P(), state)
        r_spec = None if rng is None else P()
        in_specs = (p_specs, batch_specs(batch, axes), s_specs, r_spec)
        # Explicit meshes need inputs already laid out as in_specs (a no-op when they are).
        params, opt_state, batch, state = jax.tree.map(
            lambda x, s: _lay_out(x, NamedSharding(mesh, s)), (params, opt_state, batch, state),
            (p_specs, o_specs, in_specs[1], s_specs))
        body = grad_body(loss_fn, p_specs, axes, n, lay.loop_specs, split_specs, lay.how, options)
        aux_spec = P(axis_entry(axes)) if options.aux == "gather" else P()
        mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                               out_specs=(P(), aux_spec, p_specs, P()), check_vma=False)
        loss, aux, grads, new_state = mapped(params, batch, state, rng)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params, opt_state = jax.tree.map(lambda x, s: _lay_out(x, NamedSharding(mesh, s)),
                                         (params, opt_state), (p_specs, o_specs))
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


class TrainStep:
    """A jitted train step that refuses donated (deleted) arrays with a clear error.

    Calling a jitted function with an array that an earlier call donated fails deep inside jax;
    this checks the arguments first. ``lower`` is the jitted function's.
    """

    def __init__(self, jitted, what: str = "train step", batch_size: int | None = None, batch_arg: int = 2):
        self._jitted, self._what, self._batch_size, self._batch_arg = jitted, what, batch_size, batch_arg

    def _check_batch_size(self, args):
        if self._batch_size is None or len(args) <= self._batch_arg:
            return
        got = {getattr(leaf, "shape", (None,))[:1] for leaf in jax.tree.leaves(args[self._batch_arg])}
        if got != {(self._batch_size,)}:
            shown = sorted(str(g[0]) if g else "a scalar" for g in got)
            raise ValueError(
                f"the plan was made for global batch size {self._batch_size}, got a batch of "
                f"{', '.join(shown)}: its memory was not checked against the budget. Re-plan with that "
                f"batch size, or pass any_batch_size=True to make_train_step to run it anyway")

    def __call__(self, *args):
        self._check_batch_size(args)
        for i, tree in enumerate(args[:2]):
            if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree)):
                name = ("params", "opt_state")[i]
                raise ValueError(
                    f"{name} passed to the {self._what} were donated to an earlier call (their buffers are "
                    f"deleted): use the {name} that call returned, e.g. params, opt_state, loss = "
                    f"step(params, opt_state, batch)")
        return self._jitted(*args)

    def lower(self, *args):
        self._check_batch_size(args)
        return self._jitted.lower(*args)

    def __repr__(self):
        return f"<osdp_jax {self._what}>"


def make_train_step(loss_fn, optimizer, plan, mesh, *, has_aux: bool = False, aux: str = "mean",
                    rng: bool = False, state: bool = False, any_batch_size: bool = False):
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
      plan: the :class:`osdp_jax.Plan` the params were sharded with.
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
      any_batch_size: accept a global batch size other than ``plan.batch_size`` (it recompiles,
        and its memory was not checked against the budget). By default such a batch raises a
        ``ValueError`` naming the planned size.
    """
    options = StepOptions(has_aux, aux, rng, state)
    step = build_step(loss_fn, optimizer, mesh, plan.axes, plan.specs_by_path, plan.in_loop,
                      plan.splits_by_path, plan.two_stage, options)
    return TrainStep(jit_step(step), "train step", None if any_batch_size else getattr(plan, "batch_size", None))


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
    lay = _layout(mesh, plan.specs_by_path, plan.in_loop, plan.splits_by_path, plan.two_stage, plan.axes)
    axes = plan.axes

    def evaluate(params, batch, *extra):
        check_batch(batch, axes_size(mesh, axes))
        extra = list(extra)
        st = extra.pop(0) if state else None
        key = extra.pop(0) if rng else None
        kwargs = {**({"state": st} if state else {}), **({"rng": key} if rng else {})}
        split_specs = _at_layer(fn, params, batch, kwargs, plan.specs_by_path, lay, mesh)
        p_specs = spec_tree(params, plan.specs_by_path)
        view = model_view(fn, p_specs, lay.loop_specs, split_specs, lay.how)

        def body(p, b, s, r):
            kw = {}
            if state:
                kw["state"] = s
            if rng:
                kw["rng"] = jax.random.fold_in(r, _device_index(axes))
            return jax.tree.map(lambda x: _reduce_out(x, axes, options.aux), view(p, b, **kw))

        out_spec = P(axis_entry(axes)) if aux == "gather" else P()
        in_specs = (p_specs, batch_specs(batch, axes), jax.tree.map(lambda _: P(), st),
                    None if key is None else P())
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                             check_vma=False)(params, batch, st, key)

    return TrainStep(jax.jit(evaluate), "eval step")


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
