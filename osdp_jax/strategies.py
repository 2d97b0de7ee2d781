"""Strategy names and split counts, and their validation (public)."""
from ._strategies import (DEFAULT_SPLITS, DEFAULT_STRATEGIES, STRATEGIES, check_microbatches, check_splits,
                          check_strategies)

__all__ = ["DEFAULT_SPLITS", "DEFAULT_STRATEGIES", "STRATEGIES", "check_microbatches", "check_splits", "check_strategies"]
