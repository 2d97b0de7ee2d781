"""Apply a plan: place parameters (and make a plan first when none is given)."""
from __future__ import annotations

from osdp_jax.planner.pipeline import plan as make_plan
from osdp_jax.runtime.place import place


def shard(params, mesh, plan=None, **plan_kwargs):
    """``params`` placed on ``mesh`` per ``plan`` (a ``Plan`` or ``Layout``): the same tree type back
    (boxes, nnx.State kept).

    Without a plan, one is made with ``osdp_jax.plan(params, mesh, **plan_kwargs)``; without a
    budget either, for the devices' own memory. ``jax.ShapeDtypeStruct`` leaves come back as
    ``ShapeDtypeStruct`` carrying the planned sharding. Arrays are copied, never aliased, so
    donating the result to a train step leaves the caller's arrays intact. On a mesh spanning
    several processes (``jax.distributed``), every process passes the same values.
    """
    if plan is None:
        plan = make_plan(params, mesh, **plan_kwargs)
    elif plan_kwargs:
        raise TypeError(f"pass either a plan or planning arguments, not both: {sorted(plan_kwargs)}")
    return place(params, mesh, plan)
