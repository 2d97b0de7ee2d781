"""The sharded training and eval steps, and compiling a step without allocating.

The train step takes the gradients of ``runtime.gradient`` (per device, under ``jax.shard_map``)
and runs the optimizer on the global arrays, outside the shard_map; a zero2 parameter's update is
applied on its shard, and the updated shards are all-gathered into the whole parameter when the
step lays its output out.

Compiling without allocating is :func:`compile_step`; placing parameters, optimizer state and
batches is ``runtime.place``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import time

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from osdp_jax.core.bytes import format_bytes, parse_bytes
from osdp_jax.core.compat import supported_compile_options
from osdp_jax.core.describe import path_name
from osdp_jax.core.layout import (
    as_layout,
    batch_specs,
    manual_specs,
    opt_state_specs,
    spec_tree,
    state_spec_tree,
)
from osdp_jax.core.simulated import warn_if_collectives_may_race
from osdp_jax.core.strategies import axes_size, axis_entry
from osdp_jax.core.xla import StepProfile, loop_flops, profile_compiled
from osdp_jax.runtime.collectives import device_index
from osdp_jax.runtime.gradient import (
    StepOptions,
    build_gradient,
    check_batch,
    check_batch_leaves,
    extra_args,
    gathering_of,
    lay_out_tree,
    manual_over_data,
    model_view,
    reduce_out,
)
from osdp_jax.runtime.place import abstract_args, as_auto


def build_step(loss_fn, optimizer, mesh, layout, options: StepOptions = StepOptions()):
    """An un-jitted step ``(params, opt_state, batch[, state][, rng]) -> (params, opt_state, loss[, aux][, state])``
    for ``layout`` (a :class:`~osdp_jax.Layout` or a ``Plan``).

    The gradients are those of ``runtime.gradient.build_gradient`` (per device, under
    ``jax.shard_map``); the optimizer then runs on the global arrays, outside the shard_map, so a
    transformation that reduces across parameters (``optax.clip_by_global_norm``, LAMB's trust
    ratio) sees whole gradients, not one device's shards, and every replica of a replicated
    parameter and of its optimizer state gets bit-identical values (XLA computes replicated
    elementwise updates the same way on every device; the one cross-device sum, the norm, is an
    all-reduce).
    """
    gradients = build_gradient(loss_fn, mesh, layout, options)
    layout = as_layout(layout)
    n = axes_size(mesh, layout.axes)
    named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree)  # noqa: E731

    def step(params, opt_state, batch, *extra):
        state, rng = extra_args(extra, options, "params, opt_state")
        loss, aux, grads, new_state = gradients(params, batch, state, rng)  # checks params and batch first
        p_specs = spec_tree(params, layout)
        t_specs = state_spec_tree(params, layout, n)  # gradients and optimizer state
        o_specs = opt_state_specs(optimizer, opt_state, t_specs, params)
        # Explicit meshes need inputs already laid out as the specs (a no-op when they are)
        params, opt_state = lay_out_tree((params, opt_state), (p_specs, o_specs), mesh)
        updates, opt_state = as_auto(optimizer.update, mesh, (named(t_specs), named(o_specs)))(grads, opt_state, params)
        # a zero2 parameter's update is applied on its shard, then gathered whole below
        params = optax.apply_updates(lay_out_tree(params, t_specs, mesh), updates)
        params, opt_state = lay_out_tree((params, opt_state), (p_specs, o_specs), mesh)
        out = (params, opt_state, loss)
        if options.has_aux:
            out += (aux,)
        if options.state:
            out += (new_state,)
        return out
    return step


def jit_step(step):
    """``jax.jit(step)`` with params and optimizer state donated."""
    return jax.jit(step, donate_argnums=(0, 1))


# --- compiled steps kept for reuse ------------------------------------------------------------
# Under ``plan(verify="full")`` the planner's verification compile is the train step's compile
# (by default it is compiled for its figures only, kept apart below and never run):
# ``compile_counted`` keeps the last few compiled steps, keyed by the loss function and optimizer objects, the mesh,
# the layout,
# the step options and the inputs' shapes, dtypes and shardings (each kept as ``(compiled, FLOPs
# XLA leaves out)``, so a step found here is not traced again); ``make_train_step`` runs one of
# them instead of compiling the same step again, and ``compile_counted`` returns one it already
# has (a plan whose layout a probe or an earlier plan compiled).
_COMPILED: "collections.OrderedDict" = collections.OrderedDict()
_KEEP = 8  # compiled steps kept (each holds its executable)
# Steps compiled for their figures only (``FIGURES_ONLY``) are kept apart, never run: a budget
# sweep meets the same layout at several budgets, and compiles it once.
_FIGURES: "collections.OrderedDict" = collections.OrderedDict()
_KEEP_FIGURES = 32


def _keep(kept: "collections.OrderedDict", key, compiled, most: int) -> None:
    kept[key] = compiled
    kept.move_to_end(key)
    while len(kept) > most:
        kept.popitem(last=False)


def _sharding_key(sharding, ndim: int):
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return sharding.mesh, spec
    return None if sharding is None else repr(sharding)


def signature(args) -> tuple:
    """The inputs as a compiled step sees them: tree structure, and shape, dtype and sharding of
    every leaf (arrays or ``ShapeDtypeStruct``s)."""
    leaves, treedef = jax.tree.flatten(args)
    return str(treedef), tuple((tuple(x.shape), str(x.dtype), _sharding_key(getattr(x, "sharding", None), len(x.shape)))
                               for x in leaves)


def _reuse_key(loss_fn, optimizer, mesh, layout, options, args):
    key = (loss_fn, optimizer, mesh, as_layout(layout), options, signature(args))
    try:
        hash(key)
    except TypeError:  # an unhashable loss function or optimizer: nothing is kept
        return None
    return key


_COMPILES = 0  # steps XLA compiled in this process through compile_counted
_COMPILE_SECONDS = 0.0  # and the seconds those compiles took


def compile_count() -> int:
    """How many steps ``compile_step``/``profile_step`` (and the planner) have compiled in this
    process; a step found among the kept ones is not counted."""
    return _COMPILES


def compile_seconds() -> float:
    """Seconds the compiles :func:`compile_count` counts took, wall clock (those :func:`compile_many`
    ran at once count once)."""
    return _COMPILE_SECONDS


def clear_compiled() -> None:
    """Forget the compiled steps kept for reuse (and those compiled for their figures only)."""
    _COMPILED.clear()
    _FIGURES.clear()


class TrainStep:
    """A jitted train step that refuses donated (deleted) arrays with a clear error.

    Calling a jitted function with an array that an earlier call donated fails deep inside jax;
    this checks the arguments first, and, given the ``mesh``, that no batch leaf is committed to
    other devices (``jax.device_put(x, jax.devices()[0])``: jax refuses to mix device
    assignments, naming no fix). ``lower`` is the jitted function's. With ``reuse`` (the
    loss function, optimizer, mesh, layout and options it was made from), a call whose inputs
    match a step compiled earlier in this process (the planner's ``verify="full"`` compile) runs that
    executable instead of compiling again; ``reused`` says whether the last call did.
    """

    def __init__(self, jitted, what: str = "train step", batch_size: int | None = None, batch_arg: int = 2,
                 reuse: tuple | None = None, mesh=None):
        self._jitted, self._what, self._batch_size, self._batch_arg = jitted, what, batch_size, batch_arg
        self._reuse, self.reused = reuse, False
        self._devices = None if mesh is None else tuple(mesh.devices.flat)  # the mesh's device order, once
        self._device_set = None if mesh is None else set(self._devices)

    def _check_batch_devices(self, args):
        if self._devices is None or len(args) <= self._batch_arg:
            return
        order = self._devices
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[self._batch_arg])[0]:
            if not (isinstance(leaf, jax.Array) and leaf.committed):
                continue  # host arrays and uncommitted ones: the step places them
            sharding = leaf.sharding
            same = sharding.device_set == self._device_set and (
                not isinstance(sharding, NamedSharding) or tuple(sharding.mesh.devices.flat) == order)
            if not same:
                ids = ([d.id for d in sharding.mesh.devices.flat] if isinstance(sharding, NamedSharding)
                       else sorted(d.id for d in sharding.device_set))
                raise ValueError(
                    f"batch leaf {path_name(path) or '<root>'!r} is committed to devices {ids}, not to the "
                    f"{self._what}'s mesh (devices {[d.id for d in order]}, in that order): place the batch "
                    f"with jax.device_put(batch, osdp_jax.batch_sharding(mesh, plan)), or pass host (numpy) "
                    f"or uncommitted arrays, which the step places itself")

    def _compiled_for(self, args):
        if self._reuse is None:
            return None
        key = _reuse_key(*self._reuse, args)
        kept = _COMPILED.get(key) if key is not None else None
        return None if kept is None else kept[0]

    def _check_batch_size(self, args):
        if self._batch_size is None or len(args) <= self._batch_arg:
            return
        got = check_batch_leaves(args[self._batch_arg])
        if got != self._batch_size:
            raise ValueError(
                f"the plan was made for global batch size {self._batch_size}, got a batch of "
                f"{got}: its memory was not checked against the budget. Re-plan with that "
                f"batch size, or pass any_batch_size=True to make_train_step to run it anyway")

    def __call__(self, *args):
        self._check_batch_size(args)
        self._check_batch_devices(args)
        for i, tree in enumerate(args[:2]):
            if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree)):
                name = ("params", "opt_state")[i]
                raise ValueError(
                    f"{name} passed to the {self._what} were donated to an earlier call (their buffers are "
                    f"deleted): use the {name} that call returned, e.g. params, opt_state, loss = "
                    f"step(params, opt_state, batch)")
        compiled = self._compiled_for(args)
        self.reused = compiled is not None
        return compiled(*args) if compiled is not None else self._jitted(*args)

    def lower(self, *args):
        self._check_batch_size(args)
        return self._jitted.lower(*args)

    def __repr__(self):
        return f"<osdp_jax {self._what}>"


def make_train_step(loss_fn, optimizer, plan, mesh, *, has_aux: bool = False, aux: str = "mean",
                    rng: bool = False, state: bool = False, any_batch_size: bool = False,
                    microbatches: int | None = None):
    """A ``jax.jit``-wrapped step ``(params, opt_state, batch[, state][, rng])`` returning
    ``(params, opt_state, loss[, aux][, new_state])``.

    ``params`` and ``opt_state`` are donated: use the returned ones (passing donated ones again
    raises a ``ValueError``). Place them first with :func:`osdp_jax.shard` and
    :func:`osdp_jax.init_opt_state`. Each device runs ``loss_fn`` on its slice of the batch; the
    loss is the mean of the devices' losses, so ``loss_fn`` must return the *mean* loss over the
    batch it is given.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss``, a scalar; with ``has_aux``, ``(loss, aux)``;
        with ``rng``, it also takes ``rng=``; with ``state``, it also takes ``state=`` and returns
        ``(loss, new_state)`` (``(loss, (aux, new_state))`` with ``has_aux``).
      optimizer: an ``optax.GradientTransformation``; it runs on the global gradients, so
        cross-parameter transformations such as ``optax.clip_by_global_norm`` are exact.
      plan: the :class:`osdp_jax.Plan` (or :class:`osdp_jax.Layout`) the params were sharded with.
      mesh: the mesh the plan was made for.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns ``aux`` after the loss.
      aux: ``"mean"``: each floating aux leaf is averaged over the data-parallel devices (each
        device's value is of its batch slice), integer and bool leaves are summed (counts);
        ``"gather"``: leaves are concatenated along their leading axis in device order (per-example
        outputs; a 0-d leaf gives one value per device).
      rng: the step takes a PRNG key after the batch (pass a new one each step, e.g.
        ``jax.random.fold_in(key, step)``); each device's ``loss_fn`` gets it folded with the
        device's data-parallel index, so dropout differs across the batch slices and a run is
        reproducible.
      state: the step takes mutable collections (e.g. ``{"batch_stats": ...}``, replicated) after
        the batch and returns the new ones, averaged over the data-parallel devices (BatchNorm
        statistics of the whole batch, for statistics that are means).
      microbatches: run each device's batch slice as this many microbatches in a loop, summing
        the gradients (gradient accumulation): activation memory falls about m-fold. Each gradient
        is summed where the layout's ``accumulate`` says (``osdp_jax.strategies.accumulation``):
        a sharded parameter is gathered and reduce-scattered once per microbatch unless kept
        (gathered once, reduce-scattered once); a zero2 gradient is reduce-scattered in each unless
        summed whole; a replicated gradient is summed locally and reduced once. The loss and gradient equal those of the
        whole batch (mean of equal microbatches), up to float rounding. Default: the plan's
        ``microbatches`` (1 for a ``Layout``). Not with ``state=True``. With ``rng``, each
        microbatch gets the device's key folded with its index.
      any_batch_size: accept a global batch size other than ``plan.batch_size`` (it recompiles,
        and its memory was not checked against the budget). By default such a batch raises a
        ``ValueError`` naming the planned size.
    """
    options = StepOptions(has_aux, aux, rng, state,
                          microbatches=getattr(plan, "microbatches", 1) if microbatches is None else microbatches)
    step = build_step(loss_fn, optimizer, mesh, plan, options)
    warn_if_collectives_may_race(mesh)
    return TrainStep(jit_step(step), "train step", None if any_batch_size else plan.batch_size,
                     reuse=(loss_fn, optimizer, mesh, plan, options), mesh=mesh)


def make_eval_step(fn, plan, mesh, *, aux: str = "mean", rng: bool = False, state: bool = False):
    """A ``jax.jit``-wrapped ``(params, batch[, state][, rng]) -> outputs`` under ``plan``.

    Each device runs ``fn(params, batch)`` (with ``rng=``/``state=`` when asked, as in
    :func:`make_train_step`) on its slice of the batch, with the parameters gathered as the
    train step gathers them; the outputs (any pytree) are combined as ``aux`` says: ``"mean"``
    averages floating leaves and sums integer ones over the devices, ``"gather"`` concatenates
    them along the leading axis. Nothing is donated and no gradient is taken. Any batch size the
    data-parallel device count divides is accepted.
    """
    options = StepOptions(False, aux, rng, False)
    layout = as_layout(plan)
    axes = layout.axes

    def evaluate(params, batch, *extra):
        check_batch(batch, axes_size(mesh, axes))
        extra = list(extra)
        st = extra.pop(0) if state else None
        key = extra.pop(0) if rng else None
        p_specs = spec_tree(params, layout)
        view = model_view(fn, manual_specs(p_specs, layout), gathering_of(layout, mesh, params))

        def body(p, b, s, r):
            kw = {}
            if state:
                kw["state"] = s
            if rng:
                kw["rng"] = jax.random.fold_in(r, device_index(axes))
            return jax.tree.map(lambda x: reduce_out(x, axes, options.aux), view(p, b, **kw))

        out_spec = P(axis_entry(axes)) if aux == "gather" else P()
        in_specs = (manual_specs(p_specs, layout), batch_specs(batch, axes), jax.tree.map(lambda _: P(), st),
                    None if key is None else P())
        # Explicit meshes need inputs already laid out as their specs (a no-op when they are)
        params, batch, st = lay_out_tree((params, batch, st), (p_specs, *in_specs[1:3]), mesh)
        return manual_over_data(body, mesh, layout, in_specs, out_spec,
                                lambda outputs: jax.tree.map(lambda _: out_spec, outputs))(params, batch, st, key)

    return TrainStep(jax.jit(evaluate), "eval step", batch_arg=1, mesh=mesh)


# --- compiling without allocating --------------------------------------------------------------

def compile_step(loss_fn, optimizer, params, batch, mesh, plan, **options):
    """The train step for ``plan`` (a ``Plan`` or ``Layout``) lowered and compiled on abstract
    inputs: nothing is allocated. ``params`` and ``batch`` may be arrays or ``ShapeDtypeStruct``s;
    ``options`` are :func:`make_train_step`'s ``has_aux`` and ``aux``, and ``embed_lookup=False`` to
    compile with Flax's own Embed lookup instead of ``runtime.kernels.lookup``. Read XLA's
    per-device figures with :func:`osdp_jax.profile_compiled`."""
    return compile_counted(loss_fn, optimizer, params, batch, mesh, plan, **options)[0]


# A step compiled only for XLA's figures: buffer assignment (the memory figures) and the cost
# analysis run on the optimised HLO, before the backend's LLVM passes, which this option turns off
# (a compile then takes about half the time on XLA:CPU; tests/test_plan.py checks the figures are
# equal). Probes and the planner's figures-only checks (below) compile with it.
FIGURES_ONLY = {"xla_backend_optimization_level": 0}
# A probe goes further on XLA:CPU: its kernels are emitted by the older loop emitters
# (``xla_cpu_use_fusion_emitters`` off), which halves a probe's compile on the layer-stack models
# (the new emitters' MLIR pipeline is most of a figures-only compile there). XLA then fuses some
# elementwise ops differently, so the figures are not the default compile's to the byte: measured
# within 1 KiB of temp on every model tried (tests/test_plan.py bounds it); FLOPs differ by under
# 0.1%. Probes are fitted terms; the chosen plan is checked as a probe, then verified on its
# default compile (:func:`profile_checked`), or on the probe compile alone when it will not be run.
# Its LLVM module is also not split for parallel codegen (``xla_cpu_parallel_codegen_split_count``
# 1): the compile threads (``compile_many``) already keep the cores busy, and on 2 cores the
# splitting only added work (cold plans 6 to 13% faster without it on 2 cores, the same plans and
# XLA peaks). Codegen comes after buffer assignment: the figures are the same to the byte.
# An option the running XLA does not know is left out (``_compat.supported_compile_options``):
# jaxlib 0.11 and later have no older emitters, and their probes compile with the default ones.
PROBE_ONLY_CPU = {"xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}
PROBE_TOLERANCE = 1024  # bytes: a probe compile's peak may be this far under the default compile's


def _options(purpose: str, mesh) -> dict | None:
    """Compiler options for a step compiled to run (``"run"``), for its figures (``"figures"``) or
    as a probe (``"probe"``): only those the running XLA knows, None for a default compile."""
    if purpose == "run":
        return None
    platform = mesh.devices.flat[0].platform
    cpu = purpose == "probe" and platform == "cpu"
    return supported_compile_options({**FIGURES_ONLY, **(PROBE_ONLY_CPU if cpu else {})}, platform)


@dataclasses.dataclass
class _Pending:
    """A step traced for :func:`compile_counted`: compiled already (``compiled``), or to compile
    from ``lowered``; kept under ``key`` in ``kept`` once it is."""

    key: object
    kept: "collections.OrderedDict"
    lowered: object
    options: dict | None
    missing_flops: float
    compiled: object = None


def _prepare(loss_fn, optimizer, params, batch, mesh, plan, figures_only: bool | str, options) -> _Pending:
    purpose = "probe" if figures_only == "probe" else "figures" if figures_only else "run"
    args = abstract_args(optimizer, params, batch, mesh, plan)
    options.setdefault("microbatches", getattr(plan, "microbatches", 1))
    step_options = StepOptions(**options)
    key = _reuse_key(loss_fn, optimizer, mesh, plan, step_options, args)
    kept, found = _COMPILED, _COMPILED.get(key) if key is not None else None  # a runnable one serves all
    if found is None and purpose != "run":
        kept, (key, found) = _FIGURES, _kept_figures(key, purpose)
    if found is not None:  # kept with its FLOPs: not traced again (a second on a 48-layer model)
        return _Pending(key, kept, None, None, found[1], found[0])
    traced = jit_step(build_step(loss_fn, optimizer, mesh, plan, step_options)).trace(*args)
    return _Pending(key, kept, traced.lower(), _options(purpose, mesh), loop_flops(traced.jaxpr))


def _kept_figures(key, purpose: str) -> tuple:
    """The key a step compiled for its figures as ``purpose`` is kept under in ``_FIGURES``, and
    that step, as ``(compiled, FLOPs XLA leaves out)``, if it is kept (None, None for a step that
    cannot be keyed)."""
    key = None if key is None else (key, purpose)
    return key, _FIGURES.get(key) if key is not None else None


def _compile(pending: _Pending) -> tuple[object, float, float]:
    """The pending step compiled (no shared state is touched: safe in a worker thread), and when
    the compile started and ended (``time.perf_counter``)."""
    t0 = time.perf_counter()
    return pending.lowered.compile(compiler_options=pending.options), t0, time.perf_counter()


def _union(spans: list) -> float:
    """Seconds covered by the ``(start, end)`` spans (overlapping compiles counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def _finish(pending: _Pending, compiled=None, seconds: float = 0.0):
    global _COMPILES, _COMPILE_SECONDS
    if pending.compiled is None:
        _COMPILES += 1
        _COMPILE_SECONDS += seconds
        pending.compiled = compiled
    if pending.key is not None:
        _keep(pending.kept, pending.key, (pending.compiled, pending.missing_flops),
              _KEEP_FIGURES if pending.kept is _FIGURES else _KEEP)
    return pending.compiled, pending.missing_flops


def compile_counted(loss_fn, optimizer, params, batch, mesh, plan, *, figures_only: bool | str = False, **options):
    """``(compiled step, FLOPs XLA leaves out)``: :func:`compile_step`, and the matmul FLOPs of
    the loop iterations XLA's cost analysis does not count (``osdp_jax.xla.loop_flops``), from the
    same trace. ``figures_only``: compiled for its figures alone (:data:`FIGURES_ONLY`; ``"probe"``:
    and :data:`PROBE_ONLY_CPU`), not to be run, so not kept for :func:`make_train_step` to reuse;
    a kept runnable step is used if there is one."""
    return _compiled(_prepare(loss_fn, optimizer, params, batch, mesh, plan, figures_only, options))


def _compiled(pending: _Pending):
    """:func:`_finish` of the pending step, compiled here unless it was kept."""
    if pending.compiled is not None:
        return _finish(pending)
    compiled, start, end = _compile(pending)
    return _finish(pending, compiled, end - start)


def compile_many(steps, threads: int, early=lambda: False):
    """:func:`compile_counted` for each ``(loss_fn, optimizer, params, batch, mesh, plan,
    figures_only)`` of ``steps``, yielding ``(index, (compiled, FLOPs XLA leaves out))`` as each is
    done. Each step is traced and lowered in this thread, in order, while up to ``threads`` worker
    threads compile those already lowered (XLA compiles outside Python's lock, so tracing and
    compiling overlap). While ``early()`` is true, a step
    compiled while later ones are traced is yielded then, so that the caller may stop early
    (close the generator): steps not yet compiling are dropped, and those compiling are finished,
    counted and kept. Otherwise the figures are read after the last trace, off the tracing
    thread's critical path."""
    steps = list(steps)
    if threads <= 1 or len(steps) < 2:
        for i, step in enumerate(steps):
            yield i, compile_counted(*step[:6], figures_only=step[6])
        return
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="osdp-jax-compile")
    futures, spans, done = {}, [], set()

    def finished(future):
        done.add(future)
        i, pending = futures[future]
        compiled, start, end = future.result()
        before = _union(spans)
        spans.append((start, end))
        return i, _finish(pending, compiled, _union(spans) - before)  # wall seconds, not thread seconds

    try:
        for i, step in enumerate(steps):
            pending = _prepare(*step, {})
            if pending.compiled is not None:
                yield i, _finish(pending)
                continue
            futures[pool.submit(_compile, pending)] = i, pending
            for future in [f for f in futures if f.done() and f not in done] if early() else ():
                yield finished(future)
        for future in concurrent.futures.as_completed([f for f in futures if f not in done]):
            yield finished(future)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for future in futures:
            if future not in done and not future.cancelled() and future.exception() is None:
                finished(future)


def profile_checked(loss_fn, optimizer, params, batch, mesh, plan, fits, **options) -> StepProfile:
    """XLA's figures for the step under ``plan``, as :func:`profile_step` gives them for a step
    compiled to run, at less cost when it does not fit: traced once, compiled first as a probe is
    (:data:`PROBE_ONLY_CPU`, a quarter to a half of a full compile on XLA:CPU), and only when
    ``fits(figures)`` compiled in full (kept for :func:`make_train_step`), whose figures are
    returned. A plan the verification rejects costs one probe compile, not a full one."""
    pending = _prepare(loss_fn, optimizer, params, batch, mesh, plan, False, options)
    if pending.compiled is not None:
        return profile_compiled(*_finish(pending))
    key, kept = _kept_figures(pending.key, "probe")
    quick = profile_compiled(*_compiled(_Pending(key, _FIGURES, pending.lowered, _options("probe", mesh),
                                                 pending.missing_flops, None if kept is None else kept[0])))
    return profile_compiled(*_compiled(pending)) if fits(quick) else quick


def profile_step(loss_fn, optimizer, params, batch, mesh, plan, *, figures_only: bool | str = False,
                 **options) -> StepProfile:
    """XLA's per-device figures (:class:`osdp_jax.StepProfile`) for the step under ``plan``, its
    FLOPs with every loop iteration counted; ``figures_only``: compiled for them alone
    (:func:`compile_counted`)."""
    return profile_compiled(*compile_counted(loss_fn, optimizer, params, batch, mesh, plan,
                                             figures_only=figures_only, **options))


class BudgetExceededError(ValueError):
    """A compiled step's per-device peak is over its plan's budget (:func:`check_budget`).

    Attributes:
      peak_bytes: XLA's per-device peak of the step, in bytes.
      budget_bytes: the plan's budget, in bytes.
    """

    def __init__(self, message: str, peak_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.peak_bytes, self.budget_bytes = peak_bytes, budget_bytes


def check_budget(step, plan, *args, budget=None):
    """Compile a training step of your own on ``args`` and check XLA's per-device peak against
    ``plan.budget_bytes``.

    A plan is verified against the step :func:`osdp_jax.make_train_step` builds. A step of your own
    holds the same budget when it takes its gradients from :func:`osdp_jax.value_and_grad` and
    donates the parameters and optimizer state; one that calls ``jax.value_and_grad`` on the
    placed arrays lets XLA gather the sharded weights where it chooses, and may not. This function
    says which, by XLA's own figure, before a step runs.

    Args:
      step: a ``jax.jit``-wrapped function (anything with ``.lower(*args)``).
      plan: the :class:`osdp_jax.Plan` the arrays were placed with.
      *args: the step's arguments: arrays, or ``jax.ShapeDtypeStruct``s carrying their shardings
        (``osdp_jax.abstract_state``), so that nothing is allocated.
      budget: the per-device budget to check against, in bytes or as a string (``"4GiB"``);
        default ``plan.budget_bytes``. Pass the device's whole budget when the plan was made for
        less to leave room for what the step keeps besides (an EMA of the parameters).

    Returns:
      The compiled step: call it in place of ``step`` (it takes the same arguments), or read its
      figures with :func:`osdp_jax.profile_compiled`.

    Raises:
      BudgetExceededError: XLA's peak is over the budget; the message names both and the fix.

    Example:
      >>> compiled = osdp_jax.check_budget(my_step, plan, params, opt_state, batch)  # doctest: +SKIP
    """
    compiled = step.lower(*args).compile()
    budget = plan.budget_bytes if budget is None else parse_bytes(budget)
    peak = profile_compiled(compiled).peak_bytes
    if peak > budget:
        raise BudgetExceededError(
            f"the step's per-device peak is {format_bytes(peak)} by XLA's figure, over the budget of "
            f"{format_bytes(budget)} ({peak / budget:.2f}x). Take its gradients from "
            f"osdp_jax.value_and_grad(loss_fn, plan, mesh), which gathers the weights as the plan says, and "
            f"donate the parameters and optimizer state (jax.jit(..., donate_argnums=(0, 1))). What else the "
            f"step keeps alive (an EMA of the parameters, a second model) is not in the plan: plan with a "
            f"budget smaller by its size, and check against the whole one (budget=)", peak, budget)
    return compiled
