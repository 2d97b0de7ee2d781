"""Eight simulated CPU devices for every test (set before JAX touches a device).

JAX's persistent compilation cache, in a home folder made for the test session, empty when it
starts (as on CI) and removed at its end: the workers and the CLI processes the tests start share
it, the CLI's default cache (``plan.compilation_cache``, under ``~``) included, so the suite
writes nothing under the user's home, and steps compiled again in a later test (the same probes
of a model, a plan planned again) are read back (README, *Two commands*: the suite's time with and
without it). The planner's probe store (``enable_compilation_cache(probes=True)``) stays off in the
test processes. Tests of the cache itself use their own directory.

The suite keeps XLA:CPU's default (concurrency-optimised) scheduler, whose memory figures its
tests assert. Under it, JAX's collectives (all on one channel) can meet in one rendezvous when two
run at once (``osdp_jax.core.simulated``): the gpt2-mini and opt-mini cases of
``test_layers.py``'s segment test aborted in most runs. Those run again in a child process with
the collectives in order (``toy.in_a_process_with_collectives_in_order``), where 10 of 10 passed.

XLA:CPU compiles with LLVM's optimisation off (``--xla_backend_optimization_level=0``): compiling
is what the suite spends its time on, and this cuts it by about a third (the 4-layer stack plans of
test_layers: 18.9 s -> 13.0 s). What the tests assert does not change with it: XLA's memory figures
come from buffer assignment on the HLO, before LLVM (the same peaks, byte for byte, at either
level), and equality claims compare runs compiled alike.

It also emits its kernels with XLA:CPU's older loop emitters (``--xla_cpu_use_fusion_emitters=false``),
as the planner's probes are (``runtime.step.PROBE_ONLY_CPU``): the newer emitters' MLIR pipeline is
most of a compile here (test_train, test_split and test_step: 97.6 s -> 55.9 s on two workers). The
memory figures then match the probes' exactly rather than within ``PROBE_TOLERANCE``, so the tests
that compare a probe with a default compile ask for the default emitters by name
(``test_plan.py::test_probes_compiled_for_their_figures_give_the_figures_of_a_full_compile``), and
one training test runs its steps with them (the ``default_emitters`` fixture,
``test_train.py::test_sharded_training_matches_single_device[plain]``).

And it compiles each step's LLVM module whole (``--xla_cpu_parallel_codegen_split_count=1``, as the
probes are): with two test workers on two cores, splitting a module for parallel codegen only added
work (``python -m pytest``, one after the other in one hour, each worker on one compile thread:
5 min 2 s without it, 4 min 31 s with it). Codegen comes after buffer assignment and does not
change what a step computes.

Each worker's planner keeps its default compile threads (the CPUs, 2 here): one each
(``OSDP_JAX_COMPILE_THREADS=1``) took the same time, 4 min 43 s both ways one after the other."""
import atexit
import os
import shutil
import tempfile

from osdp_jax.core.compat import supported_compile_options, supported_xla_flags  # imports jax, starts no backend

# The suite's XLA flags (module docstring); those the installed XLA does not know are left out, as
# XLA aborts a process on an unknown flag (jaxlib 0.11 and later have no older emitters).
TEST_XLA_FLAGS = ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
                  "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"]

if "OSDP_JAX_TEST_HOME" not in os.environ:  # pytest's own process: one home and flags, its workers inherit them
    os.environ["OSDP_JAX_TEST_HOME"] = tempfile.mkdtemp(prefix="osdp-jax-test-home-")
    atexit.register(shutil.rmtree, os.environ["OSDP_JAX_TEST_HOME"], True)
    os.environ["OSDP_JAX_TEST_XLA_FLAGS"] = " ".join(supported_xla_flags(TEST_XLA_FLAGS))
os.environ["HOME"] = os.environ["OSDP_JAX_TEST_HOME"]  # the CLI's default cache goes here
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + os.environ["OSDP_JAX_TEST_XLA_FLAGS"]).strip()
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
# plans on the CPU's nominal constants, as every test process and child must agree on them whatever
# the machine's load; tests/test_profile.py measures the default on its own
os.environ["OSDP_JAX_CPU_PROFILE"] = "nominal"

import jax  # noqa: E402
import pytest  # noqa: E402

import osdp_jax  # noqa: E402
from osdp_jax.cli.config import PlanConfig  # noqa: E402

# the CLI's default folder, under this home; probe figures kept in the process only, so that a
# test's compile counts do not depend on which tests planned the same probes before it
osdp_jax.enable_compilation_cache(PlanConfig.compilation_cache, probes=False)

jax.config.update("jax_num_cpu_devices", 8)

# the suite keeps XLA:CPU's default scheduler on purpose (module docstring): its steps do not warn
# about it (tests/test_simulated.py checks the warning)
from osdp_jax.core import simulated  # noqa: E402

simulated._warned.append(True)


@pytest.fixture(scope="session")
def mesh():
    """An 8-device data-parallel mesh in Auto mode."""
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.fixture(autouse=True)
def _no_probe_store():
    """No test leaves the probe store on for the next (``cli.main`` run in the test's process turns
    it on, as the CLI does; tests of the store turn it on themselves)."""
    from osdp_jax.planner import probe_store as _probe_store
    yield
    _probe_store.disable()


@pytest.fixture
def default_emitters(monkeypatch):
    """Steps compiled to run take XLA:CPU's default emitters (the fusion emitters), as a user's do,
    not the suite's older ones (module docstring)."""
    from osdp_jax.runtime import step
    step.clear_compiled()  # no step kept from an earlier test (compiled the suite's way) is reused
    options = step._options
    fusion = supported_compile_options({"xla_cpu_use_fusion_emitters": True}, "cpu")  # None: the only emitters
    monkeypatch.setattr(step, "_options", lambda purpose, mesh: fusion if purpose == "run" else options(purpose, mesh))


# The modules holding the longest tests (a plan with every probe, processes that plan and train)
# run first, so the two workers finish together instead of one running a long test at the end.
FIRST = ("test_distributed.py", "test_layers.py", "test_unit_calls.py", "test_cli.py", "test_plan.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST)
    items.sort(key=rank)  # stable: each module keeps its own order
