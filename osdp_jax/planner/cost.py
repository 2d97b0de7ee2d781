"""Cost model: per-device memory (bytes) and time (seconds) of each strategy for each parameter.

Notation, per parameter i: p_i its bytes, o_i the bytes of its optimizer state (from
``jax.eval_shape(optimizer.init, params)``, e.g. 2 p_i for Adam in the parameter dtype), N the
data-parallel device count.

Memory held for the whole step (the step's arguments; outputs alias them by donation)::

    replicate:  p_i + o_i
    zero3:      (p_i + o_i) / N
    hsdp:       (p_i + o_i) / N_inner       (sharded inside a node, replicated across nodes)
    zero2:      p_i + o_i / N               (stored whole; optimizer state sharded)

Transient memory (XLA's temp) is not a sum of per-parameter terms: it is set by which buffers XLA
keeps alive together, and that differs by where a zero3 weight is gathered.

*Gathered per step* (``_train.py`` gathers it before the loss runs): the gathered weight is kept
for the backward pass, so XLA's schedule decides how many of them (and of their full-size
gradients) are alive together; zeta, fitted on the all-zero3 probe, measures it (zeta Z, Z the
bytes gathered per step). Replicated gradients (R bytes) live until the update, with XLA's
combined all-reduce buffer for them (rho R). How much of the two XLA keeps alive together at the
peak depends on the model's schedule: ``max(rho R, zeta Z) + omega min(rho R, zeta Z)``, with the
overlap omega between 0 (one pool or the other: the repository's models) and 1 (both: models
written elsewhere, where a few weights gathered per step stay alive beside the all-reduce
buffer; with omega = 0 their mixed plans were predicted up to 12.7% under XLA's peak). The probes
are pure (all-replicate, all-zero3), where omega does not show; it is fitted on the first mixed
plan the planner compiles, and again on a later one it predicts more than 5% off XLA's peak
(``_planner._refit_overlap``); a model with no layer stack starts from 1
(``_planner.NO_LOOP_OVERLAP``). (A per-step kernel of a dense layer is gathered at the
layer, once its input is ready; other per-step weights are gathered before the loss, and
XLA:CPU's scheduler starts those gathers at the top of the step.)

*Gathered per layer* (a stacked parameter the model runs through ``osdp_jax.layers.scan``,
a scanned, rematerialised layer loop): one layer's slice is alive at a time, so making
such a parameter zero3 takes its gradient and all-reduce buffer out of temp at a small cost;
measured, temp falls linearly, by kappa bytes per parameter byte. Of a replicated (or zero2)
stacked parameter's kappa p, p is its gradient, which the backward loop fills layer by layer, and
the rest, (kappa - 1)+ p (``CostTables.after_loop``), the buffers of its all-reduce and update,
alive only after the loop. The activations a remat policy saves (``_segments``) are alive only
in the loop, so the two share memory: a stack costs ``max(sum (kappa - 1)+ p, sum A_policy)``, not
their sum (``_segments.expand``).

Over the top-level (per-step) parameters T and the per-layer ones L::

    temp(plan) = temp_R - 2 P_T + R_T + max(rho R_T, zeta Z_T) + omega min(rho R_T, zeta Z_T) - kappa Z_L

temp_R is the all-replicate temp (P_T: all per-step parameter bytes; R_T, Z_T: per-step bytes
replicated / zero3; Z_L: per-layer bytes zero3). Compiles of the real step calibrate it:
all-replicate at each probed batch size gives temp_R, "per-layer zero3, rest replicated" gives
kappa, all-zero3 gives zeta. Without a loss function to compile: temp_R = 2 P, kappa unused
(no parameter is known to be gathered per layer), zeta = 2 (gathered weight plus its gradient),
an estimate that leaves activations out.

*Split* (operator splitting, ``osdp_jax.split``, k slices; sharded kernels only): the kernel is
gathered one slice at a time inside its own rematerialised loop. A per-step kernel then puts
(zeta - tau (1 - 1/k)) p_i in the Z pool instead of zeta p_i (at least 0), tau fitted at the
largest batch size on a probe that splits every per-step kernel at its largest k, linear from
zeta at the smallest size (unmeasured there) and never over zeta between. What such a split
saves is not the gathered weight's share of the pool, and it changes with the batch size: XLA
places the gathered kernel in a slot that activation-sized buffers use at other times.
A per-layer kernel saves a further sigma (1 - 1/k) p_i / L_i bytes of temp (L_i layers), sigma
fitted on a probe that splits every per-layer kernel at its largest k.

*zero2* (the gradient reduce-scattered as it is produced, the update on the shard, the new
shards all-gathered into the output): a per-step zero2 parameter leaves the R pool and holds
xi p_i of temp instead. Its whole gradient lives from the op that produces it to its
reduce-scatter (a weight used once: briefly; a weight used twice, such as a tied embedding: from
its first use in the backward pass to its last), so xi is what the model's schedule shows,
fitted on a probe with every shardable per-step parameter zero2
(``temp_2 = temp_R - (1 + rho) Z2_T + xi Z2_T``), taken only when the search may choose zero2
(``experiments/benchmarks/zero2_memory.py`` measures it). In that probe the zero2 gradients can
hide behind a replicated stack's gradient buffers, which a plan with the stack sharded no longer
has (OPT-30B-8L's tied embedding: a plan with the stacks zero3 was predicted 10.7% under XLA's
peak on that probe alone). So a model with a layer stack or units takes a second probe, the same
with them zero3 (LAYER's layout), fitted against LAYER, and xi is the larger of the two fits
(:func:`_xi`). A per-layer or unit parameter made zero2 keeps its temp (its gradient accumulates
whole in the loop, as a replicated one's does).

(rho = 1.) As ``(1 - omega) max(A, B) + omega (A + B)``, the search is a two-pool knapsack
(``_search.solve_pools``), solved exactly.

Time per step: compute F plus the communication C that does not run behind it, each optionally
scaled by factors fitted on timed runs of the probe steps on the mesh
(``plan(measure_time=True)``; ``fit_time``)::

    step = F + max(0, C - overlap F)       (overlap: Hardware.overlap, measured by osdp-jax
                                            profile; 0 on XLA:CPU, whose collectives run apart)

    compute    = FLOPs per device / Hardware.flops      (XLA's cost_analysis, which counts a loop
                 body once, plus the matmul FLOPs of the other iterations: _xla.loop_flops)
    replicate: all-reduce(p_i)                                  = a + 2(N-1)/N p_i / W
    zero3:     all-gather(p_i) + reduce-scatter(p_i)            = 2a + 2(N-1)/N p_i / W
    zero3, gathered per layer (L_i layers, re-gathered in the backward pass):
               L_i (2 all-gather + reduce-scatter)(p_i / L_i)   = 3 L_i a + 3(N-1)/N p_i / W
    zero3 split in k slices (each re-gathered in the backward pass), L_i = 1 if per step:
               L_i k (2 all-gather + reduce-scatter)(p_i / (L_i k))
    zero2:     reduce-scatter(p_i) + all-gather(p_i)             = 2a + 2(N-1)/N p_i / W
    hsdp:      the same collectives over the inner axis (N_inner devices, its link), plus per
               gather an all-reduce of the gradient shard (V / N_inner) over the outer axes
    zero3 in two stages (2-D meshes): each all-gather of V is one over the inner axis of
               V / N_outer bytes, then one over the outer axes of V; chosen per parameter when
               the hardware's per-axis links make it faster than one flat ring

(one all-gather for a per-step parameter: the gathered weight is kept for the backward pass).
C sums these over the parameters (and a unit's recomputed forward pass, which cannot run behind
F, is counted in C too: with overlap > 0 it is predicted as hidden as a collective is). For a
given batch size the plan with the least C is also the one with the least step time, so the
search over strategies is the same with or without overlap; the overlap moves the choice of
batch size and microbatches, and the predicted step time.
With several data-parallel axes, a collective runs at the slowest link it crosses
(``Hardware.link``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import numpy as np

from osdp_jax.core.describe import ParamInfo, map_state_params
from osdp_jax.core.hardware import Hardware
from osdp_jax.core.strategies import GATHERED
from osdp_jax.core.xla import StepProfile

GATHERS_PER_STEP = 1  # all-gathers of one zero3 weight per step in _train.py
SIGMA_ESTIMATE = 2.0  # uncalibrated split saving: one layer's gathered slice and its gradient


@dataclasses.dataclass(frozen=True)
class CostTables:
    """Per-parameter costs for one batch size, per device.

    Columns are ``(strategy, k)`` choices (k: split count, 1 = not split).
    ``time[i, s]`` seconds; ``mem[i, s]`` bytes held through the step; ``pools[i, s, k]`` transient
    bytes in pool k (0: replicated-gradient buffer, 1: gathered zero3 weights). ``inf`` marks a
    strategy the parameter cannot take. Peak = ``base_mem + sum mem + max_k sum pools[..., k]``;
    step time = ``base_time + max(0, sum time - overlap * base_time)`` (:func:`step_seconds`).
    """

    columns: tuple[tuple[str, int], ...]
    time: np.ndarray
    mem: np.ndarray
    pools: np.ndarray
    base_mem: float
    base_time: float
    two_stage: np.ndarray  # [i, s]: zero3 collectives in two stages (faster there)
    overlap: float = 0.0  # the share of base_time the items' seconds run behind (Hardware.overlap)
    after_loop: np.ndarray | None = None  # [i]: bytes of a layer-stacked parameter's whole-gradient
    #                                      temp alive only after its loop, (kappa - 1)+ p (below)


def step_seconds(base_time: float, items: float, overlap: float) -> float:
    """A step's seconds: the compute ``base_time`` plus what of the items' ``items`` seconds (their
    collectives, and a unit's recomputed forward pass) does not run behind ``overlap`` of it."""
    return base_time + max(0.0, items - overlap * base_time)


def items_within(seconds: float, base_time: float, overlap: float) -> float:
    """The most items' seconds a step of ``base_time`` compute may hold and take at most
    ``seconds`` (:func:`step_seconds` inverted; negative when even none would)."""
    spare = seconds - base_time
    return spare + overlap * base_time if spare >= 0 else spare


@dataclasses.dataclass(frozen=True)
class Calibration:
    """XLA's figures for one batch size: the all-replicate step, and the fitted coefficients."""

    replicate: StepProfile
    kappa: float = 0.0  # temp bytes saved per byte of per-layer parameter made zero3
    zeta: float = 0.0  # temp bytes per byte of per-step parameter made zero3 (the Z pool)
    sigma: float = SIGMA_ESTIMATE  # temp bytes saved per byte of (1 - 1/k) p / L split per layer
    unit_flops: float = 0.0  # FLOPs per byte of unit parameter sharded: its unit's forward pass run again
    xi: float = 2.0  # temp bytes per byte of per-step parameter made zero2 (1 + RHO until fitted)
    compute_scale: float = 1.0  # measured / modelled compute seconds (timed probes; 1 if not timed)
    comm_scale: float = 1.0  # measured / modelled collective seconds
    last_saving: float = 0.0  # temp bytes saved per byte of the last-called unit sharded, the others sharded
    tau: float | None = None  # temp bytes saved per byte of (1 - 1/k) p of a per-step kernel split (None: zeta)

    @property
    def step_split_saving(self) -> float:
        """tau: what a per-step kernel's split saves per byte of (1 - 1/k) p, zeta unless measured."""
        return self.zeta if self.tau is None else self.tau


def fit(replicate: StepProfile, per_layer: StepProfile | None, zero3: StepProfile,
        p: np.ndarray, can_shard: np.ndarray, loop: np.ndarray,
        split: StepProfile | None = None, split_share: float = 0.0, unit: np.ndarray | None = None,
        zero2=None, last: np.ndarray | None = None,
        weight: np.ndarray | None = None, but_last: StepProfile | None = None,
        last_saving: float | None = None, split_step: StepProfile | None = None,
        step_share: float = 0.0) -> Calibration:
    """kappa, zeta, sigma and the units' FLOPs from the probes (module docstring); ``loop`` marks
    the parameters gathered at use (per layer, or at a unit: ``unit`` marks those).

    ``split`` is the all-zero3 step with every per-layer splittable kernel split at its largest
    k, and ``split_share`` the sum of (1 - 1/k) p / L over those kernels. ``zero2`` is the step
    with every shardable per-step parameter zero2, or the pair of it and the same with the per-layer
    and unit parameters zero3 (xi: :func:`_xi`; None: xi stays 1 + rho). ``last`` marks
    the parameters of the unit called last, which save no temp (``cost_tables``), so kappa is
    per byte of the others; ``weight`` the bytes kappa counts per parameter
    (``Problem.saving_bytes``; default ``p``). ``but_last`` is the ``per_layer`` step with the
    last unit replicated: what that unit saves, ``last_saving`` bytes per byte, is the difference
    (``cost_tables``); without it, ``last_saving`` as given (fitted at another batch size), or 0.
    ``split_step`` is the all-zero3 step with every per-step splittable kernel split at its
    largest k, and ``step_share`` the sum of (1 - 1/k) p over those kernels: tau (None without it).
    """
    saves = loop if last is None else loop & ~last
    weight = p if weight is None else weight
    z_loop = weight[can_shard & saves].sum()
    z_last = p[can_shard & loop & ~saves].sum()
    top_sh, top_fixed = p[can_shard & ~loop].sum(), p[~can_shard & ~loop].sum()
    if per_layer is not None and but_last is not None and z_last:
        last_saving = (but_last.temp_bytes - per_layer.temp_bytes) / z_last
    last_saving = last_saving or 0.0
    kappa = ((replicate.temp_bytes - per_layer.temp_bytes - last_saving * z_last) / z_loop
             if per_layer and z_loop else 0.0)
    zeta = 0.0
    if top_sh:
        # temp_Z = temp_R - 2 P_T + R_fixed + max(R_fixed, zeta Z_T) - kappa Z_L
        rest = (zero3.temp_bytes - replicate.temp_bytes + 2 * (top_sh + top_fixed) - top_fixed + kappa * z_loop
                + last_saving * z_last)
        zeta = max(0.0, rest / top_sh)
    sigma = SIGMA_ESTIMATE
    if split is not None and split_share:
        sigma = max(0.0, (zero3.temp_bytes - split.temp_bytes) / split_share)
    z_unit = p[can_shard & unit].sum() if unit is not None else 0.0
    unit_flops = max(0.0, (per_layer.flops - replicate.flops) / z_unit) if per_layer and z_unit else 0.0
    xi = _xi(replicate, per_layer, zero2, top_sh)
    tau = None
    if split_step is not None and step_share:
        tau = (zero3.temp_bytes - split_step.temp_bytes) / step_share  # < 0: splitting costs memory
    return Calibration(replicate, kappa, zeta, sigma, unit_flops, xi, last_saving=last_saving, tau=tau)


def _xi(replicate: StepProfile, per_layer: StepProfile | None, zero2, top_sh: float) -> float:
    """xi, temp bytes per byte of per-step parameter made zero2 (module docstring), from ``zero2``:
    the ZERO2 probe, or the pair (ZERO2, ZERO2_LAYER), either None where not compiled. Each gives
    ``(temp_2 - temp_base) / Z2_T + 1 + rho`` against its base (all-replicate; LAYER), and xi is the
    larger, at least 0; 1 + rho (replication's charge) without either."""
    probes = zero2 if isinstance(zero2, tuple) else (zero2, None)
    fits = [(probe.temp_bytes - base.temp_bytes) / top_sh + 1 + RHO
            for probe, base in zip(probes, (replicate, per_layer)) if probe is not None and base is not None]
    return max(0.0, *fits) if fits and top_sh else 1 + RHO


def optimizer_bytes(optimizer, params) -> tuple[np.ndarray, int]:
    """Optimizer-state bytes per parameter leaf, and bytes of state tied to no parameter.

    >>> import jax.numpy as jnp, optax
    >>> optimizer_bytes(optax.adam(1e-3), {"w": jax.ShapeDtypeStruct((4,), jnp.float32)})[0]
    array([32])
    """
    state = jax.eval_shape(optimizer.init, params)
    leaves, treedef = jax.tree.flatten(params)
    index = jax.tree.unflatten(treedef, list(range(len(leaves))))
    per_leaf = np.zeros(len(leaves), dtype=np.int64)

    def add(x, i):
        per_leaf[i] += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        return x

    map_state_params(optimizer, add, state, index, transform_non_params=lambda x: x)  # init traced, not run
    total = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    return per_leaf, total - int(per_leaf.sum())


@dataclasses.dataclass(frozen=True)
class Topology:
    """The data-parallel mesh axes and their sizes; the last axis is the inner (intra-node) one."""

    axes: tuple[str, ...] | None
    sizes: tuple[int, ...]

    @classmethod
    def flat(cls, n: int) -> "Topology":
        return cls(None, (n,))

    @property
    def n(self) -> int:
        return math.prod(self.sizes)

    @property
    def inner(self) -> int:
        return self.sizes[-1]

    def over(self, which: str) -> tuple[tuple[str, ...] | None, int]:
        """``(axes, devices)`` of "all" the data axes, the "inner" one, or the "outer" ones."""
        if self.axes is None:
            return None, self.n
        if which == "all":
            return self.axes, self.n
        if which == "inner":
            return self.axes[-1:], self.inner
        return self.axes[:-1], self.n // self.inner


def _gather_seconds(hw: Hardware, topo: Topology, nbytes: float, strategy: str, two_stage: bool) -> float:
    """One all-gather (= one reduce-scatter) of a ``nbytes`` weight, sharded by ``strategy``."""
    if strategy == "hsdp":
        return hw.all_gather(nbytes, topo.inner, topo.over("inner")[0])
    if two_stage and topo.axes is not None and len(topo.axes) > 1:
        outer_axes, outer_n = topo.over("outer")
        return (hw.all_gather(nbytes / outer_n, topo.inner, topo.over("inner")[0])
                + hw.all_gather(nbytes, outer_n, outer_axes))
    axes, n = topo.over("all")
    return hw.all_gather(nbytes, n, axes)


def comm_seconds(nbytes: float, strategy: str, hw: Hardware, topo: Topology | int, layers: int = 0,
                 split: int = 1, two_stage: bool = False) -> float:
    """Seconds of collectives per step for one parameter of ``nbytes`` (formulas in the module doc).

    ``layers`` > 0: a stacked parameter gathered per layer inside the model's loop, so each of
    its collectives runs ``layers`` times on 1/layers of the bytes, and the backward pass gathers
    again (rematerialisation): 2 all-gathers and 1 reduce-scatter per layer. ``split`` = k > 1:
    the same per slice, k times as many collectives on 1/k of the bytes. ``hsdp`` gathers inside
    the inner axis and all-reduces its gradient shard (1/inner of the bytes) over the outer
    axes; ``two_stage`` zero3 gathers the inner axis first (1/outer of the bytes), then the outer.
    """
    topo = Topology.flat(topo) if isinstance(topo, int) else topo
    if strategy == "replicate":
        axes, n = topo.over("all")
        return hw.all_reduce(nbytes, n, axes)
    if strategy == "zero2":  # reduce-scatter the gradient, all-gather the updated shards
        return 2 * _gather_seconds(hw, topo, nbytes, "zero3", False)
    if strategy not in GATHERED:
        raise ValueError(f"unknown strategy {strategy!r}")
    times = max(layers, 1) * split
    gathers = 2 if (layers or split > 1) else GATHERS_PER_STEP
    per = nbytes / times
    one = (gathers + 1) * _gather_seconds(hw, topo, per, strategy, two_stage)
    if strategy == "hsdp":
        outer_axes, outer_n = topo.over("outer")
        one += hw.all_reduce(per / topo.inner, outer_n, outer_axes)
    return times * one


def interpolate(probed: dict[int, Calibration], size: int) -> Calibration:
    """A calibration for ``size`` from two probed batch sizes, every figure linear in the batch."""
    (b0, c0), (b1, c1) = sorted(probed.items())
    w = (size - b0) / (b1 - b0)
    p0, p1 = c0.replicate, c1.replicate
    lin = lambda a, b: int(round(a + w * (b - a)))  # noqa: E731
    mixed = StepProfile(lin(p0.argument_bytes, p1.argument_bytes), lin(p0.output_bytes, p1.output_bytes),
                        lin(p0.alias_bytes, p1.alias_bytes), lin(p0.temp_bytes, p1.temp_bytes),
                        p0.flops + w * (p1.flops - p0.flops), p0.collectives)
    lerp = lambda a, b: a + w * (b - a)  # noqa: E731
    tau = None  # measured at one end at least: linear between, never over the model's zeta
    if c0.tau is not None or c1.tau is not None:
        tau = min(lerp(c0.step_split_saving, c1.step_split_saving), lerp(c0.zeta, c1.zeta))
    return Calibration(mixed, lerp(c0.kappa, c1.kappa), lerp(c0.zeta, c1.zeta), lerp(c0.sigma, c1.sigma),
                       lerp(c0.unit_flops, c1.unit_flops), lerp(c0.xi, c1.xi), lerp(c0.compute_scale, c1.compute_scale),
                       lerp(c0.comm_scale, c1.comm_scale), lerp(c0.last_saving, c1.last_saving), tau)


def fit_time(measured: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(compute_scale, comm_scale)`` from timed probes, each ``(seconds, compute_s, comm_s)``
    with the modelled compute and collective seconds: least squares of
    ``seconds = compute_scale compute_s + comm_scale comm_s``, both scales positive; with one
    probe, or when the probes cannot tell the two apart, one common scale.
    """
    t = np.array([m[0] for m in measured])
    a = np.array([[m[1], m[2]] for m in measured])
    if len(measured) >= 2 and np.linalg.matrix_rank(a / np.maximum(a.max(axis=0), 1e-30)) == 2:
        (cf, cc), *_ = np.linalg.lstsq(a, t, rcond=None)
        if cf > 0 and cc > 0:
            return float(cf), float(cc)
    scale = float(np.median(t / np.maximum(a.sum(axis=1), 1e-30)))
    return scale, scale


RHO = 1.0  # combined all-reduce buffer per replicated gradient byte
ZETA_ESTIMATE = 2.0  # uncalibrated: gathered weight + its full-size gradient


def cost_tables(infos: list[ParamInfo], available: np.ndarray, columns: tuple,
                opt_bytes: np.ndarray, other_opt_bytes: int, topo: Topology | int, hw: Hardware,
                batch_bytes: int, calibration: Calibration | None,
                in_loop: frozenset = frozenset(), units: frozenset = frozenset(),
                overlap: float = 0.0, gather_ratio: np.ndarray | None = None,
                last_unit: frozenset = frozenset(), saving: np.ndarray | None = None,
                unit_scale: float = 1.0) -> CostTables:
    """Cost tables for one batch size (formulas in the module docstring).

    Args:
      infos: the parameters.
      available: ``(n_params, n_columns)`` bool, whether parameter i can take column c.
      columns: the choices, each a strategy name or ``(strategy, k)`` with k the split count.
      opt_bytes: optimizer-state bytes per parameter; ``other_opt_bytes`` the rest of the state.
      topo: the data-parallel axes and sizes (or the device count, for one flat axis).
      hw: hardware for the time model.
      batch_bytes: bytes of the *global* batch (each device holds 1/n).
      calibration: XLA figures for this batch size, or None for the uncalibrated estimate.
      in_loop: paths of stacked parameters the model gathers per layer; their gathered bytes
        count 1/layers (one layer's slice is alive at a time).
      units: paths of parameters gathered at their unit (``osdp_jax.units``): sharded, they are
        gathered twice and reduce-scattered once per step, their memory is modelled as a
        per-layer parameter's (kappa), and their unit's forward pass runs again
        (``Calibration.unit_flops`` per byte, under the default "full" unit remat).
      overlap: the share of the smaller pool alive beside the larger at the peak (0: their max;
        1: their sum), fitted on a compiled mixed plan (``_planner``).
      last_unit: paths of the unit the forward pass calls last. Its backward pass runs first, at
        the activation peak, where its forward pass runs again (or its activations are still
        saved) either way, so sharding it saves only ``Calibration.last_saving`` bytes per byte
        (its replicated gradient, alive at the next unit's backward pass), not kappa's.
      saving: per parameter, the bytes the kappa term counts (``Problem.saving_bytes``: a unit's
        share follows its saved activations); default its bytes.
      unit_scale: the units' temp savings (kappa and lambda terms) are scaled by it: 1 as fitted
        on the probes, or refitted on a compiled plan whose units save less together than the
        sum of their savings (``_planner``).
      gather_ratio: per parameter, bytes a zero3/hsdp collective moves per byte stored (0.5 for a
        float32 parameter gathered in bfloat16, ``plan(compute_dtype=)``); the memory terms need
        no ratio, since the probes are compiled with the same gathers.
    """
    topo = Topology.flat(topo) if isinstance(topo, int) else topo
    n = topo.n
    p = np.array([i.nbytes for i in infos], dtype=np.float64)
    layers = np.array([i.shape[0] if i.path in in_loop else int(i.path in units) for i in infos])
    unit = np.array([i.path in units for i in infos], dtype=bool)
    saves = np.array([i.path not in last_unit for i in infos], dtype=bool)
    loop = layers > 0
    o = opt_bytes.astype(np.float64)
    if calibration is None:
        cal = Calibration(StepProfile(int(batch_bytes / n + other_opt_bytes + (p + o).sum()), 0, 0,
                                      int(2 * p.sum()), 0.0, {}), 0.0, ZETA_ESTIMATE)
    else:
        cal = calibration
    r = cal.replicate
    # arguments other than parameters and their state (the batch...), unaliased outputs, and the
    # all-replicate temp less the per-step parameters' share that the plan changes
    base_mem = (r.argument_bytes - (p + o).sum() + r.output_bytes - r.alias_bytes
                + r.temp_bytes - (1 + RHO) * p[~loop].sum())
    columns = tuple((c, 1) if isinstance(c, str) else tuple(c) for c in columns)  # (strategy, k[, accumulate])
    mem = np.full((len(infos), len(columns)), np.inf)
    pools = np.zeros((len(infos), len(columns), 2))
    time = np.full_like(mem, np.inf)
    two_stage = np.zeros(mem.shape, dtype=bool)
    sizes = _Sizes(p, o, layers, unit, saves, (p if saving is None else saving) * np.where(unit, unit_scale, 1.0))
    for s, (name, k, *_) in enumerate(columns):  # a column's accumulate matters with microbatches only
        ok = available[:, s]
        _column_memory(mem[:, s], pools[:, s], name, k, ok, sizes, cal, n, topo.inner, unit_scale)
        for i in np.flatnonzero(ok):
            moved = p[i] * (gather_ratio[i] if gather_ratio is not None and name in GATHERED else 1.0)
            flat = comm_seconds(moved, name, hw, topo, int(layers[i]), k)
            staged = (comm_seconds(moved, name, hw, topo, int(layers[i]), k, two_stage=True)
                      if name == "zero3" and len(topo.sizes) > 1 else np.inf)
            two_stage[i, s] = staged < flat
            time[i, s] = cal.comm_scale * min(flat, staged)
            if unit[i] and name in GATHERED and calibration is not None:
                time[i, s] += cal.compute_scale * cal.unit_flops * p[i] / hw.flops
    if overlap:  # max(A, B) + overlap * min(A, B) = (1 - overlap) max(A, B) + overlap (A + B)
        mem += overlap * pools.sum(axis=2)
        pools *= 1.0 - overlap
    # the search wants non-negative costs: move each row's smallest entry into the base
    shift = np.where(np.isfinite(mem), mem, np.inf).min(axis=1)
    mem -= shift[:, None]
    after_loop = np.where(loop & ~unit, max(0.0, cal.kappa - 1.0) * p, 0.0)
    return CostTables(columns, time, mem, pools, float(base_mem + shift.sum()),
                      cal.compute_scale * r.flops / hw.flops if calibration is not None else 0.0, two_stage,
                      hw.overlap, after_loop)


class _Sizes(NamedTuple):
    """Per parameter: bytes, optimizer-state bytes, layers gathered per layer (0: per step), at a
    unit, not the last unit's, and the bytes the kappa term counts (scaled for units)."""

    p: np.ndarray
    o: np.ndarray
    layers: np.ndarray
    unit: np.ndarray
    saves: np.ndarray
    kappa_bytes: np.ndarray


def _column_memory(mem, pools, name: str, k: int, ok, sizes: _Sizes, cal, n: int, inner: int,
                   unit_scale: float) -> None:
    """Fill one column of the memory table and its two pools (``pools[:, 0]`` R, ``[:, 1]`` Z) for
    the parameters ``ok`` can take strategy ``name`` split in ``k`` (module docstring's terms)."""
    p, o, loop, saves = sizes.p, sizes.o, sizes.layers > 0, sizes.saves
    top, per_layer = ok & ~loop, ok & loop
    if name == "replicate":
        mem[ok] = (p + o)[ok]
        mem[top] += p[top]  # R_T: the replicated gradient, held to the update
        pools[top, 0] = RHO * p[top]
    elif name == "zero2":
        mem[ok] = (p + o / n)[ok]
        mem[top] += cal.xi * p[top]
    else:
        mem[ok] = ((p + o) / (n if name == "zero3" else inner))[ok]
        w = sizes.kappa_bytes
        mem[per_layer & saves] -= cal.kappa * w[per_layer & saves]
        mem[per_layer & ~saves] -= unit_scale * cal.last_saving * p[per_layer & ~saves]
        pools[top, 1] = np.maximum(0.0, cal.zeta - cal.step_split_saving * (1 - 1 / k)) * p[top]
        if k > 1:
            mem[per_layer] -= cal.sigma * (1 - 1 / k) * (p / np.maximum(sizes.layers, 1))[per_layer]
