"""Calibration: the cost model's terms fitted on probe steps.

Activations, temporaries and FLOPs are not modelled from first principles; they are read off
compiled *probe* steps of the real loss (:class:`ProbeKind`), at the smallest and largest
candidate batch size (the remat and split probes at the largest only: ``calibrate``), and
interpolated between (``_cost.fit``, ``_cost.interpolate``). With ``measure_time`` the probes are
also run and timed, and the compute and collective seconds scaled to the measurements
(``_cost.fit_time``).

Where the figures come from is a :class:`Calibrator`: :class:`XlaCalibrator` compiles (and
times) the probes; :class:`RecordedCalibrator` reads figures recorded earlier (a JSON file or a
dict), so the planner's decisions can be tested in milliseconds. ``XlaCalibrator(record=...)``
writes such a file.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import pathlib
import time
from typing import NamedTuple, Protocol

import jax
import numpy as np

from osdp_jax.core.describe import describe
from osdp_jax.core.xla import StepProfile, profile_compiled, time_compiled
from osdp_jax.planner import probe_store as _probe_store
from osdp_jax.planner.cost import comm_seconds, fit, fit_time, interpolate
from osdp_jax.planner.discover import _signature, clear_found
from osdp_jax.planner.problem import Problem
from osdp_jax.planner.search import clear_kept
from osdp_jax.runtime.place import abstract_args
from osdp_jax.runtime.step import compile_count, compile_many

log = logging.getLogger("osdp_jax")


class ProbeKind(enum.Enum):
    """The probe steps the cost model is fitted on: each is the model's real train step under one
    layout, compiled for XLA's figures at a batch size (see the member comments for what each
    one's figures fit)."""

    REPLICATE = "R"  # every parameter replicated: the activations and the all-reduce buffer
    ZERO3 = "Z"  # every shardable parameter zero3: zeta (per-step gathered weights)
    LAYER = "L"  # only the per-layer and unit parameters zero3: kappa (temp saved per byte gathered
    #              at use), and the units' recomputed FLOPs
    SPLIT = "S"  # as ZERO3, every per-layer splittable kernel at its largest k: sigma
    SPLIT_STEP = "P"  # as ZERO3, every per-step splittable kernel at its largest k: tau
    REMAT_DOTS = "D"  # as LAYER, every stack saving its matmul outputs: the "dots" remat terms
    REMAT_NONE = "N"  # as LAYER, every stack saving everything: the "none" remat terms
    ZERO2 = "T"  # every shardable per-step parameter zero2, the rest replicated: xi (only when
    #             the search may choose zero2)
    ZERO2_LAYER = "W"  # as ZERO2, the per-layer and unit parameters zero3 (as LAYER): xi where no
    #                   replicated stack's gradients hide the zero2 ones (with LAYER and ZERO2 only)
    LAST = "U"  # as LAYER, but the unit called last replicated: what sharding that unit saves
    #            (``_cost.fit``; only with two units or more, at the smallest batch size)

    def zero3(self, info, problem: Problem) -> bool:
        """Whether this probe makes ``info`` zero3. The remat probes shard the stacks (as LAYER):
        there a policy's extra saved activations show undiluted by the stacks' replicated
        gradient buffers (whose share of the peak is a max, not a sum); measured on the
        all-replicated step they came out up to 3x too small at small batch sizes."""
        at_use = info.path in problem.in_loop or info.path in problem.units
        if self is ProbeKind.LAST:
            return at_use and problem.units.get(info.path) != problem.last_unit
        # LAYER, the remat probes and ZERO2_LAYER: the parameters gathered at use
        return {"R": False, "Z": True, "L": at_use, "S": True, "P": True, "T": False}.get(self.value, at_use)

    def zero2(self, info, problem: Problem) -> bool:
        """Whether this probe makes ``info`` zero2: the ZERO2 and ZERO2_LAYER probes, their per-step
        parameters."""
        return (self in (ProbeKind.ZERO2, ProbeKind.ZERO2_LAYER)
                and not (info.path in problem.in_loop or info.path in problem.units))

    @property
    def remat(self) -> str:
        """The remat policy its stacks run with."""
        return {"D": "dots", "N": "none"}.get(self.value, "full")

    def remat_layers(self, layers: int) -> int:
        """Of a stack of ``layers``, how many run with :attr:`remat`; the others, "full".

        A remat probe runs its policy on all but a stack's last 2 layers (when 2 or more are
        left: a one-layer segment is a loop XLA removes), so the stack mixes the policy with
        "full", as the searched plans do. A stack under one policy alone measures less: XLA's
        peak holds the saved activations of every layer plus the backward pass's transient of the
        policy that recomputes most, and with "full" gone that transient is smaller too, so a
        term fitted on a stack under one policy alone under-predicts the mixed plans the search
        returns. Fitted so, a plan with every layer under the policy is over-predicted by that
        transient's difference instead, which leaves it on the safe side of the budget."""
        if self.remat == "full" or layers < 4:
            return layers
        return layers - 2


class Calibrator(Protocol):
    """Where probe figures come from: ``plan(calibrator=...)``.

    :class:`XlaCalibrator` compiles the probe steps (the default); :class:`RecordedCalibrator`
    reads figures recorded earlier, so the planner's decisions can be tested without compiling.
    An implementation has one method, :meth:`profile`."""

    def profile(self, problem: Problem, kind: ProbeKind, batch, splits: dict,
                timed: bool) -> tuple[StepProfile, float | None]:
        """XLA's figures for the probe ``kind`` at the (abstract) ``batch``, and its measured
        seconds per step when ``timed`` (None when not timed or it does not fit the devices).
        A calibrator may also have ``profile_many(problem, requests)`` (``XlaCalibrator``'s),
        which ``calibrate`` then uses for all its probes at once."""


def _batch_size(batch) -> int:
    return int(jax.tree.leaves(batch)[0].shape[0])


_PROBES: dict = {}  # in-process probe cache: key (see XlaCalibrator._key) -> (StepProfile, seconds)
OVERLAPS: dict = {}  # in-process: the pool overlap fitted per model on a compiled plan (``_planner``)
UNIT_SCALES: dict = {}  # in-process: the scale of the units' savings refitted per model on a compiled plan
MARGINS: dict = {}  # in-process: the largest share XLA needed over the prediction on a compiled plan per model


MAX_THREADS = 8  # compile threads XlaCalibrator uses at most by default (each compile holds its HLO)


THREADS_ENV = "OSDP_JAX_COMPILE_THREADS"  # overrides compile_threads(): processes sharing the CPUs


def compile_threads() -> int:
    """The compile threads an ``XlaCalibrator`` uses by default: ``$OSDP_JAX_COMPILE_THREADS``
    when set (a positive integer), else the CPUs this process may run on, at most
    :data:`MAX_THREADS`. For processes that plan on the same CPUs at once, each its share."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ValueError(f"{THREADS_ENV}={value!r}: set it to a positive number of compile threads "
                             f"(e.g. 1), or unset it to use this process's CPUs")
        return int(value)
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def _kept(key):
    """``(StepProfile, seconds)`` kept for the probe ``key``: in this process, or else on disk
    (``_probe_store``, then kept in the process too); None if neither has it."""
    if key not in _PROBES:
        prof = _probe_store.load(key)
        if prof is None:
            return None
        _PROBES[key] = (prof, None)
    return _PROBES[key]


def clear_probe_cache() -> None:
    """Forget every probe figure this process has compiled (``XlaCalibrator(cache=True)``), and the
    pool overlaps, unit scales and error margins fitted on compiled plans, and what tracing each
    loss found (``_discover.find``), and the searches kept (``_search``). Figures kept on disk
    (``_probe_store``, when enabled) stay there, and are read again."""
    _PROBES.clear()
    clear_found()
    clear_kept()
    OVERLAPS.clear()
    UNIT_SCALES.clear()
    MARGINS.clear()


@dataclasses.dataclass
class XlaCalibrator:
    """Compile (and, when asked, time) the probe steps of ``loss_fn`` on ``mesh``.

    ``device_bytes``: a timed probe runs only if it fits the devices' memory. ``record``: a path
    to write every probe's figures to, as JSON that :class:`RecordedCalibrator` reads. ``cache``:
    keep every probe's figures in this process, keyed by the loss (its fingerprint,
    ``Problem.fingerprint``: what it traces to, so a loss written again as a new function finds
    the old one's probes; the function object when the problem has none), the optimizer, the
    parameters' paths, shapes and dtypes, the probe's layout, the batch's shapes and the mesh, so
    planning again (another budget, ``compare``) compiles no probe twice; ``cached`` counts the
    probes found there. The optimizer is keyed by its state's structure, shapes and dtypes (two
    instances of ``optax.adam`` share figures; a learning rate changes no figure).
    """

    loss_fn: object
    optimizer: object
    params: object  # abstract
    mesh: object
    device_bytes: float
    record: str | pathlib.Path | None = None
    compiles: int = 0  # probes compiled so far
    seconds: float = 0.0  # spent compiling and timing them
    cache: bool = True
    cached: int = 0  # probes found in the in-process cache
    threads: int | None = None  # compile threads (None: the CPUs, at most MAX_THREADS; timed probes: 1)
    _recorded: dict = dataclasses.field(default_factory=dict)
    _static: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def _key(self, layout, batch, timed, fingerprint: str = ""):
        if self._static is None:  # the parameters' and optimizer state's shapes, once per calibrator
            self._static = (tuple((i.path, i.shape, str(i.dtype)) for i in describe(self.params)),
                            _signature(jax.eval_shape(self.optimizer.init, self.params)))
        params, optimizer = self._static
        key = (fingerprint or self.loss_fn, optimizer, params, layout, _signature(batch), self.mesh, bool(timed))
        try:
            hash(key)
        except TypeError:  # an unhashable loss function or optimizer: no caching
            return None
        return key

    def profile(self, problem, kind, batch, splits, timed):
        return next(iter(self.profile_many(problem, [(kind, batch, splits, timed)])))[1]

    def profile_many(self, problem, requests):
        """:meth:`profile` for each ``(kind, batch, splits, timed)`` of ``requests``, yielding
        ``(index, figures)`` as each is done: probes not cached are compiled by
        ``runtime.step.compile_many`` on ``threads`` worker threads, the timed ones (they run
        on the devices) one at a time."""
        return self._profile_jobs([(problem, *request) for request in requests])

    def compile_all(self, problems, progress=lambda jobs, desc: jobs, stop=None) -> int:
        """Compile the probes of several problems of this calibrator's model at once, ``problems``
        a list of ``(problem, requests)`` (:func:`probe_requests`), and keep their figures in the
        in-process cache, where each problem's :func:`calibrate` then finds them: the plan with
        units and the plan without them (``_planner.plan``) probe in one batch on the compile
        threads, not two, each traced while the workers compile the others (the layouts they
        share compiled once). Does nothing for timed probes, which run one at a time, or without
        the cache. ``progress``: as :func:`calibrate`'s. ``stop(job, figures)``, called as each
        probe is done (``job``: ``(problem, kind, batch, splits, timed)``), ends the batch when
        true: probes not yet compiling are not compiled. The first job's figures are read as soon
        as it is compiled, the others' after the last probe is traced (``compile_many``'s
        ``early``), so a ``stop`` that waits on the first job costs the rest nothing. Returns the
        number of probes compiled."""
        if not self.cache:
            return 0
        jobs, seen = [], set()
        for problem, requests in problems:
            for kind, batch, splits, timed in requests:
                if timed:
                    return 0
                key = self._key(self._layout(problem, kind, splits), batch, timed, problem.fingerprint)
                if key is None:
                    return 0
                kept = _kept(key)
                if kept is not None and stop is not None and stop((problem, kind, batch, splits, timed), kept):
                    return 0  # a kept probe's figures end the batch before anything is compiled
                if kept is None and key not in seen:
                    seen.add(key)
                    jobs.append((problem, kind, batch, splits, timed))
        waiting = [stop is not None]  # for the first job's figures, yielded as soon as they are in
        n0, done = self.compiles, self._profile_jobs(jobs, early=lambda: waiting[0])
        try:
            for i, figures in progress(_Sized(done, len(jobs)), "osdp-jax: compiling probes") if jobs else ():
                if stop is not None and stop(jobs[i], figures):  # each kept in _PROBES as it is done
                    break
                waiting[0] = waiting[0] and i != 0
        finally:
            done.close()  # when stopped early, the probes not yet compiling are dropped
        return self.compiles - n0

    @staticmethod
    def _layout(problem, kind, splits):
        return problem.layout(lambda x: kind.zero3(x, problem), splits, kind.remat,
                              lambda x: kind.zero2(x, problem), kind.remat_layers)

    def _profile_jobs(self, jobs, early=lambda: False):
        """:meth:`profile_many` of ``(problem, kind, batch, splits, timed)`` jobs (``early``: as
        ``compile_many``'s)."""
        to_compile = []
        for i, (problem, kind, batch, splits, timed) in enumerate(jobs):
            layout = self._layout(problem, kind, splits)
            key = self._key(layout, batch, timed, problem.fingerprint) if self.cache else None
            found = _kept(key) if key is not None else None
            if found is not None:
                self.cached += 1
                yield i, self._done(kind, batch, key, *found)
            else:
                to_compile.append((i, kind, batch, layout, key, timed))
        steps = [(self.loss_fn, self.optimizer, self.params, batch, self.mesh, layout, False if timed else "probe")
                 for _, _, batch, layout, _, timed in to_compile]
        t0, n0 = time.perf_counter(), compile_count()
        threads = 1 if any(job[-1] for job in to_compile) else self.threads or compile_threads()
        for j, (compiled, missing) in compile_many(steps, threads, early):
            i, kind, batch, layout, key, timed = to_compile[j]
            prof, seconds = profile_compiled(compiled, missing), None
            if timed and prof.peak_bytes <= self.device_bytes:  # it must fit the devices, not the budget
                seconds = time_compiled(compiled, abstract_args(self.optimizer, self.params, batch, self.mesh, layout))
            self.compiles += compile_count() - n0
            self.seconds += time.perf_counter() - t0
            t0, n0 = time.perf_counter(), compile_count()
            yield i, self._done(kind, batch, key, prof, seconds)

    def _done(self, kind, batch, key, prof, seconds):
        self._record(kind, batch, prof, seconds)
        if key is not None and key not in _PROBES:
            _PROBES[key] = (prof, seconds)
            _probe_store.save(key, prof)  # a timed probe's is not kept on disk
        return prof, seconds

    def _record(self, kind, batch, prof, seconds):
        if self.record is not None:
            self._recorded[f"{kind.value}/{_batch_size(batch)}"] = {**dataclasses.asdict(prof), "seconds": seconds}
            pathlib.Path(self.record).write_text(json.dumps(self._recorded, indent=1, sort_keys=True))


@dataclasses.dataclass
class RecordedCalibrator:
    """Probe figures recorded earlier: ``{"<kind>/<batch size>": StepProfile fields + "seconds"}``,
    e.g. ``{"R/32": {"argument_bytes": ..., ..., "seconds": null}}``."""

    figures: dict
    progress_desc = "osdp-jax: reading recorded probes"

    @classmethod
    def from_json(cls, path) -> "RecordedCalibrator":
        return cls(json.loads(pathlib.Path(path).read_text()))

    def profile(self, problem, kind, batch, splits, timed):
        key = f"{kind.value}/{_batch_size(batch)}"
        if key not in self.figures:
            raise KeyError(f"no recorded probe {key!r}; recorded: {sorted(self.figures)}")
        fig = dict(self.figures[key])
        seconds = fig.pop("seconds", None)
        return StepProfile(**fig), seconds if timed else None


def probe_kinds(problem: Problem) -> list[ProbeKind]:
    """The probes a problem needs: LAYER only when it has both per-layer and per-step shardable
    parameters, SPLIT only when a per-layer kernel can split; REPLICATE alone when no parameter
    may take a sharded strategy (and there is no layer stack or unit)."""
    can_shard, loop = problem.can_shard(), problem.loop_mask()
    if not problem.stacks and not problem.units and not problem.any_sharded():
        return [ProbeKind.REPLICATE]  # nothing can be sharded (strategies=("replicate",)): no other layout
    kinds = [ProbeKind.REPLICATE, ProbeKind.ZERO3]
    if (can_shard & loop).any() and (can_shard & ~loop).any():
        kinds.append(ProbeKind.LAYER)
    if split_probe(problem):
        kinds.append(ProbeKind.SPLIT)
    if step_split_probe(problem):
        kinds.append(ProbeKind.SPLIT_STEP)
    if "zero2" in problem.strategies and (can_shard & ~loop).any():
        kinds.append(ProbeKind.ZERO2)
        if ProbeKind.LAYER in kinds:
            kinds.append(ProbeKind.ZERO2_LAYER)
    return kinds


def last_probe(problem: Problem) -> bool:
    """Whether the problem takes the LAST probe: it has two units or more, and the last one holds
    a parameter that can be sharded."""
    last = problem.last_unit_mask()
    return len(set(problem.units.values())) >= 2 and bool((last & problem.can_shard()).any())


def _largest_splits(problem: Problem, per_layer: bool) -> dict[str, int]:
    """Every splittable kernel gathered per layer (or, without ``per_layer``, per step) at its
    largest k."""
    return {i.path: problem.split_ks[i.path, "zero3"][-1] for i in problem.infos
            if (i.path in problem.in_loop) == per_layer and problem.split_ks.get((i.path, "zero3"))}


def split_probe(problem: Problem) -> dict[str, int]:
    """The SPLIT probe's split counts: every per-layer splittable kernel at its largest k."""
    return _largest_splits(problem, per_layer=True)


def step_split_probe(problem: Problem) -> dict[str, int]:
    """The SPLIT_STEP probe's split counts: every per-step splittable kernel at its largest k."""
    return _largest_splits(problem, per_layer=False)


def step_split_bytes(problem: Problem) -> float:
    """Bytes the SPLIT_STEP probe's splits take off the per-step kernels' gathered weights,
    ``sum (1 - 1/k) p`` (0 without such a kernel)."""
    splits = step_split_probe(problem)
    return sum((1 - 1 / k) * i.nbytes for i in problem.infos if (k := splits.get(i.path)))


def probe_splits(problem: Problem, kind: ProbeKind) -> dict[str, int]:
    """The split counts a probe runs with (path -> k; only SPLIT and SPLIT_STEP split)."""
    return {ProbeKind.SPLIT: split_probe, ProbeKind.SPLIT_STEP: step_split_probe}.get(kind, lambda _: {})(problem)


class Calibrated(NamedTuple):
    """What calibration gives the planner."""

    calibrations: dict  # batch size -> Calibration (None: uncalibrated estimates)
    probes: dict  # (ProbeKind, batch size) -> StepProfile: compiled layouts whose XLA peak is known
    remat: dict = {}  # batch size -> {remat policy: (temp bytes, compute seconds) per layer, vs "full"}


def probe_choices(problem: Problem, kind: ProbeKind) -> np.ndarray | None:
    """The probe's layout as one column per parameter of ``problem``, or None when the problem's
    columns cannot express it (e.g. zero3 not allowed)."""
    splits = probe_splits(problem, kind)
    choices = []
    for row, info in enumerate(problem.infos):
        zero3 = kind.zero3(info, problem) and problem.spec_of(info, "zero3") is not None
        column = ("zero3", splits.get(info.path, 1)) if zero3 else ("replicate", 1)
        if kind.zero2(info, problem) and problem.spec_of(info, "zero2") is not None:
            column = ("zero2", 1)
        if column not in problem.columns or problem.options[row][problem.columns.index(column)] is None:
            return None
        choices.append(problem.columns.index(column))
    return np.array(choices, dtype=np.int64)


def remat_kinds(problem: Problem, policies) -> list[ProbeKind]:
    """The remat probes: one per policy other than "full" the search may choose, when the model
    has a layer stack."""
    if not problem.stacks:
        return []
    return [k for k in (ProbeKind.REMAT_DOTS, ProbeKind.REMAT_NONE) if k.remat in policies]


# probe kinds compiled at the largest batch size only, their terms carried to the smaller sizes (``calibrate``:
# the remat terms in proportion to the batch, the split's saving per byte as it is)
AT_TOP = frozenset({ProbeKind.SPLIT, ProbeKind.SPLIT_STEP, ProbeKind.REMAT_DOTS, ProbeKind.REMAT_NONE})
UNTIMED = frozenset({ProbeKind.SPLIT, ProbeKind.SPLIT_STEP})  # probe kinds never run and timed (memory terms only)


def probe_requests(problem: Problem, batches: dict, measure_time: bool = False, policies=("full",)) -> tuple:
    """The probes :func:`calibrate` compiles for ``problem``: ``(jobs, requests)``, a job
    ``(ProbeKind, batch size)`` and its request ``(kind, abstract batch, splits, timed)`` for
    ``Calibrator.profile``, every probe kind at the smallest and largest of ``batches``, the
    ``AT_TOP`` kinds at the largest only, the LAST probe at the smallest."""
    sizes = sorted(batches)
    top, ends = sizes[-1], sorted({sizes[0], sizes[-1]})
    jobs = [(kind, b) for b in ends for kind in (*probe_kinds(problem), *remat_kinds(problem, policies))
            if kind not in AT_TOP or b == top]
    jobs += [(ProbeKind.LAST, sizes[0])] if last_probe(problem) else []
    return jobs, [(kind, batches[b], probe_splits(problem, kind), measure_time and kind not in UNTIMED)
                  for kind, b in jobs]


def calibrate(problem: Problem, calibrator: Calibrator, batches: dict, hw, measure_time: bool = False,
              progress=lambda jobs, desc: jobs, policies=("full",)) -> Calibrated:
    """``{batch size: Calibration}`` fitted on the probes at the smallest and largest of ``batches``
    (batch size -> abstract batch), interpolated for the sizes between; the probes' figures; and
    the remat policies' per-layer terms, from one probe per policy at the largest size only.

    The remat and split probes (``AT_TOP``) are compiled at the largest size B only. The remat
    terms are scaled to each size b in proportion, ``term(b) = term(B) b / B``: what a policy
    keeps or recomputes is activations, close to linear in the batch through zero. The split's
    saving per byte (sigma) is kept the same at every size: it is a weight term, one layer's
    gathered slice, which does not grow with the batch.
    The other probes are compiled at both ends: their temp is a max of pools (replicated gradients,
    gathered weights, activations), not a sum, and a difference at one size does not carry to
    another (which pool is the largest can change with the batch size).
    """
    sizes = sorted(batches)
    kinds = probe_kinds(problem)
    splits = split_probe(problem)
    split_share = sum((1 - 1 / k) * i.nbytes / i.shape[0] for i in problem.infos if (k := splits.get(i.path)))
    step_share = step_split_bytes(problem)
    top, ends = sizes[-1], sorted({sizes[0], sizes[-1]})
    jobs, requests = probe_requests(problem, batches, measure_time, policies)
    desc = getattr(calibrator, "progress_desc", None) or (
        "osdp-jax: compiling and timing probes" if measure_time else "osdp-jax: compiling probes")
    many = getattr(calibrator, "profile_many", None)
    done = (many(problem, requests) if many is not None
            else ((i, calibrator.profile(problem, *request)) for i, request in enumerate(requests)))
    runs = {jobs[i]: figures for i, figures in progress(_Sized(done, len(jobs)), desc)}
    p = np.array([i.nbytes for i in problem.cost_infos()], dtype=np.float64)  # per device of a model axis
    can_shard, loop = problem.can_shard(), problem.loop_mask()
    probed, last_saving = {}, None
    for b in ends:
        got = {kind: runs[kind, b][0] for kind in kinds if (kind, b) in runs}
        # with no per-step parameter to shard, the all-zero3 probe is the per-layer one
        per_layer = got.get(ProbeKind.LAYER, got.get(ProbeKind.ZERO3) if not (can_shard & ~loop).any() else None)
        probed[b] = fit(got[ProbeKind.REPLICATE], per_layer, got.get(ProbeKind.ZERO3, got[ProbeKind.REPLICATE]),
                        p, can_shard, loop,
                        got.get(ProbeKind.SPLIT), split_share, _unit_mask(problem),
                        (got.get(ProbeKind.ZERO2), got.get(ProbeKind.ZERO2_LAYER)),
                        problem.last_unit_mask(), problem.saving_bytes(),
                        runs[ProbeKind.LAST, b][0] if (ProbeKind.LAST, b) in runs else None, last_saving,
                        got.get(ProbeKind.SPLIT_STEP), step_share)
        last_saving = probed[b].last_saving
        timed = [(sec, got[kind].flops / hw.flops, _modelled_comm(problem, kind, hw))
                 for kind in kinds if kind not in UNTIMED and (kind, b) in runs and (sec := runs[kind,
                                                                                                 b][1]) is not None]
        if timed:
            cf, cc = fit_time(timed)
            probed[b] = dataclasses.replace(probed[b], compute_scale=cf, comm_scale=cc)
            log.info("batch %d: compute x%.2f, collectives x%.2f from %d timed probes", b, cf, cc, len(timed))
    if ProbeKind.SPLIT in AT_TOP and (ProbeKind.SPLIT, top) in runs:  # a weight term: the same at every size
        probed = {b: dataclasses.replace(c, sigma=probed[top].sigma) for b, c in probed.items()}
    remat = {b: {} for b in sizes}
    for kind in remat_kinds(problem, policies):
        layers = sum(kind.remat_layers(problem.stack_layers(s)) for s in range(len(problem.stacks)))
        terms = {}  # probed size -> (temp bytes, compute seconds) per layer, against "full"
        for b in [top] if kind in AT_TOP else ends:
            base = ProbeKind.LAYER if (ProbeKind.LAYER, b) in runs else ProbeKind.ZERO3
            full, prof = runs[base, b][0], runs[kind, b][0]
            terms[b] = ((prof.temp_bytes - full.temp_bytes) / layers,
                        probed[b].compute_scale * (prof.flops - full.flops) / hw.flops / layers)
            log.info("batch %d, remat %s: %+.0f bytes and %+.3g s per layer", b, kind.remat, *terms[b])
        for b in sizes:  # in proportion from the largest size, or linear between the two ends
            lo, at_lo = (0, (0.0, 0.0)) if len(terms) == 1 else (ends[0], terms[ends[0]])
            w = (b - lo) / (top - lo)
            remat[b][kind.remat] = tuple(x + w * (y - x) for x, y in zip(at_lo, terms[top]))
    return Calibrated({b: probed[b] if b in probed else interpolate(probed, b) for b in sizes},
                      {job: prof for job, (prof, _) in runs.items()}, {b: remat[b] for b in sizes})


class _Sized:
    """An iterator with a length, for the progress bar."""

    def __init__(self, it, n: int):
        self.it, self.n = it, n

    def __iter__(self):
        return iter(self.it)

    def __len__(self):
        return self.n


def _unit_mask(problem: Problem) -> np.ndarray:
    return np.array([i.path in problem.units for i in problem.infos], dtype=bool)


def _modelled_comm(problem: Problem, kind: ProbeKind, hw) -> float:
    """Modelled collective seconds of a probe's layout (no splits)."""
    def one(i):
        if kind.zero3(i, problem) and problem.spec_of(i, "zero3") is not None:
            return comm_seconds(i.nbytes, "zero3", hw, problem.topo, gathered_layers(problem, i.path, i.shape))
        zero2 = kind.zero2(i, problem) and problem.spec_of(i, "zero2") is not None
        return comm_seconds(i.nbytes, "zero2" if zero2 else "replicate", hw, problem.topo)
    return sum(one(i) for i in problem.cost_infos())


def gathered_layers(problem: Problem, path: str, shape) -> int:
    """How many times a sharded parameter's collectives run per step, each on 1/layers of it,
    re-gathered in the backward pass: its layers in a stack, 1 in a unit; 0 when gathered once
    per step and kept."""
    return shape[0] if path in problem.in_loop else int(path in problem.units)


def uncalibrated(sizes) -> Calibrated:
    """No loss function to probe: ``_cost`` uses its estimates, and no layout's XLA peak is known."""
    return Calibrated({s: None for s in sizes}, {})

