"""Planning at several budgets: the verification compiles of the later budgets done ahead, at once.

``plan()`` at each of n budgets compiles the probes once (they are kept in the process) and then,
per budget, the chosen plan's step for XLA's figures: n verification compiles, one after the
other, each traced and lowered in Python and then compiled by XLA on one core. Those compiles
do not depend on each other, so
:func:`plan_budgets` plans the first budget alone (its probes compiled, what its compile taught
the planner kept: the pool overlap, the error margin), drafts every later budget by the cost
model (``plan(verify=False)``: a search, milliseconds), and compiles the drafts' steps together
(:func:`compile_ahead`): each traced in this thread while ``compile_threads()`` workers compile
those already lowered. Then it plans each later budget as ``plan()`` does, which finds its
draft's step compiled.

The plans are ``plan()``'s at those budgets, planned in that order: a compile done ahead only
spares ``plan()`` the compile. A budget whose draft XLA needs more for than the budget allows
re-plans as ``plan()`` does, compiling its next candidate then; and where an earlier budget's
verification taught the planner something that changes a later budget's choice, that budget's
draft was compiled for nothing (one compile, on a worker).
"""
from __future__ import annotations

import dataclasses

import jax

from osdp_jax.core.bytes import parse_bytes
from osdp_jax.core.gc import paused
from osdp_jax.core.layout import as_layout
from osdp_jax.core.plan import Plan
from osdp_jax.core.strategies import axes_size, data_axes
from osdp_jax.core.xla import profile_compiled
from osdp_jax.planner.calibration import _Sized, compile_threads
from osdp_jax.planner.loss import PlainLoss
from osdp_jax.planner.pipeline import PlanOptions, _batches, _optimizer, _progress, plan
from osdp_jax.planner.search import InfeasibleBudgetError
from osdp_jax.runtime.step import compile_count, compile_many


def _options(options: PlanOptions | None, kwargs: dict) -> PlanOptions:
    plan_options = dataclasses.replace(options or PlanOptions(), **kwargs)
    # one optimizer for every plan (``optimizer=None`` would make a new one, with its warning, in
    # each): the compiled steps are kept under it
    return dataclasses.replace(plan_options, optimizer=_optimizer(plan_options.optimizer))


@paused()
def compile_ahead(params, mesh, plans, options: PlanOptions | None = None, **kwargs) -> int:
    """Compile, for XLA's figures, the steps ``plan(verify=True)`` would compile to verify
    ``plans`` (drafts: ``plan(verify=False)``'s), all at once: each traced and lowered here, in
    order, while ``compile_threads()`` worker threads compile those already lowered. They are
    kept in the process (``planning.clear_compiled`` forgets them), with their XLA figures, read
    as each is done, so ``plan()`` verifying one of them compiles and reads nothing. ``options``/``kwargs``:
    ``plan()``'s (its ``loss_fn``, ``batch``,
    ``optimizer``, ``has_aux``, ``rng``, ``state`` and ``axis`` shape the step; the rest are not
    read). Plans of the same layout and batch are compiled once; one already kept is not compiled
    again. Returns the number of steps compiled. Without a loss function nothing is compiled."""
    plan_options = _options(options, kwargs)
    if plan_options.loss_fn is None:
        return 0
    loss_fn = PlainLoss.of(plan_options.loss_fn, plan_options.has_aux, plan_options.rng, plan_options.state)
    plans = list(plans)
    batches = _batches(loss_fn, plan_options.batch, sorted({p.batch_size for p in plans}),  # each plan's own size
                       axes_size(mesh, data_axes(mesh, plan_options.axis)))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    steps, seen = [], set()
    for p in plans:
        key = (as_layout(p), p.batch_size, p.microbatches)
        if key not in seen:
            seen.add(key)
            steps.append((loss_fn, plan_options.optimizer, abstract, batches[p.batch_size], mesh, p, "probe"))
    before = compile_count()
    for _, done in _progress(_Sized(compile_many(steps, compile_threads()), len(steps)),
                             "osdp-jax: compiling plans ahead"):
        # XLA's figures read here, while the workers compile the rest, not by each plan() after
        # (profile_compiled keeps them with the executable; 0.05 to 0.09 s a plan on gpt2-48l-1536)
        profile_compiled(*done)
    return compile_count() - before


@paused()
def plan_budgets(params, mesh, budgets, options: PlanOptions | None = None, **kwargs) -> list:
    """``plan()`` at each of ``budgets`` (bytes or strings such as ``"8GB"``), in that order: a
    list with, per budget, its :class:`Plan` or the :class:`InfeasibleBudgetError` ``plan()``
    raised there. The first budget is planned alone; the later budgets' verification compiles are
    done ahead, together (the module docstring). ``options``/``kwargs``: ``plan()``'s, except
    ``budget``. With ``verify`` False or ``"full"`` (each plan compiled to run), or no loss
    function, it is ``plan()`` at each budget in turn.

    Each plan's ``planning_seconds`` and ``compiles`` are its own ``plan()`` call's; a compile
    done ahead is counted in none of them (the wall time of all of them is what the sweep in
    ``osdp_jax/cli/sweep.py`` reports)."""
    if "budget" in kwargs:
        raise TypeError("plan_budgets takes budgets=[...], not budget=")
    if isinstance(budgets, (str, bytes, int, float)):
        raise TypeError(f"budgets must be a list of budgets, e.g. ['4GB', '8GB'], got {budgets!r}; for one "
                        f"budget use osdp_jax.plan(..., budget=...)")
    budgets = [parse_bytes(b) for b in budgets]  # a bad one raises before anything is planned or warned of
    plan_options = _options(options, kwargs)
    out = []
    for i, budget in enumerate(budgets):
        if i == 1 and plan_options.verify in (True, "figures") and plan_options.loss_fn is not None:
            drafts = [_tried(params, mesh, plan_options, b, verify=False) for b in budgets[1:]]
            compile_ahead(params, mesh, [d for d in drafts if isinstance(d, Plan)], plan_options)
        out.append(_tried(params, mesh, plan_options, budget))
    return out


def _tried(params, mesh, plan_options: PlanOptions, budget: int, **kwargs):
    try:
        return plan(params, mesh, plan_options, budget=budget, **kwargs)
    except InfeasibleBudgetError as e:
        return e


__all__ = ["compile_ahead", "plan_budgets"]
