"""Shardy against GSPMD for the planner's probe compiles: compile seconds and XLA's figures.

JAX lowers a step for Shardy (``jax_use_shardy_partitioner``, the default) or for XLA's older
GSPMD partitioner. An osdp-jax step is one ``jax.shard_map`` (the gradients) plus the optimizer
update around it, so neither partitioner has much to decide, but each still runs over the whole
module. This compiles each case's step as a probe (``osdp_jax.runtime.step`` with the probe
options, every cache cleared before each compile) under both, alternating ``--repeats`` times,
and reports the median compile seconds and whether XLA's memory figures (temp, argument, output,
alias bytes) and FLOPs are equal.

Cases: the three models of ``experiments/benchmarks/foreign.py`` under DDP and FSDP on 8 devices
(``--mesh 8``) or on a 2 x 4 mesh, and gpt2-48l-1536 (the paper config) at batch 8 under FSDP
and under OSDP's 24 GB draft (three layer segments).

Writes experiments/results/partitioner.md.

Run: python experiments/benchmarks/partitioner.py [--repeats 3]
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
from jax._src import config as jax_config  # noqa: E402  (the partitioner switch as a context manager)

import osdp_jax  # noqa: E402
from experiments import config, runner  # noqa: E402
from experiments.benchmarks import foreign  # noqa: E402
from osdp_jax.planning import clear_compiled  # noqa: E402
from osdp_jax.runtime import step  # noqa: E402

OUT = pathlib.Path("experiments/results/partitioner.md")


def probe(case, shardy: bool):
    """One probe compile of ``case`` (loss_fn, optimizer, params, batch, mesh, layout) with the
    partitioner chosen: (compile seconds, figures)."""
    clear_compiled()
    jax.clear_caches()
    with jax_config.use_shardy_partitioner(shardy):  # read at lowering and at compile: both here
        pending = step._prepare(*case, "probe", {})
        t0 = time.perf_counter()
        compiled = pending.lowered.compile(compiler_options=pending.options)
        seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return seconds, (m.temp_size_in_bytes, m.argument_size_in_bytes, m.output_size_in_bytes,
                     m.alias_size_in_bytes, float(cost.get("flops", 0.0)))


def cases():
    opt = optax.adam(1e-3)
    for name, make in foreign.FAMILIES.items():
        params, loss_fn, batch = make()
        for shape, axes in (((8,), ("data",)), ((2, 4), ("replica", "data"))):
            mesh = jax.make_mesh(shape, axes)
            for method, layout in (("DDP", osdp_jax.Layout.ddp(params, mesh)),
                                   ("FSDP", osdp_jax.Layout.fsdp(params, mesh))):
                yield f"{name}, {method}, mesh {'x'.join(map(str, shape))}", (loss_fn, opt, params, batch, mesh, layout)
    s = runner.setup(config.load("experiments/paper/gpt2_48l_1536.toml"))
    params, batch = s.abstract_params(), s.abstract_batch(8)
    in_loop = osdp_jax.discover(s.loss_fn, params, batch)[0]
    yield "gpt2-48l-1536 batch 8, FSDP", (s.loss_fn, s.optimizer, params, batch, s.mesh,
                                          osdp_jax.Layout.fsdp(params, s.mesh, in_loop=in_loop))
    osdp = [m for m in runner.methods(s) if m[0] == "OSDP"][0]
    draft = runner.make_plan(runner.at_budget(s, "24GB"), strategies=osdp[1], splits=osdp[2], remat=osdp[3],
                             per_layer=osdp[4], verify=False)
    yield (f"gpt2-48l-1536 batch {draft.batch_size}, OSDP's 24 GB draft ({runner.segments_text(draft)})",
           (s.loss_fn, s.optimizer, params, s.abstract_batch(draft.batch_size), s.mesh, draft))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for label, case in cases():
        times = {True: [], False: []}
        figures = {}
        for _ in range(args.repeats):
            for shardy in (True, False):
                seconds, figures[shardy] = probe(case, shardy)
                times[shardy].append(seconds)
        sh, gs = statistics.median(times[True]), statistics.median(times[False])
        diff = [b - a for a, b in zip(figures[True], figures[False])]
        rows.append((label, sh, gs, diff))
        print(f"{label}: Shardy {sh:.2f} s, GSPMD {gs:.2f} s ({gs / sh:.2f}); figures GSPMD - Shardy {diff}",
              flush=True)
    text = [
        "# Shardy against GSPMD for the probe compiles",
        "",
        f"Measured with `python experiments/benchmarks/partitioner.py --repeats {args.repeats}` on this "
        "machine, 8 simulated CPU devices: each step compiled as a probe (no LLVM optimisation, the "
        "older loop emitters), every cache cleared before each compile, Shardy and GSPMD alternating; "
        "median compile seconds (the trace and lowering not included). *Figures* gives XLA's GSPMD "
        "figures minus its Shardy figures (temp, argument, output and alias bytes, FLOPs), measured.",
        "",
        "| step | Shardy | GSPMD | GSPMD / Shardy | figures, GSPMD - Shardy |",
        "|---|---|---|---|---|",
    ]
    for label, sh, gs, diff in rows:
        same = "equal" if not any(diff) else (
            ", ".join(f"{n} {d:+,.0f}" for n, d in zip(("temp", "argument", "output", "alias", "FLOPs"), diff) if d))
        text.append(f"| {label} | {sh:.2f} s | {gs:.2f} s | {gs / sh:.2f} | {same} |")
    ratios = [gs / sh for _, sh, gs, _ in rows]
    text += ["", f"Median GSPMD / Shardy over the {len(rows)} steps: {statistics.median(ratios):.2f} "
             f"({min(ratios):.2f} to {max(ratios):.2f})."]
    OUT.write_text("\n".join(text) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
