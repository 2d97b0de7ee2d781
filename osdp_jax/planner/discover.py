"""Discovery: which parameters a loss function runs as layer stacks, and which reach dense layers.

The planner traces the loss once, abstractly, with the step context in recording mode: the
parameters each ``osdp_jax.layers.scan`` call runs are noted as one stack (gathered per layer,
inside the loop), and every 2-D kernel that reaches a dense layer (``osdp_jax.split.dense``, or
an intercepted Flax ``Dense``/``nnx.Linear``) as a dense kernel; every call that could be a unit
(``osdp_jax.units``) with the parameters it holds. Nothing is compiled or allocated.

The same trace gives the loss a *fingerprint* (:func:`fingerprint`): a digest of its jaxpr's text
(every equation, with its shapes and literal values), its constants' shapes and dtypes (and the
values of those up to :data:`CONST_BYTES`), where its custom differentiation rules are defined
(the text names them only), the structure of what it returns, and what discovery found. Two loss functions with
the same fingerprint compile to the same probe steps, so the planner keys its probe cache by it,
not by the function object: a loss written again as a new ``lambda`` (a notebook cell run again,
a loop over budgets) finds the probes compiled for the old one.
"""
from __future__ import annotations

import collections
import hashlib
import logging
from typing import NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from osdp_jax.core.compat import scan_operand_counts
from osdp_jax.core.describe import flat_params, strip_boxes
from osdp_jax.runtime.context import StepContext, active
from osdp_jax.runtime.hooks import wrap_tree
from osdp_jax.runtime.interception import intercepting


class Found(NamedTuple):
    in_loop: set  # paths of stacked parameters (run by layers.scan, or by the model's own scans: model_loop)
    dense: set  # paths of kernels that reach a dense layer
    stacks: tuple  # per layers.scan call, then per scan of the model's own, the paths of its parameters
    units: tuple = ()  # possible units (runtime.units): (kind, name, parameter paths) per call
    saved: dict = {}  # per possible unit, the activation bytes its calls save (runtime.units.saved_bytes)
    fingerprint: str = ""  # the loss's (:func:`fingerprint`)
    model_loop: frozenset = frozenset()  # paths of stacked parameters a jax.lax.scan of the model's own slices
    dense_order: tuple = ()  # the kernels of ``dense``, in the order their dense layers are first called
    dense_inputs: dict = {}  # kernel path -> the shape of its dense layer's input (first call)


log = logging.getLogger("osdp_jax")

CONST_BYTES = 1 << 20  # constants up to this size are fingerprinted by value too; larger ones by shape


def fingerprint(closed_jaxpr, *found) -> str:
    """A hex digest of the traced loss ``closed_jaxpr`` and of ``found``, the structure of what it
    returns and what discovery found in it: equal for two functions that trace to the same
    equations on the same shapes and return the same structure (constants larger than
    :data:`CONST_BYTES` are compared by shape and dtype only: XLA's memory and FLOP figures do not
    depend on their values)."""
    h = hashlib.sha256(str(closed_jaxpr.jaxpr).encode())
    for c in closed_jaxpr.consts:
        shape, dtype = np.shape(c), c.dtype if hasattr(c, "dtype") else np.asarray(c).dtype
        h.update(f"|{shape}{dtype}".encode())
        if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and np.size(c) * dtype.itemsize <= CONST_BYTES:
            h.update(np.ascontiguousarray(np.asarray(c)).tobytes())
    for rule in _rules(closed_jaxpr.jaxpr):
        h.update(f"|{rule}".encode())
    h.update(repr(found).encode())
    return h.hexdigest()


def _rules(jaxpr):
    """Where the functions an equation carries besides its jaxprs come from (a ``custom_vjp``'s
    forward and backward rules, a ``custom_jvp``'s rule: the text names them only), in order,
    through every nested jaxpr."""
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for x in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(x, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                    yield from _rules(x.jaxpr if isinstance(x, jcore.ClosedJaxpr) else x)
                elif (info := getattr(x, "debug_info", None)) is not None:
                    yield getattr(info, "func_src_info", None)


def _signature(tree) -> tuple:
    """Tree structure, shapes and dtypes (not shardings: abstract and placed arguments trace alike)."""
    leaves, treedef = jax.tree.flatten(tree)
    return str(treedef), tuple((tuple(np.shape(x)), str(x.dtype)) for x in leaves)


def find(loss_fn, params, batch) -> Found:
    """What tracing ``loss_fn`` once, abstractly, shows (``params`` and ``batch`` may be abstract).

    Kept in the process for the same function object and argument shapes (``_FOUND``, the last
    :data:`KEEP_FOUND`), as ``jax.jit`` keeps a trace: planning the loss again (another budget,
    a sweep) does not trace it again. ``planning.clear_probe_cache``
    forgets them."""
    try:
        key = (loss_fn, _signature(params), _signature(batch))
        hash(key)
    except (TypeError, AttributeError):  # an unhashable loss function, a leaf without a dtype: traced every time
        key = None
    if key is not None and key in _FOUND:
        _FOUND.move_to_end(key)
        return _FOUND[key]
    found = _find(loss_fn, params, batch)
    if key is not None:
        _FOUND[key] = found
        while len(_FOUND) > KEEP_FOUND:
            _FOUND.popitem(last=False)
    return found


_FOUND: "collections.OrderedDict" = collections.OrderedDict()
KEEP_FOUND = 16


def clear_found() -> None:
    """Forget what :func:`find` kept."""
    _FOUND.clear()


def _find(loss_fn, params, batch) -> Found:
    ctx = StepContext(recording=True)

    def traced(p, b):
        p = wrap_tree(ctx, strip_boxes(p))
        with intercepting():
            return loss_fn(p, b)

    with active(ctx):
        # a fresh function each time: tracing caches by function, and a cached trace would not
        # call the hooks again
        closed, out = jax.make_jaxpr(traced, return_shape=True)(params, batch)
    stacks = tuple(dict.fromkeys(s for s in ctx.recorded_stacks if s))  # a stack run twice is one
    found = (sorted(ctx.recorded_loop), sorted(ctx.recorded_split), stacks, tuple(ctx.recorded_units),
             sorted(ctx.recorded_saved.items(), key=repr))
    model_stacks = _model_stacks(closed.jaxpr, params, set(ctx.recorded_loop))
    model_loop = frozenset(p for stack in model_stacks for p in stack)
    looped = looped_params(closed.jaxpr, list(flat_params(params))) - set(ctx.recorded_loop) - model_loop
    if looped:
        names = sorted(looped)
        log.warning(
            "osdp_jax: %d parameter(s) are sliced per iteration by a loop of the model's own that is not a "
            "jax.lax.scan over them (params[i] in a loop, or a scan over a cast or reshaped copy), e.g. %s: "
            "osdp-jax plans them as ordinary parameters, so a sharded one is gathered whole once per step, "
            "before the loop, every slice at once. Pass the stacked parameters unchanged to jax.lax.scan "
            "(Flax nn.scan, nnx.scan), or run them with osdp_jax.layers.scan, to gather one layer at a time "
            "and plan per layer", len(names), ", ".join(names[:3]))
    units = {name for _, name, _ in ctx.recorded_units}
    hidden = sorted(set(ctx.recorded_hidden) - units)
    hidden = [h for h in hidden if not any(h.startswith(o + "/") for o in hidden)]  # the outermost
    if hidden:
        log.warning(
            "osdp_jax: %d submodule(s) get their parameters through a transform of the model's own (a Flax "
            "lifted transform such as nn.remat or nn.vmap, or jax.checkpoint or jax.vmap around the model's "
            "apply), e.g. %s: they cannot be units (gathered at each call), so a sharded "
            "weight of theirs is gathered once per step. A unit already runs under jax.checkpoint (plan(unit_remat=), "
            "\"full\" by default, as nn.remat): drop the transform around them to let the planner make them units",
            len(hidden), ", ".join(hidden[:3]))
    return Found(set(ctx.recorded_loop) | model_loop, ctx.recorded_split, stacks + model_stacks,
                 tuple(ctx.recorded_units), dict(ctx.recorded_saved),
                 fingerprint(closed, jax.tree.structure(out), *found, model_stacks), model_loop,
                 tuple(ctx.recorded_dense), dict(ctx.recorded_inputs))


def _model_stacks(jaxpr, params, taken: set) -> tuple[tuple[str, ...], ...]:
    """The stacks the model's own scans run (:func:`scanned_params`): each scan's stacked
    parameters (two dimensions at least) not already run by ``osdp_jax.layers.scan`` (``taken``)
    or by an earlier scan."""
    shapes = {path: np.shape(x) for path, x in flat_params(params).items()}
    out = []
    for stack in scanned_params(jaxpr, list(shapes)):
        mine = tuple(p for p in stack if len(shapes[p]) >= 2 and p not in taken)
        taken.update(mine)
        if mine:
            out.append(mine)
    return tuple(out)


_PASS_THROUGH = {"convert_element_type", "copy", "copy_p", "reshape", "squeeze", "expand_dims", "transpose"}
_LOOPS = {"scan", "while"}


def scanned_params(jaxpr, paths) -> list[tuple[str, ...]]:
    """Per ``scan`` equation, the paths of the parameters (the first ``len(paths)`` inputs of
    ``jaxpr``) it takes unchanged as per-iteration operands (``xs``), at the top level or inside
    ``jit`` and ``remat`` equations that take them in order: the stacks ``runtime.model_loops``
    runs per iteration."""
    found: list[tuple[str, ...]] = []

    def walk(j, alias: dict):
        for eqn in j.eqns:
            ins = [alias.get(v) if not isinstance(v, jcore.Literal) else None for v in eqn.invars]
            if eqn.primitive.name == "scan":
                stack = tuple(dict.fromkeys(p for p in ins[sum(scan_operand_counts(eqn.params)):] if p is not None))
                if stack:
                    found.append(stack)
                continue
            for key in ("jaxpr", "call_jaxpr"):
                sub = eqn.params.get(key)
                inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                if isinstance(inner, jcore.Jaxpr) and len(inner.invars) == len(eqn.invars):
                    walk(inner, {b: p for b, p in zip(inner.invars, ins) if p is not None})

    walk(jaxpr, {v: p for v, p in zip(jaxpr.invars, paths)})
    return found


def model_loops(loss_fn, params, batch) -> set[str]:
    """Paths of the stacked parameters ``loss_fn`` slices per iteration with a ``jax.lax.scan`` of
    its own (Flax ``nn.scan``, ``nnx.scan``), passed to it unchanged: the ``model_loop`` parameters
    of a layout (``Layout.from_specs(model_loop=)``), gathered one layer at a time inside the
    model's loop. Traced abstractly (``params`` and ``batch`` may be abstract).

    Example:
      >>> layout = osdp_jax.Layout.fsdp(params, mesh, model_loop=osdp_jax.model_loops(loss_fn, params, batch))
      ... # doctest: +SKIP
    """
    return set(find(loss_fn, params, batch).model_loop)


def looped_params(jaxpr, paths) -> set[str]:
    """Paths of the parameters (the first ``len(paths)`` inputs of ``jaxpr``) that a loop in it
    slices per iteration: a ``scan``'s per-iteration operand (``xs``: Flax ``nn.scan`` and
    ``nnx.scan`` pass stacked parameters so), or an array a ``scan`` or ``while`` body takes one
    leading slice of (``dynamic_slice`` of size 1 along the first dimension and whole along the
    others: ``params[i]`` in a ``fori_loop``; a ``gather``, an embedding lookup, is not counted).
    Values are followed through dtype casts and reshapes and into nested jaxprs (``jit``,
    ``remat``, custom derivatives, loop bodies)."""
    found: set[str] = set()

    def walk(j, alias: dict, in_loop: bool):
        alias = dict(alias)
        for eqn in j.eqns:
            ins = [alias.get(v) if not isinstance(v, jcore.Literal) else None for v in eqn.invars]
            name = eqn.primitive.name
            if name in _PASS_THROUGH and ins and ins[0] is not None:
                for out in eqn.outvars:
                    alias[out] = ins[0]
                continue
            if name == "scan":
                first = sum(scan_operand_counts(eqn.params))
                found.update(p for p in ins[first:] if p is not None)
            if in_loop and name == "dynamic_slice" and ins and ins[0] is not None:
                shape, sizes = eqn.invars[0].aval.shape, tuple(eqn.params["slice_sizes"])
                if len(shape) >= 1 and sizes[0] == 1 and sizes[1:] == tuple(shape[1:]):
                    found.add(ins[0])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                    if not isinstance(inner, jcore.Jaxpr):
                        continue
                    if len(inner.invars) == len(eqn.invars):  # operands passed in order (jit, remat, scan)
                        mapping = {b: p for b, p in zip(inner.invars, ins) if p is not None}
                    elif name == "while":  # cond_jaxpr and body_jaxpr take their consts, then the carry
                        cond = sub is eqn.params.get("cond_jaxpr")
                        n = eqn.params["cond_nconsts" if cond else "body_nconsts"]
                        start = 0 if cond else eqn.params["cond_nconsts"]
                        carry = ins[eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]:]
                        mapping = {b: p for b, p in zip(inner.invars, ins[start:start + n] + carry) if p is not None}
                    else:
                        mapping = {}
                    if mapping:
                        walk(inner, mapping, in_loop or name in _LOOPS)

    walk(jaxpr, {v: p for v, p in zip(jaxpr.invars, paths)}, False)
    return found


def discover(loss_fn, params, batch) -> tuple[set[str], set[str]]:
    """Paths of the stacked parameters ``loss_fn`` runs through ``osdp_jax.layers.scan``, and of the
    kernels it runs through a dense layer, traced abstractly (``params`` and ``batch`` may be
    abstract). Stacks the model runs with scans of its own are :func:`model_loops`."""
    found = find(loss_fn, params, batch)
    return set(found.in_loop) - found.model_loop, found.dense
