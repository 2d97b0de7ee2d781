"""Run an experiment config: plan it, train under the plan, or compare DDP / FSDP / OSDP."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import models
import osdp_jax

from . import data as data_lib
from .config import ConfigError, ExperimentConfig, to_dict

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

    @property
    def budget(self) -> int:
        return osdp_jax.parse_bytes(self.cfg.plan.budget)

    def batch(self, step: int, batch_size: int) -> dict:
        return data_lib.make_batch(self.task, self.objective, step, batch_size,
                                   self.model_cfg.vocab_size, self.cfg.train.seed)

    def abstract_batch(self, batch_size: int) -> dict:
        return {"inputs": jax.ShapeDtypeStruct((batch_size, self.seq_len), jnp.int32),
                "targets": jax.ShapeDtypeStruct((batch_size, self.seq_len), jnp.int32),
                "weights": jax.ShapeDtypeStruct((batch_size, self.seq_len), jnp.float32)}

    def abstract_params(self):
        return models.abstract_params(self.module, self.seq_len)

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


def make_plan(s: Setup, strategies=None, splits=None, verify=True) -> osdp_jax.Plan:
    p = s.cfg.plan
    return osdp_jax.plan(
        s.abstract_params(), s.mesh, budget=p.budget, loss_fn=s.loss_fn,
        batch=s.abstract_batch(p.batch_sizes[0]), batch_sizes=p.batch_sizes, optimizer=s.optimizer,
        hardware=p.hardware or None, strategies=strategies or p.strategies, splits=splits or p.splits,
        verify=verify)


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


def train(s: Setup, out: pathlib.Path, plan: osdp_jax.Plan | None = None, progress=True,
          write=True) -> dict:
    """Plan (unless given), train ``train.steps`` steps, and write plan/metrics/summary to ``out``."""
    from tqdm.auto import tqdm
    cfg = s.cfg
    plan = plan or make_plan(s)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(plan.to_json())
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    params = osdp_jax.shard(models.init_params(s.module, s.seq_len, cfg.train.seed), s.mesh, plan)
    opt_state = osdp_jax.init_opt_state(s.optimizer, params, plan, s.mesh)
    step_fn = osdp_jax.make_train_step(s.loss_fn, s.optimizer, plan, s.mesh)
    b = plan.batch_size
    # compile once, read XLA's per-device figures, and train with that executable
    compiled = step_fn.lower(params, opt_state, s.batch(0, b)).compile()
    xla = osdp_jax.profile_compiled(compiled)
    losses, times = [], []
    metrics = (out / "metrics.jsonl").open("w") if write else None
    bar = tqdm(range(cfg.train.steps), desc="train", disable=not progress, mininterval=0.5)
    try:
        for step in bar:
            batch = s.batch(step, b)
            t0 = time.perf_counter()
            params, opt_state, loss = compiled(params, opt_state, batch)
            loss = float(loss)
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {step}; lower optim.learning_rate "
                                         f"or set optim.grad_clip")
            losses.append(loss)
            times.append(dt)
            if metrics:
                metrics.write(json.dumps({"step": step, "loss": loss, "seconds": dt,
                                          "samples_per_second": b / dt}) + "\n")
            if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
                bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{b / dt:.0f}")
    finally:
        if metrics:
            metrics.close()
    steady = times[1:] or times
    summary = {
        "model": cfg.model.preset, "task": cfg.data.task, "steps": len(losses),
        "initial_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "samples_per_second": b / statistics.median(steady) if steady else None,
        "xla_peak_bytes": xla.peak_bytes, "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_samples_per_second": plan.predicted_samples_per_second,
        "batch_size": b, "strategies": plan.counts(), "devices": plan.num_devices,
    }
    if cfg.data.task == "addition":
        summary["accuracy"] = addition_accuracy(s, params)
    if write:
        _write_json(out / "summary.json", summary)
    return summary


def compare(s: Setup, out: pathlib.Path, measure_steps: int = 8, progress=True) -> list[dict]:
    """DDP, FSDP and OSDP under one budget, each at its own best batch size."""
    rows = []
    trainable = s.n_params <= TRAINABLE_PARAMS
    # the baselines do not split operators; OSDP takes the config's split counts
    for name, strategies, splits in (("DDP", ("replicate",), (1,)), ("FSDP", ("zero3",), (1,)),
                                     ("OSDP", ("replicate", "zero3"), None)):
        row = {"method": name, "strategies": list(strategies)}
        try:
            plan = make_plan(s, strategies=strategies, splits=splits)
        except osdp_jax.InfeasibleBudgetError as e:
            row.update(fits=False, min_bytes=e.min_bytes)
            rows.append(row)
            continue
        row.update(fits=True, batch_size=plan.batch_size, predicted_peak_bytes=plan.predicted_peak_bytes,
                   xla_peak_bytes=plan.xla_peak_bytes,
                   predicted_samples_per_second=plan.predicted_samples_per_second,
                   counts=plan.counts(), splits=plan.splits_by_path)
        if trainable and measure_steps > 0:
            sub = dataclasses.replace(s, cfg=dataclasses.replace(
                s.cfg, train=dataclasses.replace(s.cfg.train, steps=measure_steps)))
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


def comparison_markdown(s: Setup, rows) -> str:
    f = osdp_jax.format_bytes
    lines = [f"# {s.cfg.model.preset}: DDP vs FSDP vs OSDP at {f(s.budget)} per device",
             "", f"{math.prod(s.cfg.mesh.shape)} devices, hardware profile "
             f"{s.cfg.plan.hardware or 'default for the mesh'}, batch sizes {list(s.cfg.plan.batch_sizes)}. "
             "Predicted figures come from the cost model; XLA peak is measured by compiling the step; "
             "measured samples/s is a median over real steps on this machine.", "",
             "| method | fits | batch | strategies | split kernels | predicted peak | XLA peak | predicted samples/s | measured samples/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['method']} | no (needs {f(r['min_bytes'])}) | - | - | - | - | - | - | - |")
            continue
        meas = r.get("measured_samples_per_second")
        splits = ", ".join(f"{p.rsplit('/', 1)[0]} k={k}" for p, k in r.get("splits", {}).items()) or "-"
        lines.append(f"| {r['method']} | yes | {r['batch_size']} | {r['counts']} | {splits} | {f(r['predicted_peak_bytes'])} "
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
