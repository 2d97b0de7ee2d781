"""Units: submodules whose sharded weights are gathered on entry and again in the backward pass.

In a model that runs its blocks as an unrolled Python loop, a ZeRO-3 weight gathered once per
step stays alive from the forward pass through the backward pass, so FSDP saves the optimizer
state but little of the gathered weights. A *unit* is gathered when it is called, and gathered
again when its backward pass runs; in between, only its shard is held. So at most about two
units' gathered weights are alive at a time (``runtime.units``), for one more all-gather of the
unit's weights per step. Models need no change:

- **Flax linen**: every submodule call is seen through Flax's ``nn.intercept_methods``; the plan
  names the units by module path (``"block_3"``, ``"encoder/layers_0"``).
- **Flax nnx**: :func:`mark` the model once, after building it (the chosen submodules' class is
  swapped for a subclass whose ``__call__`` is the unit's, as PyTorch FSDP2's ``fully_shard`` does).
- **plain JAX**: decorate a function of ``(params, *inputs)`` with :func:`unit`.

Which submodules are units (``osdp_jax.planner.unit_policy``): by default the model's layer list (linen
submodules named ``<name>_<number>`` with a sibling of the same name, nnx modules in a list), and,
in a model without layer stacks, any other submodule holding at least 1/8 of the parameter
bytes; the outermost of nested ones.
``osdp_jax.plan(..., units=["blocks_*"])`` names them by ``fnmatch`` patterns instead, and
``units=()`` turns them off. :func:`find` shows what the policy picks.

    plan = osdp_jax.plan(params, mesh, "8GB", loss_fn=loss_fn, batch=batch)   # linen: nothing to add
    model = osdp_jax.units.mark(nnx_model)                                     # nnx, before nnx.split

    @osdp_jax.units.unit
    def block(p, x):                                                            # plain JAX
        return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]

Outside an osdp-jax step, every unit is a plain call.
"""
from __future__ import annotations

import functools
import types

import jax
from flax import nnx

from osdp_jax.core.describe import describe
from osdp_jax.planner.discover import find as discover
from osdp_jax.planner.unit_policy import DEFAULT_SHARE, choose, from_found
from osdp_jax.runtime import units as _runtime
from osdp_jax.runtime.context import ACTIVE

__all__ = ["DEFAULT_SHARE", "find", "mark", "unit"]


def unit(fn):
    """``fn(params, *inputs)`` as a unit: under a plan that gathers some of ``params`` at it, they
    are gathered on each call and again in its backward pass. ``params`` is the pytree of the
    unit's parameters exactly as they come from the params given to the loss."""

    @functools.wraps(fn)
    def wrapped(params, *args, **kwargs):
        return _runtime.call("function", None, params, _runtime.shared(fn, fn), *args, **kwargs)

    wrapped.__osdp_unit__ = True
    return wrapped


_CLASSES: dict = {}


def _unit_class(cls):
    """``cls`` with a ``__call__`` that runs each call as a unit (cached per class)."""
    if getattr(cls, "__osdp_unit__", False):
        return cls
    if cls not in _CLASSES:
        def __call__(self, *args, **kwargs):
            ctx = ACTIVE.get()
            if ctx is None or ctx.in_unit:
                return cls.__call__(self, *args, **kwargs)
            graphdef, state = nnx.split(self)
            if not jax.tree.leaves(nnx.state(self, nnx.Not(nnx.Param))):
                return _runtime.call("nnx", None, state, _runtime.shared(
                    (cls, graphdef), lambda st, *a, **kw: cls.__call__(nnx.merge(graphdef, st), *a, **kw)),
                                     *args, **kwargs)

            def run(st, *a, **kw):  # other state (batch statistics) leaves the unit as an output
                module = nnx.merge(graphdef, st)  # new variables, at this trace level
                return cls.__call__(module, *a, **kw), nnx.as_pure(nnx.state(module, nnx.Not(nnx.Param)))
            out, other = _runtime.call("nnx", None, nnx.as_pure(state), _runtime.shared((cls, graphdef, "state"), run),
                                       *args, **kwargs)
            nnx.update(self, other)
            return out

        def body(ns):
            ns.update(__call__=__call__, __osdp_unit__=True, __module__=cls.__module__, __qualname__=cls.__qualname__)
        _CLASSES[cls] = types.new_class(cls.__name__, (cls,), exec_body=body)
    return _CLASSES[cls]


def mark(model, units=None, *, share: float = DEFAULT_SHARE):
    """Mark an nnx model's units, in place, and return the model.

    ``units``: ``fnmatch`` patterns of submodule paths (``"blocks/*"``); by default the policy of
    the module docstring (modules in a list or numbered like ``layer_3``, and modules holding at
    least ``share`` of the parameter bytes). A unit's other state (``nnx.BatchStat``) leaves each
    call as an output and is written back into the module (``nnx.update``), as if it had run in
    place. Call it before ``nnx.split``: the graph definition then carries the marked classes."""
    if not isinstance(model, nnx.Module):
        raise TypeError(f"osdp_jax.units.mark takes a flax nnx Module, got {type(model).__name__}; linen "
                        f"modules need no marking, and plain functions take the @osdp_jax.units.unit decorator")
    modules = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and path and type(node).__call__ is not nnx.Module.__call__:
            modules["/".join(map(str, path))] = node
    params = {i.path: i.nbytes for i in describe(nnx.state(model, nnx.Param))}
    calls = []
    for name, node in modules.items():
        paths = [p for p in params if p.startswith(name + "/")]
        if paths:
            calls.append(("linen", name, tuple(paths)))  # chosen by the linen rules: path names
    chosen = set(choose(calls, params, units, share).values())
    for name in chosen:
        node = modules[name]
        node.__class__ = _unit_class(type(node))
    return model


def find(loss_fn, params, batch, units=None, *, share: float = DEFAULT_SHARE) -> dict[str, str]:
    """Parameter path -> unit, as ``osdp_jax.plan`` would choose them for ``loss_fn`` (traced once,
    abstractly; ``params`` and ``batch`` may be abstract). ``units``: patterns, as in
    :func:`mark`; None: the default policy."""
    return from_found(discover(loss_fn, params, batch), describe(params), units, share)
