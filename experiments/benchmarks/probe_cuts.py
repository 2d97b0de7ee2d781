"""What probing the remat and split terms at one batch size costs in accuracy.

``osdp_jax._calibration.calibrate`` compiles the remat and split probes (``AT_TOP``) at the largest
candidate batch size only, scales the remat terms to the smaller sizes in proportion to the batch
and keeps the split's saving per byte; the other probes run at the smallest and largest size.
This benchmark plans each config both ways: *one size* (the default) and *both ends* (``AT_TOP``
emptied: every probe kind at both sizes, the terms interpolated between them, as before the cut).
The cut shows only below the largest batch size, so each config is planned at 0.3x to 1x its budget (the smaller budgets push the batch size
down), unverified (``verify=False``: the model's own choice and prediction), and every chosen plan
is compiled for its XLA peak (as the probes are, ``figures_only="probe"``). Also counted: the probe
compiles each way needs.

Run: python experiments/benchmarks/probe_cuts.py [--configs gpt2_mini,...]
Writes experiments/results/probe_cuts.md.
"""
import argparse
import os
import pathlib
import statistics
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import osdp_jax  # noqa: E402
from experiments import config, runner  # noqa: E402
from osdp_jax import _calibration  # noqa: E402
from osdp_jax.planning import clear_probe_cache  # noqa: E402

CONFIGS = ("gpt2_mini", "opt_mini", "bert_mini", "paper/gpt2_48l_1536", "paper/opt_30b_8l")
FRACTIONS = (0.3, 0.45, 0.6, 0.8, 1.0)
WAYS = {"one size": _calibration.AT_TOP, "both ends": frozenset()}


def _plan(s, budget, way):
    _calibration.AT_TOP = WAYS[way]
    try:
        return runner.make_plan(runner.at_budget(s, budget), verify=False)
    except osdp_jax.InfeasibleBudgetError:
        return None
    finally:
        _calibration.AT_TOP = WAYS["one size"]


def measure(name: str) -> list[dict]:
    s = runner.setup(config.load(f"experiments/{name}.toml", {"plan.compilation_cache": ""}))
    budget = osdp_jax.parse_bytes(s.cfg.plan.budget)
    clear_probe_cache()
    one = _plan(s, budget, "one size").compiles  # first: its probes are a subset of the other's
    counts = {"one size": one, "both ends": one + _plan(s, budget, "both ends").compiles}
    peaks, rows = {}, []
    for f in FRACTIONS:
        row = dict(name=name, budget=int(f * budget), counts=counts, top=max(s.cfg.plan.batch_sizes))
        for way in WAYS:
            p = _plan(s, int(f * budget), way)
            if p is None:
                row[way] = None
                continue
            key = (p.batch_size, p.layout)
            if key not in peaks:
                peaks[key] = osdp_jax.profile_step(s.loss_fn, s.optimizer, s.abstract_params(),
                                                   s.abstract_batch(p.batch_size), s.mesh, p,
                                                   figures_only="probe").peak_bytes
            row[way] = dict(batch=p.batch_size, pred=p.predicted_peak_bytes, xla=peaks[key],
                            sps=p.predicted_samples_per_second, segments=runner.segments_text(p))
        rows.append(row)
        print({k: v for k, v in row.items() if k != "counts"}, flush=True)
    return rows


def _cell(r):
    if r is None:
        return "infeasible | - | - | -"
    return (f"{r['batch']} | {r['sps']:.1f} | {r['pred'] / 2**20:.2f} / {r['xla'] / 2**20:.2f} MiB | "
            f"{r['pred'] / r['xla'] - 1:+.1%}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    rows = [r for name in args.configs.split(",") for r in measure(name)]
    lines = ["# Remat and split probes at one batch size: accuracy against both ends", "",
             "Measured with `python experiments/benchmarks/probe_cuts.py` (8 simulated CPU devices). Each config is",
             "planned unverified at 0.3x-1x its budget with the remat and split probes at the largest batch",
             "size only, the remat terms scaled to smaller sizes in proportion and the split's saving per byte",
             "kept (one size, the default), and with every",
             "probe kind at both batch-size ends (both ends); each chosen plan compiled for XLA's peak. Error:",
             "predicted / XLA - 1; samples/s predicted. The cut shows only in plans below the largest batch size.",
             "", "| config | budget | probes: one size / both ends | one size: batch | samples/s | predicted / XLA "
             "| error | both ends: batch | samples/s | predicted / XLA | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['budget'] / 2**20:.1f} MiB | {r['counts']['one size']} / "
                     f"{r['counts']['both ends']} | {_cell(r['one size'])} | {_cell(r['both ends'])} |")
    for way in WAYS:
        errs = [r[way]["pred"] / r[way]["xla"] - 1 for r in rows if r[way] is not None]
        below = [r[way]["pred"] / r[way]["xla"] - 1 for r in rows if r[way] is not None and r[way]["batch"] != r["top"]]
        lines += ["", f"{way}: largest error {max(map(abs, errs)):.1%} (most under: {min(errs):+.1%}), median "
                      f"{statistics.median(map(abs, errs)):.1%} over {len(errs)} plans; below the largest batch size: "
                  + (f"largest {max(map(abs, below)):.1%} over {len(below)} plans." if below else "no plan.")]
    out = pathlib.Path("experiments/results/probe_cuts.md")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
