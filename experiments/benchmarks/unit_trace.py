"""Tracing a step of an nnx model whose blocks are units: each block traced, or one trace shared.

A probe's or a plan's compile starts with tracing and lowering the train step, in Python, one
step at a time (the compile threads then run XLA). On a model without a layer stack that trace
runs every block's Python, and JAX differentiates every block's jaxpr. ``runtime.units.shared``
runs the calls of nnx units of one graph definition (and of a ``@osdp_jax.units.unit`` function)
as one inner ``jax.jit`` per step, so the later blocks reuse the first one's trace and its
derivatives. This measures the seconds of ``trace`` plus ``lower`` of the step on the ViT of
``experiments/benchmarks/foreign.py`` (8 blocks in a Python loop, at the foreign-model
benchmarks' size), with the sharing (*shared*) and without it (*each block*: ``shared`` replaced
by the plain call), for three layouts: every parameter replicated, every parameter ZeRO-3 gathered
once per step, and every block's parameters gathered at the block (its units). The two ways
alternate, every cache cleared before each; medians of ``--repeats`` (default 5). XLA's figures of
the compiled step are the same either way (``tests/test_unit_calls.py`` asserts it).

Then the whole cold ``osdp_jax.plan`` of the same ViT, as ``planning_time.py --foreign`` plans it
(at 40% of the way from its FSDP peak to its DDP peak, Adam, every cache cleared before each),
both ways alternating, ``--plans`` pairs (default 3): what the shared trace saves of a plan.

Writes experiments/results/unit_trace.md.

Run: python experiments/benchmarks/unit_trace.py [--repeats 5] [--plans 3]
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
import optax  # noqa: E402

import osdp_jax  # noqa: E402
from experiments.benchmarks import foreign  # noqa: E402
from osdp_jax.runtime import step, units  # noqa: E402

MODEL = "ViT, 8 blocks in a Python loop (nnx)"


def traced_seconds(loss_fn, opt, params, batch, mesh, layout) -> float:
    """Seconds to trace and lower the step under ``layout`` (nothing compiled), every cache cleared."""
    osdp_jax.planning.clear_compiled()
    jax.clear_caches()
    t0 = time.perf_counter()
    step._prepare(loss_fn, opt, params, batch, mesh, layout, "probe", {})
    return time.perf_counter() - t0


def cold_plans(params, loss_fn, batch, opt, mesh, ways: dict, pairs: int) -> list[str]:
    """Rows of the cold-plan table: ``pairs`` cold plans each way, alternating."""
    ddp, fsdp = foreign.ddp_fsdp_peaks(params, loss_fn, batch, opt, mesh)
    budget = int(fsdp + 0.4 * (ddp - fsdp))
    shared, runs = units.shared, {way: [] for way in ways}
    for _ in range(pairs):
        for way, fn in ways.items():
            osdp_jax.planning.clear_probe_cache()
            osdp_jax.planning.clear_compiled()
            jax.clear_caches()
            units.shared = fn
            try:
                t0 = time.perf_counter()
                p = osdp_jax.plan(params, mesh, budget=budget, loss_fn=loss_fn, batch=batch, optimizer=opt)
                runs[way].append((time.perf_counter() - t0, p.compiles))
            finally:
                units.shared = shared
            print(f"cold plan, {way}: {runs[way][-1][0]:.1f} s, {p.compiles} compiles", flush=True)
    ratios = [a[0] / b[0] for a, b in zip(runs["shared"], runs["each block"])]
    return [f"| {way} | {statistics.median(s for s, _ in r):.1f} s | "
            f"{'-'.join(str(c) for c in sorted({c for _, c in r}))} | {', '.join(f'{s:.1f}' for s, _ in r)} | "
            f"{', '.join(f'{x:.2f}' for x in ratios) if way == 'shared' else ''} |" for way, r in runs.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--plans", type=int, default=3, help="pairs of cold plans (0: none)")
    args = ap.parse_args()
    if args.repeats < 1 or args.plans < 0:
        ap.error(f"--repeats must be at least 1 and --plans at least 0, got {args.repeats} and {args.plans}")
    mesh, opt = jax.make_mesh((8,), ("data",)), optax.adam(1e-3)
    params, loss_fn, batch = foreign.FAMILIES[MODEL]()
    layouts = {"replicated": osdp_jax.Layout.ddp(params, mesh),
               "ZeRO-3, gathered once per step": osdp_jax.Layout.fsdp(params, mesh),
               "ZeRO-3, gathered at each block (units)": osdp_jax.Layout.fsdp(
                   params, mesh, units=osdp_jax.units.find(loss_fn, params, batch))}
    shared = units.shared
    ways = {"shared": shared, "each block": lambda key, fn: fn}
    rows = []
    for name, layout in layouts.items():
        traced_seconds(loss_fn, opt, params, batch, mesh, layout)  # the first trace of a process pays imports
        seconds = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way, fn in ways.items():
                units.shared = fn
                try:
                    seconds[way].append(traced_seconds(loss_fn, opt, params, batch, mesh, layout))
                finally:
                    units.shared = shared
        med = {way: statistics.median(s) for way, s in seconds.items()}
        ratios = [a / b for a, b in zip(seconds["shared"], seconds["each block"])]
        rows.append(f"| {name} | {med['each block']:.2f} s | {med['shared']:.2f} s | "
                    f"{statistics.median(ratios):.2f} | {', '.join(f'{r:.2f}' for r in ratios)} |")
        print(rows[-1], flush=True)
    plan_rows = cold_plans(params, loss_fn, batch, opt, mesh, ways, args.plans) if args.plans else []
    lines = ["# Tracing a step whose nnx blocks are units", "",
             f"Measured with `python experiments/benchmarks/unit_trace.py --repeats {args.repeats}`: seconds "
             f"to trace and lower the train step (nothing compiled) of the foreign-model benchmarks' {MODEL}, "
             f"Adam, one batch of 32, 8 simulated CPU devices, this machine's 2 cores. *Each block*: every "
             f"block's Python run and its jaxpr differentiated; *shared*: one trace per step for the blocks "
             f"of one graph definition (`osdp_jax.runtime.units.shared`). Medians of {args.repeats}, the two "
             f"ways alternating; the ratio is taken within each pair.", "",
             "| layout | each block | shared | shared / each block | the pairs' ratios |",
             "|---|---|---|---|---|", *rows, ""]
    if plan_rows:
        lines += ["## A cold plan", "",
                  f"`osdp_jax.plan` of the same ViT at 40% of the way from its FSDP peak to its DDP peak (XLA's, "
                  f"compiled first), every cache cleared before each, the two ways alternating, {args.plans} pairs; "
                  f"seconds of the whole plan and its XLA compiles (measured).", "",
                  "| way | plan (median) | compiles | the plans | shared / each block, per pair |",
                  "|---|---|---|---|---|", *plan_rows, ""]
    out = pathlib.Path("experiments/results/unit_trace.md")
    out.write_text("\n".join(lines))
    print(out.read_text())


if __name__ == "__main__":
    main()
