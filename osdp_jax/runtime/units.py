"""Units: a submodule or function whose sharded weights are gathered on entry, and again in the
backward pass, instead of once per step.

Inside an osdp-jax step a ZeRO-3/HSDP parameter that the plan gathers at a unit reaches the model
as a ``SplitKernel`` with k = 1 (this device's shard with the whole shape; any use outside a unit
gathers it there and then). A *unit call* runs ``fn(tree, *args)`` as::

    jax.checkpoint(gather the unit's shards, then fn; policy=Layout.unit_remat)

and the gathered weights are never saved for the backward pass, under any policy: they live only
while the unit runs forward, and again while it runs backward (gathered a second time, then the
gradient reduce-scattered). With the default policy, ``"full"``, the backward pass also runs the
unit's forward pass again and nothing but its inputs is kept (FSDP with activation
checkpointing); :func:`policy` gives the others.

XLA:CPU drops optimization barriers before it eliminates common subexpressions, so in straight-line
code the backward gather would merge with the forward one and the weights would stay alive
through the step. The unit therefore runs inside a ``lax.cond`` whose predicate is always true
(the device index is at least 0) but which XLA cannot fold: a conditional's branches are separate
computations, so nothing is hoisted out of them or merged across them
(``experiments/benchmarks/units_memory.py`` measures both). For a unit of p bytes over N devices on a
ring of W bytes/s: 2 all-gathers and 1 reduce-scatter, 3 (N-1)/N p / W seconds per call, against
2 (N-1)/N p / W for a weight gathered once per step and kept.

Three kinds of call sites reach :func:`call`:

- Flax linen module methods, through ``nn.intercept_methods`` (``runtime.interception``): a module
  is a unit when the plan names its path (``Plan.units``);
- Flax nnx modules marked with ``osdp_jax.units.mark`` (their class is swapped for a subclass whose
  ``__call__`` comes here, as FSDP2's ``fully_shard`` does);
- functions decorated with ``osdp_jax.units.unit`` (plain JAX), whose first argument is the
  unit's parameters.

The calls of nnx units of one graph definition, and of one decorated function, are traced once
per step (:func:`shared`).

While the planner discovers a model (``StepContext.recording``), each call is recorded with the
paths of the parameters it holds (``StepContext.recorded_units``) and, once it has run, the
activations its backward pass would keep (:func:`measure`); nothing changes.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from osdp_jax.core.describe import common_prefix, path_name
from osdp_jax.core.stack import GATHERED_NAME, remat_policy
from osdp_jax.runtime.collectives import gather
from osdp_jax.runtime.context import ACTIVE, SplitKernel

log = logging.getLogger("osdp_jax")


def policy(remat: str):
    """What a unit saves for its backward pass, by remat policy: ``"full"`` nothing but its inputs
    (the forward pass runs again), ``"dots"`` the outputs of matmuls without batch dimensions,
    ``"none"`` everything but the gathered weights. ``"none"`` keeps every block's element-wise
    intermediates, which XLA cannot fuse into the backward pass across the unit's conditional
    (``experiments/benchmarks/units_memory.py`` measures each policy)."""
    return remat_policy(remat)


def _is_array(x) -> bool:
    return isinstance(x, jax.Array) or hasattr(x, "aval")


def _inputs(args, kwargs, keep=lambda x: True):
    """A call's array arguments that ``keep`` accepts, as a list, and ``given(xs) -> (args,
    kwargs)`` putting values in their places (the other arguments as they were)."""
    flat, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(flat) if _is_array(x) and keep(x)]

    def given(xs):
        new = list(flat)
        for i, x in zip(dynamic, xs):
            new[i] = x
        return jax.tree.unflatten(treedef, new)
    return [flat[i] for i in dynamic], given


def record(kind: str, name: str | None, tree) -> str | None:
    """During discovery, note a possible unit: call site ``name`` of ``kind`` ("linen", "nnx" or
    "function"; None: named by the longest path prefix its parameters share) and the paths of
    the parameters in ``tree``. Returns the site's name (None when not recording)."""
    ctx = ACTIVE.get()
    if ctx is None or not ctx.recording:
        return None
    paths = tuple(dict.fromkeys(p for p in (ctx.lookup(x) for x in jax.tree.leaves(tree)) if p is not None))
    if not paths:
        return None
    name = name or common_prefix(paths)
    ctx.recorded_units.append((kind, name, paths))
    return name


def record_hidden(name: str, tree) -> None:
    """During discovery, note a linen call site ``name`` whose parameters ``tree`` are not the
    params themselves but are shaped as the params at its path: values a Flax lifted transform of
    the model's own (``nn.remat``, ``nn.vmap``) made of them, which no unit can gather."""
    ctx = ACTIVE.get()
    if ctx is None or not ctx.recording:
        return
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if flat and all(ctx.param_shapes.get(f"{name}/{path_name(p)}") == tuple(jnp.shape(x)) for p, x in flat):
        ctx.recorded_hidden.append(name)


def measure(name: str | None, tree, fn, args, kwargs) -> None:
    """During discovery, after the call ``fn(tree, *args, **kwargs)`` of a possible unit ``name``
    ran (and recorded what it holds), add its saved activations (:func:`saved_bytes`) to the
    site's figure (``StepContext.recorded_saved``; None when ``jax.vjp`` cannot trace the call).
    A call holding a layer stack's parameters is not measured: no unit gathers those."""
    ctx = ACTIVE.get()
    if name is None or ctx is None or not ctx.recording:
        return
    if any(ctx.lookup(x) in ctx.recorded_loop for x in jax.tree.leaves(tree)):
        return
    token = ACTIVE.set(None)  # traced as plain JAX: nothing recorded twice, no hook in the way
    try:
        saved = saved_bytes(fn, tree, args, kwargs)
    except Exception as e:  # noqa: BLE001 - a call jax.vjp cannot trace: no figure (bytes are used)
        log.info("unit %s: no activation figure (%s: %s)", name, type(e).__name__, e)
        saved = None
    finally:
        ACTIVE.reset(token)
    had = ctx.recorded_saved.get(name, 0)
    ctx.recorded_saved[name] = None if saved is None or had is None else had + saved


def saved_bytes(fn, tree, args, kwargs) -> int:
    """Bytes of the values the backward pass of ``fn(tree, *args, **kwargs)`` keeps from its
    forward pass, other than its inputs: the residuals of ``jax.vjp`` with respect to ``tree`` and
    the floating-point arguments, traced abstractly (nothing runs). They are what a unit call
    under full remat does not keep (it keeps its inputs and runs its forward pass again), before
    XLA fuses any of them away: the planner uses them only to share a measured saving out among
    units (``_cost``)."""
    xs, given = _inputs(args, kwargs, lambda x: jnp.issubdtype(x.dtype, jnp.inexact))

    def f(t, xs):
        a, kw = given(xs)
        return fn(t, *a, **kw)

    primals = (tree, xs)
    _, pullback = jax.vjp(f, *primals)
    inputs = {id(x) for x in jax.tree.leaves(primals)}
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pullback)
                   if _is_array(x) and id(x) not in inputs))


def call(kind: str, name: str | None, tree, fn, *args, **kwargs):
    """``fn(tree, *args, **kwargs)``, as unit ``name`` (None: any unit) when the plan gathers some
    of ``tree``'s parameters there (module docstring); else a plain call. While discovering, the
    call is recorded (:func:`record`) and runs plainly."""
    ctx = ACTIVE.get()
    if ctx is None or ctx.in_unit:
        return fn(tree, *args, **kwargs)
    if ctx.recording:
        site = record(kind, name, tree)
        out = fn(tree, *args, **kwargs)
        measure(site, tree, fn, args, kwargs)
        return out
    leaves, treedef = jax.tree.flatten(tree)
    mine = [i for i, x in enumerate(leaves) if isinstance(x, SplitKernel) and x.path in ctx.units
            and (name is None or ctx.units[x.path] == name)]
    if not mine:
        return fn(tree, *args, **kwargs)
    inputs, given = _inputs(args, kwargs)
    kernels = [leaves[i] for i in mine]

    def inner(shards, inputs):
        new = list(leaves)
        for i, k, s in zip(mine, kernels, shards):
            new[i] = checkpoint_name(gather(s, k.spec.dim, k.spec.how), GATHERED_NAME)
        a, kw = given(inputs)
        ctx.in_unit = True
        try:
            return fn(jax.tree.unflatten(treedef, new), *a, **kw)
        finally:
            ctx.in_unit = False

    shards = [k.shard for k in kernels]
    # the unit traced once: the conditional's branch replays its jaxpr (one checkpoint equation),
    # where tracing ``run`` again for its output shapes would run the model's Python a second time
    traced, out = jax.make_jaxpr(jax.checkpoint(inner, policy=policy(ctx.unit_remat)), return_shape=True)(
        shards, inputs)
    replay = jax.extend.core.jaxpr_as_fun(traced)

    def run(shards, inputs):
        return jax.tree.unflatten(jax.tree.structure(out), replay(*jax.tree.leaves((shards, inputs))))
    axes = kernels[0].spec.how.axes
    always = jax.lax.axis_index(axes if len(axes) > 1 else axes[0]) >= 0
    return jax.lax.cond(always, run, lambda *_: jax.tree.map(lambda o: jax.lax.full(o.shape, 0, o.dtype), out),
                        shards, inputs)  # (lax.full: PRNG key outputs too, an nnx unit's rng state)


def shared(key, fn):
    """``fn(tree, *args, **kwargs)`` as a unit's call site runs it, traced once per step for all
    the calls of one ``key`` (e.g. an nnx block's class and graph definition) with arguments of the
    same shapes: an inner ``jax.jit``, kept in the step's context (so a trace never outlives the
    step that made it), whose trace and whose derivatives' JAX then reuses at the next such call.
    XLA inlines the call: under the default unit remat ("full") the compiled step's figures are
    those of the calls traced one by one; under "dots" and "none" JAX's remat saves a little
    differently inside the inner jit (README, *Units*). Plain calls while discovering, when an
    argument is not an array (a split kernel, a Python number), and when ``key`` cannot be hashed."""

    def call(tree, *args, **kwargs):
        ctx = ACTIVE.get()
        if ctx is None or ctx.recording or not all(isinstance(x, jax.Array) for x in jax.tree.leaves((tree, args,
                                                                                                      kwargs))):
            return fn(tree, *args, **kwargs)
        try:
            jitted = ctx.shared.get(key)
        except TypeError:  # a key that cannot be hashed (a graph definition holding an array): not shared
            return fn(tree, *args, **kwargs)
        if jitted is None:
            jitted = ctx.shared[key] = jax.jit(fn)
        return jitted(tree, *args, **kwargs)
    return call
