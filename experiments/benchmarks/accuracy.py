"""Cost-model accuracy: predicted vs XLA-measured peak, and predicted vs measured step time.

For each mini model x {DDP, FSDP, OSDP} x budgets, on this machine's 8 simulated devices, with a
hardware profile measured first (``osdp-jax profile``): plan, compile, train a few real steps.
Prints a table and writes experiments/results/accuracy.md. Memory target: within 10%; step-time
target: within 25%.

With ``--peaks-only``, the peaks alone: no profile, no timed probes, nothing trained; each plan's
XLA peak is the figure of its verification compile (what ``Plan.xla_peak_bytes`` holds).

Run: python experiments/benchmarks/accuracy.py [--steps 12] [--peaks-only] [--out experiments/results/accuracy.md]
"""
import argparse
import dataclasses
import os
import pathlib
import statistics
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import osdp_jax  # noqa: E402
from osdp_jax.cli import config, runner  # noqa: E402
from osdp_jax.core.compat import versions  # noqa: E402
from osdp_jax.hardware import profile, save  # noqa: E402

CONFIGS = ("gpt2_mini", "opt_mini", "bert_mini")
METHODS = (("DDP", ("replicate",)), ("FSDP", ("zero3",)), ("OSDP", ("replicate", "zero3")))


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
    flags = "--peaks-only" if args.peaks_only else f"--steps {args.steps}"
    command = f"python experiments/benchmarks/accuracy.py {flags}"
    what = ("Peak: predicted by the cost model vs XLA's figure of the plan's verification compile (nothing timed "
            "or trained)." if args.peaks_only else
            f"Measured hardware: {hw.flops / 1e9:.1f} GFLOP/s per device, {hw.bandwidth / 1e9:.2f} GB/s, "
            f"{hw.latency * 1e6:.0f} us per collective. Peak: predicted by the cost model vs XLA's compiled "
            "figure. Step time: predicted vs measured (median of real steps after the first).")
    lines = ["# Cost-model accuracy on this machine (8 simulated CPU devices)", "",
             f"Made by `{command}` on {versions()}. {what}", "",
             "| model | budget | method | predicted peak / XLA peak | predicted step / measured step |",
             "|---|---|---|---|---|"]
    mem_err, time_err = [], []
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
    lines += ["", f"Peak: largest error {max(mem_err):.1%}, median {statistics.median(mem_err):.1%} (target 10%)."]
    if time_err:
        lines.append(f"Step time: largest error {max(time_err):.0%}, median {statistics.median(time_err):.0%} "
                     "(target 25%).")
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
