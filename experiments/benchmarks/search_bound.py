"""The planner's exact search with and without its time bound, on the paper config's cost tables.

gpt2_48l_1536 (compile-only probes, on this machine's 8 simulated devices) planned with
``verify=False`` at several budgets; the cost tables of each plan's search (one per batch size)
are kept and searched three ways, all exact:

- *whole*: ``pareto_front`` with no bound, every Pareto-optimal plan within the budget, per
  batch size (how the search ran before its bound);
- *bounded*: ``fastest_front``, per batch size (the bound rises from the LP bound until a plan
  fits);
- *planner*: ``_planner._search``, the batch sizes in order of their LP bound's samples/s, each
  searched only for plans faster than the best so far.

It checks that the three give the same best plan (samples/s equal to 1e-12) and prints measured
seconds (medians of ``--repeat`` runs) and the Pareto set sizes. Then the hard case, once each:
``--random`` tables of all-different items (uniform seconds and bytes, 4 choices, 2 pools, the
budget halfway between the least and most memory), searched bounded (``solve_pools``) and, up to
200 items, whole (``pareto_front``), the same optimum asserted. Writes
experiments/results/search_bound.md.

Run: python experiments/benchmarks/search_bound.py [--budgets 4GB,8GB,...] [--repeat 3] [--random 200,400]
"""
import numpy as np
import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import osdp_jax  # noqa: E402
from experiments import config, runner  # noqa: E402
from osdp_jax import _planner  # noqa: E402
from osdp_jax.search import InfeasibleBudgetError, fastest_front, lower_bound, pareto_front, solve_pools  # noqa: E402

CONFIG = "experiments/paper/gpt2_48l_1536.toml"
OUT = pathlib.Path("experiments/results/search_bound.md")


def tables_at(s, budget: str) -> dict:
    """The cost tables per batch size that ``plan(verify=False)`` searches at ``budget``."""
    seen = []
    search = _planner._search

    def keep(tables_for, limit, fronts, lessons=()):
        seen.append((tables_for, limit))
        return search(tables_for, limit, fronts, lessons)

    _planner._search = keep
    try:
        runner.make_plan(runner.at_budget(s, budget), verify=False)
    finally:
        _planner._search = search
    return seen[0]


def best_of(fronts: dict, tables_for: dict, limit: float):
    """(samples/s, batch size) of the best plan over the fronts, the smallest size of equals."""
    best = None
    for size, front in fronts.items():
        t = tables_for[size]
        try:
            sol = front.best(limit - t.base_mem)
        except (InfeasibleBudgetError, LookupError):
            continue
        sps = size / (t.base_time + sol.time)
        if best is None or sps > best[0]:
            best = (sps, size)
    return best


def timed(fn, repeat):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def fronts_by(make, tables_for, limit):
    out = {}
    for size, t in tables_for.items():
        try:
            out[size] = make(t.time, t.mem, t.pools, limit - t.base_mem)
        except InfeasibleBudgetError:
            pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="4GB,8GB,12GB,16GB,24GB,32GB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--random", default="200,400", help="item counts of the random tables ('' for none)")
    args = ap.parse_args()
    s = runner.setup(config.load(CONFIG))
    rows = []
    for budget in args.budgets.split(","):
        tables_for, limit = tables_at(s, budget)
        whole_s, whole = timed(lambda: fronts_by(pareto_front, tables_for, limit), args.repeat)
        bounded_s, bounded = timed(lambda: fronts_by(fastest_front, tables_for, limit), args.repeat)
        planner_s, (found, _) = timed(lambda: _planner._search(tables_for, limit, {}), args.repeat)
        want = best_of(whole, tables_for, limit)
        got = best_of(bounded, tables_for, limit)
        assert want is not None and got is not None and got[1] == want[1] and found[1] == want[1]
        assert abs(got[0] - want[0]) <= 1e-12 * want[0] and abs(found[5] - want[0]) <= 1e-12 * want[0]
        rows.append((budget, osdp_jax.format_bytes(limit), len(tables_for), whole_s,
                     sum(len(f.time) for f in whole.values()), bounded_s,
                     sum(len(f.time) for f in bounded.values()), planner_s, want))
        print(f"{budget}: whole {whole_s:.2f} s, bounded {bounded_s:.2f} s, planner {planner_s:.2f} s; "
              f"best {want[0]:.2f} samples/s at batch {want[1]}", flush=True)
    lines = ["# The exact search with and without its time bound", "",
             f"Measured with `python experiments/benchmarks/search_bound.py --budgets {args.budgets} "
             f"--repeat {args.repeat} --random {args.random}` on this 2-core machine: seconds are medians of {args.repeat} runs of "
             f"the search alone (the cost tables of {CONFIG}'s `plan(verify=False)` at each budget, one "
             "per batch size), and the three searches' best plans are asserted equal.", "",
             "| budget | limit | batch sizes | whole Pareto sets (s) | their points | bounded (s) | their points "
             "| planner, batch sizes bounded by the best (s) | best plan (predicted) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for budget, lim, n, ws, wp, bs, bp, ps, want in rows:
        lines.append(f"| {budget} | {lim} | {n} | {ws:.2f} | {wp:,} | {bs:.2f} | {bp:,} | {ps:.2f} | "
                     f"{want[0]:.2f} samples/s, batch {want[1]} |")
    if args.random:
        lines += ["", "All-different random items (one run each, seeds 0, 1, ...; whole Pareto sets up to 200 items):",
                  "", "| items | LP bound under the optimum | bounded (s) | whole Pareto set (s) |", "|---|---|---|---|"]
        for seed, n in enumerate(int(x) for x in args.random.split(",")):
            rng = np.random.default_rng(seed)
            t, m, pools = rng.random((n, 4)), rng.random((n, 4)), 0.3 * rng.random((n, 4, 2))
            budget = (m.min(axis=1).sum() + m.max(axis=1).sum()) / 2
            bounded_s, sol = timed(lambda: solve_pools(t, m, pools, budget), 1)
            whole_s = "-"
            if n <= 200:
                whole_s, whole = timed(lambda: pareto_front(t, m, pools, budget).best(budget), 1)
                assert abs(whole.time - sol.time) <= 1e-9 * abs(sol.time)
                whole_s = f"{whole_s:.2f}"
            gap = (sol.time - lower_bound(t, m, pools, budget)) / sol.time
            lines.append(f"| {n} | {gap:.2%} | {bounded_s:.2f} | {whole_s} |")
            print(f"random {n}: bounded {bounded_s:.2f} s, whole {whole_s} s, LP bound {gap:.2%} under", flush=True)
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
