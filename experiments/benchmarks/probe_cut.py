"""What the lean probe set costs in accuracy: plans from ``probes="lean"`` against ``probes="full"``.

``plan(probes="lean")`` (the default) compiles every probe kind at the largest batch size and only
the all-replicated step at the smallest; ``"full"`` compiles every kind at both
(``osdp_jax._calibration.calibrate``). The cut shows only where a plan runs below the largest batch
size, so for each config this plans at budgets from 0.3x to 1x its own (the smaller ones push the
batch size down), both ways, unverified (``verify=False``: the model's choice and prediction), and
compiles each chosen plan for XLA's peak (as the probes are, ``figures_only="probe"``). Also counted:
the probes each way compiles.

Run: python experiments/benchmarks/probe_cut.py [--configs gpt2_mini,...]
Writes experiments/results/probe_cut.md.
"""
import argparse
import dataclasses
import os
import pathlib
import statistics
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import osdp_jax  # noqa: E402
from experiments import config, runner  # noqa: E402
from osdp_jax.planning import clear_probe_cache  # noqa: E402

CONFIGS = ("gpt2_mini", "opt_mini", "bert_mini", "paper/gpt2_48l_1536")
FRACTIONS = (0.3, 0.45, 0.6, 0.8, 1.0)


def _plan(s, budget, probes):
    cfg = dataclasses.replace(s.cfg, plan=dataclasses.replace(s.cfg.plan, budget=str(budget), probes=probes))
    try:
        return runner.make_plan(dataclasses.replace(s, cfg=cfg), verify=False)
    except osdp_jax.InfeasibleBudgetError:
        return None


def measure(name: str) -> list[dict]:
    s = runner.setup(config.load(f"experiments/{name}.toml"))
    budget = osdp_jax.parse_bytes(s.cfg.plan.budget)
    clear_probe_cache()
    lean = _plan(s, budget, "lean").compiles  # first: its probes are a subset of full's
    counts = dict(lean=lean, full=lean + _plan(s, budget, "full").compiles)
    peaks, rows = {}, []
    for f in FRACTIONS:
        row = dict(name=name, budget=int(f * budget), fraction=f, counts=counts)
        for probes in ("full", "lean"):
            p = _plan(s, int(f * budget), probes)
            if p is None:
                row[probes] = None
                continue
            key = (p.batch_size, p.layout)
            if key not in peaks:
                peaks[key] = osdp_jax.profile_step(s.loss_fn, s.optimizer, s.abstract_params(),
                                                   s.abstract_batch(p.batch_size), s.mesh, p,
                                                   figures_only="probe").peak_bytes
            row[probes] = dict(batch=p.batch_size, pred=p.predicted_peak_bytes, xla=peaks[key],
                               sps=p.predicted_samples_per_second)
        rows.append(row)
        print(row, flush=True)
    return rows


def _cell(r):
    if r is None:
        return "infeasible | - | -"
    return f"{r['batch']} | {r['pred'] / 2**20:.2f} / {r['xla'] / 2**20:.2f} MiB | {r['pred'] / r['xla'] - 1:+.1%}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    rows = [r for name in args.configs.split(",") for r in measure(name)]
    lines = ["# Lean probes: accuracy against the full probe set", "",
             "Measured with `python experiments/benchmarks/probe_cut.py` (8 simulated CPU devices). Each config is",
             "planned unverified at 0.3x-1x its budget with every probe kind at both batch-size ends (full) and",
             "at the largest only (lean, the default); each chosen plan compiled for XLA's peak. Error:",
             "predicted / XLA - 1. The cut matters only for plans below the largest batch size.", "",
             "| config | budget | probes full / lean | full: batch | predicted / XLA | error "
             "| lean: batch | predicted / XLA | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['budget'] / 2**20:.1f} MiB | {r['counts']['full']} / {r['counts']['lean']} "
                     f"| {_cell(r['full'])} | {_cell(r['lean'])} |")
    for probes in ("full", "lean"):
        errs = [abs(r[probes]["pred"] / r[probes]["xla"] - 1) for r in rows if r[probes] is not None]
        below = [abs(r[probes]["pred"] / r[probes]["xla"] - 1) for r in rows
                 if r[probes] is not None and r[probes]["batch"] != max(runner_sizes(r["name"]))]
        lines.append("")
        lines.append(f"{probes}: largest error {max(errs):.1%}, median {statistics.median(errs):.1%} over "
                     f"{len(errs)} plans; below the largest batch size: "
                     + (f"largest {max(below):.1%} over {len(below)} plans." if below else "no plan."))
    out = pathlib.Path("experiments/results/probe_cut.md")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def runner_sizes(name: str) -> tuple[int, ...]:
    return tuple(config.load(f"experiments/{name}.toml").plan.batch_sizes)


if __name__ == "__main__":
    main()
