"""osdp-jax: Optimal Sharded Data Parallel for JAX.

Per parameter, choose replication or ZeRO-3 sharding over the data-parallel devices (and, for
dense kernels, a split count: operator splitting), and a batch size, for the highest training
throughput whose whole step fits a per-device memory budget.

>>> plan = osdp_jax.plan(params, mesh, budget="8GB", loss_fn=loss_fn, batch=batch)  # doctest: +SKIP
>>> params = osdp_jax.shard(params, mesh, plan)                                      # doctest: +SKIP
"""
from ._apply import shard
from ._cache import enable_compilation_cache
from ._describe import ParamInfo, describe, flat_params, path_name
from ._discover import discover
from ._hardware import PRESETS, Hardware
from ._layout import Collective, Layout, ParamLayout
from ._plan import ParamPlan, Plan
from ._planner import plan
from ._budgets import plan_budgets
from ._search import InfeasibleBudgetError
from ._strategies import STRATEGIES
from ._units import format_bytes, parse_bytes
from ._xla import StepProfile, profile_compiled
from .runtime.hooks import gather_params
from ._stack import Segment, Segmented
from .runtime.place import cut_segments, merge_segments, whole_target
from .runtime.place import abstract_state, batch_sharding, init_opt_state
from .runtime.step import compile_step, make_eval_step, make_train_step, profile_step
from . import hardware, layers, planning, search, split, strategies, units, xla

__version__ = "0.1.0"

__all__ = [
    "Collective", "Hardware", "InfeasibleBudgetError", "Layout", "PRESETS", "ParamInfo", "ParamLayout",
    "ParamPlan", "Plan", "STRATEGIES", "Segment", "Segmented", "StepProfile", "abstract_state", "batch_sharding", "compile_step", "cut_segments",
    "describe", "discover", "enable_compilation_cache", "flat_params", "format_bytes", "hardware", "gather_params", "init_opt_state", "layers", "make_eval_step", "make_train_step", "merge_segments", "parse_bytes", "path_name", "whole_target",
    "plan", "plan_budgets", "planning", "profile_compiled", "profile_step", "search", "shard", "split", "strategies", "units", "xla",
]
