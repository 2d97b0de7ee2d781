"""The planner's stages, for users who drive or test them (public).

``plan()`` runs: ``build_problem`` -> ``calibrate`` (probe steps, through a ``Calibrator``) -> cost
tables -> exact search -> ``verify``. A :class:`RecordedCalibrator` feeds recorded probe figures
instead of compiling (tests, offline what-ifs); :class:`XlaCalibrator` compiles, and with
``record=`` writes the figures for the former. ``plan()``, ``plan_budgets`` and ``compile_ahead`` run with
Python's cyclic garbage collector paused (:func:`gc_paused`, also for a loop of ``plan()`` calls).
"""
from osdp_jax.core.gc import paused as gc_paused
from osdp_jax.planner.budgets import compile_ahead, plan_budgets
from osdp_jax.planner.calibration import (
                           Calibrator,
                           ProbeKind,
                           RecordedCalibrator,
                           XlaCalibrator,
                           calibrate,
                           clear_probe_cache,
                           compile_threads,
)
from osdp_jax.planner.pipeline import PlanOptions
from osdp_jax.planner.problem import Problem, build_problem
from osdp_jax.runtime.step import clear_compiled

__all__ = ["Calibrator", "PlanOptions", "ProbeKind", "Problem", "RecordedCalibrator", "XlaCalibrator",
           "clear_probe_cache",
           "build_problem", "calibrate", "clear_compiled", "compile_ahead", "compile_threads", "gc_paused",
           "plan_budgets"]
