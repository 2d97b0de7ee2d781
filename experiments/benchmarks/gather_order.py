"""Where a weight gathered per step sits in the model changes XLA's peak: a measurement.

Four unrolled residual blocks of bias-free ``Dense(2048)``/``Dense(512)`` (d 512), batch 8, Adam,
on a 2x4 ``("data", "model")`` mesh of simulated CPU devices (both axes data-parallel). For each
set of blocks whose kernels are zero3 (gathered per step at their layer, the rest replicated),
XLA's peak bytes per device of the compiled train step. Then ``osdp_jax.plan`` at 10/20/30/55/80%
of the way from the FSDP peak to the DDP peak (the nominal CPU profile, each plan the model's first
in the process): the plan's predicted peak against XLA's.

Compile-only: nothing is trained. Writes experiments/results/gather_order.md.

Run: python experiments/benchmarks/gather_order.py [--no-plans]
"""
import argparse
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("OSDP_JAX_CPU_PROFILE", "nominal")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import osdp_jax  # noqa: E402
from osdp_jax.planner.calibration import clear_probe_cache  # noqa: E402

BLOCKS = 4
ZERO3_SETS = [(), (2, 3), (1, 2), (0, 3), (0, 1), (1, 2, 3), (0, 1, 2), (0, 1, 2, 3)]
SHARES = (0.1, 0.2, 0.3, 0.55, 0.8)
MIB = 2 ** 20


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(512, use_bias=False)(jax.nn.gelu(nn.Dense(2048, use_bias=False)(x)))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(BLOCKS):
            x = Block()(x)
        return x


def setup():
    """(params, loss_fn, batch, mesh, optimizer) of the measured model."""
    model = Net()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 512)), jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(p, b):
        return ((model.apply({"params": p}, b["x"]) - b["y"]) ** 2).mean()

    return params, loss_fn, {"x": x, "y": x}, jax.make_mesh((2, 4), ("data", "model")), optax.adam(1e-3)


def peak_with_zero3(blocks, params, loss_fn, batch, mesh, optimizer) -> float:
    """XLA's peak (MiB) with the kernels of ``blocks`` zero3 over both axes, the rest replicated."""
    specs = {f"Block_{b}/Dense_{d}/kernel": P(("data", "model")) for b in blocks for d in (0, 1)}
    layout = osdp_jax.Layout.from_specs(params, mesh, specs, dense=list(specs))
    return osdp_jax.profile_step(loss_fn, optimizer, params, batch, mesh, layout).peak_bytes / MIB


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-plans", action="store_true", help="only the table of hand-written layouts")
    args = parser.parse_args()
    params, loss_fn, batch, mesh, optimizer = setup()
    peaks = {z: peak_with_zero3(z, params, loss_fn, batch, mesh, optimizer) for z in ZERO3_SETS}
    lines = ["# Where a gathered weight sits changes the peak", "",
             f"Measured with `python experiments/benchmarks/gather_order.py` (jax {jax.__version__}), "
             "8 simulated CPU devices in a 2x4 `(\"data\", \"model\")` mesh, both axes data-parallel; "
             f"{BLOCKS} unrolled residual blocks of bias-free `Dense(2048)`/`Dense(512)`, batch 8, Adam. "
             "XLA's peak per device (measured, MiB) with the kernels of the blocks listed zero3, "
             "gathered per step at their layer, the rest replicated:", "",
             "| zero3 blocks | " + " | ".join(", ".join(map(str, z)) or "none" for z in ZERO3_SETS) + " |",
             "|---" * (len(ZERO3_SETS) + 1) + "|",
             "| XLA peak (MiB) | " + " | ".join(f"{peaks[z]:.2f}" for z in ZERO3_SETS) + " |"]
    if not args.no_plans:
        ddp, fsdp = peaks[()] * MIB, peaks[tuple(range(BLOCKS))] * MIB
        lines += ["", "`osdp_jax.plan` (nominal CPU profile) at a share of the way from the FSDP peak to "
                  "the DDP peak, each the model's first plan in the process: predicted against XLA's peak.", "",
                  "| budget share | zero3 kernels | predicted (MiB) | XLA (MiB) | error |", "|---|---|---|---|---|"]
        for share in SHARES:
            clear_probe_cache()
            plan = osdp_jax.plan(params, mesh, budget=int(fsdp + share * (ddp - fsdp)), loss_fn=loss_fn,
                                 batch=batch, optimizer=optimizer)
            zero3 = sorted(pp.path.removesuffix("/kernel") for pp in plan.params if pp.strategy == "zero3")
            lines.append(f"| {share:.0%} | {', '.join(zero3) or 'none'} | {plan.predicted_peak_bytes / MIB:.2f} | "
                         f"{plan.xla_peak_bytes / MIB:.2f} | "
                         f"{plan.predicted_peak_bytes / plan.xla_peak_bytes - 1:+.1%} |")
    text = "\n".join(lines) + "\n"
    out = ROOT / "experiments" / "results" / "gather_order.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
