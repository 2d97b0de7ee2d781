"""Eight simulated CPU devices for every test (set before JAX touches a device), and one persistent
XLA compilation cache for the session: many tests compile the same steps (the planner's probes of
one model, a run and its resumed run), and the subprocesses they start inherit the cache.

XLA:CPU compiles with LLVM's optimisation off (``--xla_backend_optimization_level=0``): compiling
is what the suite spends its time on, and this cuts it by about a third (the 4-layer stack plans of
test_layers: 18.9 s -> 13.0 s). What the tests assert does not change with it: XLA's memory figures
come from buffer assignment on the HLO, before LLVM (the same peaks, byte for byte, at either
level), and equality claims compare runs compiled alike."""
import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
# one cache per xdist worker (a cache file is not written atomically for a concurrent reader)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(
    prefix=f"osdp-jax-tests-xla-cache-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def mesh():
    """An 8-device data-parallel mesh in Auto mode."""
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
