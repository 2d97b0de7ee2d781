"""What differs between the JAX versions osdp-jax supports (jax 0.10.2 through 0.12.x), read in one place.

Every internal detail that one JAX release names or lays out differently from another is read
through a function here, and nowhere else:

- :func:`scan_operand_counts`: how many of a ``scan`` equation's operands are constants and how many
  are the carry. jax 0.10 records ``num_consts``/``num_carry``; from 0.11 the equation carries a
  flat tree of its operands (``ft_in``), whose three parts are the constants, the carry and the
  per-iteration operands.
- :func:`supported_compile_options`: compiler options the running XLA knows. XLA removes options
  between releases (``xla_cpu_use_fusion_emitters`` is gone in jaxlib 0.11), and an option it does
  not know fails the compile (``INVALID_ARGUMENT: No such compile option``).
- :func:`supported_xla_flags`: the ``XLA_FLAGS`` entries the installed XLA accepts. An unknown flag
  aborts the process when the backend starts, so it is checked in a child process.

``tests/test_compat.py`` runs each of these on whatever JAX is installed, and CI runs the suite
on the oldest and the newest JAX the package supports.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp


def scan_operand_counts(params: dict) -> tuple[int, int]:
    """``(constants, carry)``: how many of a ``scan`` equation's operands, in order, are loop
    constants and how many are the loop's carry (the per-iteration operands, ``xs``, follow).

    Args:
      params: the equation's ``params`` (``eqn.params`` of a ``scan`` equation in a jaxpr).
    """
    if "num_consts" in params:  # jax 0.10
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = (list(part) for part in params["ft_in"].unpack())  # jax 0.11 and later
    return len(consts), len(carry)


@functools.lru_cache(maxsize=None)
def _option_known(platform: str, name: str, value) -> bool:
    """Whether XLA on ``platform`` compiles a one-op function with compiler option ``name=value``."""
    device = jax.devices(platform)[0]
    arg = jax.ShapeDtypeStruct((), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    try:
        jax.jit(lambda x: x + 1).lower(arg).compile(compiler_options={name: value})
    except jax.errors.JaxRuntimeError as error:
        if "No such compile option" in str(error):
            return False
        raise
    return True


def supported_compile_options(options: dict | None, platform: str) -> dict | None:
    """``options`` without the entries the running XLA does not know on ``platform`` (``"cpu"``,
    ``"gpu"``, ...). Each option is tried once per process, on a one-op compile. ``None`` and an
    empty dict come back as ``None``: a default compile."""
    kept = {name: value for name, value in (options or {}).items() if _option_known(platform, name, value)}
    return kept or None


def supported_xla_flags(flags: list[str]) -> list[str]:
    """The entries of ``flags`` (``--name=value`` strings) that the installed XLA accepts in
    ``XLA_FLAGS``. XLA aborts a process whose ``XLA_FLAGS`` holds a flag it does not know, so the
    flags are tried in a child process (about a second for a list that is accepted whole, and one
    child per flag otherwise). Call it before JAX starts its backend, for example in a
    ``conftest.py``."""
    def accepted(candidate: list[str]) -> bool:
        env = {**os.environ, "XLA_FLAGS": " ".join(candidate), "JAX_PLATFORMS": "cpu"}
        done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True, check=False)
        return done.returncode == 0

    if accepted(flags):
        return list(flags)
    return [flag for flag in flags if accepted([flag])]


def versions() -> str:
    """The versions a figure was measured on, as one line: ``"jax 0.12.0.1, jaxlib 0.12.0.1, flax
    0.12.12, optax 0.2.8, Python 3.13.0"``."""
    import platform
    from importlib.metadata import version
    names = ("jax", "jaxlib", "flax", "optax")
    return ", ".join(f"{name} {version(name)}" for name in names) + f", Python {platform.python_version()}"
