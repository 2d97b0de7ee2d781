"""``plan()``: problem -> calibration -> cost -> search -> verification -> ``Plan``.

Each stage is its own module of ``osdp_jax.planner``: ``problem`` (the choice columns and what
applies where), ``calibration`` (probe steps, compiled or recorded), ``cost`` (memory and time per
choice), ``search`` (the exact Pareto search) and ``verify`` (compile the choice, re-plan if needed).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

from osdp_jax.core.bytes import format_bytes, parse_bytes
from osdp_jax.core.describe import check_optimizer, describe, strip_boxes, unboxed_treedef
from osdp_jax.core.gc import paused
from osdp_jax.core.hardware import default_hardware, resolve_hardware
from osdp_jax.core.layout import check_dtype, whole_spec
from osdp_jax.core.plan import ParamPlan, Plan
from osdp_jax.core.stack import REMAT_POLICIES, check_remat
from osdp_jax.core.strategies import (
    DEFAULT_SPLITS,
    GATHERED,
    accumulation,
    axes_size,
    check_microbatches,
    check_splits,
    check_strategies,
    data_axes,
)
from osdp_jax.core.xla import matmul_flops
from osdp_jax.planner import probe_store as _probe_store
from osdp_jax.planner.calibration import (
    MARGINS,
    OVERLAPS,
    UNIT_SCALES,
    Calibrator,
    XlaCalibrator,
    calibrate,
    probe_choices,
    probe_requests,
    step_split_bytes,
    step_split_probe,
    uncalibrated,
)
from osdp_jax.planner.cost import cost_tables, items_within, optimizer_bytes, step_seconds
from osdp_jax.planner.discover import find
from osdp_jax.planner.loss import PlainLoss
from osdp_jax.planner.problem import Problem, build_problem
from osdp_jax.planner.search import (
    BeyondBound,
    InfeasibleBudgetError,
    Solution,
    fastest_front,
    least_memory,
    lower_bound,
)
from osdp_jax.planner.segments import expand, expand_choices, param_columns, segments
from osdp_jax.planner.tensor_pairs import tensor_groups
from osdp_jax.planner.unit_policy import unmarked_list
from osdp_jax.planner.verify import Superseded, verify
from osdp_jax.runtime.step import (
    PROBE_TOLERANCE,
    check_batch_leaves,
    compile_count,
    compile_seconds,
    profile_checked,
    profile_step,
)

log = logging.getLogger("osdp_jax")


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What :func:`plan` searches over and how, as one value: ``plan(params, mesh, options)``.

    Every field is also a keyword of ``plan``; the comments beside the fields say what each one
    does, and the [planning guide](../guides/planning.md) explains them."""

    budget: int | str | None = None  # per-device bytes, "512MiB"/"8GB", or "least"; None: the device's memory
    loss_fn: object = None  # loss_fn(params, batch) -> mean loss; with batch, the step is compiled
    batch: object = None  # an example global batch (leading dimension = global batch size)
    batch_sizes: tuple[int, ...] | None = None  # global batch sizes to sweep (default: batch's)
    optimizer: object = None  # an optax optimizer; None: optax.adam's state, with a warning
    hardware: object = None  # Hardware, preset name, profile .json or dict; None: from the mesh
    strategies: tuple[str, ...] | None = None  # allowed strategies (default all that apply)
    axis: object = None  # data-parallel mesh axes (default all)
    splits: tuple[int, ...] = DEFAULT_SPLITS  # candidate split counts for sharded dense kernels
    verify: bool | str = True  # compile the chosen plan for XLA's figures and re-plan if its peak exceeds
    #                            the budget; "full": compile it to run (training reuses it); False: none
    measure_time: bool = False  # time the probes on the mesh and scale the time model to them
    calibrator: Calibrator | None = None  # where probe figures come from (default: compile them)
    remat: tuple[str, ...] = REMAT_POLICIES  # remat policies the search may give a stack's layers
    per_layer: bool = True  # decide each layer of a stack (segments); False: one choice per stack
    segment_gain: float = 0.0  # predicted speed-up each segment of a stack beyond its first must bring
    #                            (0.01: 1%), or a plan with every layer alike is taken; 0: the fastest plan
    units: object = None  # unit patterns (osdp_jax.units); None: the default policy; (): no units
    unit_remat: str = "full"  # the remat policy units run under
    compute_dtype: str | None = None  # e.g. "bfloat16": sharded parameters gathered in it (fp32 masters)
    microbatches: tuple[int, ...] = (1,)  # gradient-accumulation counts searched with the batch size
    has_aux: bool = False  # loss_fn returns (loss, aux), as make_train_step(has_aux=True) takes it
    rng: bool = False  # loss_fn takes rng=, as make_train_step(rng=True) gives it
    state: object = None  # mutable collections (arrays or ShapeDtypeStructs): loss_fn takes state= and
    #                       returns (loss, new_state), as make_train_step(state=True) takes it
    tensor: object = None  # tensor parallelism over model_axis: None (none); "auto" (the pairs the model's dense
    #                        calls show, osdp_jax.tensor_roles, the fastest plan with them all split, with the
    #                        pairs whose split pays by the time model split, or with every mesh axis
    #                        data-parallel); {pattern: "column" | "row"} (those pairs as well, all split)
    model_axis: str = "model"  # the mesh axis tensor parallelism splits over
    sequence: object = False  # with tensor=: Megatron's sequence parallelism, row layers' outputs split on their
    #                           sequence over the model axis (True); "auto": planned with and without, the faster
    model_sizes: object = None  # with tensor=: the model-axis sizes to plan, the devices of the model axis and its
    #                             neighbouring data axis shared anew (1: every axis data-parallel); "auto": every
    #                             size that divides them; None: the mesh's own (and 1 with tensor="auto")


LEAST_TRIES = 4  # budget="least": plans at the least budget the last try's error names, at most this often


def _least_memory_plan(params, mesh, plan_options: PlanOptions) -> Plan:
    """``plan(budget="least")``: the fastest plan at the least per-device budget any plan of the
    search space needs. A first plan at 1 byte raises the least budget it can predict
    (``InfeasibleBudgetError.min_bytes``); the plan made there is verified as every plan is, and
    where XLA's figure misses it, planning again at the budget that miss names."""
    budget = 1
    for _ in range(LEAST_TRIES):
        try:
            return plan(params, mesh, dataclasses.replace(plan_options, budget=budget))
        except InfeasibleBudgetError as error:
            if error.min_bytes <= budget:
                raise
            budget = math.ceil(error.min_bytes)
    return plan(params, mesh, dataclasses.replace(plan_options, budget=budget))


@paused()
def plan(params, mesh, options: PlanOptions | None = None, **kwargs) -> Plan:
    """The highest-throughput plan whose whole training step fits ``budget`` per device.

    ``budget="least"`` asks for the least-memory plan instead: the fastest plan at the least
    per-device budget any plan of the search space needs (at a generous budget, units and remat
    are chosen for speed, so even an all-ZeRO-3 plan there is not the least-memory one).

    Args:
      params: any params pytree (plain, linen boxed or not, ``nnx.State``); arrays or
        ``jax.ShapeDtypeStruct``. Nothing is allocated.
      mesh: the device mesh; ``axis`` names its data-parallel axes (default: all of them).
      options: a :class:`PlanOptions`; or pass its fields as keywords: ``budget``, ``loss_fn``,
        ``batch``, ``batch_sizes``, ``optimizer``, ``hardware``, ``strategies``, ``axis``, ``splits``
        (``(1,)`` disables operator splitting; a kernel gathered once per step is split only when
        splitting all such kernels could shrink them by ``STEP_SPLIT_SHARE``, 1%, of the budget),
        ``verify`` (True, the default, or ``"figures"``: compile the chosen plan for XLA's
        figures only, as the probes are, cheaper than a full compile on XLA:CPU and within
        ``runtime.step.PROBE_TOLERANCE`` of its peak there (exact elsewhere), and
        ``make_train_step`` compiles it to run;
        ``"full"``: compile it to run here, the executable ``make_train_step`` then takes (no
        compile there), checked as a probe first when predicted within 10% of the budget: for a
        plan trained at once, one compile less in all; False: trust the model),
        ``measure_time`` (runs the probes on the
        mesh; it allocates their memory), ``calibrator`` (e.g. a ``RecordedCalibrator``), ``remat``
        (the policies a layer stack's layers may take, default ``("full", "dots", "none")``;
        ``("full",)`` keeps full rematerialisation), ``per_layer`` (False: every layer of a stack
        takes the same choice, one segment), ``segment_gain`` (e.g. 0.01: a plan that cuts a
        stack into s segments is taken only if its predicted samples/s beat the best plan with every
        layer alike, one segment, by a factor ``(1 + segment_gain) ** (s - 1)``: each segment's
        loop compiles on its own, so a step of s segments takes longer to compile; the default 0
        takes the
        fastest plan whatever its segments), ``units`` (``fnmatch`` patterns of the submodules
        whose sharded weights are gathered on each call and again in the backward pass,
        ``osdp_jax.units``; None: the default policy; ``()``: none) and ``unit_remat`` (the remat
        policy units run under, default ``"full"``), ``compute_dtype`` (e.g. ``"bfloat16"``: every
        sharded parameter is gathered, and its gradient reduce-scattered, in that dtype, at half
        the bytes from float32; the stored shard, its update and its optimizer state keep the
        parameter's dtype; the probes are compiled that way, so the memory terms are fitted on it),
        ``microbatches`` (e.g. ``(1, 2, 4, 8)``: each global batch size is also tried as m
        microbatches with gradient accumulation, ``Plan.microbatches``, and each parameter's
        gradient summed whole or in its shard across them, ``ParamPlan.accumulate``; the default
        ``(1,)`` does not accumulate), and ``has_aux``, ``rng`` and ``state`` (the mutable
        collections, e.g. ``{"batch_stats": ...}``): the loss function as ``make_train_step``
        takes it with those flags (``osdp_jax.planner.loss.PlainLoss``: the probes see zeros of the
        state's shapes and a fixed key, and only the loss).

    What compiled plans of a model teach the planner is kept in the process for its next plans
    (``planning.clear_probe_cache`` forgets it): the probes, the pool overlap, the units' scale,
    and the largest share of memory XLA needed over the model's prediction; a later plan of the
    model leaves that share of its budget free (verified or not; ``MARGIN``, 0.5%, at least, on
    every plan), unless that costs more than ``MARGIN_COST`` (1%) of predicted samples/s, when
    the search's own choice is tried first.

    A layer stack (parameters run by ``osdp_jax.layers.scan``) is decided per layer: the plan may
    cut it into segments with their own strategy, split count and remat policy
    (``Plan.segments``).

    Raises:
      InfeasibleBudgetError: no plan fits; ``.min_bytes`` is the smallest budget that would.
    """
    start = time.perf_counter()
    plan_options = dataclasses.replace(options or PlanOptions(), **kwargs)
    _check_sequence(plan_options)
    if isinstance(plan_options.budget, str) and plan_options.budget.strip().lower() == "least":
        return _least_memory_plan(params, mesh, plan_options)
    if plan_options.tensor is not None and not isinstance(plan_options.tensor, TensorRoles):
        before = compile_count(), compile_seconds(), _probe_store.reads()
        return _timed(_tensor_plan(params, mesh, plan_options), start, before)
    prepared = _prepare(params, mesh, plan_options)
    plan_options, problem, axes, batches = prepared.plan_options, prepared.problem, prepared.axes, prepared.batches
    hw, budget, optimizer, abstract, policies = (prepared.hw, prepared.budget, prepared.optimizer, prepared.abstract,
                                                 prepared.policies)
    calibrator = plan_options.calibrator or XlaCalibrator(plan_options.loss_fn, optimizer, abstract, mesh,
                                                          default_hardware(mesh).memory_bytes)
    one = functools.partial(_plan_problem, plan_options=plan_options, params=params, mesh=mesh, hw=hw, budget=budget,
                            optimizer=optimizer, abstract=abstract, batches=batches, policies=policies,
                            calibrator=calibrator, start=start)
    # the counts some batch size splits into; without a loss function nothing is accumulated
    counts = check_microbatches(plan_options.microbatches, None if plan_options.loss_fn is None else batches,
                                axes_size(mesh, axes))
    counts = counts if plan_options.loss_fn is not None else (1,)
    before = compile_count(), compile_seconds(), _probe_store.reads()
    # with the default unit policy's units, also without them: a unit saves memory for one more
    # gather (and, under the default "full" unit remat, its forward pass again)
    problems = [problem] if plan_options.units is not None or not problem.units else [
        problem, dataclasses.replace(problem, units={})]
    ddp = _probe_together(problems, one, plan_options, counts, calibrator, axes, batches, budget, policies)
    if ddp is not None:
        return _timed(ddp, start, before, mesh)
    runs = [functools.partial(one, p, microbatches=m) for p in problems for m in counts]
    if plan_options.segment_gain and plan_options.per_layer and problem.stacks:  # also every layer of each stack alike
        runs += [functools.partial(_one_segment, one, p, microbatches=m) for p in problems for m in counts]
    try:
        best = _fastest(runs, plan_options)
    except InfeasibleBudgetError as e:
        hint = _nnx_units_hint(params, problem, plan_options)
        if not hint:
            raise
        raise InfeasibleBudgetError(f"{e}. {hint}", e.min_bytes) from None
    if len(problems) > 1:
        log.info("units: %s", "used" if best.units else "not used")
    return _timed(best, start, before, mesh)


class _Prepared(NamedTuple):
    """What :func:`plan` derives from its options before probing: the checked options, the
    problem, the data-parallel axes, the batches per global batch size, the hardware, the budget
    in bytes, the optimizer, the abstract params and the remat policies."""

    plan_options: PlanOptions
    problem: Problem
    axes: tuple[str, ...]
    batches: dict
    hw: object
    budget: int
    optimizer: object
    abstract: object
    policies: tuple[str, ...]


def _prepare(params, mesh, plan_options: PlanOptions) -> _Prepared:
    """The options checked and the problem built (the loss traced once, and kept: ``find``)."""
    roles = plan_options.tensor
    strategies, axes = check_strategies(plan_options.strategies), data_axes(mesh, plan_options.axis)
    plan_options = _checked(plan_options, strategies, axes)
    splits = check_splits(plan_options.splits)
    policies = _policies(plan_options.remat)
    hw = resolve_hardware(plan_options.hardware, mesh)
    budget = parse_bytes(plan_options.budget) if plan_options.budget is not None else hw.memory_bytes
    optimizer = _optimizer(plan_options.optimizer)
    batches = _batches(plan_options.loss_fn, plan_options.batch, plan_options.batch_sizes, axes_size(mesh, axes))
    problem = build_problem(params, mesh, axes, strategies, splits, plan_options.loss_fn,
                            None if plan_options.batch is None else batches[min(batches)], plan_options.units,
                            plan_options.unit_remat, check_dtype(plan_options.compute_dtype),
                            dict(roles.roles) if roles else None, roles.model_axis if roles else None,
                            roles.sequence if roles else False)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    check_optimizer(optimizer, abstract)
    problem = _step_splits_worth_probing(problem, budget)
    return _Prepared(plan_options, problem, axes, batches, hw, budget, optimizer, abstract, policies)


@dataclasses.dataclass(frozen=True)
class TensorRoles:
    """Resolved tensor-parallel roles, as :func:`_tensor_plan` hands them to :func:`plan`."""

    roles: tuple[tuple[str, str], ...]
    model_axis: str
    sequence: bool = False
    pairs: str = ""  # which of the pairs found are split, where not all: e.g. "3 of 6 pairs"


def _tensor_plan(params, mesh, plan_options: PlanOptions) -> Plan:
    """``plan(tensor=...)``: the pairs found in the model's dense calls (and the patterns given),
    split over ``model_axis`` with the other mesh axes data-parallel, for each model-axis size of
    ``model_sizes`` (:func:`_configurations`); the fastest of those plans (:func:`_fastest_configuration`)."""
    model, tensor = plan_options.model_axis, plan_options.tensor
    if model not in mesh.axis_names:
        raise ValueError(f"tensor= needs a model axis, but the mesh has no axis {model!r} (its axes are "
                         f"{list(mesh.axis_names)}); pass model_axis= one of them, or build the mesh with one, "
                         f"e.g. jax.make_mesh((2, 4), ('data', 'model'))")
    if tensor != "auto" and not isinstance(tensor, dict):
        raise ValueError(f"tensor must be None, 'auto' or a dict of parameter path patterns to 'column'/'row', "
                         f"got {tensor!r}")
    if plan_options.loss_fn is None or plan_options.batch is None:
        raise ValueError("tensor= needs loss_fn and batch: the pairs are found by tracing the loss")
    axes = tuple(a for a in mesh.axis_names if a != model) if plan_options.axis is None else \
        data_axes(mesh, plan_options.axis)
    if model in axes or not axes:
        raise ValueError(f"with tensor=, the data-parallel axes are the mesh axes but the model axis {model!r}: "
                         f"got {list(axes)}; pass axis= the others (a mesh of the model axis alone has none)")
    if axes_size(mesh, axes) < 2:
        raise ValueError(f"with tensor=, the data-parallel axes {list(axes)} need at least 2 devices (this mesh's "
                         f"have {axes_size(mesh, axes)}): give the model axis fewer, e.g. "
                         f"jax.make_mesh((2, {mesh.size // 2}), ('data', {model!r}))")
    # the optimizer resolved once (its default is announced once), the data axes fixed
    plan_options = dataclasses.replace(plan_options, optimizer=_optimizer(plan_options.optimizer), axis=axes)
    configurations = _configurations(params, mesh, plan_options)
    if not configurations:
        log.info("tensor parallelism: no column/row pair found in the model's dense calls%s; planned without",
                 _scanned_dense(params, plan_options))
        return plan(params, mesh, dataclasses.replace(plan_options, tensor=None, axis=None, sequence=False))
    return _fastest_configuration(params, configurations, plan_options)


def _traced_loss(plan_options: PlanOptions) -> tuple:
    """``(loss, batch)`` as the pairs are found from them: the plain loss (``PlainLoss``) and the
    batch's shapes."""
    loss = PlainLoss.of(plan_options.loss_fn, plan_options.has_aux, plan_options.rng, plan_options.state)
    return loss, jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), plan_options.batch)


def _scanned_dense(params, plan_options: PlanOptions) -> str:
    """Where the model's own scan (``nn.scan``, ``nnx.scan``) runs stacked kernels, which take no
    tensor role: a note saying so and naming ``osdp_jax.layers.scan``; else ``""``."""
    loss, batch = _traced_loss(plan_options)
    found = find(loss, params, batch)
    scanned = sorted(i.path for i in describe(params) if i.path in found.model_loop and len(i.shape) >= 3)
    if not scanned:
        return ""
    return (f" outside the model's own scan (nn.scan or nnx.scan), whose layers' kernels ({scanned[0]}, ...) stay "
            f"data-parallel; a stack run by osdp_jax.layers.scan is split per layer")


def _configurations(params, mesh, plan_options: PlanOptions) -> list[tuple]:
    """``(mesh, options)`` to plan, one per model-axis size t of ``plan_options.model_sizes``
    (:func:`_model_sizes`): t = 1 is ``mesh`` with every axis data-parallel (when every batch size
    divides over all its devices); t > 1 is ``mesh`` with the model axis t devices and its
    neighbouring data axis the rest (:func:`_reshaped`), with the pairs whose widths t divides
    split over it (:func:`tensor_groups`; none found: no configuration), and with
    ``tensor="auto"`` also with only the pairs whose split the time model says pays
    (:func:`_paying_pairs`), where that is some of them but not all."""
    model, tensor = plan_options.model_axis, plan_options.tensor
    loss, batch = _traced_loss(plan_options)
    sizes = plan_options.batch_sizes or (check_batch_leaves(plan_options.batch),)
    out = []
    for t in model_sizes_for(plan_options.model_sizes, tensor, dict(mesh.shape), model, plan_options.axis):
        if t == 1:
            if all(b % mesh.size == 0 for b in sizes):  # else only tensor parallelism can split it
                out.append((mesh, dataclasses.replace(plan_options, tensor=None, axis=None, sequence=False)))
            continue
        groups = tensor_groups(loss, params, batch, size=t, hint=tensor if isinstance(tensor, dict) else None)
        if not groups:
            continue
        reshaped = _reshaped(mesh, model, plan_options.axis, t)
        every = TensorRoles(tuple(sorted((p, r) for g in groups for p, r in g.items())), model)
        log.info("tensor parallelism over %r (%d devices): %d pairs, %d parameters split (%s)", model, t,
                 len(groups), len(every.roles), ", ".join(p for p, _ in every.roles[:3])
                 + (" ..." if len(every.roles) > 3 else ""))
        choices = [every]
        if tensor == "auto":
            choices += _paying_pairs(params, reshaped, dataclasses.replace(plan_options, tensor=every), groups)
        out += [(reshaped, dataclasses.replace(plan_options, tensor=dataclasses.replace(roles, sequence=sequence)))
                for roles in choices
                for sequence in ((False, True) if plan_options.sequence == "auto" else (plan_options.sequence,))]
    return out if any(o.tensor is not None for _, o in out) else []


def _paying_pairs(params, mesh, plan_options: PlanOptions, groups: list[dict]) -> list[TensorRoles]:
    """The roles of the pairs whose split pays by the time model (:func:`split_pays`), one
    ``TensorRoles`` per distinct choice over the global batch sizes, where that is some of the
    pairs but not all."""
    prepared = _prepare(params, mesh, plan_options)
    choices = {}
    for size in sorted(prepared.batches):
        pays = split_pays(prepared, groups, size)
        if any(pays) and not all(pays):
            choices[tuple(pays)] = TensorRoles(
                tuple(sorted((p, r) for g, paid in zip(groups, pays) if paid for p, r in g.items())),
                plan_options.tensor.model_axis, pairs=f"{sum(pays)} of {len(pays)} pairs")
    for pays, roles in choices.items():
        log.info("tensor parallelism: the split pays for %s by the time model (%s)", roles.pairs,
                 ", ".join(next(p for p, r in g.items() if r == "row") for g, paid in zip(groups, pays) if paid
                           and "row" in g.values()))
    return list(choices.values())


def split_pays(prepared: _Prepared, groups: list[dict], size: int) -> list[bool]:
    """Per pair of ``groups`` (``{path: role}``, all split in ``prepared``'s problem), whether
    splitting it over the model axis lowers the time model's seconds per step at global batch
    ``size``: its parameters' cheapest collectives over the data axes with their split
    dimension 1/t, plus the model axis's all-reduces (:func:`_with_tensor_seconds`), against
    their cheapest collectives whole plus the compute every device of the model axis then runs
    of the whole pair, ``(1 - 1/t) 3 F b / (N flops)`` seconds (F: the pair's kernels' forward
    FLOPs per sample, ``Problem.dense_flops``, three times that with the backward pass; b / N
    samples per data-parallel group). The pair kept whole is data-parallel only, computed alike on the t devices."""
    problem, hw = prepared.problem, prepared.hw
    split = _cheapest_seconds(prepared, size)
    whole = _cheapest_seconds(prepared, size, whole=True)
    index = {info.path: k for k, info in enumerate(problem.infos)}
    share = 3 * (1 - 1 / problem.model_size) * size / problem.n / hw.flops
    pays = []
    for group in groups:
        members = [index[p] for p in group if p in index]
        compute = share * sum(problem.dense_flops.get(p, 0.0) for p in group)
        pays.append(bool(split[members].sum() < whole[members].sum() + compute))
    return pays


def _check_sequence(plan_options: PlanOptions) -> None:
    """One clear ``ValueError`` for a ``sequence`` option that cannot work: not True, False or
    "auto", or sequence parallelism asked for without ``tensor=``."""
    sequence = plan_options.sequence
    if not (isinstance(sequence, bool) or sequence == "auto"):
        raise ValueError(f"sequence must be True (sequence parallelism with tensor=), False or 'auto' (planned "
                         f"with and without), got {sequence!r}")
    if sequence and plan_options.tensor is None:
        raise ValueError("sequence parallelism splits row layers' outputs over the model axis of tensor "
                         "parallelism: pass tensor= too (e.g. tensor='auto'), or drop sequence=")


def model_sizes_for(model_sizes, tensor, shape: dict, model: str, axes: tuple) -> tuple[int, ...]:
    """The model-axis sizes to plan on a mesh of ``shape`` (axis -> devices) with data axes
    ``axes``: ``model_sizes`` checked (one clear ``ValueError``); None: the mesh's own (and 1,
    every axis data-parallel, with ``tensor="auto"``); ``"auto"``: every size from 1 that divides
    the model axis and its neighbouring data axis together."""
    own, pool, size = shape[model], shape[model] * shape[axes[-1]], math.prod(shape.values())
    # at model size t, size // t devices are data-parallel: at least 2 where t > 1
    fits = tuple(t for t in range(1, pool + 1) if pool % t == 0 and (t == 1 or size // t >= 2))
    if model_sizes is None:
        return (1, own) if tensor == "auto" else (own,)
    if isinstance(model_sizes, str) and model_sizes == "auto":
        return fits
    sizes = (model_sizes,) if isinstance(model_sizes, int) else model_sizes
    if (not isinstance(sizes, (tuple, list)) or not sizes
            or any(isinstance(t, bool) or not isinstance(t, int) or t not in fits for t in sizes)):
        raise ValueError(f"model_sizes must be 'auto' or model-axis sizes that divide the {pool} devices of the "
                         f"axes {axes[-1]!r} and {model!r} together and leave at least 2 data-parallel devices: "
                         f"some of {fits} (1: every axis data-parallel), got {model_sizes!r}")
    return tuple(dict.fromkeys(sizes))


def _reshaped(mesh, model: str, axes: tuple, size: int):
    """``mesh`` with ``model`` of ``size`` devices and the last data axis ``axes[-1]`` the devices
    they leave (the same devices, in order): ``Plan.make_mesh`` builds it."""
    if mesh.shape[model] == size:
        return mesh
    shape = dict(mesh.shape)
    shape[axes[-1]] = mesh.shape[axes[-1]] * mesh.shape[model] // size
    shape[model] = size
    return jax.make_mesh(tuple(shape[a] for a in mesh.axis_names), mesh.axis_names, axis_types=mesh.axis_types,
                         devices=list(mesh.devices.flat))


def _fastest_configuration(params, configurations, plan_options: PlanOptions) -> Plan:
    """The fastest plan over ``configurations`` (``(mesh, options)``), each planned whole.

    A configuration's samples/s is bounded before any probe (:func:`speed_bound`): they are
    planned highest bound first, and one whose bound is no better than the best plan so far is
    not planned. With verification, each is first planned as a draft (its probes compiled, no
    verification); the best draft is verified, and the next verified only if its draft beats
    that: one verification compile where the first wins."""
    verify = plan_options.verify
    prepared = [(_prepare(params, m, o), m, o) for m, o in configurations]
    flops = step_matmul_flops(prepared[0][0], params) if len(prepared) > 1 else 0.0
    bounded = sorted(((speed_bound(p, flops), m, o) for p, m, o in prepared), key=lambda x: -x[0])
    speed = functools.partial(_speed, gain=plan_options.segment_gain)
    drafts, errors = [], []
    for bound, mesh, options in bounded:
        if drafts and bound <= max(speed(d)[0] for d, _, _ in drafts):
            log.info("%s: at most %.1f samples/s by the time model, not planned",
                     _configuration_name(options.tensor, dict(mesh.shape)), bound)
            continue
        try:
            drafts.append((plan(params, mesh, dataclasses.replace(options, verify=False) if verify else options),
                           mesh, options))
        except InfeasibleBudgetError as e:
            errors.append(e)
            continue
        log.info("%s: predicted %.1f samples/s%s", _configuration_name(options.tensor, dict(mesh.shape)),
                 drafts[-1][0].predicted_samples_per_second or 0.0, " before verification" if verify else "")
    best = None
    for draft, mesh, options in sorted(drafts, key=lambda d: speed(d[0]), reverse=True):
        if best is not None and speed(best) >= speed(draft):
            break
        try:
            done = plan(params, mesh, options) if verify else draft
        except InfeasibleBudgetError as e:
            errors.append(e)
            continue
        best = done if best is None or speed(done) > speed(best) else best
    if best is None:
        raise min(errors, key=lambda e: e.min_bytes)
    if len(bounded) > 1:
        log.info("planned %s: predicted %.1f samples/s",
                 _configuration_name(best if best.model_axis else None, dict(best.mesh_shape)),
                 best.predicted_samples_per_second or 0.0)
    return best


def _configuration_name(tensor, shape: dict) -> str:
    """E.g. ``"mesh data 2 x model 4, tensor-parallel"`` (``tensor``: a ``TensorRoles``, a plan
    with a model axis, or None)."""
    mesh = "mesh " + " x ".join(f"{a} {n}" for a, n in shape.items())
    if tensor is None:
        return mesh + ", every axis data-parallel"
    pairs = getattr(tensor, "pairs", "")
    kind = ", tensor- and sequence-parallel" if tensor.sequence else ", tensor-parallel"
    return mesh + kind + (f" ({pairs})" if pairs else "")


def _checked(plan_options: PlanOptions, strategies: tuple, axes: tuple) -> PlanOptions:
    """``plan_options`` (with ``strategies`` and data-parallel ``axes`` already checked) with its
    loss function wrapped (``PlainLoss``), or one clear ``ValueError`` for an option that cannot work."""
    if plan_options.loss_fn is not None:
        plan_options = dataclasses.replace(plan_options, loss_fn=PlainLoss.of(plan_options.loss_fn,
                                                                              plan_options.has_aux, plan_options.rng,
                                                                              plan_options.state))
    if "hsdp" in strategies and len(axes) < 2 and not set(strategies) - {"hsdp", "replicate"}:
        raise ValueError(f"strategy 'hsdp' needs two or more data-parallel mesh axes (sharded inside the last, "
                         f"replicated across the others); this mesh's are {list(axes)}, so every parameter would "
                         f"be replicated. Use a 2-D mesh, e.g. jax.make_mesh((2, 4), ('node', 'data')), or "
                         f"strategies=('zero3',)")
    if plan_options.verify not in (True, False, "figures", "full"):
        raise ValueError(f"verify must be True or 'figures' (compile the chosen plan for XLA's figures), 'full' "
                         f"(compile the step training then runs) or False (trust the model), "
                         f"got {plan_options.verify!r}")
    check_segment_gain(plan_options.segment_gain)
    return plan_options


def _timed(plan: Plan, start: float, before: tuple, mesh=None) -> Plan:
    """``plan`` with the whole planning's seconds, compiles and probe-store reads since ``before``,
    and the shape of the ``mesh`` it was made for (None: the one it has)."""
    n0, s0, r0 = before
    return dataclasses.replace(plan, planning_seconds=time.perf_counter() - start, compiles=compile_count() - n0,
                               compile_seconds=compile_seconds() - s0, probes_read=_probe_store.reads() - r0,
                               mesh_shape=plan.mesh_shape if mesh is None else
                               tuple((str(a), int(n)) for a, n in mesh.shape.items()))


def _probe_together(problems, one, plan_options: PlanOptions, counts, calibrator, axes, batches, budget,
                    policies) -> Plan | None:
    """The problems' probes compiled in one batch on the compile threads (each problem's calibrate
    then finds its own kept). Where every parameter replicated at the largest batch size is the
    fastest plan the model can give (:func:`_replication_may_be_fastest`), its probe comes first,
    the batch ends once XLA's peak of it fits, and that plan is returned; else None."""
    problem = problems[0]
    first = _replication_may_be_fastest(problem, plan_options, counts, calibrator, axes)
    if not (first or (len(problems) > 1 and plan_options.loss_fn is not None and 1 in counts
                      and hasattr(calibrator, "compile_all"))):
        return None
    top, fits, replicated = max(batches), [], dataclasses.replace(problem, units={}).replicated_only()

    def stop(job, figures) -> bool:  # passed only with ``first``
        if job[0] is replicated:
            fits.append(figures[0].peak_bytes <= budget)
        return any(fits)

    ddp_probe = [(replicated, probe_requests(replicated, {top: batches[top]})[1])] if first else []
    calibrator.compile_all(ddp_probe + [(p, probe_requests(p, batches, plan_options.measure_time, policies)[1])
                                        for p in problems], _progress, stop if first else None)
    if not any(fits):
        return None
    log.info("every parameter replicated at batch size %d fits: the fastest plan by the model, so no other layout "
             "was probed", top)
    return one(replicated, batches={top: batches[top]})


def _replication_may_be_fastest(problem: Problem, plan_options: PlanOptions, counts, calibrator, axes) -> bool:
    """Whether every parameter replicated, at the largest batch size and in one microbatch, is the
    fastest plan the cost model can give wherever XLA's peak of it fits the budget (``plan``
    probes that first): a replicated parameter's collective, ``a + 2(N-1)/N p/W`` s, is the least
    of any strategy's (zero3 and zero2 ``2a + 2(N-1)/N p/W``, hsdp more, a split or a unit more
    still, and a unit's forward pass recomputed), microbatches only add, and per-sample compute
    is the same at every batch size while the collectives are per step, so samples/s grows with
    the batch. Not when a layer stack's remat may take "dots" or "none" (fewer FLOPs than the
    probes' "full"), nor with ``compute_dtype`` (zero3 then gathers fewer bytes than an
    all-reduce moves), nor over several data-parallel axes (with a slower link between nodes,
    hsdp's all-reduce of a shard across them beats a whole all-reduce: ``tests/test_hsdp.py``),
    nor with timed probes or without a loss or a compiling calibrator."""
    return (plan_options.loss_fn is not None and not plan_options.measure_time and not problem.stacks
            and not plan_options.compute_dtype
            and len(axes) == 1
            and "replicate" in problem.strategies and 1 in counts and hasattr(calibrator, "compile_all")
            and problem.any_sharded())  # else there is nothing else to probe


def _nnx_units_hint(params, problem: Problem, plan_options: PlanOptions) -> str:
    """For a budget no plan meets: when ``params`` are an nnx model's state with a list of modules
    (``blocks/0``, ``blocks/1``, ...) and no units under the default policy, how units could meet
    it (an nnx module is a unit only once marked); else ``""``."""
    if not isinstance(params,
                      nnx.State) or plan_options.loss_fn is None or plan_options.units is not None or problem.units:
        return ""
    listed = unmarked_list(i.path for i in problem.infos if i.path not in problem.in_loop)
    if not listed:
        return ""
    shown = ", ".join(listed[:3]) + (", ..." if len(listed) > 3 else "")
    return (f"The model's modules {shown} are not units: an nnx model's are found only once marked, so each "
            f"sharded weight is gathered for the whole step. Call osdp_jax.units.mark(model) before nnx.split "
            f"to gather each at its call, under remat (README, Units), which may need far less memory")


def _fastest(runs, plan_options: PlanOptions) -> Plan:
    """The plan of highest predicted throughput among ``runs`` (each ``run(plan_options=options) -> Plan``:
    one problem, with or without units, at one microbatch count, per layer or with every layer of
    a stack alike), weighed by ``o.segment_gain`` (:func:`_speed`); the least
    ``InfeasibleBudgetError`` when none fits.

    With several runs, each is first planned without verification (its probes are compiled, or
    cached); then they are verified best first, until the best verified plan is at least as fast
    as the next unverified one (verification only lowers a plan's budget, so it never makes a
    plan faster): one verification compile, not one per run. A run whose plan
    misses by XLA and would re-plan below the next draft's predicted speed yields to it at once
    (``verify(floor=)``), and is finished only if no other run fits."""
    if len(runs) == 1:
        return runs[0](plan_options=plan_options)
    speed = functools.partial(_speed, gain=plan_options.segment_gain)
    drafts, errors, left = [], [], []
    for run in runs:
        try:
            drafts.append((run(plan_options=dataclasses.replace(plan_options, verify=False)), run))
        except InfeasibleBudgetError as e:  # the model says none fits; a probe may still, by XLA
            errors.append(e)
            left.append(run)
    if not plan_options.verify or plan_options.loss_fn is None:
        plans = [d for d, _ in drafts]
        if not plans:
            raise min(errors, key=lambda e: e.min_bytes)
        return max(plans, key=speed)
    best, deferred = None, []
    order = sorted(drafts, key=lambda dr: speed(dr[0]), reverse=True)
    for i, (draft, run) in enumerate(order + [(None, r) for r in left]):
        if best is not None and (draft is None or speed(best) >= speed(draft)):
            break  # nothing left can beat it (the runs the model found infeasible are a last resort)
        # a draft that misses and re-plans below the next draft's predicted speed yields to it
        # (in this run's own units: its draft's segments taken back out of the next draft's weighed speed)
        floor = (_weighed(speed(order[i + 1][0])[0], plan_options.segment_gain, -_extra_loops(draft))
                 if draft is not None and i + 1 < len(order) else None)
        try:
            plan = run(plan_options=plan_options, floor=floor)
        except Superseded as e:
            log.info("verification: %s; the next plan first", e)
            deferred.append(run)
            continue
        except InfeasibleBudgetError as e:
            errors.append(e)
            continue
        best = plan if best is None or speed(plan) > speed(best) else best
    for run in deferred if best is None else ():  # every other run failed: finish them
        try:
            plan = run(plan_options=plan_options)
        except InfeasibleBudgetError as e:
            errors.append(e)
            continue
        best = plan if best is None or speed(plan) > speed(best) else best
    if best is None:
        raise min(errors, key=lambda e: e.min_bytes)
    return best


def _speed(plan: Plan, gain: float = 0.0) -> tuple:
    """What ``_fastest`` maximises: predicted samples/s (or the shortest step), then the least
    memory; with a ``gain`` (``PlanOptions.segment_gain``), the samples/s divided by ``(1 + gain)``
    per segment beyond the first of each stack (:func:`_extra_loops`)."""
    speed = plan.predicted_samples_per_second or -(plan.predicted_step_seconds or 0.0)
    return (_weighed(speed, gain, _extra_loops(plan)) if gain else speed, -plan.predicted_peak_bytes)


def _weighed(speed: float, gain: float, loops: int) -> float:
    """``speed`` (samples/s, or minus the step's seconds) made ``(1 + gain) ** loops`` times worse;
    negative ``loops`` undo it."""
    return speed / (1 + gain) ** loops if speed > 0 else speed * (1 + gain) ** loops


def check_segment_gain(gain) -> None:
    """A ``ValueError`` unless ``gain`` is a number >= 0 (``PlanOptions.segment_gain``)."""
    if isinstance(gain, bool) or not (isinstance(gain, (int, float)) and 0 <= gain < math.inf):
        raise ValueError(f"segment_gain must be a number >= 0, the predicted speed-up each segment of a layer stack "
                         f"beyond its first must bring (e.g. 0.01 for 1%; 0: the fastest plan), got {gain!r}")


def _extra_loops(plan: Plan) -> int:
    """Segments beyond the first of each layer stack of ``plan``: the parameters of one stack share
    their segments' bounds, so each distinct sequence of bounds is one stack."""
    stacks = {tuple((a, b) for a, b, *_ in segs) for segs in plan.segments.values()}
    return sum(len(bounds) - 1 for bounds in stacks)


def _one_segment(one, problem, *, plan_options: PlanOptions, microbatches: int = 1, floor=None) -> Plan:
    """``one(problem)`` with every layer of each stack alike (``per_layer`` off): the plan a
    ``segment_gain`` weighs the per-layer plan against."""
    return one(problem, microbatches=microbatches, plan_options=dataclasses.replace(plan_options, per_layer=False),
               floor=floor)


def _accumulated(tables, microbatches: int, problem: Problem):
    """Cost tables of a step run as m microbatches, from those of one microbatch (the columns of
    ``problem.with_accumulation()``): the compute m times; per parameter, where its gradient is
    summed (``_strategies.accumulation``):

    - ``"shard"``: reduce-scattered in every microbatch into an accumulator of p / N bytes
      (p / N_inner hsdp); a zero3/hsdp weight is gathered again in each (its collectives m times),
      a zero2 weight is all-gathered once, after the update (m reduce-scatters and 1 all-gather:
      (m + 1) / 2 its one-step collective time);
    - ``"whole"``: summed into an accumulator of p bytes, reduced once; a zero3/hsdp weight
      (kept) is gathered once, before the loop, and stays alive through it: p bytes more for the
      step. A zero2 stack always sums whole (``runtime.step``).
    """
    if microbatches == 1:
        return tables
    time_, mem = tables.time.copy(), tables.mem.copy()
    p = np.array([i.nbytes for i in problem.cost_infos()], dtype=np.float64)
    stacked = np.array([i.path in problem.in_loop for i in problem.infos])
    for c, (strategy, _, *rest) in enumerate(tables.columns):
        whole = (stacked & (strategy == "zero2")) | (accumulation(strategy, *rest) == "whole")
        mem[whole, c] += (p * (2 if strategy in GATHERED else 1))[whole]
        mem[~whole, c] += (p / (problem.topo.inner if strategy == "hsdp" else problem.n))[~whole]
        time_[~whole, c] *= microbatches if strategy in GATHERED else (microbatches + 1) / 2
    return dataclasses.replace(tables, time=time_, mem=mem, base_time=tables.base_time * microbatches)


def _plan_problem(problem: Problem, *, plan_options: PlanOptions, params, mesh, hw, budget, optimizer, abstract,
                  batches, policies, calibrator, start, microbatches: int = 1, floor: float | None = None) -> Plan:
    """calibrate -> cost -> search -> verify -> build, for one problem, with each global batch
    size run as ``microbatches`` microbatches (probed and costed at the microbatch's size)."""
    batches, probe_batches = _microbatch_batches(batches, microbatches, axes_size(mesh, problem.axes))
    calibrated = (calibrate(problem, calibrator, probe_batches, hw, plan_options.measure_time, _progress, policies)
                  if plan_options.loss_fn is not None else uncalibrated(batches))
    # where each gradient is summed, searched too
    problem = problem.with_accumulation() if microbatches > 1 else problem
    planning = _ProblemPlanning(problem, calibrated, plan_options=plan_options, params=params, mesh=mesh, hw=hw,
                                budget=budget, optimizer=optimizer, abstract=abstract, batches=batches,
                                probe_batches=probe_batches, policies=policies, calibrator=calibrator, start=start,
                                microbatches=microbatches)
    return planning.run(floor)


def _microbatch_batches(batches: dict, microbatches: int, n: int) -> tuple[dict, dict]:
    """The global batches ``microbatches`` microbatches of ``n`` devices divide, and each one's
    microbatch (what the probes compile)."""
    if microbatches == 1:
        return batches, batches
    batches = {b: x for b, x in batches.items() if b % (n * microbatches) == 0}
    probe_batches = {b: jax.tree.map(lambda x: jax.ShapeDtypeStruct((b // microbatches, *x.shape[1:]), x.dtype), x)
                     for b, x in batches.items()}
    return batches, probe_batches


class _ProblemPlanning:
    """One problem's cost tables, search, verification against XLA and refit, with what they share:
    the Pareto fronts searched, the compiled candidate and its peak, the verification's errors."""

    def __init__(self, problem: Problem, calibrated, *, plan_options: PlanOptions, params, mesh, hw, budget,
                 optimizer, abstract, batches, probe_batches, policies, calibrator, start, microbatches: int):
        self.problem, self.calibrated, self.plan_options = problem, calibrated, plan_options
        self.params, self.mesh, self.hw, self.budget = params, mesh, hw, budget
        self.optimizer, self.abstract, self.batches, self.probe_batches = optimizer, abstract, batches, probe_batches
        self.policies, self.calibrator, self.start, self.microbatches = policies, calibrator, start, microbatches
        self.t0 = time.perf_counter()
        self.opt_bytes, self.other_opt = optimizer_bytes(optimizer, abstract)
        key = _overlap_key(calibrator, problem, probe_batches)
        self.overlap_key = key if key is None or microbatches == 1 else (key, microbatches)
        fitted = OVERLAPS.get(self.overlap_key) if self.overlap_key is not None else None
        self.prior = fitted is None and not problem.stacks and NO_LOOP_OVERLAP is not None  # (NO_LOOP_OVERLAP)
        self.fitted = NO_LOOP_OVERLAP if self.prior else fitted
        self.scale = UNIT_SCALES.get(self.overlap_key, 1.0) if self.overlap_key is not None else 1.0
        self.fronts: dict = {}  # the searches' Pareto fronts, for the re-plans under lowered budgets
        self.verified = _Compiles()
        self.compiled: dict = {}  # the candidate of the last plan built with its XLA peak
        self.errors: list = []
        self.verifying = plan_options.loss_fn is not None and plan_options.verify
        self.peak_of = self.verified(self._peak_function()) if self.verifying else None
        self.share, self.carried, self.seconds = MARGIN, 0.0, 0.0

    def run(self, floor: float | None) -> Plan:
        """The fastest plan found under the budget, verified (and refitted) where ``plan_options`` says."""
        self.tables = self.tables_for(self.fitted or 0.0, self.scale)
        best, known = self._first_search()
        if not self.verifying:
            return self.build(best)
        plan = self._verify(self.tables, best, known, self.fitted or 0.0, floor=floor)
        if self.overlap_key is not None and self.errors:
            MARGINS[self.overlap_key] = max(self.share, *self.errors)
        return self._refit(plan)

    def tables_for(self, overlap: float, unit_scale: float = 1.0, sizes=None) -> dict:
        """Cost tables per batch size (``sizes``: only those) with the pool overlap and unit scale."""
        return {b: self._tables(b, overlap, unit_scale) for b in (self.batches if sizes is None else sizes)}

    def _tables(self, size, overlap: float, unit_scale: float):
        problem, microbatches = self.problem, self.microbatches
        t = cost_tables(problem.cost_infos(), problem.available, problem.columns,
                        self.opt_bytes * problem.model_share(), self.other_opt,
                        problem.topo, self.hw, _batch_bytes(self.batches[size]),
                        self.calibrated.calibrations[size], problem.in_loop, frozenset(problem.units), overlap,
                        problem.gather_ratio(),
                        frozenset(p for p, u in problem.units.items() if u == problem.last_unit),
                        problem.saving_bytes(), unit_scale)
        t = _with_tensor_seconds(t, problem, size, self.hw)
        if microbatches > 1:  # the whole global batch is an argument; the probe held one microbatch of it
            extra = _batch_bytes(self.batches[size]) - _batch_bytes(self.probe_batches[size])
            t = dataclasses.replace(_accumulated(t, microbatches, problem),
                                    base_mem=t.base_mem + extra / axes_size(self.mesh, problem.axes))
        remat = self.calibrated.remat.get(size)
        if remat and microbatches > 1:
            remat = {policy: (temp, seconds * microbatches) for policy, (temp, seconds) in remat.items()}
        return expand(problem, t, remat, self.policies, self.plan_options.per_layer)

    def _first_search(self):
        """The search's best candidate and the probes' compiled layouts with their XLA peaks.

        The largest share XLA needed over the model on an earlier compiled plan of this model (kept
        in MARGINS, as the pool overlap is kept), MARGIN at least, is left free (a re-plan at
        another budget, a sweep, meets the same error), unless that costs over MARGIN_COST of the
        predicted samples/s; then the search's choice is verified first. Searched under the lowered
        limit first: when that plan is within MARGIN_COST of what the LP bound allows at the full
        budget, the search at the full budget is not run."""
        tables, budget = self.tables, self.budget
        self.share = max(MARGINS.get(self.overlap_key, 0.0) if self.overlap_key is not None else 0.0, MARGIN)
        self.carried = budget * self.share / (1 + self.share)  # bytes; 0 once a refit changes the model
        safe = _search(tables, budget - self.carried, self.fronts)[0] if self.carried > 0 else None
        if safe is not None and safe[5] and safe[0] >= (1 - MARGIN_COST) * _bound(tables, budget):
            best, min_needed = safe, 0.0
        else:
            best, min_needed = _search(tables, budget, self.fronts)
        self.seconds = time.perf_counter() - self.t0
        # compiled layouts with their XLA peaks (a probe of one microbatch is not the accumulated step)
        known = self._known(tables)
        if best is None and not (self.verifying and any(peak <= budget for _, peak in known)):
            # never above a layout XLA was shown to fit, when plan() at that budget would verify and take it
            least = min([min_needed, *(peak for _, peak in known if self.verifying)])
            raise InfeasibleBudgetError(_infeasible_message(budget, least, self.problem.strategies,
                                                            self.problem.axes), math.ceil(least))
        if self.carried > 0 and best is not None and best[0] > 0:
            ready = [c for c, peak in known if peak <= budget]  # compiled layouts (probes') that fit by XLA
            safe = max([c for c in (*ready, safe) if c is not None], key=lambda c: c[0], default=None)
            best = safe if safe is not None and safe[0] >= (1 - MARGIN_COST) * best[0] else best
        return best, known

    def _known(self, tables) -> list:
        return _known(self.problem, self.calibrated.probes, tables) if self.microbatches == 1 else []

    def build(self, candidate, xla_peak=None, overlap: float | None = None, unit_scale: float | None = None) -> Plan:
        """The plan of a search ``candidate``; with ``xla_peak``, kept as the compiled candidate."""
        if xla_peak is not None:
            self.compiled["candidate"], self.compiled["peak"] = candidate, xla_peak
        counts = (getattr(self.calibrator, "compiles", 0) + self.verified.count,
                  getattr(self.calibrator, "seconds", 0.0) + self.verified.seconds)
        plan = _build(self.problem, candidate, self.budget, self.hw, self.seconds, unboxed_treedef(self.params),
                      xla_peak, (time.perf_counter() - self.start, *counts),
                      (self.fitted or 0.0) if overlap is None else overlap,
                      self.scale if unit_scale is None else unit_scale)
        return dataclasses.replace(plan, microbatches=self.microbatches)

    def _peak_function(self):
        """A plan's XLA peak bytes: by default compiled as the probes are (``runtime.step.PROBE_ONLY_CPU``:
        on XLA:CPU within ``PROBE_TOLERANCE`` of the default compile), not the optimised executable, which
        make_train_step compiles; with ``verify="full"`` the optimised one, checked as a probe first
        near the budget (a plan over it is not compiled in full)."""
        loss_fn, optimizer, abstract, batches, mesh = (self.plan_options.loss_fn, self.optimizer, self.abstract,
                                                       self.batches, self.mesh)
        if self.plan_options.verify != "full":
            return lambda p: profile_step(loss_fn, optimizer, abstract, batches[p.batch_size], mesh, p,
                                          figures_only="probe").peak_bytes

        def peak_of_plan(p):
            args = (loss_fn, optimizer, abstract, batches[p.batch_size], mesh, p)
            if p.predicted_peak_bytes <= CHECK_ABOVE * self.budget:  # a miss would be a model error over 10%
                return profile_step(*args).peak_bytes
            return profile_checked(*args, lambda f: f.peak_bytes <= self.budget + PROBE_TOLERANCE).peak_bytes

        return peak_of_plan

    def _verify(self, tables, first, known, overlap, unit_scale=None, floor=None) -> Plan:
        """``first`` verified against XLA (``planner.verify.verify``), searching ``tables`` again on a miss."""
        return verify(first, self.budget, lambda limit, lessons: _search(tables, limit, self.fronts, lessons)[0],
                      lambda: _least_memory(tables),
                      functools.partial(self.build, overlap=overlap,
                                        unit_scale=self.scale if unit_scale is None else unit_scale),
                      self.peak_of, known, floor, self.carried, self.errors)

    def _replan(self, tables, overlap, unit_scale=None) -> Plan:
        """The compiled candidate costed on ``tables`` (refitted) with its XLA peak, or the search's
        plan on them if it differs and is faster (verified)."""
        unit_scale = self.scale if unit_scale is None else unit_scale
        _, size, sol, _, _, _ = self.compiled["candidate"]
        first = (_costed(size, sol.choices, tables[size]), self.compiled["peak"], overlap, unit_scale)
        second = _search(tables, self.budget, self.fronts)[0]
        if second is None or np.array_equal(second[2].choices, first[0][2].choices) and second[1] == first[0][1]:
            return self.build(*first)
        other = self._verify(tables, second, self._known(tables), overlap, unit_scale)
        return other if (other.predicted_samples_per_second or 0.0) > (first[0][5] or 0.0) else self.build(*first)

    def _refit(self, plan: Plan) -> Plan:
        """``plan``, or, when the cost model missed its XLA peak by over REFIT, the plan of the
        model refitted on that compile: the pool overlap first, else the units' saving scale."""
        _, size, sol, _, _, _ = self.compiled["candidate"]
        # judged by the model alone: a verification's lessons (charges on the layers a miss changed)
        # are in the plan's prediction, and would hide an error every plan shares
        modelled = _costed(size, sol.choices, self.tables[size])
        off = abs(_predicted(modelled) - plan.xla_peak_bytes) > REFIT * plan.xla_peak_bytes
        fitted, key = self.fitted, self.overlap_key
        if fitted is not None and not off and not self.prior:
            return plan  # fitted on an earlier plan of this model, and it holds for this one
        # the candidate costed with omega = 0 (as it was, unless an overlap was fitted before)
        plain = _costed(size, sol.choices, self.tables_for(0.0, self.scale, [size])[size]) if fitted else modelled
        overlap = _refit_overlap(plain, plan.xla_peak_bytes, again=fitted is not None)
        if self.prior and not off:  # NO_LOOP_OVERLAP held: what this compile shows is kept for the next plans
            if overlap is not None and key is not None:
                OVERLAPS[key] = overlap
            return plan
        if overlap is not None and overlap != fitted:
            if key is not None:
                OVERLAPS[key] = overlap
                MARGINS.pop(key, None)  # the misses were the old overlap's
            self.carried = 0.0
            # the compiled plan mixes replicated gradients and weights gathered per step, and XLA kept
            # `overlap` of the smaller pool beside the larger: search again with that, and keep the
            # faster of the two plans (both fit by XLA), each predicted with the fitted overlap
            log.info("pool overlap fitted on the compiled plan: %.2f (XLA peak %s, predicted %s); re-planning",
                     overlap, format_bytes(plan.xla_peak_bytes), format_bytes(plan.predicted_peak_bytes))
            return self._replan(self.tables_for(overlap, self.scale), overlap)
        if not off or not plan.units:
            return plan
        return self._rescale_units(plan)

    def _rescale_units(self, plan: Plan) -> Plan:
        """The plan's units saved less (or more) together than the sum of what each is charged to
        save (their savings do not add): scale them to the compile and plan again."""
        _, size, sol, _, _, _ = self.compiled["candidate"]
        ours = self.fitted or 0.0
        without = _predicted(_costed(size, sol.choices, self.tables_for(ours, 0.0, [size])[size]))
        saved = without - _predicted(_costed(size, sol.choices, self.tables_for(ours, 1.0, [size])[size]))
        if saved < 0.02 * plan.xla_peak_bytes:
            return plan
        new = float(np.clip((without - plan.xla_peak_bytes) / saved, 0.0, 2.0))
        if self.overlap_key is not None:
            UNIT_SCALES[self.overlap_key] = new
            MARGINS.pop(self.overlap_key, None)
        self.carried = 0.0
        log.info("units' savings scaled by %.2f on the compiled plan (XLA peak %s, predicted %s); re-planning",
                 new, format_bytes(plan.xla_peak_bytes), format_bytes(plan.predicted_peak_bytes))
        return self._replan(self.tables_for(ours, new), ours, new)


def _with_tensor_seconds(tables, problem: Problem, size: int, hw):
    """``tables`` with each row kernel's model-axis collectives added to its every choice: its
    layer's output all-reduced forward and its column layers' input gradient backward, two
    all-reduces of ``problem.tensor_bytes`` per sample times the samples per data-parallel group
    over the model axis's t devices, ``2 (a + 2 (t-1)/t V / W)`` seconds. With sequence
    parallelism, the output split on its sequence is all-gathered again where a column layer
    reads it, forward and backward, as XLA:CPU compiles it (the all-reduce kept, then sliced):
    ``2 (a + (t-1)/t V / W)`` seconds more."""
    if not problem.tensor_bytes or size is None:
        return tables
    time = tables.time.copy()
    for i, info in enumerate(problem.infos):
        per_sample = problem.tensor_bytes.get(info.path)
        if per_sample:
            moved = per_sample * size / problem.n
            seconds = 2 * hw.all_reduce(moved, problem.model_size)
            if problem.sequence:
                seconds += 2 * hw.all_gather(moved, problem.model_size)
            time[i] = np.where(np.isfinite(time[i]), time[i] + seconds, time[i])
    return dataclasses.replace(tables, time=time)


def speed_bound(prepared: _Prepared, step_flops: float = 0.0) -> float:
    """An upper bound on the samples/s of any plan of ``prepared``'s problem, from the time model
    alone (no probe). A step takes ``F + max(0, C - overlap F)`` (``step_seconds``), which grows
    with F (overlap <= 1) and with C: at least that at ``F >= F0``, the FLOPs every plan computes
    per device (:func:`compute_floor`; ``step_flops``: the step's matmul FLOPs per global sample
    on one device, :func:`step_matmul_flops`), and ``C >=`` the collectives of each parameter's cheapest choice plus
    the model axis's all-reduces (:func:`_with_tensor_seconds`); so at most ``max_b b / T(b)``
    samples/s over the global batch sizes b. inf without a batch, with timed probes (they
    rescale the collectives and the compute), where the step's time is 0, and where a layer
    stack's remat policy may save compute on hardware that overlaps (a saving counts among the
    items there, so the items may total less than the collectives)."""
    problem, options, hw = prepared.problem, prepared.plan_options, prepared.hw
    saves = problem.stacks and set(prepared.policies) - {"full"}
    if options.measure_time or None in prepared.batches or (saves and hw.overlap > 0):
        return math.inf
    best = 0.0
    for size in prepared.batches:
        comm = _cheapest_seconds(prepared, size).sum()
        floor = max(compute_floor(problem, size), step_flops * size / (problem.n * problem.model_size))
        seconds = step_seconds(floor / hw.flops, comm, hw.overlap)
        best = max(best, size / seconds if seconds > 0 else math.inf)
    return best


def _cheapest_seconds(prepared: _Prepared, size: int, whole: bool = False) -> np.ndarray:
    """Per parameter, the seconds of its cheapest choice's collectives at global batch ``size`` by
    the uncalibrated time model: as one device of the model axis holds it, with the model axis's
    all-reduces on its row kernels (:func:`_with_tensor_seconds`); ``whole``: every parameter
    whole, with no model axis."""
    problem, hw = prepared.problem, prepared.hw
    infos = list(problem.infos) if whole else problem.cost_infos()
    tables = cost_tables(infos, problem.available, problem.columns, np.zeros(len(infos)), 0, problem.topo, hw,
                         _batch_bytes(prepared.batches[size]), None, problem.in_loop, frozenset(problem.units),
                         gather_ratio=problem.gather_ratio())
    return (tables if whole else _with_tensor_seconds(tables, problem, size, hw)).time.min(axis=1)


def step_matmul_flops(prepared: _Prepared, params) -> float:
    """Per global sample, the matmul FLOPs one device computes for a training step of the loss
    with every sample on it and no remat (``osdp_jax.core.xla.matmul_flops``): those of the loss's
    gradient, traced abstractly at the smallest batch size, less those inside ``jax.checkpoint``
    in the loss (what the gradient may compute again), a ``cond`` counted by its cheapest
    branch. Spread over D devices, no plan computes less than ``1/D`` of it per device. 0 where the
    loss cannot be differentiated so (a parameter that is not floating point)."""
    size = min(prepared.batches)
    loss, batch = prepared.plan_options.loss_fn, prepared.batches[size]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), strip_boxes(params))
    try:
        grad = jax.make_jaxpr(jax.grad(loss))(abstract, batch).jaxpr
        forward = jax.make_jaxpr(loss)(abstract, batch).jaxpr
    except Exception as e:  # a floor of 0 is still a bound; the plan itself says what fails
        log.debug("the step's matmul FLOPs not counted (%s: %s): the configurations' bounds count the dense "
                  "layers' only", type(e).__name__, e)
        return 0.0
    flops = matmul_flops(grad, branch=min) - matmul_flops(forward, remat_only=True, branch=max)
    return max(0.0, flops) / size


def compute_floor(problem: Problem, size: int) -> float:
    """The FLOPs per device a step at global batch ``size`` computes in any plan of ``problem``,
    at least: each dense layer's forward pass and its kernel's gradient, ``2 x 2 T K`` per sample
    (``Problem.dense_flops``; its input's gradient is not counted, which the first layer does not
    need), for the ``size / N`` samples of a data-parallel group, a kernel split over the model
    axis 1/t of it."""
    share = problem.model_share()
    return sum(2 * problem.dense_flops.get(info.path, 0.0) * share[i] for i, info in enumerate(problem.infos)) \
        * size / problem.n


def _step_splits_worth_probing(problem: Problem, budget: int) -> Problem:
    """``problem``, or, when splitting every per-step splittable kernel at its largest k would
    shrink their gathered bytes by under ``STEP_SPLIT_SHARE`` of the budget, ``problem`` with those
    kernels never split: what such a split saves, ``tau (1 - 1/k) p`` bytes of temp (``_cost``,
    tau at most zeta, about 2), is under twice that share, and calibrating it costs the
    SPLIT_STEP probe, one compile more."""
    kernels = step_split_probe(problem)
    most = step_split_bytes(problem)
    if not kernels or most >= STEP_SPLIT_SHARE * budget:
        return problem
    log.info("per-step kernels not split: at most %s of gathered weights to save, under %.0f%% of the budget",
             format_bytes(most), 100 * STEP_SPLIT_SHARE)
    return problem.without_splits(kernels)


# per-step kernels are split only if that can shrink their gathered bytes by this share of the budget
STEP_SPLIT_SHARE = 0.01
MARGIN_COST = 0.01  # a plan gives up at most this share of predicted samples/s to leave an earlier plan's error free
# the share of the budget a plan leaves free when no larger error of the model was seen (as an earlier
# plan's error is left free, within MARGIN_COST): the cost model's errors on mixed plans where it is
# right (gpt2-48l-1536 at batch 128, per-layer splits interpolated between their probes: +21 MiB of
# 11.2 GiB, 0.2%) would otherwise cost a plan packed up to its budget a second compile
MARGIN = 0.005
# the pool overlap a model with no layer stack starts from until a compiled plan of it shows its own:
# there every weight gathered per step is gathered outside a loop, which XLA keeps alive for the whole
# step, beside the replicated gradients' all-reduce buffer at its end. Fitted on the first mixed plan
# of each model of tests/foreign.py: 1.00 (einsum LM, ResNet), 0.96 (ViT); starting
# from 0, that first plan was predicted 6.5 to 10.8% under XLA's peak and planned again, one compile more
# (experiments/results/planning_time.md). None: start from 0, as a model with a layer stack does
NO_LOOP_OVERLAP: float | None = 1.0
REFIT = 0.05  # a compiled plan predicted further than this from XLA's peak refits the pool overlap or the unit scale
CHECK_ABOVE = 0.9  # a plan predicted above this share of the budget is compiled as a probe before in full


def _overlap_key(calibrator, problem: Problem, batches: dict):
    """What a fitted pool overlap is kept under: the all-replicate probe's key (the loss's fingerprint,
    optimizer, parameters, batch shapes and mesh) with the units; None for recorded probes."""
    key = getattr(calibrator, "_key", None)
    if key is None or not getattr(calibrator, "cache", False):
        return None
    probe = key(problem.layout(), batches[min(batches)], False, problem.fingerprint)
    return None if probe is None else (probe, tuple(sorted(problem.units.items())))


def _pool_sums(candidate) -> tuple[float, float]:
    """The candidate's two transient pools (replicated-gradient buffer, per-step gathered weights)."""
    _, _, sol, items, _, _ = candidate
    idx = np.arange(len(sol.choices))
    pools = items.pools if items.step_pools is None else items.step_pools
    a, b = pools[idx, sol.choices].sum(axis=0)[:2]
    return float(a), float(b)


def _predicted(candidate) -> float:
    """A search candidate's predicted peak bytes (``_candidate``: base memory + its solution's)."""
    return candidate[3].base_mem + candidate[2].mem


def _refit_overlap(candidate, xla_peak: float, again: bool = False) -> float | None:
    """The pool overlap omega (``_cost``) that makes the compiled ``candidate``'s prediction (costed
    with omega = 0) XLA's peak; None when its smaller pool is under 2% of the peak (a plan nearly
    all replicated or all sharded, where omega does not show) or, fitting the first time
    (``again`` False), omega stays within 0.05 of 0."""
    a, b = _pool_sums(candidate)
    if min(a, b) < 0.02 * xla_peak:
        return None
    overlap = float(np.clip((xla_peak - _predicted(candidate)) / min(a, b), 0.0, 1.0))  # omega 0: max(a, b)
    return overlap if overlap > 0.05 or again else None


def _policies(remat) -> tuple[str, ...]:
    policies = (remat,) if isinstance(remat, str) else tuple(remat)
    if not policies:
        raise ValueError(f"remat needs at least one policy of {list(REMAT_POLICIES)}")
    return tuple(check_remat(p) for p in policies)


def _optimizer(optimizer):
    if optimizer is None:
        # the documented default; said each call, since the state's size is part of every figure
        log.warning("osdp_jax.plan: optimizer=None, so the plan counts optax.adam's state (two moments "
                    "per parameter, 2x the parameter bytes); pass optimizer= the one you train with")
        return optax.adam(1e-3)
    return optimizer


def _batches(loss_fn, batch, batch_sizes, n: int) -> dict:
    """``{global batch size: abstract batch}`` to sweep (``{None: None}`` without a batch)."""
    if batch is None:
        if loss_fn is not None:
            raise ValueError("loss_fn needs an example batch: pass batch=...")
        return {None: None}
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
    leading = check_batch_leaves(batch)
    sizes = sorted(set(batch_sizes)) if batch_sizes is not None else [leading]
    bad = [b for b in sizes if b % n or b <= 0]
    if bad:
        raise ValueError(f"batch size {bad[0]} is not a positive multiple of the {n} data-parallel devices; "
                         f"use multiples of {n}")
    return {b: jax.tree.map(lambda x: jax.ShapeDtypeStruct((b, *x.shape[1:]), x.dtype), batch) for b in sizes}


def _batch_bytes(batch) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(batch)) if batch else 0


PROGRESS_DELAY = 0.5  # seconds: a bar is drawn only for work that takes longer (probes found kept take none)


def _progress(jobs, desc):
    """``jobs`` under a tqdm bar, drawn once they take over :data:`PROGRESS_DELAY`; while it runs,
    log records reach the console through ``tqdm.write`` (``logging_redirect_tqdm``), so a log line
    never lands inside the bar."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        yield from tqdm(jobs, total=len(jobs), desc=desc, leave=False, disable=len(jobs) < 2, delay=PROGRESS_DELAY)


def _candidate(size, sol, tables):
    """A search result: (samples/s or -time to maximise, batch size, solution, tables, seconds, samples/s)."""
    step_s = step_seconds(tables.base_time, sol.time, tables.overlap)
    sps = size / step_s if size is not None and step_s > 0 else None
    return (sps if sps is not None else -sol.time, size, sol, tables, step_s, sps)


def _solve(tables, budget: float, fronts: dict, extra=None, give_up: float = math.inf, lb: float | None = None):
    """The optimum of the ``tables`` under ``budget`` bytes, as ``(tables, Solution)``: from the
    Pareto front in ``fronts`` (one planning's, ``id(tables) -> (tables, Front)``) when one was
    built for them for as much memory or more and holds a plan within ``budget`` (a re-plan under
    a lowered budget searches no further), else by ``fastest_front``, kept. With ``extra``
    (bytes per item and choice, the verification's lessons): the optimum of ``tables`` with ``extra``
    added to its memory, and those tables. ``give_up`` (seconds of the items): no search for
    plans slower; ``BeyondBound`` when none within ``budget`` is as fast. ``lb``: the LP bound of
    the tables (with ``extra``) under ``budget``, when known."""
    if extra is not None:
        taught = dataclasses.replace(tables, mem=tables.mem + extra)
        return taught, fastest_front(taught.time, taught.mem, taught.pools, budget, give_up, lb=lb).best(budget)
    kept = fronts.get(id(tables))
    if kept is not None and kept[0] is tables and kept[1].budget >= budget:
        try:
            return tables, kept[1].best(budget)
        except BeyondBound:  # the optimum is slower than that search's bound
            pass
    front = fastest_front(tables.time, tables.mem, tables.pools, budget, give_up, lb=lb)
    fronts[id(tables)] = (tables, front)
    return tables, front.best(budget)


def _search(tables_for: dict, limit: float, fronts: dict, lessons=()):
    """The best candidate over every batch size under ``limit`` bytes, and the least any needs;
    ``fronts`` keeps the Pareto fronts searched (:func:`_solve`); each ``_verify.Lesson`` adds
    its penalty to the memory of its batch size's choices.

    Batch sizes are searched in order of the samples/s their LP bound allows (``lower_bound``),
    each only for plans faster than the best so far: ``items_within(size / sps, ...)`` seconds of
    its items at most, and not at all when its bound is below the best. The best is the largest
    samples/s, the smallest batch size of equals, as if each were searched in full."""
    best, min_needed = None, math.inf
    order = []
    for size, t in tables_for.items():
        extra = None
        for lesson in (x for x in lessons if x.size == size):
            extra = lesson.penalty(t.mem.shape) + (0.0 if extra is None else extra)
        mem = t.mem if extra is None else t.mem + extra
        least = lower_bound(t.time, mem, t.pools, limit - t.base_mem)
        order.append((-_bound_speed(size, t, least), len(order), size, t, extra, least))
    for _, _, size, t, extra, least in sorted(order, key=lambda x: x[:2]):
        give_up = math.inf
        if best is not None and size is not None and best[5]:
            give_up = items_within(size / best[5], t.base_time, t.overlap)
        try:
            searched, sol = _solve(t, limit - t.base_mem, fronts, extra, give_up, least)
        except InfeasibleBudgetError as e:
            min_needed = min(min_needed, e.min_bytes + t.base_mem)
            continue
        except BeyondBound:  # no plan at this size is as fast as the best
            continue
        found = _candidate(size, sol, searched)
        if best is None or (found[0], -(size or 0)) > (best[0], -(best[1] or 0)):
            best = found
    return best, min_needed


def _bound_speed(size, tables, least: float) -> float:
    """A candidate's first field (samples/s) at batch ``size`` for ``least`` seconds of items (an
    LP bound): at least the optimum's."""
    return _candidate(size, Solution(np.zeros(0, np.int64), least, 0.0), tables)[0]


def _bound(tables_for: dict, limit: float) -> float:
    """The most samples/s the LP bound allows over every batch size under ``limit`` bytes (at least
    the optimum's)."""
    return max(_bound_speed(size, t, lower_bound(t.time, t.mem, t.pools, limit - t.base_mem))
               for size, t in tables_for.items())


def _known(problem: Problem, probes: dict, tables_for: dict) -> list:
    """The calibration probes as candidates, each with its XLA peak (those the columns express)."""
    known = []
    for (kind, size), prof in probes.items():
        choices = probe_choices(problem, kind)
        if choices is None or size not in tables_for or any(  # a remat probe's stack mixes two policies
                kind.remat_layers(n) < n for n in map(problem.stack_layers, range(len(problem.stacks)))):
            continue
        t = tables_for[size]
        choices = expand_choices(t, choices, kind.remat)
        if choices is None:
            continue
        known.append((_costed(size, choices, t), prof.peak_bytes))
    return known


def _costed(size, choices, tables):
    """The candidate that takes ``choices`` (one column per item) on the items ``tables``."""
    idx = np.arange(len(choices))
    mem = float(tables.mem[idx, choices].sum() + tables.pools[idx, choices].sum(axis=0).max())
    return _candidate(size, Solution(choices, float(tables.time[idx, choices].sum()), mem), tables)


def _least_memory(tables_for: dict):
    """The candidate with the smallest predicted peak, at the smallest batch size."""
    size = next(iter(tables_for))
    t = tables_for[size]
    return _candidate(size, least_memory(t.time, t.mem, t.pools), t)


class _Compiles:
    """Counts and times the verification compiles of one plan() call (a step found compiled
    already, ``runtime.step.compile_count``, is not a compile)."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def __call__(self, fn):
        def timed(*args):
            t0, n0 = time.perf_counter(), compile_count()
            try:
                return fn(*args)
            finally:
                self.count += compile_count() - n0
                self.seconds += time.perf_counter() - t0
        return timed


def _build(problem: Problem, candidate, budget, hw, search_seconds, treedef, xla_peak=None,
           timing=(0.0, 0, 0.0), overlap: float = 0.0, unit_scale: float = 1.0) -> Plan:
    _, size, sol, items, step_s, sps = candidate
    whole = param_columns(items, sol.choices)
    segs = segments(problem, items, sol.choices)
    pps = []
    for k, i in enumerate(problem.infos):
        if i.path in segs:
            s = segs[i.path]
            head = next(x for x in s if x.spec == whole_spec(s))
            pps.append(ParamPlan(path=i.path, shape=i.shape, dtype=str(i.dtype), strategy=head.strategy,
                                 spec=head.spec, nbytes=i.nbytes, in_loop=True, split=head.split,
                                 two_stage=head.two_stage, dense=i.path in problem.dense, segments=s,
                                 model_loop=i.path in problem.model_loop,
                                 gather_dtype=problem.compute_dtype if any(x.strategy in GATHERED for x in s)
                                 else "", tensor=problem.tensor.get(i.path, "")))
            continue
        c = whole[k]
        strategy, split, *accumulate = problem.columns[c]
        pps.append(ParamPlan(path=i.path, shape=i.shape, dtype=str(i.dtype), strategy=strategy,
                             spec=problem.options[k][c], nbytes=i.nbytes, in_loop=i.path in problem.in_loop,
                             split=split, two_stage=bool(items.two_stage[k, c]), dense=i.path in problem.dense,
                             unit=problem.units.get(i.path, "") if strategy in GATHERED and split == 1 else "",
                             gather_dtype=problem.compute_dtype if strategy in GATHERED else "",
                             accumulate=accumulate[0] if accumulate else "", model_loop=i.path in problem.model_loop,
                             tensor=problem.tensor.get(i.path, "")))
    collectives = float(sum(items.time[i, c] for i, ((kind, _), c) in enumerate(zip(items.owner, sol.choices))
                            if kind != "remat"))
    return Plan(params=tuple(pps), axes=problem.axes, num_devices=problem.n, batch_size=size, budget_bytes=budget,
                predicted_peak_bytes=items.base_mem + sol.mem,
                predicted_step_seconds=step_s if size is not None else None,
                predicted_collective_seconds=collectives if size is not None else None,
                predicted_samples_per_second=sps, xla_peak_bytes=xla_peak, hardware=hw.name,
                search_seconds=search_seconds, planning_seconds=timing[0], compiles=timing[1],
                compile_seconds=timing[2], treedef=treedef, unit_remat=problem.unit_remat, pool_overlap=overlap,
                unit_scale=unit_scale, model_axis=problem.model_axis, sequence=problem.sequence)


def _infeasible_message(budget, min_needed, strategies, axes) -> str:
    """Names only the strategies that apply on this mesh, and advises zero3 only if not allowed."""
    usable = [s for s in strategies if s != "hsdp" or len(axes) > 1]
    advice = "Raise the budget" + (", allow 'zero3'" if "zero3" not in strategies else "") + \
        ", or use a smaller batch size"
    return (f"no plan fits a per-device budget of {format_bytes(budget)} ({budget} bytes) with strategies "
            f"{usable}; the smallest budget that fits is {format_bytes(min_needed)} ({math.ceil(min_needed)} "
            f"bytes). {advice}")
