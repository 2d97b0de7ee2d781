"""Probes at one batch size or two: the prediction error of each, on the plans of a budget sweep.

``plan()`` compiles every probe kind at the largest candidate batch size and, at the smallest,
only the all-replicated step; ``probe_every_size=True`` compiles every kind at both (5-6 more
compiles). For each config, six budgets from just above the least memory any plan needs to the
all-replicated peak at the largest size, so the plans chosen fall at small, middle and large
batch sizes: each plan as predicted (``verify=False``), then compiled for XLA's figures. Reports
predicted / XLA peak per plan, for both, and the probes' compiles and seconds. On this machine's 8
simulated devices, JAX's persistent compilation cache off. Writes
experiments/results/probe_sizes.md.

Run: python experiments/benchmarks/probe_sizes.py [--configs gpt2_mini,...]
"""
import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import osdp_jax  # noqa: E402
from experiments import config, runner  # noqa: E402
from osdp_jax.planning import clear_compiled, clear_probe_cache  # noqa: E402
from osdp_jax.runtime.step import compile_count, profile_step  # noqa: E402

CONFIGS = ("gpt2_mini", "opt_mini", "bert_mini", "paper/gpt2_48l_1536")
BUDGETS = 6


def _with(s, every: bool, budget: int):
    plan_cfg = dataclasses.replace(s.cfg.plan, probe_every_size=every, budget=str(int(budget)))
    return dataclasses.replace(s, cfg=dataclasses.replace(s.cfg, plan=plan_cfg))


def _budgets(s) -> list[int]:
    """From 2% over the least memory a plan needs to the all-replicated peak at the largest size."""
    try:
        runner.make_plan(_with(s, False, 1), verify=False)
        raise SystemExit("a 1-byte budget was feasible")
    except osdp_jax.InfeasibleBudgetError as e:
        least = e.min_bytes
    ddp = runner.make_plan(_with(s, False, 1 << 50), strategies=("replicate",), verify=False).predicted_peak_bytes
    return [int(b) for b in np.geomspace(1.02 * least, ddp, BUDGETS)]


def measure(s, every: bool, budgets) -> dict:
    clear_probe_cache()
    clear_compiled()
    jax.clear_caches()
    rows, probe_s, compiles = [], None, None
    for budget in budgets:
        t0, n0 = time.perf_counter(), compile_count()
        try:
            plan = runner.make_plan(_with(s, every, budget), verify=False)
        except osdp_jax.InfeasibleBudgetError as e:  # this calibration's least memory is over the budget
            plan = None
            rows.append(dict(budget=budget, batch="infeasible", ratio=e.min_bytes / budget))
        if probe_s is None:
            probe_s, compiles = time.perf_counter() - t0, compile_count() - n0
        if plan is None:
            continue
        xla = profile_step(s.loss_fn, s.optimizer, s.abstract_params(), s.abstract_batch(plan.batch_size), s.mesh,
                           plan, figures_only=True).peak_bytes
        rows.append(dict(budget=budget, batch=plan.batch_size, ratio=plan.predicted_peak_bytes / xla))
    return dict(rows=rows, seconds=probe_s, compiles=compiles)


def _cells(row) -> str:
    if row["batch"] == "infeasible":
        return f"infeasible | least predicted {row['ratio']:.3f} x budget"
    return f"{row['batch']} | {row['ratio']:.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    lines = ["# Probes at one batch size or two", "",
             "Measured with `python experiments/benchmarks/probe_sizes.py` on this 2-core machine, 8 simulated CPU",
             "devices. *one size*: every probe kind at the largest candidate batch size, only the all-replicated",
             "step at the smallest (the default); *every size*: every kind at both (`probe_every_size=True`).",
             "Each plan is predicted (`verify=False`), then compiled for XLA's figures: predicted / XLA peak.",
             "Cold plan: the first budget's `plan()` on empty caches (its compiles are the probes). The",
             "budgets are set from the one-size calibration's least memory, so the other may find the",
             "first infeasible (its least predicted memory is then given).", "",
             "| config | budget | one size: batch | one size: predicted / XLA | every size: batch | every size: predicted / XLA |",
             "|---|---|---|---|---|---|"]
    summary, errors = [], {False: [], True: []}
    for name in args.configs.split(","):
        s = runner.setup(config.load(f"experiments/{name}.toml"))
        budgets = _budgets(s)
        one, every = measure(s, False, budgets), measure(s, True, budgets)
        for a, b in zip(one["rows"], every["rows"]):
            for every_size, row in ((False, a), (True, b)):
                if row["batch"] != "infeasible":
                    errors[every_size].append(abs(row["ratio"] - 1))
            lines.append(f"| {name} | {osdp_jax.format_bytes(a['budget'])} | {_cells(a)} | {_cells(b)} |")
            print(lines[-1], flush=True)
        summary.append(f"- {name}: cold plan {one['seconds']:.1f} s, {one['compiles']} compiles (one size) against "
                       f"{every['seconds']:.1f} s, {every['compiles']} compiles (every size).")
        print(summary[-1], flush=True)
    lines += ["", *summary, ""]
    for every, label in ((False, "one size"), (True, "every size")):
        e = errors[every]
        lines.append(f"Peak error, {label}: largest {100 * max(e):.1f}%, median {100 * statistics.median(e):.1f}%.")
    out = pathlib.Path("experiments/results/probe_sizes.md")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
