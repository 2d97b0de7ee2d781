"""Operator splitting (public): :func:`dense` for custom layers, :func:`matmul` for the split itself
(inside ``jax.shard_map``: ``matmul(x, shard, SplitSpec(dim, Collective(axes), k))``), and
:func:`intercepting`, the scope in which unmodified Flax Dense/Linear/Embed layers use them."""
from osdp_jax.core.layout import Collective
from osdp_jax.runtime.context import SplitKernel, SplitSpec
from osdp_jax.runtime.hooks import dense
from osdp_jax.runtime.interception import intercepting
from osdp_jax.runtime.kernels import matmul

__all__ = ["Collective", "SplitKernel", "SplitSpec", "dense", "intercepting", "matmul"]
