"""Operator splitting (public): :func:`dense` for custom layers, :func:`matmul` for the split itself
(inside ``jax.shard_map``: ``matmul(x, shard, SplitSpec(dim, Collective(axes), k))``), and
:func:`intercepting`, the scope in which unmodified Flax Dense/Linear/Embed layers use them."""
from ._layout import Collective
from .runtime.context import SplitKernel, SplitSpec
from .runtime.hooks import dense
from .runtime.interception import intercepting
from .runtime.kernels import matmul

__all__ = ["Collective", "SplitKernel", "SplitSpec", "dense", "intercepting", "matmul"]
