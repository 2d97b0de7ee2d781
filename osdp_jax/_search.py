"""Exact search: the cheapest choice per item under a memory budget.

The problem (all memory in bytes per device, all time in seconds per step)::

    minimise    sum_i time[i, c_i]
    subject to  sum_i mem[i, c_i] + max_u sum_{i in u} transient[i, c_i]  <=  budget

``mem`` is memory held for the whole step (stored parameter, gradient and optimizer state);
``transient`` is memory alive only while the items of one *unit* run (a loop body that gathers its
weights): units run one after another, so only the largest unit's transient counts. Without units
the problem is the classic multiple-choice knapsack of the original OSDP.

Exactness, without rounding memory to a grid: the search keeps the Pareto frontier of
(memory, time) over partial assignments, where a point is dropped only when another point is no
worse in both and that holds for every completion (sums are monotone). The max term is handled by
enumerating its value T over the finite set of values it can take, each unit restricted to
configurations with transient <= T, and the budget lowered by T. Identical items are grouped and
their choices enumerated as counts, which keeps 96 identical layers to one step.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

_MAX_COMBOS = 200_000  # largest count enumeration for one group of identical items


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget. ``min_bytes`` is the smallest budget that would fit."""

    def __init__(self, message: str, min_bytes: float):
        super().__init__(message)
        self.min_bytes = min_bytes


def _infeasible(budget: float, min_needed: float) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(f"no choice fits the budget {budget:.6g}; the smallest budget that fits "
                                 f"is {min_needed:.6g}", min_bytes=float(min_needed))


@dataclasses.dataclass(frozen=True)
class Solution:
    """The optimum: ``choices[i]`` is item i's column; ``time`` and ``mem`` (peak, with transient)."""

    choices: np.ndarray
    time: float
    mem: float


@dataclasses.dataclass
class _Frontier:
    """Pareto points sorted by memory ascending, time strictly descending, with back-pointers."""

    mem: np.ndarray
    time: np.ndarray
    back: list  # callable(point index) -> list of (item, choice)


def _pareto(mem: np.ndarray, time: np.ndarray) -> np.ndarray:
    """Indices of the Pareto-optimal points (no other point has both mem and time <= )."""
    order = np.lexsort((time, mem))
    t_sorted = time[order]
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], t_sorted[:-1]]))
    return order[t_sorted < best_before]


def _group_frontier(items: list[int], t: np.ndarray, m: np.ndarray, choice_ids: np.ndarray,
                    mem_cap: float) -> _Frontier:
    """Frontier of n identical items, each with the same choice rows ``t``, ``m``."""
    n, c = len(items), len(t)
    n_combos = math.comb(n + c - 1, c - 1)
    if c == 1 or n_combos <= _MAX_COMBOS:
        # All count vectors (k_0..k_{c-1}) summing to n, by stars and bars.
        counts = _compositions(n, c)
        mem, time = counts @ m, counts @ t
        keep = _pareto(mem, time)
        keep = keep[mem[keep] <= mem_cap]
        counts = counts[keep]

        def back(k, counts=counts):
            out, pos = [], 0
            for col, cnt in enumerate(counts[k]):
                out += [(items[pos + j], int(choice_ids[col])) for j in range(cnt)]
                pos += cnt
            return out

        return _Frontier(mem[keep], time[keep], [back])
    frontier = _single_frontier(items[0], t, m, choice_ids)
    for item in items[1:]:
        frontier = _merge(frontier, _single_frontier(item, t, m, choice_ids), mem_cap)
    return frontier


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


def _single_frontier(item: int, t, m, choice_ids) -> _Frontier:
    keep = _pareto(m, t)
    return _Frontier(m[keep], t[keep], [lambda k, keep=keep: [(item, int(choice_ids[keep[k]]))]])


def _merge(a: _Frontier, b: _Frontier, mem_cap: float) -> _Frontier:
    """Minkowski sum of two frontiers, pruned to the Pareto set within ``mem_cap``."""
    mem = (a.mem[:, None] + b.mem[None, :]).ravel()
    time = (a.time[:, None] + b.time[None, :]).ravel()
    keep = _pareto(mem, time)
    keep = keep[mem[keep] <= mem_cap]
    ia, ib = np.divmod(keep, len(b.mem))

    def back(k):
        return a.back[0](ia[k]) + b.back[0](ib[k])

    return _Frontier(mem[keep], time[keep], [back])


def _solve_additive(rows: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], cap: float):
    """min sum time s.t. sum mem <= cap over items given as (item, time, mem, choice_ids).

    Returns (time, mem, [(item, choice)]) or None when nothing fits.
    """
    groups: dict[tuple, list] = {}
    for item, t, m, ids in rows:
        key = (t.tobytes(), m.tobytes(), ids.tobytes())
        groups.setdefault(key, [t, m, ids, []])[3].append(item)
    # Memory that the other groups need at the least, so a partial point that cannot be completed
    # within the cap is dropped early.
    mins = [len(g[3]) * g[1].min() for g in groups.values()]
    remaining = sum(mins)
    frontier = None
    for (t, m, ids, items), min_here in zip(groups.values(), mins):
        remaining -= min_here
        group = _group_frontier(items, t, m, ids, cap - remaining - (frontier.mem[0] if frontier else 0))
        frontier = group if frontier is None else _merge(frontier, group, cap - remaining)
        if len(frontier.mem) == 0:
            return None
    if frontier is None:
        return 0.0, 0.0, []
    best = int(np.argmin(np.where(frontier.mem <= cap, frontier.time, np.inf)))
    if frontier.mem[best] > cap:
        return None
    return float(frontier.time[best]), float(frontier.mem[best]), frontier.back[0](best)


def _unit_configs(items, time_cost, mem_cost, transient):
    """Every Pareto-useful configuration of one unit: (time, mem, transient, [(item, choice)])."""
    configs = [(0.0, 0.0, 0.0, [])]
    for i in items:
        new = []
        for t0, m0, a0, pick in configs:
            for c in np.flatnonzero(np.isfinite(time_cost[i]) & np.isfinite(mem_cost[i])):
                new.append((t0 + time_cost[i, c], m0 + mem_cost[i, c], a0 + transient[i, c],
                            pick + [(i, int(c))]))
        # drop configurations dominated in all three coordinates
        new.sort(key=lambda x: (x[2], x[1], x[0]))
        kept = []
        for cfg in new:
            if not any(k[0] <= cfg[0] and k[1] <= cfg[1] and k[2] <= cfg[2] for k in kept):
                kept.append(cfg)
        configs = kept
    return configs


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
    n = time_cost.shape[0]
    ok = np.isfinite(time_cost) & np.isfinite(mem_cost)
    if n and not ok.any(axis=1).all():
        bad = int(np.flatnonzero(~ok.any(axis=1))[0])
        raise ValueError(f"item {bad} has no available choice (every entry is inf)")
    if transient is None:
        transient = np.zeros_like(mem_cost)
        units = [-1] * n
    transient = np.asarray(transient, dtype=np.float64)
    units = list(range(n)) if units is None else [int(u) for u in units]

    plain = [(i, time_cost[i, ok[i]], mem_cost[i, ok[i]], np.flatnonzero(ok[i]))
             for i in range(n) if units[i] < 0]
    by_unit: dict[int, list[int]] = {}
    for i in range(n):
        if units[i] >= 0:
            by_unit.setdefault(units[i], []).append(i)
    unit_cfgs = {u: _unit_configs(items, time_cost, mem_cost, transient) for u, items in by_unit.items()}
    thresholds = sorted({cfg[2] for cfgs in unit_cfgs.values() for cfg in cfgs} | {0.0})
    # The max term is at least the largest unit's smallest transient.
    floor = max((min(c[2] for c in cfgs) for cfgs in unit_cfgs.values()), default=0.0)
    thresholds = [t for t in thresholds if t >= floor]

    best, min_needed = None, math.inf
    for T in thresholds:
        rows = list(plain)
        for u, cfgs in unit_cfgs.items():
            allowed = [c for c in cfgs if c[2] <= T]
            # A unit is one pseudo-item whose choices are its configurations.
            rows.append((-1 - u, np.array([c[0] for c in allowed]), np.array([c[1] for c in allowed]),
                         np.arange(len(allowed))))
        need = sum(r[2].min() for r in rows) + T
        min_needed = min(min_needed, need)
        if need > budget * (1 + 1e-12):
            continue
        found = _solve_additive(rows, budget - T + abs(budget) * 1e-12)
        if found is None:
            continue
        t, m, picks = found
        if best is None or t < best[0] - 1e-15 * abs(t):
            choices = np.full(n, -1, dtype=np.int64)
            for item, c in picks:
                if item >= 0:
                    choices[item] = c
                else:
                    u = -1 - item
                    allowed = [cfg for cfg in unit_cfgs[u] if cfg[2] <= T]
                    for i, ci in allowed[c][3]:
                        choices[i] = ci
            peak = float(mem_cost[np.arange(n), choices].sum()) + _max_transient(
                choices, transient, units)
            best = (t, peak, choices)
    if best is None:
        raise _infeasible(budget, min_needed)
    return Solution(choices=best[2], time=float(time_cost[np.arange(n), best[2]].sum()), mem=best[1])


def _max_transient(choices, transient, units) -> float:
    per_unit: dict[int, float] = {}
    for i, c in enumerate(choices):
        if units[i] >= 0:
            per_unit[units[i]] = per_unit.get(units[i], 0.0) + float(transient[i, c])
    return max(per_unit.values(), default=0.0)


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
    Pareto set of (time, resource_1..K) with identical items grouped.
    """
    time_cost = np.asarray(time_cost, dtype=np.float64)
    mem_cost = np.asarray(mem_cost, dtype=np.float64)
    pools = np.asarray(pools, dtype=np.float64)
    n, c = time_cost.shape
    res = mem_cost[:, :, None] + pools  # (n, c, K)
    ok = np.isfinite(time_cost) & np.isfinite(res).all(axis=2)
    if n and not ok.any(axis=1).all():
        raise ValueError(f"item {int(np.flatnonzero(~ok.any(axis=1))[0])} has no available choice")
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
    remaining = need.copy()
    f_time, f_res = np.zeros(1), np.zeros((1, k))
    stages = []  # per group: (items, cols, counts, index of the previous point, index into counts)
    for items in groups.values():
        i0 = items[0]
        cols = np.flatnonzero(ok[i0])
        remaining -= floor[i0] * len(items)
        counts = _compositions(len(items), len(cols))
        g_time = counts @ time_cost[i0, cols]
        g_res = counts @ res[i0, cols]
        keep = _dominance_prune(g_time, g_res, cap - remaining - f_res.min(axis=0))
        g_time, g_res, counts = g_time[keep], g_res[keep], counts[keep]
        all_time = (f_time[:, None] + g_time[None, :]).ravel()
        all_res = (f_res[:, None, :] + g_res[None, :, :]).reshape(-1, k)
        keep = _dominance_prune(all_time, all_res, cap - remaining)
        if not len(keep):
            raise _infeasible(budget, _min_peak(res, ok))
        fi, gi = np.divmod(keep, len(g_time))
        stages.append((items, cols, counts, fi, gi))
        f_time, f_res = all_time[keep], all_res[keep]
    point = int(np.argmin(f_time))
    choices = np.zeros(n, dtype=np.int64)
    for items, cols, counts, fi, gi in reversed(stages):
        choices[items] = np.repeat(cols, counts[gi[point]])
        point = fi[point]
    idx = np.arange(n)
    peak = float(mem_cost[idx, choices].sum() + pools[idx, choices].sum(axis=0).max())
    return Solution(choices, float(time_cost[idx, choices].sum()), peak)


def _min_peak(res: np.ndarray, ok: np.ndarray) -> float:
    """The smallest ``max_k sum_i res[i, c_i, k]`` over all assignments (by the same search)."""
    n, _, k = res.shape
    pts = np.zeros((1, k))
    for i in range(n):
        cand = (pts[:, None, :] + res[i, ok[i]][None, :, :]).reshape(-1, k)
        keep = _dominance_prune(np.zeros(len(cand)), cand, np.full(k, np.inf))
        pts = cand[keep]
    return float(pts.max(axis=1).min())
