"""Strategies, and the storage ``PartitionSpec`` each gives a parameter on a mesh.

- ``"replicate"``: every data-parallel device holds the whole parameter (spec ``P()``).
- ``"zero3"``: the parameter is split along one dimension over all data-parallel axes; it is
  gathered before use and its gradient reduce-scattered. The dimension is the first (major-most)
  one the data-parallel size divides, never the layer axis of a parameter the model gathers
  inside its layer loop: collectives along the major dimension need no transposes, which XLA
  otherwise materialises at full size around every gather and reduce-scatter
  (``Plan.summary()`` names parameters sharded along a later dimension). A parameter with no such
  dimension cannot be zero3.
- ``"hsdp"`` (2-D meshes): zero3 inside the last (inner) axis, replicated across the others.
- ``"zero2"``: the parameter is stored whole on every device (spec ``P()``), but its gradient is
  reduce-scattered and its optimizer state and update live on a shard (:func:`state_spec_for`, the
  zero3 spec); the updated shards are all-gathered back into the whole parameter. A ring
  all-reduce is a reduce-scatter plus an all-gather, so it costs about replication's time and
  holds ``p + o / N`` bytes instead of ``p + o`` (o: the optimizer state's bytes). Not in the
  default search (:data:`DEFAULT_STRATEGIES`, the original OSDP's space); ask for it with
  ``strategies=``.

With gradient accumulation (m microbatches per step), each parameter's gradient is summed across
the microbatches either *whole* or in its *shard* (:data:`ACCUMULATE`, :func:`accumulation`):

- ``"shard"`` (the sharded strategies' default: zero3, hsdp, zero2): the gradient is
  reduce-scattered in every microbatch into a shard-sized accumulator (p / N bytes). A zero3/hsdp
  weight is then gathered again in every microbatch: m all-gathers and m reduce-scatters per step.
- ``"whole"`` (replicate always; the others on request): the gradient is summed whole (p bytes)
  and reduced once after the loop. A zero3/hsdp weight is then gathered once per step and *kept*
  across the microbatches (p bytes more, alive through the loop): one all-gather and one
  reduce-scatter per step. Not for a layer-stacked parameter (gathered per layer), a unit's
  (gathered at its unit) or a split kernel.

A layer stack's gradients accumulate as its segments' strategies do, with no choice: zero3/hsdp
in the shard, replicate and zero2 whole (reduce-scattering every layer's zero2 gradient in every
microbatch costs m times the collectives, and zero3 is there for the memory).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from jax.sharding import PartitionSpec as P

from osdp_jax.core.describe import ParamInfo

STRATEGIES = ("replicate", "zero3", "hsdp", "zero2")
DEFAULT_STRATEGIES = ("replicate", "zero3", "hsdp")  # the original OSDP's space: strategies=None
GATHERED = ("zero3", "hsdp")  # the strategies that store a shard and gather the weight for use
DEFAULT_SPLITS = (1, 2, 4, 8)  # operator-splitting slice counts the search considers
ACCUMULATE = ("shard", "whole")  # where a gradient is summed across microbatches (module docstring)
_DEFAULT_ACCUMULATE = {"replicate": "whole", "zero2": "shard", "zero3": "shard", "hsdp": "shard"}


def accumulation(strategy: str, accumulate: str = "") -> str:
    """Where a ``strategy`` parameter's gradient is summed across microbatches: ``accumulate``
    (``"shard"`` or ``"whole"``), or the strategy's default for ``""``; a ``ValueError`` for a
    value that does not apply (a replicated gradient has no shard)."""
    if accumulate == "":
        return _DEFAULT_ACCUMULATE[strategy]
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be 'shard' or 'whole', got {accumulate!r}")
    if strategy == "replicate" and accumulate == "shard":
        raise ValueError("a replicated parameter's gradient is accumulated whole (it has no shard): make it "
                         "zero2, zero3 or hsdp to accumulate it sharded")
    return accumulate


def check_strategies(strategies: Sequence[str] | None) -> tuple[str, ...]:
    """A user's ``strategies`` restriction, checked.

    Args:
      strategies: names from :data:`STRATEGIES` (one name or several), or None for
        :data:`DEFAULT_STRATEGIES`.

    Returns:
      The names as a tuple.

    Raises:
      ValueError: an unknown name, or none at all.
    """
    if strategies is None:
        return DEFAULT_STRATEGIES
    if isinstance(strategies, str):
        strategies = (strategies,)
    strategies = tuple(strategies)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"unknown strategy {unknown[0]!r}; choose from {list(STRATEGIES)}" if unknown
                         else f"strategies is empty; choose from {list(STRATEGIES)}")
    return strategies


def check_microbatches(counts, batch_sizes=None, n: int = 1) -> tuple[int, ...]:
    """Validate gradient-accumulation counts: positive integers, e.g. ``(1, 2, 4, 8)``; ``(1,)`` =
    off. With ``batch_sizes`` (global) and ``n`` data-parallel devices, the counts some batch size
    splits into (n x m examples), sorted; a ``ValueError`` when there is none."""
    counts = (counts,) if isinstance(counts, int) else tuple(counts)
    bad = [m for m in counts if isinstance(m, bool) or not isinstance(m, int) or m < 1]
    if bad or not counts:
        raise ValueError(f"microbatches must be positive integers such as [1, 2, 4, 8] ([1]: no gradient "
                         f"accumulation), got {list(counts)}")
    if batch_sizes is None:
        return tuple(sorted(set(counts)))
    usable = tuple(m for m in sorted(set(counts)) if any(b % (n * m) == 0 for b in batch_sizes))
    if not usable:
        raise ValueError(f"no batch size of {sorted(batch_sizes)} splits into {n} devices x any of microbatches "
                         f"{list(counts)}: use batch sizes divisible by devices x microbatches")
    return usable


def check_splits(splits) -> tuple[int, ...]:
    """A user's candidate split counts, checked.

    A kernel takes a count k only if k times the devices it is gathered over divides its sharded
    dimension; a count it cannot take leaves it unsplit. Without 1 in the counts, every kernel that
    can split must.

    Args:
      splits: positive integers, e.g. ``(1, 2, 4, 8)``; ``(1,)`` turns operator splitting off.

    Raises:
      ValueError: a count that is not a positive integer, or none at all.
    """
    if isinstance(splits, int):
        splits = (splits,)
    try:
        values = tuple(sorted(set(splits)))
    except TypeError:
        raise ValueError(f"splits must be a list of positive integers such as [1, 2, 4, 8], got {splits!r}") from None
    bad = [k for k in values if isinstance(k, bool) or not isinstance(k, int) or k < 1]
    if bad or not values:
        raise ValueError(f"splits must be positive integers such as [1, 2, 4, 8] ([1] disables "
                         f"splitting), got {list(splits)!r}")
    return values


def data_axes(mesh, axis: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes that are data-parallel: ``axis`` if given, else every axis of the mesh."""
    names = tuple(mesh.axis_names)
    if axis is None:
        return names
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    missing = [a for a in axes if a not in names]
    if missing or not axes:
        raise ValueError(f"mesh has no axis {missing[0] if missing else axis!r}; its axes are {list(names)}. "
                         f"Pass axis= one of them, or build the mesh with that axis name")
    return axes


def axes_size(mesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def shard_dim(info: ParamInfo, n: int, first: int = 0, prefer: int | None = None) -> int | None:
    """The dimension zero3 splits: ``prefer`` where n divides it, else the first divisible by n,
    from dimension ``first`` on; or None."""
    dims = [d for d, size in enumerate(info.shape) if d >= first and size % n == 0 and size >= n]
    if n <= 1 or not dims:
        return None
    return prefer if prefer in dims else dims[0]


def axis_entry(axes: Sequence[str]):
    """A PartitionSpec entry for one dimension split over ``axes``."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def spec_for(info: ParamInfo, strategy: str, axes: Sequence[str], n: int, in_loop: bool = False,
             inner: int | None = None, prefer: int | None = None) -> P | None:
    """The storage spec of ``info`` under ``strategy``, or None when it cannot be applied.

    ``n`` is the data-parallel size; ``inner`` the size of the last data-parallel axis (hsdp).
    A parameter gathered inside a layer loop (``in_loop``) keeps its leading layer axis whole, so
    every layer's slice is spread over all devices. ``prefer``: the dimension to shard where the
    devices divide it (:func:`shard_dim`).
    """
    if strategy == "replicate":
        return P()
    if strategy == "zero2":  # stored whole; only its gradient and optimizer state are sharded
        return P() if spec_for(info, "zero3", axes, n, in_loop, prefer=prefer) is not None else None
    if strategy in GATHERED:
        if strategy == "hsdp" and (len(axes) < 2 or inner is None):
            return None
        over, size = (axes, n) if strategy == "zero3" else ((axes[-1],), inner)
        dim = shard_dim(info, size, first=1 if in_loop else 0, prefer=prefer)
        if dim is None:
            return None
        return P(*([None] * dim), axis_entry(over))
    raise ValueError(f"unknown strategy {strategy!r}; choose from {list(STRATEGIES)}")


def sharded_dim(spec: P) -> int | None:
    """The one dimension a storage spec splits, or None for a replicated spec."""
    for d, entry in enumerate(spec):
        if entry is not None:
            return d
    return None


def state_spec_for(shape, strategy: str, storage: P, axes: Sequence[str], n: int, in_loop: bool = False) -> P:
    """The spec of a parameter's gradient and optimizer state: its storage spec, except under
    ``"zero2"``, where they are split as zero3 would split the parameter (over all ``axes``, ``n``
    devices; after the layer axis of an ``in_loop`` stack). A ``ValueError`` when no dimension of
    ``shape`` divides."""
    if strategy != "zero2":
        return storage
    dims = [d for d, size in enumerate(shape) if d >= int(in_loop) and size % n == 0 and size >= n]
    if n <= 1 or not dims:
        raise ValueError(f"a parameter of shape {tuple(shape)} cannot be zero2 over {n} devices: no dimension"
                         f"{' after the layer axis' if in_loop else ''} is divisible by {n}; replicate it")
    return P(*([None] * dims[0]), axis_entry(axes))
