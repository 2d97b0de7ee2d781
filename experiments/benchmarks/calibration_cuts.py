"""What probing fewer steps at the smallest batch size costs in predicted memory (compile-only).

``osdp_jax.plan`` compiles every probe kind at the largest candidate batch size and, at the
smallest, only the all-replicate, all-zero3 and per-layer steps; the other terms are carried
over (``osdp_jax._cost.at_batch``). Before, every kind was compiled at both sizes. Here, per
config, every probe kind is compiled at the smallest size (as before), and each such layout's
peak is predicted with the calibration the planner now uses and compared with XLA's figure. The
all-replicate, all-zero3 and per-layer layouts are fitted on themselves in both schemes; the
others (split, zero2, the remat policies) show the cut's error. 8 simulated CPU devices, the
configs' own batch sizes and strategies.

Writes experiments/results/calibration_cuts.md.

Run: python experiments/benchmarks/calibration_cuts.py [--configs gpt2_mini,...]
"""
import argparse
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from experiments import config, runner  # noqa: E402
from osdp_jax import planning  # noqa: E402
from osdp_jax._cost import cost_tables, optimizer_bytes  # noqa: E402
from osdp_jax._hardware import resolve_hardware  # noqa: E402
from osdp_jax._planner import _batch_bytes, _known  # noqa: E402
from osdp_jax._segments import expand  # noqa: E402
from osdp_jax._strategies import check_splits, check_strategies, data_axes  # noqa: E402

CONFIGS = ("gpt2_mini", "opt_mini", "bert_mini", "paper/gpt2_48l_1536")
MIB = 2**20


def measure(name: str) -> list[tuple]:
    s = runner.setup(config.load(f"experiments/{name}.toml"))
    p = s.cfg.plan
    sizes = sorted(p.batch_sizes)
    lo, hi = sizes[0], sizes[-1]
    params, axes = s.abstract_params(), data_axes(s.mesh, None)
    batches = {b: s.abstract_batch(b) for b in (lo, hi)}
    problem = planning.build_problem(params, s.mesh, axes, check_strategies(p.strategies), check_splits(p.splits),
                                     s.loss_fn, batches[lo])
    hw = resolve_hardware(p.hardware or None, s.mesh)
    calibrator = planning.XlaCalibrator(s.loss_fn, s.optimizer, params, s.mesh, hw.memory_bytes)
    policies = tuple(p.remat)
    every = planning.calibrate(problem, calibrator, {lo: batches[lo]}, hw, policies=policies)  # all kinds at lo
    now = planning.calibrate(problem, calibrator, batches, hw, policies=policies)  # what plan() does
    opt_bytes, other = optimizer_bytes(s.optimizer, params)
    t = cost_tables(list(problem.infos), problem.available, problem.columns, opt_bytes, other, problem.topo, hw,
                    _batch_bytes(batches[lo]), now.calibrations[lo], problem.in_loop, frozenset(problem.units),
                    0.0, problem.gather_ratio(), saving=problem.saving_bytes())
    tables = {lo: expand(problem, t, now.remat.get(lo), policies, True)}
    kinds = [kind for kind, b in every.probes if b == lo]
    rows = []
    for kind in kinds:
        known = _known(problem, {(kind, lo): every.probes[kind, lo]}, tables)
        if not known:  # a layout the search's columns cannot express
            continue
        (candidate, xla), = known
        predicted = candidate[3].base_mem + candidate[2].mem
        rows.append((name, lo, hi, kind.name, predicted, xla))
        print(f"{name} batch {lo} (probed at {lo} and {hi}): {kind.name}: predicted {predicted / MIB:.1f} MiB, "
              f"XLA {xla / MIB:.1f} MiB, {(predicted - xla) / xla:+.1%}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    rows = [r for name in args.configs.split(",") for r in measure(name)]
    lines = ["# Fewer probes at the smallest batch size", "",
             "Measured with `python experiments/benchmarks/calibration_cuts.py` (compile-only, 8 simulated CPU",
             "devices). Each probe layout compiled at the config's smallest batch size, its peak predicted",
             "with the calibration `osdp_jax.plan` uses (every probe at the largest size; at the smallest only",
             "the all-replicate, all-zero3 and per-layer steps, which are fitted on themselves) against XLA's.", "",
             "| config | batch (probed at) | layout | predicted peak | XLA peak | error |", "|---|---|---|---|---|---|"]
    for name, lo, hi, kind, predicted, xla in rows:
        lines.append(f"| {name} | {lo} ({lo}, {hi}) | {kind} | {predicted / MIB:.1f} MiB | {xla / MIB:.1f} MiB | "
                     f"{(predicted - xla) / xla:+.1%} |")
    worst = max(abs(pr - x) / x for *_, pr, x in rows)
    lines += ["", f"Largest error: {worst:.1%}."]
    out = pathlib.Path(__file__).resolve().parents[1] / "results" / "calibration_cuts.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
