"""Strategy names and split counts, where gradients are summed across microbatches, and their
validation (public)."""
from osdp_jax.core.strategies import (
                          ACCUMULATE,
                          DEFAULT_SPLITS,
                          DEFAULT_STRATEGIES,
                          STRATEGIES,
                          accumulation,
                          check_microbatches,
                          check_splits,
                          check_strategies,
)

__all__ = ["ACCUMULATE", "DEFAULT_SPLITS", "DEFAULT_STRATEGIES", "STRATEGIES", "accumulation", "check_microbatches",
           "check_splits", "check_strategies"]
