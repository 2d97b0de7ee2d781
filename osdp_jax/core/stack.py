"""Layer stacks in segments: the per-layer unit of a plan.

A *stack* is a set of layer-stacked parameters (leading axis = layer, ``[L, ...]``) that one
``osdp_jax.layers.scan`` call runs, one layer per loop iteration. A plan cuts a stack into
contiguous **segments** of layers, each with one configuration for all of the stack's parameters
(a :class:`Segment`: strategy, split count k, remat policy). Each segment runs as its own scan.

Stored, a parameter of a stack with two or more segments is a :class:`Segmented` pytree node whose
children are the segments' arrays (``[stop - start, ...]`` each, sharded as its segment says); with
one segment it is the plain ``[L, ...]`` array. To the user it stays one parameter: ``describe``
sees its whole shape, :func:`merge` gives back the whole ``[L, ...]`` arrays (checkpoints and
export store those, so a checkpoint restores under any segmentation), and :func:`to_storage`
cuts whole arrays as a layout says.

Remat policies (what a layer's backward pass finds saved, ``jax.checkpoint`` policies):

- ``"full"``: nothing but the layer's input; the forward pass runs again in the backward pass;
- ``"dots"``: the outputs of matmuls without batch dimensions (the projections) and of split
  kernels (:data:`SPLIT_NAME`), so only the cheap element-wise work and the attention matmuls
  run again (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``);
- ``"none"``: everything except the weights the layer gathered, which are gathered again (a
  gathered weight kept for the backward pass would hold every layer's weights at once).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

REMAT_POLICIES = ("full", "dots", "none")
GATHERED_NAME = "osdp_gathered"  # checkpoint_name of a weight gathered inside a layer
SPLIT_NAME = "osdp_split"  # checkpoint_name of a split kernel's product (``runtime.kernels.matmul``)


def check_remat(policy: str) -> str:
    if policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}: use one of {', '.join(REMAT_POLICIES)}")
    return policy


def save_all_but_gathered(prim, *_, **params) -> bool:
    """The ``"none"`` policy: save everything but the weights gathered inside the checkpoint.
    Naming them is not enough: ``checkpoint_name`` only copies its input, the output of the
    gather (a ``custom_vjp`` call), which ``save_anything_except_these_names`` would save
    (every layer's gathered weight would then be kept for the backward pass); the gathers'
    outputs are excluded too."""
    if prim.name == "name":
        return params.get("name") != GATHERED_NAME
    return "custom_vjp" not in prim.name


def remat_policy(policy: str):
    """The ``jax.checkpoint`` policy of a remat policy name (module docstring)."""
    check_remat(policy)
    cp = jax.checkpoint_policies
    if policy == "full":
        return cp.nothing_saveable
    if policy == "dots":  # a split kernel's product is a sum of matmuls: saved as one matmul's is
        return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(SPLIT_NAME))
    return save_all_but_gathered


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers ``start`` to ``stop - 1`` of a layer stack: how one stacked parameter is stored and
    run there (``plan.segments``; ``Layout.from_specs(..., segments=)`` by hand).

    Attributes:
      start, stop: the layers, ``stop`` excluded.
      strategy: ``"replicate"``, ``"zero3"``, ``"hsdp"`` or ``"zero2"`` for these layers.
      split: operator-split count of a dense kernel (1: not split).
      remat: the remat policy these layers run under: ``"full"``, ``"dots"`` or ``"none"``.
      spec: the storage ``PartitionSpec`` of this segment's ``[stop - start, ...]`` array.
      two_stage: gathered one mesh axis at a time (2-D meshes).
    """

    start: int
    stop: int
    strategy: str = "replicate"
    split: int = 1  # operator-split count k of a dense kernel (1: not split)
    remat: str = "full"
    spec: P = P()  # storage PartitionSpec of this segment's [stop - start, ...] array
    two_stage: bool = False

    @property
    def layers(self) -> int:
        return self.stop - self.start

    def to_json(self) -> dict:
        return {"start": self.start, "stop": self.stop, "strategy": self.strategy, "split": self.split,
                "remat": self.remat, "spec": [list(e) if isinstance(e, tuple) else e for e in self.spec],
                "two_stage": self.two_stage}

    @classmethod
    def from_json(cls, d: dict) -> "Segment":
        spec = P(*[tuple(e) if isinstance(e, list) else e for e in d.get("spec", [])])
        return cls(int(d["start"]), int(d["stop"]), d.get("strategy", "replicate"), int(d.get("split", 1)),
                   check_remat(d.get("remat", "full")), spec, bool(d.get("two_stage", False)))


def check_segments(path: str, segments, layers: int) -> None:
    """A ``ValueError`` unless ``segments`` cover layers 0..layers-1 contiguously, in order."""
    at = 0
    for s in segments:
        if s.start != at or s.stop <= s.start:
            raise ValueError(f"segments of {path!r} must cover layers 0-{layers - 1} contiguously in order, "
                             f"got {[(x.start, x.stop) for x in segments]}")
        check_remat(s.remat)
        at = s.stop
    if at != layers:
        raise ValueError(f"segments of {path!r} cover layers 0-{at - 1} of its {layers}")


@jax.tree_util.register_pytree_with_keys_class
class Segmented:
    """A stacked parameter stored as one array per segment (module docstring).

    ``parts[j]`` holds layers ``bounds[j][0]`` to ``bounds[j][1] - 1``. ``shape`` and ``dtype``
    are the whole parameter's, so :func:`osdp_jax.describe` sees one parameter.
    """

    def __init__(self, parts, bounds):
        self.parts, self.bounds = tuple(parts), tuple(tuple(b) for b in bounds)

    def tree_flatten_with_keys(self):
        return [(jax.tree_util.SequenceKey(j), p) for j, p in enumerate(self.parts)], self.bounds

    @classmethod
    def tree_unflatten(cls, bounds, parts):
        return cls(parts, bounds)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.bounds[-1][1], *self.parts[0].shape[1:])

    @property
    def dtype(self):
        return self.parts[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self):
        return f"Segmented(shape={self.shape}, layers={[f'{a}-{b - 1}' for a, b in self.bounds]})"


def is_segmented(x) -> bool:
    return isinstance(x, Segmented)


def held_fraction(part) -> float:
    """Share of a placed array (or a ``ShapeDtypeStruct`` with a sharding) one device holds."""
    return np.prod(part.sharding.shard_shape(part.shape)) / max(np.prod(part.shape), 1)


def merge(tree):
    """``tree`` with every :class:`Segmented` parameter (or optimizer-state leaf) concatenated back
    into its whole ``[L, ...]`` array (``ShapeDtypeStruct``s stay abstract). Placed parts are first
    laid out like the most sharded one, so the whole array is that segment's spec over all layers
    and no device holds more than that."""
    def one(x):
        if not isinstance(x, Segmented):
            return x
        parts = x.parts
        if all(isinstance(p, jax.ShapeDtypeStruct) for p in parts):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        placed = [p for p in parts if isinstance(p, jax.Array) and not isinstance(p, jax.core.Tracer)
                  and hasattr(p, "sharding")]
        if len(placed) == len(parts):
            target = min(parts, key=held_fraction).sharding
            parts = [p if p.sharding == target else jax.device_put(p, target) for p in parts]
        return jax.numpy.concatenate(parts, axis=0)
    return jax.tree.map(one, tree, is_leaf=is_segmented)


def cut(x, segments):
    """A whole ``[L, ...]`` array (or ``ShapeDtypeStruct``, or numpy array) cut into ``segments``:
    a :class:`Segmented`, or ``x`` itself for one segment."""
    if len(segments) < 2:
        return x
    bounds = [(s.start, s.stop) for s in segments]
    if isinstance(x, jax.ShapeDtypeStruct):
        parts = [jax.ShapeDtypeStruct((b - a, *x.shape[1:]), x.dtype) for a, b in bounds]
    else:
        parts = [x[a:b] for a, b in bounds]
    return Segmented(parts, bounds)


def whole_shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x)) if not isinstance(x, Segmented) else x.shape
