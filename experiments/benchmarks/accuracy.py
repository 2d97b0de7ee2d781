"""Cost-model accuracy: predicted vs XLA-measured peak, and predicted vs measured step time.

For each mini model x {DDP, FSDP, OSDP} x budgets, on this machine's 8 simulated devices, with a
hardware profile measured first (``osdp-jax profile``): plan, compile, train a few real steps.
Then layer stacks written outside the repository's models (``tests/foreign.py``: a bias-free
SwiGLU/RMSNorm stack with grouped-query attention, a Llama-style stack with rotary embeddings, a
ViT encoder stack), each planned by ``osdp_jax.plan`` at budgets 30%, 55% and 80% of the way from
its FSDP peak to its DDP peak, compiled and run. Prints the tables and writes
experiments/results/accuracy.md. Targets: peaks within 5% of XLA's; step time within 25% at
worst and 10% at the median.

With ``--peaks-only``, the peaks alone: no profile, no timed probes, nothing trained; each plan's
XLA peak is the figure of its verification compile (what ``Plan.xla_peak_bytes`` holds).

Run: python experiments/benchmarks/accuracy.py [--steps 12] [--peaks-only] [--out experiments/results/accuracy.md]
"""
import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[2] / "tests")]

import foreign  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import osdp_jax  # noqa: E402
from osdp_jax.cli import config, runner  # noqa: E402
from osdp_jax.core.compat import versions  # noqa: E402
from osdp_jax.hardware import profile, save  # noqa: E402

CONFIGS = ("gpt2_mini", "opt_mini", "bert_mini")
METHODS = (("DDP", ("replicate",)), ("FSDP", ("zero3",)), ("OSDP", ("replicate", "zero3")))
STACKS = {
    "SwiGLU/RMSNorm, GQA (4 q / 2 kv heads), 12 layers": lambda: foreign.swiglu_lm(kv_heads=2),
    "Llama-style: GQA (8 q / 2 kv heads), rotary, SwiGLU, 8 layers": foreign.llama_lm,
    "ViT encoder, 6 layers": foreign.vit_stack,
}
SHARES = (0.3, 0.55, 0.8)  # budgets: this share of the way from the FSDP peak to the DDP peak
PEAK_TARGET, WORST_STEP_TARGET, MEDIAN_STEP_TARGET = 0.05, 0.25, 0.10


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="experiments/results/accuracy.md", help="the markdown file written")
    ap.add_argument("--peaks-only", action="store_true", help="predicted vs XLA peaks only: nothing timed or trained")
    args = ap.parse_args()
    out = pathlib.Path("experiments/results")
    mesh = jax.make_mesh((8,), ("data",))
    overrides = {"plan.batch_sizes": "64", "plan.budget": "1GB"}
    hw = None
    if not args.peaks_only:
        hw, raw = profile(mesh)
        profile_path = os.path.join(tempfile.mkdtemp(), "profile.json")
        save(hw, profile_path, raw)
        overrides.update({"plan.hardware": profile_path, "plan.measure_time": "true"})
    rows = []
    for name in CONFIGS:
        base = config.load(f"experiments/{name}.toml", overrides)
        s = runner.setup(base)
        ddp = runner.make_plan(s, strategies=("replicate",))
        fsdp = runner.make_plan(s, strategies=("zero3",))
        budgets = {"roomy": int(ddp.xla_peak_bytes * 1.05),
                   "tight": int((ddp.xla_peak_bytes + fsdp.xla_peak_bytes) / 2)}
        for label, budget in budgets.items():
            cfg = dataclasses.replace(base, plan=dataclasses.replace(base.plan, budget=str(budget)),
                                      train=dataclasses.replace(base.train, steps=args.steps))
            sb = dataclasses.replace(s, cfg=cfg)
            for method, strategies in METHODS:
                try:
                    plan = runner.make_plan(sb, strategies=strategies)
                except osdp_jax.InfeasibleBudgetError:
                    rows.append((name, label, method, None))
                    continue
                if args.peaks_only:
                    rows.append((name, label, method, dict(pred_peak=plan.predicted_peak_bytes,
                                                           xla_peak=plan.xla_peak_bytes)))
                    continue
                result = runner.train(sb, out / "_tmp", plan=plan, progress=False, write=False)
                rows.append((name, label, method, dict(
                    pred_peak=plan.predicted_peak_bytes, xla_peak=result["xla_peak_bytes"],
                    pred_step=plan.predicted_step_seconds, meas_step=plan.batch_size / result["samples_per_second"])))
    stack_rows = stack_accuracy(mesh, hw, args.steps, args.peaks_only)
    flags = "--peaks-only" if args.peaks_only else f"--steps {args.steps}"
    command = f"python experiments/benchmarks/accuracy.py {flags}"
    what = ("Peak: predicted by the cost model vs XLA's figure of the plan's verification compile (nothing timed "
            "or trained)." if args.peaks_only else
            f"Measured hardware: {hw.flops / 1e9:.1f} GFLOP/s per device, {hw.bandwidth / 1e9:.2f} GB/s, "
            f"{hw.latency * 1e6:.0f} us per collective, overlap {hw.overlap:.2f}. Peak: predicted by the cost "
            "model vs XLA's compiled figure. Step time: predicted (with timed probes, `measure_time`) vs "
            "measured (median of real steps after the first).")
    lines = ["# Cost-model accuracy on this machine (8 simulated CPU devices)", "",
             f"Made by `{command}` on {versions()}. {what}", "",
             f"Targets: predicted peak within {PEAK_TARGET:.0%} of XLA's" + ("." if args.peaks_only else
             f"; predicted step time within {WORST_STEP_TARGET:.0%} of the measured one at worst and "
             f"{MEDIAN_STEP_TARGET:.0%} at the median."), "",
             "## The repository's minis", ""]
    mem_err, time_err = [], []
    lines += _table(rows, mem_err, time_err)
    if stack_rows:
        lines += ["", "## Layer stacks written outside the repository (`tests/foreign.py`)", "",
                  "Budgets: 30%, 55% and 80% of the way from the stack's FSDP peak to its DDP peak.", ""]
        lines += _table(stack_rows, mem_err, time_err)
    lines += ["", _verdict("Peak", mem_err, PEAK_TARGET, PEAK_TARGET, ".1%")]
    if time_err:
        lines.append(_verdict("Step time", time_err, WORST_STEP_TARGET, MEDIAN_STEP_TARGET, ".0%"))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _table(rows: list, mem_err: list, time_err: list) -> list[str]:
    """The markdown table of ``rows``; each row's peak and step-time errors appended to the lists."""
    lines = ["| model | budget | method | predicted peak / XLA peak | predicted step / measured step |",
             "|---|---|---|---|---|"]
    for name, label, method, r in rows:
        if r is None:
            lines.append(f"| {name} | {label} | {method} | does not fit | - |")
            continue
        m = r["pred_peak"] / r["xla_peak"]
        mem_err.append(abs(m - 1))
        t = r["pred_step"] / r["meas_step"] if "meas_step" in r else None
        if t is not None:
            time_err.append(abs(t - 1))
        lines.append(f"| {name} | {label} | {method} | {m:.3f} | {'-' if t is None else f'{t:.2f}'} |")
    return lines


def _verdict(what: str, errors: list, worst: float, median: float, fmt: str) -> str:
    """One line: the largest and the median error against their targets, met or missed."""
    big, mid = max(errors), statistics.median(errors)
    met = "met" if big <= worst and mid <= median else "missed"
    return (f"{what}: largest error {big:{fmt}} (target {worst:.0%}), median {mid:{fmt}} (target {median:.0%}): "
            f"{met}.")


def stack_accuracy(mesh, hw, steps: int, peaks_only: bool) -> list:
    """Rows ``(model, budget, "OSDP", figures)`` for each of :data:`STACKS` at each of :data:`SHARES`."""
    opt, rows = optax.adam(1e-3), []
    for name, make in STACKS.items():
        params, loss_fn, batch = make()
        in_loop = osdp_jax.discover(loss_fn, params, batch)[0]
        ddp, fsdp = (osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, layout).peak_bytes
                     for layout in (osdp_jax.Layout.ddp(params, mesh),
                                    osdp_jax.Layout.fsdp(params, mesh, in_loop=in_loop)))
        for share in SHARES:
            timing = {} if peaks_only else {"hardware": hw, "measure_time": True}
            plan = osdp_jax.plan(params, mesh, budget=int(fsdp + share * (ddp - fsdp)), loss_fn=loss_fn,
                                 batch=batch, optimizer=opt, **timing)
            figures = dict(pred_peak=plan.predicted_peak_bytes, xla_peak=plan.xla_peak_bytes)
            if not peaks_only:
                figures.update(pred_step=plan.predicted_step_seconds,
                               meas_step=_measured_step(plan, params, loss_fn, batch, opt, mesh, steps))
            rows.append((name, f"{share:.0%}", "OSDP", figures))
            print(name, f"{share:.0%}", figures, flush=True)
    return rows


def _measured_step(plan, params, loss_fn, batch, opt, mesh, steps: int) -> float:
    """Median seconds of ``steps`` real steps of ``plan``'s train step, after the first."""
    params = osdp_jax.shard(params, mesh, plan)
    state = osdp_jax.init_opt_state(opt, params, plan, mesh)
    step = osdp_jax.make_train_step(loss_fn, opt, plan, mesh)
    seconds = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        params, state, loss = step(params, state, batch)
        jax.block_until_ready(loss)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


if __name__ == "__main__":
    main()
