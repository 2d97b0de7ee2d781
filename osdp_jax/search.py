"""Low-level search over raw cost tables (``osdp_jax.search.solve``)."""
from osdp_jax.planner.search import (
                      BeyondBound,
                      Front,
                      InfeasibleBudgetError,
                      Solution,
                      fastest_front,
                      least_memory,
                      lower_bound,
                      min_peak,
                      pareto_front,
                      solve,
                      solve_pools,
)

__all__ = ["BeyondBound", "Front", "InfeasibleBudgetError", "Solution", "fastest_front", "least_memory",
           "lower_bound", "min_peak", "pareto_front", "solve", "solve_pools"]
