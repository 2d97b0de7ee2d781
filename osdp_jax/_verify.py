"""Verification: compile the chosen plan and check XLA's per-device peak against the budget.

If XLA needs more than the cost model predicted, the search runs again with the budget lowered by
the model's largest error so far (at most ``MAX_TRIES`` times); then the plan that needs the
least memory (``_search.least_memory``) is tried. If even that does not fit, its XLA peak is the
smallest budget to report.
"""
from __future__ import annotations

import logging
from typing import Callable

from ._search import InfeasibleBudgetError
from ._units import format_bytes

log = logging.getLogger("osdp_jax")

MAX_TRIES = 3


def verify(first, budget: int, search: Callable, least_memory: Callable, build: Callable,
           xla_peak: Callable):
    """The first plan, in order, whose XLA peak fits ``budget``, built with that peak recorded.

    Args:
      first: the search's choice (a candidate, as ``search`` returns it).
      budget: bytes per device.
      search: ``search(limit) -> candidate | None``, the best candidate under a lowered limit.
      least_memory: ``() -> candidate``, the candidate with the smallest predicted peak.
      build: ``build(candidate, xla_peak=None) -> Plan``.
      xla_peak: ``xla_peak(plan) -> bytes``, compiling the plan's step.

    Raises:
      InfeasibleBudgetError: no candidate fits by XLA; ``min_bytes`` is the least-memory plan's
        XLA peak.
    """
    best, error = first, 0.0
    for attempt in range(MAX_TRIES):
        plan = build(best)
        measured = xla_peak(plan)
        if measured <= budget:
            return build(best, measured)
        error = max(error, measured - plan.predicted_peak_bytes)
        log.info("plan attempt %d: XLA peak %s over budget %s; re-planning", attempt + 1,
                 format_bytes(measured), format_bytes(budget))
        best = search(budget - error)
        if best is None:
            break
    best = least_memory()
    measured = xla_peak(build(best))
    if measured <= budget:
        return build(best, measured)
    raise InfeasibleBudgetError(
        f"no plan fits a per-device budget of {format_bytes(budget)} ({budget} bytes) once compiled: the "
        f"plan that needs the least memory peaks at {format_bytes(measured)} by XLA; the smallest budget "
        f"that fits is {format_bytes(measured)} ({measured} bytes)", min_bytes=int(measured))
