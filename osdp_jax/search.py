"""Low-level search over raw cost tables (``osdp_jax.search.solve``)."""
from ._search import InfeasibleBudgetError, Solution, least_memory, min_peak, solve, solve_pools

__all__ = ["InfeasibleBudgetError", "Solution", "least_memory", "min_peak", "solve", "solve_pools"]
