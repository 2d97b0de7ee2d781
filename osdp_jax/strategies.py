"""Strategy names and split counts, and their validation (public)."""
from ._strategies import DEFAULT_SPLITS, STRATEGIES, check_splits, check_strategies

__all__ = ["DEFAULT_SPLITS", "STRATEGIES", "check_splits", "check_strategies"]
