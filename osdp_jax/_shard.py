"""Apply a plan: place parameters and optimizer state on the mesh."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ._describe import describe
from ._plan import Plan
from ._train import opt_state_specs, spec_tree


def shard(params, mesh, plan: Plan | None = None, **plan_kwargs):
    """``params`` placed on ``mesh`` per ``plan``: the same tree type back (boxes, nnx.State kept).

    Without a plan, one is made with ``osdp_jax.plan(params, mesh, **plan_kwargs)``; without a
    budget either, for the devices' own memory. ``jax.ShapeDtypeStruct`` leaves come back as
    ``ShapeDtypeStruct`` carrying the planned sharding. Arrays are copied, never aliased, so
    donating the result to a train step leaves the caller's arrays intact. On a mesh spanning
    several processes (``jax.distributed``), every process passes the same values.
    """
    if plan is None:
        from ._planner import plan as make_plan
        plan = make_plan(params, mesh, **plan_kwargs)
    elif plan_kwargs:
        raise TypeError(f"pass either a plan or planning arguments, not both: {sorted(plan_kwargs)}")
    plan.check_matches(describe(params))
    specs = spec_tree(params, plan.specs_by_path)

    def place(x, spec):
        sharding = NamedSharding(mesh, spec)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if not sharding.is_fully_addressable:
            # a mesh over several processes (jax.distributed): every process holds the same
            # whole value and places the shards of its own devices
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        if isinstance(x, jax.Array):
            # device_put may hand back the caller's buffer as one of the shards (even with
            # may_alias=False in jax 0.10), and the train step donates it: copy first.
            x = jnp.copy(x)
        return jax.device_put(x, sharding)

    return jax.tree.map(place, params, specs)


def init_opt_state(optimizer, params, plan: Plan, mesh):
    """``optimizer.init(params)`` with each state leaf sharded like its parameter.

    The state is created directly in place (``jit`` with ``out_shardings``), never gathered.
    """
    abstract = jax.eval_shape(optimizer.init, params)
    specs = opt_state_specs(optimizer, abstract, spec_tree(params, plan.specs_by_path))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def abstract_state(params, plan: Plan, mesh, optimizer=None):
    """``(params, opt_state)`` as ``jax.ShapeDtypeStruct`` trees carrying the planned shardings.

    These are the targets orbax restores onto (``ocp.args.StandardRestore(target)``), so a
    checkpoint written under any mesh or plan comes back laid out as ``plan`` says on ``mesh``;
    nothing is allocated. ``params`` may be arrays or ``ShapeDtypeStruct``s (any tree type);
    ``opt_state`` is None without an ``optimizer``.
    """
    plan.check_matches(describe(params))
    p_specs = spec_tree(params, plan.specs_by_path)

    def sds(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    params_t = jax.tree.map(sds, abstract, p_specs)
    if optimizer is None:
        return params_t, None
    opt_state = jax.eval_shape(optimizer.init, abstract)
    return params_t, jax.tree.map(sds, opt_state, opt_state_specs(optimizer, opt_state, p_specs))
