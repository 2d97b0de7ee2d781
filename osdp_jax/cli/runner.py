"""Run an experiment config: plan it, train under the plan, or compare DDP / FSDP / OSDP."""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import pathlib
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import osdp_jax
from osdp_jax import models
from osdp_jax.cli import data as data_lib
from osdp_jax.cli.config import ConfigError, ExperimentConfig, to_dict

TRAINABLE_PARAMS = 50_000_000  # models up to this size are trained for real on this machine


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a config resolves to, before any parameter is allocated."""

    cfg: ExperimentConfig
    module: object
    model_cfg: models.TransformerConfig
    objective: str
    task: object
    mesh: object
    optimizer: object
    loss_fn: object
    seq_len: int
    _abstract: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # abstract_params, once

    @property
    def budget(self) -> int:
        return osdp_jax.parse_bytes(self.cfg.plan.budget)

    def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> dict:
        return data_lib.make_batch(self.task, self.objective, step, batch_size,
                                   self.model_cfg.vocab_size, self.cfg.train.seed, rows)

    def abstract_batch(self, batch_size: int) -> dict:
        return {"inputs": jax.ShapeDtypeStruct((batch_size, self.seq_len), jnp.int32),
                "targets": jax.ShapeDtypeStruct((batch_size, self.seq_len), jnp.int32),
                "weights": jax.ShapeDtypeStruct((batch_size, self.seq_len), jnp.float32)}

    def abstract_params(self):
        """The parameters' shapes and dtypes (Flax's init traced once per setup: 0.12 s on
        gpt2-48l-1536, where a budget sweep plans dozens of times; copies by ``at_budget`` share it)."""
        if "params" not in self._abstract:
            self._abstract["params"] = models.abstract_params(self.module, self.seq_len)
        return self._abstract["params"]

    @property
    def n_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_params()))


def make_optimizer(cfg: ExperimentConfig):
    o = cfg.optim
    lr = (optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps) if o.warmup_steps
          else o.learning_rate)
    if o.warmup_steps:
        lr = optax.join_schedules([lr, optax.constant_schedule(o.learning_rate)], [o.warmup_steps])
    opt = {"adam": lambda: optax.adam(lr), "sgd": lambda: optax.sgd(lr),
           "adamw": lambda: optax.adamw(lr, weight_decay=o.weight_decay)}[o.name]()
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), opt) if o.grad_clip > 0 else opt


def make_task(cfg: ExperimentConfig, model_cfg, objective):
    d = cfg.data
    if d.task == "addition":
        if objective != "causal":
            raise ConfigError(f"config error: data.task: 'addition' needs a decoder model, not "
                              f"{cfg.model.preset!r}")
        task = data_lib.Addition(d.digits, cfg.train.seed)
        seq_len = task.seq_len - 1
    elif d.task == "chars":
        try:
            task = data_lib.Chars(d.path, d.seq_len, cfg.train.seed)
        except ValueError as e:
            raise ConfigError(f"config error: {e}") from None
        seq_len = d.seq_len
    else:
        task = data_lib.RandomTokens(model_cfg.vocab_size - (objective == "mlm"), d.seq_len, cfg.train.seed)
        seq_len = d.seq_len
    vocab = task.vocab_size + (objective == "mlm")  # BERT needs one more id for [MASK]
    if vocab > model_cfg.vocab_size:
        raise ConfigError(f"config error: data: the task needs {vocab} token ids but model "
                          f"{cfg.model.preset!r} has vocab_size {model_cfg.vocab_size}")
    if seq_len > model_cfg.max_len:
        raise ConfigError(f"config error: data.seq_len: {seq_len} tokens exceed the model's "
                          f"max_len {model_cfg.max_len}")
    return task, seq_len


def setup(cfg: ExperimentConfig) -> Setup:
    module, model_cfg, objective = models.get(cfg.model.preset)
    if cfg.model.compute_dtype:  # mixed precision: compute in it, float32 masters
        model_cfg = dataclasses.replace(model_cfg, compute_dtype=cfg.model.compute_dtype)
        module = type(module)(model_cfg)
    task, seq_len = make_task(cfg, model_cfg, objective)
    n = math.prod(cfg.mesh.shape)
    if len(jax.devices()) < n:
        raise ConfigError(f"config error: mesh.shape: {list(cfg.mesh.shape)} needs {n} devices but "
                          f"{len(jax.devices())} are available; pass --devices {n} or change mesh.shape")
    mesh = jax.make_mesh(tuple(cfg.mesh.shape), tuple(cfg.mesh.axes),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(cfg.mesh.axes),
                         devices=jax.devices()[:n])
    return Setup(cfg, module, model_cfg, objective, task, mesh, make_optimizer(cfg),
                 models.make_loss(module), seq_len)


def at_budget(s: Setup, budget) -> Setup:
    """``s`` with its plan's per-device budget replaced (``"8GB"``, or bytes)."""
    return dataclasses.replace(s, cfg=dataclasses.replace(s.cfg, plan=dataclasses.replace(s.cfg.plan,
                                                                                          budget=str(budget))))


def make_plan(s: Setup, strategies=None, splits=None, verify=True, remat=None, per_layer=None,
              tensor=None) -> osdp_jax.Plan:
    """``osdp_jax.plan`` with the config's options (``verify="full"`` for a plan trained at once);
    ``tensor``: ``plan(tensor=)`` over the config's model axis."""
    p = s.cfg.plan
    return osdp_jax.plan(
        s.abstract_params(), s.mesh, budget=p.budget, loss_fn=s.loss_fn,
        batch=s.abstract_batch(p.batch_sizes[0]), batch_sizes=p.batch_sizes, optimizer=s.optimizer,
        hardware=p.hardware or None, strategies=strategies or p.strategies, splits=splits or p.splits,
        verify=verify, measure_time=p.measure_time, remat=remat or p.remat,
        per_layer=p.per_layer if per_layer is None else per_layer,
        segment_gain=p.segment_gain,
        units=None if tuple(p.units) == ("auto",) else tuple(p.units), unit_remat=p.unit_remat,
        compute_dtype=p.compute_dtype or s.cfg.model.compute_dtype or None,
        # the config's microbatch counts for its own space; a method with its strategies fixed
        # (DDP, FSDP, ZeRO-2, OSDP as the original) runs the whole batch at once
        microbatches=p.microbatches if strategies is None else (1,), tensor=tensor, model_axis=p.model_axis,
        sequence={"off": False, "on": True, "auto": "auto"}[p.sequence] if tensor is not None else False,
        model_sizes=tuple(p.model_sizes) or None if tensor is not None else None)


def addition_accuracy(s: Setup, params) -> float:
    """Exact-match accuracy of greedy decoding on the held-out addition problems."""
    task = s.task
    problems = task.test_problems()
    seqs = task.encode(problems)
    n = task.digits
    prompt_len = 2 * n
    apply = jax.jit(lambda p, x: s.module.apply({"params": p}, x))
    tokens = np.zeros((len(seqs), task.seq_len - 1), np.int32)
    tokens[:, :prompt_len] = seqs[:, :prompt_len]
    for i in range(n + 1):
        logits = np.asarray(apply(params, tokens))
        nxt = logits[:, prompt_len - 1 + i].argmax(-1)
        if prompt_len + i < tokens.shape[1]:
            tokens[:, prompt_len + i] = nxt
        else:
            last = nxt
    pred = np.concatenate([tokens[:, prompt_len:], last[:, None]], axis=1)
    return float((pred == seqs[:, prompt_len:]).all(axis=1).mean())


def _write_json(path: pathlib.Path, obj):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: a checkpoint that passed :meth:`Checkpoints.validate`."""

    step: int
    meta: dict
    superseded: tuple[int, ...] = ()  # newer checkpoints, moved aside when resuming from an older one


def _damaged(e, out: pathlib.Path, fp) -> Exception:
    """The one-line error for a damaged checkpoint: which one, and the previous complete one."""
    from osdp_jax.cli.checkpoint import CheckpointError, Checkpoints, DamagedCheckpoint
    ckpt = Checkpoints(out / "checkpoints", read_only=True)
    try:
        for step in reversed([x for x in ckpt.steps() if x < e.step]):
            try:
                ckpt.validate(step, fp)
            except CheckpointError:
                continue
            return DamagedCheckpoint(e.path, e.step, (
                f"{e.reason}. The previous complete checkpoint is step {step}: pass --resume-from {step} "
                f"to continue from it (newer checkpoints are then moved to {out / 'superseded'}); nothing "
                f"was changed"))
    finally:
        ckpt.close()
    return DamagedCheckpoint(e.path, e.step, f"{e.reason}, and no earlier checkpoint can be read: start a "
                                             f"new run with another --out; nothing was changed")


def check_run_dir(s: Setup, out: pathlib.Path, resume: bool, resume_from: int | None = None) -> ResumePoint | None:
    """The checkpoint in ``out`` to resume from (None: start afresh), checked before anything is
    planned or written, or a ``CheckpointError``: checkpoints there but no ``resume``; ``resume``
    with nothing to resume; a checkpoint of another model; a damaged newest checkpoint (naming the
    previous complete one, which ``resume_from`` selects)."""
    from osdp_jax.cli.checkpoint import CheckpointError, Checkpoints, DamagedCheckpoint, fingerprint
    resume = resume or resume_from is not None
    directory = out / "checkpoints"
    steps, ckpt = [], None
    if directory.is_dir():
        ckpt = Checkpoints(directory, read_only=True)
        steps = ckpt.steps()
    try:
        if not steps:
            if resume:
                flag = "--resume" if resume_from is None else f"--resume-from {resume_from}"
                raise CheckpointError(f"nothing to resume: {directory} holds no complete checkpoint; drop "
                                      f"{flag} to start a new run in {out}")
            return None
        if not resume:
            raise CheckpointError(f"{out} already holds checkpoints (newest: step {steps[-1]}); pass --resume "
                                  f"to continue that run, or choose another --out")
        fp = fingerprint(s.abstract_params())
        if resume_from is not None and resume_from not in steps:
            raise CheckpointError(f"--resume-from {resume_from}: {directory} has no complete checkpoint of "
                                  f"that step (it has steps {steps})")
        step = steps[-1] if resume_from is None else resume_from
        # a step-named entry orbax does not list (a file, a folder it cannot read) newer than the
        # step to resume: a damaged checkpoint, not something to skip silently
        stray = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and int(p.name) not in steps)
        try:
            if resume_from is None and stray and stray[-1] > step:
                raise DamagedCheckpoint(directory / str(stray[-1]), stray[-1],
                                        "it is not a complete checkpoint (orbax does not list it)")
            meta = ckpt.validate(step, fp)
        except DamagedCheckpoint as e:
            raise _damaged(e, out, fp) from None
        return ResumePoint(step, meta, tuple(sorted(x for x in {*steps, *stray} if x > step)))
    finally:
        if ckpt:
            ckpt.close()


_PLAN_SECTIONS = ("model", "data", "mesh", "plan", "optim")  # what a plan depends on


_PLAN_FILE_HINT = "plan again with 'osdp-jax plan' for this config, or drop --plan-file"


def read_plan(path) -> osdp_jax.Plan:
    """The plan saved in ``path`` (the ``plan.json`` of ``osdp-jax plan`` or ``train``); a
    ``ConfigError`` when it cannot be read or is not a plan."""
    path = pathlib.Path(path)
    try:
        return osdp_jax.Plan.from_json(path.read_text())
    except OSError as e:
        raise ConfigError(f"config error: --plan-file {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError) as e:  # not JSON, another format, fields missing
        raise ConfigError(f"config error: --plan-file {path}: not an osdp-jax plan ({e}); {_PLAN_FILE_HINT}") from None


def check_plan_devices(plan: osdp_jax.Plan, path, mesh_shape: dict) -> None:
    """A ``ConfigError`` unless ``plan`` runs on the mesh ``{axis: size}``: its data-parallel axes
    are the mesh's and hold the device count it was made for."""
    if any(a not in mesh_shape for a in plan.axes) or math.prod(mesh_shape[a] for a in plan.axes) != plan.num_devices:
        raise ConfigError(f"config error: --plan-file {path}: made for {plan.num_devices} devices on axes "
                          f"{list(plan.axes)}, but this config's mesh is {mesh_shape}; {_PLAN_FILE_HINT}")


def load_plan(s: Setup, path) -> osdp_jax.Plan:
    """The plan saved in ``path`` (:func:`read_plan`), checked against this config's mesh
    (:func:`check_plan_devices`) and parameters (every path and shape), so that training under it
    plans nothing; a ``ConfigError`` naming what differs otherwise. Nothing is allocated."""
    plan = read_plan(path)
    check_plan_devices(plan, path, dict(s.mesh.shape))
    try:
        plan.check_matches(osdp_jax.describe(s.abstract_params()))
    except ValueError as e:
        raise ConfigError(f"config error: --plan-file {path}: not made for this model: {e}; "
                          f"{_PLAN_FILE_HINT}") from None
    return plan


def reusable_plan(s: Setup, point: ResumePoint | None) -> osdp_jax.Plan | None:
    """The plan a checkpoint was trained under, when the config is the same in every section a plan
    depends on (the device count comes with ``mesh``): resuming under it replays the same compiled
    step, so the run is bit-identical to an uninterrupted one, and nothing is planned again."""
    if point is None or "plan" not in point.meta or "config" not in point.meta:
        return None

    def plan_inputs(cfg: dict) -> dict:  # where compiles and probe figures are kept does not change the plan
        return {k: {f: v for f, v in cfg.get(k, {}).items() if f not in ("compilation_cache", "probe_store")}
                for k in _PLAN_SECTIONS}

    if plan_inputs(to_dict(s.cfg)) != plan_inputs(point.meta["config"]):
        return None
    try:
        return osdp_jax.Plan.from_json(json.dumps(point.meta["plan"]))
    except (ValueError, KeyError, TypeError):
        return None


def _read_metrics(path: pathlib.Path, before: int) -> list[dict]:
    """The logged steps before ``before``; a line cut short by a kill ends the log."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            if row["step"] < before:
                rows.append(row)
        except (ValueError, KeyError, TypeError):
            break
    return rows


def _params_finite(params) -> bool:
    return bool(jax.jit(lambda t: jnp.all(jnp.array([jnp.isfinite(x).all() for x in jax.tree.leaves(t)])))(params))


def train(s: Setup, out: pathlib.Path, plan: osdp_jax.Plan | None = None, progress=True,
          write=True, resume: bool = False, init_params: pathlib.Path | None = None,
          on_step=None, resume_from: int | None = None, preemption=None,
          point: ResumePoint | None = None) -> dict:
    """Plan (unless given), train ``train.steps`` steps, and write plan/metrics/summary to ``out``.

    With ``write``, checkpoints go to ``out/checkpoints`` every ``train.checkpoint_every`` steps
    and at the end. ``resume`` continues from the newest complete checkpoint (``resume_from``:
    from that step; newer checkpoints are moved to ``out/superseded``), on any mesh or plan;
    without it, a directory that already holds checkpoints is refused, so nothing is
    overwritten. The checkpoint is restored before any file is written. ``init_params``: start
    from an exported ``.npz`` instead of a random init. ``on_step(step)`` is called after each
    completed step (tests use it to kill a run). ``preemption``: a
    :class:`~osdp_jax.cli.preemption.Preemption`; when it has caught a signal, the run writes a
    checkpoint after the current step and raises ``Preempted``. ``point``: the resume point
    :func:`check_run_dir` already found for ``out`` (it is not checked again).
    """
    from osdp_jax.cli.checkpoint import Checkpoints
    if point is None and write:
        point = check_run_dir(s, out, resume, resume_from)
    plan = plan or reusable_plan(s, point) or make_plan(s, verify="full")
    _same_on_every_process(plan)
    run = _Run(s, out, plan, write=write, lead=jax.process_index() == 0, progress=progress)
    start, resumed = run.restore_or_init(point, init_params)
    if write and run.lead:
        _write_run_files(s, out, plan, point, progress)
    if point is not None and progress and run.lead:
        print(f"resuming from {out / 'checkpoints' / str(point.step)} (step {start})", flush=True)
    run.ckpt = Checkpoints(out / "checkpoints", keep=s.cfg.train.keep_checkpoints) if write else None
    try:
        xla = run.steps(start, on_step, preemption)
        run.save(s.cfg.train.steps)
        saved = run.ckpt.steps() if run.ckpt else []
    finally:
        if run.ckpt:
            run.ckpt.close()
    summary = run.summary(xla, start if resumed else None, saved)
    if write and run.lead:
        _write_json(out / "summary.json", summary)
    return summary


def _write_run_files(s: Setup, out: pathlib.Path, plan: osdp_jax.Plan, point: ResumePoint | None, progress) -> None:
    """The run directory's plan and config, with the checkpoints after the resume point moved aside."""
    out.mkdir(parents=True, exist_ok=True)
    if point is not None and point.superseded:
        aside = out / "superseded"
        aside.mkdir(exist_ok=True)
        for st in point.superseded:
            (out / "checkpoints" / str(st)).rename(aside / f"{st}-{time.strftime('%Y%m%d-%H%M%S')}")
        if progress:
            print(f"moved the checkpoints after step {point.step} ({list(point.superseded)}) to {aside}", flush=True)
    _write_json(out / "plan.json", json.loads(plan.to_json()))
    _write_json(out / "config.json", to_dict(s.cfg))


class _Run:
    """One training run's state: the sharded parameters and optimizer state, its checkpoints, and
    the losses and step times measured."""

    def __init__(self, s: Setup, out: pathlib.Path, plan: osdp_jax.Plan, *, write: bool, lead: bool, progress):
        self.s, self.out, self.plan = s, out, plan
        self.write, self.lead, self.progress = write, lead, progress  # with several processes, one writes
        self.abstract = s.abstract_params()
        self.step_fn = osdp_jax.make_train_step(s.loss_fn, s.optimizer, plan, s.mesh)
        self.ckpt = None
        self.params = self.opt_state = None
        self.losses: list[float] = []
        self.times: list[float] = []

    def restore_or_init(self, point: ResumePoint | None, init_params) -> tuple[int, bool]:
        """The state at ``point`` (resharded onto this run's mesh and plan; nothing is written
        before), or a fresh one; returns the first step and whether it was restored."""
        from osdp_jax.cli.checkpoint import Checkpoints, DamagedCheckpoint, fingerprint, import_params
        s = self.s
        if point is None:
            host = (import_params(init_params, self.abstract) if init_params
                    else models.init_params(s.module, s.seq_len, s.cfg.train.seed))
            self.params = osdp_jax.shard(host, s.mesh, self.plan)
            self.opt_state = osdp_jax.init_opt_state(s.optimizer, self.params, self.plan, s.mesh)
            return 0, False
        p_target, o_target = osdp_jax.abstract_state(self.abstract, self.plan, s.mesh, s.optimizer)
        reader = Checkpoints(self.out / "checkpoints", read_only=True)
        try:
            self.params, self.opt_state, meta = reader.restore(point.step, p_target, o_target,
                                                               fingerprint(self.abstract))
        except DamagedCheckpoint as e:
            raise _damaged(e, self.out, fingerprint(self.abstract)) from None
        finally:
            reader.close()
        return meta["step"], True

    def diverged(self, what: str) -> FloatingPointError:
        last = self.ckpt.latest() if self.ckpt else None
        kept = (f"the last good checkpoint, step {last}, is kept in {self.ckpt.directory}" if last is not None
                else "no checkpoint was written")
        return FloatingPointError(f"training diverged: {what}; {kept}. Lower optim.learning_rate or "
                                  f"set optim.grad_clip, then --resume")

    def save(self, step: int) -> None:
        """A checkpoint at ``step`` (none without checkpoints, or when one is there already)."""
        from osdp_jax.cli.checkpoint import fingerprint
        if self.ckpt is None or step in self.ckpt.steps():
            return
        if not _params_finite(self.params):
            raise self.diverged(f"parameters became non-finite by step {step} (not saved)")
        cfg = self.s.cfg
        self.ckpt.save(step, self.params, self.opt_state, {
            "model": cfg.model.preset, "fingerprint": fingerprint(self.abstract),
            "plan": json.loads(self.plan.to_json()), "config": to_dict(cfg),
            "data": {"task": cfg.data.task, "seed": cfg.train.seed, "next_step": step},
            "rng": {"seed": cfg.train.seed}})

    def steps(self, start: int, on_step, preemption):
        """Steps ``start`` to ``train.steps`` under one compiled executable; returns its XLA figures."""
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
        cfg = self.s.cfg
        batch_of = _batches(self.s, self.plan, self.plan.batch_size)
        # compile once, read XLA's per-device figures, and train with that executable
        compiled = self.step_fn.lower(self.params, self.opt_state, batch_of(0)).compile()
        xla = osdp_jax.profile_compiled(compiled)
        metrics = self._open_metrics(start)
        bar = tqdm(range(start, cfg.train.steps), desc="train", disable=not (self.progress and self.lead),
                   mininterval=0.5, initial=start, total=cfg.train.steps)
        if preemption is not None:
            preemption.deferred = True  # a signal from here on stops after the current step
        # log records (orbax's, the planner's) written above the bar while it runs, not into it
        with logging_redirect_tqdm():
            try:
                for step in bar:
                    self._step(compiled, batch_of(step), step, metrics, bar)
                    if on_step:
                        on_step(step)
                    self._stop_if_preempted(preemption, step, bar)
            finally:
                if metrics:
                    metrics.close()
        return xla

    def _open_metrics(self, start: int):
        """``metrics.jsonl``, holding the records of the steps before ``start`` (a killed run may
        have logged steps past its checkpoint); None where this process writes no files."""
        old = _read_metrics(self.out / "metrics.jsonl", start) if self.write and self.lead and start else []
        self.losses = [r["loss"] for r in old]
        if not (self.write and self.lead):
            return None
        metrics = (self.out / "metrics.jsonl").open("w")
        metrics.writelines(json.dumps(r) + "\n" for r in old)
        return metrics

    def _step(self, compiled, batch, step: int, metrics, bar) -> None:
        cfg, b = self.s.cfg, self.plan.batch_size
        t0 = time.perf_counter()
        self.params, self.opt_state, loss = compiled(self.params, self.opt_state, batch)
        loss = float(loss)
        dt = time.perf_counter() - t0
        if not math.isfinite(loss):
            raise self.diverged(f"loss became {loss} at step {step}")
        self.losses.append(loss)
        self.times.append(dt)
        if metrics:
            metrics.write(json.dumps({"step": step, "loss": loss, "seconds": dt, "samples_per_second": b / dt}) + "\n")
            metrics.flush()
        every = cfg.train.checkpoint_every
        if every and (step + 1) % every == 0:
            self.save(step + 1)
        if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{b / dt:.0f}")

    def _stop_if_preempted(self, preemption, step: int, bar) -> None:
        from osdp_jax.cli.preemption import Preempted
        signum = preemption.agreed() if preemption is not None else None
        if signum and step + 1 < self.s.cfg.train.steps:
            self.save(step + 1)
            bar.close()
            raise Preempted(signum, step + 1 if self.ckpt else None)

    def summary(self, xla, resumed_from: int | None, saved: list) -> dict:
        """The run's summary: losses, median samples/s after the first step, XLA's and the plan's figures."""
        cfg, plan, losses = self.s.cfg, self.plan, self.losses
        steady = self.times[1:] or self.times
        summary = {
            "model": cfg.model.preset, "task": cfg.data.task, "steps": len(losses),
            "initial_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
            "samples_per_second": plan.batch_size / statistics.median(steady) if steady else None,
            "xla_peak_bytes": xla.peak_bytes, "budget_bytes": plan.budget_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_samples_per_second": plan.predicted_samples_per_second,
            "batch_size": plan.batch_size, "strategies": plan.counts(), "splits": plan.splits_by_path,
            "devices": plan.num_devices, "resumed_from_step": resumed_from, "checkpoints": saved,
            "processes": jax.process_count(),
        }
        if cfg.data.task == "addition":
            params = self.params
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils
                params = multihost_utils.process_allgather(params, tiled=True)
            summary["accuracy"] = addition_accuracy(self.s, params)
        return summary


class Method(NamedTuple):
    """One method ``compare`` and the budget sweep plan: its name and ``make_plan``'s arguments."""

    name: str
    strategies: tuple | None
    splits: tuple | None
    remat: tuple | None
    per_layer: bool | None
    tensor: dict | None = None

    def plan(self, s: "Setup", verify) -> osdp_jax.Plan:
        return make_plan(s, strategies=self.strategies, splits=self.splits, remat=self.remat,
                         per_layer=self.per_layer, verify=verify, tensor=self.tensor)


def methods(s: Setup) -> list[Method]:
    """``(name, strategies, splits, remat, per_layer)`` of the methods compared: the baselines do
    not split operators, rematerialise every layer (as FSDP with activation checkpointing does)
    and treat a layer stack as one; OSDP takes the config's strategies, split counts, remat
    policies and per-layer setting (None). When the config's strategies include zero2, a ZeRO-2
    baseline is added, OSDP keeps the original's space (the strategies without zero2) and OSDP+
    takes them all. With ``plan.tensor = "on"``, OSDP+TP is OSDP with the model's column/row pairs
    split over the model axis (``plan(tensor={})``), the other methods taking every mesh axis as
    data-parallel."""
    found = [Method(*row) for row in _data_parallel_methods(s)]
    if s.cfg.plan.tensor == "on":
        found.append(Method("OSDP+TP", None, None, None, None, {}))
    return found


def _data_parallel_methods(s: Setup) -> list[tuple]:
    base = dict(splits=(1,), remat=("full",), per_layer=False)
    found = [("DDP", ("replicate",), base), ("FSDP", ("zero3",), base)]
    if len(s.cfg.mesh.axes) > 1:  # group sharding: shard inside a node, replicate across nodes
        found.append(("HSDP", ("hsdp",), base))
    rows = [(name, strategies, kw["splits"], kw["remat"], kw["per_layer"]) for name, strategies, kw in found]
    allowed = tuple(s.cfg.plan.strategies)
    if "zero2" not in allowed:
        return rows + [("OSDP", None, None, None, None)]
    # a config that allows zero2 also compares ZeRO-2 alone, and OSDP in the original's space
    # (without zero2) beside OSDP+ (with it)
    return rows + [("ZeRO-2", ("zero2",), base["splits"], base["remat"], base["per_layer"]),
                   ("OSDP", tuple(x for x in allowed if x != "zero2") or ("replicate",), None, None, None),
                   ("OSDP+", None, None, None, None)]


def compare(s: Setup, out: pathlib.Path, measure_steps: int = 8, progress=True) -> list[dict]:
    """DDP, FSDP and OSDP under one budget, each at its own best batch size."""
    rows = []
    trainable = s.n_params <= TRAINABLE_PARAMS
    for method in methods(s):
        row = {"method": method.name, "strategies": list(method.strategies or s.cfg.plan.strategies)}
        try:
            # a plan that will not be trained here is compiled for XLA's figures only
            plan = method.plan(s, verify="full" if trainable and measure_steps > 0 else "figures")
        except osdp_jax.InfeasibleBudgetError as e:
            row.update(fits=False, min_bytes=e.min_bytes)
            rows.append(row)
            continue
        row.update(fits=True, batch_size=plan.batch_size, predicted_peak_bytes=plan.predicted_peak_bytes,
                   xla_peak_bytes=plan.xla_peak_bytes,
                   predicted_samples_per_second=plan.predicted_samples_per_second,
                   counts=plan.counts(), splits=plan.splits_by_path, segments=segments_text(plan),
                   microbatches=plan.microbatches,
                   predicted_step_seconds=plan.predicted_step_seconds,
                   predicted_collective_seconds=plan.predicted_collective_seconds,
                   tensor=len(plan.tensor), model_axis=plan.model_axis, sequence=plan.sequence,
                   mesh_shape=dict(plan.mesh_shape))
        if trainable and measure_steps > 0:
            sub = dataclasses.replace(s, cfg=dataclasses.replace(
                s.cfg, train=dataclasses.replace(s.cfg.train, steps=measure_steps)), mesh=_plan_mesh(s.mesh, plan))
            result = train(sub, out, plan=plan, progress=progress, write=False)
            row["measured_samples_per_second"] = result["samples_per_second"]
        rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "comparison.json", {"model": s.cfg.model.preset, "budget_bytes": s.budget,
                                          "devices": math.prod(s.cfg.mesh.shape),
                                          "hardware": s.cfg.plan.hardware or "default",
                                          "rows": rows})
    (out / "comparison.md").write_text(comparison_markdown(s, rows))
    plot_comparison(s, rows, out / "comparison.png")
    return rows


def _plan_mesh(mesh, plan: osdp_jax.Plan):
    """``mesh``, or where the plan was made for another shape of its devices (``plan.model_sizes``),
    that shape over the same devices and axis types (``Plan.make_mesh``)."""
    if not plan.mesh_shape or dict(plan.mesh_shape) == dict(mesh.shape):
        return mesh
    return plan.make_mesh(devices=list(mesh.devices.flat), axis_types=mesh.axis_types)


def segments_text(plan: osdp_jax.Plan) -> str:
    """The layer stack's segments in one line: per segment, its layers, how many of the stack's
    parameters take each strategy there (R replicate, Z zero3, H hsdp, Z2 zero2; k when split) and the
    remat policy, e.g. ``"0-19: 12R 5Z dots; 20-47: 17Z full"``; ``"-"`` without a stack."""
    segs = list(plan.segments.values())
    if not segs:
        return "-"
    parts = []
    for j, (a, b, *_rest) in enumerate(segs[0]):
        kinds = collections.Counter({"zero2": "Z2"}.get(st, st[0].upper()) + (f"k{k}" if k > 1 else "")
                                    for st, k in ((v[j][2], v[j][3]) for v in segs))
        mix = " ".join(f"{n}{kind}" for kind, n in sorted(kinds.items()))
        parts.append(f"{a}-{b - 1}: {mix} {segs[0][j][4]}")
    return "; ".join(parts)


def comparison_markdown(s: Setup, rows) -> str:
    f = osdp_jax.format_bytes
    lines = [f"# {s.cfg.model.preset}: {' vs '.join(r['method'] for r in rows)} at {f(s.budget)} per device",
             "", f"{math.prod(s.cfg.mesh.shape)} devices, hardware profile "
             f"{s.cfg.plan.hardware or 'default for the mesh'}, batch sizes {list(s.cfg.plan.batch_sizes)}. "
             "Predicted figures come from the cost model; XLA peak is measured by compiling the step; "
             "measured samples/s is a median over real steps on this machine.", "",
             "| method | fits | batch | strategies | split kernels | layer segments | predicted peak | XLA peak "
             "| predicted samples/s | measured samples/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['method']} | no (needs {f(r['min_bytes'])}) | - | - | - | - | - | - | - | - |")
            continue
        meas = r.get("measured_samples_per_second")
        splits = ", ".join(f"{p.removesuffix('/kernel')} k={k}" for p, k in r.get("splits", {}).items()) or "-"
        batch = f"{r['batch_size']}" + (f" ({r['microbatches']} microbatches)" if r.get("microbatches", 1) > 1 else "")
        mesh = r.get("mesh_shape") or {}
        counts = f"{r['counts']}" + (f", {r['tensor']} split over {r['model_axis']!r} (mesh "
                                     f"{' x '.join(f'{a} {n}' for a, n in mesh.items())})" if r.get("tensor") else "")
        lines.append(f"| {r['method']} | yes | {batch} | {counts} | {splits} | {r.get('segments', '-')} "
                     f"| {f(r['predicted_peak_bytes'])} "
                     f"| {f(r['xla_peak_bytes'])} | {r['predicted_samples_per_second']:.1f} "
                     f"| {f'{meas:.1f}' if meas else 'not measured'} |")
    return "\n".join(lines) + "\n"


def plot_comparison(s: Setup, rows, path: pathlib.Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if not r["fits"]:
            continue
        x = r["xla_peak_bytes"] / 2**20
        ax.scatter(x, r["predicted_samples_per_second"], marker="o", label=f"{r['method']} predicted")
        if r.get("measured_samples_per_second"):
            ax.scatter(x, r["measured_samples_per_second"], marker="x", label=f"{r['method']} measured")
        ax.annotate(r["method"], (x, r["predicted_samples_per_second"]))
    ax.axvline(s.budget / 2**20, color="gray", linestyle="--", label="budget")
    ax.set_xlabel("per-device peak memory, XLA (MiB)")
    ax.set_ylabel("samples / s")
    ax.set_title(f"{s.cfg.model.preset}, {math.prod(s.cfg.mesh.shape)} devices")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _same_on_every_process(plan: osdp_jax.Plan) -> None:
    """Every process plans on its own; check that they agree (identical XLA figures)."""
    if jax.process_count() == 1:
        return
    import hashlib

    from jax.experimental import multihost_utils
    timings = ("search_seconds", "planning_seconds", "compile_seconds")  # differ between processes
    decisions = {k: v for k, v in json.loads(plan.to_json()).items() if k not in timings}
    digest = np.frombuffer(hashlib.sha256(json.dumps(decisions, sort_keys=True).encode()).digest(),
                           dtype=np.uint32)
    multihost_utils.assert_equal(digest, "the processes made different plans")


def _batches(s: Setup, plan, b: int):
    """``step -> batch`` for the step. With several processes, each builds only the rows its
    own devices hold and places them (``jax.make_array_from_process_local_data``)."""
    if jax.process_count() == 1:
        return lambda step: s.batch(step, b)
    sharding = osdp_jax.batch_sharding(s.mesh, plan)
    spans = sorted({idx[0].indices(b)[:2] for idx in sharding.addressable_devices_indices_map((b,)).values()})
    rows = slice(spans[0][0], spans[-1][1])
    if sum(hi - lo for lo, hi in spans) != rows.stop - rows.start:
        raise ValueError(f"process {jax.process_index()}'s devices hold rows {spans} of the batch, not one "
                         f"contiguous block; order the mesh's devices by process")

    def batch_of(step):
        local = s.batch(step, b, rows)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x, (b, *x.shape[1:])),
                            local)
    return batch_of
