"""Tensor parallelism in the planner: the plan on a weight-heavy model, and its cold planning time.

The model of ``tests/test_tensor.py::_wide`` (4 residual blocks of bias-free Dense 1024 -> 4096 ->
1024, batch 8, Adam) on a 2 (data) x 4 (model) mesh of simulated CPU devices at 100 MB per
device. For ``plan(tensor="auto")`` (the pairs split, against every axis data-parallel),
``plan(tensor="auto", model_sizes="auto")`` (also the model axis of 2 devices, a 4 x 2 mesh),
``plan(tensor={})`` (the pairs split only) and ``plan()`` (every axis data-parallel): the plan's
predicted samples/s (the default CPU hardware profile), predicted and XLA peak, and its cold
``plan()`` seconds over one compile of the chosen train step (``planning_time.py``'s measure:
every cache cleared first; the medians of ``--repeats`` runs, each ratio taken within its run).
Then ``plan(tensor="auto")`` on models where the time model's bounds leave more than one
configuration to plan, with the configurations drafted or ruled out.

Writes experiments/results/tensor_planning.md. Run: python experiments/benchmarks/tensor_planning.py
"""
import argparse
import logging
import os
import pathlib
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "experiments" / "benchmarks")]

import foreign  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
import planning_time  # noqa: E402
import test_tensor  # noqa: E402

import osdp_jax  # noqa: E402

MIB = 2 ** 20
BOTH = {"uneven MLP (512, 256), d 128, batch 64": foreign.uneven_mlp(widths=(512, 256), d=128, batch=64),
        "SwiGLU stack, 4 layers, d 128, batch 16": foreign.swiglu_lm(layers=4, d=128, ffn=352, vocab=512, batch=16,
                                                                     seq=32),
        "uneven MLP (2048, 128, 4096, 256, 1024, 64), d 256, batch 16": foreign.uneven_mlp(batch=16)}
VARIANTS = {"tensor=\"auto\"": ("auto", None), "tensor=\"auto\", model_sizes=\"auto\"": ("auto", "auto"),
            "tensor={}": ({}, None), "no tensor": (None, None)}


class _Configurations(logging.Handler):
    """Collects what ``plan(tensor=...)`` logs of its configurations: each one drafted (and its
    predicted samples/s) or ruled out by its bound."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.drafted, self.ruled_out = [], []

    def emit(self, record):
        message = record.getMessage()
        if found := re.match(r"mesh (.*): predicted ([0-9.]+) samples/s before verification", message):
            self.drafted.append((found.group(1), float(found.group(2))))
        elif found := re.match(r"mesh (.*): at most ([0-9.]+) samples/s by the time model, not planned", message):
            self.ruled_out.append((found.group(1), float(found.group(2))))


def measure(variant, mesh, params, loss_fn, batch, optimizer, budget="100MB", units=()) -> dict:
    tensor, model_sizes = variant
    planning_time._cold()
    logger, seen = logging.getLogger("osdp_jax"), _Configurations()
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.INFO)
    try:
        t0 = time.perf_counter()
        plan = osdp_jax.plan(params, mesh, budget=budget, loss_fn=loss_fn, batch=batch, optimizer=optimizer,
                             units=units, tensor=tensor, model_sizes=model_sizes)
        cold = time.perf_counter() - t0
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    one = planning_time._one_compile(loss_fn, optimizer, params, batch, plan.make_mesh(), plan)
    return {"plan": plan, "cold": cold, "one": one, "ratio": cold / one, "drafted": seen.drafted,
            "ruled_out": seen.ruled_out}


def _configurations(run: dict) -> str:
    """The configurations of one run: each drafted, with its predicted samples/s, or ruled out by
    its bound."""
    drafted = [f"{name}: {speed:.1f}" for name, speed in run["drafted"]]
    ruled = [f"{name}: bound {speed:.1f}, ruled out" for name, speed in run["ruled_out"]]
    return "; ".join(drafted + ruled) or "one"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    _, params, loss_fn, batch = test_tensor._wide(8)
    optimizer = optax.adam(1e-3)
    lines = ["# Tensor parallelism in the planner", "",
             f"Measured with `python experiments/benchmarks/tensor_planning.py` (jax {jax.__version__}), 8 "
             "simulated CPU devices in a 2 (data) x 4 (model) mesh, 4 residual blocks of bias-free "
             "Dense 1024 -> 4096 -> 1024, batch 8, Adam, 100 MB per device. Samples/s are predicted "
             "(default CPU profile); peaks predicted and by XLA (measured by compiling the step); "
             f"planning seconds measured, medians of {args.repeats} cold runs.", "",
             "| plan() | mesh | predicted samples/s | predicted peak | XLA peak | cold plan() "
             "| one compile | cold ratio | ratios |", "|---|---|---|---|---|---|---|---|---|"]
    for name, variant in VARIANTS.items():
        runs = [measure(variant, mesh, params, loss_fn, batch, optimizer) for _ in range(args.repeats)]
        plan = runs[-1]["plan"]
        ratios = [r["ratio"] for r in runs]
        shape = " x ".join(f"{a} {n}" for a, n in plan.mesh_shape)
        kind = ", tensor-parallel" if plan.model_axis else ""
        lines.append(f"| `{name}` | {shape}{kind} | {plan.predicted_samples_per_second:.1f} "
                     f"| {plan.predicted_peak_bytes / MIB:.1f} MiB | {plan.xla_peak_bytes / MIB:.1f} MiB "
                     f"| {statistics.median(r['cold'] for r in runs):.1f} s "
                     f"| {statistics.median(r['one'] for r in runs):.1f} s | {statistics.median(ratios):.2f} "
                     f"| {', '.join(f'{r:.2f}' for r in ratios)} |")
    lines += ["", "`tensor=\"auto\"` where the bound does not rule the other configurations out: each "
              "configuration drafted (probes, no verification), the best verified. Models of `tests/foreign.py` "
              "at 1 GB per device, the default unit policy, Adam, the same mesh and measures; the configurations "
              "column is the last run's, each with its draft's predicted samples/s (or its bound where it was "
              "ruled out). The uneven MLP of six widths has pairs whose split pays and pairs whose split does "
              "not (`split_pays`): the configuration with only the first split is one of them.", "",
              "| model | plan | predicted samples/s | predicted peak | XLA peak | compiles | cold plan() "
              "| one compile | cold ratio | ratios | configurations |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, (params, loss_fn, batch) in BOTH.items():
        runs = [measure(("auto", None), mesh, params, loss_fn, batch, optimizer, "1GB", None)
                for _ in range(args.repeats)]
        plan, ratios = runs[-1]["plan"], [r["ratio"] for r in runs]
        kind = f"tensor-parallel, {len(plan.tensor)} parameters split" if plan.model_axis else \
            "every axis data-parallel"
        lines.append(f"| {name} | {kind} | {plan.predicted_samples_per_second:.1f} "
                     f"| {plan.predicted_peak_bytes / MIB:.2f} MiB | {plan.xla_peak_bytes / MIB:.2f} MiB "
                     f"| {plan.compiles} | {statistics.median(r['cold'] for r in runs):.1f} s "
                     f"| {statistics.median(r['one'] for r in runs):.1f} s | {statistics.median(ratios):.2f} "
                     f"| {', '.join(f'{r:.2f}' for r in ratios)} | {_configurations(runs[-1])} |")
    text = "\n".join(lines) + "\n"
    (ROOT / "experiments" / "results" / "tensor_planning.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
