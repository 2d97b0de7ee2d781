"""ZeRO-2 against replication and ZeRO-3, by XLA's figures, and the planner's prediction of it.

On 8 simulated CPU devices, Adam, for three models (a 2-layer MLP, the einsum LM of
``tests/foreign.py`` with 4 blocks, and gpt2-mini's layer stack):

1. argument and temp bytes per device of the compiled step with every shardable parameter
   replicated (DDP), zero2, and zero3 (FSDP): what the cost model's xi stands for;
2. the planner's all-zero2 plan, predicted against XLA's peak;
3. a plan over replicate, zero3 and zero2 at the budget halfway between the all-zero2 and
   all-replicate peaks: its strategies, predicted vs XLA peak, and predicted samples/s beside
   DDP's (the default hardware model of the mesh).

Writes experiments/results/zero2_memory.md. Compile-only: nothing is trained.

Run: python experiments/benchmarks/zero2_memory.py
"""
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import foreign  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
import toy  # noqa: E402

import osdp_jax  # noqa: E402
from osdp_jax import models  # noqa: E402
from osdp_jax.core.strategies import spec_for  # noqa: E402


def _models():
    module, cfg, _ = models.get("gpt2-mini")
    yield "mlp (2 layers)", foreign.plain_mlp()
    yield "einsum LM (4 blocks)", foreign.einsum_lm(layers=4)
    yield "residual MLP (6 blocks, LayerNorm)", foreign.residual_mlp(depth=6, width=128, batch=32)
    yield "gpt2-mini (stack)", (models.init_params(module, 16, seed=0), models.make_loss(module),
                                toy.lm_batch(cfg.vocab_size, 64, 16))


def main():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    opt = optax.adam(1e-3)
    kib = lambda b: f"{b / 1024:,.0f} KiB"  # noqa: E731
    layouts = ["| model | layout | arguments | temp | peak |", "|---|---|---|---|---|"]
    plans = ["| model | plan | strategies | predicted peak | XLA peak | error | predicted samples/s (DDP's) |",
             "|---|---|---|---|---|---|---|"]
    for name, (params, loss_fn, batch) in _models():
        in_loop, dense = osdp_jax.discover(loss_fn, params, batch)
        infos = osdp_jax.describe(params)
        ok = [i.path for i in infos if spec_for(i, "zero3", ("data",), 8, i.path in in_loop)]
        for label, layout in [("DDP", osdp_jax.Layout.ddp(params, mesh, in_loop=in_loop)),
                              ("all zero2", osdp_jax.Layout.from_specs(params, mesh, {}, in_loop=in_loop, zero2=ok)),
                              ("FSDP", osdp_jax.Layout.fsdp(params, mesh, in_loop=in_loop, dense=dense - in_loop))]:
            pr = osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, layout)
            layouts.append(f"| {name} | {label} | {kib(pr.argument_bytes)} | {kib(pr.temp_bytes)} "
                           f"| {kib(pr.peak_bytes)} |")
        kw = dict(loss_fn=loss_fn, batch=batch, optimizer=opt, splits=(1,), remat=("full",))
        zero2 = osdp_jax.plan(params, mesh, budget="10GB", strategies=("zero2",), **kw)
        ddp = osdp_jax.plan(params, mesh, budget="10GB", strategies=("replicate",), **kw)
        fsdp = osdp_jax.plan(params, mesh, budget="10GB", strategies=("zero3",), **kw)
        budget = (zero2.xla_peak_bytes + ddp.xla_peak_bytes) // 2
        low = (zero2.xla_peak_bytes + fsdp.xla_peak_bytes) // 2
        runs = [("all zero2", zero2),
                (f"mixed at {kib(budget)}",
                 osdp_jax.plan(params, mesh, budget=budget, strategies=("replicate", "zero3", "zero2"), **kw)),
                (f"replicate/zero2 at {kib(budget)}",
                 osdp_jax.plan(params, mesh, budget=budget, strategies=("replicate", "zero2"), **kw))]
        if low < zero2.xla_peak_bytes:
            runs.append((f"zero3/zero2 at {kib(low)}",
                         osdp_jax.plan(params, mesh, budget=low, strategies=("zero3", "zero2"), **kw)))
        for label, p in runs:
            err = (p.predicted_peak_bytes - p.xla_peak_bytes) / p.xla_peak_bytes
            plans.append(f"| {name} | {label} | {p.counts()} | {kib(p.predicted_peak_bytes)} | {kib(p.xla_peak_bytes)} "
                         f"| {100 * err:+.1f}% | {p.predicted_samples_per_second:,.0f} "
                         f"({ddp.predicted_samples_per_second:,.0f}) |")
    text = "\n".join(["# ZeRO-2 memory", "",
                      "Measured with `python experiments/benchmarks/zero2_memory.py` (compile-only, 8 simulated CPU "
                      "devices, Adam). Bytes per device from XLA's compiled step; predictions from the cost model.", "",
                      "## Compiled steps", "", *layouts, "", "## Plans", "", *plans, ""])
    out = ROOT / "experiments" / "results" / "zero2_memory.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
