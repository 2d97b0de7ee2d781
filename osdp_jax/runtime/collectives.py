"""The ZeRO-3 gather: all-gather forward, reduce-scatter backward (inside ``jax.shard_map``).

XLA on CPU emits real ``all-gather`` and ``reduce-scatter`` ops this way, where plain ``jit``
would all-reduce the full gradient. Costs, for a parameter of V bytes over N devices on a ring of
bandwidth W (bytes/s): all-gather and reduce-scatter (N-1)/N V / W seconds each.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from osdp_jax.core.layout import Collective


def gather(shard, dim: int, how: Collective, model=None):
    """All-gather a ZeRO-3 shard along ``dim`` as ``how`` says (inside shard_map; :func:`_gather`).

    With ``how.model_axis`` (a model axis the step's ``shard_map`` leaves to XLA), inside a
    nested ``shard_map`` manual over that axis too, the shard split over it as ``model`` says
    (``core.tensor``; None: whole on each of its devices): a data-axis collective in a partly
    manual ``shard_map`` would otherwise gather the model split too (XLA replicates an operand's
    automatic axes before a manual collective), and a low-precision gather's cast gradient
    aborts XLA's partitioner there."""
    if how.model_axis is None:
        return _gather(shard, dim, how)
    spec, inner = P() if model is None else model, dataclasses.replace(how, model_axis=None)
    return jax.shard_map(lambda part: _gather(part, dim, inner), in_specs=spec, out_specs=spec,
                         axis_names={how.model_axis}, check_vma=False)(shard)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(shard, dim: int, how: Collective):
    """All-gather a ZeRO-3 shard along ``dim`` as ``how`` says (inside shard_map). With
    ``how.dtype`` (e.g. bfloat16) the shard is cast to it for the collective and the gathered
    weight cast back to the shard's dtype, so the model computes in its own dtypes on the
    rounded weight (a model computing in bfloat16 casts it again, exactly); the gradient is cast
    to ``how.dtype`` for the reduce-scatter and back after it.

    Its gradient reduce-scatters the cotangent back to a shard (and sums it over
    ``how.reduce_axes``): the sum over devices, so the caller divides by the device count for a
    mean.
    """
    own = shard.dtype
    if how.dtype is not None:  # a low-precision gather: half the bytes for bfloat16 from float32
        shard = shard.astype(how.dtype)
    if how.two_stage and len(how.axes) > 1:
        for axis in reversed(how.axes):  # inner (intra-node) axis first
            shard = jax.lax.all_gather(shard, axis, axis=dim, tiled=True)
    else:
        shard = jax.lax.all_gather(shard, how.axes, axis=dim, tiled=True)
    return shard.astype(own)  # the model computes in its own dtypes, on the rounded weight


def _gather_fwd(shard, dim, how):
    return _gather(shard, dim, how), jax.numpy.zeros((), shard.dtype)  # the shard's dtype, for the gradient


def _gather_bwd(dim, how, like, cotangent):
    if how.dtype is not None:
        cotangent = cotangent.astype(how.dtype)
    if how.two_stage and len(how.axes) > 1:
        for axis in how.axes:  # outer (inter-node) axis first: the reverse of the gather
            cotangent = jax.lax.psum_scatter(cotangent, axis, scatter_dimension=dim, tiled=True)
    else:
        cotangent = jax.lax.psum_scatter(cotangent, how.axes, scatter_dimension=dim, tiled=True)
    if how.reduce_axes:
        cotangent = jax.lax.psum(cotangent, how.reduce_axes)
    return (cotangent.astype(like.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def device_index(axes):
    """This device's linear index over the data-parallel ``axes`` (inside shard_map)."""
    return jax.lax.axis_index(axes if len(axes) > 1 else axes[0])
