"""osdp-jax: Optimal Sharded Data Parallel for JAX.

Per parameter, choose replication or ZeRO-3 sharding over the data-parallel devices (and, for
dense kernels, a split count: operator splitting), and a batch size, for the highest training throughput whose whole step fits a per-device memory budget.

>>> plan = osdp_jax.plan(params, mesh, budget="8GB", loss_fn=loss_fn, batch=batch)  # doctest: +SKIP
>>> params = osdp_jax.shard(params, mesh, plan)                                      # doctest: +SKIP
"""
from ._describe import ParamInfo, describe
from ._gather import gather_params
from ._hardware import PRESETS, Hardware
from ._plan import ParamPlan, Plan
from ._planner import plan
from ._search import InfeasibleBudgetError
from ._shard import abstract_state, init_opt_state, shard
from ._strategies import STRATEGIES
from ._train import make_eval_step, make_train_step
from ._units import format_bytes, parse_bytes
from ._xla import StepProfile, profile_compiled, profile_step
from . import search, split

__version__ = "0.1.0"

__all__ = [
    "Hardware", "InfeasibleBudgetError", "abstract_state", "PRESETS", "ParamInfo", "ParamPlan", "Plan", "STRATEGIES",
    "StepProfile", "describe", "format_bytes", "gather_params", "init_opt_state", "make_eval_step", "make_train_step", "parse_bytes",
    "plan", "profile_compiled", "profile_step", "search", "shard", "split",
]
