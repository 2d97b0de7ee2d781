"""Describe a params pytree: one record per leaf, without allocating anything.

Accepts a plain dict, Flax linen params (boxed in ``Partitioned``/``LogicallyPartitioned`` or
not), an ``nnx.State``, or any pytree whose leaves are arrays or ``jax.ShapeDtypeStruct``.
Boxes are pytree nodes whose only leaf is the array, so the flat leaf order is the same with or
without them: everything downstream works on that flat order and on leaf *paths*.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import optax
from flax.core import meta

from osdp_jax.core.stack import is_segmented


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter, as the planner sees it (:func:`describe` lists them).

    Attributes:
      path: the parameter's ``/``-joined path in the params tree, e.g. ``"blocks/attn/kernel"``
        (Flax boxes and ``nnx.State`` variables are looked through).
      shape: its shape.
      dtype: its dtype.
      size: its element count (a property); ``nbytes`` its size in bytes.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) parameter: size x itemsize."""
        return self.size * self.dtype.itemsize


def _key_name(key) -> str | None:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        # Flax boxes (.value) and nnx Variables add an attribute step that is not part of the name.
        return None if key.name in ("value", "raw_value") else key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return None
    return str(key)


def path_name(path) -> str:
    """``(DictKey('a'), GetAttrKey('value'))`` -> ``"a"``."""
    return "/".join(n for n in (_key_name(k) for k in path) if n is not None)


def describe(params) -> list[ParamInfo]:
    """One :class:`ParamInfo` per leaf of ``params``, in flat leaf order.

    >>> import jax.numpy as jnp
    >>> describe({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)})[0].nbytes
    24
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_segmented)  # a stored stack is one
    if not flat:
        raise ValueError("params has no array leaves: nothing to plan")
    infos = []
    for path, leaf in flat:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(f"params leaf {path_name(path)!r} is a {type(leaf).__name__}, not an array "
                            f"or jax.ShapeDtypeStruct; pass it as an array (jnp.asarray) to train it, or give "
                            f"it to loss_fn another way (a closure) if it is not trained")
        infos.append(ParamInfo(path_name(path), tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype)))
    names = [i.path for i in infos]
    if len(set(names)) != len(names):
        raise ValueError("params has two leaves with the same path name; give them distinct keys")
    return infos


def check_trainable(infos) -> None:
    """A ``ValueError`` naming the first parameter whose dtype is not floating point (integer,
    boolean): its gradient is undefined, so it cannot be trained, sharded by its gradient or
    given optimizer state."""
    for i in infos:
        if not jax.numpy.issubdtype(i.dtype, jax.numpy.inexact):
            raise ValueError(
                f"parameter {i.path!r} has dtype {i.dtype}: osdp-jax plans and trains floating-point "
                f"parameters only (an integer or boolean array has no gradient). Pass only the "
                f"trainable parameters (linen: variables['params']; nnx: nnx.state(model, nnx.Param)) "
                f"and give loss_fn the other arrays another way (a closure, or the batch)")


def unboxed_treedef(params):
    """The treedef of ``params`` with Flax linen metadata boxes removed (nnx.State kept as is)."""
    return jax.tree.structure(meta.unbox(params))


def strip_boxes(tree):
    """``tree`` with Flax linen metadata boxes replaced by their raw values, without applying the
    boxes' own sharding constraints (their logical axis names mean nothing to the planner's mesh)."""
    is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if is_box(x) else x, tree, is_leaf=is_box)


def flat_params(params) -> dict:
    """``{"/"-joined path: leaf}`` of a params tree, metadata boxes stripped (the paths
    :func:`describe` and plans use)."""
    flat = jax.tree_util.tree_flatten_with_path(strip_boxes(params), is_leaf=is_segmented)[0]
    return {path_name(p): x for p, x in flat}


def check_optimizer(optimizer, params) -> None:
    """One ``ValueError`` if ``optimizer`` cannot be used as the train step uses it: an optax
    ``GradientTransformation`` whose ``update(grads, state, params)`` takes those three arguments
    alone. Traced (``jax.eval_shape``) on ``params`` (arrays or ``jax.ShapeDtypeStruct``), not run.
    ``optax.lbfgs`` and other ``GradientTransformationExtraArgs`` that need the loss's value or
    function fail here, by name, rather than deep in the first probe's trace."""
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise ValueError(f"optimizer must be an optax.GradientTransformation (with init and update), got "
                         f"{type(optimizer).__name__}; e.g. optax.adam(1e-3). An nnx.Optimizer wraps one: pass "
                         f"the optax transformation it was given")
    leaves, treedef = jax.tree.flatten(strip_boxes(params), is_leaf=is_segmented)
    shapes = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)
    try:
        hash(optimizer)
    except TypeError:
        check = _check_update.__wrapped__  # not kept
    else:
        check = _check_update
    try:
        check(optimizer, treedef, shapes)
    except Exception as e:  # noqa: BLE001 - any failure is the same misuse, named once
        raise ValueError(
            f"the optimizer ({type(optimizer).__name__}) cannot be called as the train step calls it, "
            f"optimizer.update(grads, state, params): {type(e).__name__}: {e}. Optimizers whose update "
            f"needs more (optax.lbfgs: value, grad and value_fn) are not supported; use a first-order "
            f"optax optimizer") from None


@functools.lru_cache(maxsize=16)
def _check_update(optimizer, treedef, shapes) -> None:
    """Trace ``init`` and ``update``; kept per optimizer and parameter shapes, since a re-plan
    would otherwise trace them again."""
    params = treedef.unflatten([jax.ShapeDtypeStruct(s, d) for s, d in shapes])
    state = jax.eval_shape(optimizer.init, params)
    jax.eval_shape(lambda s, p: optimizer.update(p, s, p), state, params)


def map_state_params(optimizer, f, state, *rest, **kwargs):
    """``optax.tree_map_params(optimizer, f, state, *rest, **kwargs)``, the optimizer's ``init``
    traced (``jax.eval_shape``), not run: optax runs it to find the state's param-shaped parts,
    and run, it would build its arrays on the device (adam's step count), paying XLA compiles for
    them in the planner's main thread. What ``init`` returns only marks where the params are; ``f`` and
    ``transform_non_params`` get the leaves of ``state`` and ``rest``, so nothing traced is
    returned.

    Where a masked transformation (``optax.masked``, ``optax.multi_transform``: parameters frozen
    or trained by another optimizer) holds no state for a parameter, its state has an
    ``optax.MaskedNode``: kept as it is, ``f`` not called there."""
    is_leaf = kwargs.pop("is_leaf", None)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731

    def g(x, *r):
        return x if masked(x) else f(x, *r)

    leaf = masked if is_leaf is None else (lambda x: masked(x) or is_leaf(x))
    out = []
    jax.eval_shape(lambda: out.append(optax.tree_map_params(optimizer, g, state, *rest, is_leaf=leaf, **kwargs)))
    return out[0]


def common_prefix(paths) -> str:
    """The longest ``/``-separated prefix the ``paths`` share (``""`` if none)."""
    parts = [p.split("/") for p in paths]
    out = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        out.append(names[0])
    return "/".join(out[:-1] if parts and len(out) == min(map(len, parts)) else out)
