"""Simulated devices on a CPU: the ``XLA_FLAGS`` a multi-device XLA:CPU mesh needs.

XLA:CPU simulates N devices in one process with ``--xla_force_host_platform_device_count=N``.
Their collectives meet in a rendezvous keyed by the execution and the collective's channel, and
JAX lowers every collective on one channel (``jax._src.interpreters.mlir.COLLECTIVE_CHANNEL_ID``).
Two collectives of one step that XLA:CPU's concurrency-optimised scheduler lets run at once (an
all-gather and a reduce-scatter of a mixed plan) then meet in one rendezvous: the step hangs and
aborts ("Termination timeout for `all gather RendezvousKey{...op_id=1}`", "Check failed: id <
num_threads" in ``rendezvous.h``) or returns NaN. XLA's sequential scheduler
(:data:`ORDERED_COLLECTIVES`) runs them one after another. It is read from ``XLA_FLAGS`` when the
backend starts, not per compile (as a compiler option it leaves the schedule unchanged), so it is
set with the device count, before JAX touches a device: :func:`simulate_cpu_devices` does both.
"""
from __future__ import annotations

import os
import warnings

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
ORDERED_COLLECTIVES = f"{SCHEDULER_FLAG}=false"


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA:CPU for ``n`` devices with their collectives in order (module docstring), by adding
    to ``XLA_FLAGS`` what it does not already hold. Call it before JAX touches a device; a
    device count already in ``XLA_FLAGS`` is kept. Raises ``RuntimeError`` once the backend has
    started (the flags would be read too late)."""
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("osdp_jax.simulate_cpu_devices must run before JAX touches a device (the backend "
                           "reads XLA_FLAGS when it starts): call it first thing, or set XLA_FLAGS="
                           f"'{DEVICE_COUNT_FLAG}={n} {ORDERED_COLLECTIVES}' in the environment")
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith(DEVICE_COUNT_FLAG) for f in flags):
        flags.append(f"{DEVICE_COUNT_FLAG}={n}")
    if not collectives_ordered():
        flags.append(ORDERED_COLLECTIVES)
    os.environ["XLA_FLAGS"] = " ".join(flags)


def collectives_ordered() -> bool:
    """Whether ``XLA_FLAGS`` sets XLA:CPU's scheduler (:data:`ORDERED_COLLECTIVES`, or its other value)."""
    return SCHEDULER_FLAG in os.environ.get("XLA_FLAGS", "")


_warned = []


def warn_if_collectives_may_race(mesh) -> None:
    """Warn once per process where ``mesh`` holds several XLA:CPU devices and ``XLA_FLAGS`` leaves
    XLA:CPU's scheduler free to run two collectives at once (module docstring)."""
    if _warned or mesh.devices.size < 2 or mesh.devices.flat[0].platform != "cpu" or collectives_ordered():
        return
    _warned.append(True)
    warnings.warn(f"this step runs collectives on {mesh.devices.size} simulated CPU devices, where XLA:CPU can run "
                  f"two of them at once in one rendezvous (a hang and an abort, or NaN). Set XLA_FLAGS='... "
                  f"{ORDERED_COLLECTIVES}' before JAX starts, or call osdp_jax.simulate_cpu_devices(n) first "
                  f"thing (the osdp-jax CLI does)", RuntimeWarning, stacklevel=3)
