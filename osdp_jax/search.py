"""Low-level search over raw cost tables (``osdp_jax.search.solve``)."""
from ._search import InfeasibleBudgetError, Solution, solve

__all__ = ["InfeasibleBudgetError", "Solution", "solve"]
