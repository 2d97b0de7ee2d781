"""Tensor parallelism in the planner: the plan on a weight-heavy model, and its cold planning time.

The model of ``tests/test_tensor.py::_wide`` (4 residual blocks of bias-free Dense 1024 -> 4096 ->
1024, batch 8, Adam) on a 2 (data) x 4 (model) mesh of simulated CPU devices at 100 MB per
device. For ``plan(tensor="auto")`` (the pairs split, against every axis data-parallel),
``plan(tensor="auto", model_sizes="auto")`` (also the model axis of 2 devices, a 4 x 2 mesh),
``plan(tensor={})`` (the pairs split only) and ``plan()`` (every axis data-parallel): the plan's
predicted samples/s (the default CPU hardware profile), predicted and XLA peak, and its cold
``plan()`` seconds over one compile of the chosen train step (``planning_time.py``'s measure:
every cache cleared first; the medians of ``--repeats`` runs, each ratio taken within its run).
Then ``plan(tensor="auto")`` on two models where neither configuration's time-model bound rules
the other out, so both are planned.

Writes experiments/results/tensor_planning.md. Run: python experiments/benchmarks/tensor_planning.py
"""
import argparse
import os
import pathlib
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
                                                                     seq=32)}
VARIANTS = {"tensor=\"auto\"": ("auto", None), "tensor=\"auto\", model_sizes=\"auto\"": ("auto", "auto"),
            "tensor={}": ({}, None), "no tensor": (None, None)}


def measure(variant, mesh, params, loss_fn, batch, optimizer, budget="100MB", units=()) -> dict:
    tensor, model_sizes = variant
    planning_time._cold()
    t0 = time.perf_counter()
    plan = osdp_jax.plan(params, mesh, budget=budget, loss_fn=loss_fn, batch=batch, optimizer=optimizer,
                         units=units, tensor=tensor, model_sizes=model_sizes)
    cold = time.perf_counter() - t0
    one = planning_time._one_compile(loss_fn, optimizer, params, batch, plan.make_mesh(), plan)
    return {"plan": plan, "cold": cold, "one": one, "ratio": cold / one}


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
    lines += ["", "Where the bound rules neither configuration out, `tensor=\"auto\"` plans both (drafts, then "
              "one verification): models of `tests/foreign.py` at 1 GB per device, the default unit policy, "
              "Adam, the same mesh and measures.", "",
              "| model | plan | predicted samples/s | compiles | cold plan() | one compile | cold ratio | ratios |",
              "|---|---|---|---|---|---|---|---|"]
    for name, (params, loss_fn, batch) in BOTH.items():
        runs = [measure(("auto", None), mesh, params, loss_fn, batch, optimizer, "1GB", None)
                for _ in range(args.repeats)]
        plan, ratios = runs[-1]["plan"], [r["ratio"] for r in runs]
        lines.append(f"| {name} | {'tensor-parallel' if plan.model_axis else 'every axis data-parallel'} "
                     f"| {plan.predicted_samples_per_second:.1f} | {plan.compiles} "
                     f"| {statistics.median(r['cold'] for r in runs):.1f} s "
                     f"| {statistics.median(r['one'] for r in runs):.1f} s | {statistics.median(ratios):.2f} "
                     f"| {', '.join(f'{r:.2f}' for r in ratios)} |")
    text = "\n".join(lines) + "\n"
    (ROOT / "experiments" / "results" / "tensor_planning.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
