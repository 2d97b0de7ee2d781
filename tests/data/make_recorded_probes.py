"""Record the planner's probe figures for tests/test_planner_stages.py and tests/test_layers.py
(run after a change to the train step: ``python tests/data/make_recorded_probes.py``). Compiles the
toy model's probes and an 8-layer stacked GPT-2's (remat probes included) on 8 simulated CPU
devices and writes tests/data/toy_probes.json and tests/data/stack_probes.json."""
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import optax  # noqa: E402
import toy  # noqa: E402

import osdp_jax  # noqa: E402
from osdp_jax import _calibration  # noqa: E402
from osdp_jax.planning import XlaCalibrator  # noqa: E402

OUT = pathlib.Path(__file__).with_name("toy_probes.json")
STACK_OUT = pathlib.Path(__file__).with_name("stack_probes.json")
BATCH_SIZES = (8, 16, 64)


def main():
    # every probe kind at both batch-size ends, so the figures serve the planner with and without
    # the cut of its remat and split probes to the largest size (tests/test_layers.py undoes it)
    _calibration.AT_TOP = frozenset()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params, opt = toy.plain_params(), optax.adam(1e-3)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    OUT.unlink(missing_ok=True)
    calibrator = XlaCalibrator(toy.plain_loss, opt, abstract, mesh, 16 * 2**30, record=OUT)
    for sizes in (BATCH_SIZES, (16,)):  # the probes run at the smallest and largest size
        osdp_jax.plan(params, mesh, budget="64GB", loss_fn=toy.plain_loss, batch=toy.tokens(32), optimizer=opt,
                      batch_sizes=sizes, calibrator=calibrator, verify=False)
    print(f"wrote {OUT}")
    _, params, loss_fn, batch = toy.stack_setup()
    STACK_OUT.unlink(missing_ok=True)
    calibrator = XlaCalibrator(loss_fn, opt, params, mesh, 16 * 2**30, record=STACK_OUT)
    osdp_jax.plan(params, mesh, budget="64GB", loss_fn=loss_fn, batch=batch, optimizer=opt,
                  batch_sizes=(16, 64), calibrator=calibrator, verify=False)
    print(f"wrote {STACK_OUT}")


if __name__ == "__main__":
    main()
