"""Tensor parallelism over a model axis: how a kernel is split across it, Megatron-style.

A mesh may have a *model axis* beside its data-parallel axes (for example
``jax.make_mesh((2, 4), ("data", "model"))`` with ``axis="data"``). A dense layer's kernel
``(D, F)`` can then be split over it:

- ``"column"``: its output features, ``P(..., "model")`` on the last dimension (a bias of shape
  ``(F,)`` is split with it). Each device computes ``F / t`` of the layer's outputs, from its whole
  input.
- ``"heads"``: a multi-head projection's heads, the column split of a ``(D, H, hd)`` kernel (Flax's
  ``DenseGeneral(features=(H, hd))``, ``nnx.LinearGeneral``) on ``H``, its second-to-last
  dimension (a bias of shape ``(H, hd)`` is split with it). Each device computes ``H / t`` whole
  heads.
- ``"row"``: its input features, ``P("model", ...)`` on the first dimension: ``F`` of a ``(F, D)``
  kernel, the heads ``H`` of an attention output's ``(H, hd, D)`` (a bias stays whole). Each
  device computes a partial product from its ``F / t`` inputs; the partial products are summed
  over the model axis (one all-reduce of the layer's output forward, one of its input's gradient
  backward).

A column layer followed by elementwise (or per-head) work and a row layer (an MLP's up/gate and
down kernels; attention's q/k/v, split by heads, and o) keeps the hidden activations split
between them, as Megatron-LM does.
The data-parallel strategy of the same parameter (replicate, zero3) applies over the data axes as
before; a zero3 split kernel is sharded over the data axes along another dimension than its
model split.

Inside the step the model axis is left to XLA's partitioner (``jax.shard_map(...,
axis_names=<the data axes>)``): the data-parallel collectives are written by the step, the model
axis's by XLA, from each split kernel's sharding and the sharding of its layer's output
(``runtime.interception``).
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P

ROLES = ("column", "heads", "row")


def split_dim(shape, role: str, stacked: bool = False) -> int | None:
    """The dimension of a parameter of ``shape`` that ``role`` splits over the model axis: a
    column kernel's (or bias's) last; a heads kernel's (or bias's) second-to-last; a row kernel's
    first (its input features, or heads); None for a row bias (kept whole) and no role.
    ``stacked``: a layer stack's parameter, whose leading dimension is the layer axis (a layer's
    kernel is ``shape[1:]``)."""
    layer = len(shape) - int(stacked)
    if role == "column":
        return len(shape) - 1 if layer >= 1 else None
    if role == "heads":
        return len(shape) - 2 if layer >= 2 else None
    if role == "row":
        return int(stacked) if layer >= 2 else None
    return None


def storage_spec(spec: P, shape, role: str, model_axis: str | None, stacked: bool = False) -> P:
    """``spec`` (the data-parallel spec) with ``model_axis`` at the dimension ``role`` splits."""
    dim = split_dim(shape, role, stacked) if model_axis else None
    if dim is None:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    entries[dim] = model_axis
    return P(*entries)


def model_spec(shape, role: str, model_axis: str | None) -> P | None:
    """How a (gathered) weight of ``shape`` with tensor ``role`` lies over the model axis alone:
    its :func:`storage_spec` without data-parallel axes; None without a role."""
    return storage_spec(P(), shape, role, model_axis) if role else None


def manual_spec(spec: P, model_axis: str | None) -> P:
    """``spec`` without ``model_axis``: what a ``shard_map`` manual over the data axes only is given."""
    if not model_axis:
        return spec
    return P(*(None if entry == model_axis else entry for entry in spec))


def output_spec(ndim: int, role: str, model_axis: str, sequence: bool = False) -> P:
    """The sharding a dense layer's output of ``ndim`` dimensions keeps over the model axis: a
    column layer's split on its features, a heads layer's on its heads (``(..., H, hd)``), a row
    layer's whole (the partial products summed); with ``sequence`` (Megatron's sequence
    parallelism), a row layer's ``(batch, sequence, ...)`` output split on its sequence (the
    partial products reduce-scattered there, and gathered again where a column layer reads them),
    so the work between a row layer and the next column layer (residual adds, LayerNorm) and what
    it saves for the backward pass are split too."""
    if role == "column":
        return P(*([None] * (ndim - 1)), model_axis)
    if role == "heads":
        return P(*([None] * (ndim - 2)), model_axis, None)
    if sequence and ndim >= 3:
        return P(None, model_axis, *([None] * (ndim - 2)))
    return P()


def check_tensor(path: str, shape, role: str, spec: P, model_axis: str, size: int, stacked: bool = False) -> None:
    """One ``ValueError`` naming ``path`` when it cannot be split as ``role`` over a model axis
    of ``size`` devices under its data-parallel ``spec``."""
    if role not in ROLES:
        raise ValueError(f"parameter {path!r}: tensor role must be one of {list(ROLES)}, got {role!r}")
    if len(shape) - int(stacked) not in (1, 2, 3) or (role == "heads" and len(shape) - int(stacked) < 2):
        raise ValueError(f"parameter {path!r} {tuple(shape)}: only dense kernels (2-D, or 3-D multi-head "
                         f"projections, per layer of a stack) and their biases can be split over the model axis, "
                         f"and 'heads' needs a (..., H, hd) shape")
    dim = split_dim(shape, role, stacked)
    if dim is None:
        return
    if shape[dim] % size:
        raise ValueError(f"parameter {path!r} {tuple(shape)} cannot be split as {role!r} over the "
                         f"{size} devices of model axis {model_axis!r}: its dimension {dim} ({shape[dim]}) "
                         f"is not divisible by {size}")
    if dim < len(spec) and spec[dim] is not None:
        raise ValueError(f"parameter {path!r} is sharded over the data axes along dimension {dim} ({spec}), "
                         f"the dimension its {role!r} split uses: shard it along another dimension")
