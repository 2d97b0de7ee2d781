"""The exact search equals brute force, reaches the original OSDP optimum, and explains infeasibility."""
import itertools
import json
import pathlib

import numpy as np
import pytest

from osdp_jax.planner.search import pareto_front, solve_pools
from osdp_jax.search import InfeasibleBudgetError, solve

# The per-layer tables published with the original OSDP implementation (a copy is in tests/data).
REFERENCE = pathlib.Path(__file__).resolve().parent / "data" / "osdp_profiled_tables.json"


def brute_force(t, m, budget, transient=None, units=None):
    n, c = t.shape
    best = None
    for choice in itertools.product(range(c), repeat=n):
        choice = np.array(choice)
        time = t[np.arange(n), choice].sum()
        mem = m[np.arange(n), choice].sum()
        if transient is not None:
            per_unit = {}
            for i in range(n):
                if units[i] >= 0:
                    per_unit[units[i]] = per_unit.get(units[i], 0.0) + transient[i, choice[i]]
            mem += max(per_unit.values(), default=0.0)
        if np.isfinite(time) and np.isfinite(mem) and mem <= budget and (best is None or time < best):
            best = time
    return best


def random_instance(rng, trial):
    n, c = int(rng.integers(1, 7)), int(rng.integers(1, 4))
    t, m = rng.random((n, c)), rng.random((n, c)) * 10
    if trial % 3 == 0:  # identical items, the grouped path
        t[:], m[:] = t[0], m[0]
    if trial % 4 == 0:  # unavailable choices, but every item keeps one
        t[rng.random((n, c)) < 0.3] = np.inf
        t[:, 0] = np.where(np.isinf(t[:, 0]), 1.0, t[:, 0])
    transient = units = None
    if trial % 2 == 1:
        transient = rng.random((n, c)) * 5
        units = rng.integers(-1, 3, n)
    return t, m, transient, units, float(rng.random() * n * 8)


@pytest.mark.parametrize("seed", range(4))
def test_solver_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    for trial in range(60):
        t, m, transient, units, budget = random_instance(rng, trial)
        expected = brute_force(t, m, budget, transient, units)
        try:
            sol = solve(t, m, budget, transient=transient, units=units)
        except InfeasibleBudgetError as err:
            assert expected is None, f"solver said infeasible, brute force found {expected}"
            assert err.min_bytes > budget
            # the reported minimum is exactly the smallest budget that fits
            assert brute_force(t, m, err.min_bytes * (1 + 1e-9), transient, units) is not None
            continue
        assert expected is not None
        assert sol.time == pytest.approx(expected, rel=1e-12)
        assert sol.mem <= budget + 1e-9
        n = len(t)
        assert sol.time == pytest.approx(t[np.arange(n), sol.choices].sum())


def test_max_transient_is_not_additive():
    # Two units each with transient 4 when choosing column 0: max is 4, a sum would be 8.
    t = np.array([[1.0, 2.0], [1.0, 2.0]])
    m = np.zeros((2, 2))
    transient = np.array([[4.0, 0.0], [4.0, 0.0]])
    sol = solve(t, m, 5.0, transient=transient, units=[0, 1])
    assert list(sol.choices) == [0, 0] and sol.mem == 4.0
    # the same transient in one unit adds up and no longer fits
    sol = solve(t, m, 5.0, transient=transient, units=[0, 0])
    assert sol.time == 3.0 and sol.mem == 4.0


def test_infeasible_reports_minimum():
    with pytest.raises(InfeasibleBudgetError) as info:
        solve([[1.0, 2.0], [1.0, 3.0]], [[5.0, 2.0], [6.0, 1.0]], budget=2.5)
    assert info.value.min_bytes == 3.0
    assert "3" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_rejects_item_without_choice():
    with pytest.raises(ValueError, match="item 1 has no available choice"):
        solve([[1.0], [np.inf]], [[1.0], [1.0]], 10)


@pytest.mark.parametrize("layers,limit_mb", [(48, 8192), (96, 16384)])
def test_reaches_original_osdp_optimum(layers, limit_mb):
    ref = json.loads(REFERENCE.read_text())
    row = ref["hidden_sizes"].index(1536)
    mem = np.floor(np.array(ref["mem_mb"][row][1]))  # the original truncates to whole MB
    time = np.array(ref["time_s"][row][1])
    sol = solve(np.tile(time, (layers, 1)), np.tile(mem, (layers, 1)), limit_mb - ref["extra_overhead_mb"])
    key = f"{layers}x1536@{limit_mb}MB_row1"
    assert sol.time == pytest.approx(ref["reference_optimum"][key], rel=1e-9)


def brute_force_pools(t, m, pools, budget):
    n, c = t.shape
    best, min_peak = None, np.inf
    for choice in itertools.product(range(c), repeat=n):
        idx, choice = np.arange(n), np.array(choice)
        time = t[idx, choice].sum()
        peak = m[idx, choice].sum() + pools[idx, choice].sum(axis=0).max()
        if not (np.isfinite(time) and np.isfinite(peak)):
            continue
        min_peak = min(min_peak, peak)
        if peak <= budget and (best is None or time < best):
            best = time
    return best, min_peak


def random_pool_instance(rng, trial):
    """Item times, memory and K pools: identical items every third trial, missing choices every
    fourth, negative times every fifth (the seconds a remat policy saves)."""
    n, c, k = (int(x) for x in (rng.integers(1, 7), rng.integers(1, 4), rng.integers(1, 4)))
    t, m, pools = rng.random((n, c)), rng.random((n, c)), rng.random((n, c, k))
    if trial % 3 == 0:
        t[:], m[:], pools[:] = t[0], m[0], pools[0]
    if trial % 4 == 0:
        t[rng.random((n, c)) < 0.3] = np.inf
        t[:, 0] = np.where(np.isinf(t[:, 0]), 1.0, t[:, 0])
    if trial % 5 == 0:
        t = t - 0.7
    return t, m, pools


@pytest.mark.parametrize("seed", range(3))
def test_pool_solver_equals_brute_force(seed):
    """The planner's search: peak = sum mem + max over pools, exact against enumeration."""
    rng = np.random.default_rng(100 + seed)
    for trial in range(80):
        t, m, pools = random_pool_instance(rng, trial)
        budget = float(rng.random() * len(t) * 1.5)
        expected, min_peak = brute_force_pools(t, m, pools, budget)
        try:
            sol = solve_pools(t, m, pools, budget)
        except InfeasibleBudgetError as err:
            assert expected is None
            assert err.min_bytes == pytest.approx(min_peak, rel=1e-12)
            continue
        assert expected is not None and sol.time == pytest.approx(expected, rel=1e-12)
        assert sol.mem <= budget + 1e-9


@pytest.mark.parametrize("seed", range(2))
def test_a_front_built_for_a_budget_answers_every_smaller_one(seed):
    """``pareto_front`` at one budget: its best plan under each smaller budget is brute force's
    optimum there (what a re-plan under a lowered budget asks); a larger one is refused."""
    rng = np.random.default_rng(200 + seed)
    for trial in range(60):
        t, m, pools = random_pool_instance(rng, trial)
        budget = float((m.max(axis=1) + pools.max(axis=(1, 2))).sum())  # every plan fits it
        front = pareto_front(t, m, pools, budget)
        for limit in np.linspace(0, budget, 7):
            # the search's own tolerance: 1e-12 of the budget (the last limit is a sum's rounding)
            expected, min_peak = brute_force_pools(t, m, pools, limit * (1 + 1e-12))
            try:
                sol = front.best(limit)
            except InfeasibleBudgetError as err:
                assert expected is None and err.min_bytes == pytest.approx(min_peak, rel=1e-12)
                continue
            assert expected is not None and sol.time == pytest.approx(expected, rel=1e-12)
            assert sol.mem <= limit * (1 + 1e-12)
        with pytest.raises(ValueError, match="holds the plans within"):
            front.best(2 * budget)


def test_a_time_bound_keeps_every_plan_as_fast_and_the_hull_bound_is_below_the_optimum():
    """``pareto_front(time_bound=)``: under every smaller budget, its best plan is brute force's
    optimum when that is no slower than the bound, and ``BeyondBound`` says so when it is
    slower; a bound below the optimum leaves an empty front. ``lower_bound`` (the LP bound) is
    never above the optimum, and ``fastest_front`` with ``give_up`` finds the optimum when it is
    as fast, else says ``BeyondBound``."""
    from osdp_jax.planner.search import BeyondBound, fastest_front, lower_bound
    rng = np.random.default_rng(7)
    checked = 0
    for trial in range(60):
        t, m, pools = random_pool_instance(rng, trial)
        low = m.min(axis=1).sum() + pools.min(axis=1).sum(axis=0).max()
        high = m.max(axis=1).sum() + pools.max(axis=1).sum(axis=0).max()
        budget = low + (high - low) * rng.uniform(0.3, 0.9)
        expected, _ = brute_force_pools(t, m, pools, budget * (1 + 1e-12))
        if expected is None:
            continue
        assert lower_bound(t, m, pools, budget) <= expected + 1e-12
        bound = expected + rng.uniform(0.0, 0.5) * abs(expected)
        front = pareto_front(t, m, pools, budget, time_bound=bound)
        for limit in np.linspace(low, budget, 5):
            want, _ = brute_force_pools(t, m, pools, limit * (1 + 1e-12))
            if want is not None and want <= bound:
                assert front.best(limit).time == pytest.approx(want, rel=1e-12, abs=1e-12)
            else:  # slower than the bound, or nothing fits: a bounded front cannot tell which
                with pytest.raises(BeyondBound):
                    front.best(limit)
        assert len(pareto_front(t, m, pools, budget, time_bound=expected - 1e-6).time) == 0
        with pytest.raises(BeyondBound):
            fastest_front(t, m, pools, budget, give_up=expected - 1e-6).best(budget)
        assert fastest_front(t, m, pools, budget, give_up=expected).best(budget).time == pytest.approx(
            expected, rel=1e-12, abs=1e-12)
        checked += 1
    assert checked >= 40  # the budgets are feasible often enough for this to test something


def test_kept_searches_hold_a_sweeps_worth_within_a_byte_bound(monkeypatch):
    """A kept search (``_search._kept``) answers a repeat from what it holds, by the arguments'
    contents: a budget sweep's several hundred searches all stay (KEEP), the oldest go first once
    the results' arrays pass KEEP_BYTES, and ``clear`` forgets them."""
    from osdp_jax.planner import search as _search
    ran = []

    @_search._kept
    def search(table, budget):
        ran.append(budget)
        return np.zeros(int(budget))  # 8 bytes per unit of budget

    table = np.arange(6.0).reshape(2, 3)
    for b in range(1, 301):
        search(table, b)
    assert len(ran) == 300
    assert search(table.copy(), 1).shape == (1,) and len(ran) == 300  # the oldest of 300, by contents
    search(table + 1, 1)
    assert len(ran) == 301  # another table is another search
    monkeypatch.setattr(_search, "KEEP_BYTES", 8 * 250)
    search(table, 200)  # kept: nothing dropped on a hit
    search(table, 1000)  # 8000 bytes alone: everything older goes, the newest stays
    assert len(ran) == 302
    search(table, 1000)
    search(table, 200)
    assert len(ran) == 303
    search.clear()
    search(table, 200)
    assert len(ran) == 304


def test_the_lp_bounds_hulls_are_built_once_per_table_whatever_the_budget(monkeypatch):
    """The hulls behind ``lower_bound`` and a bounded ``pareto_front`` do not depend on the
    budget: they are kept by the tables' contents (``_search._hull_tables``), so the same tables
    searched at other budgets build none again, and every bound and front is the one built from
    nothing."""
    from osdp_jax.planner import search as _search
    built, build = [], _search._hull_tables.__wrapped__
    monkeypatch.setattr(_search, "_hull_tables", _search._kept(lambda *a: built.append(a[3]) or build(*a)))
    rng = np.random.default_rng(3)
    t, m, pools = random_pool_instance(rng, 5)
    low = m.min(axis=1).sum() + pools.min(axis=1).sum(axis=0).max()
    high = m.max(axis=1).sum() + pools.max(axis=1).sum(axis=0).max()
    budgets = [low + (high - low) * f for f in (0.4, 0.6, 0.8)]
    warm = [(_search.lower_bound(t, m, pools, b), pareto_front(t, m, pools, b, time_bound=1e9).time) for b in budgets]
    assert len(built) == 2  # one per kind of staging (each item alone; the front's groups), not per budget
    for b, (bound, times) in zip(budgets, warm):
        _search.clear_kept()  # the kept searches and hulls
        assert _search.lower_bound(t, m, pools, b) == bound
        np.testing.assert_array_equal(pareto_front(t, m, pools, b, time_bound=1e9).time, times)
    assert len(built) == 2 + 2 * len(budgets)


@pytest.mark.parametrize("seed", range(3))
def test_the_two_resource_prune_keeps_exactly_the_undominated_points(seed):
    """``_dominance_prune`` with two resources (a staircase of the kept points, chunks filtered
    against it in numpy first) keeps exactly the points that no earlier point in time order beats
    in both resources, on 3,000 points with many ties in time and resources, against the
    quadratic definition."""
    from osdp_jax.planner.search import _dominance_prune
    rng = np.random.default_rng(seed)
    n = 3000
    time = rng.integers(0, 300, n).astype(float)
    res = rng.integers(0, 400, (n, 2)).astype(float)
    cap = np.array([370.0, 390.0])
    got = set(_dominance_prune(time, res, cap).tolist())
    ok = np.flatnonzero((res <= cap).all(axis=1))
    order = ok[np.lexsort((*res[ok].T[::-1], time[ok]))]
    want = {int(i) for pos, i in enumerate(order) if not (res[order[:pos]] <= res[i]).all(axis=1).any()}
    assert got == want and len(want) >= 10


def test_of_equally_fast_plans_the_least_peak_is_taken_whatever_the_item_order():
    """Two items whose choices trade the same seconds for different memory: the plans (1, 0) and
    (0, 1) are equally fast (to the last bit or nearly) and differ in peak; the search takes the
    one of least peak, the same with the items in either order (the stage order, coarsest item
    first, and the summation order do not choose it)."""
    t = np.array([[0.3, 0.2], [0.4, 0.3]])  # 0.2 + 0.4 is 0.6 and one bit; 0.3 + 0.3 is 0.6
    m = np.array([[0.0, 40.0], [0.0, 50.0]])  # the plan of 40 bytes is the one bit slower
    pools = np.zeros((2, 2, 1))
    for order in ([0, 1], [1, 0]):
        sol = solve_pools(t[order], m[order], pools, 60.0)
        assert sol.mem == 40.0 and list(np.array(order)[np.flatnonzero(sol.choices)]) == [0]
        front = pareto_front(t[order], m[order], pools, 100.0)
        assert front.best(60.0).mem == 40.0 and front.best(100.0).mem == 90.0
