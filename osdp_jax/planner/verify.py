"""Verification: compile the chosen plan and check XLA's per-device peak against the budget.

If XLA needs more than the cost model predicted, the search runs again (at most ``MAX_TRIES``
times), under a budget lowered by the model's error, and with what the misses taught it:

- a miss with no earlier attempt at its batch size to compare with lowers the budget by
  :data:`LIKE` times its error e (bytes), as an error shared by every plan: errors within that
  factor of each other are taken for one (the next plan's error is another draw of it; lowered
  by the error alone, the next plan near the budget tends to miss again by a little).
  When no plan fits under that, the budget is lowered by e alone (a large error, such as a
  wrong pool overlap's 7%, doubled can leave nothing but a probe's layout);
- a later miss of error e_b, compared with the earlier attempt a of the same batch size that
  differs from it in the fewest items D, is put down to what changed when e_b is over
  :data:`LIKE` times e_a (or e_a <= 0 < e_b); otherwise it lowers the budget too, as a shared
  error (a wrong pool overlap misses every mixed plan by a like share, and ``_planner`` refits
  it afterwards). Put down to what changed: for each item in D, every choice but a's costs
  e_b - e_a bytes more in the next searches (a lesson, :class:`Lesson`), and the budget stays
  as it was. So a plan whose one changed layer XLA needs 1 GiB more for is not paid for by
  lowering the whole budget by 1 GiB.

An earlier plan of the same model that XLA needed more for than predicted leaves that error e_c
carried in (``shared``, from ``_planner``'s per-model record, kept as a share of the plan's
prediction): a first miss here then lowers the budget by max(e_c, e), two errors seen, not LIKE
times one.

Then the plan that needs the least memory (``_search.least_memory``) is tried. If even that does
not fit, its XLA peak is the smallest budget to report.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import numpy as np

from osdp_jax.core.bytes import format_bytes
from osdp_jax.core.plan import Plan
from osdp_jax.planner.search import InfeasibleBudgetError

log = logging.getLogger("osdp_jax")

MAX_TRIES = 3
LIKE = 2.0  # errors within this factor of each other are one error (see the module docstring)


class Superseded(Exception):
    """:func:`verify` stopped early: the plan it could search for next is predicted slower than
    ``floor`` (another run's plan, ``_planner._fastest``)."""


@dataclasses.dataclass(frozen=True)
class Lesson:
    """What a missed plan taught: at batch size ``size``, moving any item of ``items`` off its
    choice in ``choices`` (the earlier attempt's) costs ``excess`` bytes more than the model said."""

    size: object
    items: np.ndarray  # indices of the items that changed
    choices: np.ndarray  # the earlier attempt's choice of every item
    excess: float  # bytes

    def penalty(self, shape) -> np.ndarray:
        """``(n_items, n_choices)`` bytes to add to the memory table at ``size``."""
        out = np.zeros(shape)
        out[self.items] = self.excess
        out[self.items, self.choices[self.items]] = 0.0
        return out


def _same(a, b) -> bool:
    """Two candidates of the same batch size and choices."""
    return a[1] == b[1] and np.array_equal(a[2].choices, b[2].choices)


def _lesson(missed, error: float, attempts: list) -> Lesson | None:
    """The lesson of ``missed`` (XLA ``error`` bytes over its prediction) against the earlier
    attempt of its batch size with the fewest changed items; None when there is none."""
    same = [(c, e) for c, e in attempts if c[1] == missed[1] and len(c[2].choices) == len(missed[2].choices)]
    if not same:
        return None
    ref, ref_error = min(same, key=lambda ce: int((ce[0][2].choices != missed[2].choices).sum()))
    changed = np.flatnonzero(ref[2].choices != missed[2].choices)
    if not len(changed) or error <= max(ref_error, LIKE * ref_error):
        return None  # an error like the earlier one's: one every plan shares (a pool overlap off)
    return Lesson(missed[1], changed, np.asarray(ref[2].choices), float(error - ref_error))


def verify(first, budget: int, search: Callable, least_memory: Callable, build: Callable,
           xla_peak: Callable, known=(), floor: float | None = None, shared: float = 0.0,
           errors: list | None = None):
    """The best plan whose XLA peak fits ``budget``, built with that peak recorded.

    Args:
      first: the search's choice (a candidate, as ``search`` returns it), or None when the cost
        model found none.
      budget: bytes per device.
      search: ``search(limit, lessons) -> candidate | None``, the best candidate under a lowered
        limit, each :class:`Lesson`'s penalty added to the memory of its batch size's choices.
      least_memory: ``() -> candidate``, the candidate with the smallest predicted peak.
      build: ``build(candidate, xla_peak=None) -> Plan``.
      xla_peak: ``xla_peak(plan) -> bytes``, compiling the plan's step.
      known: ``(candidate, xla_peak)`` pairs already compiled (the calibration probes): a choice
        among them is verified by its figure, with no compile. When the search's choices do not
        fit, the fastest known one that fits is taken unless the least-memory candidate is
        predicted faster and fits; the minimum reported never exceeds a peak that was measured.
      shared: bytes, an earlier plan's error carried in (see the module docstring); 0: none.
      errors: when given, each compiled plan XLA needed more for than predicted (a miss not put
        down to what it changed, or the plan that fits) appends that error as a share of its
        predicted peak (``_planner`` keeps the largest for the model).
      floor: when the search's choice does not fit and what it finds next is predicted slower
        than this (samples/s, a candidate's first field), or it finds nothing, give up at once
        (:class:`Superseded`): another plan predicted that fast is waiting to be verified.

    Raises:
      Superseded: see ``floor``.
      InfeasibleBudgetError: nothing fits by XLA; ``min_bytes`` is the smallest XLA peak measured
        (the least-memory plan's or a probe's).
    """
    plan = _search_until_it_fits(first, budget, search, build, xla_peak, known, floor, shared, errors)
    return plan if plan is not None else _fall_back(budget, least_memory, build, xla_peak, known)


def _search_until_it_fits(best, budget: int, search: Callable, build: Callable, xla_peak: Callable, known,
                          floor, shared: float, errors) -> Plan | None:
    """``best`` compiled, and, while XLA's peak is over the budget, the search's next choice under
    a budget lowered by the error (or with the error charged to what changed: a :class:`Lesson`),
    at most :data:`MAX_TRIES` times; the first that fits, with its peak, or None."""
    attempts, lessons, carried = [], [], shared
    for attempt in range(MAX_TRIES if best is not None else 0):
        plan = build(best)
        measured = next((peak for c, peak in known if _same(c, best)), None)  # a probe's layout: compiled
        measured = xla_peak(plan) if measured is None else measured
        error = measured - plan.predicted_peak_bytes
        if measured <= budget:
            if errors is not None and error > 0:  # it fits, but XLA needed more than the model said
                errors.append(error / plan.predicted_peak_bytes)
            return build(best, measured)
        lesson = _lesson(best, error, attempts)
        if lesson is None:
            shared = max(shared, error)
            if errors is not None:
                errors.append(error / plan.predicted_peak_bytes)
        else:
            lessons.append(lesson)
        attempts.append((best, error))
        log.info("plan attempt %d: XLA peak %s (predicted %s) over budget %s; re-planning%s", attempt + 1,
                 format_bytes(measured), format_bytes(plan.predicted_peak_bytes), format_bytes(budget),
                 "" if lesson is None else f" with its {len(lesson.items)} changed item(s) charged "
                 f"{format_bytes(lesson.excess)} more")
        # one error seen: LIKE times it; with an earlier plan's error carried in, the larger of the two
        margin = shared if carried > 0 and len(attempts) == 1 else LIKE * shared
        best = search(budget - margin, tuple(lessons))
        if best is None and shared > 0:  # nothing under twice the error: under the error itself
            margin = shared
            best = search(budget - margin, tuple(lessons))
        if floor is not None and (best is None or best[0] < floor):
            raise Superseded(f"re-planning under {format_bytes(budget - margin)} is predicted slower than {floor:.4g}")
        if best is None:
            return None
    return None


def _fall_back(budget: int, least_memory: Callable, build: Callable, xla_peak: Callable, known):
    """When no searched plan fits: the least-memory candidate if it is predicted faster than the
    fastest compiled probe that fits and fits itself, else that probe; else
    ``InfeasibleBudgetError`` with the smallest XLA peak measured."""
    fits = [(c, peak) for c, peak in known if peak <= budget]
    best_known = max(fits, key=lambda cp: cp[0][0]) if fits else None
    peaks = [peak for _, peak in known]
    least = least_memory()
    if best_known is None or least[0] > best_known[0][0]:
        measured = xla_peak(build(least))
        if measured <= budget:
            return build(least, measured)
        peaks.append(measured)
    if best_known is not None:
        log.info("taking a compiled probe's layout: its XLA peak %s fits", format_bytes(best_known[1]))
        return build(*best_known)
    smallest = int(min(peaks))
    raise InfeasibleBudgetError(
        f"no plan fits a per-device budget of {format_bytes(budget)} ({budget} bytes) once compiled: the "
        f"least memory a compiled plan needed is {format_bytes(smallest)} by XLA; the smallest budget that "
        f"fits is {format_bytes(smallest)} ({smallest} bytes)", min_bytes=smallest)
