"""Units: submodules whose sharded weights are gathered on entry and again in the backward pass.

In a model that runs its blocks as an unrolled Python loop, a ZeRO-3 weight gathered once per
step stays alive from the forward pass through the backward pass, so FSDP saves the optimizer
state but little of the gathered weights. A *unit* is gathered when it is called, and gathered
again when its backward pass runs; in between, only its shard is held. So at most about two
units' gathered weights are alive at a time (``runtime.units``), for one more all-gather of the
unit's weights per step. Models need no change:

- **Flax linen**: every submodule call is seen through Flax's ``nn.intercept_methods``; the plan
  names the units by module path (``"block_3"``, ``"encoder/layers_0"``).
- **Flax nnx** and **Equinox**: :func:`mark` the model once, after building it (the chosen
  submodules' class is swapped for a subclass whose ``__call__`` is the unit's, as PyTorch FSDP2's
  ``fully_shard`` does).
- **plain JAX**: decorate a function of ``(params, *inputs)`` with :func:`unit`.

Which submodules are units (``osdp_jax.planner.unit_policy``): by default the model's layer list (linen
submodules named ``<name>_<number>`` with a sibling of the same name, nnx modules in a list), and,
in a model without layer stacks, any other submodule holding at least 1/8 of the parameter
bytes; the outermost of nested ones.
``osdp_jax.plan(..., units=["blocks_*"])`` names them by ``fnmatch`` patterns instead, and
``units=()`` turns them off. :func:`find` shows what the policy picks.

    plan = osdp_jax.plan(params, mesh, "8GB", loss_fn=loss_fn, batch=batch)   # linen: nothing to add
    model = osdp_jax.units.mark(nnx_model)                                     # nnx, before nnx.split
    model = osdp_jax.units.mark(eqx_model)                                     # Equinox, before eqx.partition

    @osdp_jax.units.unit
    def block(p, x):                                                            # plain JAX
        return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]

Outside an osdp-jax step, every unit is a plain call.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import types

import jax
from flax import nnx

from osdp_jax.core.describe import describe
from osdp_jax.planner.discover import find as discover
from osdp_jax.planner.unit_policy import DEFAULT_SHARE, choose, from_found
from osdp_jax.runtime import units as _runtime
from osdp_jax.runtime.context import ACTIVE, SplitKernel

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
    """Mark an nnx or Equinox model's units, in place, and return the model.

    ``units``: ``fnmatch`` patterns of submodule paths (``"blocks/*"``); by default the policy of
    the module docstring (modules in a list or numbered like ``layer_3``, and modules holding at
    least ``share`` of the parameter bytes). Each chosen submodule's class is swapped for a
    subclass whose ``__call__`` runs as a unit; outside an osdp-jax step it is a plain call.

    - **nnx**: call it before ``nnx.split``, so the graph definition carries the marked classes. A
      unit's other state (``nnx.BatchStat``) leaves each call as an output and is written back into
      the module (``nnx.update``), as if it had run in place.
    - **Equinox**: call it before ``eqx.partition``; the static part then carries the marked
      classes. Parameter paths are unchanged (``blocks/0/linear/weight``).

    Raises:
      TypeError: ``model`` is neither an ``nnx.Module`` nor an ``eqx.Module``.
    """
    if _is_eqx_module(model):
        modules, params = _eqx_modules(model), {i.path: i.nbytes for i in describe(_eqx_arrays(model))}
        swap = _eqx_unit_class
    elif isinstance(model, nnx.Module):
        modules = {}
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Module) and path and type(node).__call__ is not nnx.Module.__call__:
                modules["/".join(map(str, path))] = node
        params, swap = {i.path: i.nbytes for i in describe(nnx.state(model, nnx.Param))}, _unit_class
    else:
        raise TypeError(f"osdp_jax.units.mark takes a flax nnx Module or an Equinox Module, got "
                        f"{type(model).__name__}; linen modules need no marking, and plain functions take the "
                        f"@osdp_jax.units.unit decorator")
    calls = []
    for name in modules:
        paths = [p for p in params if p.startswith(name + "/")]
        if paths:
            calls.append(("linen", name, tuple(paths)))  # chosen by the linen rules: path names
    for name in set(choose(calls, params, units, share).values()):
        node = modules[name]
        object.__setattr__(node, "__class__", swap(type(node)))  # Equinox modules are frozen dataclasses
    return model


def _is_eqx_module(model) -> bool:
    eqx = sys.modules.get("equinox")  # an Equinox model means Equinox is imported
    return eqx is not None and isinstance(model, eqx.Module)


def _eqx_arrays(model):
    """The floating-point arrays of an Equinox model, as ``eqx.partition(model, eqx.is_inexact_array)`` gives them."""
    import equinox as eqx
    return eqx.filter(model, eqx.is_inexact_array)


def _eqx_modules(model, prefix: str = "") -> dict:
    """Path -> submodule with a ``__call__`` of its own, for every Equinox module under ``model``
    (fields, and the items of lists, tuples and dicts), paths as ``osdp_jax.describe`` names them."""
    import equinox as eqx
    found = {}

    def walk(node, path):
        if isinstance(node, eqx.Module):
            if path and callable(getattr(type(node), "__call__", None)):
                found[path] = node
            for field in dataclasses.fields(node):
                walk(getattr(node, field.name, None), f"{path}/{field.name}" if path else field.name)
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                walk(item, f"{path}/{i}" if path else str(i))
        elif isinstance(node, dict):
            for key, item in node.items():
                walk(item, f"{path}/{key}" if path else str(key))

    walk(model, prefix)
    return found


def _eqx_unit_class(cls):
    """``cls`` (an ``eqx.Module``) with a ``__call__`` that runs each call as a unit: the module's
    arrays are the unit's parameters, its other fields stay static (cached per class)."""
    if getattr(cls, "__osdp_unit__", False):
        return cls
    if cls not in _CLASSES:
        import equinox as eqx

        def is_param(x) -> bool:
            return isinstance(x, SplitKernel) or eqx.is_array(x)

        def __call__(self, *args, **kwargs):
            ctx = ACTIVE.get()
            if ctx is None or ctx.in_unit:
                return cls.__call__(self, *args, **kwargs)
            arrays, static = eqx.partition(self, is_param)

            def run(tree, *a, **kw):
                return cls.__call__(eqx.combine(tree, static), *a, **kw)
            return _runtime.call("eqx", None, arrays, _runtime.shared((cls, static), run), *args, **kwargs)

        def body(ns):
            ns.update(__call__=__call__, __osdp_unit__=True, __module__=cls.__module__, __qualname__=cls.__qualname__)
        _CLASSES[cls] = types.new_class(cls.__name__, (cls,), exec_body=body)
    return _CLASSES[cls]


def find(loss_fn, params, batch, units=None, *, share: float = DEFAULT_SHARE) -> dict[str, str]:
    """Parameter path -> unit, as ``osdp_jax.plan`` would choose them for ``loss_fn`` (traced once,
    abstractly; ``params`` and ``batch`` may be abstract). ``units``: patterns, as in
    :func:`mark`; None: the default policy."""
    return from_found(discover(loss_fn, params, batch), describe(params), units, share)
