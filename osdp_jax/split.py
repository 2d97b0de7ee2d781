"""Operator splitting (public): :func:`dense` for custom layers, :func:`matmul` for the split itself
(inside ``jax.shard_map``: ``matmul(x, shard, SplitSpec(dim, Collective(axes), k))``)."""
from ._context import Collective, SplitKernel, SplitSpec
from ._split import dense, intercepting, matmul

__all__ = ["Collective", "SplitKernel", "SplitSpec", "dense", "intercepting", "matmul"]
