"""osdp-jax: Optimal Sharded Data Parallel for JAX.

Per parameter and per layer, choose how each parameter is stored and synchronised over the
data-parallel devices (replicated, ZeRO-3, HSDP or ZeRO-2), in how many slices each dense kernel
is gathered (operator splitting), the remat policy of each layer, the number of microbatches and
the global batch size: the highest predicted training throughput whose whole step fits a
per-device memory budget by XLA's own figure.

>>> plan = osdp_jax.plan(params, mesh, budget="8GB", loss_fn=loss_fn, batch=batch)  # doctest: +SKIP
>>> params = osdp_jax.shard(params, mesh, plan)                                      # doctest: +SKIP
>>> step = osdp_jax.make_train_step(loss_fn, optimizer, plan, mesh)                 # doctest: +SKIP

In a training step of your own, :func:`osdp_jax.value_and_grad` takes ``jax.value_and_grad``'s
place and gathers the weights as the plan says.

Advanced stages live in submodules: :mod:`osdp_jax.planning` (the planner's stages, recorded
probes, caches), :mod:`osdp_jax.search` (the exact search on raw tables), :mod:`osdp_jax.layers`
(layer stacks), :mod:`osdp_jax.units` (per-block gathering), :mod:`osdp_jax.split` (operator
splitting), :mod:`osdp_jax.hardware`, :mod:`osdp_jax.strategies` and :mod:`osdp_jax.xla`.
"""
from osdp_jax import hardware, layers, planning, search, split, strategies, units, xla
from osdp_jax._apply import shard
from osdp_jax.core.bytes import format_bytes, parse_bytes
from osdp_jax.core.describe import ParamInfo, describe
from osdp_jax.core.hardware import PRESETS, Hardware
from osdp_jax.core.layout import Layout, ParamLayout
from osdp_jax.core.logical import logical_axis_rules
from osdp_jax.core.plan import ParamPlan, Plan
from osdp_jax.core.simulated import simulate_cpu_devices
from osdp_jax.core.stack import Segment, Segmented
from osdp_jax.core.xla import StepProfile, profile_compiled
from osdp_jax.planner.budgets import plan_budgets
from osdp_jax.planner.cache import enable_compilation_cache
from osdp_jax.planner.discover import discover, model_loops
from osdp_jax.planner.pipeline import plan
from osdp_jax.planner.search import InfeasibleBudgetError
from osdp_jax.planner.tensor_pairs import tensor_roles
from osdp_jax.runtime.gradient import value_and_grad
from osdp_jax.runtime.place import (
                                    Shardings,
                                    abstract_state,
                                    batch_sharding,
                                    cut_segments,
                                    init_opt_state,
                                    merge_segments,
                                    shardings,
                                    whole_target,
)
from osdp_jax.runtime.step import (
    BudgetExceededError,
    check_budget,
    compile_step,
    make_eval_step,
    make_train_step,
    profile_step,
)

__version__ = "0.1.0"

__all__ = [
    # plan
    "plan", "plan_budgets", "Plan", "ParamPlan", "InfeasibleBudgetError", "enable_compilation_cache",
    # apply and train
    "shard", "init_opt_state", "abstract_state", "shardings", "Shardings", "batch_sharding", "make_train_step",
    "make_eval_step", "value_and_grad", "check_budget", "BudgetExceededError",
    # layer-stack checkpoints
    "merge_segments", "cut_segments", "whole_target", "Segment", "Segmented",
    # layouts by hand, and what the planner sees
    "Layout", "ParamLayout", "describe", "ParamInfo", "discover", "model_loops", "tensor_roles",
    "logical_axis_rules",
    # XLA's figures
    "compile_step", "profile_step", "profile_compiled", "StepProfile",
    # hardware and sizes
    "Hardware", "PRESETS", "format_bytes", "parse_bytes", "simulate_cpu_devices",
    # submodules
    "hardware", "layers", "planning", "search", "split", "strategies", "units", "xla",
]
