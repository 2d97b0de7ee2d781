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

Writes experiments/results/unit_trace.md.

Run: python experiments/benchmarks/unit_trace.py [--repeats 5]
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
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
    lines = ["# Tracing a step whose nnx blocks are units", "",
             f"Measured with `python experiments/benchmarks/unit_trace.py --repeats {args.repeats}`: seconds "
             f"to trace and lower the train step (nothing compiled) of the foreign-model benchmarks' {MODEL}, "
             f"Adam, one batch of 32, 8 simulated CPU devices, this machine's 2 cores. *Each block*: every "
             f"block's Python run and its jaxpr differentiated; *shared*: one trace per step for the blocks "
             f"of one graph definition (`osdp_jax.runtime.units.shared`). Medians of {args.repeats}, the two "
             f"ways alternating; the ratio is taken within each pair.", "",
             "| layout | each block | shared | shared / each block | the pairs' ratios |",
             "|---|---|---|---|---|", *rows, ""]
    out = pathlib.Path("experiments/results/unit_trace.md")
    out.write_text("\n".join(lines))
    print(out.read_text())


if __name__ == "__main__":
    main()
