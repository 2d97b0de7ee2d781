"""Per-layer plans against one segment: predicted speed and compile time, at each sweep budget.

A per-layer plan runs a layer stack in segments, each its own loop, and a step's compile grows
with its loops. For the paper config (gpt2_48l_1536, compile-only) at each budget of the
README's sweep, this drafts OSDP's plan (``verify=False``: the cost model's choice, after the
probes) with ``per_layer`` on (the default) and off (every layer of the stack alike: one
segment), and compiles each draft's step as the planner verifies it (for XLA's figures, as a
probe: ``runtime.step.compile_counted(figures_only="probe")``), alone, every compiled step
forgotten before each, the median of ``--repeats`` compiles, traced and lowered each time.

What it answers: what the per-layer plans' predicted samples/s cost in compile time (a budget
sweep verifies one OSDP plan per budget; a user training compiles one). Each budget is drafted
on its own, after the probes alone: no verified plan has taught the planner anything, so a
draft can differ from the sweep's plan at that budget (the sweep plans FSDP first, whose miss at
4GB it learns from). Predicted figures are
the cost model's; compile seconds are measured on this machine, where they vary by a third
from minute to minute (compare within a row only).

Writes experiments/results/segment_compile.md.

Run: python experiments/benchmarks/segment_compile.py [--budgets 6GB,8GB] [--repeats 3]
"""
import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

import osdp_jax  # noqa: E402
from experiments import config, runner  # noqa: E402
from experiments.benchmarks.planning_time import SWEEP_BUDGETS  # noqa: E402
from osdp_jax.planning import clear_compiled, clear_probe_cache  # noqa: E402
from osdp_jax.runtime import step  # noqa: E402

CONFIG = "paper/gpt2_48l_1536"


def compile_seconds(s: runner.Setup, plan, repeats: int) -> float:
    """Median seconds to trace, lower and compile ``plan``'s step as a probe, alone."""
    seconds = []
    for _ in range(repeats):
        clear_compiled()
        jax.clear_caches()
        t0 = time.perf_counter()
        step.compile_counted(s.loss_fn, s.optimizer, s.abstract_params(), s.abstract_batch(plan.batch_size), s.mesh,
                             plan, figures_only="probe")
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default=",".join(SWEEP_BUDGETS))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    s = runner.setup(config.load(f"experiments/{CONFIG}.toml"))
    clear_probe_cache()
    rows = []
    for budget in args.budgets.split(","):
        at = runner.at_budget(s, budget)
        cells = []
        for per_layer in (True, False):
            try:
                plan = runner.make_plan(at, per_layer=per_layer, verify=False)
            except osdp_jax.InfeasibleBudgetError:
                cells.append(None)
                continue
            loops = max((len(v) for v in plan.segments.values()), default=1)
            cells.append((plan.predicted_samples_per_second, plan.batch_size, loops, runner.segments_text(plan),
                          compile_seconds(s, plan, args.repeats)))
        rows.append((budget, *cells))
        print(budget, cells, flush=True)
    lines = ["# Per-layer plans against one segment: predicted speed and compile time", "",
             f"Measured with `python experiments/benchmarks/segment_compile.py --budgets {args.budgets} --repeats "
             f"{args.repeats}` on this 2-core machine, 8 simulated CPU devices: {CONFIG}'s OSDP draft at each "
             "budget (the cost model's choice after the probes, not verified) with `per_layer` on and off; "
             "*predicted* samples/s are the cost model's; *compile* is the measured median seconds to trace, "
             "lower and compile the draft's step as the planner verifies it (for its figures, as a probe), alone.",
             "", "| budget | per layer: predicted samples/s | batch | segments | compile s | one segment: predicted "
             "samples/s | batch | compile s | per layer / one segment, predicted | compile |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for budget, per, one in rows:
        if per is None or one is None:
            lines.append(f"| {budget} | " + " | ".join("-" for _ in range(9)) + " |")
            continue
        lines.append(f"| {budget} | {per[0]:.2f} | {per[1]} | {per[2]} ({per[3]}) | {per[4]:.2f} | {one[0]:.2f} | "
                     f"{one[1]} | {one[4]:.2f} | {per[0] / one[0]:.3f} | {per[4] / one[4]:.2f} |")
    out = pathlib.Path(__file__).resolve().parents[1] / "results" / "segment_compile.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
