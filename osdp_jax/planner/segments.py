"""The layer as the unit of decision: search items per layer, and segments from the chosen counts.

A stacked parameter of L layers (one that ``osdp_jax.layers.scan`` runs) is L identical search
items, each with 1/L of the parameter's row of the cost tables: its memory and collective time
are sums over layers (``_cost``: ``(p + o)/N - kappa p`` bytes and ``3 L a + 3 (N-1)/N p/W``
seconds for a per-layer zero3 parameter, both linear in the layers). The split saving
``sigma (1 - 1/k) p / L`` is one layer's gathered slice; charged 1/L per split layer, it is exact
when every layer splits and interpolated between. Each stack also has L *remat* items whose
choices are the remat policies, charged per layer (per sample, times the batch size):

    full:  0 bytes, 0 s                         (the probes' own policy)
    dots:  A_dots bytes, -F_dots / flops s     A, F fitted on probe steps that use the policy
    none:  A_none bytes, -F_none / flops s     (``_calibration``: the step with the stacks zero3
                                               under the policy, against "full"): extra
                                               temp, fewer FLOPs, per layer, at two batch
                                               sizes, linear between

The exact search (``_search.solve_pools``) groups identical items and enumerates how many layers
take each choice, so the optimum is exact over per-layer counts.

The unit is a *pair* of layers when L is even: a segment of one layer is a loop of one iteration,
which XLA removes, and the layer's memory is then no longer bounded by the loop. With pairs every
count, hence every cut, is even. A stack of fewer
than 4 layers is one item (one segment); an odd L of 5 or more keeps single layers (and the
compiled check catches what a one-layer segment costs). :func:`segments` then orders each
parameter's layers so that the stack is cut into as few contiguous segments as it can find
(segment bounds are shared by every parameter of the stack: each segment runs as one scan).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import numpy as np

from osdp_jax.core.stack import Segment
from osdp_jax.planner.cost import CostTables


@dataclasses.dataclass(frozen=True)
class Items:
    """Cost tables over search items (``CostTables``' fields, rows per item), and whose each item is:
    ``owner[i]`` is ``("param", k)`` (parameter k whole), ``("layer", k)`` (one layer of stacked
    parameter k), ``("remat", s)`` (one layer of stack s's remat choice) or ``("unit", u)`` (the
    parameters of unit u, ``units[u]``, together: a unit is decided whole). Columns are the
    problem's (strategy, k) columns, then ``("remat", policy)`` per policy."""

    columns: tuple
    time: np.ndarray
    mem: np.ndarray
    pools: np.ndarray
    base_mem: float
    base_time: float
    two_stage: np.ndarray  # per parameter (not item) and strategy column, as in CostTables
    owner: tuple
    policies: tuple[str, ...]
    weight: tuple = ()  # layers each item stands for (1 per layer; L for a whole stack)
    units: tuple = ()  # per unit item ("unit", u): its parameters' indices
    unit_cols: tuple = ()  # [u][column]: each of its parameters' column when the unit takes it
    overlap: float = 0.0  # as CostTables.overlap
    step_pools: np.ndarray | None = None  # the tables' pools per item (``pools`` crossed with the loop's, or them)


def expand(problem, tables: CostTables, remat: dict | None, policies=("full",), per_layer: bool = True) -> Items:
    """``tables`` with every stacked parameter as one item per layer, and a remat item per layer of each
    stack. ``remat``: policy -> ``(bytes, seconds)`` per layer at this batch size, relative to
    "full" (None: only "full").
    Without ``per_layer``, one item per stacked parameter and one remat item per stack: every
    layer of a stack alike (one segment).

    A policy's saved activations live in the backward loop, a replicated stacked gradient's
    buffers other than the gradient itself after it (``CostTables.after_loop``): where both
    occur, they are two loop pools, ``max(sum after_loop, sum A)``, crossed with the tables' pools
    (:func:`_cross_pools`: ``max_x X + max_y Y`` is the max over the pairs (x, y) of X + Y)."""
    policies = tuple(p for p in policies if p == "full" or p in (remat or {})) or ("full",)
    n_cols, n_rem = len(tables.columns), len(policies)
    stacked = {p for stack in problem.stacks for p in stack}
    saved = np.array([[remat[p][0] if p != "full" else 0.0 for p in policies]
                      for _ in problem.stacks]).reshape(len(problem.stacks), n_rem)
    after = tables.after_loop if tables.after_loop is not None else np.zeros(len(problem.infos))
    stacked_after = [after[k] for k, i in enumerate(problem.infos) if i.path in stacked]
    pooled = bool((saved > 0).any() and (saved >= 0).all() and any(a > 0 for a in stacked_after))
    whole = np.array([c[0] in ("replicate", "zero2") for c in tables.columns] + [False] * n_rem)
    rows_t, rows_m, rows_p, rows_l, owner, weight = [], [], [], [], [], []
    moved = 0.0  # bytes moved from the items' memory into the base (the search wants costs >= 0)
    pad = np.full(n_rem, np.inf)
    groups: dict = {}
    for k, info in enumerate(problem.infos):
        if info.path in problem.units and info.path not in stacked:
            groups.setdefault(problem.units[info.path], []).append(k)
            continue
        layers = info.shape[0] if info.path in stacked else 1
        per = _items(layers) if per_layer else 1
        loop_pool = np.zeros((n_cols + n_rem, 2))
        if pooled and info.path in stacked:
            loop_pool[whole, 0] = after[k]
        rows_t += [np.concatenate([tables.time[k] / per, pad])] * per
        row = np.concatenate([tables.mem[k], pad]) - loop_pool[:, 0]
        least = row[np.isfinite(row)].min() if loop_pool.any() else 0.0
        moved += least
        rows_m += [(row - least) / per] * per
        rows_p += [np.concatenate([tables.pools[k] / per, np.zeros((n_rem, tables.pools.shape[2]))])] * per
        rows_l += [loop_pool / per] * per
        owner += [("layer" if info.path in stacked else "param", k)] * per
        weight += [layers // per] * per
    units, unit_cols = [], []
    replicate = tables.columns.index(("replicate", 1))
    for u, members in enumerate(groups.values()):
        # a unit is one item: all its parameters take the unit's strategy (those that cannot stay
        # replicated); split columns are not offered
        cols = tuple(tuple(c if col[1:] == (1,) and np.isfinite(tables.mem[m, c]) else replicate for m in members)
                     for c, col in enumerate(tables.columns))
        ok = np.array([col[1:] == (1,) for col in tables.columns])  # nor the microbatch accumulation columns
        for rows, table in ((rows_t, tables.time), (rows_m, tables.mem)):
            row = np.array([sum(table[m, mc] for m, mc in zip(members, cols[c])) for c in range(n_cols)])
            rows.append(np.concatenate([np.where(ok, row, np.inf), pad]))
        pools = np.array([sum(tables.pools[m, mc] for m, mc in zip(members, cols[c])) for c in range(n_cols)])
        rows_p.append(np.concatenate([pools, np.zeros((n_rem, tables.pools.shape[2]))]))
        rows_l.append(np.zeros((n_cols + n_rem, 2)))
        owner.append(("unit", u))
        weight.append(1)
        units.append(tuple(members))
        unit_cols.append(cols)
    base_time, base_mem = tables.base_time, tables.base_mem + moved
    for s, stack in enumerate(problem.stacks):
        layers = problem.stack_layers(s)
        m = saved[s]
        tt = np.array([remat[p][1] if p != "full" else 0.0 for p in policies])
        loop_pool = np.zeros((n_cols + n_rem, 2))
        if pooled:  # the saved activations go to the loop's pool, whole
            loop_pool[n_cols:, 1] = m * layers
            m = np.zeros(n_rem)
        base_mem, base_time = base_mem + layers * m.min(), base_time + layers * tt.min()
        m, tt = m - m.min(), tt - tt.min()
        per = _items(layers) if per_layer else 1
        rows_t += [np.concatenate([np.full(n_cols, np.inf), tt * layers / per])] * per
        rows_m += [np.concatenate([np.full(n_cols, np.inf), m * layers / per])] * per
        rows_p += [np.zeros((n_cols + n_rem, tables.pools.shape[2]))] * per
        rows_l += [loop_pool / per] * per
        owner += [("remat", s)] * per
        weight += [layers // per] * per
    columns = (*tables.columns, *(("remat", p) for p in policies))
    step_pools = np.array(rows_p)
    pools = _cross_pools(step_pools, np.array(rows_l)) if pooled else step_pools
    return Items(columns, np.array(rows_t), np.array(rows_m), pools, base_mem, base_time,
                 tables.two_stage, tuple(owner), policies, tuple(weight), tuple(units), tuple(unit_cols),
                 tables.overlap, step_pools)


def _cross_pools(step_pools: np.ndarray, loop_pools: np.ndarray) -> np.ndarray:
    """``(items, columns, X * Y)`` pools whose max over the last axis, summed over items, is the
    max of the X step pools plus the max of the Y loop pools: pool (x, y) holds both."""
    n, c, x = step_pools.shape
    return (step_pools[:, :, :, None] + loop_pools[:, :, None, :]).reshape(n, c, x * loop_pools.shape[2])


def param_columns(items: Items, choices) -> dict[int, int]:
    """Parameter index -> chosen column, for the parameters decided whole (alone or as a unit)."""
    out = {}
    for (kind, k), c in zip(items.owner, choices):
        if kind == "param":
            out[k] = int(c)
        elif kind == "unit":
            out.update(zip(items.units[k], items.unit_cols[k][c]))
    return out


def _items(layers: int) -> int:
    """Search items for a stack of ``layers``: one per pair of layers when even (module docstring);
    one for the whole stack under 4 layers, where any cut leaves a one-layer segment."""
    if layers < 4:
        return 1
    return layers // 2 if layers % 2 == 0 else layers


def expand_choices(items: Items, param_choices, policy: str = "full") -> np.ndarray | None:
    """Item choices for a layout given per parameter (every layer alike) and one remat policy;
    None when the items cannot express it (a policy the search does not offer)."""
    if ("remat", policy) not in items.columns:
        return None
    remat_col = items.columns.index(("remat", policy))
    replicate = items.columns.index(("replicate", 1))

    def unit_col(u):  # the column of its first parameter that is not replicated
        return next((int(param_choices[m]) for m in items.units[u] if param_choices[m] != replicate), replicate)
    return np.array([remat_col if kind == "remat" else unit_col(k) if kind == "unit" else param_choices[k]
                     for kind, k in items.owner], dtype=np.int64)


def counts(items: Items, choices) -> tuple[dict, dict]:
    """``({param k: Counter(column)}, {stack s: Counter(policy)})`` of an item assignment."""
    per_param, per_stack = {}, {}
    for (kind, k), c, w in zip(items.owner, choices, items.weight):
        if kind == "remat":
            per_stack.setdefault(k, Counter())[items.columns[c][1]] += w
        elif kind == "unit":
            for m, mc in zip(items.units[k], items.unit_cols[k][c]):
                per_param.setdefault(m, Counter())[int(mc)] += w
        else:
            per_param.setdefault(k, Counter())[int(c)] += w
    return per_param, per_stack


def _bounds(order, count) -> set[int]:
    at, cuts = 0, set()
    for c in order[:-1]:
        at += count[c]
        cuts.add(at)
    return cuts


def _orders(count: Counter, rank) -> list[tuple]:
    used = sorted(count, key=rank)
    if len(used) > 4:
        return [tuple(used)]
    return [tuple(p) for p in itertools.permutations(used)]


def layer_orders(rows: list[Counter], layers: int, rank) -> list[tuple]:
    """One order of choices per row (a parameter's or the remat counts) so that the union of
    their boundaries, the stack's segment cuts, is as small as a local search finds: start from
    the common ``rank`` order, then give each row in turn the order that adds the fewest cuts,
    until nothing improves."""
    orders = [_orders(r, rank)[0] for r in rows]
    for _ in range(6):
        changed = False
        for i, r in enumerate(rows):
            others = set().union(*(_bounds(o, rows[j]) for j, o in enumerate(orders) if j != i))
            best = min(_orders(r, rank), key=lambda o: (len(others | _bounds(o, r)), o != orders[i]))
            if best != orders[i]:
                orders[i], changed = best, True
        if not changed:
            break
    return orders


def segments(problem, items: Items, choices) -> dict[str, tuple[Segment, ...]]:
    """Path -> segments of every stacked parameter, from the items' chosen columns."""
    per_param, per_stack = counts(items, choices)
    index = {i.path: k for k, i in enumerate(problem.infos)}
    cols = items.columns
    # a common order: most memory per layer first (replicate, then zero3 by k), remat none first
    rank = lambda c: (0, cols[c][0] != "replicate", cols[c][1])  # noqa: E731
    remat_rank = {"none": 0, "dots": 1, "full": 2}
    out = {}
    for s, stack in enumerate(problem.stacks):
        layers = problem.stack_layers(s)
        ks = [index[p] for p in stack]
        remat_count = per_stack.get(s, Counter({"full": layers}))
        rows = [per_param[k] for k in ks] + [remat_count]
        ranks = lambda c: remat_rank[c] if isinstance(c, str) else rank(c)  # noqa: E731
        orders = layer_orders(rows, layers, ranks)
        cuts = sorted({0, layers}.union(*(_bounds(o, r) for o, r in zip(orders, rows))))

        def at(order, count, layer):
            for c in order:
                if layer < count[c]:
                    return c
                layer -= count[c]
            raise AssertionError("counts do not cover the stack")

        for pos, k in enumerate(ks):
            segs = []
            for a, b in zip(cuts, cuts[1:]):
                c = at(orders[pos], rows[pos], a)
                strategy, split = cols[c]
                segs.append(Segment(a, b, strategy, split, at(orders[-1], rows[-1], a),
                                    problem.options[k][c], bool(items.two_stage[k, c])))
            out[problem.infos[k].path] = tuple(segs)  # every cut is some row's boundary: none merges
    return out
