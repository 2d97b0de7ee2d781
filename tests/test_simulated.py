"""Simulated CPU devices: ``osdp_jax.simulate_cpu_devices`` sets the device count and XLA:CPU's
sequential scheduler before the backend starts, and a step on several CPU devices without the
latter warns (``osdp_jax.core.simulated``)."""
import os
import subprocess
import sys
import warnings

import optax
import pytest
import toy

import osdp_jax
from osdp_jax.core import simulated

SCRIPT = """
import os
os.environ.pop("XLA_FLAGS", None)
import osdp_jax
osdp_jax.simulate_cpu_devices(4)
import jax
print(len(jax.devices()))
print(os.environ["XLA_FLAGS"])
try:
    osdp_jax.simulate_cpu_devices(4)
except RuntimeError as e:
    print("again:", e)
"""


def test_simulate_cpu_devices_sets_the_count_and_orders_collectives_before_the_backend_starts():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == "4"
    assert out[1].split() == ["--xla_force_host_platform_device_count=4", simulated.ORDERED_COLLECTIVES]
    assert out[2].startswith("again: osdp_jax.simulate_cpu_devices must run before JAX touches a device")


def test_a_step_on_cpu_devices_whose_collectives_may_race_warns_once(mesh, monkeypatch):
    params = toy.plain_params()
    layout = osdp_jax.Layout.fsdp(params, mesh)
    monkeypatch.setattr(simulated, "_warned", [])
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.warns(RuntimeWarning, match="XLA_FLAGS='... --xla_cpu_enable_concurrency_optimized_scheduler=false'"):
        osdp_jax.make_train_step(toy.plain_loss, optax.sgd(0.1), layout, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        osdp_jax.value_and_grad(toy.plain_loss, layout, mesh)
    monkeypatch.setattr(simulated, "_warned", [])
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {simulated.ORDERED_COLLECTIVES}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ordered: no warning
        osdp_jax.make_train_step(toy.plain_loss, optax.sgd(0.1), layout, mesh)
