"""Operator splitting (public): :func:`dense` for custom layers, :func:`matmul` for the split itself."""
from ._context import SplitKernel, SplitSpec
from ._split import dense, intercepting, matmul

__all__ = ["SplitKernel", "SplitSpec", "dense", "intercepting", "matmul"]
