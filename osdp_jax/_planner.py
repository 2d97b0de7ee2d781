"""``plan()``: describe -> cost -> search over batch sizes -> compile-verify -> ``Plan``."""
from __future__ import annotations

import dataclasses
import logging
import math
import time as _time

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from ._cost import Topology, comm_seconds, cost_tables, fit, fit_time, interpolate, optimizer_bytes
from ._describe import describe, unboxed_treedef
from ._gather import discover
from ._hardware import default_hardware, resolve_hardware
from ._plan import ParamPlan, Plan
from ._search import InfeasibleBudgetError, solve_pools
from ._strategies import DEFAULT_SPLITS, axes_size, check_splits, check_strategies, data_axes, sharded_dim, spec_for
from ._units import format_bytes, parse_bytes
from ._train import abstract_args
from ._xla import compile_step, profile_compiled, profile_step, time_compiled

log = logging.getLogger("osdp_jax")

MAX_VERIFY_TRIES = 3


def _with_batch_size(batch, size: int):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype), batch)


def _batch_size_of(batch) -> int:
    sizes = {x.shape[0] if getattr(x, "shape", ()) else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"batch leaves must share one leading (global batch) dimension, got {sorted(map(str, sizes))}")
    return sizes.pop()


def _batch_bytes(batch) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(batch))


def _progress(iterable, total, desc):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=total < 2)


def plan(params, mesh, *, budget=None, loss_fn=None, batch=None, batch_sizes=None, optimizer=None,
         hardware=None, strategies=None, axis=None, splits=DEFAULT_SPLITS, verify: bool = True,
         measure_time: bool = False) -> Plan:
    """The highest-throughput plan whose whole training step fits ``budget`` per device.

    Args:
      params: any params pytree (plain, linen boxed or not, ``nnx.State``); arrays or
        ``jax.ShapeDtypeStruct``. Nothing is allocated.
      mesh: the device mesh; ``axis`` names its data-parallel axes (default: all of them).
      budget: per-device bytes, an int or a string such as ``"512MiB"``/``"8GB"``; default the
        device memory of ``hardware``.
      loss_fn: ``loss_fn(params, batch) -> mean loss``. With ``batch``, the step is compiled to
        measure activations, temporaries and FLOPs, and the chosen plan is checked against XLA's
        per-device peak.
      batch: an example global batch (pytree; leading dimension = global batch size).
      batch_sizes: global batch sizes to sweep (default: the example batch's).
      optimizer: an optax optimizer; its state is part of the memory. None plans for
        ``optax.adam``'s state (two moments per parameter) and logs a warning saying so.
      hardware: a :class:`Hardware`, a preset name or a dict; default from the mesh's devices.
      strategies: allowed strategy names, e.g. ``("zero3",)`` (FSDP) or ``("replicate",)`` (DDP).
      splits: candidate split counts k for sharded (zero3 or hsdp) kernels of dense layers
        (operator splitting, ``osdp_jax.split``); ``(1,)`` disables splitting. A kernel takes k
        only when k times the devices it is gathered over divides its sharded dimension.
      verify: compile the chosen plan and re-plan if XLA's peak exceeds the budget.
      measure_time: also *run* the probe steps that fit the devices' memory on ``mesh`` (zeros as
        data, a few timed steps each) and scale the modelled compute and collective seconds to match
        (``_cost.fit_time``). Use it when ``mesh`` is the hardware the plan is for; it allocates
        the probes' memory on the devices.

    Raises:
      InfeasibleBudgetError: no plan fits; ``.min_bytes`` is the smallest budget that would.
    """
    infos = describe(params)
    strategies = check_strategies(strategies)
    splits = check_splits(splits)
    axes = data_axes(mesh, axis)
    n = axes_size(mesh, axes)
    hw = resolve_hardware(hardware, mesh)
    budget_bytes = parse_bytes(budget) if budget is not None else hw.memory_bytes
    if optimizer is None:
        # documented default; said once per call, since the state's size is part of every figure
        log.warning("osdp_jax.plan: optimizer=None, so the plan counts optax.adam's state (two moments "
                     "per parameter, 2x the parameter bytes); pass optimizer= the one you train with")
        optimizer = optax.adam(1e-3)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    opt_bytes, other_opt = optimizer_bytes(optimizer, abstract)

    sizes: list[int | None]
    if batch is not None:
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
        default_size = _batch_size_of(batch)
        sizes = sorted(set(batch_sizes)) if batch_sizes is not None else [default_size]
        bad = [b for b in sizes if b % n or b <= 0]
        if bad:
            raise ValueError(f"batch size {bad[0]} is not a positive multiple of the {n} data-parallel "
                             f"devices; use multiples of {n}")
    else:
        if loss_fn is not None:
            raise ValueError("loss_fn needs an example batch: pass batch=...")
        sizes = [None]

    # Parameters the model gathers itself inside its layer loop (osdp_jax.gather_params), and
    # kernels of dense layers it may split (osdp_jax.split).
    in_loop, splittable = frozenset(), frozenset()
    if loss_fn is not None:
        shapes = {i.path: i.shape for i in infos}
        loop_found, split_found = discover(loss_fn, abstract, batch)
        in_loop = frozenset(p for p in loop_found if len(shapes.get(p, ())) >= 2)
        splittable = frozenset(p for p in split_found if len(shapes.get(p, ())) == 2 + (p in in_loop))

    topo = Topology(axes, tuple(mesh.shape[a] for a in axes))
    device_bytes = default_hardware(mesh).memory_bytes  # what the mesh's devices really hold
    inner = topo.inner

    def spec_of(info, strategy):
        return spec_for(info, strategy, axes, n, info.path in in_loop, inner)

    def split_counts(info, strategy) -> list[int]:
        """Split counts k > 1 a sharded kernel can take: its gather group times k must divide
        its sharded dimension."""
        spec = spec_of(info, strategy)
        if info.path not in splittable or spec is None:
            return []
        size, group = info.shape[sharded_dim(spec)], (n if strategy == "zero3" else inner)
        return [k for k in splits if k > 1 and size % (group * k) == 0]

    # Columns are (strategy, k) choices. A parameter that none of the allowed strategies can
    # store (a 0-d scalar, or no dimension the device count divides, under zero3) is
    # replicated, the one layout that always applies.
    names = strategies if "replicate" in strategies else (*strategies, "replicate")
    sharded = [s for s in ("zero3", "hsdp") if s in strategies]
    columns = [(s, 1) for s in names] + [(s, k) for s in sharded for k in splits if k > 1]
    ks = {(i.path, s): split_counts(i, s) for i in infos for s in sharded}
    options = []
    for i in infos:
        row = []
        for s, k in columns:
            spec = spec_of(i, s) if s in strategies else None
            if s in sharded and k > 1 and k not in ks[i.path, s]:
                spec = None
            if s in sharded and k == 1 and 1 not in splits and ks[i.path, s]:
                spec = None  # this kernel must split
            row.append(spec)
        options.append(row)
    for info, row in zip(infos, options):
        if all(o is None for o in row):
            row[columns.index(("replicate", 1))] = P()
            log.info("parameter %s %s cannot be stored as %s: replicated", info.path, info.shape,
                     "/".join(strategies))
    available = np.array([[o is not None for o in row] for row in options], dtype=bool)

    def specs(zero3_where):
        return {i.path: (spec_of(i, "zero3") if zero3_where(i) else None) or P() for i in infos}

    def probe(size, zero3_where, split=None, timed=False):
        """XLA's figures for one probe step, and its measured seconds when ``timed`` (and it fits)."""
        sp, b = specs(zero3_where), _with_batch_size(batch, size)
        compiled = compile_step(loss_fn, optimizer, abstract, b, mesh, axes, sp, in_loop, split)
        prof = profile_compiled(compiled)
        seconds = None
        if timed and prof.peak_bytes <= device_bytes:  # it must fit the devices, not the budget
            seconds = time_compiled(compiled, abstract_args(optimizer, abstract, b, mesh, axes, sp))
        return prof, seconds

    def modelled_comm(zero3_where) -> float:
        """Modelled collective seconds of a probe's plan (no splits)."""
        return sum(comm_seconds(i.nbytes, "zero3", hw, topo, i.shape[0] if i.path in in_loop else 0)
                   if zero3_where(i) and spec_of(i, "zero3") is not None
                   else comm_seconds(i.nbytes, "replicate", hw, topo) for i in infos)

    # Activations, temporaries and FLOPs grow linearly with the batch: compile the probes at the
    # smallest and largest batch size and interpolate between them (the chosen plan is compiled
    # and checked against the budget afterwards).
    calibrations: dict = {s: None for s in sizes}
    if loss_fn is not None:
        p = np.array([i.nbytes for i in infos], dtype=np.float64)
        loop = np.array([i.path in in_loop for i in infos])
        can_shard = np.array([spec_of(i, "zero3") is not None for i in infos])
        kinds = ["R", "Z"] + (["L"] if (can_shard & loop).any() and (can_shard & ~loop).any() else [])
        # every per-layer splittable kernel split at its largest k, the rest as in the Z probe
        split_probe = {i.path: ks[i.path, "zero3"][-1] for i in infos
                       if i.path in in_loop and ks.get((i.path, "zero3"))}
        split_share = sum((1 - 1 / k) * i.nbytes / i.shape[0] for i in infos
                          if (k := split_probe.get(i.path)))
        kinds += ["S"] if split_probe else []
        where = {"R": lambda i: False, "Z": lambda i: True, "L": lambda i: i.path in in_loop,
                 "S": lambda i: True}
        jobs = [(k, b) for b in sorted({sizes[0], sizes[-1]}) for k in kinds]
        desc = "osdp-jax: compiling and timing probes" if measure_time else "osdp-jax: compiling probes"
        timed_runs = {job: probe(job[1], where[job[0]], split_probe if job[0] == "S" else None,
                                 timed=measure_time and job[0] != "S")
                      for job in _progress(jobs, len(jobs), desc)}
        got = {job: prof for job, (prof, _) in timed_runs.items()}
        probed = {}
        for b in sorted({sizes[0], sizes[-1]}):
            # with no per-step parameter to shard, the all-zero3 probe is the per-layer one
            per_layer = got.get(("L", b), got[("Z", b)] if not (can_shard & ~loop).any() else None)
            probed[b] = fit(got[("R", b)], per_layer, got[("Z", b)], p, can_shard, loop,
                            got.get(("S", b)), split_share)
            runs = [(sec, got[(kind, b)].flops / hw.flops, modelled_comm(where[kind]))
                    for kind in kinds if kind != "S" and (sec := timed_runs[(kind, b)][1]) is not None]
            if runs:
                cf, cc = fit_time(runs)
                probed[b] = dataclasses.replace(probed[b], compute_scale=cf, comm_scale=cc)
                log.info("batch %d: compute x%.2f, collectives x%.2f from %d timed probes", b, cf, cc, len(runs))
        calibrations = {b: probed[b] if b in probed else interpolate(probed, b) for b in sizes}

    t_search = _time.perf_counter()
    # one set of cost tables per batch size, shared by every search below
    tables_for = {size: cost_tables(infos, available, columns, opt_bytes, other_opt, topo, hw,
                                    _batch_bytes(_with_batch_size(batch, size)) if size is not None else 0,
                                    calibrations[size], in_loop)
                  for size in sizes}

    def candidate(size, sol):
        tables = tables_for[size]
        step_s = tables.base_time + sol.time
        sps = size / step_s if size is not None and step_s > 0 else None
        return (sps if sps is not None else -sol.time, size, sol, tables, step_s, sps)

    def search(budget_limit):
        best, min_needed = None, math.inf
        for size, tables in tables_for.items():
            try:
                sol = solve_pools(tables.time, tables.mem, tables.pools, budget_limit - tables.base_mem)
            except InfeasibleBudgetError as e:
                min_needed = min(min_needed, e.min_bytes + tables.base_mem)
                continue
            found = candidate(size, sol)
            if best is None or found[0] > best[0]:
                best = found
        return best, min_needed

    def least_memory():
        """The plan with the smallest predicted peak, at the smallest batch size."""
        tables = tables_for[sizes[0]]
        try:
            solve_pools(tables.time, tables.mem, tables.pools, -1.0)
        except InfeasibleBudgetError as e:
            floor = e.min_bytes
        return candidate(sizes[0], solve_pools(tables.time, tables.mem, tables.pools, floor * (1 + 1e-9) + 1))

    best, min_needed = search(budget_bytes)
    t_search = _time.perf_counter() - t_search
    if best is None:
        raise InfeasibleBudgetError(
            f"no plan fits a per-device budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) "
            f"with strategies {list(strategies)}; the smallest budget that fits is "
            f"{format_bytes(min_needed)} ({math.ceil(min_needed)} bytes). Raise the budget, allow "
            f"'zero3', or use a smaller batch size", min_bytes=math.ceil(min_needed))

    def build(best_, xla_peak=None):
        _, size, sol, tables, step_s, sps = best_
        pps = tuple(ParamPlan(i.path, i.shape, str(i.dtype), columns[c][0], options[k][c], i.nbytes,
                              i.path in in_loop, columns[c][1], bool(tables.two_stage[k, c]))
                    for k, (i, c) in enumerate(zip(infos, sol.choices)))
        return Plan(pps, axes, n, size, budget_bytes, tables.base_mem + sol.mem,
                    step_s if size is not None else None, sps, xla_peak, hw.name, t_search,
                    unboxed_treedef(params))

    result = build(best)
    if loss_fn is None or not verify:
        return result
    # Compile the chosen plan. If XLA needs more than the model said, search again with the
    # budget lowered by the model's largest error so far (bounded); last, try the plan that needs
    # the least memory, and if even that does not fit, its XLA peak is the minimum to report.
    def xla_peak(plan_):
        return profile_step(loss_fn, optimizer, abstract, _with_batch_size(batch, plan_.batch_size),
                            mesh, axes, plan_.specs_by_path, in_loop, plan_.splits_by_path,
                            plan_.two_stage).peak_bytes

    error = 0.0
    for attempt in range(MAX_VERIFY_TRIES):
        measured = xla_peak(result)
        if measured <= budget_bytes:
            return build(best, measured)
        error = max(error, measured - result.predicted_peak_bytes)
        log.info("plan attempt %d: XLA peak %s over budget %s; re-planning", attempt + 1,
                 format_bytes(measured), format_bytes(budget_bytes))
        best, _ = search(budget_bytes - error)
        if best is None:
            break
        result = build(best)
    best = least_memory()
    measured = xla_peak(build(best))
    if measured <= budget_bytes:
        return build(best, measured)
    raise InfeasibleBudgetError(
        f"no plan fits a per-device budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) once "
        f"compiled: the plan that needs the least memory peaks at {format_bytes(measured)} by XLA; "
        f"the smallest budget that fits is {measured} bytes", min_bytes=int(measured))

