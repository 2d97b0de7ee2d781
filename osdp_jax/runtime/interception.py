"""Unmodified Flax layers routed to the step's kernels while a step is traced, in this thread only.

Inside ``intercepting()``:

- ``flax.linen.Dense`` and ``flax.nnx.Linear`` call :func:`~osdp_jax.runtime.hooks.dense` (a
  split or layer-gathered kernel runs there);
- ``flax.linen.DenseGeneral`` and ``flax.nnx.LinearGeneral`` (multi-head projections) run as Flax
  has them, their calls recorded while discovering and their outputs kept split over a model
  axis as their kernels' tensor roles say;
- ``flax.linen.Embed`` and ``flax.nnx.Embed`` look up through
  :func:`~osdp_jax.runtime.kernels.lookup` (their ``attend`` is unchanged).

Flax's hooks come first. Linen has its own scoped, thread-local interception,
``nn.intercept_methods``, used here. ``nnx.Linear`` and ``linen.Dense`` also take ``dot_general=``
and ``promote_dtype=``, but only where a model constructs them: a user's model, built with the
defaults inside its ``loss_fn`` (``nnx.merge``), cannot be handed one. So ``nnx.Linear.__call__``
and ``nnx.Embed.__call__`` are wrapped once, on first use, by a function that defers to Flax's own
method unless *this thread* is inside ``intercepting()``: no other thread, and no code outside a
step's trace, sees a difference.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from osdp_jax.runtime import units
from osdp_jax.runtime.context import ACTIVE, SplitKernel
from osdp_jax.runtime.hooks import dense, record
from osdp_jax.runtime.kernels import lookup

_LOCAL = threading.local()  # .depth: intercepting() contexts this thread is in; .lookups: Embed routed
_LOCK = threading.Lock()
_ORIGINAL: dict = {}  # (class, method name) -> Flax's own method


def active() -> bool:
    """Whether this thread is inside ``intercepting()``."""
    return getattr(_LOCAL, "depth", 0) > 0


def _install(cls, name: str, replacement) -> None:
    """Wrap ``cls.name`` once: ``replacement(original, self, ...)`` in an intercepting thread,
    Flax's own method everywhere else."""
    with _LOCK:
        if (cls, name) in _ORIGINAL:
            return
        original = getattr(cls, name)

        @functools.wraps(original)
        def dispatch(self, *args, **kwargs):
            if active():
                return replacement(original, self, *args, **kwargs)
            return original(self, *args, **kwargs)

        _ORIGINAL[(cls, name)] = original
        setattr(cls, name, dispatch)


def _apply_clone(module, method: str, variables, *args, **kwargs):
    """``module.method(*args)`` run on ``variables``: an unbound copy of the module applied to them,
    with a key per rng stream the module's scope has (``runtime.units`` runs a unit this way).
    With collections the module may change (:func:`_mutable`), ``(output, their new values)``."""
    rngs = {name: module.make_rng(name) for name in module.scope.rngs} or None
    mutable = _mutable(module)
    return module.clone(parent=None).apply(variables, *args, method=None if method == "__call__" else method,
                                           rngs=rngs, mutable=mutable or False, **kwargs)


def _mutable(module) -> list[str]:
    """The collections other than parameters that ``module`` holds and may change in this call
    (e.g. ``batch_stats`` in training)."""
    return [c for c in module.variables if c != "params" and module.is_mutable_collection(c)]


def _put_back(module, updates) -> None:
    """A unit's changed collections written into ``module``'s scope, as if it had run in place."""
    for col, tree in updates.items():
        for name, value in tree.items():
            module.put_variable(col, name, value)


_NOT_A_UNIT = object()


def _may_be_unit(module, method: str) -> bool:
    """Whether a linen module method call can be a unit's: a submodule's (a scope path) public
    method or ``__call__``, not ``setup``."""
    return (module.scope is not None and bool(module.scope.path) and method != "setup"
            and (method == "__call__" or not method.startswith("_")))


def _linen_unit(module, method: str, args, kwargs):
    """A linen module method as a unit call (``runtime.units``), or ``_NOT_A_UNIT``: every
    method of a submodule holding parameters is recorded while discovering, and runs as its unit
    when the plan names the module's path. Collections the call may change (batch statistics
    in training, ``sow``n intermediates) come out of the unit as outputs and are written into
    the module's scope, as if it had run in place; rng streams come in as keys."""
    ctx = ACTIVE.get()
    if ctx is None or ctx.in_unit or not _may_be_unit(module, method):
        return _NOT_A_UNIT
    name = "/".join(module.scope.path)
    if ctx.recording:
        if "params" in module.variables and units.record("linen", name, module.variables["params"]) is None:
            units.record_hidden(name, module.variables["params"])  # under a lifted transform of the model's
        return _NOT_A_UNIT
    if name not in ctx.units.values():
        return _NOT_A_UNIT
    out = units.call("linen", name, module.variables,
                     lambda vs, *a, **kw: _apply_clone(module, method, vs, *a, **kw), *args, **kwargs)
    if not _mutable(module):
        return out
    out, updates = out  # collections the call changed (batch statistics) left the unit as outputs
    _put_back(module, updates)
    return out


def _linen(next_fun, args, kwargs, context):
    """One linen interceptor for units, and for Dense and Embed calls; while discovering, a
    possible unit's saved activations are measured once its call has run (``units.measure``)."""
    module = context.module
    out = _linen_unit(module, context.method_name, args, kwargs)
    if out is not _NOT_A_UNIT:
        return out
    out = _linen_layer(next_fun, args, kwargs, context)
    ctx, method = ACTIVE.get(), context.method_name
    if (ctx is not None and ctx.recording and _may_be_unit(module, method)
            and "params" in module.variables):  # a call _linen_unit recorded
        others = {c: v for c, v in module.variables.items() if c != "params"}
        units.measure("/".join(module.scope.path), module.variables["params"],
                      lambda ps, *a, **kw: _apply_clone(module, method, {"params": ps, **others}, *a, **kw),
                      args, kwargs)
    return out


def _linen_layer(next_fun, args, kwargs, context):
    """Dense and Embed calls routed to the step's kernels; any other call as it is."""
    module = context.module
    if context.method_name != "__call__" or module.scope is None or len(args) != 1 or kwargs:
        return next_fun(*args, **kwargs)
    if type(module) is nn.Dense:
        if (not module.scope.has_variable("params", "kernel") or module.dot_general is not None
                or module.dot_general_cls is not None):
            return next_fun(*args, **kwargs)
        kernel = module.scope.get_variable("params", "kernel")
        record(kernel, args[0])
        if not isinstance(kernel, SplitKernel):
            return _tensor_output(kernel, next_fun(*args, **kwargs))
        bias = module.scope.get_variable("params", "bias") if module.use_bias else None
        return _tensor_output(kernel, dense(args[0], kernel, bias, precision=module.precision, dtype=module.dtype))
    if type(module) is nn.DenseGeneral and module.scope.has_variable("params", "kernel"):
        kernel = module.scope.get_variable("params", "kernel")
        record(kernel, args[0], splittable=False)
        return _tensor_output(kernel, next_fun(*args, **kwargs))
    if type(module) is nn.Embed and _LOCAL.lookups:
        if (module.num_embeddings == 1 or not jnp.issubdtype(args[0].dtype, jnp.integer)
                or not module.scope.has_variable("params", "embedding")):
            return next_fun(*args, **kwargs)
        table = module.scope.get_variable("params", "embedding")
        (table,) = module.promote_dtype(table, dtype=module.dtype, inexact=False)
        return lookup(table, args[0])
    return next_fun(*args, **kwargs)


def _nnx_linear(original, self, inputs, out_sharding=None):
    kernel = self.kernel[...]
    record(kernel, inputs)
    if not isinstance(kernel, SplitKernel):
        return _tensor_output(kernel, original(self, inputs, out_sharding))
    if out_sharding is not None or getattr(self, "dot_general", jax.lax.dot_general) is not jax.lax.dot_general:
        kernel.as_array()  # raises for a split kernel; an unsplit one is gathered by nnx's own code
        return _tensor_output(kernel, original(self, inputs, out_sharding))
    bias = self.bias[...] if self.bias is not None else None
    y = dense(inputs, kernel, bias, precision=self.precision, dtype=self.dtype)
    y = y.astype(self.preferred_element_type) if self.preferred_element_type is not None else y
    return _tensor_output(kernel, y)


def _nnx_linear_general(original, self, inputs, *args, **kwargs):
    kernel = self.kernel[...]
    record(kernel, inputs, splittable=False)
    return _tensor_output(kernel, original(self, inputs, *args, **kwargs))


def _tensor_output(kernel, y):
    """``y`` sharded over the model axis as ``kernel``'s tensor role says (``StepContext.tensor_output``)."""
    ctx = ACTIVE.get()
    return y if ctx is None or not ctx.tensor_ids else ctx.tensor_output(kernel, y)


def _nnx_embed(original, self, inputs, out_sharding=None):
    if not _LOCAL.lookups or out_sharding is not None or self.num_embeddings == 1 or not jnp.issubdtype(inputs.dtype,
                                                                                                        jnp.integer):
        return original(self, inputs, out_sharding)
    (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    return lookup(table, inputs)


@contextlib.contextmanager
def intercepting(lookups: bool = True):
    """Route Flax Dense/Linear and Embed calls to the step's kernels, in this thread, while open.

    ``lookups=False`` leaves Embed to Flax (``jnp.take``, whose table-sized gradient XLA:CPU
    allocates at the top of the step): for measuring what :func:`~.kernels.lookup` saves."""
    _install(nnx.Linear, "__call__", _nnx_linear)
    _install(nnx.LinearGeneral, "__call__", _nnx_linear_general)
    _install(nnx.Embed, "__call__", _nnx_embed)
    saved = getattr(_LOCAL, "depth", 0), getattr(_LOCAL, "lookups", True)
    _LOCAL.depth, _LOCAL.lookups = saved[0] + 1, lookups
    try:
        with nn.intercept_methods(_linen):
            yield
    finally:
        _LOCAL.depth, _LOCAL.lookups = saved
