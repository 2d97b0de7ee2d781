"""Eight simulated CPU devices for every test (set before JAX touches a device).

No persistent XLA compilation cache: on XLA:CPU, executables loaded from it sometimes ran their
collectives in another execution's rendezvous (measured: 5 of 42 runs of the opt-mini segment test
in three parallel processes gave NaN losses or aborted with "Check failed: id < num_threads" in
rendezvous.h; 0 of 21 runs, and 0 of 60 in-process repeats, without the cache). Tests of the
cache itself (``plan.compilation_cache``) use their own directory.

XLA:CPU compiles with LLVM's optimisation off (``--xla_backend_optimization_level=0``): compiling
is what the suite spends its time on, and this cuts it by about a third (the 4-layer stack plans of
test_layers: 18.9 s -> 13.0 s). What the tests assert does not change with it: XLA's memory figures
come from buffer assignment on the HLO, before LLVM (the same peaks, byte for byte, at either
level), and equality claims compare runs compiled alike."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def mesh():
    """An 8-device data-parallel mesh in Auto mode."""
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


# The modules holding the longest tests (a plan with every probe, processes that plan and train)
# run first, so the two workers finish together instead of one running a long test at the end.
FIRST = ("test_distributed.py", "test_layers.py", "test_unit_calls.py", "test_cli.py", "test_plan.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST)
    items.sort(key=rank)  # stable: each module keeps its own order
