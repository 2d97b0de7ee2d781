"""Low-level search over raw cost tables (``osdp_jax.search.solve``)."""
from ._search import Front, InfeasibleBudgetError, Solution, least_memory, min_peak, pareto_front, solve, solve_pools

__all__ = ["Front", "InfeasibleBudgetError", "Solution", "least_memory", "min_peak", "pareto_front", "solve",
           "solve_pools"]
