"""A training step of the user's own under a plan: ``osdp_jax.value_and_grad`` against
``jax.value_and_grad``, by XLA's per-device peak of that step.

For each model of ``tests/foreign.py`` below (unrolled linen and nnx residual MLPs of 6
``Dense(1024)`` blocks, an Equinox transformer), 8 simulated devices, Adam: plans at the budget
halfway between the model's DDP and FSDP peaks, places the arrays with ``osdp_jax.shard``, and
compiles the same user step (own ``jax.jit``, ``optimizer.update``, ``optax.apply_updates``,
parameters and optimizer state donated) once with each gradient function; runs each 5 steps and
compares the losses with one device's. Measured: XLA's peaks and the losses; predicted: the plan's
peak.

Run: python experiments/benchmarks/own_loop.py [--out experiments/results/own_loop.md]
"""
import argparse
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))

import foreign  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import toy  # noqa: E402

import osdp_jax  # noqa: E402
from osdp_jax.core.compat import versions  # noqa: E402

MODELS = {
    "linen residual MLP, 6 x Dense(1024), batch 64": lambda: foreign.residual_mlp(6, 1024, 64),
    "nnx residual MLP, 6 x Linear(1024), batch 64": lambda: foreign.nnx_residual_mlp(6, 1024, 64),
    "Equinox transformer, 4 blocks, d 256, batch 32": lambda: foreign.equinox_transformer(4, 256, 8, 32, 512, 32),
}


def run(params, loss_fn, batch, plan, mesh, opt, grad_fn) -> tuple[int, float]:
    """XLA's peak of the user's step on ``grad_fn`` and its largest relative loss error against
    one device over 5 steps."""
    s = osdp_jax.shardings(params, plan, mesh, opt, batch)
    sharded = osdp_jax.shard(params, mesh, plan)
    state = osdp_jax.init_opt_state(opt, sharded, plan, mesh)
    placed = jax.device_put(batch, s.batch)
    compiled = toy.own_step(grad_fn, opt, s).lower(sharded, state, placed).compile()
    losses = []
    for _ in range(5):
        sharded, state, loss = compiled(sharded, state, placed)
        losses.append(float(loss))
    expected, _ = toy.single_device_run(params, loss_fn, opt, batch, 5)
    return osdp_jax.profile_compiled(compiled).peak_bytes, float(np.max(np.abs(np.subtract(losses, expected))
                                                                        / np.abs(expected)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write the markdown table here")
    args = ap.parse_args()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    opt = optax.adam(1e-3)
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    rows = ["| model | DDP / FSDP peak (MiB) | budget (MiB) | plan: predicted (MiB) | own step on "
            "`osdp_jax.value_and_grad`: XLA peak (MiB, x budget) | own step on `jax.value_and_grad`: "
            "XLA peak (MiB, x budget) | loss vs one device, 5 steps (largest relative error) |",
            "|---|---|---|---|---|---|---|"]
    for name, make in MODELS.items():
        params, loss_fn, batch = make()
        ddp, fsdp = foreign.ddp_fsdp_peaks(params, loss_fn, batch, opt, mesh)
        plan = osdp_jax.plan(params, mesh, budget=(ddp + fsdp) // 2, loss_fn=loss_fn, batch=batch, optimizer=opt)
        ours, ours_err = run(params, loss_fn, batch, plan, mesh, opt, osdp_jax.value_and_grad(loss_fn, plan, mesh))
        plain, plain_err = run(params, loss_fn, batch, plan, mesh, opt, jax.value_and_grad(loss_fn))
        budget = plan.budget_bytes
        rows.append(f"| {name} | {mib(ddp)} / {mib(fsdp)} | {mib(budget)} | {mib(plan.predicted_peak_bytes)} | "
                    f"{mib(ours)} ({ours / budget:.2f}x) | {mib(plain)} ({plain / budget:.2f}x) | "
                    f"{max(ours_err, plain_err):.1e} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "Measured by `python experiments/benchmarks/own_loop.py` (8 simulated CPU devices, Adam; "
        f"{versions()}). The budget is halfway between the model's DDP and FSDP peaks; peaks are XLA's "
        "per-device figures of the user's own jitted step.", "", *rows, ""])
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
