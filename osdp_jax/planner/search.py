"""Exact search: the cheapest choice per item under a memory budget.

The problem (all memory in bytes per device, all time in seconds per step)::

    minimise    sum_i time[i, c_i]
    subject to  sum_i mem[i, c_i] + max_u sum_{i in u} transient[i, c_i]  <=  budget

``mem`` is memory held for the whole step (stored parameter, gradient and optimizer state);
``transient`` is memory alive only while the items of one *unit* run (a loop body that gathers its
weights): units run one after another, so only the largest unit's transient counts. Without units
the problem is the classic multiple-choice knapsack of the original OSDP.

Exactness, without rounding memory to a grid: the peak ``sum mem + max_k pool_k`` fits the
budget iff ``sum (mem + pool_k) <= budget`` for every pool k, a K-resource knapsack. One core,
:func:`solve_pools`, keeps the Pareto set of (time, resource_1..K) over partial assignments,
dropping a point only when another is no worse in time and every resource; identical items are
grouped and their choices enumerated as counts, which keeps 96 identical layers to one step, and
the groups are placed coarsest first (the largest memory step first), where the LP bound that cuts
partial plans is loosest.
:func:`solve`'s units are one-hot pools (:func:`unit_pools`), so it runs on the same core.
:func:`min_peak` and :func:`least_memory` give the least memory any assignment needs, directly.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import hashlib
import math
from collections.abc import Sequence

import numpy as np

_MAX_COMBOS = 200_000  # largest count enumeration for one group of identical items


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget (a ``ValueError``).

    Args:
      message: what did not fit, and the smallest budget that would.
      min_bytes: the smallest per-device budget, in bytes, under which a plan fits: the least
        memory any plan of the search space needs.

    Example:
      >>> try:                                                                   # doctest: +SKIP
      ...     osdp_jax.plan(params, mesh, budget=1, loss_fn=loss_fn, batch=batch)
      ... except osdp_jax.InfeasibleBudgetError as error:
      ...     least = error.min_bytes
    """

    def __init__(self, message: str, min_bytes: float):
        super().__init__(message)
        self.min_bytes = min_bytes


def _infeasible(budget: float, min_needed: float) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(f"no choice fits the budget {budget:.6g}; the smallest budget that fits "
                                 f"is {min_needed:.6g}", min_bytes=float(min_needed))


class BeyondBound(LookupError):
    """A bounded :class:`Front` holds no plan within the budget asked: the optimum, if any, is
    slower than its bound; search again with a higher one (:func:`fastest_front`)."""


@dataclasses.dataclass(frozen=True)
class Solution:
    """A search's optimum.

    Attributes:
      choices: ``choices[i]`` is the column (choice) item ``i`` takes.
      time: the summed time of the chosen entries (seconds, or whatever unit the tables are in).
      mem: the peak memory of the choice: the sum over items, plus the largest transient.
    """

    choices: np.ndarray
    time: float
    mem: float


def _compositions(n: int, c: int) -> np.ndarray:
    """All vectors of c non-negative ints summing to n, shape (comb(n+c-1, c-1), c)."""
    partial = np.zeros((1, 0), dtype=np.int64)
    for _ in range(c - 1):
        used = partial.sum(axis=1)
        reps = n - used + 1
        rows = np.repeat(np.arange(len(partial)), reps)
        # for each partial row, the next count runs 0..n-used
        nxt = np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps)
        partial = np.concatenate([partial[rows], nxt[:, None]], axis=1)
    return np.concatenate([partial, (n - partial.sum(axis=1))[:, None]], axis=1)


def solve(time_cost, mem_cost, budget: float, *, transient=None,
          units: Sequence[int] | None = None) -> Solution:
    """Exact optimum of the per-item choice under a memory budget.

    Args:
      time_cost: ``(n_items, n_choices)`` seconds; ``inf`` marks a choice the item does not have.
      mem_cost: ``(n_items, n_choices)`` bytes (any unit, as long as ``budget`` uses the same).
      budget: the memory limit.
      transient: optional ``(n_items, n_choices)`` memory alive only while the item's unit runs.
      units: optional unit id per item for ``transient``; by default each item is its own unit.
        Items with ``units[i] < 0`` have no transient.

    Returns:
      A :class:`Solution`.

    Raises:
      InfeasibleBudgetError: when no assignment fits, with the smallest budget that would.

    >>> solve([[1.0, 2.0]], [[10.0, 5.0]], budget=8).choices
    array([1])
    """
    time_cost = np.asarray(time_cost, dtype=np.float64)
    mem_cost = np.asarray(mem_cost, dtype=np.float64)
    if time_cost.ndim != 2 or time_cost.shape != mem_cost.shape:
        raise ValueError(f"time_cost and mem_cost must be 2-D arrays of one shape, got "
                         f"{time_cost.shape} and {mem_cost.shape}")
    return solve_pools(time_cost, mem_cost, unit_pools(time_cost.shape, transient, units), budget)


def unit_pools(shape, transient=None, units=None) -> np.ndarray:
    """``solve``'s units as pools: unit u's transient memory is pool u (one-hot), so the peak's
    ``max_u`` is ``solve_pools``' max over pools. Items with ``units[i] < 0`` add to no pool."""
    n, c = shape
    if transient is None:
        return np.zeros((n, c, 1))
    transient = np.asarray(transient, dtype=np.float64)
    units = list(range(n)) if units is None else [int(u) for u in units]
    ids = sorted({u for u in units if u >= 0})
    pools = np.zeros((n, c, max(len(ids), 1)))
    for i, u in enumerate(units):
        if u >= 0:
            pools[i, :, ids.index(u)] = transient[i]
    return pools


def _dominance_prune(time: np.ndarray, res: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Indices of points within ``cap`` that no other point beats in time and every resource.

    Points are visited by time; a point is kept unless an earlier kept point needs no more of
    every resource. For one or two resources the earlier points are summarised by a staircase
    (O(F log F)); for more, compared directly.
    """
    ok = np.flatnonzero((res <= cap).all(axis=1))
    order = ok[np.lexsort((*res[ok].T[::-1], time[ok]))]
    k = res.shape[1]
    if k == 1:
        r = res[order, 0]
        best_before = np.minimum.accumulate(np.concatenate([[np.inf], r[:-1]]))
        return order[r < best_before]
    if k == 2:
        kept = []
        xs: list[float] = []  # staircase of kept points: r1 ascending, r2 strictly descending
        ys: list[float] = []
        rs = res[order]
        start, step = 0, 32
        while start < len(order):
            chunk = rs[start:start + step]
            # vectorised first pass against the staircase so far; survivors go one by one
            if xs:
                pos = np.searchsorted(np.asarray(xs), chunk[:, 0], side="right")
                stair_y = np.concatenate([[np.inf], ys])[pos]
                alive = np.flatnonzero(stair_y > chunk[:, 1])
            else:
                alive = np.arange(len(chunk))
            for j, (x, y) in zip(alive.tolist(), chunk[alive].tolist()):
                pos = bisect.bisect_right(xs, x)
                if pos and ys[pos - 1] <= y:
                    continue
                kept.append(order[start + j])
                end = pos
                while end < len(xs) and ys[end] >= y:
                    end += 1
                xs[pos:end] = [x]
                ys[pos:end] = [y]
            start, step = start + step, min(2 * step, 4096)
        return np.array(kept, dtype=np.int64)
    kept = []
    kept_res = np.empty((len(order), k))
    for idx in order:
        r = res[idx]
        if kept and (kept_res[:len(kept)] <= r).all(axis=1).any():
            continue
        kept_res[len(kept)] = r
        kept.append(idx)
    return np.array(kept, dtype=np.int64)


def solve_pools(time_cost, mem_cost, pools, budget: float) -> Solution:
    """Exact optimum when transient memory goes to one of K pools that never overlap in time.

    ``pools[i, c, k]`` is the transient bytes that item i adds to pool k under choice c; the peak
    is ``sum_i mem[i, c_i] + max_k sum_i pools[i, c_i, k]``, so the budget holds exactly when, for
    every pool k, ``sum_i (mem + pools[..., k]) <= budget``: a K-resource knapsack, solved on the
    Pareto set of (time, resource_1..K) with identical items grouped (:func:`pareto_front`).
    """
    return fastest_front(time_cost, mem_cost, pools, budget).best(budget)


@dataclasses.dataclass(frozen=True)
class Front:
    """The Pareto set of whole assignments within ``budget``: no point is beaten by another in
    time and every resource. It holds the optimum for ``budget`` and for any smaller one (a
    point that fits less is dominated only by points that fit it too), so a search repeated under
    a lowered budget (``_verify``) is a filter of it, not a new search."""

    budget: float
    time: np.ndarray  # (F,) seconds of each point
    res: np.ndarray  # (F, K) bytes of each point per pool
    stages: list  # per group of identical items: (items, cols, counts, previous point, counts row)
    costs: tuple  # (time_cost, mem_cost, pools, res per item and choice, ok)
    bound: float = math.inf  # seconds: only the plans no slower are held (pareto_front's time_bound)

    def best(self, budget: float) -> Solution:
        """The fastest point within ``budget`` (at most the front's), as a :class:`Solution`; of
        points as fast (within 1e-12 of its seconds: sums of the same choices taken in another
        order differ in the last bits), the one of least peak (``max_k`` of its resources)."""
        if budget > self.budget:
            raise ValueError(f"this front holds the plans within {self.budget:.6g}, not {budget:.6g}")
        _, _, _, res, ok = self.costs
        cap = budget + abs(budget) * 1e-12
        fits = np.flatnonzero((self.res <= cap).all(axis=1))
        if not len(fits) and math.isfinite(self.bound):
            raise BeyondBound(f"no plan within {budget:.6g} is as fast as this front's bound, "
                              f"{self.bound:.6g} s")
        if not len(fits):
            raise _infeasible(budget, _min_peak(res, ok))
        fastest = self.time[fits].min()
        ties = fits[self.time[fits] <= fastest + abs(fastest) * 1e-12]
        return self._solution(int(ties[np.argmin(self.res[ties].max(axis=1))]))

    def _solution(self, point: int) -> Solution:
        time_cost, mem_cost, pools, _, _ = self.costs
        n = time_cost.shape[0]
        choices = np.zeros(n, dtype=np.int64)
        for items, cols, counts, fi, gi in reversed(self.stages):
            choices[items] = np.repeat(cols, counts[gi[point]])
            point = fi[point]
        idx = np.arange(n)
        peak = float(mem_cost[idx, choices].sum() + pools[idx, choices].sum(axis=0).max())
        return Solution(choices, float(time_cost[idx, choices].sum()), peak)


def pareto_front(time_cost, mem_cost, pools, budget: float, time_bound: float = math.inf) -> Front:
    """The :class:`Front` of :func:`solve_pools`' problem within ``budget``; with ``time_bound``
    (seconds, the time of a plan known to fit), only of the plans no slower than it: a partial
    assignment is dropped once its time plus the least time of the items left exceeds the bound,
    which keeps the search exact for the optimum and makes it short when the bound is close."""
    time_cost = np.asarray(time_cost, dtype=np.float64)
    mem_cost = np.asarray(mem_cost, dtype=np.float64)
    pools = np.asarray(pools, dtype=np.float64)
    n, c = time_cost.shape
    res = mem_cost[:, :, None] + pools  # (n, c, K)
    ok = np.isfinite(time_cost) & np.isfinite(res).all(axis=2)
    if n and not ok.any(axis=1).all():
        raise ValueError(f"item {int(np.flatnonzero(~ok.any(axis=1))[0])} has no available choice (every entry is inf)")
    k = res.shape[2]
    cap = np.full(k, budget + abs(budget) * 1e-12)
    floor = np.array([res[i, ok[i]].min(axis=0) for i in range(n)]).reshape(n, k)
    need = floor.sum(axis=0)
    if (need > cap).any():
        raise _infeasible(budget, _min_peak(res, ok))
    groups: dict[bytes, list[int]] = {}
    for i in range(n):
        key = np.where(ok[i][:, None], res[i], np.inf).tobytes() + time_cost[i].tobytes()
        groups.setdefault(key, []).append(i)
    groups = {(key, j): part for key, items in groups.items()
              for j, part in enumerate(_chunks(items, int(ok[items[0]].sum())))}
    # coarsest first: the hull bound of the items after a stage is the LP bound, loose by about
    # the largest step one of them can take (a layer's remat policy, hundreds of MiB, bought in
    # part); once those are placed, the bound of the rest is nearly exact and cuts the partial
    # plans early (gpt2-48l-1536's search at 12 GB: 1.3 s in the items' order, 0.06 s so)
    step = {g: float(np.ptp(res[items[0], ok[items[0]]], axis=0).max()) for g, items in groups.items()}
    groups = dict(sorted(groups.items(), key=lambda kv: -step[kv[0]]))
    remaining = need.copy()
    bounded = math.isfinite(time_bound)
    if bounded:
        least_from = _hull_bounds(time_cost, res, ok, list(groups.values()))
    # sums taken in another order differ in the last bits: the bound's own plan is never dropped
    slack = 1e-9 * (abs(time_bound) + np.abs(np.where(ok, time_cost, 0.0)).max(axis=1).sum()) + 1e-12
    f_time, f_res = np.zeros(1), np.zeros((1, k))
    stages = []  # per group: (items, cols, counts, index of the previous point, index into counts)
    for stage, items in enumerate(groups.values()):
        i0 = items[0]
        cols = np.flatnonzero(ok[i0])
        remaining -= floor[i0] * len(items)
        counts = _compositions(len(items), len(cols))
        g_time = counts @ time_cost[i0, cols]
        g_res = counts @ res[i0, cols]
        keep = _dominance_prune(g_time, g_res, cap - remaining - f_res.min(axis=0))
        if bounded:
            least = least_from[stage + 1](cap - f_res.min(axis=0) - g_res[keep])
            keep = keep[g_time[keep] + f_time.min() + least <= time_bound + slack]
        g_time, g_res, counts = g_time[keep], g_res[keep], counts[keep]
        all_time = (f_time[:, None] + g_time[None, :]).ravel()
        all_res = (f_res[:, None, :] + g_res[None, :, :]).reshape(-1, k)
        if bounded:  # no completion within the bound: as if over the budget
            all_res[all_time + least_from[stage + 1](cap - all_res) > time_bound + slack] = np.inf
        keep = _dominance_prune(all_time, all_res, cap - remaining)
        if not len(keep) and not bounded:
            raise _infeasible(budget, _min_peak(res, ok))
        fi, gi = np.divmod(keep, len(g_time))
        stages.append((items, cols, counts, fi, gi))
        f_time, f_res = all_time[keep], all_res[keep]
        if not len(keep):  # nothing within the bound
            break
    return Front(float(budget), f_time, f_res, stages, (time_cost, mem_cost, pools, res, ok), float(time_bound))


def _digest(x) -> object:
    """A hashable stand-in for an argument of a kept search: an array by its shape, dtype and bytes."""
    if isinstance(x, np.ndarray):
        return x.shape, x.dtype.str, hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=16).digest()
    return x


def _nbytes(x) -> int:
    """Bytes of the arrays ``x`` holds: a :class:`Front`'s points and tables, 0 for a number."""
    if isinstance(x, np.ndarray):
        return x.nbytes
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(v) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return sum(_nbytes(getattr(x, f.name)) for f in dataclasses.fields(x))
    return 0


def _kept(fn):
    """``fn`` (a pure function of arrays and numbers) with its results kept by the arguments'
    contents, the newest :data:`KEEP` of them within :data:`KEEP_BYTES` of arrays: planning
    again at the same budget (a budget sweep's draft, then its verified plan; ``plan()`` re-run)
    repeats its searches. The arrays are copied before the call, so a result holds none a caller
    may change."""
    kept: collections.OrderedDict = collections.OrderedDict()  # key -> (result, its bytes)
    held = [0]  # bytes of the kept results

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        key = (tuple(_digest(np.asarray(a) if isinstance(a, (list, np.ndarray)) else a) for a in args),
               tuple(sorted((k, _digest(v)) for k, v in kwargs.items())))
        if key in kept:
            kept.move_to_end(key)
            return kept[key][0]
        args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        out = fn(*args, **kwargs)
        kept[key] = out, _nbytes(out)
        held[0] += kept[key][1]
        while len(kept) > KEEP or (held[0] > KEEP_BYTES and len(kept) > 1):
            held[0] -= kept.popitem(last=False)[1][1]
        return out

    def clear():
        kept.clear()
        held[0] = 0

    wrapper.clear = clear
    return wrapper


KEEP = 1024  # searches kept per kept function
KEEP_BYTES = 64 << 20  # of arrays in the kept results, per kept function


def clear_kept() -> None:
    """Forget the kept searches (``planning.clear_probe_cache`` does, for a cold plan)."""
    lower_bound.clear()
    fastest_front.clear()
    _hull_tables.clear()


@_kept
def lower_bound(time_cost, mem_cost, pools, budget: float) -> float:
    """A lower bound on the optimum's seconds under ``budget``: the LP relaxation of each
    resource's knapsack (``_hull_bounds``); ``inf`` when even that fits no plan, ``-inf``
    for no items."""
    time_cost = np.asarray(time_cost, dtype=np.float64)
    res = np.asarray(mem_cost, dtype=np.float64)[:, :, None] + np.asarray(pools, dtype=np.float64)
    ok = np.isfinite(time_cost) & np.isfinite(res).all(axis=2)
    if not time_cost.shape[0] or not ok.any(axis=1).all():
        return -math.inf if not time_cost.shape[0] else math.inf
    least = _hull_bounds(time_cost, res, ok, [[i] for i in range(time_cost.shape[0])], first_only=True)[0]
    return float(least(np.full(res.shape[2], budget + abs(budget) * 1e-12)))


@_kept
def fastest_front(time_cost, mem_cost, pools, budget: float, give_up: float = math.inf,
                  steps=tuple(0.002 * 2 ** i for i in range(9)), lb: float | None = None) -> Front:
    """:func:`pareto_front` under time bounds raised from the LP bound of the whole problem until
    a front holds a plan within ``budget``: the optimum, exactly (a bounded front holds every
    plan no slower than its bound). A bound below the optimum leaves nothing, quickly, since
    every partial plan is cut by the hull bound of the items after it; the bounds tried are
    ``lb + step * scale`` seconds for ``steps`` (0.2% doubling to 51%: a plan is found at a
    bound at most twice as far above the LP bound as the optimum, and the fronts grow with that
    distance), ``scale = max(|lb|, 1e-3 * spread)`` (``spread``,
    the sum of each item's slowest less fastest seconds), then none. ``give_up`` (seconds): the
    last bound, no search beyond it (an empty front when no plan within ``budget`` is as fast).
    ``lb``: :func:`lower_bound` of these tables under ``budget``, when the caller has it.

    Raises:
      InfeasibleBudgetError: when no assignment fits (an unbounded search found none).
    """
    lb = lower_bound(time_cost, mem_cost, pools, budget) if lb is None else lb
    if math.isfinite(lb):
        t = np.asarray(time_cost, dtype=np.float64)
        t = np.where(np.isfinite(t), t, np.nan)
        scale = max(abs(lb), 1e-3 * float(np.nansum(np.nanmax(t, axis=1) - np.nanmin(t, axis=1))), 1e-12)
        for step in steps:
            bound = lb + step * scale
            if bound >= give_up:
                break
            front = pareto_front(time_cost, mem_cost, pools, budget, bound)
            if len(front.time):
                return front
    return pareto_front(time_cost, mem_cost, pools, budget, give_up)


def _hull_bounds(time_cost, res, ok, stages, first_only: bool = False):
    """Per stage s, ``least(left)``: a lower bound on the seconds the items of stages s, s+1, ... need
    when ``left[..., k]`` bytes of resource k remain for them, for (F, K) ``left``.

    For each resource alone, the items' choices relaxed to their convex hull (fractions of a
    choice allowed): from every item's least-resource choice, the hull's segments are bought in
    order of seconds saved per byte, so ``least_k(m) = T0 + interp(m - M0, cum bytes, cum
    seconds)``, the knapsack's LP bound; over the resources, the largest. A bound, not a plan:
    the real items need at least as many seconds, so a partial plan whose seconds plus the bound
    exceed the time bound cannot complete to a plan within it. ``inf`` where ``left`` is below
    the least resource any completion needs. ``first_only``: stage 0's alone (every item).

    The hulls do not depend on the budget: they are kept by the tables' contents
    (:func:`_hull_tables`), so the searches of one model at other budgets (a sweep's, a
    re-plan's) build none again.
    """
    return [_least(fns) for fns in _hull_tables(time_cost, res, ok, tuple(map(tuple, stages)), first_only)]


def _least(fns):
    """``least(left)`` of one start stage's ``(M0, cum bytes, cum seconds)`` per resource."""
    def least(left):
        left = np.asarray(left, dtype=np.float64)
        out = np.full(left.shape[:-1], -math.inf)
        for r, (m0, cm, ct) in enumerate(fns):
            m = left[..., r] - m0
            out = np.maximum(out, np.where(m >= -abs(m0) * 1e-12, np.interp(m, cm, ct), math.inf))
        return out
    return least


@_kept
def _hull_tables(time_cost, res, ok, stages: tuple, first_only: bool) -> list:
    """:func:`_hull_bounds`' tables: per start stage, per resource, ``(M0, cum bytes, cum seconds)``."""
    k = res.shape[2]
    per_stage = []  # per stage, per resource: (seconds at the least bytes, least bytes, segments)
    for items in stages:
        i0, count = items[0], len(items)
        cols = np.flatnonzero(ok[i0])
        per_res = []
        for r in range(k):
            hull: list[tuple[float, float]] = []
            for m, t in sorted(zip(res[i0, cols, r].tolist(), time_cost[i0, cols].tolist())):
                if hull and t >= hull[-1][1]:  # bytes ascending, seconds strictly falling
                    continue
                while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (m - hull[-2][0])
                                          >= (t - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
                    hull.pop()  # not convex: the middle point is on or above the chord
                hull.append((m, t))
            per_res.append((hull[0][1] * count, hull[0][0] * count,
                            [((b[0] - a[0]) * count, (b[1] - a[1]) * count) for a, b in zip(hull, hull[1:])]))
        per_stage.append(per_res)
    bounds = [[] for _ in range(1 if first_only else len(stages) + 1)]  # per start stage, per resource
    for r in range(k):  # every stage's hull segments, in order of seconds per byte
        seg = [(st, dm, dt) for st, x in enumerate(per_stage) for dm, dt in x[r][2]]
        st, dm, dt = (np.array(v, dtype=np.float64).reshape(-1) for v in zip(*seg)) if seg else (np.zeros(0),) * 3
        order = np.argsort(dt / np.where(dm > 0, dm, 1.0), kind="stable")
        st, dm, dt = st[order], dm[order], dt[order]
        # seconds and bytes at the least bytes of stages s.. (0 after the last)
        t0 = np.append(np.cumsum([x[r][0] for x in per_stage][::-1])[::-1], 0.0)
        m0 = np.append(np.cumsum([x[r][1] for x in per_stage][::-1])[::-1], 0.0)
        for s, fns in enumerate(bounds):
            later = st >= s
            cm = np.concatenate([[0.0], np.cumsum(dm[later])])
            ct = np.concatenate([[0.0], np.cumsum(dt[later])]) + t0[s]
            fns.append((float(m0[s]), cm, ct))
    return bounds


def _chunks(items: list[int], choices: int) -> list[list[int]]:
    """``items`` (identical) in as few runs as keep each run's count enumeration within
    ``_MAX_COMBOS``: the Pareto merge of the runs is as exact as one enumeration."""
    size = len(items)
    while size > 1 and math.comb(size + choices - 1, choices - 1) > _MAX_COMBOS:
        size = (size + 1) // 2
    return [items[i:i + size] for i in range(0, len(items), size)]


def min_peak(mem_cost, pools) -> float:
    """The smallest peak ``sum_i mem[i, c_i] + max_k sum_i pools[i, c_i, k]`` over all
    assignments (``inf`` marks a missing choice): the least memory any plan needs."""
    res = np.asarray(mem_cost, dtype=np.float64)[:, :, None] + np.asarray(pools, dtype=np.float64)
    return _min_peak(res, np.isfinite(res).all(axis=2))


def least_memory(time_cost, mem_cost, pools) -> Solution:
    """The fastest assignment among those with the smallest peak.

    Args:
      time_cost: ``(items, choices)`` time of each choice; ``inf`` marks a missing one.
      mem_cost: ``(items, choices)`` memory of each choice.
      pools: ``(items, choices, K)`` bytes each choice adds to K memory pools that share one peak.

    Returns:
      The :class:`Solution` of least peak (:func:`min_peak`), the fastest of equals.
    """
    floor = min_peak(mem_cost, pools)
    return solve_pools(time_cost, mem_cost, pools, floor * (1 + 1e-9) + 1e-9)


def _min_peak(res: np.ndarray, ok: np.ndarray) -> float:
    """The smallest ``max_k sum_i res[i, c_i, k]`` over all assignments (by the same search)."""
    n, _, k = res.shape
    pts = np.zeros((1, k))
    for i in range(n):
        cand = (pts[:, None, :] + res[i, ok[i]][None, :, :]).reshape(-1, k)
        keep = _dominance_prune(np.zeros(len(cand)), cand, np.full(k, np.inf))
        pts = cand[keep]
    return float(pts.max(axis=1).min())
